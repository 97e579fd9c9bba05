"""Small bundles for tests whose manifests hold what a real one does: `inputs` whose sha256 is the key.

`inputs_for(tag)` gives distinct inputs (and so a distinct key) per tag; `inputs_of(recipe)` those of a
real recipe, so that a test bundle has the key `llamabundle key RECIPE` prints."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from llamabundle import bundle, keys
from llamabundle.digest import canonical_json
from llamabundle.recipe import Recipe

COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"


def inputs_for(tag: str = "test", *, platform: str = "linux-x86_64", commit: str = COMMIT,
               cuda: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"recipe": f"test-{tag}", "platform": platform, "commit": commit, "cuda": cuda}


def inputs_of(recipe: Recipe) -> dict[str, Any]:
    return keys.resolve(recipe).inputs


def key_of(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(inputs).encode()).hexdigest()


def key_for(tag: str = "test", **kw: Any) -> str:
    return key_of(inputs_for(tag, **kw))


def write_bundle(stage: Path, files: dict[str, bytes], roles: dict[str, str], *, name: str = "test-bundle",
                 inputs: dict[str, Any] | None = None, executables: tuple[str, ...] = (),
                 **fields: Any) -> dict[str, Any]:
    """Write `files` and a consistent bundle.json into `stage` (created); returns the manifest dict.
    `fields` override or add manifest fields (e.g. backends, cuda) after the consistent ones."""
    inputs = inputs if inputs is not None else inputs_for(name)
    stage.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        (stage / rel).parent.mkdir(parents=True, exist_ok=True)
        (stage / rel).write_bytes(data)
    for rel in executables:
        (stage / rel).chmod(0o755)
    return bundle.write_manifest(stage, {
        "name": name, "key": key_of(inputs), "inputs": inputs, "platform": inputs.get("platform", "linux-x86_64"),
        "llama_cpp": {"commit": inputs.get("commit", COMMIT)},
        "files": bundle.file_entries(stage, roles), **fields,
    }).to_json()


def make_zip(tmp: Path, files: dict[str, bytes], roles: dict[str, str], *, zip_name: str = "bundle.zip",
             **kw: Any) -> tuple[Path, dict[str, Any]]:
    """A bundle zip in tmp (its stage beside it) and its manifest dict."""
    stage = tmp / f"stage-{zip_name}-{len(list(tmp.glob('stage-*')))}"
    manifest = write_bundle(stage, files, roles, **kw)
    zip_path = tmp / zip_name
    bundle.pack(stage, zip_path, source_date_epoch=0)
    return zip_path, manifest
