"""probe (DESIGN §8): a reason code from real fake nvidia-smi programs, real bundles whose llama-server is a
small shell program answering --list-devices like llama.cpp, and a cache that an older probe finishing last
never overwrites. The bundle and nvidia-smi makers are tests/probing.py's, shared with the install, doctor and
telemetry tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from llamabundle.backends import vulkan as vulkan_backend
from llamabundle.gpus import driver_older, parse_nvidia_smi, parse_proc_version
from llamabundle.platforms import load as platform_load
from llamabundle.reasons import Chosen, Reason, explain, reasons
from llamabundle.runtime.probe import (
    ProbeResult,
    ensure_backend,
    read_cached,
    with_gpu_layers,
)
from llamabundle.runtime.results import take_token
from llamabundle.store.local import LocalStore
from tests.probing import (
    H200,
    NAME,
    OLD,
    QUIET,
    REPO,
    cli,
    fake_smi,
    installed,
    make_stage,
    publish,
    run_probe,
)
from tests.processes import wait_for


@pytest.fixture()
def env(tmp_path: Path) -> dict[str, str]:
    return {"PATH": str(tmp_path / "emptybin"), "HOME": str(tmp_path)}


# ------------------------------------------------------------------------------------ reasons


def test_every_reason_has_a_sentence_and_a_fix_and_only_ok_is_cuda() -> None:
    table = reasons()
    assert set(table) == {r.value for r in Reason}
    assert [r for r in Reason if table[r.value]["backend"] == "cuda"] == [Reason.OK]
    sentence, fix = explain(Reason.DRIVER_TOO_OLD, {"driver": "551.61", "floor": "572.61"})
    assert f"{sentence}: {fix}".startswith("driver 551.61 is older than 572.61 required by this bundle: update the NVIDIA driver")
    assert explain(Reason.GPU_MISSING, {})[0] == "no NVIDIA GPU was found (?)"


@pytest.mark.parametrize(("driver", "floor", "older"), [
    ("551.61", "572.61", True), ("570.124.06", "572.61", True), ("572.61", "572.61", False),
    ("580.95.05", "580.95.05", False), ("580.95.05", "580.9", False), ("575", "572.61", False), ("99.1", "100.0", True),
])
def test_driver_older_compares_versions_not_strings(driver: str, floor: str, older: bool) -> None:
    assert driver_older(driver, floor) is older


def test_parsers_of_nvidia_smi_and_the_proc_version_file() -> None:
    gpus = parse_nvidia_smi(f"{H200}\nNVIDIA A100-SXM4-80GB, 580.95.05, [N/A], [N/A]\nNo devices were found\n")
    assert [(g.name, g.driver, g.memory_total_mib, g.memory_free_mib) for g in gpus] == [
        ("NVIDIA H200", "580.95.05", 143771, 143155), ("NVIDIA A100-SXM4-80GB", "580.95.05", None, None)]
    assert parse_nvidia_smi("No devices were found\n") == []
    assert parse_proc_version("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.124.06  Wed Feb 26 2025\n"
                              "GCC version:  gcc version 12.2.0\n") == "570.124.06"
    assert parse_proc_version("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build\n") == "580.95.05"
    assert parse_proc_version("garbage") is None
    # Recorded on the H200 machine (2026-11): the exact output of the query and of the version file.
    assert parse_nvidia_smi("NVIDIA H200, 580.159.04, 143771, 143156\n")[0].driver == "580.159.04"
    assert parse_proc_version("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  "
                              "(nixbld@)  \nGCC version:  gcc version 15.3.0 (GCC) \n") == "580.159.04"


# ------------------------------------------------------------------------------------ no GPU / driver


def test_no_nvidia_smi_and_no_driver_is_gpu_missing(tmp_path: Path, env: dict[str, str]) -> None:
    r = run_probe(tmp_path, env, None)
    assert (r.backend, r.reason) == (Chosen.CPU, Reason.GPU_MISSING)
    assert r.sentence == "no NVIDIA GPU was found (nvidia-smi is not on PATH)"
    assert r.facts["gpus"] == [] and r.facts["nvidia_smi"] is None


def test_nvidia_smi_is_found_first_on_path(tmp_path: Path, env: dict[str, str]) -> None:
    smi = fake_smi(tmp_path / "bin", H200)
    r = run_probe(tmp_path, {**env, "PATH": f"{smi.parent}:{env['PATH']}"}, None)
    assert r.reason is Reason.BINARY_MISSING_NVIDIA_DETECTED
    assert r.facts["nvidia_smi"] == str(smi)
    assert r.facts["gpus"] == [{"name": "NVIDIA H200", "driver": "580.95.05", "memory_total_mib": 143771,
                                "memory_free_mib": 143155}]
    assert r.sentence == "an NVIDIA GPU (NVIDIA H200, driver 580.95.05) is present but no CUDA bundle is installed"


@pytest.mark.parametrize(("rc", "out", "err"), [
    (9, "", "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."),
    (6, "No devices were found", ""),
])
def test_a_failing_nvidia_smi_is_gpu_missing_with_its_message(tmp_path: Path, env: dict[str, str], rc: int, out: str,
                                                              err: str) -> None:
    smi = fake_smi(tmp_path / "bin", *([out] if out else []), rc=rc, stderr=err)
    r = run_probe(tmp_path, env, smi)
    assert r.reason is Reason.GPU_MISSING
    assert r.facts["detail"] == f"nvidia-smi exited with {rc}: {out or err}"


def test_a_hanging_nvidia_smi_is_stopped_by_the_timeout(tmp_path: Path, env: dict[str, str]) -> None:
    smi = fake_smi(tmp_path / "bin", H200, hang=True)
    r = run_probe(tmp_path, env, smi, smi_timeout=0.5)
    assert r.reason is Reason.GPU_MISSING
    assert "did not answer" in r.facts["detail"]


def test_the_kernel_driver_alone_counts_as_a_gpu(tmp_path: Path, env: dict[str, str]) -> None:
    proc = tmp_path / "version"
    proc.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  551.61  Release Build\n")
    r = run_probe(tmp_path, env, None, proc_version=proc)
    assert r.reason is Reason.BINARY_MISSING_NVIDIA_DETECTED
    assert (r.facts["driver"], r.facts["proc_driver"]) == ("551.61", "551.61")
    installed(tmp_path)  # and that driver is compared with the bundle's floor
    r = run_probe(tmp_path, env, None, proc_version=proc)
    assert r.reason is Reason.DRIVER_TOO_OLD


# ------------------------------------------------------------------------------------ with a bundle


def test_old_driver_is_driver_too_old(tmp_path: Path, env: dict[str, str]) -> None:
    m = installed(tmp_path, floor="572.61")
    r = run_probe(tmp_path, env, fake_smi(tmp_path / "bin", OLD))
    assert (r.backend, r.reason) == (Chosen.CPU, Reason.DRIVER_TOO_OLD)
    assert r.sentence == "driver 551.61 is older than 572.61 required by this bundle"
    assert r.fix == "update the NVIDIA driver to 572.61 or newer"
    assert r.facts["bundle_key"] == m.key


@pytest.mark.parametrize(("server", "reason", "detail"), [
    ("ok", Reason.OK, None),
    ("cpu_only", Reason.CUDA_UNAVAILABLE, "the CUDA backend did not load"),
    ("no_device", Reason.CUDA_UNAVAILABLE, "the CUDA backend loaded but listed no device"),
    ("broken", Reason.CUDA_STARTUP_FAILED, "llama-server --list-devices exited with 127"),
    ("outside", Reason.CUDA_STARTUP_FAILED, "the CUDA backend was loaded from /usr/lib/libggml-cuda.so, outside the bundle"),
])
def test_the_bundles_own_list_devices_decides(tmp_path: Path, env: dict[str, str], server: str, reason: Reason,
                                              detail: str | None) -> None:
    m = installed(tmp_path, server=server)
    r = run_probe(tmp_path, env, fake_smi(tmp_path / "bin", H200))
    assert r.reason is reason, r.sentence
    assert r.backend is (Chosen.CUDA if reason is Reason.OK else Chosen.CPU)
    if detail is None:
        assert r.facts["devices"] == ["CUDA0: NVIDIA H200 (143155 MiB, 142629 MiB free)"]
        assert r.facts["backends_loaded"]["CUDA"].endswith("/libggml-cuda.so")
        assert r.sentence == f"the CUDA bundle {NAME} ({m.key[:12]}) runs on NVIDIA H200 with driver 580.95.05"
    else:
        assert r.facts["detail"].startswith(detail)
    if server == "broken":
        assert "libcudart.so.13: cannot open shared object file" in r.facts["output"]


def test_a_hanging_llama_server_is_cuda_startup_failed(tmp_path: Path, env: dict[str, str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform_load, "LOAD_TIMEOUT", 1)
    installed(tmp_path, server="hang")
    r = run_probe(tmp_path, env, fake_smi(tmp_path / "bin", H200))
    assert r.reason is Reason.CUDA_STARTUP_FAILED
    assert "did not finish in 1s" in r.facts["detail"]


def test_a_cpu_only_bundle_is_not_a_cuda_bundle(tmp_path: Path, env: dict[str, str]) -> None:
    installed(tmp_path, name="linux-x86_64-cpu", backends=("cpu",))
    assert run_probe(tmp_path, env, fake_smi(tmp_path / "bin", H200)).reason is Reason.BINARY_MISSING_NVIDIA_DETECTED


def test_without_bundle_a_cpu_only_install_is_the_one_probed_with_its_server_args(tmp_path: Path,
                                                                                 env: dict[str, str]) -> None:
    """probe without --bundle considers every install, CPU-only ones last: with only a CPU bundle installed, that
    bundle is the answer's (its directory, key and the flags that run it), not nothing."""
    m = installed(tmp_path, name="linux-x86_64-cpu", backends=("cpu",))
    r = run_probe(tmp_path, env, None)
    assert (r.backend, r.reason) == (Chosen.CPU, Reason.GPU_MISSING)
    assert r.facts["bundle_key"] == m.key and r.facts["bundle_dir"] is not None
    assert r.facts["server_args"] == ["--device", "none"]


def test_without_bundle_the_next_gpu_install_is_probed_when_the_first_ones_backend_does_not_work(
        tmp_path: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA bundle comes first where an NVIDIA GPU is seen; its backend lists no device here, so the Vulkan
    bundle installed before it is probed next and chosen, saying which bundle was passed over and why."""
    monkeypatch.setattr(vulkan_backend, "loader_path", lambda: "/usr/lib/x86_64-linux-gnu/libvulkan.so.1")  # any machine
    vulkan = installed(tmp_path, name="linux-x86_64-vulkan", backends=("cpu", "vulkan"), server="vulkan_amd")
    cuda = installed(tmp_path, name="linux-x86_64-cuda13.0", backends=("cpu", "cuda"), server="no_device")
    installed(tmp_path, name="linux-x86_64-cpu", backends=("cpu",))
    r = run_probe(tmp_path, env, fake_smi(tmp_path / "bin", H200))
    assert (r.backend, r.reason) == (Chosen.VULKAN, Reason.VULKAN_OK), r.sentence
    assert r.facts["bundle_key"] == vulkan.key and r.facts["passed_over"]["reason"] == "cuda_unavailable"
    assert cuda.key[:12] in r.facts["passed_over"]["bundle_dir"]


def test_a_cached_answer_that_passed_a_bundle_over_is_reused_until_either_bundle_changes(
        tmp_path: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The answer above is what a probe of the same installs asks again: within its age it is the cached one;
    a file added to the passed-over bundle or to the chosen one probes anew."""
    monkeypatch.setattr(vulkan_backend, "loader_path", lambda: "/usr/lib/x86_64-linux-gnu/libvulkan.so.1")
    installed(tmp_path, name="linux-x86_64-vulkan", backends=("cpu", "vulkan"), server="vulkan_amd")
    installed(tmp_path, name="linux-x86_64-cuda13.0", backends=("cpu", "cuda"), server="no_device")
    smi = fake_smi(tmp_path / "bin", H200)
    first = run_probe(tmp_path, env, smi, max_age=3600)
    assert first.backend is Chosen.VULKAN and "passed_over" in first.facts and not first.cached
    again = run_probe(tmp_path, env, smi, max_age=3600)
    assert again.cached and again.token == first.token
    for changed in (Path(first.facts["passed_over"]["bundle_dir"]), Path(first.facts["bundle_dir"])):
        (changed / "touched").write_text("x")
        fresh = run_probe(tmp_path, env, smi, max_age=3600)
        assert not fresh.cached and fresh.token != first.token, changed
        assert run_probe(tmp_path, env, smi, max_age=3600).cached  # and that new answer is reused in turn
        (changed / "touched").unlink()


def test_probe_of_an_explicit_bundle_directory(tmp_path: Path, env: dict[str, str]) -> None:
    stage, m = make_stage(tmp_path, server="ok")
    r = run_probe(tmp_path, env, fake_smi(tmp_path / "bin", H200), bundle=stage)
    assert r.reason is Reason.OK and r.facts["bundle_dir"] == str(stage.resolve())
    assert r.facts["bundle_key"] == m.key and r.facts["bundle"] == f"{NAME} ({m.key[:12]})"  # read as a typed Manifest


def test_planned_zero_gpu_layers(tmp_path: Path, env: dict[str, str]) -> None:
    installed(tmp_path)
    ok = run_probe(tmp_path, env, fake_smi(tmp_path / "bin", H200))
    zero = with_gpu_layers(ok, 0)
    assert (zero.backend, zero.reason, zero.facts["ngl"]) == (Chosen.CPU, Reason.CUDA_GPU_LAYERS_ZERO, 0)
    assert zero.sentence == "the CUDA bundle works but the plan puts no layer on the GPU (-ngl 0)"
    assert with_gpu_layers(ok, 33).reason is Reason.OK
    assert with_gpu_layers(ok, None) == ok
    missing = run_probe(tmp_path, env, None)
    assert with_gpu_layers(missing, 0).reason is Reason.GPU_MISSING  # the first reason stays the reason


# ------------------------------------------------------------------------------------ cache, TTL, tokens


def test_cache_is_reused_within_its_age_and_only_for_the_same_bundle(tmp_path: Path, env: dict[str, str]) -> None:
    first = run_probe(tmp_path, env, fake_smi(tmp_path / "old", OLD))
    assert first.reason is Reason.BINARY_MISSING_NVIDIA_DETECTED and not first.cached
    again = run_probe(tmp_path, env, fake_smi(tmp_path / "new", H200), max_age=3600)
    assert again.cached and again.token == first.token and again.facts["driver"] == "551.61"
    fresh = run_probe(tmp_path, env, fake_smi(tmp_path / "new", H200), max_age=0)
    assert not fresh.cached and fresh.token > first.token and fresh.facts["driver"] == "580.95.05"
    installed(tmp_path)  # a newly installed bundle makes the cached answer stale
    after = run_probe(tmp_path, env, fake_smi(tmp_path / "new", H200), max_age=3600)
    assert not after.cached and after.reason is Reason.OK
    assert read_cached(tmp_path / "cache") == after


def test_an_older_probe_finishing_last_does_not_overwrite_a_newer_result(tmp_path: Path, env: dict[str, str]) -> None:
    gate, started = tmp_path / "gate", tmp_path / "started"
    slow = fake_smi(tmp_path / "slow", OLD, gate=gate, started=started)
    fast = fake_smi(tmp_path / "fast", H200)
    results: dict[str, ProbeResult] = {}
    older = threading.Thread(target=lambda: results.setdefault("older", run_probe(tmp_path, env, slow)))
    older.start()
    wait_for(started)  # the older probe has taken its token and is inside nvidia-smi
    newer = run_probe(tmp_path, env, fast)
    assert read_cached(tmp_path / "cache") == newer
    gate.touch()
    older.join(60)
    assert not older.is_alive()
    assert results["older"].token < newer.token
    assert results["older"].facts["driver"] == "551.61"  # it did finish, with its own answer...
    cached = read_cached(tmp_path / "cache")
    assert cached == newer and cached.facts["driver"] == "580.95.05"  # ...which was not written over the newer one
    # In order, a newer probe does replace an older result.
    latest = run_probe(tmp_path, env, slow)
    assert latest.token > newer.token and read_cached(tmp_path / "cache") == latest


def test_tokens_increase_across_processes(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    code = f"from pathlib import Path; from llamabundle.runtime.results import take_token; print(take_token(Path({str(cache)!r})))"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)}) for _ in range(4)]
    got = sorted(int(p.communicate(timeout=60)[0]) for p in procs)
    assert got == [1, 2, 3, 4]
    assert take_token(cache) == 5


# ------------------------------------------------------------------------------------ install on demand


def test_on_demand_installs_only_on_binary_missing_then_probes_again(tmp_path: Path, env: dict[str, str]) -> None:
    m = publish(tmp_path / "store", tmp_path)
    store = LocalStore(tmp_path / "store")
    kw = {"root": tmp_path / "data", "env": env, "log": QUIET, "cache_dir": tmp_path / "cache", "proc_version": tmp_path / "x"}
    none = ensure_backend(store=store, key=m.key, nvidia_smi=None, **kw)
    assert none.reason is Reason.GPU_MISSING and not (tmp_path / "data").exists()  # nothing installed without a GPU
    r = ensure_backend(store=store, key=m.key, nvidia_smi=str(fake_smi(tmp_path / "bin", H200)), **kw)
    assert (r.backend, r.reason, r.facts["bundle_key"]) == (Chosen.CUDA, Reason.OK, m.key)


def test_on_demand_installs_only_the_pinned_zip(tmp_path: Path, env: dict[str, str]) -> None:
    """install --if-needed pins the zip as a plain install does: another sha256 (or a digest list without the
    zip) is bundle_invalid on the CPU and nothing is installed; the right one installs and probes ok."""
    import hashlib

    from llamabundle.runtime.install import list_installed, load_digests

    m = publish(tmp_path / "store", tmp_path)
    store = LocalStore(tmp_path / "store")
    sha = hashlib.sha256(next((tmp_path / "store" / m.key).glob("*.zip")).read_bytes()).hexdigest()
    kw = {"root": tmp_path / "data", "env": env, "log": QUIET, "cache_dir": tmp_path / "cache",
          "proc_version": tmp_path / "x", "nvidia_smi": str(fake_smi(tmp_path / "bin", H200))}
    r = ensure_backend(store=store, key=m.key, expect_sha256="0" * 64, **kw)
    assert (r.backend, r.reason) == (Chosen.CPU, Reason.BUNDLE_INVALID) and "sha256" in r.facts["detail"]
    assert list_installed(tmp_path / "data") == []
    listed = tmp_path / "SHA256SUMS"
    listed.write_text(f"{sha}  some-other-bundle.zip\n")
    r = ensure_backend(store=store, key=m.key, digests=load_digests(listed), **kw)
    assert r.reason is Reason.BUNDLE_INVALID and "is not in the digest list" in r.facts["detail"]
    assert list_installed(tmp_path / "data") == []
    r = ensure_backend(store=store, key=m.key, expect_sha256=sha.upper(), **kw)
    assert (r.backend, r.reason, r.facts["bundle_key"]) == (Chosen.CUDA, Reason.OK, m.key)


def test_on_demand_with_a_failed_install_is_cpu_with_the_reason(tmp_path: Path, env: dict[str, str]) -> None:
    smi = str(fake_smi(tmp_path / "bin", H200))
    kw = {"root": tmp_path / "data", "env": env, "log": QUIET, "cache_dir": tmp_path / "cache",
          "proc_version": tmp_path / "x", "nvidia_smi": smi}
    r = ensure_backend(store=LocalStore(tmp_path / "empty"), key="ab" * 32, **kw)
    assert (r.backend, r.reason) == (Chosen.CPU, Reason.CUDA_BUNDLE_INSTALL_FAILED)
    assert r.sentence.startswith("installing the CUDA bundle failed: no bundle with key abababababab")
    assert read_cached(tmp_path / "cache") == r
    m = publish(tmp_path / "store", tmp_path, platform="windows-x86_64")
    r = ensure_backend(store=LocalStore(tmp_path / "store"), key=m.key, **kw)
    assert (r.backend, r.reason) == (Chosen.CPU, Reason.BUNDLE_INVALID)
    assert "built for windows-x86_64" in r.sentence


# ------------------------------------------------------------------------------------ command line


def test_cli_probe_json_without_a_gpu_and_with_an_old_driver(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LLAMABUNDLE_CACHE_DIR": str(tmp_path / "cache"),
           "LLAMABUNDLE_DATA_DIR": str(tmp_path / "data")}
    failing = fake_smi(tmp_path / "nogpu", rc=9, stderr="NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")
    p = cli("probe", "--json", "--nvidia-smi", str(failing), env=env)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert (out["backend"], out["reason"], out["schema"]) == ("cpu", "gpu_missing", 1)
    installed(tmp_path)
    old = fake_smi(tmp_path / "oldbin", OLD)
    p = cli("probe", "--json", "--max-age", "0", env={**env, "PATH": f"{old.parent}:/usr/bin:/bin"})
    out = json.loads(p.stdout)
    assert (out["backend"], out["reason"]) == ("cpu", "driver_too_old")
    assert out["facts"]["nvidia_smi"] == str(old)
    good = fake_smi(tmp_path / "goodbin", H200)
    p = cli("probe", "--ngl", "0", "--max-age", "0", "--nvidia-smi", str(good), env=env)
    assert p.returncode == 0, p.stderr
    assert "backend  cpu\nreason   cuda_gpu_layers_zero\n" in p.stdout


def test_the_cli_default_ttl_is_the_probe_default() -> None:
    from llamabundle.cli import app as cli_app
    from llamabundle.runtime import probe as probe_mod

    assert cli_app.DEFAULT_TTL == probe_mod.DEFAULT_TTL
