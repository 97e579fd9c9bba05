"""CUDA toolkit from redist archives: the pinned manifests, planning, and installs of SMALL archives
with the real layout served by a real HTTP server on 127.0.0.1 (faults injected there): tests/redist.py,
as the `repo` fixture."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from llamabundle import data, keys
from llamabundle.backends.cuda.toolkit import layout, redist
from llamabundle.backends.cuda.toolkit.manifest import load_manifest
from llamabundle.backends.cuda.toolkit.plan import (
    IMPLIED_COMPONENTS,
    plan_for_recipe,
    plan_toolkit,
)
from llamabundle.errors import ToolchainError, UsageError
from tests.redist import COMMON_H, NVCC, WINDOWS_12_8_1_TOTAL, WINDOWS_RECIPE, Repo, leftovers

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------ the pinned data


@pytest.mark.parametrize("version", sorted(data.cuda_toolkits()))
def test_every_pinned_manifest_parses(version: str) -> None:
    m = load_manifest(version=version)
    assert m.release == version and len(m.pin) == 64
    for comp, info in m.components.items():
        for plat in ("linux-x86_64", "windows-x86_64"):
            if plat in info:
                a = m.archive(comp, plat)
                assert a.size > 0 and a.name.endswith(".zip" if plat.startswith("windows") else ".tar.xz")
                assert a.url("https://x/redist/") == f"https://x/redist/{a.relative_path}"


def test_windows_12_8_1_plan_totals_exactly() -> None:
    plan = plan_for_recipe(keys.load(WINDOWS_RECIPE))
    assert plan.total_bytes == WINDOWS_12_8_1_TOTAL
    assert [a.component for a in plan.archives] == ["cuda_nvcc", "cuda_cudart", "libcublas", "libnvjitlink",
                                                     "cuda_nvrtc", "libnvfatbin", "cuda_cccl"]
    assert not any(a.added_by for a in plan.archives)
    assert all(a.archive.name.endswith("-archive.zip") for a in plan.archives)
    assert plan.components["cuda_nvcc"] == "12.8.93"


def test_13x_adds_crt_and_nvvm_from_the_table() -> None:
    assert IMPLIED_COMPONENTS["13"]["cuda_nvcc"] == ("cuda_crt", "libnvvm")
    plan = plan_toolkit(version="13.0.2", components=["cuda_nvcc", "cuda_cudart"], platform="linux-x86_64")
    assert [(a.component, a.added_by) for a in plan.archives] == [
        ("cuda_nvcc", None), ("cuda_crt", "cuda_nvcc"), ("libnvvm", "cuda_nvcc"), ("cuda_cudart", None)]
    assert plan.archives[1].note == "added: needed by cuda_nvcc in 13.x"
    # asked for explicitly: not "added"
    plan = plan_toolkit(version="13.0.1", components=["cuda_crt", "cuda_nvcc"], platform="windows-x86_64")
    assert [(a.component, a.added_by) for a in plan.archives] == [
        ("cuda_crt", None), ("cuda_nvcc", None), ("libnvvm", "cuda_nvcc")]
    # 12.x: nvcc carries them itself
    plan = plan_toolkit(version="12.8.1", components=["cuda_nvcc"], platform="linux-x86_64")
    assert [a.component for a in plan.archives] == ["cuda_nvcc"]


def test_content_address_depends_on_components_platform_and_pin(tmp_path: Path) -> None:
    a = plan_toolkit(version="12.8.1", components=["cuda_nvcc", "cuda_cudart"], platform="linux-x86_64")
    b = plan_toolkit(version="12.8.1", components=["cuda_cudart", "cuda_nvcc"], platform="linux-x86_64")
    c = plan_toolkit(version="12.8.1", components=["cuda_nvcc"], platform="linux-x86_64")
    d = plan_toolkit(version="12.8.1", components=["cuda_nvcc", "cuda_cudart"], platform="windows-x86_64")
    assert a.root(tmp_path) == b.root(tmp_path)
    assert len({a.root(tmp_path), c.root(tmp_path), d.root(tmp_path)}) == 3
    assert a.root(tmp_path).parent == tmp_path / "toolkits"


def test_manifest_explicit_path_or_dict(tmp_path: Path) -> None:
    raw = json.loads((ROOT / "llamabundle" / "data" / "cuda" / "redistrib_12.8.1.json").read_text())
    p = tmp_path / "m.json"
    p.write_text(json.dumps(raw))
    assert load_manifest(p).pin == load_manifest(raw).pin == load_manifest(version="12.8.1").pin
    with pytest.raises(ToolchainError, match="for CUDA 12.8.1, not 13.0.2"):
        load_manifest(p, version="13.0.2")
    with pytest.raises(ToolchainError, match="not pinned"):
        load_manifest(version="11.0.0")
    with pytest.raises(ToolchainError, match="no such manifest"):
        load_manifest(tmp_path / "missing.json")


@pytest.mark.parametrize("change, match", [
    ({"relative_path": "../../etc/x-archive.tar.xz"}, "relative_path"),
    ({"relative_path": "/abs/x-archive.tar.xz"}, "relative_path"),
    ({"relative_path": "a/x-archive.exe"}, "relative_path"),
    ({"sha256": "abc"}, "sha256"),
    ({"size": "-1"}, "size"),
    ({"size": "many"}, "size"),
])
def test_manifest_entries_are_checked(change: dict[str, str], match: str) -> None:
    entry = {"relative_path": "c/linux-x86_64/c-archive.tar.xz", "sha256": "0" * 64, "size": "10", **change}
    m = load_manifest({"release_label": "13.0.2", "cuda_x": {"version": "1.0", "linux-x86_64": entry}})
    with pytest.raises(ToolchainError) as e:
        m.archive("cuda_x", "linux-x86_64")
    assert match in (e.value.why + e.value.what)


def test_unknown_component_or_platform_is_a_toolkit_error() -> None:
    with pytest.raises(ToolchainError, match="not a component of CUDA 12.8.1"):
        plan_toolkit(version="12.8.1", components=["cuda_nvcc", "cuda_nope"], platform="linux-x86_64")
    with pytest.raises(ToolchainError, match="no windows-x86_64 archive of cuda_compat"):
        plan_toolkit(version="12.8.1", components=["cuda_nvcc", "cuda_compat"], platform="windows-x86_64")
    with pytest.raises(UsageError, match="the components cuda_cudart have no cuda_nvcc"):  # what was asked: exit 2
        plan_toolkit(version="12.8.1", components=["cuda_cudart"], platform="linux-x86_64")
    with pytest.raises(ToolchainError, match="source 'installer'"):
        plan_toolkit(version="12.8.1", components=["cuda_nvcc"], platform="linux-x86_64", source="installer")


# ------------------------------------------------------------------------------------- installs


def test_install_assembles_the_layout(repo: Repo) -> None:
    plan = repo.plan(["cuda_nvcc", "cuda_cudart"])
    assert redist.cached_map(plan, repo.cache) == dict.fromkeys(plan.components, False)
    res = repo.install(plan)
    root = plan.root(repo.cache)
    assert not res.reused and res.toolkit.root == root and res.downloaded_bytes == plan.total_bytes
    assert sorted(res.downloaded) == sorted(a.archive.name for a in plan.archives)
    assert redist.cached_map(plan, repo.cache) == dict.fromkeys(plan.components, True)
    # flattened: no archive top directories left
    assert sorted(p.name for p in root.iterdir()) == sorted([
        "LICENSE.cuda_crt", "LICENSE.cuda_cudart", "LICENSE.cuda_nvcc", "LICENSE.libnvvm", layout.MARKER,
        "bin", "include", "lib", "lib64", "nvvm", "version.json"])
    assert (root / "LICENSE.cuda_cudart").read_bytes() == b"cudart license\n"
    assert (root / "bin" / "nvcc").read_bytes() == NVCC and os.access(root / "bin" / "nvcc", os.X_OK)
    assert (root / "include" / "crt" / "host_config.h").is_file()  # cuda_crt (13.x)
    assert (root / "nvvm" / "libdevice" / "libdevice.10.bc").is_file()  # libnvvm (13.x)
    assert (root / "include" / "common.h").read_bytes() == COMMON_H  # the same file in two components is fine
    # symlinks kept
    assert os.readlink(root / "lib" / "libcudart.so.13") == "libcudart.so.13.0.96"
    assert os.readlink(root / "lib" / "libcudart.so") == "libcudart.so.13"
    assert (root / "lib" / "libcudart.so").read_bytes() == b"\x7fELF cudart\n"
    assert os.readlink(root / "lib64") == "lib" and (root / "lib64" / "libcudart.so.13.0.96").is_file()
    version = json.loads((root / "version.json").read_text())
    assert version["cuda"]["version"] == "13.0.2"
    assert {k: v["version"] for k, v in version.items() if k != "cuda"} == {
        "cuda_nvcc": "13.0.88", "cuda_crt": "13.0.88", "libnvvm": "13.0.88", "cuda_cudart": "13.0.96"}
    marker = json.loads((root / layout.MARKER).read_text())
    assert marker["components"] == dict(sorted(plan.components.items())) and marker["source"] == "redist"
    tk = layout.read_installed(root)
    assert tk is not None and tk.version == "13.0.2" and tk.nvcc == root / "bin" / "nvcc"
    assert tk.lib_dirs[0] == root / "lib"
    # downloads cached by sha256
    a = plan.archives[0].archive
    assert (repo.cache / "downloads" / a.sha256 / a.name).is_file()
    assert leftovers(repo) == []


def test_install_windows_zip_layout(repo: Repo) -> None:
    plan = repo.plan(["cuda_nvcc", "cuda_cudart"], platform="windows-x86_64")
    res = repo.install(plan)
    root = res.toolkit.root
    assert (root / "bin" / "nvcc.exe").is_file() and (root / "bin" / "cudart64_13.dll").is_file()
    assert (root / "lib" / "x64" / "cudart.lib").is_file() and (root / "nvvm" / "bin" / "cicc.exe").is_file()
    assert not (root / "lib64").exists()
    assert (root / "LICENSE.libnvvm").read_bytes() == b"nvvm license\n"
    assert res.toolkit.lib_dirs == [root / "bin", root / "lib" / "x64"]
    assert layout.read_installed(root) is not None


def test_second_install_downloads_nothing(repo: Repo) -> None:
    plan = repo.plan(["cuda_nvcc", "cuda_cudart"])
    repo.install(plan)
    repo.server.reset()
    res = repo.install(plan)  # its time is measured by bench/toolkit_bytes.py, not asserted here
    assert res.reused and res.downloaded_bytes == 0 and res.downloaded == []
    assert repo.server.requests == [] and repo.server.bytes_sent == 0


def test_cached_downloads_are_rehashed_before_reuse(repo: Repo) -> None:
    plan = repo.plan(["cuda_nvcc", "cuda_cudart"])
    root = repo.install(plan).toolkit.root
    shutil.rmtree(root)
    # same size, other bytes: re-hashing notices and fetches it again; the others come from the cache
    a = plan.archives[-1].archive
    cached = redist.download_path(repo.cache, a)
    cached.write_bytes(b"\0" * a.size)
    repo.server.reset()
    res = repo.install(plan)
    assert res.downloaded == [a.name] and repo.server.paths() == [a.relative_path]
    assert sorted(res.from_cache) == sorted(x.archive.name for x in plan.archives[:-1])
    assert layout.read_installed(root) is not None


def test_hash_mismatch_fails_and_leaves_nothing(repo: Repo) -> None:
    manifest = json.loads(json.dumps(repo.manifest))
    manifest["cuda_cudart"]["linux-x86_64"]["sha256"] = "f" * 64
    plan = repo.plan(["cuda_nvcc", "cuda_cudart"], manifest=manifest)
    with pytest.raises(ToolchainError, match="sha256 mismatch"):
        repo.install(plan)
    assert not plan.root(repo.cache).exists()
    assert not redist.download_path(repo.cache, plan.archives[-1].archive).exists()
    assert leftovers(repo) == []


def test_size_mismatch_fails(repo: Repo) -> None:
    manifest = json.loads(json.dumps(repo.manifest))
    manifest["cuda_cudart"]["linux-x86_64"]["size"] = "12"
    plan = repo.plan(["cuda_nvcc", "cuda_cudart"], manifest=manifest)
    with pytest.raises(ToolchainError, match="size mismatch"):
        repo.install(plan)
    assert not plan.root(repo.cache).exists() and leftovers(repo) == []


def test_http_500_is_retried(repo: Repo) -> None:
    plan = repo.plan(["cuda_nvcc", "cuda_cudart"])
    rel = repo.rel("cuda_cudart")
    repo.server.faults[rel] = ["500", "500"]
    res = repo.install(plan)
    assert [p for p in repo.server.paths() if p == rel] == [rel, rel, rel]
    assert res.downloaded_bytes == plan.total_bytes and layout.read_installed(res.toolkit.root) is not None


def test_truncated_download_is_resumed(repo: Repo) -> None:
    plan = repo.plan(["cuda_nvcc", "cuda_cudart"])
    rel = repo.rel("cuda_cudart")
    size = plan.archives[-1].archive.size
    repo.server.faults[rel] = ["truncate"]
    res = repo.install(plan)
    assert [r for r in repo.server.requests if r[0] == rel] == [(rel, None), (rel, f"bytes={size // 2}-")]
    assert repo.server.bytes_sent == plan.total_bytes  # half, then the other half: nothing twice
    assert layout.read_installed(res.toolkit.root) is not None and leftovers(repo) == []


def test_overlapping_files_with_different_content_fail(repo: Repo) -> None:
    plan = repo.plan(["cuda_nvcc", "cuda_cudart", "cuda_conflict"])
    with pytest.raises(ToolchainError) as e:
        repo.install(plan)
    assert "cuda_cudart and cuda_conflict both ship include/cuda_runtime.h" in e.value.what
    assert not plan.root(repo.cache).exists() and leftovers(repo) == []


def test_unsafe_archive_is_refused(repo: Repo) -> None:
    plan = repo.plan(["cuda_nvcc", "cuda_evil"])
    with pytest.raises(ToolchainError, match="cannot extract"):
        repo.install(plan)
    assert not plan.root(repo.cache).exists() and leftovers(repo) == []
    assert not (repo.cache / "evil").exists() and not (repo.cache.parent / "evil").exists()


def test_tampered_root_is_detected_and_repaired(repo: Repo) -> None:
    plan = repo.plan(["cuda_nvcc", "cuda_cudart"])
    root = repo.install(plan).toolkit.root
    (root / "include" / "cuda_runtime.h").unlink()
    with pytest.raises(ToolchainError, match="incomplete or was changed"):
        layout.read_installed(root)
    with pytest.raises(ToolchainError):
        redist.installed(plan, root)
    repo.server.reset()
    res = repo.install(plan)  # reinstalled from the download cache
    assert not res.reused and res.downloaded == [] and repo.server.requests == []
    assert (root / "include" / "cuda_runtime.h").is_file() and layout.read_installed(root) is not None
    assert leftovers(repo) == []


def test_dest_directory(repo: Repo, tmp_path: Path) -> None:
    plan = repo.plan(["cuda_nvcc"])
    dest = tmp_path / "tk"
    res = repo.install(plan, dest=dest)
    assert res.toolkit.root == dest and (dest / "bin" / "nvcc").is_file()
    assert repo.install(plan, dest=dest).reused
    # another plan into the same directory: refused, nothing overwritten
    with pytest.raises(ToolchainError, match="holds a different toolkit"):
        repo.install(repo.plan(["cuda_nvcc", "cuda_cudart"]), dest=dest)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(ToolchainError, match="not a toolkit installed by llamabundle"):
        repo.install(plan, dest=foreign)
    assert (foreign / "notes.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert repo.install(plan, dest=empty).toolkit.root == empty


@pytest.mark.race
def test_stale_temp_tree_of_a_killed_install_is_cleaned(repo: Repo) -> None:
    plan = repo.plan(["cuda_nvcc"])
    root = plan.root(repo.cache)
    stale = root.with_name(f".{root.name}.tmp-99999-deadbeef")
    (stale / "bin").mkdir(parents=True)
    repo.install(plan)
    assert not stale.exists() and leftovers(repo) == []


def test_install_redist_is_what_resolve_toolkit_calls(repo: Repo) -> None:
    from llamabundle.settings import Settings

    settings = Settings(cache_dir=repo.cache, cuda_redist_url=repo.server.url)
    tk = redist.install_redist(version="13.0.2", platform="linux-x86_64", components=["cuda_nvcc", "cuda_cudart"],
                               settings=settings, log=repo.log, manifest=repo.manifest)
    assert tk.root == repo.plan(["cuda_nvcc", "cuda_cudart"]).root(repo.cache) and tk.nvcc.is_file()
    repo.server.reset()
    again = redist.install_redist(version="13.0.2", platform="linux-x86_64", components=["cuda_cudart", "cuda_nvcc"],
                                  settings=settings, log=repo.log, manifest=repo.manifest)
    assert again.root == tk.root and repo.server.requests == []
