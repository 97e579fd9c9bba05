"""Run-time companions (llamabundle.backends.cuda.companions): the names a CUDA library loads by name, read
from its bytes (ASCII and UTF-16LE); the recipe's cuda.libraries and cuda.latent_companions; what
Cuda.runtime_extras asks the collection for, and what Cuda.check_companions requires of a bundle. The
"libraries" here are small files whose bytes hold the names, as the real ones do."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from llamabundle import bundle, keys
from llamabundle.backends.cuda import CUDA, companions
from llamabundle.backends.cuda.companions import Rule
from llamabundle.errors import RecipeError, ToolchainError, VerifyError
from llamabundle.platforms.base import Extra
from llamabundle.platforms.linux import LINUX
from llamabundle.platforms.windows import WINDOWS as WINDOWS_PLATFORM
from llamabundle.recipe import Recipe
from tests import bundles as test_bundles
from tests.recipes import WINDOWS, WINDOWS_PATH, edit, line_of

LINUX_PATH = WINDOWS_PATH.parent / "linux-x86_64-cuda13.0.yaml"  # (tests.recipes' LINUX_PATH is the CPU recipe)
LIBRARIES_LINE = ("  libraries: [nvJitLink_120_0.dll, nvfatbin_120_0.dll]     "
                  "# shipped although nothing names them (the seed's seven)")
assert line_of(WINDOWS, LIBRARIES_LINE) and LIBRARIES_LINE + "\n" in WINDOWS  # the whole line, as written


def windows_recipe(**replacements: str) -> Recipe:
    """The Windows CUDA recipe with each key string (found exactly once) replaced by its value."""
    text = WINDOWS
    for old, new in replacements.items():
        text = edit(text, old, new)
    return keys.parse(text, file="windows.yaml")


def platform_of(m: object) -> object:
    from llamabundle import platforms

    return platforms.get(m.platform)  # type: ignore[attr-defined]


def wide(name: str) -> bytes:
    return name.encode("utf-16-le")


def noise(seed: int, n: int = 512) -> bytes:
    """Random bytes (seeded: the same every run) bracketed by NULs, so they never run into a name."""
    return b"\x00\x00" + random.Random(seed).randbytes(n) + b"\x00\x00"


def lib(path: Path, *holds: bytes) -> Path:
    """A "library" at `path` whose bytes hold each of `holds` amid noise."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"MZ" + b"".join(noise(i) + h for i, h in enumerate(holds)) + noise(99))
    return path


def only_rule(file_name: str) -> Rule:
    (rule,) = companions.rules_for(file_name)
    return rule


NVRTC_RULE = "nvrtc64_120_0.dll"  # a name rules_for gives the NVRTC -> builtins rule for


# ------------------------------------------------------------------------------------------------ names_in


def test_names_in_finds_ascii_and_utf16_names_each_once_sorted(tmp_path: Path) -> None:
    rule = only_rule("cublasLt64_12.dll")
    f = lib(tmp_path / "cublasLt64_12.dll",
            b"\x00junk nvrtc64_130_0.dll\x00",
            b"\x00junk nvrtc64_120_0.dll\x00",
            wide("nvrtc64_120_0.dll"),
            wide("nvrtc64_121_1.dll") + b"\x00\x00",
            b"nvrtc64_120_0.dll\x00")
    assert companions.names_in(f, rule) == ["nvrtc64_120_0.dll", "nvrtc64_121_1.dll", "nvrtc64_130_0.dll"]


ELF_LIB = r"""
const char *lazy_name(void) { return "libnvrtc.so.13"; }   /* .rodata: what the library passes to dlopen */
__asm__(".section .text\n.asciz \"libnvrtc.so.99\"\n");   /* in code: never a name it loads */
__asm__(".section .nv_fatbin,\"a\"\n.asciz \"libnvrtc.so.98\"\n");  /* GPU code: nor is this */
"""


def test_names_in_an_elf_library_reads_its_data_sections_only(tmp_path: Path) -> None:
    """A real shared library (gcc): the name in .rodata is found, the ones in .text and .nv_fatbin are not read (most
    of cuBLASLt's 540 MB is code and GPU code); a file whose section headers cannot be read is read whole."""
    import shutil
    import subprocess

    from llamabundle.deps import elf

    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    (src := tmp_path / "lt.c").write_text(ELF_LIB)
    so = tmp_path / "libcublasLt.so.13"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", so, src], check=True)
    rule = only_rule(so.name)
    assert companions.names_in(so, rule) == ["libnvrtc.so.13"]
    ranges = elf.data_ranges(so)
    assert ranges and sum(n for _, n in ranges) < so.stat().st_size
    data = bytearray(so.read_bytes())
    data[0x28:0x30] = (len(data) * 2).to_bytes(8, "little")  # e_shoff past the end: no section table to read
    (cut := tmp_path / "cut" / so.name).parent.mkdir()
    cut.write_bytes(bytes(data))
    assert elf.data_ranges(cut) is None
    assert companions.names_in(cut, rule) == ["libnvrtc.so.13", "libnvrtc.so.98", "libnvrtc.so.99"]


def test_names_in_a_name_at_the_very_start_or_end_of_the_file(tmp_path: Path) -> None:
    rule = only_rule("cublasLt64_12.dll")
    (tmp_path / "a").write_bytes(b"nvrtc64_120_0.dll")
    (tmp_path / "w").write_bytes(wide("nvrtc64_120_0.dll"))
    assert companions.names_in(tmp_path / "a", rule) == ["nvrtc64_120_0.dll"]
    assert companions.names_in(tmp_path / "w", rule) == ["nvrtc64_120_0.dll"]


@pytest.mark.parametrize("held", [
    b" xnvrtc64_120_0.dll\x00", b" nvrtc64_120_0.dllx\x00", b" _nvrtc64_120_0.dll\x00", b" nvrtc64_120_0.dll.bak\x00",
    b" 1nvrtc64_120_0.dll\x00", b" nvrtc64_120_0.dll-2\x00",
    wide(" xnvrtc64_120_0.dll "), wide(" nvrtc64_120_0.dllx "), wide(" -nvrtc64_120_0.dll "),
    wide(" nvrtc64_120_0.dll_ "),
    b" nvrtc64_.dll\x00", b" nvrtc64_120.dll\x00",  # not the pattern at all
], ids=repr)
def test_names_in_does_not_match_part_of_a_longer_name(tmp_path: Path, held: bytes) -> None:
    f = lib(tmp_path / "cublasLt64_12.dll", held)
    assert companions.names_in(f, only_rule("cublasLt64_12.dll")) == []


def test_names_in_a_wide_char_whose_low_byte_is_a_letter_is_not_part_of_the_name(tmp_path: Path) -> None:
    # U+0141 (b"A\x01") before the name: not the character 'A', so the name starts there
    f = lib(tmp_path / "x.dll", "\u0141nvrtc64_120_0.dll".encode("utf-16-le") + b"\x00\x00")
    assert companions.names_in(f, only_rule("cublasLt64_12.dll")) == ["nvrtc64_120_0.dll"]


def test_names_in_a_high_byte_before_an_ascii_name_does_not_hide_it(tmp_path: Path) -> None:
    # 0xe9 ('é' in Latin-1) is not a file-name character: the name right after it still counts
    f = lib(tmp_path / "x.dll", b"\xe9nvrtc64_120_0.dll\x00")
    assert companions.names_in(f, only_rule("cublasLt64_12.dll")) == ["nvrtc64_120_0.dll"]
    (tmp_path / "bare").write_bytes(b"\xe9nvrtc64_120_0.dll")
    assert companions.names_in(tmp_path / "bare", only_rule("cublasLt64_12.dll")) == ["nvrtc64_120_0.dll"]


def test_names_in_an_empty_file_names_nothing(tmp_path: Path) -> None:
    (tmp_path / "empty.dll").write_bytes(b"")
    assert companions.names_in(tmp_path / "empty.dll", only_rule("cublasLt64_12.dll")) == []


# ------------------------------------------------------------------------------------------------ rules


def test_every_rule_has_evidence_a_component_and_a_kind() -> None:
    assert companions.rules()
    for rule in companions.rules():
        assert rule.evidence.strip() and rule.component and rule.kind in ("required", "latent")
        assert "#" in rule.names and rule.library


@pytest.mark.parametrize(("file_name", "names", "kind"), [
    ("cublasLt64_12.dll", "nvrtc64_#_#.dll", "latent"),
    ("CUBLASLT64_12.DLL", "nvrtc64_#_#.dll", "latent"),
    ("libcublasLt.so.13", "libnvrtc.so.#", "latent"),
    (NVRTC_RULE, "nvrtc-builtins64_#.dll", "required"),
    ("libnvrtc.so.13", "libnvrtc-builtins.so.#.#", "required"),
])
def test_rules_for_a_library_that_loads_by_name(file_name: str, names: str, kind: str) -> None:
    rule = only_rule(file_name)
    assert rule.names == names and rule.kind == kind and rule.component == "cuda_nvrtc"


@pytest.mark.parametrize("file_name", ["cudart64_12.dll", "libcudart.so.13", "ggml-cuda.dll", "nvrtc-builtins64_128.dll"])
def test_rules_for_a_library_that_loads_nothing_by_name(file_name: str) -> None:
    assert companions.rules_for(file_name) == []


def test_named_by_without_latent_keeps_required_rules_only(tmp_path: Path) -> None:
    files = {"cublasLt64_12.dll": lib(tmp_path / "cublasLt64_12.dll", wide("nvrtc64_120_0.dll")),
             "nvrtc64_120_0.dll": lib(tmp_path / "nvrtc64_120_0.dll", b"nvrtc-builtins64_128.dll\x00"),
             "cudart64_12.dll": lib(tmp_path / "cudart64_12.dll", b"nvrtc64_120_0.dll\x00")}
    required = companions.named_by(files, latent=False)
    assert [(n.by, n.name, n.rule.kind) for n in required] == [
        ("nvrtc64_120_0.dll", "nvrtc-builtins64_128.dll", "required")]
    assert required[0].why == "loaded by nvrtc64_120_0.dll at run time (required companion)"
    every = companions.named_by(files, latent=True)
    assert [(n.by, n.name) for n in every] == [("cublasLt64_12.dll", "nvrtc64_120_0.dll"),
                                              ("nvrtc64_120_0.dll", "nvrtc-builtins64_128.dll")]


# ------------------------------------------------------------------------------------------------ runtime_extras


def toolkit(tmp: Path, *, skip: tuple[str, ...] = ()) -> Path:
    """A fake Windows toolkit bin directory: cuBLASLt, NVRTC and its builtins, and the recipe's two libraries
    (nvJitLink's name in upper case: Windows finds it all the same)."""
    d = tmp / "toolkit" / "bin"
    files = {"cublasLt64_12.dll": (wide("nvrtc64_120_0.dll") + b"\x00\x00",),
             "nvrtc64_120_0.dll": (b"nvrtc-builtins64_128.dll\x00",),
             "nvrtc-builtins64_128.dll": (), "NVJITLINK_120_0.DLL": (), "nvfatbin_120_0.dll": ()}
    for name, holds in files.items():
        if name not in skip:
            lib(d / name, *holds)
    return d


def extras_of(recipe: Recipe, bundled: dict[str, Path], lib_dirs: list[Path], platform: object) -> list[tuple[str, str]]:
    out = CUDA.runtime_extras(recipe, bundled, lib_dirs, platform=platform)  # type: ignore[arg-type]
    assert all(isinstance(e, Extra) for e in out)
    return [(e.path.name, e.why) for e in out]


def test_the_windows_recipe_ships_two_libraries() -> None:
    r = keys.load(WINDOWS_PATH)
    assert r.cuda is not None and r.cuda.libraries == ("nvJitLink_120_0.dll", "nvfatbin_120_0.dll")
    assert r.cuda.latent_companions == "ship"


def test_runtime_extras_on_windows_asks_for_companions_and_the_recipe_libraries(tmp_path: Path) -> None:
    d = toolkit(tmp_path)
    recipe = keys.load(WINDOWS_PATH)
    first = extras_of(recipe, {"cublasLt64_12.dll": d / "cublasLt64_12.dll"}, [tmp_path / "nowhere", d],
                      WINDOWS_PLATFORM)
    assert first == [("nvrtc64_120_0.dll", "loaded by cublasLt64_12.dll at run time (latent companion)"),
                     ("NVJITLINK_120_0.DLL", "asked for by the recipe (cuda.libraries)"),
                     ("nvfatbin_120_0.dll", "asked for by the recipe (cuda.libraries)")]
    second = extras_of(recipe, {"cublasLt64_12.dll": d / "cublasLt64_12.dll",
                                "nvrtc64_120_0.dll": d / "nvrtc64_120_0.dll"}, [d], WINDOWS_PLATFORM)
    assert second[0] == ("nvrtc-builtins64_128.dll", "loaded by nvrtc64_120_0.dll at run time (required companion)")
    assert [n for n, _ in second] == ["nvrtc-builtins64_128.dll", "NVJITLINK_120_0.DLL", "nvfatbin_120_0.dll"]


def test_runtime_extras_a_bundled_name_in_other_case_is_already_there_on_windows(tmp_path: Path) -> None:
    d = toolkit(tmp_path)
    bundled = {"cublasLt64_12.dll": d / "cublasLt64_12.dll", "NVRTC64_120_0.DLL": d / "nvrtc64_120_0.dll"}
    names = [n for n, _ in extras_of(keys.load(WINDOWS_PATH), bundled, [d], WINDOWS_PLATFORM)]
    assert names == ["nvrtc-builtins64_128.dll", "NVJITLINK_120_0.DLL", "nvfatbin_120_0.dll"]


def test_runtime_extras_a_missing_latent_companion_names_its_component_and_omit(tmp_path: Path) -> None:
    d = toolkit(tmp_path, skip=("nvrtc64_120_0.dll",))
    with pytest.raises(ToolchainError) as e:
        CUDA.runtime_extras(keys.load(WINDOWS_PATH), {"cublasLt64_12.dll": d / "cublasLt64_12.dll"}, [d],
                            platform=WINDOWS_PLATFORM)
    assert e.value.what.startswith("nvrtc64_120_0.dll (loaded by cublasLt64_12.dll at run time (latent companion))")
    assert "cuda_nvrtc" in e.value.fix and "cuda.latent_companions: omit" in e.value.fix
    assert str(d) in e.value.why and "evidence: " in e.value.why


def test_runtime_extras_a_missing_required_companion_cannot_be_omitted(tmp_path: Path) -> None:
    d = toolkit(tmp_path, skip=("nvrtc-builtins64_128.dll",))
    bundled = {"cublasLt64_12.dll": d / "cublasLt64_12.dll", "nvrtc64_120_0.dll": d / "nvrtc64_120_0.dll"}
    with pytest.raises(ToolchainError) as e:
        CUDA.runtime_extras(keys.load(WINDOWS_PATH), bundled, [d], platform=WINDOWS_PLATFORM)
    assert e.value.what.startswith("nvrtc-builtins64_128.dll ")
    assert "cuda_nvrtc" in e.value.fix and "omit" not in e.value.fix


def test_runtime_extras_a_missing_recipe_library_is_named(tmp_path: Path) -> None:
    d = toolkit(tmp_path, skip=("nvfatbin_120_0.dll",))
    with pytest.raises(ToolchainError, match=r"^nvfatbin_120_0\.dll \(cuda\.libraries\) is not in the toolkit$"):
        CUDA.runtime_extras(keys.load(WINDOWS_PATH), {}, [d], platform=WINDOWS_PLATFORM)


def test_runtime_extras_with_omit_asks_for_no_nvrtc(tmp_path: Path) -> None:
    d = toolkit(tmp_path, skip=("nvrtc64_120_0.dll",))
    recipe = windows_recipe(**{LIBRARIES_LINE: LIBRARIES_LINE + "\n  latent_companions: omit"})
    assert recipe.cuda is not None and recipe.cuda.latent_companions == "omit"
    names = [n for n, _ in extras_of(recipe, {"cublasLt64_12.dll": d / "cublasLt64_12.dll"}, [d], WINDOWS_PLATFORM)]
    assert names == ["NVJITLINK_120_0.DLL", "nvfatbin_120_0.dll"]


def test_runtime_extras_on_linux_case_matters(tmp_path: Path) -> None:
    recipe = keys.load(LINUX_PATH)
    assert recipe.cuda is not None and recipe.cuda.libraries == ()
    d = tmp_path / "lib"
    cublaslt = lib(d / "libcublasLt.so.13", b"libnvrtc.so.13\x00")
    lib(d / "libnvrtc.so.13")
    assert extras_of(recipe, {"libcublasLt.so.13": cublaslt}, [d], LINUX) == [
        ("libnvrtc.so.13", "loaded by libcublasLt.so.13 at run time (latent companion)")]
    (d / "libnvrtc.so.13").rename(d / "LIBNVRTC.SO.13")
    with pytest.raises(ToolchainError, match=r"^libnvrtc\.so\.13 .* is not in the toolkit$"):
        CUDA.runtime_extras(recipe, {"libcublasLt.so.13": cublaslt}, [d], platform=LINUX)


# ------------------------------------------------------------------------------------------------ recipe fields


def test_a_bad_latent_companions_value_is_a_recipe_error() -> None:
    with pytest.raises(RecipeError, match=r"cuda\.latent_companions"):
        windows_recipe(**{LIBRARIES_LINE: LIBRARIES_LINE + "\n  latent_companions: maybe"})


def test_a_library_listed_twice_in_other_case_is_a_recipe_error() -> None:
    with pytest.raises(RecipeError, match=r"cuda\.libraries.*listed twice"):
        windows_recipe(**{LIBRARIES_LINE: "  libraries: [nvJitLink_120_0.dll, NVJITLINK_120_0.DLL]"})


@pytest.mark.parametrize("libraries", ["[../x.dll]", "[a b.dll]", "['-x']", "[dir/x.dll]", "['dir\\\\x.dll']",
                                       "['.hidden.dll']", "['']"])
def test_a_library_that_is_not_a_file_name_is_a_recipe_error(libraries: str) -> None:
    with pytest.raises(RecipeError, match=r"cuda\.libraries"):
        windows_recipe(**{LIBRARIES_LINE: f"  libraries: {libraries}"})


def test_libraries_and_omit_change_the_key_defaults_do_not() -> None:
    shipped = keys.load(WINDOWS_PATH)
    bare = windows_recipe(**{LIBRARIES_LINE: ""})
    assert keys.resolve(bare).key != keys.resolve(shipped).key
    assert "libraries" not in keys.resolve(bare).inputs["cuda"] and "latent_companions" not in keys.resolve(bare).inputs["cuda"]
    empty = windows_recipe(**{LIBRARIES_LINE: "  libraries: []\n  latent_companions: ship"})
    assert keys.resolve(empty).key == keys.resolve(bare).key and keys.resolve(empty).inputs == keys.resolve(bare).inputs
    reordered = windows_recipe(**{LIBRARIES_LINE: "  libraries: [nvfatbin_120_0.dll, nvJitLink_120_0.dll]"})
    assert keys.resolve(reordered).key == keys.resolve(shipped).key
    omit = windows_recipe(**{LIBRARIES_LINE: LIBRARIES_LINE + "\n  latent_companions: omit"})
    assert keys.resolve(omit).key != keys.resolve(shipped).key and keys.resolve(omit).inputs["cuda"]["latent_companions"] == "omit"


# ------------------------------------------------------------------------------------------------ check_companions


def companion_bundle(tmp: Path, files: dict[str, bytes], *, cuda: dict[str, object] | None = None) -> tuple[Path, object]:
    """A real bundle (bundle.json written and read back) of `files`, its inputs' cuda section `cuda`."""
    stage = tmp / "bundle"
    inputs = test_bundles.inputs_for("companions", platform="windows-x86_64",
                                     cuda={"toolkit": "12.8.1", "archs": ["86-real"], **(cuda or {})})
    test_bundles.write_bundle(stage, files, {n: "runtime" for n in files}, name="windows-x86_64-test", inputs=inputs)
    return stage, bundle.read_manifest(stage)


CUBLASLT = b"MZ" + noise(1) + wide("nvrtc64_120_0.dll") + noise(2)
NVRTC = b"MZ" + noise(3) + b"nvrtc-builtins64_128.dll" + noise(4)


def test_check_companions_passes_when_all_are_in_the_bundle(tmp_path: Path) -> None:
    root, m = companion_bundle(tmp_path, {"cublasLt64_12.dll": CUBLASLT, "nvrtc64_120_0.dll": NVRTC,
                                          "nvrtc-builtins64_128.dll": b"MZ", "ggml-cuda.dll": b"MZ"})
    assert CUDA.check_companions(root, m, platform=platform_of(m)) == {  # type: ignore[arg-type]
        "companions": "passed (cublasLt64_12.dll -> nvrtc64_120_0.dll; nvrtc64_120_0.dll -> nvrtc-builtins64_128.dll)"}


def test_check_companions_a_missing_one_is_named(tmp_path: Path) -> None:
    root, m = companion_bundle(tmp_path, {"cublasLt64_12.dll": CUBLASLT, "nvrtc64_120_0.dll": NVRTC})
    with pytest.raises(VerifyError) as e:
        CUDA.check_companions(root, m, platform=platform_of(m))  # type: ignore[arg-type]
    assert e.value.exit_code == 5 and e.value.what == "nvrtc-builtins64_128.dll is not in the bundle"
    assert e.value.why == "missing: nvrtc-builtins64_128.dll (loaded by nvrtc64_120_0.dll at run time (required companion))"
    root, m = companion_bundle(tmp_path / "2", {"cublasLt64_12.dll": CUBLASLT})
    with pytest.raises(VerifyError, match="^nvrtc64_120_0.dll is not in the bundle$"):
        CUDA.check_companions(root, m, platform=platform_of(m))  # type: ignore[arg-type]


def test_check_companions_omit_does_not_require_the_latent_one(tmp_path: Path) -> None:
    root, m = companion_bundle(tmp_path, {"cublasLt64_12.dll": CUBLASLT, "ggml-cuda.dll": b"MZ"},
                               cuda={"latent_companions": "omit"})
    assert CUDA.check_companions(root, m, platform=platform_of(m)) == {}  # type: ignore[arg-type]
    root, m = companion_bundle(tmp_path / "2", {"cublasLt64_12.dll": CUBLASLT, "nvrtc64_120_0.dll": NVRTC,
                                                "nvrtc-builtins64_128.dll": b"MZ"}, cuda={"latent_companions": "omit"})
    assert CUDA.check_companions(root, m, platform=platform_of(m)) == {  # type: ignore[arg-type]
        "companions": "passed (nvrtc64_120_0.dll -> nvrtc-builtins64_128.dll)"}


def test_check_companions_of_a_bundle_without_cuda_libraries(tmp_path: Path) -> None:
    root, m = companion_bundle(tmp_path, {"llama-server.exe": b"MZ nvrtc64_120_0.dll", "ggml-cpu-x64.dll": b"MZ"})
    assert CUDA.check_companions(root, m, platform=platform_of(m)) == {}  # type: ignore[arg-type]
