"""A consumer without Python (docs/consumer-walkthrough.md): tests/consumer/install.mjs, plain Node.js with its own
zip reader, installs a real bundle zip made by tests/bundles.py from a real local store, and refuses tampered
ones (a file changed inside the zip, the zip replaced, a bundle of another commit) with nothing installed.
Skipped where `node` is absent (Debian: apt-get install nodejs)."""

from __future__ import annotations

import json
import shutil
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import pytest

from llamabundle import digest
from llamabundle.bundle import manifest as manifest_mod
from llamabundle.runtime.install import check_bundle, list_installed
from llamabundle.store.local import SUMS, LocalStore
from tests import bundles as tb

REPO = Path(__file__).resolve().parents[2]
CONSUMER = REPO / "tests" / "consumer" / "install.mjs"
NODE = shutil.which("node") or shutil.which("nodejs")
pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed (Debian: apt-get install nodejs)")

SERVER = b'#!/bin/sh\necho "load_backend: loaded CPU backend from $(dirname "$0")/libggml-cpu.so" >&2\n'
FILES = {"llama-server": SERVER, "libggml-base.so": bytes(range(256)) * 300, "libggml-cpu.so": b"cpu backend\n" * 5000,
         "LICENSE": "MIT License \u00e9\n".encode(), "empty.txt": b""}
ROLES = {"llama-server": "exe", "libggml-base.so": "runtime", "libggml-cpu.so": "backend", "LICENSE": "license",
         "empty.txt": "license"}


def stored(tmp: Path, tag: str = "node", files: dict[str, bytes] | None = None) -> tuple[Path, dict[str, Any], Path]:
    """A bundle zip made by tests/bundles.py, published into a new local store: (store, manifest, stored zip)."""
    zip_path, m = tb.make_zip(tmp, files or FILES, ROLES, name=f"bundle-{tag}", inputs=tb.inputs_for(tag),
                              executables=("llama-server",), backends=["cpu"], zip_name=f"bundle-{tag}.zip")
    store = tmp / "store"
    entry = LocalStore(store).publish(zip_path, manifest_mod.parse(m)).entry
    return store, m, Path(entry.location)


def node(store: Path, key: str, dest: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    assert NODE is not None
    return subprocess.run([NODE, str(CONSUMER), "--store", str(store), "--key", key, "--dest", str(dest), *extra],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def rewrite(zip_path: Path, change: dict[str, bytes], *, compression: int = zipfile.ZIP_DEFLATED) -> None:
    """The zip again, members (and their modes) kept but those in `change`, and SHA256SUMS updated to match: a
    store entry whose digests agree, with a bundle inside that does not agree with its bundle.json."""
    with zipfile.ZipFile(zip_path) as z:
        members = [(info, z.read(info)) for info in z.infolist()]
    tmp = zip_path.with_suffix(".new")
    with zipfile.ZipFile(tmp, "w", compression=compression) as z:
        for info, data in members:
            info.compress_type = compression
            z.writestr(info, change.get(info.filename, data))
        for name in set(change) - {i.filename for i, _ in members}:
            z.writestr(name, change[name])
    tmp.replace(zip_path)
    (zip_path.parent / SUMS).write_text(f"{digest.sha256_file(zip_path)}  {zip_path.name}\n", encoding="utf-8")


def nothing_installed(dest: Path, name: str) -> None:
    slot = dest / "bundles" / name
    assert not (slot / "current").exists()
    assert not slot.exists() or list(slot.iterdir()) == []  # the stage is gone too


def test_node_installs_a_bundle_from_a_local_store_and_llamabundle_trusts_the_install(tmp_path: Path) -> None:
    store, m, _zip = stored(tmp_path)
    dest = tmp_path / "apps"
    r = node(store, m["key"], dest, "--expect-commit", tb.COMMIT, "--platform", "linux-x86_64")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["ok"] is True and out["key"] == m["key"] and out["files"] == len(FILES)
    path = Path(out["path"])
    assert path.parent == dest / "bundles" / m["name"]
    assert sorted(p.name for p in path.iterdir()) == sorted([*FILES, "bundle.json"])
    for rel, data in FILES.items():
        assert (path / rel).read_bytes() == data, rel
    assert (path / "llama-server").stat().st_mode & 0o777 == 0o755 and (path / "LICENSE").stat().st_mode & 0o777 == 0o644
    assert json.loads((path / "bundle.json").read_text(encoding="utf-8")) == m
    pointer = json.loads((path.parent / "current").read_text(encoding="utf-8"))
    assert pointer["dir"] == path.name and pointer["key"] == m["key"] and pointer["zip_sha256"] == out["zip_sha256"]
    # the install is the layout llamabundle's own install makes: list sees it, its trust check passes
    (inst,) = list_installed(dest)
    assert inst.key == m["key"] and inst.path == path
    check_bundle(path, key=m["key"], platform="linux-x86_64", commit=tb.COMMIT)
    # a second install replaces the first version directory only after the new one is in place
    again = node(store, m["key"], dest)
    assert again.returncode == 0, again.stderr
    assert [p.name for p in (dest / "bundles" / m["name"]).iterdir() if p.is_dir()] == [Path(json.loads(again.stdout)["path"]).name]


def test_node_reads_stored_members_too(tmp_path: Path) -> None:
    store, m, zip_path = stored(tmp_path)
    rewrite(zip_path, {}, compression=zipfile.ZIP_STORED)
    r = node(store, m["key"], tmp_path / "apps")
    assert r.returncode == 0, r.stderr
    assert (Path(json.loads(r.stdout)["path"]) / "libggml-base.so").read_bytes() == FILES["libggml-base.so"]


def test_node_refuses_a_file_changed_inside_the_zip(tmp_path: Path) -> None:
    store, m, zip_path = stored(tmp_path)
    rewrite(zip_path, {"libggml-cpu.so": b"CPU BACKEND\n" * 5000})  # same size, other bytes; SHA256SUMS agrees
    r = node(store, m["key"], tmp_path / "apps")
    assert r.returncode == 5, (r.stdout, r.stderr)
    assert "refused: libggml-cpu.so does not match its sha256 in bundle.json" in r.stderr
    nothing_installed(tmp_path / "apps", m["name"])


def test_node_refuses_a_replaced_zip(tmp_path: Path) -> None:
    store, m, zip_path = stored(tmp_path / "a")
    _other_store, _other, other_zip = stored(tmp_path / "b", tag="other", files={**FILES, "libggml-cpu.so": b"evil\n"})
    shutil.copyfile(other_zip, zip_path)  # a valid bundle, but not the zip SHA256SUMS names
    r = node(store, m["key"], tmp_path / "apps")
    assert r.returncode == 5, (r.stdout, r.stderr)
    assert f"refused: {zip_path.name} has sha256 {digest.sha256_file(other_zip)}, the store's SHA256SUMS says" in r.stderr
    nothing_installed(tmp_path / "apps", m["name"])


@pytest.mark.parametrize("case", ["extra file", "other commit", "other platform", "key of other inputs"])
def test_node_refuses_what_the_trust_check_refuses(tmp_path: Path, case: str) -> None:
    store, m, zip_path = stored(tmp_path)
    extra: list[str] = []
    if case == "extra file":
        rewrite(zip_path, {"libevil.so": b"not listed\n"})
    elif case == "other commit":
        extra = ["--expect-commit", "1" * 40]
    elif case == "other platform":
        extra = ["--platform", "windows-x86_64"]
    else:  # bundle.json edited: its inputs no longer hash to its key
        edited = {**m, "inputs": {**m["inputs"], "recipe": "edited"}}
        (zip_path.parent / "bundle.json").write_text(json.dumps(edited), encoding="utf-8")
    r = node(store, m["key"], tmp_path / "apps", *extra)
    assert r.returncode == 5, (r.stdout, r.stderr)
    assert {"extra file": "libevil.so is in the bundle but not in bundle.json",
            "other commit": f"it holds llama.cpp {tb.COMMIT}, expected {'1' * 40}",
            "other platform": "it is built for linux-x86_64, not windows-x86_64",
            "key of other inputs": "is not the sha256 of the inputs"}[case] in r.stderr
    nothing_installed(tmp_path / "apps", m["name"])


def test_node_says_when_the_store_lacks_the_key(tmp_path: Path) -> None:
    store, _m, _zip = stored(tmp_path)
    r = node(store, tb.key_for("absent"), tmp_path / "apps")
    assert r.returncode == 2 and "no bundle with key" in r.stderr


# ------------------------------------------------------------------ the backend, from the bundle's own probe

CHOOSER = REPO / "tests" / "consumer" / "backend.mjs"
H200 = REPO / "tests" / "data" / "h200"


def choose(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    assert NODE is not None
    r = subprocess.run([NODE, str(CHOOSER), *args], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stderr
    got: dict[str, Any] = json.loads(r.stdout)
    return got


@pytest.mark.parametrize(("record", "backend", "device", "env", "passed_over"), [
    ("probe-cuda-vulkan.json", "cuda", "CUDA0", {"GGML_VK_VISIBLE_DEVICES": ""}, []),
    ("probe-cuda.json", "cuda", "CUDA0", {}, []),
    ("probe-vulkan-refused.json", "cuda", "CUDA0", {"GGML_VK_VISIBLE_DEVICES": ""}, []),
    ("probe-built-cuda.json", "cuda", "CUDA0", {}, []),
    ("probe-built-no-libcudart.json", "cpu", "CPU", {},
     [{"backend": "cuda", "file": "libggml-cuda.so",
       "why": "the loader refused it: libcudart.so.13: cannot open shared object file: No such file or directory"}]),
    ("probe-no-libcudart.json", "cpu", "CPU", {},
     [{"backend": "cuda", "file": "libggml-cuda.so",
       "why": "the loader refused it: libcudart.so.13: cannot open shared object file: No such file or directory"}]),
])
def test_node_chooses_the_backend_from_the_h200_probe_answers(record: str, backend: str, device: str,
                                                             env: dict[str, str], passed_over: list[Any]) -> None:
    """What the bundles' own llamabundle-probe printed on the H200 (tests/data/h200), read by the Node chooser alone."""
    got = choose("--probe-json", str(H200 / record))
    assert (got["backend"], got["device"], got["server_env"], got["passed_over"]) == (backend, device, env, passed_over)
    assert got["server_args"] == ["--device", device if backend != "cpu" else "none"]
    if backend == "cuda":
        assert got["compute_capability"] == "9.0" and got["description"] == "NVIDIA H200" and got["memory_free"] > 10**11


def test_node_falls_back_to_vulkan_when_the_cuda_module_does_not_load(tmp_path: Path) -> None:
    """The CUDA+Vulkan answer with the CUDA module refused (as on a machine whose driver is too old for its
    runtime): Vulkan0 is chosen, CUDA hidden from llama-server, and the CUDA module's reason given."""
    got = json.loads((H200 / "probe-cuda-vulkan.json").read_text())
    (cuda,) = [m for m in got["modules"] if m["backend"] == "cuda"]
    cuda.update(opened=False, loaded=False, chosen=False, outcome="not_opened", registered=None,
                error="libcuda.so.1: cannot open shared object file: No such file or directory")
    got["devices"] = [d for d in got["devices"] if d["backend"] != "CUDA"]
    (tmp_path / "probe.json").write_text(json.dumps(got))
    out = choose("--probe-json", str(tmp_path / "probe.json"))
    assert (out["backend"], out["device"], out["server_env"]) == ("vulkan", "Vulkan0", {"CUDA_VISIBLE_DEVICES": ""})
    assert out["passed_over"] == [{"backend": "cuda", "file": "libggml-cuda.so",
                                   "why": f"the loader refused it: {cuda['error']}"}]


def test_node_installs_the_real_bundle_then_chooses_its_backend_from_its_probe(first_build: dict[str, Any], store: Path,
                                                                               recipe_key: str, tmp_path: Path) -> None:
    """The real CPU bundle of the shared e2e build, installed by Node from the store and asked by Node which
    backend runs: its llamabundle-probe, run from the install, answers (the CPU, no GPU module passed over)."""
    root = tmp_path / "apps"
    r = node(store, recipe_key, root)
    assert r.returncode == 0, r.stderr
    name = json.loads(r.stdout)["name"]
    got = choose("--dest", str(root), "--name", name)
    assert (got["backend"], got["device"], got["server_args"], got["passed_over"]) == ("cpu", "CPU", ["--device", "none"], [])
    assert got["memory_free"] > 0 and got["description"]
