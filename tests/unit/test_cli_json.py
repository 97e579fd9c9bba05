"""One output contract (README, DESIGN §8): every command's --json output validates against the schema committed
as llamabundle/data/schemas/cli-<command>.schema.json, a failure under --json is one error object on stdout, names are spelled alike
across commands and the GitHub Actions outputs, timestamps are ISO 8601 UTC, exit codes are the README's, and
messages name the user's paths (never a temporary one, never Python's None).

Each command runs in this process through llamabundle.cli.main, on real bundles in real local stores (as
test_cli.py does). `build` is run on a store that has the key (a cache hit: fetched and verified, nothing
compiled); the output of a build that compiles is validated in tests/e2e/test_pipeline.py, on the real build."""

from __future__ import annotations

import json
import os
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any

import click
import jsonschema
import pytest

from llamabundle import bundle, keys
from llamabundle.cli import cli
from llamabundle.cli.output import wants_json
from llamabundle.errors import UsageError
from llamabundle.runtime.results import parse_utc_timestamp, utc_timestamp
from llamabundle.settings import Settings
from tests.clibundles import LINUX, LINUX_KEY, WINDOWS, make_bundle_dir, make_bundle_zip
from tests.clicontract import SCHEMAS, schema, valid
from tests.clirun import run
from tests.probing import OLD, fake_smi
from tests.probing import publish as publish_cuda
from tests.redist import Repo

ISO = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$")


def json_of(capsys: pytest.CaptureFixture[str], name: str, *argv: object, code: int = 0) -> dict[str, Any]:
    """Run a command with --json: exactly one JSON object on stdout, valid against its schema (the error
    schema too when it failed)."""
    got, out, err = run(capsys, *argv, "--json")
    assert got == code, err
    obj = json.loads(out)  # one object: json.loads refuses anything after it
    assert obj["schema"] == 1 and obj["ok"] is (code in (0, 1)), obj
    if code not in (0, 1):
        valid("error", obj)
        assert obj["error"]["exit_code"] == code
        assert err.strip(), "the human message still goes to stderr"
    return valid(name, obj)


def json_commands() -> list[str]:
    """Every command with a --json option, as `toolkit plan` (its schema: cli-toolkit-plan.schema.json)."""
    out: list[str] = []

    def walk(group: click.Group, prefix: list[str]) -> None:
        ctx = click.Context(group)
        for name in group.list_commands(ctx):  # the top group imports a command's module when asked (cli.entry)
            cmd = group.get_command(ctx, name)
            assert cmd is not None
            if isinstance(cmd, click.Group):
                walk(cmd, [*prefix, name])
            elif any("--json" in p.opts for p in cmd.params if isinstance(p, click.Option)):
                out.append(" ".join([*prefix, name]))

    walk(cli, [])
    return sorted(out)


# --------------------------------------------------------------------------------- the schemas themselves


NOT_OUTPUTS = ("bundle", "recipe", "index-site", "llamabundle-probe")  # bundle.json, a recipe, index.json, the program's
SHIPPED = sorted(p.name.removesuffix(".schema.json") for p in SCHEMAS.iterdir() if p.name.endswith(".schema.json"))


def test_every_reporting_command_has_json_and_a_schema() -> None:
    commands = json_commands()
    assert {"key", "show", "check", "build", "fetch", "verify", "publish", "deps", "archs", "install", "list",
            "uninstall", "probe", "doctor", "plan", "toolkit plan", "toolkit install", "recipe lint",
            "telemetry"} <= set(commands)
    for cmd in commands:
        schema(cmd.replace(" ", "-"))  # exists and is JSON
    files = {p.name for p in SCHEMAS.iterdir() if p.name.endswith(".schema.json")}
    assert files == ({f"cli-{c.replace(' ', '-')}.schema.json" for c in commands} | {"cli-error.schema.json"}
                     | {f"{name}.schema.json" for name in NOT_OUTPUTS})


@pytest.mark.parametrize("name", SHIPPED)
def test_each_shipped_schema_is_draft_2020_12_with_its_own_id(name: str) -> None:
    """One directory of schemas (data/schemas/, in the repository and the wheel), each file NAME.schema.json with
    the $id urn:llamabundle:schema:NAME; the outputs' schemas are the cli-* ones."""
    s = json.loads((SCHEMAS / f"{name}.schema.json").read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(s)
    assert s["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert s["$id"] == f"urn:llamabundle:schema:{name}"
    assert name in NOT_OUTPUTS or name.startswith("cli-")
    if name.startswith("cli-"):
        assert s["properties"]["schema"] == {"const": 1} and "ok" in s["required"]
    # ajv's strict mode (tests/e2e/test_schemas_node.py) refuses a union of types but [T, "null"]: anyOf instead
    unions = [t for t in _types(s) if isinstance(t, list) and not (len(t) == 2 and t[1] == "null")]
    assert not unions, f"{name}: a union type {unions[0]} (write anyOf)"


def _types(node: Any) -> list[Any]:
    """Every `type` keyword's value in a schema."""
    if isinstance(node, dict):
        return ([node["type"]] if "type" in node else []) + [t for v in node.values() for t in _types(v)]
    return [t for v in node for t in _types(v)] if isinstance(node, list) else []


def test_schemas_are_package_data() -> None:
    text = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert '"data/schemas/*.json"' in text


# --------------------------------------------------------------------------------- recipes


def test_recipe_list(capsys: pytest.CaptureFixture[str]) -> None:
    rows = json_of(capsys, "recipe-list", "recipe", "list")["recipes"]
    names = [r["name"] for r in rows]
    assert "linux-x86_64-cpu" in names and "windows-x86_64-cuda12.8" in names
    cuda = next(r for r in rows if r["name"] == "windows-x86_64-cuda12.8")
    assert cuda["cuda"] == "12.8.1" and cuda["backends"] == ["cpu", "cuda", "rpc"] and cuda["compiler"] == "msvc"
    code, out, _ = run(capsys, "recipe", "list")
    assert code == 0 and any(line.startswith("linux-x86_64-cpu ") for line in out.splitlines())
    code, out, _ = run(capsys, "key", "linux-x86_64-cpu")  # a shipped recipe by name
    assert code == 0 and out.strip() == keys.resolve(keys.load(LINUX)).key


def test_key_and_show(capsys: pytest.CaptureFixture[str]) -> None:
    assert json_of(capsys, "key", "key", WINDOWS)["key"] == keys.resolve(keys.load(WINDOWS)).key
    data = json_of(capsys, "show", "show", WINDOWS)
    assert data["platform"] == "windows-x86_64" and data["driver_floor"]


def test_recipe_lint_json_ok_and_failing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = json_of(capsys, "recipe-lint", "recipe", "lint", LINUX, WINDOWS)
    assert [r["ok"] for r in data["recipes"]] == [True, True] and "error" not in data
    assert data["recipes"][0]["key"] == LINUX_KEY
    bad = tmp_path / "bad.yaml"
    bad.write_text(LINUX.read_text().replace("backends: [cpu]", "backend: [cpu]"))
    data = json_of(capsys, "recipe-lint", "recipe", "lint", LINUX, bad, tmp_path / "none.yaml", code=2)
    assert [r["ok"] for r in data["recipes"]] == [True, False, False]
    assert data["error"] == data["recipes"][1]["error"]
    assert "unknown key 'backend'" in data["error"]["what"] and data["error"]["exit_code"] == 2
    assert "no such recipe file" in data["recipes"][2]["error"]["what"]


def test_archs(capsys: pytest.CaptureFixture[str]) -> None:
    data = json_of(capsys, "archs", "archs", WINDOWS)
    assert data["toolkit"] == "12.8.1" and data["rows"]
    assert json_of(capsys, "archs", "archs", LINUX)["toolkit"] is None


# --------------------------------------------------------------------------------- store commands


def test_check_publish_fetch_verify_and_a_build_that_hits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    miss = json_of(capsys, "check", "check", LINUX, "--store", store, code=1)
    assert (miss["hit"], miss["location"]) == (False, None)
    zip_path = make_bundle_zip(tmp_path)
    pub = json_of(capsys, "publish", "publish", zip_path, "--store", store)
    stored = str(store.resolve() / LINUX_KEY / zip_path.name)
    assert (pub["created"], pub["location"], pub["key"], pub["verify"]["path"]) == (True, stored, LINUX_KEY, str(zip_path))
    assert json_of(capsys, "publish", "publish", zip_path, "--store", store)["created"] is False
    hit = json_of(capsys, "check", "check", LINUX, "--store", store)
    assert (hit["hit"], hit["location"], hit["store"]) == (True, stored, str(store.resolve()))

    out = tmp_path / "fetched"
    fetched = json_of(capsys, "fetch", "fetch", LINUX_KEY, "--store", store, "--out", out, "--level", "load")
    assert (fetched["location"], fetched["out"], fetched["store"]) == (stored, str(out), hit["store"])
    assert fetched["verify"]["backends_loaded"] == {"CPU": str(out / "libggml-cpu.so")}  # --out, not the temp dir

    built = json_of(capsys, "build", "build", LINUX, "--store", store)  # a hit: fetched and verified, not compiled
    assert (built["hit"], built["location"], built["compiled"], built["store"]) == (True, stored, 0, hit["store"])
    assert "cache_hit" not in built and "published" not in built  # one spelling: check's hit and location
    assert built["verify"]["levels"]["load"] == "passed"
    assert built["verify"]["backends_loaded"]["CPU"] == f"{stored}:libggml-cpu.so"

    report = json_of(capsys, "verify", "verify", zip_path, "--level", "load")
    assert report["backends_loaded"] == {"CPU": f"{zip_path}:libggml-cpu.so"}  # the user's zip, not the temp copy
    assert report["path"] == str(zip_path) and report["levels"]["load"] == "passed"


def test_a_hit_into_out_from_a_store_on_this_disk_takes_the_blobs_and_copies_the_zip(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """pipeline._hit: --out is assembled from the store's blobs while the zip is copied into the cache beside it;
    the result is what a hit through the zip gives: the bundle in --out, verified at the load level, and the zip,
    the stored one byte for byte."""
    store = tmp_path / "store"
    zip_path = make_bundle_zip(tmp_path)
    json_of(capsys, "publish", "publish", zip_path, "--store", store)
    out = tmp_path / "out"
    built = json_of(capsys, "build", "build", LINUX, "--store", store, "--out", out)
    assert (built["hit"], built["compiled"], built["out"]) == (True, 0, str(out))
    assert built["verify"]["levels"]["load"] == "passed"
    assert built["verify"]["backends_loaded"] == {"CPU": str(out / "libggml-cpu.so")}  # --out, not the temp dir
    assert Path(built["zip"]).read_bytes() == zip_path.read_bytes() and Path(built["zip"]).parent != store
    with zipfile.ZipFile(zip_path) as z:
        assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == \
            sorted(i.filename for i in z.infolist() if not i.is_dir())
        assert all((out / i.filename).read_bytes() == z.read(i) for i in z.infolist() if not i.is_dir())


def test_a_hit_whose_zip_copy_fails_leaves_out_empty(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The blobs are whole, the zip's copy beside them fails (damaged after the lookup read it): the hit fails with
    the copy's error, --out is never filled, and nothing is left beside it."""
    from llamabundle import pipeline
    from llamabundle.bundle.manifest import Expect
    from llamabundle.errors import VerifyError
    from llamabundle.log import Log
    from llamabundle.store.local import LocalStore

    store = tmp_path / "store"
    json_of(capsys, "publish", "publish", make_bundle_zip(tmp_path), "--store", store)
    local = LocalStore(store)
    entry = local.lookup(LINUX_KEY)
    assert entry is not None

    def broken(*_: object, **__: object) -> Path:
        raise VerifyError("the stored zip does not match its sha256 in the store")

    monkeypatch.setattr(local, "fetch", broken)
    out = tmp_path / "out"
    with pytest.raises(VerifyError, match="does not match its sha256"):
        pipeline._hit(entry, store=local, settings=Settings.from_env({"LLAMABUNDLE_CACHE_DIR": str(tmp_path / "cache")}),
                      log=Log(quiet=True), out=out, expect=Expect(key=LINUX_KEY))
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_github_actions_outputs_use_the_json_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    zip_path = make_bundle_zip(tmp_path)
    assert run(capsys, "publish", zip_path, "--store", store)[0] == 0
    gh_out = tmp_path / "out.txt"
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_OUTPUT", str(gh_out))
    for cmd in ("check", "build"):
        gh_out.write_text("")
        data = json_of(capsys, cmd, cmd, LINUX, "--store", store)
        outputs = dict(line.split("=", 1) for line in gh_out.read_text().splitlines())
        # and zip (issue 32): build's zip as its --json says it (forward slashes); check's hit: the stored zip's name
        zip_out = Path(data["zip"]).as_posix() if cmd == "build" else Path(data["location"]).name
        assert outputs == {"key": data["key"], "hit": "true", "location": data["location"], "zip": zip_out}, cmd
        assert Path(outputs["zip"]).name == zip_path.name
    gh_out.write_text("")
    json_of(capsys, "check", "check", LINUX, "--store", tmp_path / "empty", code=1)
    assert gh_out.read_text() == f"key={LINUX_KEY}\nhit=false\nlocation=\nzip=\n"  # a miss: no zip


# --------------------------------------------------------------------------------- deps


def test_deps_json_of_an_elf_binary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "bin"
    d.mkdir()
    shutil.copy(shutil.which("true") or "/bin/true", d / "true")
    data = json_of(capsys, "deps", "deps", d / "true")
    assert data["format"] == "elf" and data["missing"] == {} and data["binaries"][0]["path"] == str(d / "true")


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is needed to build an ELF file with a missing library")
def test_deps_with_a_missing_library_exits_5_with_its_data_and_the_error(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    import subprocess

    (tmp_path / "ghost.c").write_text("int ghost(void) { return 2; }\n")
    (tmp_path / "main.c").write_text("int ghost(void);\nint main(void) { return ghost(); }\n")
    d = tmp_path / "b"
    d.mkdir()
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libghost.so", "-o", "libghost.so", "ghost.c"], cwd=tmp_path, check=True)
    subprocess.run(["gcc", "-Wl,--no-as-needed", "-o", d / "main", "main.c", f"-L{tmp_path}", "-lghost"], cwd=tmp_path, check=True)
    data = json_of(capsys, "deps", "deps", d / "main", code=5)
    assert data["missing"] == {"libghost.so": ["main"]} and "libghost.so (needed by main)" in data["error"]["what"]
    code, out, err = run(capsys, "deps", d / "main")
    assert code == 5 and "missing: libghost.so (needed by main)" in out and "error: 1 of the libraries" in err


# --------------------------------------------------------------------------------- the app side


def test_install_list_uninstall_probe_doctor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = publish_cuda(tmp_path / "store", tmp_path)
    data_dir = tmp_path / "data"
    smi = fake_smi(tmp_path / "bin", OLD)
    inst = json_of(capsys, "install", "install", "--store", tmp_path / "store", "--key", m.key, "--dest", data_dir)
    assert inst["key"] == m.key and ISO.match(inst["installed_at"]) and inst["reused"] is False
    again = json_of(capsys, "install", "install", "--store", tmp_path / "store", "--key", m.key, "--dest", data_dir)
    assert again["reused"] is True and again["installed_at"] == inst["installed_at"]
    listed = json_of(capsys, "list", "list", "--dest", data_dir)
    assert [b["key"] for b in listed["bundles"]] == [m.key] and listed["bundles"][0]["installed_at"] == inst["installed_at"]

    probe = json_of(capsys, "probe", "probe", "--dest", data_dir, "--nvidia-smi", smi, "--max-age", "0")
    assert probe["reason"] == "driver_too_old" and ISO.match(probe["probed_at"])
    cached = json.loads((Path(os.environ["LLAMABUNDLE_CACHE_DIR"]) / "runtime" / "probe.json").read_text())
    assert cached["probed_at"] == probe["probed_at"]  # the file an app reads: the same spelling
    doctor = json_of(capsys, "doctor", "doctor", "--dest", data_dir, "--nvidia-smi", smi)
    assert doctor["last_probe"]["probed_at"] == probe["probed_at"] and doctor["bundles"][0]["driver_ok"] is False
    code, out, _ = run(capsys, "doctor", "--dest", data_dir, "--nvidia-smi", smi)
    # its last probe is the one the doctor before it made (and cached)
    assert code == 0 and f"at {doctor['probe']['probed_at']}" in out and "None" not in out

    gone = json_of(capsys, "uninstall", "uninstall", m.key, "--dest", data_dir)
    assert gone["removed"]["key"] == m.key
    assert json_of(capsys, "list", "list", "--dest", data_dir)["bundles"] == []


def test_telemetry(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import subprocess

    m = publish_cuda(tmp_path / "store", tmp_path)
    data_dir = tmp_path / "data"
    json_of(capsys, "install", "install", "--store", tmp_path / "store", "--key", m.key, "--dest", data_dir)
    smi = fake_smi(tmp_path / "bin", "0, NVIDIA H200, 580.95.05, 37, 1234, 143771")
    idle = json_of(capsys, "telemetry", "telemetry", "--dest", data_dir, "--nvidia-smi", smi)
    assert (idle["active"], idle["reason"], idle["sampled_at"]) == (False, "server_not_running", None)
    server = Path(json_of(capsys, "list", "list", "--dest", data_dir)["bundles"][0]["path"]) / "llama-server"
    server.unlink()
    shutil.copy(shutil.which("sleep") or "/bin/sleep", server)  # a real process running from the bundle
    p = subprocess.Popen([server, "60"], stdin=subprocess.DEVNULL)
    try:
        data = json_of(capsys, "telemetry", "telemetry", "--dest", data_dir, "--nvidia-smi", smi, "--pid", p.pid)
    finally:
        p.kill()
        p.wait()
    assert data["active"] is True and data["gpus"][0]["memory_used_mib"] == 1234 and ISO.match(data["sampled_at"])


def test_install_if_needed_is_a_probe_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))  # no nvidia-smi: gpu_missing, nothing installed
    m = publish_cuda(tmp_path / "store", tmp_path)
    data = json_of(capsys, "install", "install", "--store", tmp_path / "store", "--key", m.key, "--dest",
                   tmp_path / "data", "--if-needed")
    assert data["reason"] == "gpu_missing" and not (tmp_path / "data" / "bundles").exists()


def test_install_if_needed_takes_the_pin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from tests.probing import H200

    fake_smi(tmp_path / "bin", H200)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")  # an NVIDIA GPU, no bundle: it would install
    monkeypatch.setenv("LLAMABUNDLE_CACHE_DIR", str(tmp_path / "cache"))
    m = publish_cuda(tmp_path / "store", tmp_path)
    data = json_of(capsys, "install", "install", "--store", tmp_path / "store", "--key", m.key, "--dest",
                   tmp_path / "data", "--if-needed", "--expect-sha256", "0" * 64)
    assert (data["backend"], data["reason"]) == ("cpu", "bundle_invalid") and "sha256" in data["facts"]["detail"]


def test_install_if_needed_takes_the_backends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from tests.probing import H200

    fake_smi(tmp_path / "bin", H200)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")  # an NVIDIA GPU, no bundle: it installs
    monkeypatch.setenv("LLAMABUNDLE_CACHE_DIR", str(tmp_path / "cache"))
    m = publish_cuda(tmp_path / "store", tmp_path, backends=("cpu", "cuda", "vulkan"), parts=True)
    json_of(capsys, "install", "install", "--store", tmp_path / "store", "--key", m.key, "--dest", tmp_path / "data",
            "--if-needed", "--backends", "cuda")
    (held,) = json_of(capsys, "list", "list", "--dest", tmp_path / "data")["bundles"]
    assert held["key"] == m.key and held["backends"] == ["cpu", "cuda"]  # Vulkan's part was not installed


def test_install_of_a_cpu_bundle_expecting_cuda_never_says_none(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = publish_cuda(tmp_path / "store", tmp_path, backends=("cpu",))
    data = json_of(capsys, "error", "install", "--store", tmp_path / "store", "--key", m.key, "--dest",
                   tmp_path / "data", "--expect-toolkit", "13.0.2", code=5)
    assert "it was built without CUDA, expected CUDA 13.0.2" in data["error"]["what"]
    assert "None" not in json.dumps(data["error"])


def test_timestamps_are_iso_8601_utc() -> None:
    assert utc_timestamp(1700000000) == "2023-11-14T22:13:20Z"
    assert parse_utc_timestamp("2023-11-14T22:13:20Z") == 1700000000
    assert parse_utc_timestamp(1700000000.5) == 1700000000  # a probe.json written by an older version
    assert ISO.match(utc_timestamp())


# --------------------------------------------------------------------------------- plan, toolkit


def test_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.ggufs import write

    model = write(tmp_path / "m.gguf")
    data = json_of(capsys, "plan", "plan", model, "--free-vram", "24GiB")
    assert data["model"]["n_layer"] == 4


def test_toolkit_plan_of_each_source(capsys: pytest.CaptureFixture[str]) -> None:
    redist = json_of(capsys, "toolkit-plan", "toolkit", "plan", "--version", "13.0.2", "--components",
                     "cuda_nvcc,cuda_cudart", "--platform", "linux-x86_64")
    assert redist["source"] == "redist" and redist["components"]
    pypi = json_of(capsys, "toolkit-plan", "toolkit", "plan", "--source", "pypi", "--version", "13.0.2", "--components",
                   "cuda_nvcc,cuda_cudart")
    assert pypi["source"] == "pypi" and pypi["wheels"]
    installer = json_of(capsys, "toolkit-plan", "toolkit", "plan", WINDOWS, "--source", "installer")
    assert installer["source"] == "installer" and installer["installer"]["file"].endswith(".exe")


def test_toolkit_install(cli_repo: Repo, recipe13: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = json_of(capsys, "toolkit-install", "toolkit", "install", recipe13, "--manifest", cli_repo.manifest_path)
    assert data["reused"] is False and data["toolkit"] == "13.0.2"


# --------------------------------------------------------------------------------- failures under --json


def test_a_usage_error_under_json_is_one_error_object(capsys: pytest.CaptureFixture[str]) -> None:
    data = json_of(capsys, "error", "key", LINUX, "--frob", code=2)
    assert "No such option" in data["error"]["what"] and "llamabundle key --help" in data["error"]["fix"]
    data = json_of(capsys, "error", "check", code=2)  # a missing argument
    assert "Missing argument 'RECIPE'" in data["error"]["what"]
    data = json_of(capsys, "error", "recipe", "schema", code=2)  # a command without --json: still asked for JSON
    assert "No such option" in data["error"]["what"] and "--json" in data["error"]["what"]


def test_errors_under_json_keep_their_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = json_of(capsys, "error", "verify", tmp_path / "nothing.zip", code=2)
    assert data["error"]["what"] == f"{tmp_path / 'nothing.zip'} does not exist"
    stage, _ = make_bundle_dir(tmp_path)
    (stage / "LICENSE").write_bytes(b"MIT Licensf\n")
    data = json_of(capsys, "error", "verify", stage, code=5)
    assert data["error"]["what"] == f"{stage / 'LICENSE'} does not match its sha256 in bundle.json"  # the directory given
    data = json_of(capsys, "error", "fetch", "ef" * 32, "--store", tmp_path / "store", "--out", tmp_path / "o", code=2)
    assert "no bundle with key efefefefefef" in data["error"]["what"]
    data = json_of(capsys, "error", "build", WINDOWS, "--store", tmp_path / "store", code=2)
    assert "cannot be built on" in data["error"]["what"]
    data = json_of(capsys, "error", "show", tmp_path / "none.yaml", code=2)
    assert "no such recipe file" in data["error"]["what"]


def test_without_json_a_failure_prints_nothing_on_stdout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "verify", tmp_path / "nothing.zip")
    assert (code, out) == (2, "") and "does not exist" in err


def test_json_is_read_from_the_options_only() -> None:
    assert wants_json(["check", "r.yaml", "--json"]) and wants_json(["--json"])
    assert not wants_json(["check", "r.yaml"]) and not wants_json(["key", "--", "--json"])


# --------------------------------------------------------------------------------- exit codes (README)


@pytest.mark.parametrize("var, value", [("LLAMABUNDLE_CONNECT_TIMEOUT", "abc"), ("LLAMABUNDLE_CONNECT_TIMEOUT", "-1"),
                                        ("LLAMABUNDLE_CONNECT_TIMEOUT", "nan"), ("SOURCE_DATE_EPOCH", "yesterday")])
def test_a_bad_environment_value_is_a_usage_error_naming_it(var: str, value: str, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(var, value)
    code, out, err = run(capsys, "key", LINUX)
    assert (code, out) == (2, "") and f"error: {var}={value!r} is not " in err
    assert "internal error" not in err and "Traceback" not in err
    data = json_of(capsys, "error", "key", LINUX, code=2)
    assert data["error"]["what"].startswith(f"{var}={value!r}")
    with pytest.raises(UsageError, match=var):
        Settings.from_env({var: value})


def test_good_and_empty_environment_values() -> None:
    s = Settings.from_env({"LLAMABUNDLE_CONNECT_TIMEOUT": " 2.5 ", "SOURCE_DATE_EPOCH": "1700000000"})
    assert (s.connect_timeout, s.source_date_epoch) == (2.5, 1700000000)
    s = Settings.from_env({"LLAMABUNDLE_CONNECT_TIMEOUT": "", "SOURCE_DATE_EPOCH": ""})
    assert (s.connect_timeout, s.source_date_epoch) == (10.0, None)


def test_verify_of_unreadable_input_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "verify", "/proc/self/mem")  # exists, but every read fails (EIO)
    assert code == 2 and "cannot read /proc/self/mem" in err


# --------------------------------------------------------------------------------- the user's paths


def test_verify_of_a_zip_names_the_zip_not_the_temp_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bundle.zip"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("llama-server", "x")
    code, _, err = run(capsys, "verify", bad)
    assert code == 5 and f"error: {bad} has no bundle.json" in err
    assert "llamabundle-verify-" not in err and ".partial-" not in err

    stage, _ = make_bundle_dir(tmp_path / "b", key=LINUX_KEY)  # a llama-server that fails, naming itself
    (stage / "llama-server").write_bytes(b'#!/bin/sh\necho "$0: error while loading shared libraries: libx.so" >&2\nexit 127\n')
    manifest = json.loads((stage / "bundle.json").read_text())
    manifest["files"] = bundle.file_entries(stage, {"llama-server": "exe", "LICENSE": "license"})
    (stage / "bundle.json").write_text(json.dumps(manifest))
    zip_path = bundle.pack(stage, tmp_path / "broken.zip")
    data = json_of(capsys, "error", "verify", zip_path, "--level", "load", code=5)
    assert f"{zip_path}:llama-server: error while loading shared libraries" in data["error"]["details"]
    assert "llamabundle-verify-" not in json.dumps(data)
    code, _, err = run(capsys, "verify", stage, "--level", "load")  # a directory: its copy is named as the directory
    assert code == 5 and f"{stage / 'llama-server'}: error while loading" in err and "llamabundle-verify-" not in err


@pytest.mark.parametrize("name", ["doctor", "install"])
def test_the_probe_result_inside_other_schemas_is_the_probe_schema(name: str) -> None:
    """doctor and install embed a probe result ($defs/probe): the same definition as probe's own schema (its
    reason codes, backends and facts), so a new reason code cannot pass one schema and fail another."""
    own = {k: v for k, v in schema("probe").items() if k not in ("$schema", "$id", "title")}
    embedded = schema(name)["$defs"]["probe"]
    if "ok" not in embedded["properties"]:  # doctor's last probe is a record, not a command's answer
        own = {**own, "properties": {k: v for k, v in own["properties"].items() if k != "ok"},
               "required": [r for r in own["required"] if r != "ok"]}
    assert embedded == own


def test_probe_schema_names_every_reason_code() -> None:
    from llamabundle.reasons import reasons
    assert set(schema("probe")["properties"]["reason"]["enum"]) == set(reasons())
