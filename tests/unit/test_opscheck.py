"""verify's ops level without a GPU: test-backend-ops' console output read case by case, and the runner
driven by a stand-in test-backend-ops (a shell program that answers like the real one, per op), including
a budget that runs out and a failing case that fails the level with its name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llamabundle import opscheck
from llamabundle.errors import UsageError

REAL = """Testing 2 devices

Backend 1/2: Vulkan0
  Device description: llvmpipe (LLVM 15.0.6, 256 bits)
  ADD(type=f16,ne=[1,1,8,1],nr=[1,1,1,1],nf=1,perm1=0,src_overlap=0): \x1b[1;32mOK\x1b[0m
  ADD_ADD(type=f16,ne=[10,5,4,3]): [ADD_ADD] NMSE = 0.000000106 > 0.000000100 \x1b[1;31mFAIL\x1b[0m
  MUL_MAT(type_a=iq2_xxs,type_b=f32,m=16,n=1,k=256): not supported [Vulkan0]
  SOFT_MAX(type=f32,ne=[16,2,32,1],mask=1): \x1b[1;32mOK\x1b[0m
  2/3 tests passed
  Backend Vulkan0: \x1b[1;31mFAIL\x1b[0m
"""


def test_console_lines_are_counted_as_the_tool_prints_them() -> None:
    r = opscheck.DeviceOps(device="Vulkan0")
    opscheck.read_cases(REAL, r)
    assert (r.passed, r.failed, r.not_supported) == (2, 1, 1)
    assert r.failures == ["ADD_ADD(type=f16,ne=[10,5,4,3]): [ADD_ADD] NMSE = 0.000000106 > 0.000000100"]


def stand_in(tmp: Path, body: str) -> Path:
    tool = tmp / "tools" / "test-backend-ops"
    tool.parent.mkdir(parents=True, exist_ok=True)
    tool.write_text("#!/bin/sh\n" + body)
    tool.chmod(0o755)
    return tool


def test_each_op_runs_from_inside_the_bundle_and_the_tool_is_removed(tmp_path: Path) -> None:
    root = tmp_path / "bundle"
    root.mkdir()
    tool = stand_in(tmp_path, 'd=$(dirname "$0"); echo "  $5(x=1): OK"; echo "  $5(x=2): OK"; echo "ran from $d" > "$d/../where-$5"\n')
    out = opscheck.run_ops(root, tool, ["Vulkan0"], env={"PATH": "/usr/bin:/bin"}, budget=60, ops=("ROPE", "CPY"))
    assert [(r.device, r.passed, r.failed, r.ops_run) for r in out] == [("Vulkan0", 4, 0, ["ROPE", "CPY"])]
    assert (tmp_path / "where-ROPE").read_text().strip() == f"ran from {root}"
    assert not (root / "test-backend-ops").exists()


def test_the_budget_stops_a_slow_op_and_keeps_what_it_did(tmp_path: Path) -> None:
    root = tmp_path / "bundle"
    root.mkdir()
    sleep = os.popen("command -v sleep").read().strip()
    tool = stand_in(tmp_path, f'echo "  $5(x=1): OK"; [ "$5" = "MUL_MAT" ] && exec {sleep} 30\nexit 0\n')
    out = opscheck.run_ops(root, tool, ["CUDA0", "Vulkan0"], env={"PATH": "/usr/bin:/bin"}, budget=6,
                           ops=("ADD", "MUL_MAT", "ROPE"))
    assert [r.device for r in out] == ["CUDA0", "Vulkan0"]  # a result per device: the loop below checks both
    for r in out:  # MUL_MAT had its share of the device's 3 s and was stopped; ROPE still ran
        assert r.ops_run == ["ADD", "MUL_MAT (partly)", "ROPE"] and r.ops_left == [], r
        assert r.passed == 3 and r.seconds < 10


def test_ops_not_reached_are_named(tmp_path: Path) -> None:
    root = tmp_path / "bundle"
    root.mkdir()
    sleep = os.popen("command -v sleep").read().strip()
    tool = stand_in(tmp_path, f'echo "  $5(x=1): OK"; exec {sleep} 0.8\n')
    (r,) = opscheck.run_ops(root, tool, ["Vulkan0"], env={"PATH": "/usr/bin:/bin"}, budget=2.5,
                            ops=("ADD", "MUL", "ROPE", "CPY"))
    # each op's share (about 0.6 s) is less than the stand-in's 0.8 s: ADD is stopped, and the budget ends before CPY
    # (before ROPE too on a loaded machine, where starting each run takes longer)
    assert r.ops_run[0] == "ADD (partly)" and r.ops_left[-1:] == ["CPY"], r
    assert [o.removesuffix(" (partly)") for o in r.ops_run] + r.ops_left == ["ADD", "MUL", "ROPE", "CPY"]
    assert f"{len(r.ops_left)} ops not reached in the budget ({', '.join(r.ops_left)})" in r.summary()


def test_a_missing_tool_says_how_to_get_one(tmp_path: Path) -> None:
    with pytest.raises(UsageError) as e:
        opscheck.run_ops(tmp_path, tmp_path / "nope", ["Vulkan0"], env={}, budget=10)
    assert "--ops-tool" in e.value.fix
    assert opscheck.sibling_tool(Path("/o/b-1234.zip")) == Path("/o/b-1234.test-backend-ops")
