"""PE import closure (DESIGN §7 static, Windows) on real PE files compiled with mingw-w64: imports and
delay-imports, each class (missing, bundled, system, driver, runtimes), the x64 check, and
`verify --level static` of a Windows bundle that lost a DLL."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from llamabundle import bundle
from llamabundle.bundle.manifest import Manifest
from llamabundle.deps import pe
from llamabundle.deps.pe import DllClass, read_pe, resolve_closure
from llamabundle.errors import VerifyError
from llamabundle.verify import Level, check_static, verify_bundle
from tests import bundles as test_bundles
from tests.pefiles import CC, DLLTOOL, MINGW_OMP, NM, Built, as_i386, make_dir

pytestmark = pytest.mark.skipif(not all(shutil.which(t) for t in (CC, DLLTOOL, NM)),
                                reason=f"{CC}, {DLLTOOL} and {NM} (mingw-w64) are needed to build real PE files")


def write_bundle(root: Path) -> Manifest:
    """bundle.json for the PE files in root (as a build would write it)."""
    roles = {p.name: "exe" if p.suffix == ".exe" else "backend" if p.name.startswith("ggml") else "runtime"
             for p in root.iterdir() if p.name != bundle.MANIFEST}
    test_bundles.write_bundle(root, {}, roles, name="windows-x86_64-test",
                              inputs=test_bundles.inputs_for("pe", platform="windows-x86_64"))
    return bundle.read_manifest(root)


# ------------------------------------------------------------------------------------------------ read_pe


def test_read_pe_lists_imports_of_a_real_exe(built: Built) -> None:
    info = read_pe(built / "app.exe")
    assert info.machine == "AMD64" and not info.dll
    assert [i.lower() for i in info.imports] == ["cudart64_12.dll", "nvcuda.dll", "kernel32.dll", "msvcrt.dll"]
    assert info.delay_imports == ()
    assert read_pe(built / "cudart64_12.dll").dll


def test_read_pe_sees_delay_imports(built: Built) -> None:
    info = read_pe(built / "lazy.exe")
    assert info.delay_imports == ("lazy.dll",)
    assert "lazy.dll" not in info.imports


def test_a_32_bit_pe_is_refused(built: Built, tmp_path: Path) -> None:
    x86 = as_i386(built / "cudart64_12.dll", tmp_path / "cudart32.dll")
    with pytest.raises(VerifyError) as e:
        read_pe(x86)
    assert e.value.exit_code == 5
    assert e.value.what == "cudart32.dll is a I386 PE file, not x64 (AMD64)"
    assert read_pe(x86, require_x64=False).machine == "I386"


def test_non_pe_files_are_told_apart(built: Built, tmp_path: Path) -> None:
    junk = tmp_path / "junk.dll"
    junk.write_bytes(b"MZ" + b"\0" * 100)
    assert pe.is_pe(built / "app.exe") and not pe.is_pe(junk)
    with pytest.raises(VerifyError, match="junk.dll is not a readable PE file"):
        read_pe(junk)


# ------------------------------------------------------------------------------------------------ classes


def test_policy_classifies_names_case_insensitively() -> None:
    p = pe.pe_policy()
    cases = {"KERNEL32.dll": DllClass.SYSTEM, "api-ms-win-crt-runtime-l1-1-0.dll": DllClass.SYSTEM,
             "ext-ms-win-ntuser-window-l1-1-0.dll": DllClass.SYSTEM, "nvcuda.dll": DllClass.DRIVER,
             "NVML.DLL": DllClass.DRIVER, "VCRUNTIME140_1.dll": DllClass.MSVC_RUNTIME,
             "msvcp140_atomic_wait.dll": DllClass.MSVC_RUNTIME, "vcomp140.dll": DllClass.OPENMP,
             "libomp140.x86_64.dll": DllClass.OPENMP, "cublasLt64_12.dll": DllClass.CUDA_RUNTIME,
             "nvJitLink_120_0.dll": DllClass.CUDA_RUNTIME, "libgomp-1.dll": DllClass.MINGW_RUNTIME,
             "ggml-base.dll": None}
    assert {n: p.classify(n) for n in cases} == cases


def test_closure_proves_bundled_system_driver_and_missing(built: Built, tmp_path: Path) -> None:
    d = make_dir(tmp_path, built, "app.exe", "cudart64_12.dll")
    c = resolve_closure([d / "app.exe"], bundle_dir=d)
    got = {dep.name: (dep.cls, dep.kind, dep.path) for dep in c.deps}
    assert got == {"cudart64_12.dll": (DllClass.BUNDLED, DllClass.CUDA_RUNTIME, d / "cudart64_12.dll"),
                   "KERNEL32.dll": (DllClass.SYSTEM, DllClass.SYSTEM, None),
                   "msvcrt.dll": (DllClass.SYSTEM, DllClass.SYSTEM, None),
                   "nvcuda.dll": (DllClass.DRIVER, DllClass.DRIVER, None)}
    assert c.missing == {}
    assert c.system_deps == ["KERNEL32.dll", "msvcrt.dll", "nvcuda.dll"]
    assert [b.path.name for b in c.binaries] == ["app.exe", "cudart64_12.dll"]  # the bundled DLL was read too
    # Without the DLL it is missing, and the closure names who imports it.
    (d / "cudart64_12.dll").unlink()
    c = resolve_closure([d / "app.exe"], bundle_dir=d)
    assert c.missing == {"cudart64_12.dll": ("app.exe",)}
    assert c.of_class(DllClass.MISSING)[0].kind is DllClass.CUDA_RUNTIME


def test_a_driver_dll_is_never_bundled_even_when_present(built: Built, tmp_path: Path) -> None:
    d = make_dir(tmp_path, built, "app.exe", "cudart64_12.dll")
    shutil.copy(built / "cudart64_12.dll", d / "nvcuda.dll")  # someone copied a driver DLL in
    c = resolve_closure([d / "app.exe"], bundle_dir=d)
    assert {x.name: x.cls for x in c.deps}["nvcuda.dll"] is DllClass.DRIVER


def test_delay_imports_are_part_of_the_closure(built: Built, tmp_path: Path) -> None:
    d = make_dir(tmp_path, built, "lazy.exe")
    c = resolve_closure([d / "lazy.exe"], bundle_dir=d)
    lazy = next(x for x in c.deps if x.name == "lazy.dll")
    assert lazy.cls is DllClass.MISSING and lazy.delay_only and lazy.imported_by == ("lazy.exe",)
    assert not next(x for x in c.deps if x.name == "KERNEL32.dll").delay_only


def test_mingw_runtime_is_found_in_the_sysroot_transitively(built: Built, tmp_path: Path) -> None:
    d = make_dir(tmp_path, built, "ggml-cpu-haswell.dll")
    alone = resolve_closure([d / "ggml-cpu-haswell.dll"], bundle_dir=d)
    assert alone.missing == {"libgomp-1.dll": ("ggml-cpu-haswell.dll",)}
    c = resolve_closure([d / "ggml-cpu-haswell.dll"], bundle_dir=d, extra_dirs=built.mingw)
    deps = {x.name.lower(): x for x in c.deps}
    assert deps["libgomp-1.dll"].cls is DllClass.MINGW_RUNTIME
    assert deps["libgomp-1.dll"].path is not None and deps["libgomp-1.dll"].path.parent in built.mingw
    # libgomp needs libgcc_s_seh and libwinpthread: only walking the found DLL reveals them.
    assert {n for n, x in deps.items() if x.cls is DllClass.MINGW_RUNTIME} == set(MINGW_OMP)
    assert "libgomp-1.dll" in deps["libgcc_s_seh-1.dll"].imported_by
    assert "ggml-cpu-haswell.dll" not in deps["libwinpthread-1.dll"].imported_by
    assert c.missing == {}


def test_extra_dirs_skip_a_32_bit_copy(built: Built, tmp_path: Path) -> None:
    d = make_dir(tmp_path, built, "app.exe")
    wrong, right = tmp_path / "x86", tmp_path / "x64"
    wrong.mkdir()
    right.mkdir()
    as_i386(built / "cudart64_12.dll", wrong / "cudart64_12.dll")
    c = resolve_closure([d / "app.exe"], bundle_dir=d, extra_dirs=[wrong])
    assert "cudart64_12.dll" in c.missing
    shutil.copy(built / "cudart64_12.dll", right / "cudart64_12.dll")
    c = resolve_closure([d / "app.exe"], bundle_dir=d, extra_dirs=[wrong, right])
    dep = next(x for x in c.deps if x.name == "cudart64_12.dll")
    assert (dep.cls, dep.path) == (DllClass.CUDA_RUNTIME, right / "cudart64_12.dll")


def test_a_32_bit_dll_inside_the_bundle_is_refused(built: Built, tmp_path: Path) -> None:
    d = make_dir(tmp_path, built, "app.exe")
    as_i386(built / "cudart64_12.dll", d / "cudart64_12.dll")
    with pytest.raises(VerifyError, match="cudart64_12.dll is a I386 PE file"):
        resolve_closure([d / "app.exe"], bundle_dir=d)


def test_to_json_round_trips_the_closure(built: Built, tmp_path: Path) -> None:
    import json

    d = make_dir(tmp_path, built, "app.exe")
    js = json.loads(json.dumps(resolve_closure([d / "app.exe"], bundle_dir=d).to_json()))
    assert js["schema"] == 1 and js["format"] == "pe"
    assert js["missing"] == {"cudart64_12.dll": ["app.exe"]}
    assert js["binaries"][0]["imports"][:2] == ["cudart64_12.dll", "nvcuda.dll"]
    assert {x["name"]: x["class"] for x in js["deps"]}["nvcuda.dll"] == "driver"


# ------------------------------------------------------------------------------------------------ verify


def test_static_verification_of_a_windows_bundle(built: Built, tmp_path: Path) -> None:
    d = make_dir(tmp_path, built, "app.exe", "cudart64_12.dll", "ggml-cpu-haswell.dll", "lazy.exe")
    for n in MINGW_OMP:
        shutil.copy(next(m / n for m in built.mingw if (m / n).is_file()), d / n)
    (d / "lazy.dll").write_bytes((built / "cudart64_12.dll").read_bytes())
    (d / "LICENSE").write_text("MIT\n")
    write_bundle(d)
    report = verify_bundle(d, level=Level.STATIC, cache_dir=tmp_path / "cache")
    assert report.levels == {"manifest": "passed", "static": "passed"}
    assert check_static(d, bundle.read_manifest(d)) == ["KERNEL32.dll", "msvcrt.dll", "nvcuda.dll"]
    # The same bundle without libgomp-1.dll (bundle.json rewritten, so only the import check can fail).
    (d / "libgomp-1.dll").unlink()
    (d / bundle.MANIFEST).unlink()
    write_bundle(d)
    with pytest.raises(VerifyError) as e:
        verify_bundle(d, level=Level.STATIC, cache_dir=tmp_path / "cache")
    assert e.value.exit_code == 5
    assert e.value.what == "libgomp-1.dll (imported by ggml-cpu-haswell.dll) is not in the bundle"


def test_static_verification_names_every_missing_dll_and_importer(built: Built, tmp_path: Path) -> None:
    d = make_dir(tmp_path, built, "app.exe", "lazy.exe")
    with pytest.raises(VerifyError) as e:
        check_static(d, write_bundle(d))
    assert e.value.what == ("cudart64_12.dll (imported by app.exe) is not in the bundle; "
                            "lazy.dll (imported by lazy.exe) is not in the bundle")


def test_static_verification_refuses_32_bit_and_elf_binaries(built: Built, tmp_path: Path) -> None:
    d = make_dir(tmp_path, built, "app.exe", "cudart64_12.dll")
    as_i386(built / "cudart64_12.dll", d / "cudart64_12.dll")
    with pytest.raises(VerifyError, match="not x64"):
        check_static(d, write_bundle(d))
    (d / bundle.MANIFEST).unlink()
    shutil.copy(built / "cudart64_12.dll", d / "cudart64_12.dll")
    elf_file = Path("/bin/true").resolve()
    shutil.copy(elf_file, d / "llama-server")
    with pytest.raises(VerifyError) as e:
        check_static(d, write_bundle(d))
    assert e.value.what == "llama-server is an ELF binary in a windows-x86_64 bundle"
