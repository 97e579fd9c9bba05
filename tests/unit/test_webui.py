"""The web UI (`ui: build`, webui.py): built once per UI source tree with npm (a stand-in npm here that does what
`npm ci` and `npm run build` do to the tree: node_modules, then LLAMA_UI_OUT_DIR), kept in the cache by the
source's sha256 and reused without npm; laid into the build directory where llama.cpp's ui-assets.cmake embeds
it. Missing npm, a failing build and a damaged kept tree are clear errors that keep nothing. In the key only
when built; a recipe cannot ask llama.cpp to fetch or build it too. (The real npm build, embedded into a real
llama-server that serves it: tests/e2e/test_pipeline.py.)"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import re
import tarfile
from pathlib import Path

import pytest

from llamabundle import keys, webui
from llamabundle.archive import UnsafeArchive
from llamabundle.errors import BuildError, RecipeError, ToolchainError, VerifyError
from llamabundle.log import Log
from tests import gitsources
from tests.clicontract import valid
from tests.clirun import run
from tests.loopback import Loopback, static
from tests.recipes import LINUX, edit

NPM = """#!/bin/sh
echo "$*" >> "{calls}"
case "$1" in
  ci) mkdir -p node_modules/pkg && echo x > node_modules/pkg/index.js ;;
  run) [ -n "{fail}" ] && {{ echo "vite: build failed" >&2; exit 1; }}
       mkdir -p "$LLAMA_UI_OUT_DIR/_app" && echo "<html>ui</html>" > "$LLAMA_UI_OUT_DIR/index.html" \\
       && echo "$npm_config_cache" > "$LLAMA_UI_OUT_DIR/_app/cache.txt" ;;
esac
"""


def source(tmp: Path) -> Path:
    src = tmp / "src"
    ui = src / "tools" / "ui"
    (ui / "src").mkdir(parents=True)
    (ui / "package.json").write_text('{"name": "llama-ui"}\n')
    (ui / "package-lock.json").write_text('{"lockfileVersion": 3}\n')
    (ui / "src" / "app.ts").write_text("export {}\n")
    return src


def fake_npm(tmp: Path, *, fail: bool = False) -> tuple[dict[str, str], Path]:
    bin_dir, calls = tmp / "bin", tmp / "npm-calls"
    bin_dir.mkdir(exist_ok=True)
    npm = bin_dir / "npm"
    npm.write_text(NPM.format(calls=calls, fail="1" if fail else ""))
    npm.chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp)}, calls


def provide(src: Path, cache: Path, env: dict[str, str]) -> webui.Assets:
    return webui.built(src, cache_dir=cache, log=Log(quiet=True), env=env, timeout=60)


def test_built_once_per_ui_source_then_reused_without_npm(tmp_path: Path) -> None:
    src, cache = source(tmp_path), tmp_path / "cache"
    env, calls = fake_npm(tmp_path)
    a = provide(src, cache, env)
    assert calls.read_text().splitlines() == ["ci --no-audit --no-fund", "run build"]
    assert a.dist == cache / "ui" / a.source / "dist" and (a.dist / "index.html").read_text() == "<html>ui</html>\n"
    assert (a.dist / "_app" / "cache.txt").read_text().strip() == str(cache / "downloads" / "npm")  # npm's cache is ours
    assert a.files == 2 and a.digest == webui.tree_digest(a.dist)[0]
    assert not list((cache / "tmp").iterdir())  # the work tree became the kept one
    b = provide(src, cache, {"PATH": "/nonexistent"})  # no npm needed: the kept tree is used
    assert b == a and len(calls.read_text().splitlines()) == 2


def test_the_source_id_is_the_ui_tree_without_its_outputs(tmp_path: Path) -> None:
    src = source(tmp_path)
    ui = src / "tools" / "ui"
    first = webui.source_id(src)
    for out in ("dist", "node_modules", ".svelte-kit"):
        (ui / out).mkdir()
        (ui / out / "x").write_text("output")
    assert webui.source_id(src) == first
    (ui / "src" / "app.ts").write_text("export const x = 1\n")
    assert webui.source_id(src) != first


def test_no_npm_is_a_toolchain_error_naming_ui_none(tmp_path: Path) -> None:
    src, cache = source(tmp_path), tmp_path / "cache"
    with pytest.raises(ToolchainError) as e:
        provide(src, cache, {"PATH": str(tmp_path / "empty")})
    assert e.value.exit_code == 3 and "npm is not on PATH" in e.value.what and "ui: none" in e.value.fix
    assert not (cache / "ui").exists()


def test_a_failing_npm_build_keeps_nothing(tmp_path: Path) -> None:
    src, cache = source(tmp_path), tmp_path / "cache"
    env, _ = fake_npm(tmp_path, fail=True)
    with pytest.raises(BuildError) as e:
        provide(src, cache, env)
    assert e.value.exit_code == 4 and "the web UI's build failed" in e.value.what and "vite: build failed" in e.value.render()
    assert not (cache / "ui").exists() and not list((cache / "tmp").iterdir())


def test_a_damaged_kept_tree_is_refused_and_removed(tmp_path: Path) -> None:
    src, cache = source(tmp_path), tmp_path / "cache"
    env, calls = fake_npm(tmp_path)
    a = provide(src, cache, env)
    (a.dist / "index.html").write_text("<html>changed</html>\n")
    with pytest.raises(BuildError, match="changed after it was kept"):
        provide(src, cache, env)
    assert not a.dist.exists()
    assert provide(src, cache, env).digest == a.digest and len(calls.read_text().splitlines()) == 4  # built anew


def test_place_lays_the_assets_where_ui_assets_cmake_embeds_them(tmp_path: Path) -> None:
    src, cache = source(tmp_path), tmp_path / "cache"
    env, _ = fake_npm(tmp_path)
    a = provide(src, cache, env)
    build = tmp_path / "build"
    dest = webui.place(a, build, Log(quiet=True))
    assert dest == build / "tools" / "ui" / "dist" and webui.tree_digest(dest)[0] == a.digest
    (dest / "stale.js").write_text("old")
    webui.place(a, build, Log(quiet=True))
    assert not (dest / "stale.js").exists() and webui.tree_digest(dest)[0] == a.digest


def test_the_key_holds_the_ui_only_when_it_is_built() -> None:
    without = re.sub(r"^ui: build.*\n", "", LINUX, flags=re.M)
    assert without != LINUX
    none = keys.resolve(keys.parse(without))
    built = keys.resolve(keys.parse(LINUX))
    assert built.recipe.ui == "build" and built.inputs["ui"] == "build"
    assert "ui" not in none.inputs and none.key != built.key
    explicit = keys.resolve(keys.parse(edit(LINUX, "ui: build ", "ui: none ")))
    assert explicit.key == none.key  # `none` is the default: recipes without the UI keep their keys


@pytest.mark.parametrize(("old", "new", "message"), [
    ("  LLAMA_USE_PREBUILT_UI: OFF", "  LLAMA_USE_PREBUILT_UI: ON", "LLAMA_USE_PREBUILT_UI is ON"),
    ("  LLAMA_USE_PREBUILT_UI: OFF        # no download of web UI assets at build time\n", "",
     "LLAMA_USE_PREBUILT_UI defaults to ON"),
    ("  LLAMA_USE_PREBUILT_UI: OFF", "  LLAMA_USE_PREBUILT_UI: OFF\n  LLAMA_BUILD_UI: ON", "LLAMA_BUILD_UI is ON"),
], ids=["prebuilt-on", "prebuilt-default", "npm-in-cmake"])
def test_llama_cpp_may_not_fetch_or_build_the_ui_itself(old: str, new: str, message: str) -> None:
    with pytest.raises(RecipeError) as e:
        keys.parse(edit(LINUX, old, new))
    assert message in e.value.what and "OFF" in e.value.fix


def test_every_shipped_recipe_builds_the_ui() -> None:
    for path in sorted((Path(__file__).resolve().parents[2] / "recipes").glob("*.yaml")):
        assert keys.load(path).ui == "build", path.name
    assert dataclasses.fields(webui.Assets)


# ------------------------------------------------- a pinned archive (ui: {url, sha256}) and `ui pack`


def archived(tmp: Path) -> tuple[Path, webui.Assets, Path]:
    """The source, its UI built by the stand-in npm, and `ui pack`'s archive of it."""
    src = source(tmp)
    env, _ = fake_npm(tmp)
    a = provide(src, tmp / "cache", env)
    return src, a, webui.pack(a, tmp / "packed")


def pinned(tmp: Path, body: bytes, src: Path, *, sha: str | None = None, name: str = "webui.tar",
           cache: Path | None = None) -> tuple[webui.Assets, Loopback]:
    with Loopback(static({f"/{name}": body})) as server:  # a pinned UI needs no npm
        return webui.pinned(f"{server.url}/{name}", sha or hashlib.sha256(body).hexdigest(), src,
                            cache_dir=cache or tmp / "cache2", log=Log(quiet=True)), server


def test_pack_writes_the_same_bytes_for_the_same_assets(tmp_path: Path) -> None:
    _, a, path = archived(tmp_path)
    again = webui.pack(a, tmp_path / "again")
    assert path.read_bytes() == again.read_bytes() and path.name == f"webui-{a.source[:12]}-{a.digest[:12]}.tar"
    with tarfile.open(path) as tf:
        members = tf.getmembers()
    assert [m.name for m in members] == ["webui.json", "dist/_app/cache.txt", "dist/index.html"]
    assert {(m.mtime, m.uid, m.gid, m.mode, m.uname) for m in members} == {(0, 0, 0, 0o644, "")}
    assert not list((tmp_path / "again").glob(".*"))  # nothing of the writing left beside it


def test_a_pinned_archive_is_downloaded_once_checked_and_embeds_the_same_files(tmp_path: Path) -> None:
    src, a, path = archived(tmp_path)
    got, server = pinned(tmp_path, path.read_bytes(), src)
    assert (got.source, got.digest, got.files) == (a.source, a.digest, a.files)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    assert got.dist == tmp_path / "cache2" / "ui" / f"archive-{sha}" / "dist" and server.paths() == ["/webui.tar"]
    again, server = pinned(tmp_path, b"not served", src, sha=sha)  # kept: not downloaded again
    assert again.digest == a.digest and server.paths() == []
    dest = webui.place(again, tmp_path / "build", Log(quiet=True))
    assert webui.tree_digest(dest)[0] == a.digest


def _tar(members: list[tuple[str, bytes | None, str]]) -> bytes:
    """A tar of (name, data, kind): kind "file", "link" (data is the target) or "dir"."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name, data, kind in members:
            info = tarfile.TarInfo(name)
            if kind == "link":
                info.type, info.linkname = tarfile.SYMTYPE, (data or b"").decode()
                tf.addfile(info)
            else:
                info.size = len(data or b"")
                tf.addfile(info, io.BytesIO(data or b""))
    return buf.getvalue()


def _meta(source: str, digest: str, files: int) -> bytes:
    return json.dumps({"schema": 1, "source": source, "digest": digest, "files": files}).encode()


@pytest.mark.parametrize("case", ["sha256", "other-source", "tampered", "symlink", "escape", "stray", "no-meta",
                                  "bad-meta", "not-a-tar"])
def test_a_bad_pinned_archive_is_refused_and_nothing_is_kept(tmp_path: Path, case: str) -> None:
    src, a, path = archived(tmp_path)
    good = path.read_bytes()
    index = b"<html>ui</html>\n"
    meta = _meta(a.source, a.digest, a.files)
    cache_txt = (a.dist / "_app" / "cache.txt").read_bytes()
    body, sha, error, said = {
        "sha256": (good, "0" * 64, VerifyError, "sha256"),
        "tampered": (_tar([("webui.json", meta, "file"), ("dist/_app/cache.txt", cache_txt, "file"),
                           ("dist/index.html", b"<html>evil</html>\n", "file")]), None, VerifyError,
                     "holds other files than its webui.json records"),
        "symlink": (_tar([("webui.json", meta, "file"), ("dist/index.html", b"/etc/passwd", "link")]), None,
                    UnsafeArchive, "member 'dist/index.html' is not one a web UI archive holds"),
        "escape": (_tar([("webui.json", meta, "file"), ("dist/../../x", index, "file")]), None, UnsafeArchive,
                   "escapes the destination"),
        "stray": (_tar([("webui.json", meta, "file"), ("dist/index.html", index, "file"), ("run.sh", b"x", "file")]),
                  None, UnsafeArchive, "member 'run.sh' is not one"),
        "no-meta": (_tar([("dist/index.html", index, "file")]), None, VerifyError, "has no webui.json"),
        "bad-meta": (_tar([("webui.json", b'{"schema": 1, "source": "x"}', "file"), ("dist/index.html", index, "file")]),
                     None, VerifyError, "is not what `ui pack` writes"),
        "not-a-tar": (b"PK\x03\x04 not a tar at all", None, VerifyError, "not a readable tar"),
        "other-source": (good, None, BuildError, "built from another web UI source"),
    }[case]
    if case == "other-source":
        (src / "tools" / "ui" / "src" / "app.ts").write_text("export const changed = 1\n")
    with pytest.raises(error) as e:
        pinned(tmp_path, body, src, sha=sha)
    assert said in str(e.value.what) + str(e.value.why), e.value
    ui_area = tmp_path / "cache2" / "ui"
    kept = [p.name for p in ui_area.iterdir()] if ui_area.exists() else []
    assert kept == ([f"archive-{hashlib.sha256(good).hexdigest()}"] if case == "other-source" else []), kept
    assert not list((tmp_path / "cache2" / "tmp").glob("*")) if (tmp_path / "cache2" / "tmp").exists() else True


PINNED = "ui:\n  url: https://example.invalid/webui.tar\n  sha256: " + "ab" * 32 + "\n"


def test_a_recipe_pins_a_ui_archive_by_sha256_and_the_key_holds_that_sha256() -> None:
    pinned_text = re.sub(r"^ui: build.*\n", PINNED, LINUX, flags=re.M)
    r = keys.resolve(keys.parse(pinned_text))
    assert r.recipe.embeds_ui and r.inputs["ui"] == {"archive_sha256": "ab" * 32}
    assert r.key != keys.resolve(keys.parse(LINUX)).key
    mirror = keys.resolve(keys.parse(pinned_text.replace("example.invalid", "mirror.example.invalid")))
    assert mirror.key == r.key  # where it is published is not in the key: its bytes are
    other = keys.resolve(keys.parse(pinned_text.replace("ab" * 32, "cd" * 32)))
    assert other.key != r.key
    with pytest.raises(RecipeError, match="LLAMA_USE_PREBUILT_UI is ON"):  # still no download by llama.cpp itself
        keys.parse(edit(pinned_text, "  LLAMA_USE_PREBUILT_UI: OFF", "  LLAMA_USE_PREBUILT_UI: ON"))


@pytest.mark.parametrize(("ui", "message"), [
    ("ui: npm\n", "'npm' is not one of build, none, or a mapping of url, sha256"),
    ("ui: [build]\n", "expected one of build, none"),
    ("ui: {url: ftp://x/webui.tar, sha256: " + "ab" * 32 + "}\n", "'ftp://x/webui.tar' is not valid"),
    ("ui: {url: https://x/webui.tar}\n", "missing required key 'sha256'"),
    ("ui: {url: https://x/webui.tar, sha256: " + "ab" * 32 + ", name: x}\n", "unknown key 'name'"),
])
def test_a_bad_ui_is_a_recipe_error_at_its_line(ui: str, message: str) -> None:
    with pytest.raises(RecipeError) as e:
        keys.parse(re.sub(r"^ui: build.*\n", ui, LINUX, flags=re.M))
    assert message in e.value.what and e.value.line is not None


def test_ui_pack_builds_the_commits_ui_and_writes_the_archive_a_recipe_pins(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    repo = tmp_path / "llama.cpp"
    ui_files = {f"tools/ui/{k}": v for k, v in {"package.json": b'{"name": "llama-ui"}\n',
                                                  "package-lock.json": b'{"lockfileVersion": 3}\n',
                                                  "src/app.ts": b"export {}\n"}.items()}
    commit = gitsources.make_repo(repo, {**gitsources.FILES, **ui_files})
    recipe = tmp_path / "r.yaml"
    recipe.write_text("\n".join(["recipe: 1", "name: ui-test", "platform: linux-x86_64", "llama_cpp:",
                                 f"  commit: {commit}", f"  sources: [{{path: {repo}}}]", "backends: [cpu]",
                                 "toolchain: {compiler: gcc}", "targets: [llama-server]",
                                 "cmake: {LLAMA_USE_PREBUILT_UI: 'OFF'}", "ui: build", ""]))
    env, calls = fake_npm(tmp_path)
    monkeypatch.setenv("PATH", env["PATH"])
    monkeypatch.setenv("LLAMABUNDLE_CACHE_DIR", str(tmp_path / "cache"))
    code, out, err = run(capsys, "ui", "pack", recipe, "--out", tmp_path / "out", "--json")
    assert code == 0, err
    got = valid("ui-pack", json.loads(out))
    archive = Path(got["archive"])
    assert archive.parent == tmp_path / "out" and got["sha256"] == hashlib.sha256(archive.read_bytes()).hexdigest()
    assert got["commit"] == commit and got["files"] == 2 and got["size"] == archive.stat().st_size
    assert len(calls.read_text().splitlines()) == 2
    code, out, _ = run(capsys, "ui", "pack", recipe, "--out", tmp_path / "out2")  # the kept UI: no npm again
    assert code == 0 and len(calls.read_text().splitlines()) == 2
    assert (tmp_path / "out2" / archive.name).read_bytes() == archive.read_bytes()
    assert f"sha256: {got['sha256']}" in out and "ui:\n  url: https://…/" in out
    src = tmp_path / "cache" / "src" / commit
    assets, _ = pinned(tmp_path, archive.read_bytes(), src if src.is_dir() else repo)
    assert assets.digest == got["digest"]
    none = recipe.read_text().replace("ui: build", "ui: none")
    recipe.write_text(none)
    code, _, err = run(capsys, "ui", "pack", recipe)
    assert code == 2 and "says ui: none" in err
