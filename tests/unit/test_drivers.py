"""runtime/drivers.py: what a bundle's `llamabundle-probe --drivers` said, read as untrusted input. Hermetic: the
answers are JSON text written here (as the program prints them on the fake NVIDIA driver and lavapipe, see
tests/e2e/test_probe_drivers.py for the program itself), and the "program" run by `query` is a small Python
script that prints garbage, too much, fails, crashes or hangs with a child."""

from __future__ import annotations

import copy
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from llamabundle import data
from llamabundle.errors import LlamaBundleError, VerifyError
from llamabundle.runtime import drivers
from llamabundle.runtime.drivers import CudaDevice, DriversError, VulkanDevice
from llamabundle.scratch import start_time

H200 = {"index": 0, "name": "NVIDIA Fake H200", "compute_capability": "9.0", "device_id": "0000:00:06.0",
        "memory_total": 143771 << 20}
A100 = {"index": 1, "name": "NVIDIA Fake A100", "compute_capability": "8.0", "device_id": "0001:c1:00.0",
        "memory_total": 80 << 30}
LLVMPIPE = {"index": 0, "name": "llvmpipe (LLVM 15.0.6, 256 bits)", "type": "cpu", "api_version": "1.3.230",
            "vendor_id": 65541}
NOT_FOUND = "libcuda.so.1: cannot open shared object file: No such file or directory"


def cuda(**given: Any) -> dict[str, Any]:
    """The cuda object of an answer: the fake driver's two devices unless `given` says otherwise."""
    return {"library": "libcuda.so.1", "opened": True, "error": None, "path": "/fake/libcuda.so.1", "missing": [],
            "init": 0, "init_error": None, "driver_version": 12080, "cuda_version": "12.8", "device_count": 2,
            "devices": [H200, A100], "problems": [], **given}


def vulkan(**given: Any) -> dict[str, Any]:
    return {"library": "libvulkan.so.1", "opened": True, "error": None, "path": "/lib/x86_64-linux-gnu/libvulkan.so.1",
            "missing": [], "create_instance": 0, "device_count": 1, "devices": [LLVMPIPE], "problems": [], **given}


NO_CUDA = cuda(opened=False, error=NOT_FOUND, path=None, init=None, driver_version=None, cuda_version=None,
               device_count=None, devices=[])


def answer(cuda_said: dict[str, Any] | None = None, vulkan_said: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"schema": 1, "program": "llamabundle-probe", "mode": "drivers",
            "drivers": {"cuda": cuda() if cuda_said is None else cuda_said,
                        "vulkan": vulkan() if vulkan_said is None else vulkan_said}}


def valid(said: Any) -> bool:
    return bool(jsonschema.Draft202012Validator(data.schema("llamabundle-probe")).is_valid(said))


# ------------------------------------------------------------------------------------ reading an answer


def test_the_fake_drivers_answer_reads_as_its_devices() -> None:
    got = drivers.parse(json.dumps(answer()))
    assert got.cuda_driver_version == "12.8" and got.cuda_init == 0 and got.cuda_init_error is None
    assert got.cuda_devices == (
        CudaDevice(index=0, name="NVIDIA Fake H200", compute_capability="9.0", bus_id="0000:00:06.0",
                   memory_total=150754820096),
        CudaDevice(index=1, name="NVIDIA Fake A100", compute_capability="8.0", bus_id="0001:c1:00.0",
                   memory_total=85899345920))
    assert got.vulkan_devices == (VulkanDevice(index=0, name="llvmpipe (LLVM 15.0.6, 256 bits)", type="cpu",
                                               api_version="1.3.230", vendor_id=65541),)
    assert got.cuda_not_opened is None and got.vulkan_not_opened is None
    assert got.cuda.path == "/fake/libcuda.so.1" and got.vulkan.library == "libvulkan.so.1"
    # lavapipe is a CPU implementation: CUDA has devices here, Vulkan none ggml-vulkan would take
    assert got.gpu_backends == ("cuda",)
    assert got.why_not("cuda") == ""
    assert got.why_not("vulkan") == "the Vulkan loader lists only CPU implementations: llvmpipe (LLVM 15.0.6, 256 bits)"


def test_a_library_that_did_not_open_gives_the_loaders_message() -> None:
    got = drivers.parse(json.dumps(answer(NO_CUDA, vulkan(opened=False, error="libvulkan.so.1: cannot open shared "
                                                          "object file: No such file or directory", path=None,
                                                          create_instance=None, device_count=None, devices=[]))))
    assert got.cuda_not_opened == NOT_FOUND and got.cuda_devices == () and got.cuda_driver_version is None
    assert got.vulkan_not_opened == "libvulkan.so.1: cannot open shared object file: No such file or directory"
    assert got.gpu_backends == ()
    assert got.why_not("cuda") == f"libcuda.so.1 did not open: {NOT_FOUND}"
    assert got.why_not("vulkan").startswith("libvulkan.so.1 did not open: libvulkan.so.1: cannot open")


@pytest.mark.parametrize(("given", "why"), [
    ({"init": 100, "init_error": "CUDA_ERROR_NO_DEVICE", "device_count": None, "devices": []},
     "cuInit returned 100 (CUDA_ERROR_NO_DEVICE)"),
    ({"init": 999, "init_error": None, "device_count": None, "devices": []}, "cuInit returned 999"),
    ({"init": None, "missing": ["cuInit"], "device_count": None, "devices": []}, "libcuda.so.1 lacks cuInit"),
    ({"device_count": 0, "devices": []}, "the NVIDIA driver lists no device"),
    ({"device_count": None, "devices": [], "problems": ["cuDeviceGetCount returned 999 (CUDA_ERROR_UNKNOWN)"]},
     "the NVIDIA driver lists no device (cuDeviceGetCount returned 999 (CUDA_ERROR_UNKNOWN))"),
])
def test_why_cuda_has_no_device_says_which_step_failed(given: dict[str, Any], why: str) -> None:
    got = drivers.parse(json.dumps(answer(cuda(**given))))
    assert got.why_not("cuda") == why and "cuda" not in got.gpu_backends


@pytest.mark.parametrize(("given", "backends", "why"), [
    ({"devices": [{**LLVMPIPE, "name": "NVIDIA H200", "type": "discrete_gpu", "vendor_id": 4318}]}, ("cuda", "vulkan"), ""),
    ({"devices": [LLVMPIPE, {**LLVMPIPE, "index": 1, "type": "integrated_gpu"}]}, ("cuda", "vulkan"), ""),
    ({"create_instance": -9, "device_count": None, "devices": []}, ("cuda",),
     "vkCreateInstance returned -9 (VK_ERROR_INCOMPATIBLE_DRIVER: no Vulkan driver)"),
    ({"device_count": 0, "devices": []}, ("cuda",), "the Vulkan loader lists no device"),
])
def test_vulkan_counts_a_device_that_is_not_a_cpu(given: dict[str, Any], backends: tuple[str, ...], why: str) -> None:
    got = drivers.parse(json.dumps(answer(vulkan_said=vulkan(**given))))
    assert got.gpu_backends == backends and got.why_not("vulkan") == why


def test_a_name_with_quotes_control_characters_and_replaced_bytes_reads_as_it_was_given() -> None:
    name = 'Fake "q"\n\ufffd G\x01'
    text = json.dumps(answer(cuda(devices=[{**H200, "name": name}])))
    assert drivers.parse(text).cuda_devices[0].name == name
    assert drivers.parse(text.encode()).cuda_devices[0].name == name  # bytes as they came


# ------------------------------------------------------------------------------------ what is refused

MUTATIONS: list[tuple[tuple[Any, ...], Any]] = [
    (("drivers", "vulkan", "devices", 0, "type"), "gpu"),
    (("drivers", "vulkan", "devices", 0, "type"), 4),
    (("drivers", "vulkan", "devices", 0, "api_version"), "1.3"),
    (("drivers", "vulkan", "devices", 0, "vendor_id"), -1),
    (("drivers", "vulkan", "devices", 0, "vendor_id"), True),
    (("drivers", "vulkan", "create_instance"), "0"),
    (("drivers", "vulkan", "create_instance"), ...),
    (("drivers", "vulkan", "devices", 0, "extra"), 1),
    (("drivers", "cuda", "devices", 0, "memory_total"), ...),
    (("drivers", "cuda", "devices", 0, "memory_total"), -1),
    (("drivers", "cuda", "devices", 0, "memory_total"), 1.5),
    (("drivers", "cuda", "devices", 1, "device_id"), "0001:C1:00.0"),
    (("drivers", "cuda", "devices", 0, "compute_capability"), "sm_90"),
    (("drivers", "cuda", "devices", 0, "index"), -1),
    (("drivers", "cuda", "devices", 0), "CUDA0"),
    (("drivers", "cuda", "cuda_version"), "12"),
    (("drivers", "cuda", "init"), False),
    (("drivers", "cuda", "missing"), [1]),
    (("drivers", "cuda", "problems"), "none"),
    (("drivers", "cuda", "opened"), "yes"),
    (("drivers", "cuda", "library"), ...),
    (("drivers", "cuda", "devices"), [H200] * 65),
    (("drivers", "cuda"), ...),
    (("drivers", "gpu"), {}),
    (("mode",), "backends"),
    (("mode",), ...),
    (("schema",), 2),
    (("program",), "llama-server"),
    (("dir",), "/bundle"),
]


def mutated(given: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    """A copy of the answer `given` with the field at `path` set to `value` (... removes it)."""
    bad = copy.deepcopy(given)
    where: Any = bad
    for key in path[:-1]:
        where = where[key]
    if value is ...:
        del where[path[-1]]
    else:
        where[path[-1]] = value
    return bad


def test_what_is_read_is_what_the_schema_accepts() -> None:
    for good in (answer(), answer(NO_CUDA), answer(cuda(devices=[{**H200, "name": None, "compute_capability": None,
                                                                   "device_id": None, "memory_total": None}]))):
        assert valid(good) and drivers.problem(good) == ""


@pytest.mark.parametrize(("path", "value"), MUTATIONS)
def test_the_hand_written_check_agrees_with_the_schema(path: tuple[Any, ...], value: Any) -> None:
    bad = mutated(answer(), path, value)
    assert not valid(bad)
    assert drivers.problem(bad) != ""
    with pytest.raises(DriversError) as e:
        drivers.parse(json.dumps(bad))
    assert e.value.what == "llamabundle-probe --drivers printed an answer llamabundle cannot read"
    assert e.value.why == drivers.problem(bad) and e.value.fix == drivers.FIX


def test_a_refusal_names_the_field() -> None:
    assert drivers.problem(mutated(answer(), ("drivers", "vulkan", "devices", 0, "type"), "gpu")) == \
        "drivers.vulkan.devices[0].type is 'gpu'"
    assert drivers.problem(mutated(answer(), ("drivers", "cuda", "devices", 0, "memory_total"), ...)) == \
        "drivers.cuda.devices[0].memory_total is missing"
    assert drivers.problem(mutated(answer(), ("mode",), ...)) == "not the answer to --drivers (mode is 'missing')"


def test_the_default_answer_of_the_program_is_not_a_drivers_answer() -> None:
    recorded = json.loads((Path(__file__).resolve().parents[1] / "data" / "h200" / "probe-cuda.json").read_text())
    assert valid(recorded)  # the schema's other branch
    assert drivers.problem(recorded) == "not the answer to --drivers (mode is 'missing')"
    assert not valid({**recorded, "mode": "drivers"})


@pytest.mark.parametrize(("text", "why"), [
    (b"", "Expecting value: line 1 column 1 (char 0)"),
    (b"Segmentation fault\n", "Expecting value: line 1 column 1 (char 0)"),
    (b'{"schema": 1} trailing', "Extra data: line 1 column 15 (char 14)"),
    (b"\xff\xfe{}", "'utf-8' codec can't decode byte 0xff in position 0: invalid start byte"),
    (b"[" * 9 + b"]" * 9, "nested deeper than 8 levels"),
    (b" " * (drivers.MAX_OUTPUT + 1), f"larger than 1 MiB ({drivers.MAX_OUTPUT + 1} bytes)"),
])
def test_garbage_is_no_json_with_a_preview(text: bytes, why: str) -> None:
    with pytest.raises(DriversError) as e:
        drivers.parse(text)
    assert e.value.what == "llamabundle-probe --drivers printed no JSON" and e.value.why == why
    assert e.value.details.startswith("it printed '")
    assert isinstance(e.value, VerifyError) and isinstance(e.value, LlamaBundleError)


@pytest.mark.parametrize(("said", "why"), [
    ([], "not a llamabundle-probe answer"),
    ("drivers", "not a llamabundle-probe answer"),
    (None, "not a llamabundle-probe answer"),
    ({"program": "llamabundle-probe", "mode": "drivers", "schema": 1}, "the answer.drivers is missing"),
    ({**answer(), "schema": True}, "the answer.schema is True"),
])
def test_a_json_value_that_is_not_the_answer_is_refused(said: Any, why: str) -> None:
    with pytest.raises(DriversError) as e:
        drivers.parse(json.dumps(said))
    assert e.value.why == why


def test_why_not_knows_only_the_gpu_backends() -> None:
    with pytest.raises(ValueError, match="'cpu'"):
        drivers.parse(json.dumps(answer())).why_not("cpu")


# ------------------------------------------------------------------------------------ running the program


def program(tmp_path: Path, body: str) -> Path:
    """An executable Python script standing in for llamabundle-probe (the Python running these tests)."""
    exe = tmp_path / "bundle" / "llamabundle-probe"
    exe.parent.mkdir(parents=True, exist_ok=True)
    exe.write_text(f"#!{sys.executable}\nimport json, os, sys, time\n{body}\n", encoding="utf-8")
    exe.chmod(0o755)
    return exe


def test_query_runs_the_program_with_drivers_in_a_clean_environment(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The script answers with the arguments and environment it was given, in cuda's error and problems."""
    said = answer(NO_CUDA)
    exe = program(tmp_path, f"said = {said!r}\n"
                            "said['drivers']['cuda']['error'] = ' '.join(sys.argv[1:])\n"
                            "said['drivers']['cuda']['problems'] = sorted(f'{k}={v}' for k, v in os.environ.items())\n"
                            "print(json.dumps(said))")
    monkeypatch.setenv("LLAMABUNDLE_TEST_LEAK", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.setenv("VK_ICD_FILENAMES", "/icd.json")
    got = drivers.query(exe)
    assert got.cuda_not_opened == "--drivers"
    env = dict(line.split("=", 1) for line in got.cuda.problems)
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["VK_ICD_FILENAMES"] == "/icd.json"  # DRIVER_ENV, kept
    assert "LLAMABUNDLE_TEST_LEAK" not in env and env["PATH"] == "/usr/bin:/bin" and env["HOME"] == str(exe.parent)
    given = drivers.query(exe, env={"LD_LIBRARY_PATH": "/fake"})  # what the caller names, and only that
    env = dict(line.split("=", 1) for line in given.cuda.problems)
    assert env["LD_LIBRARY_PATH"] == "/fake" and "CUDA_VISIBLE_DEVICES" not in env


@pytest.mark.parametrize(("body", "what", "why"), [
    ("print('hello')", "printed no JSON", "Expecting value: line 1 column 1 (char 0)"),
    ("sys.stdout.write(' ' * (2 << 20))", "printed no JSON", "larger than 1 MiB (2097152 bytes)"),
    ("print(json.dumps({'schema': 1, 'program': 'llamabundle-probe', 'dir': '/x', 'modules': [], 'devices': [], 'log': []}))",
     "printed an answer llamabundle cannot read", "not the answer to --drivers (mode is 'missing')"),
])
def test_a_program_that_prints_something_else_is_a_clear_error(tmp_path: Path, body: str, what: str, why: str) -> None:
    exe = program(tmp_path, body)
    with pytest.raises(DriversError) as e:
        drivers.query(exe)
    assert e.value.what == f"{exe} --drivers {what}" and e.value.why == why and e.value.fix == drivers.FIX


@pytest.mark.parametrize(("code", "why"), [
    (3, "it gave no answer"),
    (2, "it does not know --drivers (its bundle was built before llamabundle-probe had it)"),
])
def test_a_program_that_fails_says_so_with_what_it_wrote(tmp_path: Path, code: int, why: str) -> None:
    exe = program(tmp_path, f"print('libcuda: oops', file=sys.stderr)\nprint('{{}}')\nsys.exit({code})")
    with pytest.raises(DriversError) as e:
        drivers.query(exe)
    assert e.value.what == f"{exe} --drivers exited with {code}" and e.value.why == why
    assert e.value.details == "libcuda: oops"


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_a_program_a_driver_crashed_names_the_signal(tmp_path: Path) -> None:
    exe = program(tmp_path, "import signal\nsignal.signal(signal.SIGSEGV, signal.SIG_DFL)\n"
                            "os.kill(os.getpid(), signal.SIGSEGV)")
    with pytest.raises(DriversError) as e:
        drivers.query(exe)
    assert e.value.what == f"{exe} --drivers exited with {-signal.SIGSEGV}"
    assert e.value.why == "it was killed by SIGSEGV: a GPU driver it opened crashed it"


def test_a_hanging_program_is_stopped_at_its_timeout_with_what_it_started(tmp_path: Path) -> None:
    pidfile = tmp_path / "child.pid"
    exe = program(tmp_path, "import subprocess\n"
                            f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
                            f"open({str(pidfile)!r}, 'w').write(str(child.pid))\n"
                            "print('cuInit...', file=sys.stderr, flush=True)\ntime.sleep(300)")
    t0 = time.monotonic()
    with pytest.raises(DriversError) as e:
        drivers.query(exe, timeout=2)
    assert time.monotonic() - t0 < 30  # the timeout, then at most the TERM -> KILL grace
    assert e.value.what == f"{exe} --drivers did not finish in 2s"
    assert e.value.why.startswith("a GPU driver did not answer") and e.value.details == "cuInit..."
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while start_time(child) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert start_time(child) is None, "the program's child outlived the timeout"


def test_a_program_that_is_not_there_cannot_be_started(tmp_path: Path) -> None:
    missing = tmp_path / "llamabundle-probe"
    with pytest.raises(DriversError) as e:
        drivers.query(missing)
    assert e.value.what == f"{missing} could not be started" and "No such file or directory" in e.value.why
    assert e.value.fix == drivers.FIX
