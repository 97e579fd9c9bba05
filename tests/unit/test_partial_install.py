"""Partial installs (the layered-bundles issue, part 3): bundle.json's `parts` says which files only each GPU
backend needs (computed from the staged binaries' imports); `install --backends auto|LIST` installs the CPU
part and the chosen backends' parts, and the installed bundle.json says what it holds and what it was cut from;
adding a backend later downloads only what it adds. A bundle without `parts` is installed whole or not at all."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llamabundle import backends
from llamabundle.bundle import manifest as manifest_mod
from llamabundle.bundle import parts
from llamabundle.bundle.manifest import ManifestError, check_consistent
from llamabundle.errors import UsageError
from llamabundle.runtime.install import check_bundle, install_bundle, list_installed
from llamabundle.store.local import LocalStore
from tests.probing import QUIET, make_zip, publish

PLATFORM = "linux-x86_64"
ALL = ("cpu", "cuda", "vulkan")
REPO = Path(__file__).resolve().parents[2]


def test_split_puts_each_file_in_the_parts_of_the_backends_that_reach_it_and_the_cpu_part_wins() -> None:
    imports = {
        "llama-server": ["libllama.so", "libc.so.6"],
        "libllama.so": ["libggml-base.so"],
        "libggml-cpu-haswell.so": ["libggml-base.so", "libgomp.so.1"],
        "libggml-cuda.so": ["libggml-base.so", "libcublas.so.13", "libcudart.so.13", "libshared.so"],
        "libcublas.so.13": ["libcublasLt.so.13"],
        "libggml-vulkan.so": ["libggml-base.so", "libshared.so", "libvulkan.so.1"],
    }
    names = [*imports, "libggml-base.so", "libgomp.so.1", "libcublasLt.so.13", "libcudart.so.13", "libshared.so",
             "libnvrtc.so.13", "LICENSE", "LICENSE-CUDA.txt", "orphan.txt"]
    roots = {"cpu": ["llama-server", "libggml-cpu-haswell.so", "LICENSE"],
             "cuda": ["libggml-cuda.so", "libnvrtc.so.13", "LICENSE-CUDA.txt"], "vulkan": ["libggml-vulkan.so"]}
    got = parts.split(names, roots=roots, imports=lambda n: imports.get(n, []))
    assert got == {"cuda": ["LICENSE-CUDA.txt", "libcublas.so.13", "libcublasLt.so.13", "libcudart.so.13",
                            "libggml-cuda.so", "libnvrtc.so.13", "libshared.so"],
                   "vulkan": ["libggml-vulkan.so", "libshared.so"]}
    # PE names are matched without case, as Windows' loader matches them
    pe = parts.split(["ggml-cuda.dll", "CUBLAS64_12.dll", "llama-server.exe"], roots={"cpu": ["llama-server.exe"],
                     "cuda": ["ggml-cuda.dll"]}, imports=lambda n: ["cublas64_12.DLL"] if n == "ggml-cuda.dll" else [],
                     fold_case=True)
    assert pe == {"cuda": ["CUBLAS64_12.dll", "ggml-cuda.dll"]}


def store_with_parts(tmp: Path, **kw: object) -> tuple[Path, manifest_mod.Manifest]:
    store = tmp / "store"
    return store, publish(store, tmp, backends=ALL, parts=True, **kw)


def test_a_cpu_install_holds_the_cpu_part_says_so_and_adding_cuda_downloads_only_its_files(tmp_path: Path) -> None:
    store, m = store_with_parts(tmp_path)
    root = tmp_path / "data"
    cpu = install_bundle(LocalStore(store), m.key, root=root, log=QUIET, platform=PLATFORM, backends_wanted="cpu")
    held = cpu.installed.manifest
    assert held.backends == ("cpu",) and held.key == m.key
    assert sorted(p.name for p in cpu.installed.path.iterdir()) == ["LICENSE", "bundle.json", "libggml-cpu.so", "llama-server"]
    assert held.cut is not None and dict(held.cut) | {"from_manifest_sha256": ""} == {
        "from_backends": ("cpu", "cuda", "vulkan"), "dropped": ("cuda", "vulkan"), "by": "list",
        "why": {"cuda": "not asked for", "vulkan": "not asked for"}, "from_manifest_sha256": ""}
    assert held.sections.get("cuda") is None and held.to_json()["cuda"] is None and held.parts == {}
    check_bundle(cpu.installed.path, key=m.key, platform=PLATFORM)  # a checked bundle of its own
    cpu_bytes = sum(f.size for f in held.files)
    assert cpu.transfer.files == 3 and cpu.transfer.from_cache == 0

    both = install_bundle(LocalStore(store), m.key, root=root, log=QUIET, platform=PLATFORM, backends_wanted="cuda,cpu")
    assert both.installed.manifest.backends == ("cpu", "cuda") and both.replaced == m.key and not both.reused
    cuda_part = set(m.parts["cuda"]) if m.parts else set()
    assert both.transfer.fetched == len(cuda_part) == 3 and both.transfer.from_cache == cpu_bytes  # only what cuda adds
    assert {f.path for f in both.installed.manifest.files} == {f.path for f in held.files} | cuda_part
    again = install_bundle(LocalStore(store), m.key, root=root, log=QUIET, platform=PLATFORM, backends_wanted="cpu,cuda")
    assert again.reused
    whole = install_bundle(LocalStore(store), m.key, root=root, log=QUIET, platform=PLATFORM)
    assert whole.installed.manifest == m and whole.transfer.fetched == 1  # libggml-vulkan.so
    assert [i.key for i in list_installed(root)] == [m.key]


def test_auto_keeps_the_gpu_backends_whose_device_is_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store, m = store_with_parts(tmp_path)
    monkeypatch.setattr(type(backends.REGISTRY["cuda"]), "device_present", lambda self: True)
    monkeypatch.setattr(type(backends.REGISTRY["vulkan"]), "device_present", lambda self: False)
    got = install_bundle(LocalStore(store), m.key, root=tmp_path / "data", log=QUIET, platform=PLATFORM,
                         backends_wanted="auto")
    held = got.installed.manifest
    assert held.backends == ("cpu", "cuda") and held.cut is not None and held.cut["by"] == "auto"
    assert held.cut["why"] == {"cuda": "an NVIDIA GPU and driver: found here",
                               "vulkan": f"{backends.REGISTRY['vulkan'].device_hint}: not found here"}
    assert "libggml-vulkan.so" not in {f.path for f in held.files}


def test_a_zip_install_is_cut_after_its_whole_check(tmp_path: Path) -> None:
    store, m = store_with_parts(tmp_path)
    entry = LocalStore(store).lookup(m.key)
    assert entry is not None
    got = install_bundle(LocalStore(store), m.key, root=tmp_path / "data", log=QUIET, platform=PLATFORM,
                         backends_wanted="vulkan", expect_sha256=entry.zip_sha256)  # a pin reads the zip
    assert got.transfer.by == "zip" and got.installed.manifest.backends == ("cpu", "vulkan")
    assert sorted(p.name for p in got.installed.path.iterdir()) == ["LICENSE", "bundle.json", "libggml-cpu.so",
                                                                    "libggml-vulkan.so", "llama-server"]
    check_bundle(got.installed.path, key=m.key, platform=PLATFORM)


def test_what_cannot_be_cut_is_a_usage_error_and_installs_nothing(tmp_path: Path) -> None:
    store, m = store_with_parts(tmp_path)
    root = tmp_path / "data"
    with pytest.raises(UsageError) as e:
        install_bundle(LocalStore(store), m.key, root=root, log=QUIET, platform=PLATFORM, backends_wanted="cuda,rocm")
    assert e.value.what.startswith("--backends 'cuda,rocm' names rocm, which") and "cpu, cuda, vulkan" in e.value.why
    old = tmp_path / "old"
    zip_path, plain = make_zip(old, backends=ALL)  # packed before parts: whole or nothing
    LocalStore(old / "store").publish(zip_path, plain)
    with pytest.raises(UsageError) as e:
        install_bundle(LocalStore(old / "store"), plain.key, root=root, log=QUIET, platform=PLATFORM, backends_wanted="cpu")
    assert "cannot be installed in part" in e.value.what and "install it whole" in e.value.fix
    assert list_installed(root) == []
    whole = install_bundle(LocalStore(old / "store"), plain.key, root=root, log=QUIET, platform=PLATFORM,
                           backends_wanted="cpu,cuda,vulkan")  # all of them: no cut needed
    assert whole.installed.manifest == plain


def test_a_cut_manifest_is_checked_against_its_inputs(tmp_path: Path) -> None:
    _store, m = store_with_parts(tmp_path)
    cut = parts.cut(m, parts.Choice(backends=("cpu", "cuda"), why={}, by="list"))
    check_consistent(cut)
    data = cut.to_json()
    bad = [
        ({**data, "backends": ["cuda"]}, "a partial install holds the CPU part"),
        ({**data, "cut": {**data["cut"], "dropped": []}}, "says it dropped none"),
        ({**data, "cut": {**data["cut"], "from_backends": ["cpu", "cuda"]}}, "its inputs say cpu, cuda, vulkan"),
        ({**data, "vulkan": {"toolkit": None}}, "vulkan section"),
    ]
    for edited, said in bad:
        with pytest.raises(ManifestError) as e:
            check_consistent(manifest_mod.parse(edited))
        assert said in e.value.what + e.value.why, (said, e.value.what)
    with pytest.raises(ManifestError, match="'parts.cuda\\[0\\]' is 'nowhere.so', which the bundle does not list"):
        manifest_mod.parse({**m.to_json(), "parts": {"cuda": ["nowhere.so"]}})
    with pytest.raises(ManifestError, match="'parts.cpu' names a backend"):
        manifest_mod.parse({**m.to_json(), "parts": {"cpu": []}})


def test_the_cli_installs_a_part_and_says_which(tmp_path: Path) -> None:
    store, m = store_with_parts(tmp_path)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LLAMABUNDLE_CACHE_DIR": str(tmp_path / "cache"),
           "PYTHONPATH": str(REPO), "NO_COLOR": "1"}
    r = subprocess.run([sys.executable, "-m", "llamabundle", "install", "--store", str(store), "--key", m.key,
                        "--dest", str(tmp_path / "data"), "--backends", "cpu", "--json"],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["backends"] == ["cpu"] and out["transfer"]["files"] == 3
    assert "backends: cpu; cuda: not asked for; vulkan: not asked for" in r.stderr
    shutil.rmtree(tmp_path / "data")
