"""The Windows local installer source: a synthetic 7-Zip self-extractor (a fake PE stub and a real 7z
archive made with py7zr, laid out like NVIDIA's installer) is found, verified, extracted (only the
selected component folders) and flattened into the one toolkit layout."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import re
import struct
import zlib
from pathlib import Path
from typing import Any

import py7zr
import pytest

from llamabundle import keys, sevenzip
from llamabundle.backends.cuda.toolkit import installer, layout
from llamabundle.backends.cuda.toolkit.resolve import resolve_toolkit
from llamabundle.errors import ToolchainError, UsageError
from llamabundle.log import Log
from llamabundle.settings import Settings
from tests.clirun import run  # noqa: E402

SCAN = installer.installer_data()["sfx_scan_bytes"]  # how far into an .exe the installer looks for its 7z

WIN = "windows-x86_64"
NVI = """\ufeff<?xml version="1.0" encoding="utf-8"?>
<nvi name="nvcc" version="12.8">
  <phases>
    <standard phase="copyFiles">
      <copyFile target="bin\\nvcc.exe"/>
      <copyFile target="include\\crt\\host_config.h"/>
      <copyFile target="lib\\x64\\cudadevrt.lib"/>
      <copyFile target="nvvm\\bin\\cicc.exe"/>
      <copyFile target="${{SystemRoot}}\\System32\\nvcc-helper.dll"/>
      <copyFile target="bin\\renamed.dll" source="other\\thing.dll"/>
    </standard>
    <standard phase="addRegistries"><addRegistry keyName="HKEY_LOCAL_MACHINE\\SOFTWARE\\NVIDIA"/></standard>
  </phases>
</nvi>
"""
SHARED_H = b"/* shipped identically by cudart and cublas_dev */\n"

# What the synthetic installer's 7z archive holds (3 selected-able components, one unrelated, the EULA).
PAYLOAD: dict[str, bytes] = {
    "EULA.txt": b"NVIDIA CUDA Toolkit EULA\n",
    "cuda_nvcc/nvcc/nvcc.nvi": NVI.encode("utf-8"),
    "cuda_nvcc/nvcc/LICENSE": b"nvcc license\n",
    "cuda_nvcc/nvcc/bin/nvcc.exe": b"MZ nvcc\n",
    "cuda_nvcc/nvcc/bin/not-listed.txt": b"not in nvcc.nvi: stays out\n",
    "cuda_nvcc/nvcc/include/crt/host_config.h": b"/* crt */\n",
    "cuda_nvcc/nvcc/lib/x64/cudadevrt.lib": b"lib cudadevrt\n",
    "cuda_nvcc/nvcc/nvvm/bin/cicc.exe": b"MZ cicc\n",
    "cuda_cudart/LICENSE.txt": b"cudart license\n",
    "cuda_cudart/cudart/bin/cudart64_12.dll": b"MZ cudart\n",
    "cuda_cudart/cudart/include/cuda_runtime.h": b"/* runtime */\n",
    "cuda_cudart/cudart/include/shared.h": SHARED_H,
    "cuda_cudart/cudart/lib/x64/cudart.lib": b"lib cudart\n",
    "libcublas/cublas/bin/cublas64_12.dll": b"MZ cublas\n",
    "libcublas/cublas_dev/include/cublas_v2.h": b"/* cublas */\n",
    "libcublas/cublas_dev/include/shared.h": SHARED_H,
    "libcublas/cublas_dev/lib/x64/cublas.lib": b"lib cublas\n",
    "cuda_nvrtc/nvrtc/bin/nvrtc64_120_0.dll": b"MZ nvrtc: not selected, never extracted\n",
    "cuda_nvrtc/LICENSE": b"nvrtc license\n",
}

EXPECTED_ALL = {
    "bin/nvcc.exe": b"MZ nvcc\n",
    "include/crt/host_config.h": b"/* crt */\n",
    "lib/x64/cudadevrt.lib": b"lib cudadevrt\n",
    "nvvm/bin/cicc.exe": b"MZ cicc\n",
    "bin/cudart64_12.dll": b"MZ cudart\n",
    "include/cuda_runtime.h": b"/* runtime */\n",
    "include/shared.h": SHARED_H,
    "lib/x64/cudart.lib": b"lib cudart\n",
    "bin/cublas64_12.dll": b"MZ cublas\n",
    "include/cublas_v2.h": b"/* cublas */\n",
    "lib/x64/cublas.lib": b"lib cublas\n",
    "LICENSE.cuda_nvcc": b"nvcc license\n",
    "LICENSE.cuda_cudart": b"cudart license\n",
    "LICENSE.libcublas": b"NVIDIA CUDA Toolkit EULA\n",  # no license of its own: the installer-wide EULA
}
THREE = ["cuda_nvcc", "cuda_cudart", "libcublas"]


def _stub() -> bytes:
    """A PE-like stub that even contains a 7z signature with a wrong start header CRC (a false positive to skip)."""
    fake = sevenzip.SIGNATURE + b"\x00\x04" + b"\xde\xad\xbe\xef" + struct.pack("<QQI", 0, 10, 0)
    return b"MZ" + b"\x90" * 4000 + b"This program cannot be run in DOS mode." + fake + b"\x00" * 3000


def make_7z(files: dict[str, bytes], *, plain_header: bool = False, links: dict[str, Path] | None = None) -> bytes:
    buf = io.BytesIO()
    z = py7zr.SevenZipFile(buf, "w")
    if plain_header:
        z.encoded_header_mode = False
    if links:  # py7zr writes a link only among members written from disk
        src = Path(next(iter(links.values()))).parent / "payload"
        for name, body in files.items():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes(body)
            z.write(src / name, name)
        for name, link in links.items():
            z.write(link, name)
    else:
        for name, body in files.items():
            z.writestr(body, name)
    z.close()
    return buf.getvalue()


def make_exe(path: Path, files: dict[str, bytes] | None = None, *, archive: bytes | None = None) -> Path:
    path.write_bytes(_stub() + (archive if archive is not None else make_7z(files if files is not None else PAYLOAD)))
    return path


def rename_member(archive: bytes, old: str, new: str) -> bytes:
    """Rename a member inside a 7z with a plain (unencoded) header, fixing the header CRCs: how a hostile
    name that py7zr refuses to write gets into a test archive."""
    assert len(old) == len(new)
    o, n = old.encode("utf-16-le"), new.encode("utf-16-le")
    next_ofs, next_size, _ = struct.unpack_from("<QQI", archive, 12)
    start = 32 + next_ofs
    header = archive[start:start + next_size]
    assert header.count(o) == 1
    header = header.replace(o, n)
    sig = bytearray(archive[:32])
    struct.pack_into("<I", sig, 28, zlib.crc32(header))
    struct.pack_into("<I", sig, 8, zlib.crc32(bytes(sig[12:32])))
    return bytes(sig) + archive[32:start] + header + archive[start + next_size:]


def info_for(exe: Path | None, *, pinned: bool = True) -> dict[str, Any]:
    info = copy.deepcopy(installer.installer_data())
    entry = info["installers"]["12.8.1"]
    entry["sha256"] = hashlib.sha256(exe.read_bytes()).hexdigest() if (pinned and exe is not None) else None
    entry["size"] = exe.stat().st_size if (pinned and exe is not None) else None
    return info


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
            and p.name not in ("version.json", layout.MARKER)}


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(".")) if parent.is_dir() else []


def _const(value: Any) -> Any:
    return lambda: value


@pytest.fixture
def no_7z(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sevenzip, "seven_zip_program", lambda: None)


@pytest.fixture
def exe(tmp_path: Path) -> Path:
    return make_exe(tmp_path / "cuda_12.8.1_572.61_windows.exe")


# ------------------------------------------------------------------------------------------ data


def test_the_pinned_data_describes_the_12_8_1_installer() -> None:
    entry = installer.installer_data()["installers"]["12.8.1"]
    assert entry["file"] == "cuda_12.8.1_572.61_windows.exe"
    assert entry["url"] == "https://developer.download.nvidia.com/compute/cuda/12.8.1/local_installers/cuda_12.8.1_572.61_windows.exe"
    assert re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]), "the 12.8.1 installer is pinned by its sha256"
    assert entry["sha256_source"], "and the data says where that sha256 comes from"
    # every component it maps is a Windows component of the pinned 12.8.1 redist manifest
    from llamabundle import data

    manifest = data.cuda_manifest("12.8.1")
    for comp in entry["components"]:
        assert WIN in manifest[comp], comp
    for comp in ("cuda_nvcc", "cuda_cudart", "libcublas", "libnvjitlink", "cuda_nvrtc", "libnvfatbin", "cuda_cccl"):
        assert comp in entry["components"], comp  # the shipped windows CUDA recipe's components


def test_plan_is_pure_and_names_folders_versions_and_the_pin() -> None:
    plan = installer.plan_installer(version="12.8.1", components=THREE)
    assert plan.components == {"cuda_nvcc": "12.8.93", "cuda_cudart": "12.8.90", "libcublas": "12.8.4.1"}
    assert plan.folders == {"cuda_nvcc": ("cuda_nvcc",), "cuda_cudart": ("cuda_cudart",), "libcublas": ("libcublas",)}
    assert plan.installer.file == "cuda_12.8.1_572.61_windows.exe"
    j = plan.to_json()
    assert j["source"] == "installer" and j["folders"] == ["cuda_cudart", "cuda_nvcc", "libcublas"]
    assert plan.pin == installer.plan_installer(version="12.8.1", components=list(reversed(THREE))).pin


@pytest.mark.parametrize("kwargs, words", [
    ({"platform": "linux-x86_64"}, "is for windows-x86_64, not linux-x86_64"),
    ({"components": ["cuda_nvcc", "cuda_demo_suite"]}, "cannot provide cuda_demo_suite"),
    ({"version": "11.8.0"}, "no CUDA 11.8.0 local installer"),
    ({"sha256": "0" * 64}, "not the pinned one"),
    ({"sha256": "xyz"}, "is not a sha256"),
])
def test_plan_refusals(kwargs: dict[str, Any], words: str) -> None:
    args: dict[str, Any] = {"version": "12.8.1", "components": ["cuda_nvcc"], **kwargs}
    with pytest.raises(ToolchainError) as e:
        installer.plan_installer(**args)
    assert e.value.exit_code == 3 and words in e.value.what


def test_a_component_set_without_nvcc_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="have no cuda_nvcc: a toolkit without nvcc cannot compile"):
        installer.plan_installer(version="12.8.1", components=["cuda_cudart"])


# ------------------------------------------------------------------------------- the 7z inside


def test_the_archive_is_found_after_the_stub_past_a_false_signature(exe: Path) -> None:
    assert sevenzip.find_7z_offset(exe, limit=SCAN) == len(_stub())
    with sevenzip.open_7z(exe, len(_stub())) as ar:
        names = {m.path.as_posix() for m in sevenzip.list_members(ar, exe) if not m.is_dir}
    assert names == set(PAYLOAD)


def test_not_an_exe_or_no_archive_is_refused(tmp_path: Path) -> None:
    plain = tmp_path / "plain.7z"
    plain.write_bytes(make_7z({"a/b": b"x"}))
    with pytest.raises(ToolchainError, match="not a Windows executable"):
        sevenzip.find_7z_offset(plain, limit=SCAN)
    stub_only = tmp_path / "stub.exe"
    stub_only.write_bytes(_stub())
    with pytest.raises(ToolchainError, match="no 7-Zip archive found"):
        sevenzip.find_7z_offset(stub_only, limit=SCAN)


# ------------------------------------------------------------------------------------- install


def test_install_with_py7zr_gives_the_flattened_root(exe: Path, tmp_path: Path, no_7z: None) -> None:
    plan = installer.plan_installer(version="12.8.1", components=THREE, info=info_for(exe))
    cache = tmp_path / "cache"
    res = installer.install(plan, cache_dir=cache, log=Log(quiet=True), installer=exe)
    tk = res.toolkit
    assert not res.reused and res.extractor == "py7zr" and res.installer == exe
    assert tk.root == plan.root(cache).absolute() and tk.source == "installer" and tk.platform == WIN
    assert tk.nvcc == tk.root / "bin" / "nvcc.exe" and tk.lib_dirs == [tk.root / "bin", tk.root / "lib" / "x64"]
    assert tree(tk.root) == EXPECTED_ALL  # nothing of cuda_nvrtc, nothing nvcc.nvi leaves out, no .nvi, no stray LICENSE
    version = json.loads((tk.root / "version.json").read_text())
    assert version["cuda"]["version"] == "12.8.1" and version["cuda_nvcc"]["version"] == "12.8.93"
    marker = json.loads((tk.root / layout.MARKER).read_text())
    assert marker["source"] == "installer" and marker["components"] == plan.components
    assert os.access(tk.root / "bin" / "nvcc.exe", os.X_OK) and not os.access(tk.root / "include" / "shared.h", os.X_OK)
    assert leftovers(tk.root.parent) == []
    # a second install is a no-op, and needs no installer at all
    again = installer.install(plan, cache_dir=cache, log=Log(quiet=True), installer=None)
    assert again.reused and again.toolkit.root == tk.root


def test_only_the_selected_components_are_extracted(exe: Path, tmp_path: Path, no_7z: None,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    real = sevenzip.extract_with_py7zr

    def spy(exe_: Path, offset: int, wanted: Any, xdir: Path) -> None:
        seen.extend(m.path.as_posix() for m in wanted)
        real(exe_, offset, wanted, xdir)

    monkeypatch.setattr(sevenzip, "extract_with_py7zr", spy)
    plan = installer.plan_installer(version="12.8.1", components=["cuda_nvcc"], info=info_for(exe))
    tk = installer.install(plan, cache_dir=tmp_path / "cache", log=Log(quiet=True), installer=exe).toolkit
    assert sorted(seen) == sorted(n for n in PAYLOAD if n.startswith("cuda_nvcc/") or n == "EULA.txt")
    assert tree(tk.root) == {k: v for k, v in EXPECTED_ALL.items()
                             if k in ("bin/nvcc.exe", "include/crt/host_config.h", "lib/x64/cudadevrt.lib",
                                      "nvvm/bin/cicc.exe", "LICENSE.cuda_nvcc")}


def test_a_wrong_sha256_is_refused_and_leaves_nothing(exe: Path, tmp_path: Path) -> None:
    info = info_for(exe)
    info["installers"]["12.8.1"]["sha256"] = "1" * 64
    plan = installer.plan_installer(version="12.8.1", components=THREE, info=info)
    cache = tmp_path / "cache"
    with pytest.raises(ToolchainError) as e:
        installer.install(plan, cache_dir=cache, log=Log(quiet=True), installer=exe)
    assert e.value.exit_code == 3 and "sha256 mismatch" in e.value.what
    assert not plan.root(cache).exists() and leftovers(plan.root(cache).parent) == []
    assert not (cache / "downloads").exists()


def test_an_unpinned_installer_is_refused_without_an_explicit_sha256(exe: Path, tmp_path: Path) -> None:
    info = info_for(exe, pinned=False)
    plan = installer.plan_installer(version="12.8.1", components=THREE, info=info)
    assert plan.sha256 is None and plan.sha256_origin is None
    with pytest.raises(ToolchainError) as e:
        installer.install(plan, cache_dir=tmp_path / "cache", log=Log(quiet=True), installer=exe)
    assert e.value.exit_code == 3 and "no pinned sha256" in e.value.what and "MD5" in e.value.why
    assert "--installer-sha256" in e.value.fix
    assert not (tmp_path / "cache" / "toolkits").exists() or not any((tmp_path / "cache" / "toolkits").iterdir())
    # with the explicit sha256 of the file it installs
    sha = hashlib.sha256(exe.read_bytes()).hexdigest()
    plan = installer.plan_installer(version="12.8.1", components=THREE, info=info, sha256=sha.upper())
    assert plan.sha256 == sha and plan.sha256_origin == "explicit"
    installer.install(plan, cache_dir=tmp_path / "cache", log=Log(quiet=True), installer=exe)


def test_a_hostile_member_name_is_refused(tmp_path: Path, no_7z: None) -> None:
    archive = rename_member(make_7z({**PAYLOAD, "xx/evil": b"owned\n"}, plain_header=True), "xx/evil", "../evil")
    exe = make_exe(tmp_path / "evil.exe", archive=archive)
    plan = installer.plan_installer(version="12.8.1", components=THREE, info=info_for(exe))
    cache = tmp_path / "cache"
    with pytest.raises(ToolchainError) as e:
        installer.install(plan, cache_dir=cache, log=Log(quiet=True), installer=exe)
    assert e.value.exit_code == 3 and "'../evil'" in e.value.what and "'..'" in e.value.what
    assert not (tmp_path / "evil").exists() and not (cache / "evil").exists()
    assert not plan.root(cache).exists() and leftovers(plan.root(cache).parent) == []


@pytest.mark.parametrize("hostile, words", [("/abs/evil", "an absolute path"), ("C:/x/evil", "drive letter")])
def test_absolute_and_drive_names_are_refused(tmp_path: Path, hostile: str, words: str) -> None:
    placeholder = "q" * len(hostile)
    archive = rename_member(make_7z({**PAYLOAD, placeholder: b"x"}, plain_header=True), placeholder, hostile)
    exe = make_exe(tmp_path / "evil.exe", archive=archive)
    with sevenzip.open_7z(exe, sevenzip.find_7z_offset(exe, limit=SCAN)) as ar, pytest.raises(ToolchainError, match=words):
        sevenzip.list_members(ar, exe)


def test_a_symlink_member_is_refused(tmp_path: Path, no_7z: None) -> None:
    link = tmp_path / "link"
    os.symlink(os.path.relpath("/etc/passwd", tmp_path), link)  # ../../…/etc/passwd, however deep tmp_path is
    exe = make_exe(tmp_path / "links.exe", archive=make_7z(PAYLOAD, links={"cuda_cudart/cudart/bin/evil.dll": link}))
    plan = installer.plan_installer(version="12.8.1", components=THREE, info=info_for(exe))
    with pytest.raises(ToolchainError, match="is a symbolic link"):
        installer.install(plan, cache_dir=tmp_path / "cache", log=Log(quiet=True), installer=exe)
    assert leftovers(plan.root(tmp_path / "cache").parent) == []


def test_a_file_its_nvi_lists_but_the_installer_lacks_is_an_error(tmp_path: Path, no_7z: None) -> None:
    payload = {k: v for k, v in PAYLOAD.items() if k != "cuda_nvcc/nvcc/nvvm/bin/cicc.exe"}
    exe = make_exe(tmp_path / "short.exe", payload)
    plan = installer.plan_installer(version="12.8.1", components=["cuda_nvcc"], info=info_for(exe))
    with pytest.raises(ToolchainError, match=r"nvcc.nvi lists 1 file\(s\) the installer does not hold") as e:
        installer.install(plan, cache_dir=tmp_path / "cache", log=Log(quiet=True), installer=exe)
    assert "nvvm/bin/cicc.exe" in e.value.why


def test_two_components_with_different_files_at_one_path_conflict(tmp_path: Path, no_7z: None) -> None:
    exe = make_exe(tmp_path / "conflict.exe", {**PAYLOAD, "libcublas/cublas_dev/include/shared.h": b"/* other */\n"})
    plan = installer.plan_installer(version="12.8.1", components=THREE, info=info_for(exe))
    with pytest.raises(ToolchainError, match="components cuda_cudart and libcublas both ship include/shared.h"):
        installer.install(plan, cache_dir=tmp_path / "cache", log=Log(quiet=True), installer=exe)


def test_a_missing_component_folder_is_named(tmp_path: Path, no_7z: None) -> None:
    exe = make_exe(tmp_path / "nocublas.exe", {k: v for k, v in PAYLOAD.items() if not k.startswith("libcublas/")})
    plan = installer.plan_installer(version="12.8.1", components=THREE, info=info_for(exe))
    with pytest.raises(ToolchainError, match=r"has no libcublas/ folder \(for libcublas\)"):
        installer.install(plan, cache_dir=tmp_path / "cache", log=Log(quiet=True), installer=exe)


def test_a_failing_7z_program_falls_back_to_py7zr(exe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bin" / "7zz"
    bad.parent.mkdir()
    bad.write_text("#!/bin/sh\necho \"7zz: $*\" >&2\nexit 2\n")
    bad.chmod(0o755)
    plan = installer.plan_installer(version="12.8.1", components=THREE, info=info_for(exe))
    res = installer.install(plan, cache_dir=tmp_path / "cache", log=Log(), installer=exe, program=str(bad))
    assert res.extractor == "py7zr" and tree(res.toolkit.root) == EXPECTED_ALL
    err = capsys.readouterr().err
    assert "7zz could not extract" in err and "trying py7zr" in err
    assert f"-o{tmp_path}" in err and "-scsUTF-8" in err and " @" in err  # the command line it ran


def test_an_external_7z_program_gives_the_same_tree(exe: Path, tmp_path: Path) -> None:
    program = sevenzip.seven_zip_program()
    if program is None:
        pytest.skip("no 7zz, 7z or 7zr on PATH (e.g. apt-get install 7zip); the py7zr path is tested above")
    plan = installer.plan_installer(version="12.8.1", components=THREE, info=info_for(exe))
    res = installer.install(plan, cache_dir=tmp_path / "cache", log=Log(quiet=True), installer=exe, program=program)
    assert res.extractor == program and tree(res.toolkit.root) == EXPECTED_ALL


def test_resolve_installs_from_a_local_installer_named_in_the_environment(exe: Path, tmp_path: Path, no_7z: None,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    recipe_path = tmp_path / "windows-x86_64-cuda12.8-installer.yaml"
    recipe_path.write_text("""\
recipe: 1
name: windows-x86_64-cuda12.8-installer
platform: windows-x86_64
llama_cpp:
  commit: 0c1e57098bba43ac29e6e3b677cdceebdd22334f
  sources:
    - github: ggml-org/llama.cpp
backends: [cpu, cuda]
toolchain: {compiler: msvc}
cuda:
  toolkit: 12.8.1
  source: installer
  components: [cuda_nvcc, cuda_cudart]
  archs: [86-real]
targets: [llama-server]
""")
    monkeypatch.setattr(installer, "installer_data", _const(info_for(exe, pinned=False)))
    env = {"LLAMABUNDLE_CACHE_DIR": str(tmp_path / "cache")}  # the installer's path and sha256 come from Settings
    sha = hashlib.sha256(exe.read_bytes()).hexdigest()
    recipe = keys.load(recipe_path)
    with pytest.raises(ToolchainError, match="no pinned sha256"):
        resolve_toolkit(recipe, settings=Settings.from_env({**env, "LLAMABUNDLE_CUDA_INSTALLER": str(exe)}),
                        log=Log(quiet=True), env={})
    tk = resolve_toolkit(recipe, settings=Settings.from_env({**env, "LLAMABUNDLE_CUDA_INSTALLER": str(exe),
                                                             "LLAMABUNDLE_CUDA_INSTALLER_SHA256": sha}),
                         log=Log(quiet=True), env={})
    assert tk.source == "installer" and (tk.root / "bin" / "cudart64_12.dll").is_file()


# ------------------------------------------------------------------------------------------ CLI




BASE = ("--source", "installer", "--version", "12.8.1", "--components", "cuda_nvcc,cuda_cudart,libcublas")


def test_cli_plan_shows_the_installer_its_pin_and_the_folders(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "toolkit", "plan", *BASE)
    assert code == 0
    entry = installer.installer_data()["installers"]["12.8.1"]
    assert "cuda_12.8.1_572.61_windows.exe" in out and entry["url"] in out
    assert (entry["sha256"] or "NOT PINNED") in out
    for comp, folder in (("cuda_nvcc", "cuda_nvcc/"), ("cuda_cudart", "cuda_cudart/"), ("libcublas", "libcublas/")):
        assert any(line.startswith(comp) and folder in line for line in out.splitlines()), comp
    code, out, _ = run(capsys, "toolkit", "plan", *BASE, "--json")
    j = json.loads(out)
    assert code == 0 and j["source"] == "installer" and j["installer"]["file"] == entry["file"]
    assert j["installer"]["sha256"] == entry["sha256"] and j["installer"]["size"] == entry["size"]
    assert j["folders"] == ["cuda_cudart", "cuda_nvcc", "libcublas"] and j["installed"] is False


def test_cli_plan_says_when_the_installer_is_not_pinned(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(installer, "installer_data", _const(info_for(None, pinned=False)))
    code, out, _ = run(capsys, "toolkit", "plan", *BASE)
    assert code == 0 and "NOT PINNED" in out and "--installer-sha256" in out


def test_cli_install_from_a_local_installer(exe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch, no_7z: None) -> None:
    monkeypatch.setattr(installer, "installer_data", _const(info_for(exe)))
    code, out, err = run(capsys, "toolkit", "install", *BASE, "--installer", exe, "--json")
    assert code == 0, err
    j = json.loads(out)
    assert j["source"] == "installer" and j["reused"] is False and j["extractor"] == "py7zr"
    assert tree(Path(j["root"])) == EXPECTED_ALL
    code, out, _ = run(capsys, "toolkit", "install", *BASE)
    assert code == 0 and "already installed and intact" in out
    code, out, _ = run(capsys, "toolkit", "plan", *BASE, "--json")
    assert json.loads(out)["installed"] is True


def test_cli_refuses_a_wrong_or_missing_sha256_with_exit_3(exe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # the real pin: the synthetic .exe is not NVIDIA's installer
    code, _, err = run(capsys, "toolkit", "install", *BASE, "--installer", exe)
    assert code == 3 and "sha256 mismatch" in err
    monkeypatch.setattr(installer, "installer_data", _const(info_for(exe, pinned=False)))
    code, _, err = run(capsys, "toolkit", "install", *BASE, "--installer", exe)
    assert code == 3 and "no pinned sha256" in err and "--installer-sha256" in err
    code, _, err = run(capsys, "toolkit", "install", *BASE, "--installer", exe, "--installer-sha256", "2" * 64)
    assert code == 3 and "sha256 mismatch" in err
    toolkits = Path(os.environ["LLAMABUNDLE_CACHE_DIR"]) / "toolkits"
    assert not toolkits.exists() or not any(toolkits.iterdir())
    sha = hashlib.sha256(exe.read_bytes()).hexdigest()
    monkeypatch.setattr(sevenzip, "seven_zip_program", lambda: None)
    code, out, err = run(capsys, "toolkit", "install", *BASE, "--installer", exe, "--installer-sha256", sha)
    assert code == 0, err
    assert "installed CUDA 12.8.1" in out


def test_cli_installer_options_need_the_installer_source(exe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "toolkit", "plan", "--version", "12.8.1", "--components", "cuda_nvcc", "--installer", exe)
    assert code == 2 and "--source installer" in err
    code, _, err = run(capsys, "toolkit", "plan", *BASE[:2], "--version", "12.8.1", "--components", "cuda_nvcc",
                       "--platform", "linux-x86_64")
    assert code == 3 and "is for windows-x86_64" in err

