"""The PyPI toolkit source: the pinned wheel data against NVIDIA's manifests, pure planning, and the
assembly of a toolkit root from small synthetic wheels laid out like the real ones (the download
cache is seeded, or they come from a package index on 127.0.0.1)."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import re
import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llamabundle import data
from llamabundle.backends.cuda.toolkit import layout, pypi
from llamabundle.errors import LlamaBundleError, ToolchainError, VerifyError
from llamabundle.log import Log
from llamabundle.settings import Settings
from tests.fakeindex import FakeIndex

LINUX = "linux-x86_64"
HEX64 = re.compile(r"^[0-9a-f]{64}$")

CUDA_H = """\
#define __CUDA_API_PTDS(api) api ## _ptds
#define __CUDA_API_PTSZ(api) api ## _ptsz
#define cuMemAlloc cuMemAlloc_v2
#define cuMemcpy __CUDA_API_PTDS(cuMemcpy)
#define cuMemPrefetchAsync __CUDA_API_PTSZ(cuMemPrefetchAsync_v2)
CUresult CUDAAPI cuInit(unsigned int Flags);
CUresult CUDAAPI cuMemAlloc(CUdeviceptr *dptr, size_t bytesize);
CUresult CUDAAPI cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t ByteCount);
CUresult CUDAAPI cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size,
                             const CUmemAllocationProp *prop, unsigned long long flags);
"""
ELF = b"\x7fELF\x02\x01\x01" + b"\0" * 57

# component -> {path in the wheel: bytes}; paths under nvidia/cu13/ as in NVIDIA's CUDA 13 wheels
FAKE_FILES: dict[str, dict[str, bytes]] = {
    "cuda_nvcc": {"nvidia/cu13/bin/nvcc": b"#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n",
                  "nvidia/cu13/bin/ptxas": ELF, "nvidia/cu13/bin/nvcc.profile": b"TOP = $(_HERE_)/..\n",
                  "nvidia/cu13/bin/crt/link.stub": b"stub\n", "nvidia/cu13/include/fatbinary_section.h": b"/* fb */\n"},
    "cuda_crt": {"nvidia/cu13/include/crt/host_config.h": b"/* crt */\n"},
    "libnvvm": {"nvidia/cu13/nvvm/bin/cicc": ELF, "nvidia/cu13/lib/libnvvm.so.4": ELF,
                "nvidia/cu13/nvvm/libdevice/libdevice.10.bc": b"BC\xc0\xde", "nvidia/cu13/include/nvvm.h": b"/* nvvm */\n"},
    "cuda_cudart": {"nvidia/cu13/include/cuda.h": CUDA_H.encode(), "nvidia/cu13/include/cuda_runtime.h": b"/* rt */\n",
                    "nvidia/cu13/lib/libcudart.so.13": ELF, "nvidia/cu13/lib/libcudart_static.a": b"!<arch>\n"},
    "cuda_cccl": {"nvidia/cu13/include/cccl/cub/cub.cuh": b"/* cub */\n",
                  "nvidia/cu13/.metadata/provenance.txt": b"build farm notes\n",
                  "nvidia/cu13/lib/cmake/cccl/cccl-config.cmake": b"# cccl\n"},
    "cuda_nvrtc": {"nvidia/cu13/lib/libnvrtc.so.13": ELF, "nvidia/cu13/lib/libnvrtc-builtins.so.13.0": ELF,
                   "nvidia/cu13/include/nvrtc.h": b"/* nvrtc */\n"},
}


# ------------------------------------------------------------------------------------------- data


def test_every_pinned_wheel_has_its_components_manifest_version() -> None:
    info = pypi.pypi_data()
    assert {"13.0.1", "13.0.2"} <= set(info["toolkits"])
    for version, tk in info["toolkits"].items():
        manifest = data.cuda_manifest(version)  # the toolkit is a known one, with NVIDIA's manifest
        for comp, wheel in tk["wheels"].items():
            assert comp in manifest, (version, comp)
            assert wheel["version"] == manifest[comp]["version"], (version, comp)
            assert LINUX in wheel["files"], (version, comp)
            for platform, f in wheel["files"].items():
                assert HEX64.match(f["sha256"]), (version, comp, platform)
                assert f["size"] > 0
                dist = wheel["project"].replace("-", "_")
                assert f["filename"].startswith(f"{dist}-{wheel['version']}-py3-none-"), f["filename"]
                if platform == LINUX:
                    assert re.search(r"-manylinux[0-9a-z_.]*_x86_64\.whl$", f["filename"]), f["filename"]
                else:
                    assert platform == "windows-x86_64" and f["filename"].endswith("-win_amd64.whl")
        for comp, why in tk["missing"].items():
            assert comp in manifest and manifest[comp]["version"] in why, (version, comp)


def test_known_pins_for_13_0_2() -> None:
    wheels = pypi.pypi_data()["toolkits"]["13.0.2"]["wheels"]
    expected = {"cuda_nvcc": ("nvidia-cuda-nvcc", "13.0.88"), "cuda_cudart": ("nvidia-cuda-runtime", "13.0.96"),
                "libcublas": ("nvidia-cublas", "13.1.0.3"), "cuda_crt": ("nvidia-cuda-crt", "13.0.88"),
                "libnvvm": ("nvidia-nvvm", "13.0.88"), "cuda_cccl": ("nvidia-cuda-cccl", "13.0.85"),
                "libnvjitlink": ("nvidia-nvjitlink", "13.0.88"), "cuda_nvrtc": ("nvidia-cuda-nvrtc", "13.0.88"),
                "libnvfatbin": ("nvidia-nvfatbin", "13.0.85")}
    for comp, (project, version) in expected.items():
        assert (wheels[comp]["project"], wheels[comp]["version"]) == (project, version)
    assert wheels["cuda_nvcc"]["files"][LINUX]["sha256"] == "56fe502eb77625a12f25172caa3cdddb4e4c8ba2c8c17dba44b164761b380f03"


def test_pinned_hashes_are_64_hex_in_the_plan() -> None:
    records = pypi.plan_pypi("13.0.2", LINUX, ["cuda_nvcc", "cuda_cudart", "cuda_cccl", "libcublas"])
    assert all(HEX64.match(r.sha256) for r in records)


# ----------------------------------------------------------------------------------------- planning


def test_nvcc_brings_crt_and_nvvm() -> None:
    records = pypi.plan_pypi("13.0.2", LINUX, ["cuda_nvcc"])
    assert [r.component for r in records] == ["cuda_crt", "cuda_nvcc", "libnvvm"]
    assert [r.component for r in pypi.plan_pypi("13.0.2", LINUX, ["cuda_cudart"])] == ["cuda_cudart"]


def test_plan_is_sorted_deduplicated_and_pinned() -> None:
    a = pypi.plan_pypi("13.0.2", LINUX, ["libcublas", "cuda_nvcc", "cuda_cudart", "cuda_nvcc", "cuda_crt"])
    b = pypi.plan_pypi("13.0.2", LINUX, ["cuda_cudart", "libcublas", "cuda_nvcc"])
    assert a == b
    assert [r.component for r in a] == sorted(r.component for r in a)
    assert pypi.plan_pin(a) == pypi.plan_pin(b) and HEX64.match(pypi.plan_pin(a))
    assert pypi.plan_pin(pypi.plan_pypi("13.0.1", LINUX, ["cuda_cudart"])) != \
        pypi.plan_pin(pypi.plan_pypi("13.0.2", LINUX, ["cuda_cudart"]))


def test_unknown_component_is_a_toolchain_error_naming_it() -> None:
    with pytest.raises(ToolchainError) as e:
        pypi.plan_pypi("13.0.2", LINUX, ["cuda_nvcc", "cuda_nvcx"])
    assert e.value.exit_code == 3
    assert "cuda_nvcx" in e.value.what and "cuda_nvcc" not in e.value.what
    assert "cuda_nvcc" in e.value.fix  # the list of what PyPI has


def test_component_without_a_wheel_at_that_version_is_reported() -> None:
    with pytest.raises(ToolchainError) as e:
        pypi.plan_pypi("13.0.2", LINUX, ["cuda_cuobjdump", "cuda_nvdisasm"])
    assert "cuda_cuobjdump" in e.value.what and "cuda_nvdisasm" in e.value.what
    assert "nvidia-cuda-cuobjdump" in e.value.why and "13.0.85" in e.value.why
    assert "redist" in e.value.fix


def test_unknown_version_and_platform() -> None:
    with pytest.raises(ToolchainError, match="12.8.1"):
        pypi.plan_pypi("12.8.1", LINUX, ["cuda_nvcc"])
    with pytest.raises(ToolchainError, match="cuda_culibos"):
        pypi.plan_pypi("13.0.2", "windows-x86_64", ["cuda_culibos"])  # a Linux-only component
    with pytest.raises(ToolchainError):
        pypi.plan_pypi("13.0.2", LINUX, [])


def test_default_root_is_content_addressed(tmp_path: Path) -> None:
    settings = Settings(cache_dir=tmp_path)
    records = pypi.plan_pypi("13.0.2", LINUX, ["cuda_nvcc"])
    root = pypi.default_root(settings, version="13.0.2", platform=LINUX, records=records)
    assert root == layout.toolkit_root(tmp_path, version="13.0.2", platform=LINUX, source="pypi",
                                       components=["cuda_crt", "cuda_nvcc", "libnvvm"], pin=pypi.plan_pin(records))
    assert root.name.startswith("cuda-13.0.2-linux-x86_64-pypi-")


def test_driver_symbols_follow_the_header_macros() -> None:
    names = pypi.driver_symbols(CUDA_H)
    for n in ("cuInit", "cuMemAlloc", "cuMemAlloc_v2", "cuMemcpy", "cuMemcpy_ptds", "cuMemCreate",
              "cuMemPrefetchAsync_v2", "cuMemPrefetchAsync_v2_ptsz"):
        assert n in names
    assert names == sorted(set(names))


# ------------------------------------------------------------------------------------------ install


def _wheel_bytes(component: str, files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    dist = f"nvidia_fake_{component}-1.0.dist-info"
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, content in files.items():
            info = zipfile.ZipInfo(name, date_time=(2025, 1, 1, 0, 0, 0))
            info.external_attr = 0o100644 << 16  # no exec bits: the installer must set them
            zf.writestr(info, content)
        zf.writestr(f"{dist}/licenses/License.txt", f"NVIDIA license for {component}\n")
        zf.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\n")
    return buf.getvalue()


class Fake:
    """Synthetic wheels behind the real data's shape, their pins patched into the plan, the cache seeded."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: dict[str, dict[str, bytes]]) -> None:
        self.blobs: dict[str, bytes] = {}
        info = copy.deepcopy(pypi.pypi_data())
        wheels = info["toolkits"]["13.0.2"]["wheels"]
        for comp, content in files.items():
            blob = _wheel_bytes(comp, content)
            f = wheels[comp]["files"][LINUX]
            f.update(sha256=hashlib.sha256(blob).hexdigest(), size=len(blob))
            self.blobs[f["filename"]] = blob
        monkeypatch.setattr(pypi, "pypi_data", lambda: info)
        self.index = FakeIndex()
        for comp in files:
            wheel = wheels[comp]
            self.index.add(wheel["project"], wheel["files"][LINUX]["filename"], self.blobs[wheel["files"][LINUX]["filename"]])
        self.settings = Settings(cache_dir=tmp_path / "cache", pip_index_url=self.index.url)
        self.stub_calls = 0

        def fake_stub(root: Path, stub: dict[str, Any], **kw: Any) -> None:  # no C compiler in most tests
            self.stub_calls += 1
            out = root / stub["path"]
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(b"stub " + " ".join(pypi.driver_symbols((root / stub["header"]).read_text())).encode())

        monkeypatch.setattr(pypi, "_driver_stub", fake_stub)

    @property
    def downloads(self) -> list[str]:
        """The wheel files fetched from the index, in order."""
        return self.index.file_requests()

    def seed(self, *, corrupt: str = "") -> None:
        for rec in self.plan():
            d = pypi.download_dir(self.settings, rec)
            d.mkdir(parents=True, exist_ok=True)
            blob = self.blobs[rec.filename]
            (d / rec.filename).write_bytes(blob[:-1] + b"X" if rec.component == corrupt else blob)

    def plan(self) -> list[pypi.WheelRecord]:
        return pypi.plan_pypi("13.0.2", LINUX, self.components)

    components = ["cuda_nvcc", "cuda_cudart", "cuda_cccl"]

    def install(self, **kw: Any) -> layout.Toolkit:
        return pypi.install_from_pypi(version="13.0.2", platform=LINUX, components=self.components,
                                      settings=self.settings, log=Log(quiet=True), **kw)


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Fake]:
    f = Fake(tmp_path, monkeypatch, {k: v for k, v in FAKE_FILES.items() if k != "cuda_nvrtc"})
    yield f
    f.index.close()


def test_install_flattens_the_wheels_into_the_layout(fake: Fake) -> None:
    fake.seed()
    tk = fake.install()
    assert fake.downloads == [] and fake.index.requests == []  # everything came from the seeded cache
    root = tk.root
    assert root == pypi.default_root(fake.settings, version="13.0.2", platform=LINUX, records=fake.plan())
    assert (tk.version, tk.source, tk.platform) == ("13.0.2", "pypi", LINUX)
    assert tk.nvcc == root / "bin" / "nvcc"
    for rel in ("bin/nvcc", "bin/ptxas", "bin/nvcc.profile", "bin/crt/link.stub", "include/crt/host_config.h",
                "include/cuda.h", "include/cccl/cub/cub.cuh", "nvvm/bin/cicc", "nvvm/libdevice/libdevice.10.bc",
                "lib/libnvvm.so.4", "lib/libcudart.so.13", "lib/cmake/cccl/cccl-config.cmake"):
        assert (root / rel).is_file(), rel
    assert not (root / "nvidia").exists() and not (root / ".metadata").exists()
    assert not list(root.glob("*.dist-info")) and not (root / ".llamabundle-extract").exists()
    # executables are executable, data is not
    for rel in ("bin/nvcc", "bin/ptxas", "nvvm/bin/cicc"):
        assert os.stat(root / rel).st_mode & 0o111 == 0o111, rel
    for rel in ("bin/nvcc.profile", "bin/crt/link.stub", "include/cuda.h"):
        assert os.stat(root / rel).st_mode & 0o111 == 0, rel
    # development names and lib64, as a real install has them
    assert os.readlink(root / "lib" / "libcudart.so") == "libcudart.so.13"
    assert os.readlink(root / "lib" / "libnvvm.so") == "libnvvm.so.4"
    assert os.readlink(root / "lib64") == "lib"
    assert tk.lib_dirs == [root / "lib", root / "lib64"]
    assert fake.stub_calls == 1 and (root / "lib" / "stubs" / "libcuda.so").read_bytes().startswith(b"stub cuInit")
    # licenses, version.json, marker
    for comp in ("cuda_cccl", "cuda_crt", "cuda_cudart", "cuda_nvcc", "libnvvm"):
        assert (root / f"LICENSE.{comp}").read_text() == f"NVIDIA license for {comp}\n"
    version = json.loads((root / "version.json").read_text())
    assert version["cuda"] == {"name": "CUDA SDK", "version": "13.0.2"}
    assert version["cuda_nvcc"] == {"name": "cuda_nvcc", "version": "13.0.88"}
    assert version["cuda_cudart"]["version"] == "13.0.96" and version["libnvvm"]["version"] == "13.0.88"
    marker = json.loads((root / layout.MARKER).read_text())
    assert marker["source"] == "pypi" and marker["components"]["cuda_crt"] == "13.0.88"
    assert marker["files"] == sum(1 for p in root.rglob("*") if p.is_file() or p.is_symlink()) - 1
    assert not list(root.parent.glob(".*partial*"))


def test_marker_is_written_last(fake: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    fake.seed()
    seen: list[set[str]] = []
    real = layout.write_marker

    def spy(root: Path, **kw: Any) -> None:
        seen.append({p.relative_to(root).as_posix() for p in root.rglob("*")})
        real(root, **kw)

    monkeypatch.setattr(layout, "write_marker", spy)
    tk = fake.install()
    assert len(seen) == 1 and "version.json" in seen[0] and layout.MARKER not in seen[0]
    assert seen[0] | {layout.MARKER} == {p.relative_to(tk.root).as_posix() for p in tk.root.rglob("*")}


def test_second_install_is_a_verified_no_op(fake: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    fake.seed()
    first = fake.install()
    before = (first.root / layout.MARKER).stat().st_mtime_ns

    def boom(*a: Any, **kw: Any) -> None:
        raise AssertionError("nothing may be downloaded or extracted again")

    monkeypatch.setattr(pypi, "_fetch_wheels", boom)
    monkeypatch.setattr(pypi, "extract_zip", boom)
    second = fake.install()
    assert second == first and (second.root / layout.MARKER).stat().st_mtime_ns == before
    # a changed install is not trusted
    (first.root / "include" / "extra.h").write_text("x")
    with pytest.raises(ToolchainError, match="incomplete or was changed"):
        fake.install()


def test_missing_wheels_come_from_the_index_by_url(fake: Fake) -> None:
    fake.seed()
    nvcc = next(r for r in fake.plan() if r.component == "cuda_nvcc")
    shutil.rmtree(pypi.download_dir(fake.settings, nvcc))
    tk = fake.install()
    assert (tk.root / "bin" / "nvcc").is_file()
    assert fake.index.requests == ["/simple/nvidia-cuda-nvcc/", f"/files/nvidia-cuda-nvcc/{nvcc.filename}"]
    assert (pypi.download_dir(fake.settings, nvcc) / nvcc.filename).is_file()
    assert not list(pypi.download_dir(fake.settings, nvcc).glob("*.part*"))


def test_every_wheel_from_the_configured_index(fake: Fake) -> None:
    fake.install()  # nothing seeded
    assert len(fake.plan()) == 5  # nvcc, crt, nvvm, cudart, cccl: all five from the index
    assert sorted(fake.downloads) == sorted(r.filename for r in fake.plan())
    assert sum(p.startswith("/simple/") for p in fake.index.requests) == 5  # one page per project


def test_an_html_only_index_works_too(fake: Fake) -> None:
    fake.index.json_api = False  # PEP 503: links with #sha256= fragments
    tk = fake.install()
    assert tk.nvcc.is_file() and sorted(fake.downloads) == sorted(r.filename for r in fake.plan())


def test_a_cached_wheel_with_another_hash_is_not_trusted(fake: Fake) -> None:
    fake.seed(corrupt="cuda_cudart")
    cudart = next(r for r in fake.plan() if r.component == "cuda_cudart")
    tk = fake.install()
    assert fake.downloads == [cudart.filename]  # only the damaged one was fetched again
    cached = pypi.download_dir(fake.settings, cudart) / cudart.filename
    assert hashlib.sha256(cached.read_bytes()).hexdigest() == cudart.sha256
    assert (tk.root / "lib" / "libcudart.so.13").read_bytes() == ELF


def test_an_index_serving_another_file_is_refused(fake: Fake) -> None:
    fake.seed()
    cudart = next(r for r in fake.plan() if r.component == "cuda_cudart")
    shutil.rmtree(pypi.download_dir(fake.settings, cudart))
    fake.index.served[cudart.filename] = fake.blobs[cudart.filename][:-8] + b"tampered"  # same size, other bytes
    with pytest.raises(VerifyError, match="sha256 mismatch") as e:
        fake.install()
    assert e.value.exit_code == 5
    assert not pypi.download_dir(fake.settings, cudart).exists() or \
        list(pypi.download_dir(fake.settings, cudart).iterdir()) == []
    assert list((fake.settings.cache_dir / "toolkits").glob("*")) == []


def test_an_index_listing_another_sha256_is_refused_before_downloading(fake: Fake) -> None:
    cudart = next(r for r in fake.plan() if r.component == "cuda_cudart")
    fake.index.listed_sha256[cudart.filename] = "0" * 64
    with pytest.raises(VerifyError, match="lists .* with sha256 0000") as e:
        fake.install()
    assert e.value.exit_code == 5 and cudart.filename not in fake.downloads


def test_an_unreachable_index_is_a_network_error(fake: Fake) -> None:
    fake.settings = Settings(cache_dir=fake.settings.cache_dir, pip_index_url="http://127.0.0.1:9/simple")
    with pytest.raises(LlamaBundleError) as e:
        fake.install()
    assert e.value.exit_code == 6 and "127.0.0.1:9" in e.value.what
    assert list((fake.settings.cache_dir / "toolkits").glob("*")) == []


def test_a_failed_assembly_leaves_nothing_behind(fake: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    fake.seed()

    def broken_stub(root: Path, stub: dict[str, Any], **kw: Any) -> None:
        raise ToolchainError("no compiler")

    monkeypatch.setattr(pypi, "_driver_stub", broken_stub)
    with pytest.raises(ToolchainError, match="no compiler"):
        fake.install()
    toolkits = fake.settings.cache_dir / "toolkits"
    assert list(toolkits.iterdir()) == []


def test_an_incomplete_root_is_replaced(fake: Fake) -> None:
    fake.seed()
    root = pypi.default_root(fake.settings, version="13.0.2", platform=LINUX, records=fake.plan())
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "leftover").write_text("from a crashed install")
    tk = fake.install()
    assert not (tk.root / "bin" / "leftover").exists() and (tk.root / layout.MARKER).is_file()


def test_install_into_an_explicit_dest(fake: Fake, tmp_path: Path) -> None:
    fake.seed()
    tk = fake.install(dest=tmp_path / "my-cuda")
    assert tk.root == tmp_path / "my-cuda" and tk.nvcc.is_file()
    assert not (fake.settings.cache_dir / "toolkits").exists()
    assert fake.install(dest=tmp_path / "my-cuda") == tk
    fake.components = ["cuda_nvcc"]  # another set into the same dest is not silently "installed"
    with pytest.raises(ToolchainError, match="holds another toolkit"):
        fake.install(dest=tmp_path / "my-cuda")


def test_sonames_for_every_versioned_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = Fake(tmp_path, monkeypatch, FAKE_FILES)
    f.components = ["cuda_nvcc", "cuda_nvrtc"]
    f.seed()
    tk = f.install()
    lib = tk.root / "lib"
    assert os.readlink(lib / "libnvrtc.so") == "libnvrtc.so.13"
    assert os.readlink(lib / "libnvrtc-builtins.so") == "libnvrtc-builtins.so.13.0"
    assert not (lib / "stubs").exists()  # no cudart: no driver stub


def test_conflicting_files_across_wheels_are_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = copy.deepcopy(FAKE_FILES)
    files["cuda_crt"]["nvidia/cu13/include/fatbinary_section.h"] = b"/* other */\n"
    f = Fake(tmp_path, monkeypatch, {k: files[k] for k in ("cuda_nvcc", "cuda_crt", "libnvvm")})
    f.components = ["cuda_nvcc"]
    f.seed()
    with pytest.raises(ToolchainError, match="fatbinary_section.h"):
        f.install()


def test_same_file_in_two_wheels_is_fine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = copy.deepcopy(FAKE_FILES)
    files["cuda_crt"]["nvidia/cu13/include/fatbinary_section.h"] = FAKE_FILES["cuda_nvcc"]["nvidia/cu13/include/fatbinary_section.h"]
    f = Fake(tmp_path, monkeypatch, {k: files[k] for k in ("cuda_nvcc", "cuda_crt", "libnvvm")})
    f.components = ["cuda_nvcc"]
    f.seed()
    assert (f.install().root / "include" / "fatbinary_section.h").is_file()


def test_a_wheel_escaping_its_tree_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = copy.deepcopy(FAKE_FILES)
    files["cuda_crt"]["../../evil.h"] = b"x"
    f = Fake(tmp_path, monkeypatch, {k: files[k] for k in ("cuda_nvcc", "cuda_crt", "libnvvm")})
    f.components = ["cuda_nvcc"]
    f.seed()
    with pytest.raises(VerifyError, match="refused"):
        f.install()
    assert not (tmp_path / "evil.h").exists() and not (f.settings.cache_dir / "evil.h").exists()
    assert list((f.settings.cache_dir / "toolkits").iterdir()) == []


def test_a_wheel_without_the_cu13_tree_is_a_toolchain_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = copy.deepcopy(FAKE_FILES)
    files["cuda_crt"] = {"nvidia/cu12/include/crt/host_config.h": b"x"}
    f = Fake(tmp_path, monkeypatch, {k: files[k] for k in ("cuda_nvcc", "cuda_crt", "libnvvm")})
    f.components = ["cuda_nvcc"]
    f.seed()
    with pytest.raises(ToolchainError, match="nvidia/cu13"):
        f.install()


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_driver_stub_is_a_real_shared_library(tmp_path: Path) -> None:
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    root = tmp_path / "root"
    (root / "include").mkdir(parents=True)
    (root / "include" / "cuda.h").write_text(CUDA_H)
    stub = pypi.pypi_data()["driver_stub"]
    pypi._driver_stub(root, stub, settings=Settings(cache_dir=tmp_path / "cache"), log=Log(quiet=True))
    out = root / stub["path"]
    assert out == root / "lib" / "stubs" / "libcuda.so"
    with open(out, "rb") as fh:
        elf = ELFFile(fh)
        dyn = next(s for s in elf.iter_sections() if isinstance(s, DynamicSection))
        soname = [t.soname for t in dyn.iter_tags() if t.entry.d_tag == "DT_SONAME"]
        symbols = {s.name for s in elf.get_section_by_name(".dynsym").iter_symbols()
                   if s["st_info"]["type"] == "STT_FUNC" and s["st_shndx"] != "SHN_UNDEF"}
    assert soname == ["libcuda.so.1"]
    assert {"cuInit", "cuMemAlloc_v2", "cuMemcpy_ptds", "cuMemCreate"} <= symbols
    assert sorted(p.name for p in root.iterdir()) == ["include", "lib"]  # the C source was not left behind


def test_errors_have_exit_codes() -> None:
    assert issubclass(ToolchainError, LlamaBundleError) and ToolchainError("x").exit_code == 3
