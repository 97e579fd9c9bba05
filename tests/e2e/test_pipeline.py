"""The core pipeline, end to end on Linux: recipe → pinned source → web UI (npm, once) → CPU build → runtime
closure → bundle.json → verify → local store → cache hit; the bundle's llama-server serves a model and the UI,
and `ui pack` makes the archive of that UI that a recipe pins."""

from __future__ import annotations

import gzip
import json
import shutil
import socket
import subprocess
import urllib.request
import zipfile
from importlib import resources
from pathlib import Path
from typing import Any

from llamabundle import webui
from llamabundle.log import Log
from tests.e2e.conftest import RECIPE, SHARED_KEEP, run_cli, wait_healthy
from tests.e2e.probeprogram import ABSENT, add_unloadable_module, module, run_probe
from tests.e2e.tinymodel import write_tiny_qwen2
from tests.loopback import Loopback, static

COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"


def test_check_misses_then_build_stores_then_check_hits(first_build: dict[str, Any], store: Path, recipe_key: str) -> None:
    assert first_build["miss"].returncode == 1
    assert "miss" in first_build["miss"].stdout
    result = first_build["result"]
    assert result["hit"] is False
    assert result["key"] == recipe_key
    assert Path(result["location"]).is_file()
    assert Path(result["location"]).parent == store / recipe_key
    assert first_build["hit"].returncode == 0
    hit = json.loads(first_build["hit"].stdout)
    assert hit["hit"] is True and hit["key"] == recipe_key
    # The build ran the real pipeline and said so.
    err = first_build["build"].stderr
    assert "cache miss" in err
    assert "loaded CPU backend" in err or "load: passed" in err


def test_the_real_build_and_fetch_json_match_their_schemas(first_build: dict[str, Any], e2e_env: dict[str, str],
                                                          store: Path, recipe_key: str, tmp_path: Path) -> None:
    """`build --json` of the build that compiled, and `fetch --json` of its bundle, against the committed schemas."""
    import jsonschema

    def schema(name: str) -> Any:
        return json.loads(resources.files("llamabundle.data").joinpath(f"schemas/cli-{name}.schema.json").read_text())

    built = first_build["result"]
    jsonschema.Draft202012Validator(schema("build")).validate(built)
    assert built["ok"] is True and built["hit"] is False and built["compiled"] > 0 and built["bundled_libs"]
    fetched = run_cli("fetch", recipe_key, "--store", store, "--out", tmp_path / "fetched", "--json", env=e2e_env)
    assert fetched.returncode == 0, fetched.stderr
    got = json.loads(fetched.stdout)
    jsonschema.Draft202012Validator(schema("fetch")).validate(got)
    assert got["key"] == recipe_key and got["verify"]["levels"]["static"] == "passed"


def test_second_build_is_a_cache_hit_that_compiles_nothing(first_build: dict[str, Any], e2e_env: dict[str, str],
                                                          store: Path, recipe_key: str, tmp_path: Path) -> None:
    trees = (Path(e2e_env["LLAMABUNDLE_CACHE_DIR"]) / "build").glob(f"{recipe_key[:16]}-*/.ninja_log")
    ninja_log = max(trees, key=lambda p: p.stat().st_mtime_ns)  # the tree the first build used
    before = ninja_log.stat().st_mtime_ns
    # No cmake or ninja can be found: a hit must not need them. Only g++ is there: the recipe does not pin
    # its compiler, so the key holds the version of the one found here.
    only_gxx = tmp_path / "only-g++"
    only_gxx.mkdir()
    (only_gxx / "g++").symlink_to(shutil.which("g++", path=e2e_env.get("PATH")) or "/usr/bin/g++")
    env = {**e2e_env, "PATH": str(only_gxx)}
    res = run_cli("build", RECIPE, "--store", store, "--json", env=env)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["hit"] is True
    assert out["compiled"] == 0
    assert out["verify"]["levels"]["load"] == "passed" and out["verify"]["load_source"] == "llamabundle-probe"
    assert "cache hit" in res.stderr and "cmake" not in res.stderr
    assert ninja_log.stat().st_mtime_ns == before


def test_bundle_json_contract(unpacked: Path, recipe_key: str) -> None:
    manifest = json.loads((unpacked / "bundle.json").read_text())
    assert manifest["format"] == 1
    assert manifest["key"] == recipe_key
    assert manifest["platform"] == "linux-x86_64"
    assert manifest["llama_cpp"]["commit"] == COMMIT
    assert manifest["llama_cpp"]["source"] in ("pypi:llama-cpp-python==0.3.36", "github:ggml-org/llama.cpp")
    assert manifest["inputs"]["commit"] == COMMIT and manifest["inputs"]["cmake"]["GGML_CPU_ALL_VARIANTS"] == "ON"
    assert manifest["toolchain"]["compiler"].startswith("GNU ")
    assert manifest["toolchain"]["cmake"] and manifest["toolchain"]["ninja"]
    roles = {f["path"]: f["role"] for f in manifest["files"]}
    assert roles["llama-server"] == "exe"
    assert roles["LICENSE"] == "license"
    backends = sorted(p for p, r in roles.items() if r == "backend")
    assert backends == sorted(f"libggml-cpu-{v}.so" for v in SHARED_KEEP)  # the recipe's variants, cut for CI
    for lib in ("libllama.so.0", "libggml.so.0", "libggml-base.so.0"):
        assert roles[lib] == "runtime"
    assert "libc.so.6" in manifest["system_deps"]
    assert not any(d.startswith(("libcuda", "libnvidia")) for d in roles)
    major, minor = map(int, manifest["glibc_floor"].split("."))
    assert (major, minor) >= (2, 17)
    on_disk = sorted(p.name for p in unpacked.iterdir())
    assert on_disk == sorted([*roles, "bundle.json"])


def test_verify_load_runs_llama_server_from_a_copy(first_build: dict[str, Any], e2e_env: dict[str, str]) -> None:
    zip_path = first_build["result"]["location"]
    res = run_cli("verify", zip_path, "--level", "load", "--json", env=e2e_env)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["levels"] == {"manifest": "passed", "static": "passed", "load": "passed"}
    cpu = report["backends_loaded"]["CPU"]
    # loaded from a temporary copy of the zip's contents (never from the build tree), and named in the
    # user's terms: the member of the zip they passed
    assert cpu.startswith(f"{zip_path}:libggml-cpu-") and "llamabundle-verify-" not in cpu


def test_one_changed_byte_in_a_library_fails_verify(unpacked: Path, e2e_env: dict[str, str], tmp_path: Path) -> None:
    copy = tmp_path / "bundle"
    shutil.copytree(unpacked, copy)
    lib = copy / "libggml-base.so.0"
    data = bytearray(lib.read_bytes())
    data[len(data) // 2] ^= 0x01
    lib.write_bytes(bytes(data))
    res = run_cli("verify", copy, env=e2e_env)
    assert res.returncode == 5
    assert "libggml-base.so.0" in res.stderr
    assert "Traceback" not in res.stderr
    assert run_cli("verify", unpacked, env=e2e_env).returncode == 0


def test_a_damaged_zip_fails_verify(first_build: dict[str, Any], e2e_env: dict[str, str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.zip"
    shutil.copyfile(first_build["result"]["location"], bad)
    with zipfile.ZipFile(bad) as zf:
        info = zf.getinfo("libllama.so.0")
    data = bytearray(bad.read_bytes())
    data[info.header_offset + 200] ^= 0xFF  # inside the compressed data of one member
    bad.write_bytes(bytes(data))
    res = run_cli("verify", bad, env=e2e_env)
    assert res.returncode == 5, res.stderr
    assert "Traceback" not in res.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_llama_server_from_the_bundle_serves_a_model(unpacked: Path, e2e_env: dict[str, str], tmp_path: Path) -> None:
    version = subprocess.run([unpacked / "llama-server", "--version"], env={"PATH": "/usr/bin:/bin"},
                             capture_output=True, text=True, timeout=60)
    assert COMMIT[:8] in version.stdout + version.stderr
    src = Path(e2e_env["LLAMABUNDLE_CACHE_DIR"]) / "src" / COMMIT
    model = write_tiny_qwen2(src, tmp_path / "tiny.gguf")
    port = _free_port()
    server = subprocess.Popen([unpacked / "llama-server", "-m", model, "--host", "127.0.0.1", "--port", str(port),
                               "-c", "256", "-t", "2"], env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(port, server, said=lambda: server.stderr.read() if server.stderr else "")
        # the web UI (ui: build): llama-server serves the kept npm build it embedded, gzip as llama.cpp stores it
        ui = urllib.request.Request(f"http://127.0.0.1:{port}/", headers={"Accept-Encoding": "gzip"})
        with urllib.request.urlopen(ui, timeout=30) as r:
            assert r.status == 200 and r.headers["Content-Encoding"] == "gzip"
            page = gzip.decompress(r.read())
        toolchain = json.loads((unpacked / "bundle.json").read_text())["toolchain"]
        kept = Path(e2e_env["LLAMABUNDLE_CACHE_DIR"]) / "ui" / toolchain["ui_source"] / "dist"
        assert webui.tree_digest(kept)[0] == toolchain["ui"]
        assert page == (kept / "index.html").read_bytes() and b"<!doctype html>" in page
        req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", method="POST",
                                     data=json.dumps({"prompt": "Hello", "n_predict": 4}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            body = json.load(r)
        assert body["tokens_predicted"] == 4
        assert isinstance(body["content"], str)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def test_a_failing_configure_exits_4_with_the_tail_and_the_log(first_build: dict[str, Any], e2e_env: dict[str, str],
                                                              tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text(RECIPE.read_text().replace("GGML_BACKEND_DL: ON", "GGML_BACKEND_DL: OFF"))
    store = tmp_path / "store"
    res = run_cli("build", broken, "--store", store, env=e2e_env, timeout=900)
    assert res.returncode == 4, res.stderr[-2000:]
    assert "GGML_CPU_ALL_VARIANTS requires GGML_BACKEND_DL" in res.stderr
    assert "llamabundle-build.log" in res.stderr and "Traceback" not in res.stderr
    assert not store.exists() or not any(store.iterdir())


def test_ui_pack_makes_the_archive_a_recipe_pins_and_it_embeds_the_same_files(
        unpacked: Path, e2e_env: dict[str, str], tmp_path: Path) -> None:
    """`ui pack` of the recipe whose bundle was built: the kept UI (no npm run again) as an archive; taken as a
    pinned ui: {url, sha256} from a loopback server into a fresh cache, it is the UI the bundle embeds."""
    res = run_cli("ui", "pack", RECIPE, "--out", tmp_path / "ui", "--json", env=e2e_env)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)
    toolchain = json.loads((unpacked / "bundle.json").read_text())["toolchain"]
    assert (got["digest"], got["source"], got["commit"]) == (toolchain["ui"], toolchain["ui_source"], COMMIT)
    archive = Path(got["archive"])
    again = run_cli("ui", "pack", RECIPE, "--out", tmp_path / "again", "--json", env=e2e_env)
    assert again.returncode == 0 and json.loads(again.stdout)["sha256"] == got["sha256"]  # the same bytes
    src = Path(e2e_env["LLAMABUNDLE_CACHE_DIR"]) / "src" / COMMIT
    with Loopback(static({f"/{archive.name}": archive.read_bytes()})) as server:
        assets = webui.pinned(f"{server.url}/{archive.name}", got["sha256"], src, cache_dir=tmp_path / "cache",
                              log=Log(quiet=True))
    assert (assets.digest, assets.files) == (toolchain["ui"], got["files"]) and got["files"] > 10


def test_the_bundles_probe_says_which_backends_load_why_the_others_do_not_and_the_devices(
        unpacked: Path, tmp_path: Path) -> None:
    """llamabundle-probe (built into every bundle): each CPU variant of the bundle opened and scored as ggml
    scores it, the best one loaded and registered, the others not chosen or unsupported on this CPU, the CPU
    device; and a module whose import is nowhere is named with the loader's own message."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    got = run_probe([str(unpacked / "llamabundle-probe")], env=env)
    manifest = json.loads((unpacked / "bundle.json").read_text())
    assert "llamabundle-probe" in {f["path"] for f in manifest["files"] if f["role"] == "exe"}
    backends = {f["path"] for f in manifest["files"] if f["role"] == "backend"}
    cpu = [m for m in got["modules"] if m["backend"] == "cpu"]
    assert {m["file"] for m in cpu} == backends and len(cpu) == len(SHARED_KEEP) and got["dir"] == str(unpacked)
    (loaded,) = [m for m in cpu if m["loaded"]]
    assert loaded["registered"] == "CPU" and loaded["outcome"] == "loaded"
    assert loaded["score"] == max(m["score"] for m in cpu if m["opened"]) > 0
    assert all(m["opened"] and m["error"] is None for m in cpu)
    assert {m["outcome"] for m in cpu if not m["loaded"]} <= {"not_chosen", "unsupported"}
    assert all((m["score"] == 0) == (m["outcome"] == "unsupported") for m in cpu if not m["loaded"])
    assert [d["name"] for d in got["devices"]] == ["CPU"] and got["devices"][0]["memory_total"] > 0
    assert any(f"loaded CPU backend from {unpacked / loaded['file']}" in line["text"] for line in got["log"])
    print(f"\nprobe: {loaded['file']} loaded (score {loaded['score']}); "
          f"{sum(m['outcome'] == 'unsupported' for m in cpu)} variants unsupported on this CPU")

    copy = tmp_path / "bundle"
    shutil.copytree(unpacked, copy, symlinks=True)
    add_unloadable_module(copy, cc="gcc", name="libggml-rpc.so", dep=f"lib{ABSENT}.so")
    again = run_probe([str(copy / "llamabundle-probe")], env=env)
    rpc = module(again, "libggml-rpc.so")
    assert (rpc["opened"], rpc["loaded"], rpc["outcome"]) == (False, False, "not_opened")
    assert rpc["error"] == f"lib{ABSENT}.so: cannot open shared object file: No such file or directory"
    assert [m["file"] for m in again["modules"] if m["loaded"]] == [loaded["file"]]  # the CPU backend still loads
