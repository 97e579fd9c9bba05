"""doctor: what was found (GPUs, driver, installed bundles, the last probe), the reason and what to do,
from real fake nvidia-smi programs and real installed bundles."""

from __future__ import annotations

import json
from pathlib import Path

from llamabundle.reasons import Reason
from llamabundle.runtime.doctor import diagnose
from tests.probing import H200, NAME, OLD, cli, fake_smi, installed, run_probe


def test_doctor_names_the_old_driver_and_the_fix(tmp_path: Path) -> None:
    m = installed(tmp_path, floor="572.61")
    smi = fake_smi(tmp_path / "bin", OLD)
    env = {"PATH": str(tmp_path / "none")}
    d = diagnose(root=tmp_path / "data", env=env, cache_dir=tmp_path / "cache", nvidia_smi=str(smi),
                 proc_version=tmp_path / "none")
    assert d.result.reason is Reason.DRIVER_TOO_OLD
    assert d.advice == "driver 551.61 is older than 572.61 required by this bundle: update the NVIDIA driver to 572.61 or newer"
    rows = dict(d.rows())
    assert rows["GPU 0"] == "NVIDIA GeForce RTX 3060, 12288 MiB (11019 MiB free)"
    assert rows["driver"] == "551.61"
    assert rows[f"bundle {NAME}"].startswith(f"key {m.key[:12]}, llama.cpp 0c1e57098bba, backends cpu+cuda, CUDA 13.0.2, "
                                             "driver floor 572.61 (driver 551.61 is too old), installed ")
    assert rows["last probe"] == "none"
    assert (rows["backend"], rows["reason"]) == ("cpu", "driver_too_old")
    j = d.to_json()
    assert j["bundles"][0]["driver_ok"] is False and j["probe"]["reason"] == "driver_too_old"


def test_doctor_shows_the_last_probe_and_an_ok_result(tmp_path: Path) -> None:
    installed(tmp_path)
    env = {"PATH": str(tmp_path / "none")}
    earlier = run_probe(tmp_path, env, fake_smi(tmp_path / "old", OLD))
    d = diagnose(root=tmp_path / "data", env=env, cache_dir=tmp_path / "cache", nvidia_smi=str(fake_smi(tmp_path / "new", H200)),
                 proc_version=tmp_path / "none")
    assert d.last_probe == earlier
    rows = dict(d.rows())
    assert rows["last probe"].startswith("cpu / driver_too_old at ")
    assert (rows["backend"], rows["reason"]) == ("cuda", "ok")
    assert "(driver ok)" in rows[f"bundle {NAME}"]
    assert d.advice.startswith(f"the CUDA bundle {NAME} (")  # ok: no fix appended


def test_doctor_without_gpu_or_bundles_in_plain_text_and_json(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LLAMABUNDLE_CACHE_DIR": str(tmp_path / "cache"),
           "LLAMABUNDLE_DATA_DIR": str(tmp_path / "data")}
    failing = fake_smi(tmp_path / "bin", rc=9, stderr="NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.")
    p = cli("doctor", "--nvidia-smi", str(failing), env=env)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].split(None, 1) == ["GPU", ("none found (nvidia-smi exited with 9: NVIDIA-SMI has failed because it "
                                               "couldn't communicate with the NVIDIA driver.)")]
    assert f"bundles     none installed in {tmp_path / 'data'}" in lines
    assert "reason      gpu_missing" in lines
    assert lines[-1].startswith("no NVIDIA GPU was found (nvidia-smi exited with 9")
    p = cli("doctor", "--json", "--nvidia-smi", str(failing), env=env)
    j = json.loads(p.stdout)
    assert (j["schema"], j["gpus"], j["bundles"], j["probe"]["reason"]) == (1, [], [], "gpu_missing")
    assert j["last_probe"]["reason"] == "gpu_missing"  # the first doctor run's probe was cached


def test_doctor_names_the_nvidia_smi_line_it_did_not_believe(tmp_path: Path) -> None:
    smi = fake_smi(tmp_path / "bin", "GPU, 1.2.3.4.5.6.7.8.9, -5, NaN")
    d = diagnose(root=tmp_path / "data", env={"PATH": str(tmp_path / "none")}, cache_dir=tmp_path / "cache",
                 nvidia_smi=str(smi), proc_version=tmp_path / "none")
    assert d.result.reason is Reason.GPU_MISSING
    rows = dict(d.rows())
    assert rows["GPU"] == ("none found (nvidia-smi listed no GPU: 'GPU, 1.2.3.4.5.6.7.8.9, -5, NaN': driver version "
                           "'1.2.3.4.5.6.7.8.9' is not a version like 580.65.06)")
    assert rows["driver"] == "none" and d.to_json()["gpus"] == []
