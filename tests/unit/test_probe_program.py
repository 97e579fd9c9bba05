"""llamabundle-probe's contract (data/programs/llamabundle-probe.cpp, built into every bundle): its JSON schema
is draft 2020-12 with an `$id` and accepts what the program printed on the H200 (recorded in tests/data/h200),
and refuses what it must (an outcome outside the list, a device without its memory). The program itself runs
in tests/e2e (the CPU bundle, lavapipe, Wine)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from llamabundle import data
from llamabundle.build import OWN_PROGRAMS, PROBE_PROGRAM

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
    assert probe[2] == "ggml ${CMAKE_DL_LIBS}"  # no llama: it answers for the backends, and reads no model
    source = data.text(f"programs/{PROBE_PROGRAM}.cpp")
    assert "ggml_log_set(on_log" in source and "ggml_backend_load(" in source and '#include "llama.h"' not in source
