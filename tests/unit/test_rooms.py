"""The rooms keep their shape: every registered platform and backend implements its protocol (members and
signatures), the registries agree with the recipe's Literals, and one module starts processes."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from typing import get_args

import pytest

from llamabundle import backends, keys, platforms, recipe
from llamabundle.backends.base import Backend
from llamabundle.backends.cuda.toolkit import manifest as toolkit_manifest
from llamabundle.build import MEMORY_PROGRAM, PROBE_PROGRAM, BuildTools, plan_build
from llamabundle.bundle import manifest as bundle_manifest
from llamabundle.platforms.base import Platform
from llamabundle.recipe import NO_HOST

PACKAGE = Path(__file__).resolve().parents[2] / "llamabundle"


def members(protocol: type) -> dict[str, object]:
    """The protocol's own members: attributes (annotations) and methods."""
    names = {n for n in vars(protocol) if not n.startswith("_")} | set(protocol.__annotations__)
    return {n: getattr(protocol, n, None) for n in sorted(names)}


def check_implements(obj: object, protocol: type) -> None:
    assert isinstance(obj, protocol), f"{obj!r} lacks members of {protocol.__name__}"
    for name, member in members(protocol).items():
        assert hasattr(obj, name), f"{type(obj).__name__} has no {name}"
        if callable(member):
            want = [p.name for p in inspect.signature(member).parameters.values()][1:]
            got = [p.name for p in inspect.signature(getattr(obj, name)).parameters.values()]
            assert got == want, f"{type(obj).__name__}.{name}{got} differs from {protocol.__name__}.{name}{want}"


@pytest.mark.parametrize("name", platforms.NAMES)
def test_every_platform_implements_the_protocol(name: str) -> None:
    p = platforms.get(name)
    check_implements(p, Platform)
    assert p.name == name and name.startswith(p.system + "-")
    assert p.compilers and set(p.compilers) <= set(get_args(recipe.Compiler))
    assert p.program_file("llama-server") != p.library_file("llama-server")


@pytest.mark.parametrize("name", backends.NAMES)
def test_every_backend_implements_the_protocol(name: str) -> None:
    b = backends.get(name)
    check_implements(b, Backend)
    assert b.name == name and b.loader_name
    assert (b.manifest_key is None) or b.manifest_key == name


def test_the_registries_agree_with_the_recipe_model_and_the_manifest() -> None:
    assert set(platforms.NAMES) == set(get_args(recipe.Platform))
    assert set(backends.NAMES) == set(get_args(recipe.Backend))
    assert bundle_manifest.PLATFORMS == platforms.NAMES
    assert set(toolkit_manifest.PLATFORMS) <= set(platforms.NAMES)
    assert backends.NAMES[0] == "cpu"  # built first; every bundle has it


def test_every_source_kind_of_the_recipe_has_its_module() -> None:
    from llamabundle import source

    assert set(source.KINDS) == set(get_args(recipe.Source))
    for cls, module in source.KINDS.items():
        assert module.KIND is cls and callable(module.fetch) and callable(module.describe)


def test_every_reason_code_is_given_by_probe_or_by_one_of_the_backends() -> None:
    from llamabundle.reasons import Reason
    from llamabundle.runtime.probe import OWN_REASONS

    given = set(OWN_REASONS).union(*(b.reasons for b in backends.REGISTRY.values()))
    assert given == set(Reason)
    for b in backends.REGISTRY.values():
        assert (b.works is not None) == b.gpu and (b.works is None or b.works in b.reasons), b.name
        assert (b.hide_env is not None) == b.gpu, b.name


def test_an_unknown_platform_is_a_usage_error() -> None:
    with pytest.raises(Exception, match="unknown platform 'plan9-mips'") as e:
        platforms.get("plan9-mips")
    assert getattr(e.value, "exit_code", None) == 2


@pytest.mark.parametrize("name", platforms.NAMES)
def test_a_plan_names_files_as_its_platform_does(name: str) -> None:
    p = platforms.get(name)
    compiler = "mingw" if "mingw" in p.compilers else p.compilers[0]
    r = keys.parse(f"""
recipe: 1
name: t-{name}
platform: {name}
llama_cpp:
  commit: 0c1e57098bba43ac29e6e3b677cdceebdd22334f
  sources: [{{github: ggml-org/llama.cpp}}]
backends: [cpu]
toolchain: {{compiler: {compiler}, version: "=12.2.0"}}
cmake: {{GGML_BACKEND_DL: "ON", GGML_CPU_ALL_VARIANTS: "OFF", GGML_NATIVE: "OFF"}}
targets: [llama-server]
publish: {{tag: "{{name}}-{{key12}}"}}
""")
    plan = plan_build(r, NO_HOST, source_dir=Path("/s"), build_dir=Path("/b"), tools=BuildTools(cmake="cmake", ninja="ninja"))
    assert plan.programs == tuple(p.program_file(t) for t in (*r.targets, MEMORY_PROGRAM, PROBE_PROGRAM))
    assert plan.backends == (p.library_file("ggml-cpu"),)
    assert "-DGGML_CUDA=OFF" in plan.configure  # every switched backend is named, on or off


def test_only_proc_starts_processes() -> None:
    """subprocess, os.system/exec*/spawn* and Popen appear in proc.py only (types and the Timeout class aside;
    and the CUDA compiler launcher, a standalone script CMake runs, which replaces itself with nvcc)."""
    offenders = []
    standalone = {PACKAGE / "proc.py", PACKAGE / "backends" / "cuda" / "nvcc_launch.py"}
    for f in sorted(PACKAGE.rglob("*.py")):
        if f in standalone:
            continue
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                base, attr = node.value.id, node.attr
                if (base == "subprocess" and attr not in ("CompletedProcess",)) or \
                        (base == "os" and (attr == "system" or attr.startswith(("exec", "spawn", "popen")))):
                    offenders.append(f"{f.relative_to(PACKAGE)}:{node.lineno} {base}.{attr}")
    assert not offenders, "start processes through llamabundle.proc: " + ", ".join(offenders)


def test_every_module_says_what_its_room_is_for() -> None:
    """A module docstring in every module of the package, and none that points at an issue number (the
    code explains itself; the tracker is history)."""
    missing, pointing = [], []
    for f in sorted(PACKAGE.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(f.read_text(encoding="utf-8")))
        rel = str(f.relative_to(PACKAGE))
        if not doc:
            missing.append(rel)
        elif re.search(r"\bissues?\s*#?\d+", doc, re.IGNORECASE):
            pointing.append(rel)
    assert not missing, "modules without a docstring: " + ", ".join(missing)
    assert not pointing, "docstrings naming issue numbers: " + ", ".join(pointing)
