"""The GitHub Actions workflows: actionlint and zizmor (pedantic) find nothing, every action is pinned by commit
SHA, and release.yml builds exactly the released recipes (.github/release-legs.yml), only those whose bundles
a plan job (`llamabundle matrix`, Python only) finds missing from the store, on images that have the tools the
recipes pin (Debian 12 for Linux and mingw-w64, a Windows image whose MSVC the recipe's CUDA accepts), in legs
that may only read; a publish job of its own verifies, publishes and attests what they built. The extracted
CUDA toolkit and the compiler cache are kept across runs within a budget that fits GitHub's 10 GB, and the
build log is kept when a build fails."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import yaml

from llamabundle import keys

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
RELEASE = WORKFLOWS / "release.yml"
LEGS = ROOT / ".github" / "release-legs.yml"
ON_BUILD_FAILURE = "failure() && steps.build.outcome == 'failure'"
# where release.yml puts llamabundle's cache (LLAMABUNDLE_CACHE_DIR) and ccache's (CCACHE_DIR), in the workspace
CACHE_DIR = ".cache/llamabundle"
CCACHE_DIR = ".cache/ccache"
DEBIAN = "debian:12"
# a step `uses: owner/repo[/path]@<40 hex> # vX.Y.Z`
PINNED = re.compile(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_./-]+@[0-9a-f]{40}")
USES_LINE = re.compile(r"^\s*(?:-\s+)?uses:\s*(\S+)(.*)$")
VERSION_COMMENT = re.compile(r"#\s*v\d+\.\d+\.\d+\b")


def find_tool(name: str) -> str | None:
    """`name` on PATH, else in this interpreter's scripts directory (a venv that was not activated)."""
    exe = f"{name}.exe" if os.name == "nt" else name
    found = shutil.which(name)
    if found:
        return found
    for d in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        if d and (Path(d) / exe).is_file():
            return str(Path(d) / exe)
    return None


def find_actionlint() -> str | None:
    return find_tool("actionlint")


def workflow_files() -> list[Path]:
    files = sorted(WORKFLOWS.glob("*.yml"))
    assert files, f"no workflows in {WORKFLOWS}"
    return files


def load(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert isinstance(data, dict), f"{path.name} is not a YAML mapping"
    if True in data and "on" not in data:  # YAML 1.1 reads the key `on` as a boolean
        data["on"] = data.pop(True)
    return data


def condition(step: dict[str, Any]) -> str:
    cond = str(step.get("if", "")).strip()
    m = re.fullmatch(r"\$\{\{(.*)\}\}", cond, re.S)
    return " ".join((m.group(1) if m else cond).split())


def conjuncts(cond: str) -> list[str]:
    """The top-level `&&` terms of a condition (one without `||`, which every condition here is)."""
    assert "||" not in cond, f"condition {cond!r} has an `||`"
    return [c.strip() for c in cond.split("&&")]


def release_job() -> dict[str, Any]:
    job = load(RELEASE)["jobs"]["bundle"]
    assert isinstance(job, dict)
    return job


def release_steps() -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = release_job()["steps"]
    return steps


def publish_job() -> dict[str, Any]:
    job = load(RELEASE)["jobs"]["publish"]
    assert isinstance(job, dict)
    return job


def plan_job() -> dict[str, Any]:
    job = load(RELEASE)["jobs"]["plan"]
    assert isinstance(job, dict)
    return job


def release_matrix() -> list[dict[str, Any]]:
    """The legs `llamabundle matrix --legs` reads (the plan job keeps those whose bundles are missing)."""
    rows: list[dict[str, Any]] = yaml.safe_load(LEGS.read_text(encoding="utf-8"))["legs"]
    return rows


def recipe_of(row: dict[str, Any]) -> dict[str, Any]:
    recipe = yaml.safe_load((ROOT / "recipes" / f"{row['recipe']}.yaml").read_text(encoding="utf-8"))
    assert isinstance(recipe, dict)
    return recipe


def is_native_windows(recipe: dict[str, Any]) -> bool:
    return str(recipe["platform"]).startswith("windows-") and recipe["toolchain"]["compiler"] != "mingw"


def uses_steps(steps: list[dict[str, Any]], action: str) -> list[dict[str, Any]]:
    return [s for s in steps if str(s.get("uses", "")).startswith(f"{action}@")]


def size_bytes(size: str) -> float:
    """A ccache size (`5G`, `500M`, `2Gi`, a plain number of bytes) in bytes."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?", size.strip(), re.I)
    assert m, f"{size!r} is not a ccache size"
    power = " KMGT".index(m.group(2).upper() or " ")
    base = 1024.0 if m.group(3) else 1000.0  # ccache: k, M, G, T are powers of 1000; Ki, Mi, Gi, Ti of 1024
    return float(m.group(1)) * base**power


def step_running(steps: list[dict[str, Any]], needle: str) -> dict[str, Any]:
    found = [s for s in steps if needle in str(s.get("run", ""))]
    assert len(found) == 1, f"expected one step of release.yml to run `{needle}`, found {len(found)}"
    return found[0]


# ------------------------------------------------------------------------------- linters and pins


@pytest.mark.lint
def test_actionlint_finds_nothing() -> None:
    actionlint = find_actionlint()
    if actionlint is None:
        pytest.fail("actionlint is not installed: install the test extra (python3 -m pip install -e '.[test]'), "
                    "which provides the actionlint binary", pytrace=False)
    proc = subprocess.run([actionlint, "-no-color", *map(str, workflow_files())], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 0 and out == "", f"actionlint exited {proc.returncode}:\n{out}"


@pytest.mark.lint
def test_zizmor_finds_nothing() -> None:
    """zizmor's offline audits (template injection, credential persistence, unpinned actions, excessive
    permissions, cache poisoning, ...): no finding, besides the ones release.yml ignores with a reason."""
    zizmor = find_tool("zizmor")
    if zizmor is None:
        pytest.fail("zizmor is not installed: install the test extra (python3 -m pip install -e '.[test]'), "
                    "which provides the zizmor binary", pytrace=False)
    env = {k: v for k, v in os.environ.items() if k not in {"GH_TOKEN", "GITHUB_TOKEN", "ZIZMOR_GITHUB_TOKEN"}}
    # --strict-collection: a workflow zizmor cannot read is a failure, never silently left out
    cmd = [zizmor, "--offline", "--pedantic", "--strict-collection", "--no-progress", "--color=never",
           *map(str, workflow_files())]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False, env=env)
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 0, f"zizmor exited {proc.returncode}:\n{out}"
    # ignored sparingly, each with its reason above it: the cache-poisoning finding of release.yml's caches, and
    # the Debian 12 image named by its tag (its tools are pinned by the recipes and checked by `build`)
    ignores = [(path.name, line.strip()) for path in workflow_files()
               for line in path.read_text(encoding="utf-8").splitlines() if "zizmor: ignore" in line]
    caches = [(n, line) for n, line in ignores if line.startswith("uses: actions/cache@")]
    images = [(n, line) for n, line in ignores if line.startswith("container:")]
    assert len(caches) == len(uses_steps(release_steps(), "actions/cache")) and len(ignores) == len(caches) + len(images)
    for name, line in caches:
        assert name == RELEASE.name and line.endswith("# zizmor: ignore[cache-poisoning]"), line
    assert sorted(images) == [("ci.yml", f"container: {DEBIAN}  # zizmor: ignore[unpinned-images]"),
                              ("release.yml", "container: ${{ matrix.container }}  # zizmor: ignore[unpinned-images]")]


def test_every_action_is_pinned_by_commit_sha() -> None:
    """A tag can be moved; a commit cannot. The tag it was stays beside it, as `# vX.Y.Z`."""
    seen = 0
    for path in workflow_files():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            m = USES_LINE.match(line)
            if not m:
                continue
            seen += 1
            ref, rest = m.group(1).strip("'\""), m.group(2)
            assert PINNED.fullmatch(ref), f"{path.name}:{n}: {ref} is not pinned to a 40-hex commit SHA"
            assert VERSION_COMMENT.search(rest), f"{path.name}:{n}: {ref} has no `# vX.Y.Z` comment"
        # every `uses:` of the parsed workflow was one of those lines (none hides in a flow mapping)
        jobs = load(path)["jobs"].values()
        parsed = [s["uses"] for j in jobs for s in j.get("steps", []) if "uses" in s] + \
                 [j["uses"] for j in jobs if "uses" in j]
        assert all(PINNED.fullmatch(u) for u in parsed), f"{path.name}: {parsed}"
    assert seen, "no `uses:` in the workflows"


def test_the_replaced_workflows_are_gone() -> None:
    assert not (WORKFLOWS / "tests.yml").exists() and not (WORKFLOWS / "bundles.yml").exists()  # now ci.yml, release.yml


# ------------------------------------------------------------------------------------------- release.yml


def test_release_triggers_and_permissions() -> None:
    wf = load(RELEASE)
    assert wf["on"]["release"]["types"] == ["published"]
    assert "workflow_dispatch" in wf["on"]
    # nothing for the workflow as a whole; the legs that run llama.cpp's build only read; the writes only in the
    # job that publishes, which runs after them and builds nothing
    assert wf["permissions"] == {}
    assert set(wf["jobs"]) == {"plan", "bundle", "publish"}
    assert plan_job()["permissions"] == release_job()["permissions"] == {"contents": "read"}
    assert publish_job()["permissions"] == {"contents": "write", "id-token": "write", "attestations": "write"}
    assert publish_job()["needs"] == ["plan", "bundle"]
    assert condition(publish_job()) == "!cancelled() && needs.plan.outputs.count != '0'"


def test_release_matrix_is_exactly_the_shipped_recipes() -> None:
    job = release_job()
    include = release_matrix()
    names = [row["recipe"] for row in include]
    # the per-image recipes (…-ubuntu24.04) are for building on that image: the release publishes the Debian 12 ones
    shipped = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml") if not p.stem.endswith("-ubuntu24.04"))
    assert shipped, "no recipes/*.yaml"
    assert sorted(names) == shipped and len(names) == len(set(names))
    for row in include:
        recipe = recipe_of(row)
        assert recipe["name"] == row["recipe"]
        # Linux and mingw-w64: in Debian 12, whose compilers and glslc the recipes pin (see below)
        runner, image = ("windows-2022", "") if is_native_windows(recipe) else ("ubuntu-24.04", DEBIAN)
        assert (row["os"], row["container"]) == (runner, image), f"{row['recipe']} ({recipe['platform']}) must run on {runner} {image}"
    assert job["runs-on"] == "${{ matrix.os }}" and job["container"] == "${{ matrix.container }}"
    assert job["strategy"]["matrix"] == "${{ fromJSON(needs.plan.outputs.matrix) }}"
    assert job["needs"] == "plan" and condition(job) == "needs.plan.outputs.count != '0'"
    assert job["env"]["RECIPE"] == "recipes/${{ matrix.recipe }}.yaml"
    assert job["env"]["STORE"] == "github:${{ github.repository }}"


def test_the_plan_job_asks_the_store_with_python_only() -> None:
    """The first job runs `llamabundle matrix` over the legs file on a bare runner: llamabundle without its build
    tools, no compiler, no apt-get; its outputs are the matrix and its size."""
    job = plan_job()
    steps: list[dict[str, Any]] = job["steps"]
    matrix = step_running(steps, "llamabundle matrix")
    assert matrix["run"].strip() == 'llamabundle matrix --legs .github/release-legs.yml --store "$STORE"'
    assert matrix.get("id") == "matrix" and matrix["env"]["GITHUB_TOKEN"] == "${{ secrets.GITHUB_TOKEN }}"
    assert job["outputs"] == {"matrix": "${{ steps.matrix.outputs.matrix }}", "count": "${{ steps.matrix.outputs.count }}"}
    assert job["env"]["STORE"] == "github:${{ github.repository }}"
    text = "\n".join(str(s.get("run", "")) for s in steps)
    assert "pip install ." in text and "[tools]" not in text
    for needle in ("apt-get", "choco", "glslc", "g++", "mingw", "cmake", "llamabundle build"):
        assert needle not in text, f"the plan job runs {needle!r}"
    assert "container" not in job


def test_a_leg_builds_without_publishing() -> None:
    """A leg exists only for a miss (the plan job): it builds (a bundle published since the plan is fetched and
    verified instead), never publishes, and restores its caches before the build."""
    steps = release_steps()
    assert not [s for s in steps if "llamabundle check" in str(s.get("run", ""))]  # the plan asked the store
    build = step_running(steps, "llamabundle build")
    assert "if" not in build
    assert '--store "$STORE" --no-publish --json' in build["run"]  # the leg cannot write: publish does
    assert build["env"]["GITHUB_TOKEN"] == "${{ secrets.GITHUB_TOKEN }}"
    # its zip is llamabundle's own step output (issue 32: it was parsed out of --json inline)
    assert build.get("id") == "build" and "GITHUB_OUTPUT" not in build["run"] and "python" not in build["run"]
    assert not uses_steps(steps, "actions/attest-build-provenance")
    restores = uses_steps(steps, "actions/cache") + uses_steps(steps, "actions/cache/restore")
    assert restores
    for cache_step in restores:
        assert steps.index(cache_step) < steps.index(build)
    [log] = [s for s in steps if s.get("name") == "upload the build log"]
    assert condition(log) == ON_BUILD_FAILURE


def test_each_leg_has_node_for_the_web_ui_before_it_builds() -> None:
    """Every released recipe builds llama.cpp's web UI with npm (ui: build): each leg sets up Node.js 20, whatever
    its image (Debian 12's own is 18), before the build."""
    steps = release_steps()
    [node] = uses_steps(steps, "actions/setup-node")
    assert str(node["with"]["node-version"]) == "20" and "if" not in node
    assert steps.index(node) < steps.index(step_running(steps, "llamabundle build"))
    assert all(recipe_of(row).get("ui") == "build" for row in release_matrix())


def test_each_leg_runs_on_an_image_with_the_tools_its_recipe_pins() -> None:
    """Debian 12 has g++ 12.2.0, a mingw-w64 g++ whose macros say 12.0.0 and glslc 2023.2-1; windows-2022 has
    MSVC 14.44.35207: each leg's recipe pins exactly what its image has (else `build` would stop at exit 3).
    Where this machine is that Debian (README's, CI's), its tools are checked to be the pinned ones."""
    images = {DEBIAN: {"gcc": "=12.2.0", "mingw": "=12.0.0", "clang": "=19.1.7", "glibc": "2.36",
                       "glslc": {"shaderc": "2023.2-1", "spirv_tools": "2022.4+1.3.236.0-1", "glslang": "11.13.0-1",
                                 "features": []}},
              "windows-2022": {"msvc": "14.44.35207"}}
    for row in release_matrix():
        recipe = recipe_of(row)
        has = images[row["container"] or row["os"]]
        t = recipe["toolchain"]
        assert (t.get("toolset") if t["compiler"] == "msvc" else t.get("version")) == has[t["compiler"]], row["recipe"]
        if "vulkan" in recipe:
            assert recipe["vulkan"]["glslc"] == has["glslc"], row["recipe"]
        if "glibc" in t:  # a cross build's sysroot (Debian 12's libc6-dev-arm64-cross), on the image it is pinned for
            assert (t["glibc"], t.get("build_host")) == (has["glibc"], "linux-x86_64"), row["recipe"]
    try:
        debian12 = Path("/etc/debian_version").read_text().startswith("12.")
    except OSError:
        debian12 = False
    if debian12:
        from llamabundle.backends import vulkan
        from llamabundle.compilers import detect_version

        for compiler, program in (("gcc", None), ("mingw", None), ("clang", "clang++-19")):
            found = detect_version(compiler, program=program)
            assert found is None or "=" + found == images[DEBIAN][compiler], (compiler, found)
        glslc = vulkan.detect_glslc()
        if glslc is not None:
            pin = images[DEBIAN]["glslc"]
            assert (glslc.version, dict(glslc.versions), list(glslc.features)) == (
                pin["shaderc"], {"shaderc": pin["shaderc"], "spirv-tools": pin["spirv_tools"], "glslang": pin["glslang"]},
                pin["features"])


def test_each_leg_hands_its_zip_to_the_publish_job() -> None:
    steps = release_steps()
    build = step_running(steps, "llamabundle build")
    [upload] = [s for s in uses_steps(steps, "actions/upload-artifact") if s.get("name") == "upload the bundle"]
    assert PINNED.fullmatch(upload["uses"]) and "if" not in upload
    assert upload["with"]["name"] == "bundle-${{ matrix.recipe }}"  # one artifact per leg
    assert upload["with"]["path"] == "${{ steps.build.outputs.zip }}" and upload["with"]["if-no-files-found"] == "error"
    assert steps.index(build) < steps.index(upload)


def test_the_publish_job_verifies_publishes_and_attests_and_builds_nothing() -> None:
    """It downloads every leg's zip, verifies each (static: manifest, every file's sha256, imports, GPU archs)
    before publishing it, and attests what it published; it runs no build of any kind."""
    job = publish_job()
    steps: list[dict[str, Any]] = job["steps"]
    [download] = uses_steps(steps, "actions/download-artifact")
    assert PINNED.fullmatch(download["uses"]) and download["with"]["pattern"] == "bundle-*"
    where = download["with"]["path"]
    publish = step_running(steps, "llamabundle publish")
    run = publish["run"]
    assert run.index('llamabundle verify "$zip" --level static') < run.index('llamabundle publish "$zip" --store "$STORE"')
    assert publish.get("id") == "publish" and publish["env"]["GITHUB_TOKEN"] == "${{ secrets.GITHUB_TOKEN }}"
    assert job["env"]["STORE"] == "github:${{ github.repository }}"
    [attest] = uses_steps(steps, "actions/attest-build-provenance")
    assert attest["with"] == {"subject-path": f"{where}/*/*.zip"}
    assert condition(attest) == "steps.publish.outputs.count != '0'"
    assert steps.index(download) < steps.index(publish) < steps.index(attest)
    text = "\n".join(str(s.get("run", "")) for s in steps)
    for needle in ("llamabundle build", "cmake", "ninja", "pip install -e"):
        assert needle not in text, f"the publish job runs {needle!r}"
    for s in steps:
        assert "cache" not in str(s.get("uses", "")), f"the publish job restores a cache: {s['uses']}"


def test_each_published_zip_gets_a_build_provenance_attestation() -> None:
    """actions/attest-build-provenance signs the zips the publish job published (Sigstore, through the job's OIDC
    token), pinned by commit SHA with its release tag beside it; only that job may mint the token and write
    attestations. Consumers check it with `gh attestation verify` (README); install does not (no Sigstore here)."""
    [attest] = uses_steps(publish_job()["steps"], "actions/attest-build-provenance")
    action, sha = attest["uses"].split("@")
    assert action == "actions/attest-build-provenance" and re.fullmatch(r"[0-9a-f]{40}", sha)
    [line] = [ln for ln in RELEASE.read_text(encoding="utf-8").splitlines() if f"uses: {attest['uses']}" in ln]
    assert VERSION_COMMENT.search(line), line
    # the permissions it needs, on the job that attests, and nowhere else
    assert {"id-token", "attestations"} <= {k for k, v in publish_job()["permissions"].items() if v == "write"}
    for path in workflow_files():
        for name, job in load(path)["jobs"].items():
            if (path, name) != (RELEASE, "publish"):
                perms = job.get("permissions") or {}
                assert "id-token" not in perms and "write" not in perms.values(), f"{path.name}: {name}: {perms}"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "gh attestation verify" in readme and "--repo" in readme


def test_the_compiler_cache_is_saved_even_when_the_build_fails() -> None:
    """A cold CUDA build takes hours: what it compiled is kept when it fails or runs out of time (the build step
    stops before the job's limit), so that a re-run of the job resumes from it."""
    steps = release_steps()
    ccache_path = CCACHE_DIR
    [restore] = uses_steps(steps, "actions/cache/restore")
    [save] = uses_steps(steps, "actions/cache/save")
    assert restore["with"]["path"] == save["with"]["path"] == ccache_path
    assert restore["uses"].split("@")[1] == save["uses"].split("@")[1]
    assert "if" not in restore and restore.get("id") == "ccache"
    # a key of its own for every attempt (a cache key is written once), restored by the newest of the recipe's
    key = restore["with"]["key"]
    assert "matrix.recipe" in key and "${{ github.run_id }}-${{ github.run_attempt }}" in key
    assert restore["with"]["restore-keys"].splitlines() == ["ccache-${{ matrix.recipe }}-${{ hashFiles(env.RECIPE) }}-",
                                                       "ccache-${{ matrix.recipe }}-"]
    assert save["with"]["key"] == "${{ steps.ccache.outputs.cache-primary-key }}"
    assert conjuncts(condition(save)) == ["always()", "steps.ccache.outcome == 'success'"]
    build = step_running(steps, "llamabundle build")
    assert steps.index(restore) < steps.index(build) < steps.index(save) == len(steps) - 1
    assert build["timeout-minutes"] + 20 <= release_job()["timeout-minutes"] <= 360


def test_release_sets_the_cache_directories_before_anything_uses_them() -> None:
    """LLAMABUNDLE_CACHE_DIR and CCACHE_DIR are set explicitly, in the workspace, so that the cache steps'
    paths (relative to it) name the directories llamabundle and ccache really use, in a container job too
    (where the runner's own paths, runner.temp's included, are not the container's)."""
    steps = release_steps()
    job_env = release_job()["env"]
    assert "LLAMABUNDLE_CACHE_DIR" not in job_env and "CCACHE_DIR" not in job_env  # $GITHUB_WORKSPACE: steps only
    [setter] = [s for s in steps if "LLAMABUNDLE_CACHE_DIR=" in str(s.get("run", ""))]
    assert f'echo "LLAMABUNDLE_CACHE_DIR=$GITHUB_WORKSPACE/{CACHE_DIR}" >> "$GITHUB_ENV"' in setter["run"]
    assert f'echo "CCACHE_DIR=$GITHUB_WORKSPACE/{CCACHE_DIR}" >> "$GITHUB_ENV"' in setter["run"]
    assert "if" not in setter
    first_user = min(steps.index(step_running(steps, "llamabundle build")),
                     steps.index(step_running(steps, "pip install")))
    assert steps.index(setter) < first_user
    assert "${{ runner.temp }}" not in RELEASE.read_text(encoding="utf-8").split("\n  bundle:")[1].split("\n  publish:")[0]


def test_windows_legs_run_on_a_bare_windows_2022_and_no_step_opens_a_developer_prompt() -> None:
    """llamabundle sets MSVC up itself (vswhere, then the toolset's environment script, inside the tool): the
    workflow must work on a runner where no developer prompt was opened, so it opens none either."""
    windows = {row["recipe"]: row for row in release_matrix() if is_native_windows(recipe_of(row))}
    assert {"windows-x86_64-cuda12.8", "windows-x86_64-cpu"} <= set(windows)
    for name, row in windows.items():
        assert row["os"] == "windows-2022", name
        assert recipe_of(row)["toolchain"]["compiler"] == "msvc", name
        assert row["msc-ver"] == WINDOWS_IMAGES[row["os"]], name
    text = RELEASE.read_text(encoding="utf-8").lower()
    for needle in ("msvc-dev-cmd", "ilammy", "vcvars", "vsdevcmd", "vsdevshell", "developer command prompt"):
        assert needle not in text, f"release.yml mentions {needle!r}: the workflow must not set MSVC up itself"
    for s in release_steps():
        assert "msvc" not in str(s.get("uses", "")).lower(), s["uses"]


# The _MSC_VER of the default toolset of the Windows images GitHub hosts (runner-images' readme of each, "Visual
# Studio Enterprise 2022 17.14" -> MSVC 14.44, cl 19.44). windows-latest moves: a leg names a pinned image.
WINDOWS_IMAGES = {"windows-2022": 1944, "windows-2025": 1944}


def msvc_range(spec: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A recipe's msvc_version "[17.0,18.0)": the Visual Studio versions [low, high)."""
    m = re.fullmatch(r"\[\s*([\d.]+)\s*,\s*([\d.]+)\s*\)", spec)
    assert m, spec
    return tuple(map(int, m.group(1).split("."))), tuple(map(int, m.group(2).split(".")))


def test_each_windows_image_has_an_msvc_the_recipes_cuda_accepts() -> None:
    """The image is chosen from what the toolkit accepts: its toolset's _MSC_VER lies in the range the recipe's
    CUDA release takes (data/msvc.json, from its crt/host_config.h) and its Visual Studio in the recipe's
    msvc_version. A leg moved to an image with Visual Studio 2026 (MSVC 19.50) fails here for CUDA 12.8."""
    from llamabundle import data

    host = data.load("msvc.json")["cuda_host_msc_ver"]

    def accepted(toolkit: str) -> tuple[int, int]:
        major_minor = ".".join(toolkit.split(".")[:2])
        lower = [v for v in host if tuple(map(int, v.split("."))) <= tuple(map(int, major_minor.split(".")))]
        low, high = host[max(lower, key=lambda v: tuple(map(int, v.split("."))))]
        return int(low), int(high)

    checked = 0
    for row in release_matrix():
        recipe = recipe_of(row)
        if not is_native_windows(recipe):
            continue
        assert row["os"] in WINDOWS_IMAGES, f"{row['recipe']}: {row['os']} is not a pinned image of known MSVC"
        msc = WINDOWS_IMAGES[row["os"]]
        assert row["msc-ver"] == msc, row["recipe"]
        low_vs, high_vs = msvc_range(recipe["toolchain"]["msvc_version"])
        vs = (17, msc - 1930) if 1930 <= msc < 1950 else (18, msc - 1950)  # 19.3x/19.4x: VS 2022 17.x; 19.5x: 2026
        assert low_vs <= vs < high_vs, f"{row['recipe']}: {row['os']}'s Visual Studio {vs} is outside {recipe['toolchain']['msvc_version']}"
        if "cuda" in recipe["backends"]:
            low, high = accepted(str(recipe["cuda"]["toolkit"]))
            assert low <= msc < high, f"{row['recipe']}: CUDA {recipe['cuda']['toolkit']} accepts _MSC_VER [{low}, {high}), {row['os']} has {msc}"
            checked += 1
    assert checked == 1
    # and the check can fail: an image of Visual Studio 2026 is outside CUDA 12.8's range
    low, high = accepted("12.8.1")
    assert not low <= 1950 < high


def test_the_mingw_leg_runs_in_debian_12() -> None:
    """Debian 12's mingw-w64 gcc (12) is the one the recipe pins; Ubuntu 22.04's gcc 10 could not even build the
    alderlake CPU variant (-mavxvnni needs gcc 11+)."""
    mingw = [row for row in release_matrix() if recipe_of(row)["toolchain"]["compiler"] == "mingw"]
    assert [row["recipe"] for row in mingw] == ["windows-x86_64-cpu-mingw"]
    assert (mingw[0]["os"], mingw[0]["container"]) == ("ubuntu-24.04", DEBIAN)
    text = LEGS.read_text(encoding="utf-8")
    assert "-mavxvnni" in text and "gcc 11" in text  # the comment that says why
    install = step_running(release_steps(), "g++-mingw-w64-x86-64-posix")
    assert "apt-get install" in install["run"] and "sudo" not in install["run"]  # root in the container
    assert condition(install) == "matrix.container != ''"


def test_ccache_is_large_enough_for_each_leg() -> None:
    """ccache's default of 500 MB does not hold ggml-cuda: each leg sets CCACHE_MAXSIZE, CUDA legs at least 1.5G
    (ccache counts its compressed size)."""
    assert release_job()["env"]["CCACHE_MAXSIZE"] == "${{ matrix.ccache-maxsize }}"
    for row in release_matrix():
        size = size_bytes(str(row["ccache-maxsize"]))
        wanted = 1.5e9 if "cuda" in recipe_of(row)["backends"] else 5e8
        assert size >= wanted, f"{row['recipe']}: CCACHE_MAXSIZE {row['ccache-maxsize']} is under {wanted:.0e} bytes"


def toolkit_bytes(recipe_name: str) -> int:
    """The size of the archives a CUDA recipe's toolkit is installed from (its pinned manifest's figures)."""
    from llamabundle.backends.cuda.toolkit import resolve

    recipe = keys.load(ROOT / "recipes" / f"{recipe_name}.yaml")
    assert recipe.cuda is not None
    plan = resolve.plan_source(recipe.cuda.source, version=recipe.cuda.toolkit, platform=recipe.platform,
                               components=recipe.cuda.components)
    items: Any = getattr(plan, "wheels", None) or getattr(plan, "archives", None)
    assert items, plan
    return sum(getattr(a, "archive", a).size for a in items)


def test_the_caches_fit_githubs_10_gb_with_a_budget_per_leg() -> None:
    """GitHub keeps 10 GB of caches per repository and evicts the least recently used beyond. Each leg's budget
    covers its compiler cache and, where it has CUDA, its extracted toolkit (the archives' size and a fifth
    more; legs with the same toolkit share one entry); the budgets add up to at most 9.5 GB, so a run's newest
    caches all fit and only older runs' entries are evicted. The comment table beside the matrix says the same."""
    budget, toolkits = 0.0, {}
    for row in release_matrix():
        own = size_bytes(str(row["cache-budget"]))
        budget += own
        need = size_bytes(str(row["ccache-maxsize"]))
        if "cuda-manifest" in row:
            entry = (row["cuda-manifest"], toolkit_bytes(row["recipe"]))
            if entry not in toolkits:  # the first leg with this toolkit budgets it
                toolkits[entry] = row["recipe"]
                need += 1.2 * entry[1]
        assert need <= own, f"{row['recipe']}: its caches take {need / 1e9:.2f} GB, over its budget {row['cache-budget']}"
    assert budget <= 9.5e9, f"the legs' budgets add up to {budget / 1e9:.2f} GB"
    text = LEGS.read_text(encoding="utf-8")
    assert re.search(r"#\s+all\s+9\.5G", text) and "10 GB" in text  # the table beside the legs


def test_cuda_legs_cache_the_extracted_toolkit_keyed_by_the_manifest() -> None:
    """The extracted CUDA toolkit (<LLAMABUNDLE_CACHE_DIR>/toolkits/<root>) is kept across runs, only for recipes
    with CUDA, keyed by the sha256 of the manifest that pins its archives and by those archives' sha256s (the
    plan of the recipe's components: two recipes with the same components share it)."""
    from llamabundle.backends.cuda.toolkit.layout import toolkit_root

    root = Path("cache-root")
    assert toolkit_root(root, version="1", platform="p", source="pypi", components=["a"], pin="0").parent == root / "toolkits"
    for row in release_matrix():
        recipe = recipe_of(row)
        if "cuda" not in recipe["backends"]:
            assert "cuda-manifest" not in row, row["recipe"]
            continue
        cuda = recipe["cuda"]
        source = cuda.get("source", "redist")
        manifest = {"redist": f"llamabundle/data/cuda/redistrib_{cuda['toolkit']}.json",
                    "pypi": "llamabundle/data/cuda_pypi.json"}[source]
        assert row.get("cuda-manifest") == manifest, f"{row['recipe']} (cuda.source: {source})"
        assert (ROOT / manifest).is_file()

    steps = release_steps()
    plan = step_running(steps, "llamabundle toolkit plan")
    assert plan.get("id") == "toolkit" and 'echo "archives=' in plan["run"] and '"sha256"' in plan["run"]
    [toolkit_cache] = [s for s in uses_steps(steps, "actions/cache") if s["with"]["path"] == f"{CACHE_DIR}/toolkits"]
    for s in (plan, toolkit_cache):
        assert condition(s) == "matrix.cuda-manifest != ''"
    assert toolkit_cache["with"]["key"] == ("cuda-toolkit-${{ runner.os }}-${{ hashFiles(matrix.cuda-manifest) }}-"
                                            "${{ steps.toolkit.outputs.archives }}")
    assert steps.index(plan) < steps.index(toolkit_cache) < steps.index(step_running(steps, "llamabundle build"))


def test_the_build_log_is_uploaded_when_the_build_fails() -> None:
    from llamabundle import build, cache

    # where llamabundle writes the log: <cache>/build/<one directory>/llamabundle-build.log
    root = Path("cache-root")
    tree = cache.build_dir(root, keys.resolve(keys.load(ROOT / "recipes" / "linux-x86_64-cpu.yaml")).key,
                           build.BuildTools(cmake="cmake", ninja="ninja").ids)
    assert tree.parent == root / "build"

    steps = release_steps()
    [upload] = [s for s in uses_steps(steps, "actions/upload-artifact") if s.get("name") == "upload the build log"]
    assert condition(upload) == ON_BUILD_FAILURE
    assert steps.index(upload) > steps.index(step_running(steps, "llamabundle build"))
    paths = [p.strip() for p in str(upload["with"]["path"]).splitlines()]
    assert f"{CACHE_DIR}/build/*/{build.LOG_NAME}" in paths
    assert "matrix.recipe" in upload["with"]["name"]  # one artifact per leg: names must not collide


def test_ci_runs_the_ci_script() -> None:
    wf = load(WORKFLOWS / "ci.yml")
    assert set(wf["on"]) == {"push", "pull_request"}
    job = wf["jobs"]["tests"]
    # in the Debian 12 the recipes pin (g++, glslc): the e2e tests' real builds run with the pinned tools
    assert job["runs-on"] == "ubuntu-24.04" and job["container"] == DEBIAN and job["timeout-minutes"] == 90
    assert job["steps"][-1]["run"] == "bash .ci/run"
    # no cache of llamabundle's trees: .ci/run starts from empty caches
    assert not [s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/cache@")]


def test_the_arm_leg_installs_its_cross_toolchain_and_qemu() -> None:
    """The linux-aarch64 recipe is cross-built in Debian 12 (its toolchain.build_host) with clang 19 and the aarch64
    sysroot, and its build verifies it under qemu-aarch64: the leg's Debian step installs all three for it."""
    [row] = [r for r in release_matrix() if recipe_of(r)["platform"] == "linux-aarch64"]
    assert row["container"] == DEBIAN and recipe_of(row)["toolchain"]["build_host"] == "linux-x86_64"
    run = step_running(release_steps(), "g++-aarch64-linux-gnu")["run"]
    line = next(ln for ln in run.splitlines() if "g++-aarch64-linux-gnu" in ln)
    assert {"clang-19", "qemu-user"} <= set(line.split()) and "platform: linux-aarch64" in run
