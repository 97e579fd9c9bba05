"""The Vulkan bundle, built for real here: the shipped recipe with the CPU variants cut to two (x64 and
haswell: the Vulkan backend is what is under test; the CPU variants are the shared build's), the pinned Debian
headers downloaded by llamabundle, the shaders compiled by the glslc on PATH; after the session's shared CPU
build, whose compiler cache gives it every compile but ggml-vulkan's. Lavapipe (mesa-vulkan-drivers)
is the Vulkan device: `verify --level load` passes with it, `--level gpu` is skipped with its reason (a CPU
implementation is not a GPU), and the bundle's llama-server answers /completion with its model on Vulkan0.

Needs glslc, libvulkan1 and mesa-vulkan-drivers (`.ci/run` installs them) and deb.debian.org (a package
registry) for the headers, once: the download is cached."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from .conftest import BUILD_TIMEOUT, REPO, cut_variants, run_cli
from .probeprogram import module, run_probe
from .tinymodel import write_tiny_qwen2

MiB = 1 << 20

SHIPPED = REPO / "recipes" / "linux-x86_64-vulkan.yaml"
KEEP = ("x64", "haswell")
LAVAPIPE = "/usr/share/vulkan/icd.d/lvp_icd.x86_64.json"

pytestmark = pytest.mark.skipif(shutil.which("glslc") is None or not Path(LAVAPIPE).is_file()
                                or not any(Path(d, "libvulkan.so.1").exists() for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu")),
                                reason="needs glslc, libvulkan1 and mesa-vulkan-drivers (.ci/run installs them)")


@pytest.fixture(scope="module")
def vulkan_build(first_build: dict[str, Any], e2e_env: dict[str, str],
                 tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Built after the session's shared CPU build (on its worker: tests/conftest.py), whose compiler cache holds
    every compile of this recipe but the Vulkan backend's own (test_the_cpu_part_comes_from_the_shared_builds_cache)."""
    d = tmp_path_factory.mktemp("vulkan")
    recipe = cut_variants(SHIPPED, d / "vulkan.yaml", keep=KEEP)
    t0 = time.monotonic()
    build = run_cli("build", recipe, "--store", d / "store", "--out", d / "bundle", "--ops-tool", "--json",
                    env=e2e_env, timeout=BUILD_TIMEOUT)
    if build.returncode != 0:
        pytest.fail(f"llamabundle build failed ({build.returncode}):\n{build.stderr[-6000:]}")
    result = json.loads(build.stdout)
    print(f"\nvulkan e2e build: {time.monotonic() - t0:.0f} s, {result['compiled']} edges compiled; "
          f"zip {Path(result['zip']).stat().st_size} bytes")
    return {"dir": d, "recipe": recipe, "result": result, "bundle": d / "bundle", "stderr": build.stderr}


def test_bundle_records_the_vulkan_inputs(vulkan_build: dict[str, Any]) -> None:
    manifest = json.loads((vulkan_build["bundle"] / "bundle.json").read_text())
    assert manifest["backends"] == ["cpu", "vulkan"]
    glslc = subprocess.run(["glslc", "--version"], capture_output=True, text=True, check=True).stdout
    shaderc = glslc.split()[1]
    assert manifest["vulkan"]["glslc"] == shaderc == manifest["inputs"]["vulkan"]["glslc"]["version"]
    assert manifest["vulkan"]["headers"] == "1.4.309"
    assert manifest["vulkan"]["shader_extensions"] == manifest["inputs"]["vulkan"]["glslc"]["features"]
    names = {f["path"]: f for f in manifest["files"]}
    assert "libggml-vulkan.so" in names and names["libggml-vulkan.so"]["origin"] == "build"
    assert "libvulkan.so.1" not in names, "the Vulkan loader is the machine's, never bundled"
    assert "libvulkan.so.1" in manifest["system_deps"]
    assert manifest["toolchain"]["glslc"] == shaderc and manifest["toolchain"]["vulkan_headers"] == "1.4.309"


def test_the_cpu_part_comes_from_the_shared_builds_cache(first_build: dict[str, Any],
                                                         vulkan_build: dict[str, Any]) -> None:
    """A toolkit's path map is on its own backend's compiles only (build.py): every other compile of the Vulkan
    recipe is the CPU recipe's, so the compiler cache the shared build filled serves it; only the objects the shared
    build does not have (ggml-vulkan's, and test-backend-ops for --ops-tool) may miss (all of them in CI, whose cache
    starts empty)."""
    shared = first_build["result"]["compiler_cache"]
    stats = vulkan_build["result"]["compiler_cache"]
    if shared is None:
        pytest.skip("the shared build compiled without a compiler cache (no ccache or sccache on PATH)")
    if vulkan_build["result"]["compiled"] < 200:  # a new tree (CI's always is) runs more steps than that
        pytest.skip(f"the Vulkan build tree of an earlier run was partly up to date: {vulkan_build['result']['compiled']} "
                    "steps ran")
    assert stats is not None and stats["tool"] == shared["tool"], stats

    def tree(result: dict[str, Any]) -> Path:
        return Path(result["bundled_libs"]["libggml-base.so.0"]).parent.parent

    shared_objects = set(re.findall(r"^build (\S+\.o): ", (tree(first_build["result"]) / "build.ninja").read_text(), re.M))
    log = (tree(vulkan_build["result"]) / ".ninja_log").read_text().splitlines()
    outputs = [line.split("\t")[3] for line in log if not line.startswith("#")]  # start, end, mtime, output, hash
    compiled = {o for o in outputs if o.endswith(".o")}
    own = compiled - shared_objects  # ggml-vulkan's, and test-backend-ops (--ops-tool)
    assert any("/ggml-vulkan.dir/" in o for o in own) and stats["hits"] + stats["misses"] >= 200, (sorted(own)[:5], stats)
    assert stats["misses"] <= len(own), (f"{stats['misses']} misses, but only {len(own)} compiles are not the shared "
                                         "build's: a compile outside the Vulkan backend differs from the CPU recipe's", stats)
    print(f"\nthe Vulkan build's compiler cache: {stats['hits']} hits, {stats['misses']} misses "
          f"({len(own)} of its {len(compiled)} compiles are not the shared build's)")


def test_verify_load_passes_with_lavapipe_and_gpu_is_skipped(vulkan_build: dict[str, Any], e2e_env: dict[str, str]) -> None:
    zip_path = vulkan_build["result"]["zip"]
    load = run_cli("verify", zip_path, "--level", "load", "--json", env=e2e_env)
    assert load.returncode == 0, load.stderr
    report = json.loads(load.stdout)
    assert report["levels"]["load"] == "passed" and report["load_source"] == "llamabundle-probe"
    assert report["modules"]["libggml-vulkan.so"] == "loaded"
    assert report["backends_loaded"]["Vulkan"].endswith(":libggml-vulkan.so")
    assert report["levels"]["vulkan"].startswith("passed")
    gpu = run_cli("verify", zip_path, "--level", "gpu", "--json", env=e2e_env)
    assert gpu.returncode == 0, gpu.stderr
    level = json.loads(gpu.stdout)["levels"]["gpu"]
    if Path("/dev/dri").exists() or Path("/dev/nvidiactl").exists():
        pytest.skip(f"this machine has a GPU device node: gpu level said {level!r}")
    assert level.startswith("skipped: ") and "Vulkan" in level, level
    strict = run_cli("verify", zip_path, "--level", "gpu", "--require-gpu", env=e2e_env)
    assert strict.returncode != 0 and "--require-gpu" in strict.stderr


def test_ops_level_runs_test_backend_ops_on_the_vulkan_device(vulkan_build: dict[str, Any], e2e_env: dict[str, str]) -> None:
    """llama.cpp's test-backend-ops from the same build tree (beside the zip, not in it), run from inside an
    unpacked copy against Vulkan0 (lavapipe, made a device by GGML_VK_VISIBLE_DEVICES=0), against the CPU."""
    result = vulkan_build["result"]
    tool = Path(result["ops_tool"])
    assert tool.is_file() and tool.name.endswith(".test-backend-ops")
    manifest = json.loads((vulkan_build["bundle"] / "bundle.json").read_text())
    assert not any("test-backend-ops" in f["path"] for f in manifest["files"])
    plain = run_cli("verify", result["zip"], "--level", "ops", "--json", env=e2e_env)
    assert plain.returncode == 0, plain.stderr
    assert json.loads(plain.stdout)["levels"]["ops"].startswith("skipped: the bundle lists no GPU device")
    env = {**e2e_env, "GGML_VK_VISIBLE_DEVICES": "0"}
    ops = run_cli("verify", result["zip"], "--level", "ops", "--ops-budget", "90", "--json", env=env, timeout=900)
    assert ops.returncode == 0, ops.stderr[-3000:]
    report = json.loads(ops.stdout)
    (vulkan0,) = report["ops"]
    print(f"\nops on lavapipe: {vulkan0}")
    assert vulkan0["device"] == "Vulkan0" and vulkan0["passed"] > 0 and vulkan0["failed"] == 0
    assert report["levels"]["ops"].startswith("passed (Vulkan0: ")


def _post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out: dict[str, Any] = json.loads(r.read())
        return out


def test_llama_server_completes_on_the_vulkan_device(vulkan_build: dict[str, Any], e2e_env: dict[str, str],
                                                    tmp_path: Path) -> None:
    """The bundle's own llama-server, the model offloaded to Vulkan0 (lavapipe, made visible to ggml)."""
    bundle = vulkan_build["bundle"]
    commit = json.loads((bundle / "bundle.json").read_text())["llama_cpp"]["commit"]
    model = write_tiny_qwen2(Path(e2e_env["LLAMABUNDLE_CACHE_DIR"]) / "src" / commit, tmp_path / "tiny.gguf")
    port = _free_port()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "GGML_VK_VISIBLE_DEVICES": "0",
           "VK_DRIVER_FILES": LAVAPIPE}
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen([str(bundle / "llama-server"), "-m", str(model), "--device", "Vulkan0", "-ngl", "99",
                                   "--host", "127.0.0.1", "--port", str(port), "-c", "256", "--no-webui", "--verbose"],
                                  env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        _wait_ready(port, server, log)
        got = _post(f"http://127.0.0.1:{port}/completion", {"prompt": "Hello", "n_predict": 8, "temperature": 0},
                    timeout=300)
        assert got["tokens_predicted"] == 8 and isinstance(got["content"], str)
        text = log.read_text(errors="replace")
        assert "using device Vulkan0 (llvmpipe" in text, text[-3000:]
        assert re.search(r"offloaded (\d+)/\1 layers to GPU", text), text[-3000:]
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def test_plan_sizes_its_rungs_with_the_bundles_dry_run_as_llama_server_allocates(
        vulkan_build: dict[str, Any], e2e_env: dict[str, str], tmp_path: Path) -> None:
    """`plan --bundle` on lavapipe (made a device by GGML_VK_VISIBLE_DEVICES=0): with less free VRAM than the
    whole model needs, the rungs are sized by the bundle's llamabundle-memory (llama.cpp's no_alloc dry run),
    and the plan's launch, started for real, allocates on Vulkan0 the model, KV and compute buffers the plan
    printed (whole MiB, rounded down) and fits in the free VRAM less the headroom."""
    bundle = vulkan_build["bundle"]
    names = {f["path"] for f in json.loads((bundle / "bundle.json").read_text())["files"]}
    assert "llamabundle-memory" in names
    commit = json.loads((bundle / "bundle.json").read_text())["llama_cpp"]["commit"]
    model = write_tiny_qwen2(Path(e2e_env["LLAMABUNDLE_CACHE_DIR"]) / "src" / commit, tmp_path / "m.gguf",
                             layers=8, hidden=256, heads=4, kv_heads=4, ffn=768)
    env = {**e2e_env, "GGML_VK_VISIBLE_DEVICES": "0"}

    def plan(*args: object) -> dict[str, Any]:
        done = run_cli("plan", model, "--ctx", "4096", "--json", *args, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        out: dict[str, Any] = json.loads(done.stdout)
        return out

    full = plan("--free-vram", "100GiB", "--bundle", bundle)
    assert full["estimate_by"] == "llama.cpp dry run" and full["dry_run"]["device"] == "Vulkan0", full
    assert full["ngl"] == 9 and full["dry_run"]["runs"] == 1
    need = full["bytes"]["total"] - full["bytes"]["headroom"]
    free = int((need + 256 * MiB) / 0.95) - 2 * MiB  # the whole model does not fit, by 2 MiB
    got = plan("--free-vram", free, "--bundle", bundle)
    assert got["estimate_by"] == "llama.cpp dry run" and 0 < got["ngl"] < 9, got
    assert got["bytes"]["total"] <= free and got["reasons"][0].startswith(f"-ngl {got['ngl']}: one step more")
    closed = plan("--free-vram", free, "--closed-form")
    assert closed["estimate_by"] == "closed form" and closed["dry_run"] is None and closed["dry_run_skipped"] == "--closed-form"

    port = _free_port()
    log = tmp_path / "server.log"
    run_env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "GGML_VK_VISIBLE_DEVICES": "0", "VK_DRIVER_FILES": LAVAPIPE}
    with open(log, "w") as out:
        server = subprocess.Popen([str(bundle / "llama-server"), "-m", str(model), *got["flags"], "--fit", "off",
                                   "--host", "127.0.0.1", "--port", str(port), "--no-webui", "--verbose"],
                                  env=run_env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        _wait_ready(port, server, log)
    finally:
        server.terminate()
        server.wait(timeout=30)
    from llamabundle.runtime.server_args import parse_buffer_log

    logged = parse_buffer_log(log.read_text(errors="replace"))
    for kind, key in (("model", "weights"), ("kv", "kv"), ("compute", "compute")):
        assert abs(logged.gpu(kind) - got["bytes"][key]) < 1.01 * MiB, (kind, logged.sizes, got["bytes"])
    used = logged.gpu("model") + logged.gpu("kv") + logged.gpu("compute")
    print(f"\nplan on lavapipe: -ngl {got['ngl']} of 9 in {free / MiB:,.1f} MiB ({got['dry_run']['runs']} dry runs, "
          f"{got['dry_run']['seconds']:.1f} s); llama-server allocated {used / MiB:,.1f} MiB on Vulkan0")
    assert used + got["bytes"]["headroom"] <= free


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_ready(port: int, server: subprocess.Popen[bytes], log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"llama-server exited with {server.returncode}:\n{log.read_text(errors='replace')[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"llama-server was not ready in {timeout:.0f}s:\n{log.read_text(errors='replace')[-4000:]}")


if __name__ == "__main__":  # write the e2e recipe (to build it ahead of the test run): python -m tests.e2e.test_vulkan_bundle OUT
    print(cut_variants(SHIPPED, Path(sys.argv[1]), keep=KEEP))
    os._exit(0)


def test_the_bundles_probe_lists_the_vulkan_device_and_says_when_the_loader_is_absent(
        vulkan_build: dict[str, Any], tmp_path: Path) -> None:
    """llamabundle-probe of the Vulkan bundle: on lavapipe (made a device by GGML_VK_VISIBLE_DEVICES=0) the Vulkan
    module loads and lists Vulkan0 with its memory; on a machine without the Vulkan loader (libvulkan.so.1 hidden
    in a mount namespace of the probe's own) the module's reason is the loader's message naming it."""
    bundle = vulkan_build["bundle"]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "GGML_VK_VISIBLE_DEVICES": "0", "VK_DRIVER_FILES": LAVAPIPE}
    got = run_probe([str(bundle / "llamabundle-probe")], env=env)
    vulkan = module(got, "libggml-vulkan.so")
    assert (vulkan["loaded"], vulkan["registered"], vulkan["error"]) == (True, "Vulkan", None)
    (dev,) = [d for d in got["devices"] if d["backend"] == "Vulkan"]
    assert dev["name"] == "Vulkan0" and "llvmpipe" in (dev["description"] or "") and dev["memory_total"] > 0
    assert got["devices"][-1]["name"] == "CPU" and dev["compute_capability"] is None
    print(f"\nprobe on lavapipe: {dev}")

    loader = subprocess.run(["sh", "-c", "ldconfig -p | awk '/libvulkan.so.1 .*x86-64/{print $NF; exit}'"],
                            capture_output=True, text=True).stdout.strip()
    assert loader, "no libvulkan.so.1 on this machine"
    # the loader's directory, seen through a farm of links to all it holds but libvulkan.so* (its own files stay
    # reachable through a second mount of it), in a mount namespace that ends with the probe
    hide = (f"set -e; real=$(readlink -f {loader}); dir=$(dirname $real); orig={tmp_path}/orig; farm={tmp_path}/farm; "
            "mkdir $orig $farm; "
            "mount --bind $dir $orig; for f in $orig/*; do case ${f##*/} in libvulkan.so*) ;; *) ln -s $f $farm/;; esac; "
            f"done; mount --bind $farm $dir; exec {bundle / 'llamabundle-probe'}")
    namespace = ["unshare", "--mount"] if os.geteuid() == 0 else ["unshare", "--user", "--map-root-user", "--mount"]
    if subprocess.run([*namespace, "true"], capture_output=True).returncode != 0:
        pytest.skip("no mount namespace here (unshare refused): the loader cannot be hidden from the probe")
    absent = run_probe([*namespace, "sh", "-c", hide], env=env)
    vulkan = module(absent, "libggml-vulkan.so")
    assert (vulkan["opened"], vulkan["outcome"]) == (False, "not_opened")
    assert vulkan["error"] == "libvulkan.so.1: cannot open shared object file: No such file or directory"
    assert [d["name"] for d in absent["devices"]] == ["CPU"]
    print(f"probe without the Vulkan loader: {vulkan['error']}")


def test_a_node_app_installs_the_vulkan_bundle_and_chooses_vulkan_from_its_probe(vulkan_build: dict[str, Any],
                                                                                 tmp_path: Path) -> None:
    """tests/consumer: Node installs the Vulkan bundle from its store, then asks the install's own llamabundle-probe
    which backend runs (Vulkan0 on lavapipe, made a device by the user's GGML_VK_VISIBLE_DEVICES=0) — no Python,
    no log parsing."""
    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        pytest.skip("node is not installed (Debian: apt-get install nodejs)")
    consumer = REPO / "tests" / "consumer"
    key = vulkan_build["result"]["key"]
    inst = subprocess.run([node, str(consumer / "install.mjs"), "--store", str(vulkan_build["dir"] / "store"), "--key", key,
                           "--dest", str(tmp_path / "apps")], capture_output=True, text=True, timeout=300)
    assert inst.returncode == 0, inst.stderr
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "GGML_VK_VISIBLE_DEVICES": "0", "VK_DRIVER_FILES": LAVAPIPE}
    got = subprocess.run([node, str(consumer / "backend.mjs"), "--dest", str(tmp_path / "apps"), "--name",
                          json.loads(inst.stdout)["name"]], capture_output=True, text=True, timeout=300, env=env)
    assert got.returncode == 0, got.stderr
    chosen = json.loads(got.stdout)
    assert (chosen["backend"], chosen["device"], chosen["server_args"]) == ("vulkan", "Vulkan0", ["--device", "Vulkan0"])
    assert "llvmpipe" in chosen["description"] and chosen["memory_free"] > 0 and chosen["passed_over"] == []


def test_the_cpu_part_installs_alone_verifies_and_vulkan_is_added_by_its_own_files(
        vulkan_build: dict[str, Any], e2e_env: dict[str, str], tmp_path: Path) -> None:
    """A partial install of the real CPU+Vulkan bundle from the store the build published it to: bundle.json's
    parts (computed from the binaries' imports) give Vulkan its module only; `install --backends cpu` installs
    the rest, which verifies at the load level on its own; adding vulkan downloads only libggml-vulkan.so and
    the whole then loads Vulkan on lavapipe."""
    key, store, root = vulkan_build["result"]["key"], vulkan_build["dir"] / "store", tmp_path / "data"
    published = json.loads((vulkan_build["bundle"] / "bundle.json").read_text())
    assert published["parts"] == {"vulkan": ["libggml-vulkan.so"]}
    zip_size = Path(vulkan_build["result"]["zip"]).stat().st_size

    def install(backends: str) -> dict[str, Any]:
        got = run_cli("install", "--store", store, "--key", key, "--dest", root, "--backends", backends, "--json", env=e2e_env)
        assert got.returncode == 0, got.stderr
        out: dict[str, Any] = json.loads(got.stdout)
        return out

    cpu = install("cpu")
    path = Path(cpu["path"])
    held = json.loads((path / "bundle.json").read_text())
    assert cpu["backends"] == held["backends"] == ["cpu"] and held["cut"]["dropped"] == ["vulkan"]
    assert not (path / "libggml-vulkan.so").exists() and held["vulkan"] is None
    load = run_cli("verify", path, "--level", "load", "--json", env=e2e_env)
    assert load.returncode == 0, load.stderr
    report = json.loads(load.stdout)
    assert report["levels"]["load"] == "passed" and "Vulkan" not in report["backends_loaded"], report
    both = install("cpu,vulkan")
    vulkan = next(f for f in published["files"] if f["path"] == "libggml-vulkan.so")
    assert both["transfer"]["files_downloaded"] == 1 and both["transfer"]["cached_bytes"] == sum(
        f["size"] for f in held["files"])
    assert both["backends"] == ["cpu", "vulkan"] and Path(both["path"], "libggml-vulkan.so").stat().st_size == vulkan["size"]
    whole = run_cli("verify", both["path"], "--level", "load", "--json", env=e2e_env)
    assert whole.returncode == 0 and json.loads(whole.stdout)["modules"]["libggml-vulkan.so"] == "loaded", whole.stderr
    print(f"\npartial install of the CPU+Vulkan bundle (zip {zip_size} bytes): the CPU part downloaded "
          f"{cpu['transfer']['downloaded_bytes']} bytes ({cpu['transfer']['downloaded_bytes'] / zip_size:.3f} of the zip); "
          f"adding vulkan {both['transfer']['downloaded_bytes']} bytes")


def test_auto_asks_the_drivers_through_the_real_cpu_part(vulkan_build: dict[str, Any], e2e_env: dict[str, str],
                                                         tmp_path: Path) -> None:
    """`install --backends auto` of the real CPU+Vulkan bundle: the CPU part is fetched first, its own
    llamabundle-probe --drivers asks the Vulkan loader, which lists lavapipe only (a CPU implementation): Vulkan's
    part is left out, with the driver's own words, and only the CPU part was downloaded."""
    key, store, root = vulkan_build["result"]["key"], vulkan_build["dir"] / "store", tmp_path / "data"
    got = run_cli("install", "--store", store, "--key", key, "--dest", root, "--backends", "auto", "--json", env=e2e_env)
    assert got.returncode == 0, got.stderr
    out = json.loads(got.stdout)
    held = json.loads(Path(out["path"], "bundle.json").read_text())
    assert out["backends"] == ["cpu"] and held["cut"]["by"] == "auto" and held["cut"]["dropped"] == ["vulkan"]
    why = held["cut"]["why"]["vulkan"]
    assert why.startswith("the Vulkan loader lists only CPU implementations: llvmpipe") and why.endswith(
        "(llamabundle-probe --drivers)"), why
    assert out["transfer"]["files_downloaded"] == len(held["files"])  # the CPU part, once
