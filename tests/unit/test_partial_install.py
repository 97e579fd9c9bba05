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
from tests.ghstore import Captured
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


# ------------------------------------------------------------- auto: the bundle's probe asks the drivers

def drivers_answer(cuda: dict[str, object] | None = None, vulkan: dict[str, object] | None = None) -> str:
    from tests.unit.test_drivers import answer

    return json.dumps(answer(cuda, vulkan))


def h200(version: str = "13.0", cc: str = "9.0") -> dict[str, object]:
    from tests.unit.test_drivers import H200, cuda

    major, minor = version.split(".")
    return cuda(devices=[{**H200, "compute_capability": cc}], device_count=1, cuda_version=version,
                driver_version=int(major) * 1000 + int(minor) * 10)


def test_auto_asks_the_drivers_through_the_cpu_part_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU part (its llamabundle-probe with it) is fetched first; the drivers' answer keeps CUDA (an H200 with
    a CUDA 13 driver, served by the bundle's sm_90 SASS) and leaves Vulkan out (lavapipe is a CPU); what the
    device files say is not asked."""
    monkeypatch.setattr(type(backends.REGISTRY["cuda"]), "device_present", lambda self: False)
    monkeypatch.setattr(type(backends.REGISTRY["vulkan"]), "device_present", lambda self: True)
    store, m = store_with_parts(tmp_path, drivers=drivers_answer(h200()))
    root = tmp_path / "data"
    got = install_bundle(LocalStore(store), m.key, root=root, log=QUIET, platform=PLATFORM, backends_wanted="auto")
    held = got.installed.manifest
    assert held.backends == ("cpu", "cuda") and held.cut is not None and held.cut["by"] == "auto"
    assert held.cut["why"]["cuda"] == "NVIDIA Fake H200 (9.0) with CUDA 13.0 (llamabundle-probe --drivers)"
    assert held.cut["why"]["vulkan"].startswith("the Vulkan loader lists only CPU implementations: llvmpipe")
    assert "llamabundle-probe" in {f.path for f in held.files} and "libggml-vulkan.so" not in {f.path for f in held.files}
    # the CPU part fetched once (the install linked it again), then CUDA's part: each file downloaded once
    assert got.transfer.fetched == len(held.files) and got.transfer.from_cache == 0
    again = install_bundle(LocalStore(store), m.key, root=root, log=QUIET, platform=PLATFORM, backends_wanted="auto")
    assert again.reused  # the installed part's own probe answered the same


@pytest.mark.parametrize(("said", "why"), [
    (h200("12.8"), "the NVIDIA driver runs CUDA 12.8, the bundle's runtime is CUDA 13.0.2 (driver 572.61 or newer)"),
    (h200(cc="7.0"), "CUDA0 (compute capability 7.0) is listed, but no kernel of the bundle runs on it"),
    (None, "libcuda.so.1 did not open: libcuda.so.1: cannot open shared object file"),
])
def test_auto_leaves_cuda_out_when_the_driver_cannot_run_it(tmp_path: Path, said: dict[str, object] | None,
                                                            why: str) -> None:
    from tests.unit.test_drivers import NO_CUDA

    store, m = store_with_parts(tmp_path, drivers=drivers_answer(NO_CUDA if said is None else said))
    got = install_bundle(LocalStore(store), m.key, root=tmp_path / "data", log=QUIET, platform=PLATFORM,
                         backends_wanted="auto")
    held = got.installed.manifest
    assert held.backends == ("cpu",) and held.cut is not None
    assert why in held.cut["why"]["cuda"] and held.cut["why"]["cuda"].endswith("(llamabundle-probe --drivers)")


def test_auto_with_a_probe_that_gives_no_answer_says_so_and_reads_the_device_files(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(type(backends.REGISTRY["cuda"]), "device_present", lambda self: True)
    monkeypatch.setattr(type(backends.REGISTRY["vulkan"]), "device_present", lambda self: False)
    store, m = store_with_parts(tmp_path, drivers="exit 2")  # a probe older than --drivers
    cap = Captured()
    got = install_bundle(LocalStore(store), m.key, root=tmp_path / "data", log=cap.log, platform=PLATFORM,
                         backends_wanted="auto")
    assert got.installed.manifest.backends == ("cpu", "cuda")
    assert "llamabundle-probe --drivers exited with 2" in cap.text and "by their drivers' files" in cap.text


def test_auto_from_a_pinned_zip_asks_the_unpacked_bundle(tmp_path: Path) -> None:
    """A zip pin reads the zip: the whole bundle is unpacked and checked, its probe answers, then it is cut."""
    from llamabundle.digest import sha256_file

    store, m = store_with_parts(tmp_path, drivers=drivers_answer(h200()))
    (zip_path,) = (store / m.key).glob("*.zip")
    got = install_bundle(LocalStore(store), m.key, root=tmp_path / "data", log=QUIET, platform=PLATFORM,
                         backends_wanted="auto", expect_sha256=sha256_file(zip_path))
    assert got.installed.manifest.backends == ("cpu", "cuda") and got.transfer.by == "zip"
    assert sorted(p.name for p in got.installed.path.iterdir()) == sorted(
        [f.path for f in got.installed.manifest.files] + ["bundle.json"])
