"""probe names why the CUDA backend did not come up (fallbacks that name their cause): a library of ggml-cuda's
import closure that this machine cannot resolve, a driver too old for the bundle's toolkit, a GPU whose compute
capability the bundle's SASS and PTX do not serve, PTX as its only code with a driver too old to JIT it.

Each cause is produced for real: bundles whose libggml-cuda.so and CUDA libraries are real ELF files compiled
here with gcc (DT_NEEDED on libcudart.so.13, libcublas.so.13, libggml-base.so and the driver's libcuda.so.1),
"this machine's" library directories given explicitly (this host's own are never read: it may have a CUDA
toolkit in ldconfig's cache), a llama-server that answers --list-devices like llama.cpp without a CUDA
device, and fake nvidia-smi programs that answer each query as nvidia-smi does and log what they were asked."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from llamabundle import gpus
from llamabundle.backends.cuda import diagnosis
from llamabundle.reasons import Chosen, Reason, reasons
from llamabundle.runtime.probe import ProbeResult
from tests.bundles import inputs_for, write_bundle
from tests.clirun import run
from tests.probing import CPU_LOADED, CUDA_LOADED, SERVERS, run_probe

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is needed to build real ELF libraries")

NEW = (Reason.CUDA_LIBRARY_MISSING, Reason.CUDA_DRIVER_LIBRARY_MISSING, Reason.CUDA_DRIVER_TOO_OLD_FOR_TOOLKIT,
       Reason.CUDA_ARCH_UNSUPPORTED, Reason.CUDA_PTX_TOO_NEW)
BUNDLED = ("libcudart.so.13", "libcublas.so.13", "libggml-base.so")
H200 = "NVIDIA H200"
GTX1080 = "NVIDIA GeForce GTX 1080 Ti"
RTX5090 = "NVIDIA GeForce RTX 5090"
_HEAD = b'#!/bin/sh\nd=$(dirname "$0")\n: > "$d/.ran"\n'  # marks that the bundle was run
SERVER = {
    "cpu_only": _HEAD + b'echo "ggml_cuda_init: failed to initialize CUDA: no CUDA-capable device is detected" >&2\n'
                + CPU_LOADED + b'echo "Available devices:"\n',
    "no_device": _HEAD + CUDA_LOADED + CPU_LOADED + b'echo "Available devices:"\n',
    "ok": _HEAD + SERVERS["ok"].removeprefix(b'#!/bin/sh\nd=$(dirname "$0")\n'),
}
SERVER["cpu_only_unmarked"] = SERVER["cpu_only"].replace(b': > "$d/.ran"\n', b"")  # writes nothing into the bundle


# ------------------------------------------------------------------------------------ real ELF libraries


def _gcc(*args: str | Path, cwd: Path) -> None:
    subprocess.run(["gcc", "-O1", "-Wl,--no-as-needed", *map(str, args)], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def elfs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """libggml-cuda.so needing the three bundled libraries and the driver's libcuda.so.1, each a real shared
    object with its soname; compiled once for the module."""
    out = tmp_path_factory.mktemp("elfs")
    src = out / "src"
    src.mkdir()
    libs = {"libcudart.so.13": "cudart", "libcublas.so.13": "cublas", "libggml-base.so": "ggml_base",
            "libcuda.so.1": "cuda"}
    for soname, sym in libs.items():
        (src / f"{sym}.c").write_text(f"int {sym}_fn(void) {{ return 1; }}\n")
        _gcc("-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", out / soname, f"{sym}.c", cwd=src)
    (src / "ggml_cuda.c").write_text("int cudart_fn(void); int cublas_fn(void); int ggml_base_fn(void); int cuda_fn(void);\n"
                                     "int ggml_backend_init(void) { return cudart_fn() + cublas_fn() + ggml_base_fn() + cuda_fn(); }\n")
    _gcc("-shared", "-fPIC", "-Wl,-soname,libggml-cuda.so", "-o", out / "libggml-cuda.so", "ggml_cuda.c", f"-L{out}",
         *(f"-l:{s}" for s in libs), cwd=src)
    return {p.name: p for p in out.iterdir() if p.is_file()}


def probe_said(cuda_error: str) -> bytes:
    """A stand-in llamabundle-probe: the CPU module loaded, ggml-cuda not opened with the loader's `cuda_error`."""
    said = {"schema": 1, "program": "llamabundle-probe", "dir": "DIR", "devices": [], "log": [], "modules": [
        {"file": "libggml-cuda.so", "backend": "cuda", "variant": None, "opened": False, "error": cuda_error,
         "score": None, "chosen": False, "loaded": False, "outcome": "not_opened", "registered": None, "log": []},
        {"file": "libggml-cpu.so", "backend": "cpu", "variant": None, "opened": True, "error": None, "score": None,
         "chosen": True, "loaded": True, "outcome": "loaded", "registered": "CPU", "log": []}]}
    text = json.dumps(said).replace('"DIR"', '"\'"$(cd "$(dirname "$0")" && pwd -P)"\'"')
    return f"#!/bin/sh\necho '{text}'\n".encode()


def cuda_bundle(tmp: Path, elfs: dict[str, Path], *, server: str = "cpu_only", sass: tuple[str, ...] = ("90",),
                ptx: tuple[str, ...] = ("75",), floor: str | None = "580.65.06", toolkit: str = "13.0.2",
                without: tuple[str, ...] = (), probe: bytes | None = None) -> Path:
    """An unpacked CPU + CUDA bundle with a consistent bundle.json; `without` names files removed afterwards;
    `probe`, a llamabundle-probe it carries."""
    stage = tmp / "bundle"
    files = {"llama-server": SERVER[server], "libggml-cpu.so": b"cpu backend\n", "LICENSE": b"MIT License\n",
             "libggml-cuda.so": elfs["libggml-cuda.so"].read_bytes(), **{n: elfs[n].read_bytes() for n in BUNDLED},
             **({"llamabundle-probe": probe} if probe is not None else {})}
    roles = {"llama-server": "exe", "libggml-cpu.so": "backend", "libggml-cuda.so": "backend", "LICENSE": "license",
             **dict.fromkeys(BUNDLED, "runtime"), **({"llamabundle-probe": "exe"} if probe is not None else {})}
    cuda = {"toolkit": toolkit, "driver_floor": floor}
    write_bundle(stage, files, roles, name="linux-x86_64-cuda13.0",
                 executables=("llama-server", *(("llamabundle-probe",) if probe is not None else ())),
                 inputs=inputs_for(f"causes-{server}-{sass}-{ptx}-{floor}-{toolkit}", cuda=cuda),
                 backends=["cpu", "cuda"], cuda={**cuda, "archs": {"sass": list(sass), "ptx": list(ptx)}})
    for name in without:
        (stage / name).unlink()
    return stage


def machine_libs(tmp: Path, elfs: dict[str, Path], *, driver: bool = True) -> Path:
    """This machine's library directory: the driver's libcuda.so.1, or nothing."""
    d = tmp / "machine-lib"
    d.mkdir(exist_ok=True)
    if driver:
        shutil.copyfile(elfs["libcuda.so.1"], d / "libcuda.so.1")
    return d


def smi(tmp: Path, *, name: str = H200, driver: str = "580.95.05", cc: str | None = "9.0",
        cuda: str | None = "13.0") -> tuple[Path, Path]:
    """(nvidia-smi, its log): the GPU query, `--query-gpu=compute_cap` (as a driver before 510 answers when cc
    is None) and the plain header with 'CUDA Version' (none when cuda is None), as nvidia-smi prints them."""
    where = tmp / "smi"
    where.mkdir(exist_ok=True)
    log = where / "asked"
    header = ["+-----------------------------------------------------------------------------------------+",
              f"| NVIDIA-SMI {driver}    Driver Version: {driver}    CUDA Version: {cuda or 'N/A'}     |"
              if cuda else f"| NVIDIA-SMI {driver}    Driver Version: {driver}     |"]
    body = ["#!/bin/sh", f'echo "$*" >> {shlex.quote(str(log))}', 'case "$1" in',
            f"  --query-gpu=name,*) echo {shlex.quote(f'{name}, {driver}, 24576, 24000')} ;;",
            ("  --query-gpu=compute_cap) echo " + shlex.quote(cc) + " ;;" if cc else
             '  --query-gpu=compute_cap) echo \'Field "compute_cap" is not a valid field to query.\'; exit 2 ;;'),
            '  "") ' + "; ".join(f"echo {shlex.quote(h)}" for h in header) + " ;;",
            "  *) exit 2 ;;", "esac"]
    exe = where / "nvidia-smi"
    exe.write_text("\n".join(body) + "\n")
    exe.chmod(0o755)
    return exe, log


def probe_of(tmp: Path, stage: Path, exe: Path, libs: Path) -> ProbeResult:
    env = {"PATH": str(tmp / "emptybin"), "HOME": str(tmp)}
    return run_probe(tmp, env, exe, bundle=stage, max_age=0, lib_dirs=[libs])


def asked(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def valid_json(r: ProbeResult) -> dict[str, Any]:
    """What `probe --json` prints for r, checked against the committed schema."""
    obj = {**r.to_json(), "ok": True}
    schema = json.loads((resources.files("llamabundle.data") / "schemas" / "cli-probe.schema.json").read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator(schema).validate(json.loads(json.dumps(obj)))
    return obj


# ------------------------------------------------------------------------------------ a) libraries


def test_a_library_removed_from_the_bundle_is_named(tmp_path: Path, elfs: dict[str, Path]) -> None:
    stage = cuda_bundle(tmp_path, elfs, without=("libcudart.so.13",))
    exe, _log = smi(tmp_path)
    r = probe_of(tmp_path, stage, exe, machine_libs(tmp_path, elfs))
    assert (r.backend, r.reason) == (Chosen.CPU, Reason.CUDA_LIBRARY_MISSING), r.sentence
    assert r.sentence == (f"the CUDA backend of {r.facts['bundle']} cannot load: libcudart.so.13, needed by "
                          "libggml-cuda.so, is neither in the bundle nor on this machine")
    assert "a complete one carries libcudart.so.13" in r.fix
    cause = r.facts["cause"]
    assert (cause["code"], cause["library"], cause["needed_by"]) == ("cuda_library_missing", "libcudart.so.13", ["libggml-cuda.so"])
    assert cause["searched"] == [str(stage.resolve()), str(tmp_path / "machine-lib")]
    assert r.facts["detail"] == "the CUDA backend did not load"  # the old words stay in the facts
    assert r.facts["server_args"] == ["--device", "none"]
    valid_json(r)


def test_the_loaders_own_words_from_the_bundles_probe_name_the_library(tmp_path: Path, elfs: dict[str, Path]) -> None:
    """A bundle whose llamabundle-probe quotes the loader refusing ggml-cuda: the library it names is the cause,
    with the loader's message, although the bundle holds every file (the reason comes from the probe's facts,
    not from reading the imports)."""
    message = "libcublasLt.so.13: cannot open shared object file: No such file or directory"
    stage = cuda_bundle(tmp_path, elfs, probe=probe_said(message))
    r = probe_of(tmp_path, stage, smi(tmp_path)[0], machine_libs(tmp_path, elfs))
    assert (r.backend, r.reason) == (Chosen.CPU, Reason.CUDA_LIBRARY_MISSING), r.sentence
    assert r.facts["library"] == "libcublasLt.so.13" and r.facts["loader_message"] == message
    assert r.facts["cause"]["loader_message"] == message and r.facts["load_source"] == "llamabundle-probe"
    assert r.facts["modules"] == {"libggml-cuda.so": message, "libggml-cpu.so": "loaded"}
    assert "libcublasLt.so.13, needed by libggml-cuda.so (the loader, through llamabundle-probe)" in r.sentence
    valid_json(r)
    driver = cuda_bundle(tmp_path / "driver", elfs, probe=probe_said(
        "libcuda.so.1: cannot open shared object file: No such file or directory"))
    r = probe_of(tmp_path, driver, smi(tmp_path)[0], machine_libs(tmp_path, elfs))
    assert r.reason is Reason.CUDA_DRIVER_LIBRARY_MISSING and r.facts["library"] == "libcuda.so.1"
    valid_json(r)


def test_a_library_on_this_machine_counts_as_resolved(tmp_path: Path, elfs: dict[str, Path]) -> None:
    """The loader would find libcudart.so.13 in a system directory: not the cause."""
    stage = cuda_bundle(tmp_path, elfs, without=("libcudart.so.13",), server="no_device")
    libs = machine_libs(tmp_path, elfs)
    shutil.copyfile(elfs["libcudart.so.13"], libs / "libcudart.so.13")
    r = probe_of(tmp_path, stage, smi(tmp_path)[0], libs)
    assert r.reason is Reason.CUDA_UNAVAILABLE and r.facts["cause"] is None
    assert "libcudart.so.13" in r.facts["diagnosis"]["libraries"]["bundled"]


def test_ggml_cuda_itself_removed_is_named(tmp_path: Path, elfs: dict[str, Path]) -> None:
    stage = cuda_bundle(tmp_path, elfs, without=("libggml-cuda.so",))
    r = probe_of(tmp_path, stage, smi(tmp_path)[0], machine_libs(tmp_path, elfs))
    assert r.reason is Reason.CUDA_LIBRARY_MISSING and r.facts["library"] == "libggml-cuda.so"
    valid_json(r)


def test_the_drivers_libcuda_absent_is_named(tmp_path: Path, elfs: dict[str, Path]) -> None:
    stage = cuda_bundle(tmp_path, elfs)
    r = probe_of(tmp_path, stage, smi(tmp_path)[0], machine_libs(tmp_path, elfs, driver=False))
    assert (r.backend, r.reason) == (Chosen.CPU, Reason.CUDA_DRIVER_LIBRARY_MISSING), r.sentence
    assert r.sentence.endswith("cannot load: the NVIDIA driver's libcuda.so.1, needed by libggml-cuda.so, is not on this machine")
    assert "NVIDIA Container Toolkit" in r.fix
    assert r.facts["cause"]["library"] == "libcuda.so.1"
    assert r.facts["diagnosis"]["libraries"]["driver_absent"] == ["libcuda.so.1"]
    valid_json(r)


def test_a_32_bit_libcuda_does_not_count(tmp_path: Path, elfs: dict[str, Path]) -> None:
    if subprocess.run(["gcc", "-m32", "-shared", "-x", "c", "-", "-o", str(tmp_path / "t.so")], input=b"int f(void){return 0;}",
                      capture_output=True, check=False).returncode != 0:
        pytest.skip("gcc cannot build 32-bit objects here")
    libs = machine_libs(tmp_path, elfs, driver=False)
    shutil.copyfile(tmp_path / "t.so", libs / "libcuda.so.1")
    r = probe_of(tmp_path, cuda_bundle(tmp_path, elfs), smi(tmp_path)[0], libs)
    assert r.reason is Reason.CUDA_DRIVER_LIBRARY_MISSING


# ------------------------------------------------------------------------------------ b) driver


def test_a_driver_below_the_recorded_floor_is_driver_too_old_before_the_bundle_runs(tmp_path: Path,
                                                                                    elfs: dict[str, Path]) -> None:
    stage = cuda_bundle(tmp_path, elfs, floor="580.95.05")
    exe, log = smi(tmp_path, driver="580.65.06", cuda="13.0")
    r = probe_of(tmp_path, stage, exe, machine_libs(tmp_path, elfs))
    assert r.reason is Reason.DRIVER_TOO_OLD  # the stable code, decided from the GPU query alone
    assert r.sentence == "driver 580.65.06 is older than 580.95.05 required by this bundle"
    assert not (stage / ".ran").exists() and "diagnosis" not in r.facts
    assert asked(log) == [" ".join(gpus.SCAN_ARGS)]


def test_a_driver_of_an_older_cuda_major_is_too_old_for_the_toolkit(tmp_path: Path, elfs: dict[str, Path]) -> None:
    """No floor recorded: nvidia-smi's header says the driver runs CUDA 12.9; the bundle's runtime is CUDA 13."""
    stage = cuda_bundle(tmp_path, elfs, floor=None)
    exe, log = smi(tmp_path, driver="575.57.08", cuda="12.9")
    r = probe_of(tmp_path, stage, exe, machine_libs(tmp_path, elfs))
    assert (r.backend, r.reason) == (Chosen.CPU, Reason.CUDA_DRIVER_TOO_OLD_FOR_TOOLKIT), r.sentence
    assert r.sentence == (f"driver 575.57.08 is too old for CUDA 13.0.2, which the bundle {r.facts['bundle']} was built "
                          "with (it supports CUDA 12.9; the bundle records no driver floor)")
    assert r.fix.startswith("update the NVIDIA driver to 580.95.05 or newer")  # data/cuda.json: 13.0.2 on Linux
    assert r.facts["cause"] == {"code": "cuda_driver_too_old_for_toolkit", "driver": "575.57.08", "toolkit": "13.0.2",
                                "driver_cuda": "12.9", "toolkit_floor": "580.95.05", "basis": "nvidia-smi: CUDA Version"}
    assert (stage / ".ran").exists()  # the diagnosis came after the bundle's own run
    assert " ".join(gpus.COMPUTE_CAP_ARGS) in asked(log) and "" in asked(log)
    valid_json(r)


def test_without_the_header_the_toolkits_floor_in_the_data_decides(tmp_path: Path, elfs: dict[str, Path]) -> None:
    stage = cuda_bundle(tmp_path, elfs, floor=None)
    r = probe_of(tmp_path, stage, smi(tmp_path, driver="580.82.07", cuda=None)[0], machine_libs(tmp_path, elfs))
    assert r.reason is Reason.CUDA_DRIVER_TOO_OLD_FOR_TOOLKIT, r.sentence
    assert "it is older than 580.95.05, the driver of CUDA 13.0.2's installer in data/cuda.json" in r.sentence
    assert r.facts["cause"]["basis"] == "data/cuda.json driver floor" and r.facts["cause"]["driver_cuda"] is None


def test_a_driver_at_the_toolkits_floor_is_not_the_cause(tmp_path: Path, elfs: dict[str, Path]) -> None:
    stage = cuda_bundle(tmp_path, elfs, floor=None, server="no_device")
    r = probe_of(tmp_path, stage, smi(tmp_path, driver="580.95.05", cuda="13.0")[0], machine_libs(tmp_path, elfs))
    assert r.reason is Reason.CUDA_UNAVAILABLE and r.facts["cause"] is None
    assert r.sentence.endswith("starts but lists no CUDA device (the CUDA backend loaded but listed no device)")


# ------------------------------------------------------------------------------------ c) compute capability


@pytest.mark.parametrize(("name", "cc", "sass", "ptx", "fix"), [
    (GTX1080, "6.1", ("90",), ("75",), "CUDA 13.0.2 cannot target it (nothing below sm_75); a recipe on an older "
                                       "toolkit with 61-real can"),
    (RTX5090, "12.0", ("90",), (), "add 120-real to the recipe"),
    (RTX5090, "12.0", ("90a",), ("90a",), "add 120-real to the recipe"),  # 'a' code runs on 9.0 only
])
def test_a_gpu_served_by_neither_sass_nor_ptx_is_named(tmp_path: Path, elfs: dict[str, Path], name: str, cc: str,
                                                       sass: tuple[str, ...], ptx: tuple[str, ...], fix: str) -> None:
    stage = cuda_bundle(tmp_path, elfs, sass=sass, ptx=ptx)
    r = probe_of(tmp_path, stage, smi(tmp_path, name=name, cc=cc)[0], machine_libs(tmp_path, elfs))
    assert (r.backend, r.reason) == (Chosen.CPU, Reason.CUDA_ARCH_UNSUPPORTED), r.sentence
    assert r.sentence == (f"{name} (compute capability {cc}) is served by neither SASS nor PTX in the bundle "
                          f"{r.facts['bundle']} (SASS: {', '.join(sass)}; PTX: {', '.join(ptx) or 'none'})")
    assert f"({fix})" in r.fix
    assert r.facts["cause"] == {"code": "cuda_arch_unsupported", "compute_cap": [cc], "sass": list(sass), "ptx": list(ptx),
                                "toolkit": "13.0.2"}
    valid_json(r)


def test_a_gpu_served_by_sass_is_not_the_cause(tmp_path: Path, elfs: dict[str, Path]) -> None:
    """sm_90 SASS runs on 9.0; the driver is new enough: nothing found, the old reason stays, with the evidence."""
    stage = cuda_bundle(tmp_path, elfs, server="no_device")
    r = probe_of(tmp_path, stage, smi(tmp_path)[0], machine_libs(tmp_path, elfs))
    assert r.reason is Reason.CUDA_UNAVAILABLE and r.facts["cause"] is None and "diagnosis_error" not in r.facts
    d = r.facts["diagnosis"]
    assert d["compute_caps"] == ["9.0"] and d["served"] == {"9.0": {"status": "sass", "via": "sm_90"}}
    assert d["driver_cuda"] == "13.0" and d["errors"] == []
    valid_json(r)


def test_a_driver_that_cannot_tell_the_compute_capability(tmp_path: Path, elfs: dict[str, Path]) -> None:
    stage = cuda_bundle(tmp_path, elfs, server="no_device")
    r = probe_of(tmp_path, stage, smi(tmp_path, cc=None)[0], machine_libs(tmp_path, elfs))
    assert r.reason is Reason.CUDA_UNAVAILABLE
    assert "compute capability: nvidia-smi --query-gpu=compute_cap --format=csv,noheader exited with 2" in r.facts["diagnosis_error"]


# ------------------------------------------------------------------------------------ d) PTX newer than the JIT


def test_ptx_only_with_a_driver_of_an_older_cuda_is_named(tmp_path: Path, elfs: dict[str, Path]) -> None:
    """12.0 runs only compute_75 PTX through the JIT; the driver passes the bundle's floor but runs CUDA 12.9."""
    stage = cuda_bundle(tmp_path, elfs, floor="570.124.06")
    exe, _log = smi(tmp_path, name=RTX5090, cc="12.0", driver="575.57.08", cuda="12.9")
    r = probe_of(tmp_path, stage, exe, machine_libs(tmp_path, elfs))
    assert (r.backend, r.reason) == (Chosen.CPU, Reason.CUDA_PTX_TOO_NEW), r.sentence
    assert r.sentence == (f"{RTX5090} (compute capability 12.0) is served only by the bundle {r.facts['bundle']}'s PTX "
                          "(compute_75), made by CUDA 13.0.2, which driver 575.57.08 cannot JIT-compile (it supports CUDA 12.9)")
    assert r.fix == ("update the NVIDIA driver to one for CUDA 13.0.2 or newer (580.82.07 or later), or use a bundle with "
                     "SASS for compute capability 12.0 (add 120-real to the recipe)")
    cause = r.facts["cause"]
    assert (cause["code"], cause["ptx"], cause["driver_cuda"], cause["compute_cap"]) == ("cuda_ptx_too_new", "compute_75", "12.9", ["12.0"])
    valid_json(r)


def test_ptx_only_without_the_header_uses_the_oldest_driver_of_that_cuda(tmp_path: Path, elfs: dict[str, Path]) -> None:
    stage = cuda_bundle(tmp_path, elfs, floor="570.124.06")
    r = probe_of(tmp_path, stage, smi(tmp_path, name=RTX5090, cc="12.0", driver="580.65.06", cuda=None)[0],
                 machine_libs(tmp_path, elfs))
    assert r.reason is Reason.CUDA_PTX_TOO_NEW, r.sentence
    assert "(it is older than 580.82.07, the oldest driver data/cuda.json gives for CUDA 13.0)" in r.sentence


def test_ptx_only_with_a_driver_that_knows_the_toolkit_is_not_the_cause(tmp_path: Path, elfs: dict[str, Path]) -> None:
    stage = cuda_bundle(tmp_path, elfs, server="no_device")
    r = probe_of(tmp_path, stage, smi(tmp_path, name=RTX5090, cc="12.0", cuda="13.0")[0], machine_libs(tmp_path, elfs))
    assert r.reason is Reason.CUDA_UNAVAILABLE and r.facts["cause"] is None
    assert r.facts["diagnosis"]["served"] == {"12.0": {"status": "ptx-jit", "via": "compute_75"}}


# ------------------------------------------------------------------------------------ the happy path, failures


def test_the_happy_path_runs_no_diagnosis_and_checks_the_kernels(tmp_path: Path, elfs: dict[str, Path]) -> None:
    stage = cuda_bundle(tmp_path, elfs, server="ok")
    exe, log = smi(tmp_path)
    r = probe_of(tmp_path, stage, exe, machine_libs(tmp_path, elfs, driver=False))  # libcuda absent: not looked at
    assert (r.backend, r.reason) == (Chosen.CUDA, Reason.OK)
    assert not {"cause", "diagnosis", "diagnosis_error"} & set(r.facts)
    assert r.facts["kernels"] == {"compute_caps": ["9.0"], "served": {"9.0": {"status": "sass", "via": "sm_90"}}, "errors": []}
    # the GPU query, then the compute capability (the listed device's kernels); no library closure, no header
    assert asked(log) == [" ".join(gpus.SCAN_ARGS), " ".join(gpus.COMPUTE_CAP_ARGS)]
    valid_json(r)


def test_a_listed_gpu_that_no_kernel_runs_on_is_arch_unsupported(tmp_path: Path, elfs: dict[str, Path]) -> None:
    """As on the H200 (bench/results/gpu-h200-multi-backend/): a bundle of sm_80 SASS only listed `CUDA0: NVIDIA H200`
    and probe said ok, while llama-bench aborted at its first kernel. A listed device is checked like a missing one."""
    stage = cuda_bundle(tmp_path, elfs, server="ok", sass=("80",), ptx=())
    r = probe_of(tmp_path, stage, smi(tmp_path, cc="9.0")[0], machine_libs(tmp_path, elfs))
    assert (r.backend, r.reason) == (Chosen.CPU, Reason.CUDA_ARCH_UNSUPPORTED), r.sentence
    assert r.sentence == (f"{H200} (compute capability 9.0) is served by neither SASS nor PTX in the bundle "
                          f"{r.facts['bundle']} (SASS: 80; PTX: none)")
    assert "(add 90-real to the recipe)" in r.fix
    assert r.facts["detail"] == "the CUDA backend loaded and listed CUDA0, but no kernel in the bundle runs on it"
    assert r.facts["kernels"]["served"] == {"9.0": {"status": "unsupported", "via": None}}
    assert r.facts["cause"]["code"] == "cuda_arch_unsupported" and r.facts["server_args"] == ["--device", "none"]
    valid_json(r)


def test_a_listed_gpu_served_only_by_ptx_the_driver_cannot_jit(tmp_path: Path, elfs: dict[str, Path]) -> None:
    stage = cuda_bundle(tmp_path, elfs, server="ok", floor="570.124.06")
    exe, _log = smi(tmp_path, name=RTX5090, cc="12.0", driver="575.57.08", cuda="12.9")
    r = probe_of(tmp_path, stage, exe, machine_libs(tmp_path, elfs))
    assert (r.backend, r.reason) == (Chosen.CPU, Reason.CUDA_PTX_TOO_NEW), r.sentence
    assert r.facts["kernels"]["served"] == {"12.0": {"status": "ptx-jit", "via": "compute_75"}}


def test_a_listed_gpu_whose_compute_capability_is_unknown_stays_ok(tmp_path: Path, elfs: dict[str, Path]) -> None:
    """A driver before 510 cannot answer compute_cap: nothing proves the kernels wrong, so the listed device stands."""
    stage = cuda_bundle(tmp_path, elfs, server="ok", sass=("80",), ptx=())
    r = probe_of(tmp_path, stage, smi(tmp_path, cc=None)[0], machine_libs(tmp_path, elfs))
    assert r.reason is Reason.OK
    assert r.facts["kernels"]["compute_caps"] is None and "compute capability" in r.facts["kernels"]["errors"][0]


def test_a_cached_result_is_not_reused_once_a_file_is_removed(tmp_path: Path, elfs: dict[str, Path]) -> None:
    """Seen on the H200: libcudart removed from the bundle 2 s after a probe, and `probe` (TTL 30 s) said ok again."""
    stage = cuda_bundle(tmp_path, elfs, server="cpu_only_unmarked")
    exe, _log = smi(tmp_path)
    env = {"PATH": str(tmp_path / "emptybin"), "HOME": str(tmp_path)}
    libs = [machine_libs(tmp_path, elfs)]
    first = run_probe(tmp_path, env, exe, bundle=stage, max_age=30, lib_dirs=libs)
    again = run_probe(tmp_path, env, exe, bundle=stage, max_age=30, lib_dirs=libs)
    assert (first.cached, again.cached) == (False, True) and again.reason is first.reason is Reason.CUDA_UNAVAILABLE
    (stage / "libcudart.so.13").unlink()
    after = run_probe(tmp_path, env, exe, bundle=stage, max_age=30, lib_dirs=libs)
    assert not after.cached and after.reason is Reason.CUDA_LIBRARY_MISSING
    assert after.facts["bundle_stamp"] != first.facts["bundle_stamp"]


def test_a_diagnosis_that_fails_keeps_the_old_reason(tmp_path: Path, elfs: dict[str, Path],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_a: object, **_k: object) -> None:
        raise RuntimeError("no look today")

    monkeypatch.setattr(diagnosis, "diagnose", boom)
    stage = cuda_bundle(tmp_path, elfs, without=("libcudart.so.13",))
    r = probe_of(tmp_path, stage, smi(tmp_path)[0], machine_libs(tmp_path, elfs))
    assert r.reason is Reason.CUDA_UNAVAILABLE and r.sentence.endswith("(the CUDA backend did not load)")
    assert r.facts["diagnosis_error"] == "RuntimeError: no look today" and r.facts["cause"] is None
    valid_json(r)


def test_a_check_that_fails_leaves_the_others(tmp_path: Path, elfs: dict[str, Path]) -> None:
    """ggml-cuda is no ELF file (the library check cannot be made); the arch check still names the cause."""
    stage = cuda_bundle(tmp_path, elfs)
    (stage / "libggml-cuda.so").write_bytes(b"not an ELF file\n")
    r = probe_of(tmp_path, stage, smi(tmp_path, name=GTX1080, cc="6.1")[0], machine_libs(tmp_path, elfs))
    assert r.reason is Reason.CUDA_ARCH_UNSUPPORTED
    assert r.facts["diagnosis"]["errors"] == ["libraries: libggml-cuda.so is not an ELF file"]


def test_a_vulkan_fallback_carries_the_cuda_cause(tmp_path: Path, elfs: dict[str, Path],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from llamabundle.backends import vulkan

    monkeypatch.setattr(vulkan, "loader_path", lambda: "/usr/lib/x86_64-linux-gnu/libvulkan.so.1")
    stage = tmp_path / "bundle"
    SERVER["vk"] = _HEAD + b'echo "load_backend: loaded Vulkan backend from $d/libggml-vulkan.so" >&2\n' + CPU_LOADED \
        + b'echo "Available devices:"\necho "  Vulkan0: NVIDIA GeForce GTX 1080 Ti (11264 MiB, 11000 MiB free)"\n'
    try:
        files = {"llama-server": SERVER["vk"], "libggml-cpu.so": b"cpu\n", "libggml-vulkan.so": b"vulkan\n",
                 "libggml-cuda.so": elfs["libggml-cuda.so"].read_bytes(), **{n: elfs[n].read_bytes() for n in BUNDLED}}
        cuda = {"toolkit": "13.0.2", "driver_floor": "580.65.06"}
        write_bundle(stage, files, {**dict.fromkeys(files, "backend"), "llama-server": "exe"}, executables=("llama-server",),
                     inputs=inputs_for("causes-vk", cuda=cuda), backends=["cpu", "cuda", "vulkan"],
                     cuda={**cuda, "archs": {"sass": ["90"], "ptx": ["75"]}})
    finally:
        del SERVER["vk"]
    r = probe_of(tmp_path, stage, smi(tmp_path, name=GTX1080, cc="6.1")[0], machine_libs(tmp_path, elfs))
    assert (r.backend, r.reason, r.facts["cuda_reason"]) == (Chosen.VULKAN, Reason.VULKAN_OK, "cuda_arch_unsupported")
    assert "CUDA is not used: NVIDIA GeForce GTX 1080 Ti (compute capability 6.1) is served by neither" in r.sentence
    assert r.facts["cuda_cause"]["code"] == "cuda_arch_unsupported"
    valid_json(r)


def test_a_listed_cuda_device_no_kernel_runs_on_falls_back_to_vulkan(tmp_path: Path, elfs: dict[str, Path],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The H200's multi-backend case with a bundle of sm_80 SASS: CUDA0 and Vulkan0 both listed (as the pinned
    llama.cpp lists one GPU twice); CUDA cannot run a kernel there, so Vulkan is chosen and says why."""
    from llamabundle.backends import vulkan

    monkeypatch.setattr(vulkan, "loader_path", lambda: "/usr/lib/x86_64-linux-gnu/libvulkan.so.1")
    stage = tmp_path / "bundle"
    server = _HEAD + CUDA_LOADED + b'echo "load_backend: loaded Vulkan backend from $d/libggml-vulkan.so" >&2\n' \
        + CPU_LOADED + b'echo "Available devices:"\necho "  CUDA0: NVIDIA H200 (143155 MiB, 142612 MiB free)"\n' \
        + b'echo "  Vulkan0: NVIDIA H200 (143771 MiB, 142612 MiB free)"\n'
    files = {"llama-server": server, "libggml-cpu.so": b"cpu\n", "libggml-vulkan.so": b"vulkan\n",
             "libggml-cuda.so": elfs["libggml-cuda.so"].read_bytes(), **{n: elfs[n].read_bytes() for n in BUNDLED}}
    cuda = {"toolkit": "13.0.2", "driver_floor": "580.65.06"}
    write_bundle(stage, files, {**dict.fromkeys(files, "backend"), "llama-server": "exe"}, executables=("llama-server",),
                 inputs=inputs_for("causes-vk-listed", cuda=cuda), backends=["cpu", "cuda", "vulkan"],
                 cuda={**cuda, "archs": {"sass": ["80"], "ptx": []}})
    r = probe_of(tmp_path, stage, smi(tmp_path, cc="9.0")[0], machine_libs(tmp_path, elfs))
    assert (r.backend, r.reason, r.facts["cuda_reason"]) == (Chosen.VULKAN, Reason.VULKAN_OK, "cuda_arch_unsupported")
    assert "CUDA is not used: NVIDIA H200 (compute capability 9.0) is served by neither SASS nor PTX" in r.sentence
    assert r.facts["server_args"] == ["--device", "Vulkan0"] and r.facts["server_env"] == {"CUDA_VISIBLE_DEVICES": ""}
    assert r.facts["gpu_devices"] == [{"name": "NVIDIA H200", "devices": ["CUDA0", "Vulkan0"]}]
    valid_json(r)


# ------------------------------------------------------------------------------------ codes, schema, command line


def test_the_new_codes_have_sentences_and_fixes_and_the_schema_lists_every_code() -> None:
    table = reasons()
    for r in NEW:
        assert table[r.value]["backend"] == "cpu" and table[r.value]["sentence"] and table[r.value]["fix"]
    schema = json.loads((resources.files("llamabundle.data") / "schemas" / "cli-probe.schema.json").read_text(encoding="utf-8"))
    assert schema["properties"]["reason"]["enum"] == [r.value for r in Reason]
    assert schema["properties"]["backend"]["enum"] == [b.value for b in Chosen]
    assert schema["properties"]["facts"]["properties"]["cause"]["oneOf"][1]["properties"]["code"]["enum"] == [r.value for r in NEW]


def test_cli_probe_json_names_the_cause(tmp_path: Path, elfs: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`probe --json` in this process: the machine's library directories are the test's (ldconfig not run)."""
    from llamabundle.deps import elf

    libs = machine_libs(tmp_path, elfs)
    monkeypatch.setattr(elf, "ldconfig_cache", lambda: "")
    monkeypatch.setattr(elf, "system_library_dirs", lambda policy, ldconfig_output="": [libs])
    stage = cuda_bundle(tmp_path, elfs, without=("libcublas.so.13",))
    code, out, err = run(capsys, "probe", "--bundle", stage, "--nvidia-smi", smi(tmp_path)[0], "--max-age", "0", "--json")
    assert code == 0, err
    obj = json.loads(out)
    assert (obj["ok"], obj["reason"], obj["facts"]["cause"]["library"]) == (True, "cuda_library_missing", "libcublas.so.13")
    schema = json.loads((resources.files("llamabundle.data") / "schemas" / "cli-probe.schema.json").read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator(schema).validate(obj)
    code, out, _ = run(capsys, "probe", "--bundle", stage, "--nvidia-smi", smi(tmp_path)[0], "--max-age", "0")
    assert code == 0 and "reason   cuda_library_missing\n" in out and "libcublas.so.13" in out
