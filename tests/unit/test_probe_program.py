"""llamabundle-probe's contract (data/programs/llamabundle-probe.cpp, built into every bundle): its JSON schema
is draft 2020-12 with an `$id` and accepts what the program printed on the H200 (recorded in tests/data/h200)
and what `--drivers` prints (the GPU drivers asked directly), and refuses what it must (an outcome outside the
list, a device without its memory, a Vulkan device type that does not exist). The program itself runs in
tests/e2e (the CPU bundle, lavapipe, Wine; --drivers in test_probe_drivers.py)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from llamabundle import data
from llamabundle.build import OWN_PROGRAMS, PROBE_PROGRAM
from tests.unit.test_drivers import mutated

H200 = Path(__file__).resolve().parents[1] / "data" / "h200"


def schema() -> dict[str, Any]:
    got: dict[str, Any] = data.schema("llamabundle-probe")
    return got


def recorded(name: str) -> dict[str, Any]:
    got: dict[str, Any] = json.loads((H200 / name).read_text(encoding="utf-8"))
    return got


def test_the_schema_is_draft_2020_12_with_an_id() -> None:
    s = schema()
    jsonschema.Draft202012Validator.check_schema(s)
    assert s["$id"] == "urn:llamabundle:schema:llamabundle-probe"


@pytest.mark.parametrize("made", ["", "built-"])
def test_what_the_probe_printed_on_the_h200_is_valid_and_says_what_was_seen(made: str) -> None:
    """`probe-*`: the program built in a plain ggml tree; `probe-built-*`: the one in the bundle that `llamabundle
    build` made of the CUDA recipe there (bench/results/gpu-h200-probe/built-2026-12-04)."""
    got = recorded(f"probe-{made}cuda.json")
    jsonschema.validate(got, schema())
    cuda0 = got["devices"][0]
    assert (cuda0["name"], cuda0["description"], cuda0["backend"], cuda0["type"]) == ("CUDA0", "NVIDIA H200", "CUDA", "gpu")
    assert cuda0["device_id"] == "0000:00:06.0" and cuda0["compute_capability"] == "9.0"
    assert cuda0["memory_total"] >= cuda0["memory_free"] > 130 * 1024**3
    cuda = next(m for m in got["modules"] if m["backend"] == "cuda")
    assert cuda["loaded"] and any("compute capability 9.0" in line for line in cuda["log"])

    gone = recorded(f"probe-{made}no-libcudart.json")
    jsonschema.validate(gone, schema())
    cuda = next(m for m in gone["modules"] if m["backend"] == "cuda")
    assert (cuda["opened"], cuda["outcome"]) == (False, "not_opened")
    assert cuda["error"] == "libcudart.so.13: cannot open shared object file: No such file or directory"
    assert [d["name"] for d in gone["devices"]] == ["CPU"]


def test_on_the_h200_one_gpu_seen_by_cuda_and_vulkan_has_one_bus_id_and_pairs_once() -> None:
    from llamabundle.platforms import load
    from llamabundle.runtime.probe import pair_devices

    got = recorded("probe-cuda-vulkan.json")
    jsonschema.validate(got, schema())
    assert load.probe_problem(got) == ""
    gpus = [d for d in got["devices"] if d["type"] == "gpu"]
    assert [(d["name"], d["device_id"]) for d in gpus] == [("CUDA0", "0000:00:06.0"), ("Vulkan0", "0000:00:06.0")]
    lines = [load.device_line(d) for d in gpus]
    assert pair_devices(lines, {d["name"]: d["device_id"] for d in gpus}) == [
        {"name": "NVIDIA H200", "devices": ["CUDA0", "Vulkan0"], "bus_id": "0000:00:06.0"}]
    refused = recorded("probe-vulkan-refused.json")
    jsonschema.validate(refused, schema())
    vulkan = next(m for m in refused["modules"] if m["backend"] == "vulkan")
    assert (vulkan["opened"], vulkan["chosen"], vulkan["loaded"], vulkan["outcome"]) == (True, True, False, "refused")
    assert vulkan["log"] == ["load_backend: failed to initialize backend from BUNDLE/libggml-vulkan.so: "
                             "ggml_backend_init returned NULL"]


@pytest.mark.parametrize(("path", "value"), [
    (("modules", 0, "outcome"), "maybe"),
    (("modules", 0, "score"), "64"),
    (("devices", 0, "memory_total"), None),
    (("devices", 0, "type"), "GPU"),
    (("schema",), 2),
])
def test_the_schema_refuses_what_the_program_never_prints(path: tuple[Any, ...], value: Any) -> None:
    bad = copy.deepcopy(recorded("probe-cuda.json"))
    where = bad
    for key in path[:-1]:
        where = where[key]
    where[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema())


def test_every_bundle_builds_the_probe_linked_to_ggml_only() -> None:
    (probe,) = [p for p in OWN_PROGRAMS if p[0] == PROBE_PROGRAM]
    # no llama: it answers for the backends, and reads no model; Winsock on Windows for --rpc
    assert probe[2] == "ggml ${CMAKE_DL_LIBS} $<$<PLATFORM_ID:Windows>:ws2_32>"
    source = data.text(f"programs/{PROBE_PROGRAM}.cpp")
    assert "ggml_log_set(on_log" in source and "ggml_backend_load(" in source and '#include "llama.h"' not in source


# ------------------------------------------------------------------------------------ --drivers

# What `llamabundle-probe --drivers` printed here (tests/e2e/test_probe_drivers.py runs it): the fake NVIDIA driver
# of tests/data/fakecuda on LD_LIBRARY_PATH, and lavapipe as the one Vulkan device.
DRIVERS = """{
  "schema": 1,
  "program": "llamabundle-probe",
  "mode": "drivers",
  "drivers": {
    "cuda": {
      "library": "libcuda.so.1", "opened": true, "error": null, "path": "/tmp/fc/libcuda.so.1", "missing": [],
      "init": 0, "init_error": null, "driver_version": 12080, "cuda_version": "12.8", "device_count": 2,
      "devices": [
        {"index": 0, "name": "NVIDIA Fake H200", "compute_capability": "9.0", "device_id": "0000:00:06.0", "memory_total": 150754820096},
        {"index": 1, "name": "NVIDIA Fake A100", "compute_capability": "8.0", "device_id": "0001:c1:00.0", "memory_total": 85899345920}
      ],
      "problems": []
    },
    "vulkan": {
      "library": "libvulkan.so.1", "opened": true, "error": null, "path": "/lib/x86_64-linux-gnu/libvulkan.so.1", "missing": [],
      "create_instance": 0, "device_count": 1,
      "devices": [
        {"index": 0, "name": "llvmpipe (LLVM 15.0.6, 256 bits)", "type": "cpu", "api_version": "1.3.230", "vendor_id": 65541}
      ],
      "problems": []
    }
  }
}
"""
NO_LIBCUDA = {"library": "libcuda.so.1", "opened": False,
              "error": "libcuda.so.1: cannot open shared object file: No such file or directory", "path": None,
              "missing": [], "init": None, "init_error": None, "driver_version": None, "cuda_version": None,
              "device_count": None, "devices": [], "problems": []}


def drivers_answer() -> dict[str, Any]:
    got: dict[str, Any] = json.loads(DRIVERS)
    return got


def test_the_schema_accepts_what_drivers_prints() -> None:
    got = drivers_answer()
    jsonschema.validate(got, schema())
    not_opened = {**got, "drivers": {**got["drivers"], "cuda": NO_LIBCUDA}}
    jsonschema.validate(not_opened, schema())
    failed_init = copy.deepcopy(got)
    failed_init["drivers"]["cuda"].update(init=100, init_error="CUDA_ERROR_NO_DEVICE", device_count=None, devices=[])
    jsonschema.validate(failed_init, schema())


@pytest.mark.parametrize(("path", "value"), [
    (("drivers", "vulkan", "devices", 0, "type"), "gpu"),  # VkPhysicalDeviceType has 5 names, no other
    (("drivers", "vulkan", "devices", 0, "type"), 2),
    (("drivers", "vulkan", "devices", 0, "api_version"), ...),
    (("drivers", "vulkan", "create_instance"), ...),
    (("drivers", "vulkan", "problems"), ...),
    (("drivers", "cuda", "devices", 0, "memory_total"), ...),
    (("drivers", "cuda", "devices", 0, "device_id"), "0000:00:06"),
    (("drivers", "cuda", "devices", 0, "compute_capability"), "90"),
    (("drivers", "cuda", "devices", 0, "bus_id"), "0000:00:06.0"),  # a field the schema does not name
    (("drivers", "cuda", "cuda_version"), 12.8),
    (("drivers", "cuda", "init"), ...),
    (("drivers", "cuda", "error"), ...),
    (("drivers", "vulkan"), ...),
    (("drivers", "metal"), {}),
    (("mode",), "devices"),
    (("mode",), ...),  # then it is read as the default answer, which it is not either
    (("dir",), "/bundle"),
])
def test_the_schema_refuses_a_broken_drivers_answer(path: tuple[Any, ...], value: Any) -> None:
    bad = mutated(drivers_answer(), path, value)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema())


def test_a_default_answer_that_says_it_is_the_drivers_one_is_refused() -> None:
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**recorded("probe-cuda.json"), "mode": "drivers"}, schema())


def test_drivers_asks_the_drivers_by_name_without_their_headers() -> None:
    """--drivers opens the driver libraries by plain name (the system's, never a bundled copy), declares the
    few functions and structs it calls itself, and ends without exit handlers once it printed its answer."""
    source = data.text(f"programs/{PROBE_PROGRAM}.cpp")
    assert '"libcuda.so.1"' in source and '"nvcuda.dll"' in source
    assert '"libvulkan.so.1"' in source and '"vulkan-1.dll"' in source
    assert "LOAD_LIBRARY_SEARCH_SYSTEM32" in source  # Windows: from System32, not beside the program
    assert "#include <cuda" not in source and "#include <vulkan" not in source and '#include "vulkan' not in source
    assert "MAX_DRIVER_DEVICES = 64" in source and '"--drivers"' in source and "std::_Exit(0)" in source
