"""The load check of a bundle that carries llamabundle-probe (platforms/load.py): the probe's JSON gives the
backends loaded and where from, each module's outcome or the loader's message, the devices with their bus ids
and compute capabilities (a stand-in probe here prints what the real one printed on the H200, with the bundle's
directory); llama-server then runs once and must list the same devices. A damaged answer, a CPU backend that
did not load and a disagreement are clear errors; a bundle without the probe is read from llama-server's lines,
as before. The hand-written check of the answer agrees with the committed JSON schema."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from llamabundle import data
from llamabundle.errors import VerifyError
from llamabundle.platforms import load
from llamabundle.runtime.probe import pair_devices

H200 = Path(__file__).resolve().parents[1] / "data" / "h200"
SERVER = """#!/bin/sh
echo "load_backend: loaded CPU backend from $(dirname "$0")/libggml-cpu.so" >&2
echo "Available devices:"
{devices}
"""


def recorded(name: str = "probe-cuda.json") -> dict[str, Any]:
    got: dict[str, Any] = json.loads((H200 / name).read_text(encoding="utf-8"))
    return got


def bundle(tmp: Path, said: dict[str, Any] | str | None, devices: tuple[str, ...] = ("CUDA0: NVIDIA H200",)) -> Path:
    root = tmp / "bundle"
    root.mkdir()
    server = root / "llama-server"
    server.write_text(SERVER.format(devices="\n".join(f'echo "  {d} (143155 MiB, 142629 MiB free)"' for d in devices)))
    server.chmod(0o755)
    if said is not None:
        text = said if isinstance(said, str) else json.dumps(said).replace("BUNDLE", str(root))
        (root / "answer.json").write_text(text)
        probe = root / "llamabundle-probe"
        probe.write_text('#!/bin/sh\nexec cat "$(dirname "$0")/answer.json"\n')
        probe.chmod(0o755)
    return root


def test_the_probes_answer_is_what_the_load_check_reads(tmp_path: Path) -> None:
    root = bundle(tmp_path, recorded())
    got = load.run_list_devices(root, exe_name="llama-server")
    assert got.source == "llamabundle-probe" and got.level == "passed"
    assert got.backends == {"CUDA": str(root / "libggml-cuda.so"), "CPU": str(root / "libggml-cpu.so")}
    assert got.devices == ["CUDA0: NVIDIA H200 (143155 MiB, 142629 MiB free)"]  # no CPU device, as llama-server lists
    assert got.compute_caps == {"CUDA0": "9.0"} and got.device_ids == {"CUDA0": "0000:00:06.0"}
    assert got.modules == {"libggml-cuda.so": "loaded", "libggml-cpu.so": "loaded"}


def test_a_module_that_did_not_open_keeps_the_loaders_words(tmp_path: Path) -> None:
    root = bundle(tmp_path, recorded("probe-no-libcudart.json"), devices=())
    got = load.run_list_devices(root, exe_name="llama-server")
    assert got.modules["libggml-cuda.so"] == "libcudart.so.13: cannot open shared object file: No such file or directory"
    assert set(got.backends) == {"CPU"} and got.devices == []


def test_a_cpu_variant_that_does_not_open_fails_the_check_though_another_loaded(tmp_path: Path) -> None:
    """A damaged best variant must not pass because a lesser one loaded instead (a variant whose features this CPU
    lacks still opens: not_opened is damage, not this CPU)."""
    said = recorded()
    said["modules"].append({**next(m for m in said["modules"] if m["file"] == "libggml-cpu.so"),
                            "file": "libggml-cpu-armv9.2_2.so", "opened": False, "loaded": False, "chosen": False,
                            "registered": None, "score": None, "outcome": "not_opened",
                            "error": "libggml-cpu-armv9.2_2.so: file too short"})
    root = bundle(tmp_path, said)
    with pytest.raises(VerifyError) as e:
        load.run_list_devices(root, exe_name="llama-server")
    assert e.value.what == "the CPU backend libggml-cpu-armv9.2_2.so of the bundle does not load"
    assert e.value.why == "libggml-cpu-armv9.2_2.so: file too short"


def test_llama_server_must_list_the_devices_the_probe_found(tmp_path: Path) -> None:
    root = bundle(tmp_path, recorded(), devices=())
    with pytest.raises(VerifyError) as e:
        load.run_list_devices(root, exe_name="llama-server")
    assert "listed other devices than llamabundle-probe" in e.value.what
    assert e.value.why == "llama-server: none; the probe: CUDA0"


@pytest.mark.parametrize(("answer", "said"), [
    ("not json at all", "printed no JSON"),
    ('{"schema": 2}', "not a llamabundle-probe answer of schema 1"),
    ("MODULE-OUTCOME", "modules[0].outcome is 'maybe'"),
    ("DEVICE-MEMORY", "devices[0].memory_total is '1'"),
])
def test_a_damaged_answer_is_refused_naming_what_is_wrong(tmp_path: Path, answer: str, said: str) -> None:
    if answer == "MODULE-OUTCOME":
        bad = recorded()
        bad["modules"][0]["outcome"] = "maybe"
        answer = json.dumps(bad)
    elif answer == "DEVICE-MEMORY":
        bad = recorded()
        bad["devices"][0]["memory_total"] = "1"
        answer = json.dumps(bad)
    root = bundle(tmp_path, answer)
    with pytest.raises(VerifyError) as e:
        load.run_list_devices(root, exe_name="llama-server")
    assert said in e.value.what + " " + e.value.why and "rebuild the bundle" in e.value.fix


def test_no_cpu_backend_says_why_per_variant_from_the_probe(tmp_path: Path) -> None:
    said = recorded("probe-no-libcudart.json")
    said["modules"] = [{"file": "libggml-cpu-haswell.so", "backend": "cpu", "variant": "haswell", "opened": True,
                        "error": None, "score": 0, "chosen": False, "loaded": False, "outcome": "unsupported",
                        "registered": None, "log": []},
                       {"file": "libggml-cpu-x64.so", "backend": "cpu", "variant": "x64", "opened": False,
                        "error": "libgomp.so.1: cannot open shared object file: No such file or directory", "score": None,
                        "chosen": False, "loaded": False, "outcome": "not_opened", "registered": None, "log": []}]
    said["devices"] = []
    root = bundle(tmp_path, said, devices=())
    with pytest.raises(VerifyError) as e:
        load.run_list_devices(root, exe_name="llama-server")
    assert e.value.what == "llama-server did not load a CPU backend"
    assert e.value.why == ("loaded one by one: libggml-cpu-haswell.so: unsupported; libggml-cpu-x64.so: "
                           "libgomp.so.1: cannot open shared object file: No such file or directory")


def test_a_bundle_without_the_probe_is_read_from_llama_servers_lines(tmp_path: Path) -> None:
    root = bundle(tmp_path, None)
    got = load.run_list_devices(root, exe_name="llama-server")
    assert got.source == "llama-server --verbose --list-devices" and got.modules == {} and got.device_ids == {}
    assert got.backends == {"CPU": str(root / "libggml-cpu.so")} and got.devices == [
        "CUDA0: NVIDIA H200 (143155 MiB, 142629 MiB free)"]


@pytest.mark.parametrize(("path", "value"), [
    (("modules", 0, "outcome"), "maybe"), (("modules", 0, "loaded"), 1), (("modules", 0, "score"), True),
    (("devices", 0, "memory_free"), None), (("devices", 0, "device_id"), 7), (("log", 0, "text"), None),
    (("dir",), None), (("program",), "llama-server"),
])
def test_the_hand_written_check_agrees_with_the_schema(path: tuple[Any, ...], value: Any) -> None:
    schema = data.schema("llamabundle-probe")
    good = recorded()
    assert load.probe_problem(good) == "" and jsonschema.Draft202012Validator(schema).is_valid(good)
    bad = copy.deepcopy(good)
    where = bad
    for key in path[:-1]:
        where = where[key]
    where[path[-1]] = value
    assert load.probe_problem(bad) != "" and not jsonschema.Draft202012Validator(schema).is_valid(bad)


def test_a_cuda_and_a_vulkan_device_with_one_bus_id_are_one_gpu() -> None:
    devices = ["CUDA0: NVIDIA H200 (143155 MiB, 142629 MiB free)", "Vulkan0: NVIDIA H200 (143155 MiB, 143155 MiB free)",
               "Vulkan1: NVIDIA H200 (143155 MiB, 143155 MiB free)"]
    ids = {"CUDA0": "0000:00:06.0", "Vulkan0": "0000:00:07.0", "Vulkan1": "0000:00:06.0"}
    assert pair_devices(devices, ids) == [{"name": "NVIDIA H200", "devices": ["CUDA0", "Vulkan1"], "bus_id": "0000:00:06.0"},
                                          {"name": "NVIDIA H200", "devices": ["Vulkan0"], "bus_id": "0000:00:07.0"}]
    assert pair_devices(devices[:2]) == [{"name": "NVIDIA H200", "devices": ["CUDA0", "Vulkan0"]}]  # by name, in order


def test_the_probe_and_llama_server_run_at_the_same_time(tmp_path: Path) -> None:
    """Each waits until the other has started (a file each writes, then looks for): run one after the other, the
    first would wait for ever and the check would fail on its timeout."""
    root = bundle(tmp_path, recorded())
    meet = 'touch "$(dirname "$0")/{me}.up"; i=0; while [ ! -f "$(dirname "$0")/{other}.up" ]; do ' \
           'i=$((i+1)); [ $i -gt 200 ] && {{ echo "{me} waited alone" >&2; exit 9; }}; sleep 0.05; done\n'
    for exe, me, other in (("llama-server", "server", "probe"), ("llamabundle-probe", "probe", "server")):
        text = (root / exe).read_text()
        (root / exe).write_text(text.replace("\n", "\n" + meet.format(me=me, other=other), 1))
    got = load.run_list_devices(root, exe_name="llama-server")
    assert got.level == "passed" and got.devices == ["CUDA0: NVIDIA H200 (143155 MiB, 142629 MiB free)"]


def test_where_both_fail_the_probes_failure_is_the_one_said(tmp_path: Path) -> None:
    root = bundle(tmp_path, recorded())
    (root / "llama-server").write_text("#!/bin/sh\necho 'server broke' >&2\nexit 4\n")
    (root / "llamabundle-probe").write_text("#!/bin/sh\necho 'probe broke' >&2\nexit 5\n")
    with pytest.raises(VerifyError) as e:
        load.run_list_devices(root, exe_name="llama-server")
    assert e.value.what == "llamabundle-probe exited with 5" and "probe broke" in (e.value.details or "")
    (root / "llamabundle-probe").write_text('#!/bin/sh\nexec cat "$(dirname "$0")/answer.json"\n')
    with pytest.raises(VerifyError) as e:
        load.run_list_devices(root, exe_name="llama-server")
    assert e.value.what == "llama-server --list-devices exited with 4" and "server broke" in (e.value.details or "")
