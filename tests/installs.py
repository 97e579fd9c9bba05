"""Bundles and store entries for the install tests, on top of tests/probing.py's bundles: `rebundle` adds
files or changes manifest fields, `recipe_bundle` makes a CPU bundle of a shipped recipe (its real key),
`plant` writes a store entry by hand, and `slot_entries` lists what an installed name's slot holds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llamabundle import bundle, digest, keys
from llamabundle.bundle.manifest import Manifest
from llamabundle.runtime.install import BUNDLES
from llamabundle.store.local import SUMS
from tests import bundles as tb
from tests.probing import NAME, make_stage


def rebundle(stage: Path, m: Manifest, *, extra: dict[str, bytes] | None = None, **fields: Any) -> Manifest:
    """tests.probing's bundle in `stage` with more files (role runtime) and manifest fields changed, its manifest
    written again (a key given in `fields` must be the sha256 of the inputs, as write_manifest checks nothing)."""
    roles = {f.path: f.role for f in m.files}
    for rel, data in (extra or {}).items():
        (stage / rel).write_bytes(data)
        roles[rel] = "runtime"
    base = {k: v for k, v in m.to_json().items() if k not in ("format", "tool")}
    return bundle.write_manifest(stage, {**base, **fields, "files": bundle.file_entries(stage, roles)})


def recipe_bundle(tmp: Path, recipe_path: Path) -> tuple[Path, Manifest]:
    """A CPU bundle of a shipped recipe: its key is the one `llamabundle key RECIPE` prints."""
    recipe = keys.load(recipe_path)
    stage, m = make_stage(tmp, name=recipe.name, backends=("cpu",), commit=recipe.llama_cpp.commit)
    m = rebundle(stage, m, key=keys.resolve(recipe).key, inputs=tb.inputs_of(recipe))
    return bundle.pack(stage, tmp / f"{recipe.name}.zip", source_date_epoch=0), m


def plant(store_root: Path, key: str, zip_path: Path, manifest: bytes | str) -> Path:
    """A store entry written by hand, as a tampering hand or another tool would: anything under any key."""
    d = store_root / key
    d.mkdir(parents=True, exist_ok=True)
    (d / zip_path.name).write_bytes(zip_path.read_bytes())
    (d / SUMS).write_text(f"{digest.sha256_file(zip_path)}  {zip_path.name}\n", encoding="utf-8")
    (d / bundle.MANIFEST).write_bytes(manifest.encode() if isinstance(manifest, str) else manifest)
    return d


def slot_entries(root: Path, name: str = NAME) -> list[str]:
    return sorted(p.name for p in (root / BUNDLES / name).iterdir())
