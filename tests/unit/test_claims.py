"""What a bundle claims is bound to its key (issue 30): the backends it says it holds are the ones its key
inputs name, a backend's section belongs to a backend it holds, and the CUDA section's SASS and PTX are the
archs its inputs ask for. A CPU bundle re-zipped with `backends: [cpu, cuda]` passed verify, publish, fetch
and install before; each now refuses it (exit 5). `install` also compares the zip's bundle.json with the
store's record of it, as `fetch` does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from llamabundle import backends, bundle, digest, keys
from llamabundle.bundle import manifest as manifest_mod
from llamabundle.bundle.manifest import ManifestError
from tests import bundles as tb
from tests.clirun import run

ROOT = Path(__file__).resolve().parents[2]
LINUX = ROOT / "recipes" / "linux-x86_64-cpu.yaml"
FILES = {"llama-server": b"#!/bin/sh\nexit 0\n", "LICENSE": b"MIT License\n"}
ROLES = {"llama-server": "exe", "LICENSE": "license"}
CUDA_INPUTS = {"toolkit": "13.0.2", "components": ["cudart"], "archs": ["75-virtual", "90-real"], "driver_floor": None}


def _edited(tmp: Path, **fields: Any) -> tuple[Path, dict[str, Any]]:
    """A bundle of the Linux CPU recipe's inputs (its key is that recipe's) whose bundle.json claims `fields`."""
    stage = tmp / "stage"
    manifest = tb.write_bundle(stage, FILES, ROLES, name="linux-x86_64-cpu", inputs=tb.inputs_of(keys.load(LINUX)),
                               executables=("llama-server",), backends=["cpu"])
    (stage / bundle.MANIFEST).write_text(json.dumps({**manifest, **fields}))
    z = tmp / "edited.zip"
    bundle.pack(stage, z, source_date_epoch=0)
    return z, {**manifest, **fields}


CLAIMS = {
    "cuda-claimed": ({"backends": ["cpu", "cuda"]}, "it says backends cpu, cuda, its inputs say cpu"),
    "cpu-dropped": ({"backends": ["vulkan"]}, "it says backends vulkan, its inputs say cpu"),
    "vulkan-section": ({"vulkan": {"loader": "system"}}, "it has a vulkan section, its inputs name no such backend"),
}


@pytest.mark.parametrize("case", sorted(CLAIMS))
def test_an_edited_claim_fails_verify_and_publish(tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    fields, text = CLAIMS[case]
    z, _ = _edited(tmp_path, **fields)
    for argv in (["verify", z], ["publish", z, "--store", tmp_path / "store"]):
        code, out, err = run(capsys, *argv)
        assert code == 5 and text in err, (argv, code, err)
        assert "Traceback" not in err
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").iterdir())


@pytest.mark.parametrize("case", ["cuda-claimed", "vulkan-section"])
def test_an_edited_claim_fails_fetch_install_and_check_by_recipe(tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    fields, text = CLAIMS[case]
    z, m = _edited(tmp_path, **fields)
    entry = tmp_path / "store" / m["key"]
    entry.mkdir(parents=True)
    (entry / "b.zip").write_bytes(z.read_bytes())
    (entry / "SHA256SUMS").write_text(f"{digest.sha256_file(z)}  b.zip\n")
    (entry / bundle.MANIFEST).write_text(json.dumps(m))
    monkeypatch.setenv("LLAMABUNDLE_CACHE_DIR", str(tmp_path / "cache"))
    for argv in (["fetch", LINUX, "--store", tmp_path / "store", "--out", tmp_path / "out"],
                 ["install", "--recipe", LINUX, "--store", tmp_path / "store", "--dest", tmp_path / "apps"],
                 ["install", "--key", m["key"], "--store", tmp_path / "store", "--dest", tmp_path / "apps"]):
        code, out, err = run(capsys, *argv)
        assert code == 5 and text in err, (argv, code, err)
    assert not (tmp_path / "out").exists()
    assert not list((tmp_path / "apps").glob("bundles/linux-x86_64-cpu/*"))  # (its lock stays in bundles/.locks)


def _cuda_manifest(sass: list[str], ptx: list[str], **inputs: Any) -> manifest_mod.Manifest:
    ins = {**tb.inputs_for("cuda", cuda={**CUDA_INPUTS, **inputs}), "backends": ["cpu", "cuda"]}
    return manifest_mod.parse({"format": 1, "name": "b", "key": tb.key_of(ins), "inputs": ins,
                               "llama_cpp": {"commit": tb.COMMIT}, "platform": "linux-x86_64", "files": [],
                               "backends": ["cpu", "cuda"],
                               "cuda": {"toolkit": "13.0.2", "archs": {"sass": sass, "ptx": ptx}}})


def test_the_cuda_archs_a_bundle_records_are_the_ones_its_inputs_ask_for() -> None:
    good = _cuda_manifest(["90"], ["75"])
    manifest_mod.check_consistent(good)
    backends.read_sections(good)  # the trust step of verify, fetch and install
    for sass, ptx in ((["90", "100"], ["75"]), (["90"], []), ([], ["75", "90"])):
        edited = _cuda_manifest(sass, ptx)
        with pytest.raises(ManifestError, match="its inputs ask for SASS \\['90'\\] and PTX \\['75'\\]") as e:
            backends.read_sections(edited)
        assert e.value.exit_code == 5 and "part of its key" in e.value.why


def test_install_refuses_a_zip_whose_bundle_json_is_not_the_one_the_store_lists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                                capsys: pytest.CaptureFixture[str]) -> None:
    z, m = _edited(tmp_path)  # a good bundle
    entry = tmp_path / "store" / m["key"]
    entry.mkdir(parents=True)
    (entry / "b.zip").write_bytes(z.read_bytes())
    (entry / "SHA256SUMS").write_text(f"{digest.sha256_file(z)}  b.zip\n")
    (entry / bundle.MANIFEST).write_text(json.dumps({**m, "built_at": "2030-01-01T00:00:00Z"}))  # the store's record differs
    monkeypatch.setenv("LLAMABUNDLE_CACHE_DIR", str(tmp_path / "cache"))
    for argv in (["install", "--key", m["key"], "--store", tmp_path / "store", "--dest", tmp_path / "apps"],
                 ["fetch", m["key"], "--store", tmp_path / "store", "--out", tmp_path / "out"]):
        code, out, err = run(capsys, *argv)
        assert code == 5 and "is not the one" in err and "lists" in err, (argv, code, err)
    assert not list((tmp_path / "apps").glob("bundles/linux-x86_64-cpu/*"))  # (its lock stays in bundles/.locks)
