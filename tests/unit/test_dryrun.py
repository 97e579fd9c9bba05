"""llama.cpp's dry run as `plan` asks it: the table llamabundle-memory prints, the flags it is given, the
bundle it is found in, and the plan's walk over the rungs with it. Hermetic: the bundle's llamabundle-memory
here is a small script that prints a table from the flags it is given (the real program is run against
llama-server on lavapipe by tests/e2e/test_vulkan_bundle.py, and on the H200 by bench/gpu/dryrun_h200.sh)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from llamabundle.data import MEMORY_PROGRAM as PROGRAM
from llamabundle.errors import UsageError
from llamabundle.runtime.dryrun import (
    DeviceMemory,
    DryRun,
    Launch,
    find_dry_run,
    open_dry_run,
    parse_fit_print,
    passthrough_args,
)
from llamabundle.runtime.gguf_model import MiB, read_model
from llamabundle.runtime.offload import LLAMA_CPP, plan_for_app, plan_offload
from llamabundle.runtime.server_args import parse_server_args
from tests.bundles import write_bundle
from tests.clicontract import valid
from tests.clirun import run
from tests.ggufs import write

# What the pinned llamabundle-memory printed on lavapipe (m8.gguf, -ngl 4 -c 4096): common_fit_print's table.
REAL_TABLE = "Vulkan0 73 48 30 \nHost 716 80 10 \n"

# A stand-in for llamabundle-memory: model = 100 MiB per -ngl, KV = 1 MiB per 1024 cells per -ngl, compute
# 64 MiB; every argv is appended to calls.log. FAKE_MODE: hostonly (no GPU line), fail (exit 3), garbage.
FAKE = textwrap.dedent("""\
    #!{python}
    import os, sys
    from pathlib import Path
    argv = sys.argv[1:]
    with open(Path(__file__).with_name("calls.log"), "a") as f:
        f.write(" ".join(argv) + "\\n")
    mode = os.environ.get("FAKE_MODE", "")
    if mode == "fail":
        print("llama_model_load: error loading model: tensor data is not within the file bounds", file=sys.stderr)
        sys.exit(3)
    if mode == "garbage":
        print("ggml_cuda_init: found 1 CUDA devices")
        sys.exit(0)
    ngl, ctx = int(argv[argv.index("-ngl") + 1]), int(argv[argv.index("-c") + 1])
    if mode != "hostonly":
        print(f"Vulkan0 {{100 * ngl}} {{ctx // 1024 * ngl}} 64 ")
    print("Host 900 0 12 ")
""")


def fake_bundle(root: Path, *, platform: str = "linux-x86_64", program: bool = True) -> Path:
    files = {PROGRAM: FAKE.format(python=sys.executable).encode()} if program else {}
    write_bundle(root, {**files, "llama-server": b"#!/bin/sh\n"}, {PROGRAM: "exe", "llama-server": "exe"} if program
                 else {"llama-server": "exe"}, executables=(*files, "llama-server"), backends=["cpu", "vulkan"],
                 inputs={"recipe": "t", "platform": platform, "commit": "0" * 40, "cuda": None})
    return root


def calls(bundle: Path) -> list[str]:
    log = bundle / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(write(tmp_path_factory.mktemp("gguf") / "m.gguf", n_layer=8))


# ----------------------------------------------------------------------------------------- the table


def test_the_table_of_the_real_program_is_read_in_bytes() -> None:
    rows = parse_fit_print(REAL_TABLE)
    assert rows == [DeviceMemory(device="Vulkan0", model=73 * MiB, context=48 * MiB, compute=30 * MiB),
                    DeviceMemory(device="Host", model=716 * MiB, context=80 * MiB, compute=10 * MiB)]
    assert rows[0].total == 151 * MiB


@pytest.mark.parametrize(("text", "says"), [
    ("", "no final Host line"),
    ("Vulkan0 73 48 30\n", "no final Host line"),
    ("ggml_cuda_init: found 1 CUDA devices\nHost 1 2 3\n", "not 'DEVICE MODEL CONTEXT COMPUTE'"),
    ("CUDA0 -1 2 3\nHost 1 2 3\n", "not 'DEVICE MODEL CONTEXT COMPUTE'"),
])
def test_anything_else_is_refused_saying_what_it_printed(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_fit_print(text)


def test_the_launch_is_given_as_llama_server_flags() -> None:
    assert Launch(ngl=5, ctx=8192).args() == ["-ngl", "5", "-c", "8192", "-np", "1", "-no-kvu", "-ctk", "f16", "-ctv",
                                              "f16", "-fa", "on"]
    args = Launch(ngl=0, ctx=4096, n_parallel=4, kv_unified=True, n_cpu_moe=3, kv_type="q8_0", kv_type_v="q4_0",
                  flash_attn=False, n_ubatch=256, n_batch=1024, op_offload=False).args()
    assert args == ["-ngl", "0", "-c", "4096", "-np", "4", "-kvu", "-ctk", "q8_0", "-ctv", "q4_0", "-fa", "off",
                    "--n-cpu-moe", "3", "-b", "1024", "-ub", "256", "--no-op-offload"]


def test_the_apps_placement_flags_are_passed_with_their_values() -> None:
    argv = ["--port", "8080", "-ot", "blk\\.1\\.ffn.*=CPU", "-dev", "CUDA0", "--jinja", "-ts", "3,1", "-ngl", "99"]
    assert passthrough_args(argv) == ["-ot", "blk\\.1\\.ffn.*=CPU", "-dev", "CUDA0", "-ts", "3,1"]


# ------------------------------------------------------------------------------------------ the bundle


def test_a_bundle_for_another_platform_or_without_the_program_says_why(tmp_path: Path) -> None:
    win = open_dry_run(fake_bundle(tmp_path / "w", platform="windows-x86_64"), host="linux-x86_64")
    assert isinstance(win, str) and "is for windows-x86_64, and this machine is linux-x86_64" in win
    old = open_dry_run(fake_bundle(tmp_path / "o", program=False))
    assert isinstance(old, str) and f"has no {PROGRAM}" in old and "rebuild or reinstall it" in old
    got, why = find_dry_run(None, root=tmp_path / "nothing-installed")
    assert got is None and why is not None and "no GPU bundle for this machine is installed" in why


def test_the_dry_run_keeps_the_callers_device_selection_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GGML_VK_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("LD_LIBRARY_PATH", "/elsewhere")
    dry = open_dry_run(fake_bundle(tmp_path / "b"))
    assert isinstance(dry, DryRun)
    assert dry.env["GGML_VK_VISIBLE_DEVICES"] == "0" and "LD_LIBRARY_PATH" not in dry.env


def test_a_failing_or_garbled_dry_run_is_a_usage_error_with_its_last_lines(tmp_path: Path, model: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    dry = open_dry_run(fake_bundle(tmp_path / "b"))
    assert isinstance(dry, DryRun)
    monkeypatch.setitem(dry.env, "FAKE_MODE", "fail")
    with pytest.raises(UsageError) as e:
        dry.measure(model, Launch(ngl=1, ctx=4096))
    assert "it exited with 3" in e.value.why and "tensor data is not within the file bounds" in e.value.why
    monkeypatch.setitem(dry.env, "FAKE_MODE", "garbage")
    with pytest.raises(UsageError) as e:
        dry.measure(model, Launch(ngl=1, ctx=4096))
    assert "ggml_cuda_init" in e.value.why


# ---------------------------------------------------------------------------------------- the plan


def test_the_plan_bisects_the_rungs_with_llama_cpps_figures(tmp_path: Path, model: Path) -> None:
    """The stand-in's figures differ from the closed form (100 MiB a rung): the plan takes the rung that fits by
    them, in a few dry runs, and reports them."""
    bundle = fake_bundle(tmp_path / "b")
    dry = open_dry_run(bundle)
    assert isinstance(dry, DryRun)
    info = read_model(model)
    free = 1000 * MiB  # headroom 5% + 256 MiB = 306 MiB: 694 MiB for the GPU; -ngl k needs 100k + 4k + 64 MiB
    plan = plan_offload(info, free_vram=free, ctx=4096, min_ctx=4096, dry_run=dry)
    assert plan.ngl == 6 and plan.estimate_by == LLAMA_CPP
    assert (plan.estimate.weights, plan.estimate.kv, plan.estimate.compute) == (600 * MiB, 24 * MiB, 64 * MiB)
    assert plan.reasons[0].startswith("-ngl 6: one step more (-ngl 7) would need")
    assert plan.dry_run is not None and plan.dry_run["runs"] == len(calls(bundle)) <= 5 and plan.dry_run["device"] == "Vulkan0"
    assert all(c.startswith(f"-m {model} -ngl ") and " -c 4096 -np 1 -no-kvu " in c for c in calls(bundle))
    closed = plan_offload(info, free_vram=free, ctx=4096, min_ctx=4096)
    assert closed.ngl == 9 and closed.estimate_by == "closed form" and closed.dry_run is None  # the tiny model fits whole


def test_with_no_gpu_listed_the_plan_keeps_the_closed_form_and_says_so(tmp_path: Path, model: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    dry = open_dry_run(fake_bundle(tmp_path / "b"))
    assert isinstance(dry, DryRun)
    monkeypatch.setitem(dry.env, "FAKE_MODE", "hostonly")
    info = read_model(model)
    plan = plan_offload(info, free_vram=1000 * MiB, ctx=4096, dry_run=dry)
    closed = plan_offload(info, free_vram=1000 * MiB, ctx=4096)
    assert (plan.ngl, plan.estimate) == (closed.ngl, closed.estimate) and plan.estimate_by == "closed form"
    assert any("lists no GPU device here" in w for w in plan.warnings)


def test_an_apps_placement_flags_reach_the_dry_run_and_leave_the_unmodelled_warning_out(tmp_path: Path,
                                                                                        model: Path) -> None:
    bundle = fake_bundle(tmp_path / "b")
    app = parse_server_args("-c 4096 -np 2 -ot blk\\.0\\.ffn.*=CPU --port 8080")
    dry = open_dry_run(bundle, extra=passthrough_args(app.argv))
    assert isinstance(dry, DryRun)
    plan = plan_for_app(read_model(model), app, free_vram=1000 * MiB, dry_run=dry)
    assert plan.estimate_by == LLAMA_CPP and not any("not part of this estimate" in w for w in plan.warnings)
    assert app.argv[app.argv.index("-ot") + 1] == "blk.0.ffn.*=CPU"  # as a shell splits the app's string
    assert all(c.endswith(" -ot blk.0.ffn.*=CPU") and " -np 2 -no-kvu " in c for c in calls(bundle))
    closed = plan_for_app(read_model(model), app, free_vram=1000 * MiB)
    assert any("-ot: passed to llama-server as given, but not part of this estimate" in w for w in closed.warnings)


# ------------------------------------------------------------------------------------------------ CLI


def test_cli_plan_with_a_bundle_prints_the_dry_runs_and_valid_json(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                                  model: Path) -> None:
    bundle = fake_bundle(tmp_path / "b")
    code, out, err = run(capsys, "plan", model, "--bundle", bundle, "--free-vram", "1000MiB", "--ctx", "4096")
    assert code == 0, err
    assert "sized by  llama.cpp dry run (" in out and "-ngl 6" in out
    assert f"sizing the rungs with llama.cpp's dry run: {bundle.resolve() / PROGRAM}" in err
    assert "    dry run -ngl 6 -c 4096: Vulkan0: model 600, KV 24, compute 64 MiB" in err
    code, out, _ = run(capsys, "plan", model, "--bundle", bundle, "--free-vram", "1000MiB", "--ctx", "4096", "--json")
    data = json.loads(out)
    assert code == 0 and valid("plan", data)
    assert data["estimate_by"] == LLAMA_CPP and data["dry_run"]["device"] == "Vulkan0" and data["dry_run_skipped"] is None
    assert data["bytes"]["weights"] == 600 * MiB and data["ngl"] == 6


def test_cli_plan_says_why_no_dry_run_was_used(capsys: pytest.CaptureFixture[str], tmp_path: Path, model: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMABUNDLE_DATA_DIR", str(tmp_path / "data"))
    code, out, _ = run(capsys, "plan", model, "--free-vram", "1000MiB", "--json")
    data = json.loads(out)
    assert code == 0 and valid("plan", data) and data["estimate_by"] == "closed form"
    assert data["dry_run"] is None and "no GPU bundle for this machine is installed" in data["dry_run_skipped"]
    code, out, _ = run(capsys, "plan", model, "--free-vram", "1000MiB", "--closed-form")
    assert code == 0 and "sized by  closed form: --closed-form" in out
    code, _, err = run(capsys, "plan", model, "--free-vram", "1000MiB", "--closed-form", "--bundle", fake_bundle(tmp_path / "b"))
    assert code == 2 and "--bundle and --closed-form cannot be combined" in err


def test_the_python_api_plans_with_a_bundle_and_says_when_it_cannot(tmp_path: Path, model: Path) -> None:
    from llamabundle import api

    got = api.plan_offload(model, free_vram="1000MiB", ctx=4096, min_ctx=4096, bundle=fake_bundle(tmp_path / "b"))
    assert (got.ngl, got.estimate_by, got.gpu_bytes["weights"]) == (6, LLAMA_CPP, 600 * MiB)
    old = api.plan_offload(model, free_vram="1000MiB", ctx=4096, min_ctx=4096,
                           bundle=fake_bundle(tmp_path / "o", program=False))
    assert old.estimate_by == "closed form" and any(f"has no {PROGRAM}" in w for w in old.warnings)
