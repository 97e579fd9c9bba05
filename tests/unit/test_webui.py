"""The web UI (`ui: build`, webui.py): built once per UI source tree with npm (a stand-in npm here that does what
`npm ci` and `npm run build` do to the tree: node_modules, then LLAMA_UI_OUT_DIR), kept in the cache by the
source's sha256 and reused without npm; laid into the build directory where llama.cpp's ui-assets.cmake embeds
it. Missing npm, a failing build and a damaged kept tree are clear errors that keep nothing. In the key only
when built; a recipe cannot ask llama.cpp to fetch or build it too. (The real npm build, embedded into a real
llama-server that serves it: tests/e2e/test_pipeline.py.)"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from llamabundle import keys, webui
from llamabundle.errors import BuildError, RecipeError, ToolchainError
from llamabundle.log import Log
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
    return webui.provide(src, cache_dir=cache, log=Log(quiet=True), env=env, timeout=60)


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
    with pytest.raises(BuildError, match="changed after it was built"):
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
