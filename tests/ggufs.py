"""Small synthetic GGUF models for the offload, dry-run and plan tests, written by the writer of
bench/offload_compare.py (`bench`, loaded from its file), and NONE: the offload planner's zero headroom."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from llamabundle.runtime.offload import Headroom

ROOT = Path(__file__).resolve().parents[1]

NONE = Headroom(percent=0, fixed=0)


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("offload_compare", ROOT / "bench" / "offload_compare.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _bench()


def write(path: Path, **kw: object) -> Path:
    args: dict[str, object] = {"n_layer": 4, "n_embd": 64, "n_head": 4, "n_head_kv": 2, "n_ff": 128, "n_vocab": 300,
                               "n_ctx_train": 32768}
    return bench.write_synthetic(path, **{**args, **kw})
