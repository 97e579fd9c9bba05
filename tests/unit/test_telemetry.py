"""telemetry: live GPU numbers only while a CUDA llama-server of a bundle runs, from a fake nvidia-smi that logs
each call; the "server" is a real child process (a copy of sleep inside the bundle directory). A 5 s cache,
one nvidia-smi run for concurrent callers (threads and processes), and an older sample never overwriting a
newer one."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llamabundle import gpus
from llamabundle.cli import telemetry as telemetry_cli
from llamabundle.runtime import results, telemetry
from llamabundle.runtime.install import list_installed
from llamabundle.runtime.telemetry import (
    CACHE,
    NVIDIA_SMI_ARGS,
    Inactive,
    Sample,
    read_sample,
    read_telemetry,
    store_sample,
)
from tests.clicontract import valid
from tests.clirun import run
from tests.probing import fake_smi as probe_fake_smi
from tests.probing import installed, make_stage
from tests.processes import wait_for

SLEEP = shutil.which("sleep") or "/bin/sleep"
GPU0 = "0, NVIDIA H200, 580.95.05, 37, 1234, 143771"
GPU1 = "1, NVIDIA RTX 6000 Ada Generation, 580.95.05, 0, 512, 49140"


def fake_smi(where: Path, *lines: str, **kw: Any) -> Path:
    """tests.probing's fake `nvidia-smi`, appending its arguments to `<where>/calls` (one line a call)."""
    return probe_fake_smi(where, *lines, calls=where / "calls", **kw)


def calls(smi: Path) -> list[str]:
    log = smi.parent / "calls"
    return log.read_text().splitlines() if log.exists() else []


@pytest.fixture()
def env(tmp_path: Path) -> dict[str, str]:
    return {"PATH": str(tmp_path / "emptybin"), "HOME": str(tmp_path)}


@pytest.fixture()
def bundle_dir(tmp_path: Path) -> Path:
    """The directory of an installed CUDA bundle (under tmp/data), its llama-server a copy of sleep."""
    installed(tmp_path)
    (inst,) = list_installed(tmp_path / "data")
    server = inst.path / "llama-server"
    server.unlink()
    shutil.copy(SLEEP, server)
    server.chmod(0o755)
    return inst.path


def start(exe: Path | str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([str(exe), "60"], stdin=subprocess.DEVNULL)


@pytest.fixture()
def server(bundle_dir: Path) -> Iterator[subprocess.Popen[bytes]]:
    p = start(bundle_dir / "llama-server")
    yield p
    p.kill()
    p.wait()


def tele(tmp: Path, env: dict[str, str], pid: int | None, smi: Path | None, **kw: Any) -> telemetry.Telemetry:
    kw.setdefault("root", tmp / "data")
    kw.setdefault("cache_dir", tmp / "cache")
    return read_telemetry(env=env, pid=pid, nvidia_smi=str(smi) if smi else None, **kw)


# ------------------------------------------------------------------------------------ not active


def test_without_a_pid_it_is_inactive_and_runs_nothing(tmp_path: Path, env: dict[str, str]) -> None:
    smi = fake_smi(tmp_path / "bin", GPU0)
    t = tele(tmp_path, env, None, smi)
    assert (t.active, t.reason) == (False, Inactive.SERVER_NOT_RUNNING) and "--pid" in t.detail
    assert t.to_json()["reason"] == "server_not_running" and calls(smi) == []


def test_a_dead_pid_and_a_zombie_are_not_running(tmp_path: Path, env: dict[str, str], bundle_dir: Path) -> None:
    smi = fake_smi(tmp_path / "bin", GPU0)
    p = start(bundle_dir / "llama-server")
    p.kill()
    p.wait()
    t = tele(tmp_path, env, p.pid, smi)
    assert (t.active, t.reason) == (False, Inactive.SERVER_NOT_RUNNING) and f"process {p.pid} is not running" in t.detail

    z = start(bundle_dir / "llama-server")
    os.kill(z.pid, signal.SIGKILL)  # not reaped: a zombie, which kill(pid, 0) still finds
    stat = Path(f"/proc/{z.pid}/stat")
    for _ in range(500):
        if stat.read_text().rpartition(")")[2].split()[0] == "Z":
            break
        time.sleep(0.01)
    try:
        t = tele(tmp_path, env, z.pid, smi)
        assert (t.active, t.reason) == (False, Inactive.SERVER_NOT_RUNNING) and "zombie" in t.detail
    finally:
        z.wait()
    assert calls(smi) == []


def test_a_server_outside_the_bundle_is_not_a_bundle_server(tmp_path: Path, env: dict[str, str], bundle_dir: Path) -> None:
    smi = fake_smi(tmp_path / "bin", GPU0)
    outside = tmp_path / "elsewhere" / "llama-server"
    outside.parent.mkdir()
    shutil.copy(SLEEP, outside)
    link = bundle_dir / "llama-server-link"  # a symlink in the bundle: the kernel names the real file
    link.symlink_to(outside)
    for exe in (outside, link):
        p = start(exe)
        try:
            t = tele(tmp_path, env, p.pid, smi)
        finally:
            p.kill()
            p.wait()
        assert (t.active, t.reason) == (False, Inactive.NOT_BUNDLE_SERVER), exe
        assert f"runs {outside.resolve()}, which is in no bundle installed in" in t.detail
    assert calls(smi) == []


def test_a_server_of_a_cpu_bundle_or_a_removed_one_is_not_a_cuda_bundle_server(tmp_path: Path, env: dict[str, str],
                                                                               bundle_dir: Path) -> None:
    smi = fake_smi(tmp_path / "bin", GPU0)
    installed(tmp_path, name="linux-x86_64-cpu", backends=("cpu",))
    cpu = next(i for i in list_installed(tmp_path / "data") if i.name == "linux-x86_64-cpu")
    shutil.copy(SLEEP, cpu.path / "sleepy")
    p = start(cpu.path / "sleepy")
    try:
        t = tele(tmp_path, env, p.pid, smi)
    finally:
        p.kill()
        p.wait()
    assert (t.reason, t.active) == (Inactive.NOT_BUNDLE_SERVER, False) and "has no CUDA backend" in t.detail

    p = start(bundle_dir / "llama-server")
    try:
        (bundle_dir / "llama-server").unlink()  # an install replaced it: the running one is gone from disk
        t = tele(tmp_path, env, p.pid, smi)
    finally:
        p.kill()
        p.wait()
    assert t.reason is Inactive.NOT_BUNDLE_SERVER and "(deleted)" in t.detail
    assert calls(smi) == []


def test_no_nvidia_smi(tmp_path: Path, env: dict[str, str], server: subprocess.Popen[bytes]) -> None:
    t = tele(tmp_path, env, server.pid, None)  # PATH holds none
    assert (t.active, t.reason, t.detail) == (False, Inactive.NO_NVIDIA_SMI, "nvidia-smi is not on PATH")
    t = tele(tmp_path, env, server.pid, tmp_path / "nope" / "nvidia-smi")
    assert t.reason is Inactive.NO_NVIDIA_SMI and "is not an executable file" in t.detail
    assert t.to_json()["bundle_dir"] == str(list_installed(tmp_path / "data")[0].path.resolve())


# ------------------------------------------------------------------------------------ active


def test_two_gpus_are_read(tmp_path: Path, env: dict[str, str], server: subprocess.Popen[bytes], bundle_dir: Path) -> None:
    smi = fake_smi(tmp_path / "bin", GPU0, GPU1)
    t = tele(tmp_path, env, server.pid, smi)
    assert (t.active, t.reason, t.cached) == (True, None, False)
    data = t.to_json()
    assert data["driver"] == "580.95.05" and data["server_exe"] == str((bundle_dir / "llama-server").resolve())
    assert data["gpus"] == [
        {"index": 0, "name": "NVIDIA H200", "utilization_pct": 37, "memory_used_mib": 1234, "memory_total_mib": 143771},
        {"index": 1, "name": "NVIDIA RTX 6000 Ada Generation", "utilization_pct": 0, "memory_used_mib": 512,
         "memory_total_mib": 49140}]
    assert data["bundle_key"] == list_installed(tmp_path / "data")[0].key and data["token"] >= 1
    assert calls(smi) == [" ".join(NVIDIA_SMI_ARGS)]
    valid("telemetry", {"schema": 1, "ok": True, **data})


def test_the_bundle_option_names_the_server_directory(tmp_path: Path, env: dict[str, str]) -> None:
    stage, manifest = make_stage(tmp_path)
    (stage / "llama-server").unlink()
    shutil.copy(SLEEP, stage / "llama-server")
    smi = fake_smi(tmp_path / "bin", GPU0)
    p = start(stage / "llama-server")
    try:
        t = tele(tmp_path, env, p.pid, smi, bundle=stage)
        other = tele(tmp_path, env, p.pid, smi, bundle=tmp_path / "bin")
    finally:
        p.kill()
        p.wait()
    assert t.active and t.to_json()["bundle_key"] == manifest.key and t.to_json()["bundle_dir"] == str(stage.resolve())
    assert other.reason is Inactive.NOT_BUNDLE_SERVER and "which is not in" in other.detail


def test_read_query_names_each_line_it_leaves_out() -> None:
    found, driver, bad = gpus.read_stats(f"{GPU0}\n2, NVIDIA A100, PCIe, 80GB, 580.95.05, [N/A], 10, [N/A]\n"
                                         "x, GPU, 580.95.05, 1, 2, 3\n0, GPU, 580.95.05, 101, 2, 3\nNo devices were found\n")
    assert driver == "580.95.05" and [(g.index, g.name, g.utilization_pct, g.memory_total_mib) for g in found] == [
        (0, "NVIDIA H200", 37, 143771), (2, "NVIDIA A100, PCIe, 80GB", None, None)]
    assert len(bad) == 3 and "is not a GPU index" in bad[0] and "is not a percentage" in bad[1]
    assert "not 6 comma-separated fields" in bad[2]


# ------------------------------------------------------------------------------------ TTL and debounce


def test_a_sample_younger_than_max_age_is_served_from_the_cache(tmp_path: Path, env: dict[str, str],
                                                                server: subprocess.Popen[bytes]) -> None:
    smi = fake_smi(tmp_path / "bin", GPU0, GPU1)
    now = [time.time()]
    first = tele(tmp_path, env, server.pid, smi, clock=lambda: now[0])
    now[0] += 2
    second = tele(tmp_path, env, server.pid, smi, clock=lambda: now[0])
    assert len(calls(smi)) == 1 and (first.cached, second.cached) == (False, True)
    assert second.to_json()["gpus"] == first.to_json()["gpus"] and second.sample == first.sample
    assert second.age_s is not None and 2 <= second.age_s < 3
    now[0] += 4  # 6 s after it was taken: older than the 5 s default
    third = tele(tmp_path, env, server.pid, smi, clock=lambda: now[0])
    assert len(calls(smi)) == 2 and not third.cached and third.sample and first.sample
    assert third.sample.token > first.sample.token
    for _ in range(2):
        assert not tele(tmp_path, env, server.pid, smi, max_age=0).cached
    assert len(calls(smi)) == 4
    other = fake_smi(tmp_path / "bin2", GPU0)  # a sample of another nvidia-smi is not served
    assert not tele(tmp_path, env, server.pid, other).cached and len(calls(other)) == 1


def test_the_server_is_checked_even_when_the_sample_is_cached(tmp_path: Path, env: dict[str, str], bundle_dir: Path) -> None:
    smi = fake_smi(tmp_path / "bin", GPU0)
    p = start(bundle_dir / "llama-server")
    assert tele(tmp_path, env, p.pid, smi).active
    p.kill()
    p.wait()
    assert tele(tmp_path, env, p.pid, smi).reason is Inactive.SERVER_NOT_RUNNING and len(calls(smi)) == 1


@pytest.mark.race
def test_concurrent_threads_share_one_nvidia_smi_run(tmp_path: Path, env: dict[str, str],
                                                     server: subprocess.Popen[bytes]) -> None:
    gate, started = tmp_path / "gate", tmp_path / "started"
    smi = fake_smi(tmp_path / "bin", GPU0, GPU1, gate=gate, started=started)
    results: list[telemetry.Telemetry] = []

    def one() -> None:
        results.append(tele(tmp_path, env, server.pid, smi, max_age=60))

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    wait_for(started)
    time.sleep(0.3)  # the others wait on the refresh lock (or come after the sample: they read the cache)
    gate.touch()
    for t in threads:
        t.join(timeout=60)
    assert len(calls(smi)) == 1 and len(results) == 8
    assert all(r.active for r in results) and len({r.sample.token for r in results if r.sample}) == 1
    assert sorted(r.cached for r in results) == [False] + [True] * 7


@pytest.mark.race
def test_concurrent_processes_share_one_nvidia_smi_run(tmp_path: Path, env: dict[str, str],
                                                       server: subprocess.Popen[bytes]) -> None:
    gate, started = tmp_path / "gate", tmp_path / "started"
    smi = fake_smi(tmp_path / "bin", GPU0, gate=gate, started=started)
    argv = [sys.executable, "-m", "llamabundle", "telemetry", "--json", "--pid", str(server.pid), "--nvidia-smi",
            str(smi), "--dest", str(tmp_path / "data"), "--max-age", "60"]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL) for _ in range(3)]
    try:
        wait_for(started)
        time.sleep(0.5)
        gate.touch()
        outs = [json.loads(p.communicate(timeout=60)[0]) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert len(calls(smi)) == 1
    assert [o["active"] for o in outs] == [True] * 3 and len({o["token"] for o in outs}) == 1
    assert sorted(o["cached"] for o in outs) == [False, True, True]
    for o in outs:
        valid("telemetry", o)


# ------------------------------------------------------------------------------------ the token guard


def _sample(token: int, util: int) -> Sample:
    found, driver, _ = gpus.read_stats(f"0, NVIDIA H200, 580.95.05, {util}, 1, 2")
    return Sample(token=token, sampled_at=int(time.time()), nvidia_smi="/x/nvidia-smi", gpus=tuple(found), driver=driver,
                  failure=None)


def test_an_older_sample_written_after_a_newer_one_is_discarded(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    older, newer = results.take_token(cache), results.take_token(cache)  # the cache's counter: taken before nvidia-smi runs
    assert newer > older
    assert store_sample(cache, _sample(newer, 22)) is True
    assert store_sample(cache, _sample(older, 11)) is False
    got = read_sample(cache)
    assert got is not None and got.token == newer and got.gpus[0].utilization_pct == 22
    assert [p.name for p in cache.iterdir() if p.name.startswith(f".{CACHE}.")] == []  # temp + rename, none left


def test_a_slow_refresh_finishing_last_does_not_overwrite_a_newer_sample(tmp_path: Path, env: dict[str, str],
                                                                         server: subprocess.Popen[bytes]) -> None:
    """A holds the refresh lock with a slow nvidia-smi; B gives up waiting, runs its own (a newer token) and
    writes first; A's older sample, written last, is discarded."""
    gate, started = tmp_path / "gate", tmp_path / "started"
    slow = fake_smi(tmp_path / "slow", GPU0.replace(", 37,", ", 11,"), gate=gate, started=started)
    fast = fake_smi(tmp_path / "fast", GPU0.replace(", 37,", ", 22,"))
    out: dict[str, telemetry.Telemetry] = {}
    a = threading.Thread(target=lambda: out.setdefault("a", tele(tmp_path, env, server.pid, slow)))
    a.start()
    wait_for(started)
    out["b"] = tele(tmp_path, env, server.pid, fast, lock_timeout=0.2)
    gate.touch()
    a.join(timeout=60)
    sa, sb = out["a"].sample, out["b"].sample
    assert sa is not None and sb is not None and sb.token > sa.token
    assert sa.gpus[0].utilization_pct == 11 and not out["a"].cached  # A's caller still gets what it read
    cached = read_sample(tmp_path / "cache")
    assert cached is not None and cached.token == sb.token and cached.gpus[0].utilization_pct == 22
    again = tele(tmp_path, env, server.pid, fast)
    assert again.cached and again.sample == sb and len(calls(fast)) == 1


# ------------------------------------------------------------------------------------ nvidia-smi failing


def test_a_failing_or_hanging_nvidia_smi_is_a_reason(tmp_path: Path, env: dict[str, str],
                                                     server: subprocess.Popen[bytes]) -> None:
    failing = fake_smi(tmp_path / "fail", rc=9, stderr="NVIDIA-SMI has failed because it couldn't communicate with "
                       "the NVIDIA driver")
    t = tele(tmp_path, env, server.pid, failing)
    assert (t.active, t.reason) == (False, Inactive.NVIDIA_SMI_FAILED)
    assert t.detail.startswith("nvidia-smi exited with 9: NVIDIA-SMI has failed") and t.to_json()["gpus"] == []
    assert tele(tmp_path, env, server.pid, failing).cached and len(calls(failing)) == 1  # a failure is debounced too

    hanging = fake_smi(tmp_path / "hang", GPU0, hang=True)
    t0 = time.monotonic()
    t = tele(tmp_path, env, server.pid, hanging, timeout=0.5)
    assert time.monotonic() - t0 < 10
    assert t.reason is Inactive.NVIDIA_SMI_FAILED and "did not answer in 0.5s" in t.detail

    garbage = fake_smi(tmp_path / "garbage", "No devices were found")
    t = tele(tmp_path, env, server.pid, garbage)
    assert t.reason is Inactive.NVIDIA_SMI_FAILED and "listed no GPU" in t.detail
    valid("telemetry", {"schema": 1, "ok": True, **t.to_json()})

    partly = fake_smi(tmp_path / "partly", GPU0, "garbage line")
    t = tele(tmp_path, env, server.pid, partly)
    assert t.active and "1 line(s) that are not GPUs" in t.detail


def test_the_defaults_are_probes(tmp_path: Path) -> None:
    import inspect

    params = inspect.signature(read_telemetry).parameters
    assert params["timeout"].default == gpus.SMI_TIMEOUT
    assert params["max_age"].default == telemetry.DEFAULT_MAX_AGE == telemetry_cli.DEFAULT_MAX_AGE == 5.0


# ------------------------------------------------------------------------------------ the command


def test_the_command_json_and_text(tmp_path: Path, capsys: pytest.CaptureFixture[str], server: subprocess.Popen[bytes]) -> None:
    smi = fake_smi(tmp_path / "bin", GPU0, GPU1)
    dest = tmp_path / "data"
    code, out, _ = run(capsys, "telemetry", "--json", "--pid", server.pid, "--nvidia-smi", smi, "--dest", dest)
    data = valid("telemetry", json.loads(out))
    assert code == 0 and data["active"] is True and [g["index"] for g in data["gpus"]] == [0, 1]
    cache = Path(os.environ["LLAMABUNDLE_CACHE_DIR"]) / "runtime"  # beside probe's cache
    assert (cache / CACHE).is_file() and json.loads((cache / CACHE).read_text())["token"] == data["token"]
    code, out, _ = run(capsys, "telemetry", "--pid", server.pid, "--nvidia-smi", smi, "--dest", dest)
    assert code == 0 and "active   yes" in out and "gpu 1    NVIDIA RTX 6000 Ada Generation: 0% busy, 512 / 49140 MiB" in out
    assert "(cached," in out and len(calls(smi)) == 1
    code, out, _ = run(capsys, "telemetry", "--json", "--dest", dest)
    data = valid("telemetry", json.loads(out))
    assert code == 0 and (data["active"], data["reason"]) == (False, "server_not_running")
    code, out, _ = run(capsys, "telemetry", "--dest", dest)
    assert code == 0 and out.startswith("active   no: server_not_running")
