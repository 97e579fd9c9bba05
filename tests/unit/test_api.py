"""The declared Python API (llamabundle.api, docs/python-api.md): install, installed, uninstall, probe and
plan_offload against real local stores holding real bundle zips made by tests/bundles.py, fake nvidia-smi
programs and a llama-server that answers --list-devices as llama.cpp does. Hermetic: no network."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
from pathlib import Path
from typing import Any

import pytest

from llamabundle import api, gpus, keys
from llamabundle.bundle import manifest as manifest_mod
from llamabundle.store.local import BLOBS, LocalStore
from tests import bundles as tb

REPO = Path(__file__).resolve().parents[2]
_HEAD = b'#!/bin/sh\nd=$(dirname "$0")\n'
CPU_SERVER = _HEAD + b'echo "load_backend: loaded CPU backend from $d/libggml-cpu.so" >&2\necho "Available devices:"\n'
CUDA_SERVER = (_HEAD + b'echo "load_backend: loaded CUDA backend from $d/libggml-cuda.so" >&2\n'
               b'echo "load_backend: loaded CPU backend from $d/libggml-cpu.so" >&2\n'
               b'echo "Available devices:"\necho "  CUDA0: NVIDIA H200 (143155 MiB, 142629 MiB free)"\n')
H200 = "NVIDIA H200, 580.95.05, 143771, 143155"


def publish(tmp: Path, store: Path, tag: str, *, cuda: bool = False, inputs: dict[str, Any] | None = None,
            name: str | None = None) -> dict[str, Any]:
    """A bundle zip (tests/bundles.py) published into the local store `store`; its manifest dict."""
    files = {"llama-server": CUDA_SERVER if cuda else CPU_SERVER, "libggml-cpu.so": b"cpu\n", "LICENSE": b"MIT\n"}
    roles = {"llama-server": "exe", "libggml-cpu.so": "backend", "LICENSE": "license"}
    fields: dict[str, Any] = {"backends": ["cpu"]}
    toolkit = {"toolkit": "13.0.2"} if cuda else None
    if cuda:
        files["libggml-cuda.so"] = b"cuda\n"
        roles["libggml-cuda.so"] = "backend"
        fields = {"backends": ["cpu", "cuda"], "cuda": {**(toolkit or {}), "archs": {"sass": ["90"], "ptx": []},
                                                        "driver_floor": "580.65.06"}}
    zip_path, m = tb.make_zip(tmp, files, roles, name=name or f"app-{tag}", inputs=inputs or tb.inputs_for(tag, cuda=toolkit),
                              executables=("llama-server",), zip_name=f"app-{tag}.zip", **fields)
    LocalStore(store).publish(zip_path, manifest_mod.parse(m))
    return m


def smi(where: Path, *lines: str) -> Path:
    """A directory holding an executable nvidia-smi that prints `lines` (no lines: no GPU)."""
    where.mkdir(parents=True, exist_ok=True)
    exe = where / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + "".join(f"echo '{line}'\n" for line in lines) + ("" if lines else "exit 9\n"))
    exe.chmod(0o755)
    return where


@pytest.fixture(autouse=True)
def _no_kernel_driver(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The probe reads the kernel driver's version file through gpus.PROC_VERSION: none here."""
    monkeypatch.setattr(gpus, "PROC_VERSION", tmp_path / "no-nvidia-driver")


# ------------------------------------------------------------------------------------- the API itself


def test_all_names_the_api_and_every_result_is_frozen() -> None:
    assert sorted(api.__all__) == sorted(["InstallResult", "InstalledBundle", "LlamaBundleError", "OffloadPlan",
                                          "ProbeReport", "install", "installed", "plan_offload", "probe", "uninstall"])
    for name in api.__all__:
        obj = getattr(api, name)
        if dataclasses.is_dataclass(obj):
            assert obj.__dataclass_params__.frozen, name  # type: ignore[attr-defined]
        elif inspect.isfunction(obj):
            sig = inspect.signature(obj)
            assert sig.return_annotation != inspect.Signature.empty, name
            assert all(p.annotation != inspect.Parameter.empty for p in sig.parameters.values()), name
    assert (REPO / "docs" / "python-api.md").is_file()
    text = (REPO / "docs" / "python-api.md").read_text(encoding="utf-8")
    assert all(f"`{name}" in text for name in api.__all__), [n for n in api.__all__ if f"`{n}" not in text]


# ------------------------------------------------------------------------------------------- install


def test_install_by_key_lists_reuses_and_uninstalls(tmp_path: Path) -> None:
    store, root = tmp_path / "store", tmp_path / "root"
    m = publish(tmp_path, store, "cpu")
    got = api.install(store=store, key=m["key"], root=root, expect_commit=tb.COMMIT)
    assert not got.reused and got.replaced is None
    blobs = Path(store).joinpath(*BLOBS)  # a directory store: what was downloaded is its zstd blobs
    assert got.transfer == "blobs"
    assert got.downloaded_bytes == sum((blobs / (f["sha256"] + ".zst")).stat().st_size for f in m["files"])
    b = got.bundle
    assert (b.name, b.key, b.platform, b.commit, b.backends, b.toolkit) == (m["name"], m["key"], "linux-x86_64",
                                                                          tb.COMMIT, ("cpu",), None)
    assert b.path.parent == root / "bundles" / m["name"] and b.server == b.path / "llama-server"
    assert (b.path / "libggml-cpu.so").read_bytes() == b"cpu\n" and b.server.stat().st_mode & 0o111
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.key = "x"  # type: ignore[misc]
    assert api.installed(root=root) == (b,)
    again = api.install(store=str(store), key=m["key"], root=root)
    assert again.reused and (again.transfer, again.downloaded_bytes) == ("none", 0)
    assert api.uninstall(m["key"][:8], root=root) == b
    assert api.installed(root=root) == ()


def test_install_by_recipe_expects_its_commit(tmp_path: Path) -> None:
    recipe = keys.load("linux-x86_64-cpu")
    store, root = tmp_path / "store", tmp_path / "root"
    m = publish(tmp_path, store, "recipe", inputs=tb.inputs_of(recipe), name=recipe.name)
    assert m["key"] == keys.resolve(recipe).key
    got = api.install(store=f"file://{store}", recipe="linux-x86_64-cpu", root=root)
    assert got.bundle.key == keys.resolve(recipe).key and got.bundle.commit == recipe.llama_cpp.commit


def test_install_pins_the_zip_by_sha256_or_by_a_digest_list(tmp_path: Path) -> None:
    import hashlib

    store, root = tmp_path / "store", tmp_path / "root"
    m = publish(tmp_path, store, "pinned")
    zip_path = next((store / m["key"]).glob("*.zip"))
    sha = hashlib.sha256(zip_path.read_bytes()).hexdigest()
    listed = tmp_path / "SHA256SUMS"
    listed.write_text(f"# the app's list\n{'1' * 64}  another.zip\n{sha}  {zip_path.name}\n")
    got = api.install(store=store, key=m["key"], root=root, digests=listed)
    assert got.pinned_by == f"{listed}:3" and got.bundle.key == m["key"]
    again = api.install(store=store, key=m["key"], root=root, expect_sha256=sha)
    assert again.pinned_by == "--expect-sha256"
    assert api.install(store=store, key=m["key"], root=root).pinned_by is None
    listed.write_text(f"{sha}  another.zip\n")
    with pytest.raises(api.LlamaBundleError) as e:
        api.install(store=store, key=m["key"], root=root / "other", digests=listed)
    assert e.value.exit_code == 5 and "is not in the digest list" in e.value.what
    assert api.installed(root=root / "other") == ()
    with pytest.raises(api.LlamaBundleError) as e:
        api.install(store=store, key=m["key"], root=root, digests=listed, expect_sha256=sha)
    assert e.value.exit_code == 2


def test_install_refuses_with_the_error_and_its_exit_code(tmp_path: Path) -> None:
    store, root = tmp_path / "store", tmp_path / "root"
    m = publish(tmp_path, store, "cpu")
    with pytest.raises(api.LlamaBundleError) as e:
        api.install(store=store, key=m["key"], root=root, expect_commit="1" * 40)
    assert e.value.exit_code == 5 and "bundle_invalid" in e.value.what and "expected " + "1" * 40 in e.value.what
    with pytest.raises(api.LlamaBundleError) as e:
        api.install(store=store, key=m["key"], root=root, expect_toolkit="13.0.2")
    assert e.value.exit_code == 5 and "built without CUDA" in e.value.what
    with pytest.raises(api.LlamaBundleError) as e:
        api.install(store=store, key=m["key"], root=root, expect_sha256="0" * 64)
    assert e.value.exit_code == 5
    zip_path = next((store / m["key"]).glob("*.zip"))
    data = bytearray(zip_path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    zip_path.write_bytes(bytes(data))  # the stored zip changed after it was published
    with pytest.raises(api.LlamaBundleError) as e:
        api.install(store=store, key=m["key"], root=root)
    assert e.value.exit_code == 5
    with pytest.raises(api.LlamaBundleError) as e:
        api.install(store=store, key=tb.key_for("absent"), root=root)
    assert e.value.exit_code == 2
    with pytest.raises(api.LlamaBundleError) as e:
        api.install(store=store, root=root)
    assert e.value.exit_code == 2
    assert api.installed(root=root) == ()  # nothing was installed by any of them


def test_the_install_root_and_store_come_from_the_environment(tmp_path: Path) -> None:
    store = tmp_path / "store"
    m = publish(tmp_path, store, "cpu")
    env = {"LLAMABUNDLE_DATA_DIR": str(tmp_path / "data"), "LLAMABUNDLE_STORE": str(store),
           "LLAMABUNDLE_CACHE_DIR": str(tmp_path / "cache")}
    got = api.install(key=m["key"], env=env)
    assert got.bundle.path.is_relative_to(tmp_path / "data" / "bundles")
    assert [i.key for i in api.installed(env=env)] == [m["key"]]


# --------------------------------------------------------------------------------------------- probe


def test_probe_without_a_gpu_bundle(tmp_path: Path) -> None:
    store, root = tmp_path / "store", tmp_path / "root"
    api.install(store=store, key=publish(tmp_path, store, "cpu")["key"], root=root)
    none = api.probe(root=root, env={"PATH": str(smi(tmp_path / "no-gpu"))})
    assert (none.backend, none.reason) == ("cpu", "gpu_missing") and "no NVIDIA GPU was found" in none.sentence
    seen = api.probe(root=root, env={"PATH": str(smi(tmp_path / "h200", H200))})
    assert (seen.backend, seen.reason) == ("cpu", "binary_missing_nvidia_detected") and "NVIDIA H200" in seen.sentence
    assert seen.facts["gpus"][0]["name"] == "NVIDIA H200"
    assert seen.server_args == ("--device", "none")  # the installed CPU bundle is the answer's (issue 32, part 6)
    with pytest.raises(TypeError):
        seen.facts["gpus"] = ()  # type: ignore[index]  # read-only


def test_probe_checks_the_rpc_servers_the_app_names_and_a_bundle_without_rpc_can_use_none(tmp_path: Path) -> None:
    from tests.unit.test_rpc_servers import server

    store, root = tmp_path / "store", tmp_path / "root"
    api.install(store=store, key=publish(tmp_path, store, "cpu")["key"], root=root)
    with server("silent") as ep:
        got = api.probe(root=root, env={"PATH": str(smi(tmp_path / "no-gpu"))}, rpc=[ep])
    assert [(s["endpoint"], s["reason"]) for s in got.facts["rpc_servers"]] == [(ep, "rpc_backend_missing")]
    assert got.server_args == ("--device", "none") and got.reason == "gpu_missing"


def test_probe_a_cuda_bundle_gives_the_flags_and_the_plan_can_keep_it_on_the_cpu(tmp_path: Path) -> None:
    store, root = tmp_path / "store", tmp_path / "root"
    m = publish(tmp_path, store, "cuda", cuda=True)
    installed = api.install(store=store, key=m["key"], root=root, expect_toolkit="13.0.2").bundle
    assert installed.toolkit == "13.0.2" and installed.driver_floor == "580.65.06"
    env = {"PATH": str(smi(tmp_path / "h200", H200))}
    ok = api.probe(root=root, env=env)
    assert (ok.backend, ok.reason, ok.server_args, dict(ok.server_env)) == ("cuda", "ok", ("--device", "CUDA0"), {})
    assert ok.facts["bundle_key"] == m["key"] and not ok.cached
    assert api.probe(root=root, env=env, max_age=3600).cached  # cached where the CLI caches it
    zero = api.probe(bundle=installed.path, env=env, ngl=0)
    assert (zero.backend, zero.reason) == ("cpu", "cuda_gpu_layers_zero")
    cpu = api.probe(root=root, env=env, prefer="cpu")
    assert (cpu.reason, cpu.server_args) == ("cpu_preferred", ("--device", "none"))
    old = api.probe(root=root, env={"PATH": str(smi(tmp_path / "old", "NVIDIA H200, 570.86.10, 143771, 143155"))})
    assert (old.backend, old.reason) == ("cpu", "driver_too_old") and "580.65.06" in old.fix
    with pytest.raises(api.LlamaBundleError):
        api.probe(root=root, env=env, prefer="tpu")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------- offload


def _synthetic(path: Path, **kw: Any) -> Path:
    spec = importlib.util.spec_from_file_location("offload_compare", REPO / "bench" / "offload_compare.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out: Path = mod.write_synthetic(path, **{"n_layer": 4, "n_embd": 64, "n_head": 4, "n_head_kv": 2, "n_ff": 128,
                                             "n_vocab": 300, "n_ctx_train": 4096, **kw})
    return out


def test_plan_offload_wraps_the_planner(tmp_path: Path) -> None:
    model = _synthetic(tmp_path / "dense.gguf")
    everything = api.plan_offload(model, free_vram="8GiB", ctx=2048)
    assert (everything.ngl, everything.blocks_on_gpu, everything.output_on_gpu, everything.moe) == (5, 4, True, False)
    assert everything.flags[:4] == ("-ngl", "5", "-c", "2048") and everything.reasons[0].startswith("everything fits")
    assert everything.gpu_bytes["total"] == sum(everything.gpu_bytes[k] for k in ("weights", "kv", "compute", "headroom"))
    same = api.plan_offload(str(model), free_vram=8 << 30, ctx=2048)
    assert same == everything
    with pytest.raises(api.LlamaBundleError) as e:
        api.plan_offload(model, free_vram="1MiB", headroom="0%")
    assert e.value.exit_code == 2 and "cannot run" in e.value.what
