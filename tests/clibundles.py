"""The shipped Linux CPU and Windows CUDA recipes, and a bundle of the Linux one made without a build: its
inputs are the recipe's (so its key is the one `llamabundle key` prints), its llama-server a shell script
that answers the load check like the real one. For the CLI tests, which run it through real stores."""

from __future__ import annotations

import json
from pathlib import Path

from llamabundle import bundle, keys
from tests import bundles as test_bundles

ROOT = Path(__file__).resolve().parents[1]
LINUX = ROOT / "recipes" / "linux-x86_64-cpu.yaml"
WINDOWS = ROOT / "recipes" / "windows-x86_64-cuda12.8.yaml"
LINUX_KEY = keys.resolve(keys.load(LINUX)).key
# llama-server is a shell script (not an ELF, so the static check passes) that answers the load check
# like the real one: a CPU backend loaded from inside the bundle, then the device list.
SERVER = b"""#!/bin/sh
echo "load_backend: loaded CPU backend from $(dirname "$0")/libggml-cpu.so" >&2
echo "Available devices:"
exit 0
"""
FILES = {"llama-server": SERVER, "LICENSE": b"MIT License\n"}
ROLES = {"llama-server": "exe", "LICENSE": "license"}


def make_bundle_dir(tmp: Path, key: str = LINUX_KEY) -> tuple[Path, dict]:
    """A bundle of the shipped Linux recipe (its inputs, so its key is the recipe's); another `key` gives a
    manifest that names that key over the recipe's inputs (a re-keyed bundle)."""
    stage = tmp / "stage"
    manifest = test_bundles.write_bundle(stage, FILES, ROLES, name="linux-x86_64-cpu",
                                         inputs=test_bundles.inputs_of(keys.load(LINUX)), executables=("llama-server",))
    if key != manifest["key"]:
        manifest["key"] = key
        (stage / bundle.MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return stage, manifest


def make_bundle_zip(tmp: Path, key: str = LINUX_KEY) -> Path:
    stage, _ = make_bundle_dir(tmp, key)
    return bundle.pack(stage, tmp / "linux-x86_64-cpu.zip", source_date_epoch=0)
