"""The schemas as an app in another language uses them: tests/consumer/validate.mjs (Node.js, ajv 8 in strict
mode, draft 2020-12, no allowUnionTypes, pinned by tests/consumer/package-lock.json) compiles every schema in
llamabundle/data/schemas/, finds each by its $id, and validates real outputs against them: the --json output of
the commands that run without a build (in this process, on the small bundles of tests/clibundles.py and
tests/probing.py, in real local stores), the bundle.json files they wrote, the shipped recipes, index.json, what
llamabundle-probe printed on the H200 (tests/data/h200); and, with the session's real build, `build --json`, its
bundle.json and its own llamabundle-probe's answer.

ajv is installed here with `npm ci --prefix tests/consumer` where tests/consumer/node_modules lacks it (the npm
registry is needed then); a failed install fails the tests. Skipped only where node or npm is absent
(Debian: apt-get install nodejs npm; .ci/run installs them)."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from filelock import FileLock

from tests.clibundles import LINUX, LINUX_KEY, WINDOWS, make_bundle_dir, make_bundle_zip
from tests.clirun import run

REPO = Path(__file__).resolve().parents[2]
CONSUMER = REPO / "tests" / "consumer"
VALIDATE = CONSUMER / "validate.mjs"
SCHEMAS = REPO / "llamabundle" / "data" / "schemas"
H200 = REPO / "tests" / "data" / "h200"
NODE = shutil.which("node") or shutil.which("nodejs")
NPM = shutil.which("npm")
pytestmark = pytest.mark.skipif(NODE is None or NPM is None,
                                reason="node and npm are not installed (Debian: apt-get install nodejs npm)")


def locked_ajv() -> str:
    return str(json.loads((CONSUMER / "package-lock.json").read_text(encoding="utf-8"))["packages"]["node_modules/ajv"]["version"])


def installed_ajv() -> str | None:
    got = CONSUMER / "node_modules" / "ajv" / "package.json"
    return json.loads(got.read_text(encoding="utf-8"))["version"] if got.is_file() else None


@pytest.fixture(scope="module")
def ajv() -> str:
    """tests/consumer/node_modules as package-lock.json pins it (`npm ci` where it is missing or another version),
    under a lock: this module's tests may run on two workers (the real build's test is in the build's group)."""
    lock = Path(tempfile.gettempdir()) / f"llamabundle-npm-{hashlib.sha256(str(CONSUMER).encode()).hexdigest()[:12]}.lock"
    with FileLock(str(lock)):
        if installed_ajv() != locked_ajv():
            assert NPM is not None
            res = subprocess.run([NPM, "ci", "--prefix", str(CONSUMER), "--no-audit", "--no-fund"], capture_output=True,
                                 text=True, timeout=600, stdin=subprocess.DEVNULL)
            if res.returncode != 0:
                pytest.fail(f"npm ci --prefix tests/consumer failed ({res.returncode}):\n{res.stderr[-4000:]}")
        assert installed_ajv() == locked_ajv()
    return locked_ajv()


def validate(*pairs: tuple[str, Path]) -> subprocess.CompletedProcess[str]:
    assert NODE is not None
    argv = [NODE, str(VALIDATE), str(SCHEMAS), *(str(x) for pair in pairs for x in pair)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def passes(*pairs: tuple[str, Path]) -> dict[str, Any]:
    res = validate(*pairs)
    assert res.returncode == 0, res.stderr
    got: dict[str, Any] = json.loads(res.stdout)
    assert got["ok"] is True and got["validated"] == len(pairs)
    return got


class Outputs:
    """Real outputs written to files, each with the name of the schema it must satisfy."""

    def __init__(self, where: Path, capsys: pytest.CaptureFixture[str]) -> None:
        self.where, self.capsys = where, capsys
        self.pairs: list[tuple[str, Path]] = []
        where.mkdir(parents=True, exist_ok=True)

    def file(self, name: str, path: Path) -> Path:
        self.pairs.append((name, path))
        return path

    def value(self, name: str, obj: Any) -> Path:
        path = self.where / f"{len(self.pairs):03d}-{name}.json"
        path.write_text(json.dumps(obj), encoding="utf-8")
        return self.file(name, path)

    def cli(self, name: str, *argv: object, code: int = 0) -> dict[str, Any]:
        """`llamabundle ARGV --json`: its one object, against cli-NAME (and cli-error too when it failed)."""
        got, out, err = run(self.capsys, *argv, "--json")
        assert got == code, err
        obj: dict[str, Any] = json.loads(out)
        path = self.value(f"cli-{name}", obj)
        if code not in (0, 1):
            self.file("cli-error", path)
        return obj


@pytest.fixture
def hermetic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMABUNDLE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("LLAMABUNDLE_DATA_DIR", str(tmp_path / "data-dir"))
    for name in ("LLAMABUNDLE_STORE", "GITHUB_ACTIONS", "GITHUB_OUTPUT", "GITHUB_STEP_SUMMARY"):
        monkeypatch.delenv(name, raising=False)


def test_every_shipped_schema_compiles_under_ajv_strict_with_its_id(ajv: str) -> None:
    got = passes()
    assert got["schemas"] == sorted(p.name.removesuffix(".schema.json") for p in SCHEMAS.glob("*.schema.json"))
    assert {"bundle", "recipe", "index-site", "llamabundle-probe", "cli-error", "cli-bundle", "cli-probe"} <= set(got["schemas"])


def test_validate_names_the_file_the_schema_and_the_failing_path(ajv: str, tmp_path: Path) -> None:
    bad = tmp_path / "key.json"
    bad.write_text(json.dumps({"schema": 1, "ok": True, "key": "nope", "inputs": {}}), encoding="utf-8")
    res = validate(("cli-key", bad))
    assert res.returncode == 1 and json.loads(res.stdout)["ok"] is False
    assert f"validate.mjs: {bad} is not valid against cli-key: /key must match pattern" in res.stderr
    # a schema that strict mode refuses (a union type, as probe's `ptx` had), or whose $id is not its name
    schemas = tmp_path / "schemas"
    shutil.copytree(SCHEMAS, schemas)
    union = json.loads((schemas / "cli-key.schema.json").read_text(encoding="utf-8"))
    union["properties"]["key"] = {"type": ["string", "array"]}
    (schemas / "cli-key.schema.json").write_text(json.dumps(union), encoding="utf-8")
    renamed = json.loads((schemas / "cli-show.schema.json").read_text(encoding="utf-8"))
    (schemas / "cli-show.schema.json").write_text(json.dumps({**renamed, "$id": "urn:llamabundle:schema:show"}))
    assert NODE is not None
    res = subprocess.run([NODE, str(VALIDATE), str(schemas)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1
    assert "cli-key.schema.json does not compile under ajv strict mode: strict mode: use allowUnionTypes" in res.stderr
    assert 'cli-show.schema.json has the $id "urn:llamabundle:schema:show"' in res.stderr


def test_real_outputs_validate_under_ajv_strict(ajv: str, hermetic: None, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from tests.ggufs import write as write_gguf
    from tests.probing import OLD, fake_smi
    from tests.probing import publish as publish_cuda

    o = Outputs(tmp_path / "outputs", capsys)
    # recipes: the shipped ones themselves, and what the commands that read them say
    for recipe in sorted((REPO / "recipes").glob("*.yaml")):
        o.value("recipe", yaml.safe_load(recipe.read_text(encoding="utf-8")))
    o.cli("recipe-list", "recipe", "list")
    for recipe in (LINUX, WINDOWS):
        o.cli("key", "key", recipe)
        o.cli("show", "show", recipe)
        o.cli("archs", "archs", recipe)
    o.cli("recipe-lint", "recipe", "lint", LINUX, WINDOWS)
    bad = tmp_path / "bad.yaml"
    bad.write_text(LINUX.read_text(encoding="utf-8").replace("backends: [cpu]", "backend: [cpu]"), encoding="utf-8")
    assert o.cli("recipe-lint", "recipe", "lint", LINUX, bad, code=2)["ok"] is False

    # a store: a miss, publish, a hit, fetch and verify (the load check runs the bundle's llama-server), a build
    # that is a cache hit, the matrix of the release's legs, the static index
    store = tmp_path / "store"
    assert o.cli("check", "check", LINUX, "--store", store, code=1)["hit"] is False
    zip_path = make_bundle_zip(tmp_path)
    o.cli("publish", "publish", zip_path, "--store", store)
    assert o.cli("check", "check", LINUX, "--store", store)["hit"] is True
    fetched = tmp_path / "fetched"
    o.cli("fetch", "fetch", LINUX_KEY, "--store", store, "--out", fetched, "--level", "load")
    o.file("bundle", fetched / "bundle.json")
    assert o.cli("build", "build", LINUX, "--store", store)["hit"] is True
    o.cli("verify", "verify", zip_path, "--level", "load")
    o.cli("matrix", "matrix", "--legs", REPO / ".github" / "release-legs.yml", "--store", store)
    site = tmp_path / "site"
    o.cli("index", "index", "--store", store, "--out", site)
    o.file("index-site", site / "index.json")
    o.cli("cache-list", "cache", "list")
    o.cli("cache-prune", "cache", "prune", "--max", "0", "--dry-run")
    tools = tmp_path / "bin"
    tools.mkdir()
    shutil.copy(shutil.which("true") or "/bin/true", tools / "true")
    o.cli("deps", "deps", tools / "true")

    # the app side, on a CUDA bundle and an old driver: install, list, probe, doctor, telemetry, uninstall
    m = publish_cuda(tmp_path / "cuda-store", tmp_path / "cuda")
    data_dir = tmp_path / "apps"
    smi = fake_smi(tmp_path / "smi", OLD)
    installed = o.cli("install", "install", "--store", tmp_path / "cuda-store", "--key", m.key, "--dest", data_dir)
    o.value("bundle", json.loads((Path(installed["path"]) / "bundle.json").read_text(encoding="utf-8")))  # uninstalled below
    o.cli("list", "list", "--dest", data_dir)
    assert o.cli("probe", "probe", "--dest", data_dir, "--nvidia-smi", smi, "--max-age", "0")["reason"] == "driver_too_old"
    o.cli("doctor", "doctor", "--dest", data_dir, "--nvidia-smi", smi)
    o.cli("telemetry", "telemetry", "--dest", data_dir, "--nvidia-smi", smi)
    o.cli("uninstall", "uninstall", m.key, "--dest", data_dir)
    o.cli("plan", "plan", write_gguf(tmp_path / "m.gguf"), "--free-vram", "24GiB")
    o.cli("toolkit-plan", "toolkit", "plan", "--version", "13.0.2", "--components", "cuda_nvcc,cuda_cudart",
          "--platform", "linux-x86_64")
    o.cli("toolkit-plan", "toolkit", "plan", "--source", "pypi", "--version", "13.0.2", "--components",
          "cuda_nvcc,cuda_cudart")
    o.cli("toolkit-plan", "toolkit", "plan", WINDOWS, "--source", "installer")

    # failures: one error object each
    o.cli("error", "key", LINUX, "--frob", code=2)
    o.cli("error", "verify", tmp_path / "nothing.zip", code=2)
    stage, _ = make_bundle_dir(tmp_path / "tampered")
    (stage / "LICENSE").write_bytes(b"MIT Licensf\n")
    o.cli("error", "verify", stage, code=5)
    o.cli("error", "bundle", LINUX, tmp_path / "no-build", "--out", tmp_path / "bundle-out", code=2)

    # what the bundle's own llamabundle-probe printed on the H200
    for recorded in sorted(H200.glob("probe-*.json")):
        o.file("llamabundle-probe", recorded)

    got = passes(*o.pairs)
    names = {name for name, _ in o.pairs}
    assert len(o.pairs) > 50 and {"recipe", "bundle", "index-site", "llamabundle-probe", "cli-error"} <= names
    assert {f"cli-{n}" for n in ("install", "probe", "doctor", "verify", "fetch", "build", "recipe-lint")} <= names
    assert got["validated"] == len(o.pairs)


def test_the_real_build_its_bundle_json_and_its_probe_validate_under_ajv_strict(
        ajv: str, first_build: dict[str, Any], unpacked: Path, tmp_path: Path) -> None:
    """The session's real build (tests/e2e/conftest.py): `build --json`, `check --json` of the hit, the fetched
    bundle.json, and what the bundle's own llamabundle-probe prints, run as an app would."""
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    (outputs / "build.json").write_text(first_build["build"].stdout, encoding="utf-8")
    (outputs / "hit.json").write_text(first_build["hit"].stdout, encoding="utf-8")
    probe = subprocess.run([str(unpacked / "llamabundle-probe")], env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
                           capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert probe.returncode == 0, probe.stderr[-3000:]
    (outputs / "probe.json").write_text(probe.stdout, encoding="utf-8")
    passes(("cli-build", outputs / "build.json"), ("cli-check", outputs / "hit.json"),
           ("bundle", unpacked / "bundle.json"), ("llamabundle-probe", outputs / "probe.json"))
