"""Knowledge as data: JSON files beside this module, loaded once into plain values with invariant checks."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

MEMORY_PROGRAM = "llamabundle-memory"  # programs/llamabundle-memory.cpp: built into every bundle (build.py)
PROBE_PROGRAM = "llamabundle-probe"  # programs/llamabundle-probe.cpp: built into every bundle (build.py)
# Every JSON schema the tool ships lies in schemas/ (in the repository and in the installed package), one file
# schemas/NAME.schema.json with the $id urn:llamabundle:schema:NAME: bundle, recipe, index-site (index.json),
# llamabundle-probe, and cli-COMMAND for each command's --json output (cli-error for a failure).
SCHEMA_DRAFT = "https://json-schema.org/draft/2020-12/schema"


def schema_id(name: str) -> str:
    """The $id of the shipped schema schemas/NAME.schema.json."""
    return f"urn:llamabundle:schema:{name}"


def schema(name: str) -> Any:
    """The shipped schema schemas/NAME.schema.json, parsed once."""
    return load(f"schemas/{name}.schema.json")


@cache
def load(name: str) -> Any:
    """One JSON file of this package, parsed once. The modules that own a file check its invariants."""
    return json.loads(text(name))


@cache
def text(name: str) -> str:
    """One file of this package as text (a JSON file, or a source file the build writes into its tree)."""
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")





@cache
def cuda_toolkits() -> dict[str, Any]:
    toolkits: dict[str, Any] = load("cuda.json")["toolkits"]
    for version, info in toolkits.items():
        assert set(info) >= {"manifest", "archs", "driver_floor"}, version
        assert set(info["driver_floor"]) == {"linux", "windows"}, version
    return toolkits


@cache
def cuda_manifest(version: str) -> dict[str, Any]:
    manifest: dict[str, Any] = load("cuda/" + cuda_toolkits()[version]["manifest"])
    assert manifest.get("release_label") == version, f"manifest for {version} is labelled {manifest.get('release_label')}"
    return {k: v for k, v in manifest.items() if isinstance(v, dict)}


@cache
def build_knowledge() -> dict[str, Any]:
    info: dict[str, Any] = load("build.json")
    assert "x64" in info["cpu_variants"]["x86_64"]
    return info


@cache
def elf_policy() -> dict[str, Any]:
    policy: dict[str, Any] = load("elf_policy.json")
    overlap = set(policy["system"]) & set(policy["driver"])
    assert not overlap, f"libraries both system and driver: {overlap}"
    return policy


@cache
def cuda_runtime() -> dict[str, Any]:
    info: dict[str, Any] = load("cuda_runtime.json")
    assert not any(k.startswith(("libcuda.so", "nvcuda")) for k in info["components"]), "driver libraries are never bundled"
    return info


@cache
def llama_builds() -> dict[str, int]:
    """commit -> llama.cpp build number (the b<N> of the release tags)."""
    builds = {c: int(v["build"]) for c, v in load("llama_builds.json")["commits"].items()}
    assert all(len(c) == 40 and n > 0 for c, n in builds.items())
    return builds
