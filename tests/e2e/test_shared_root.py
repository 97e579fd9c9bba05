"""One install root, two languages: the CLI and the Node.js consumer (tests/consumer/install.mjs) take the same
slot lock (docs/install-rules.md#the-slot-lock), wait for each other's live holders, break each other's dead ones,
and, installing the same name at once over 20 rounds, lose nothing. Skipped where `node` is absent."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llamabundle import scratch
from llamabundle.bundle import manifest as manifest_mod
from llamabundle.runtime import slotlock
from llamabundle.runtime.install import check_bundle, list_installed
from llamabundle.store.local import LocalStore
from tests import bundles as tb
from tests.e2e.test_node_consumer import CONSUMER, NODE, ROLES

pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed (Debian: apt-get install nodejs)")
NAME = "shared"


def files_for(tag: str) -> dict[str, bytes]:
    """A few MB that take a moment to copy, hash and unpack, different for each tag."""
    rnd = random.Random(tag)
    return {"llama-server": b"#!/bin/sh\nexit 0\n", "libggml-base.so": rnd.randbytes(3 << 20),
            "libggml-cpu.so": rnd.randbytes(2 << 20), "LICENSE": f"MIT {tag}\n".encode(), "empty.txt": b""}


@pytest.fixture(scope="module")
def two_keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A local store holding two bundles of the one name `shared` (two keys)."""
    tmp = tmp_path_factory.mktemp("shared-store")
    store, keys = tmp / "store", []
    for tag in ("a", "b"):
        zip_path, m = tb.make_zip(tmp, files_for(tag), ROLES, name=NAME, inputs=tb.inputs_for(tag),
                                  executables=("llama-server",), backends=["cpu"], zip_name=f"shared-{tag}.zip")
        LocalStore(store).publish(zip_path, manifest_mod.parse(m))
        keys.append(m["key"])
    return store, keys


def node_install(store: Path, key: str, dest: Path) -> subprocess.Popen[str]:
    assert NODE is not None
    return subprocess.Popen([NODE, str(CONSUMER), "--store", str(store), "--key", key, "--dest", str(dest)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)


def cli_install(store: Path, key: str, dest: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "llamabundle", "install", "--store", str(store), "--key", key,
                             "--dest", str(dest)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, env={**os.environ, "LLAMABUNDLE_DATA_DIR": str(dest)})


def finish(p: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=timeout)
    return p.returncode, out, err


def intact(root: Path, keys: list[str], *, broken: str | None = None) -> str:
    """The slot holds one complete, checked install of one of `keys` and nothing else; no lock is left but, when
    `broken` names a dead holder's token, its lock moved aside as .stale-<token>."""
    (inst,) = list_installed(root)
    assert inst.name == NAME and inst.key in keys
    check_bundle(inst.path, key=inst.key, platform="linux-x86_64", commit=tb.COMMIT)
    slot = root / "bundles" / NAME
    assert sorted(p.name for p in slot.iterdir()) == sorted(["current", inst.path.name])
    assert [p.name for p in (root / "bundles" / ".locks").iterdir()] == ([f".stale-{broken}"] if broken else [])
    return inst.key


def test_node_waits_for_the_lock_the_cli_side_holds(two_keys: tuple[Path, list[str]], tmp_path: Path) -> None:
    store, keys = two_keys
    root = tmp_path / "apps"
    with slotlock.holding(root / "bundles" / ".locks", NAME, timeout=10):
        p = node_install(store, keys[0], root)
        time.sleep(1.5)
        assert p.poll() is None  # still waiting
        assert not (root / "bundles" / NAME / "current").exists()
    rc, out, err = finish(p)
    assert rc == 0, err
    assert json.loads(out)["key"] == keys[0] and intact(root, keys) == keys[0]


def test_node_breaks_the_lock_of_a_cli_process_killed_holding_it(two_keys: tuple[Path, list[str]], tmp_path: Path) -> None:
    store, keys = two_keys
    root = tmp_path / "apps"
    code = ("import sys, time\nfrom pathlib import Path\nfrom llamabundle.runtime import slotlock\n"
            "slotlock.take(Path(sys.argv[1]), sys.argv[2], timeout=10)\nprint('held', flush=True)\ntime.sleep(60)\n")
    locks = root / "bundles" / ".locks"
    holder = subprocess.Popen([sys.executable, "-c", code, str(locks), NAME], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    dead = slotlock.read_owner(locks / f"{NAME}.held")
    assert dead is not None and dead.pid == holder.pid
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    t0 = time.monotonic()
    rc, _out, err = finish(node_install(store, keys[1], root))
    assert rc == 0, err
    assert time.monotonic() - t0 < 30
    assert intact(root, keys, broken=dead.token) == keys[1]


def test_the_cli_waits_for_a_live_node_holder_then_breaks_its_lock_once_it_dies(two_keys: tuple[Path, list[str]],
                                                                                  tmp_path: Path) -> None:
    """The lock as a Node process records it (install.mjs's fields, that process's pid and start time): the CLI
    says whom it waits for while the process lives, and installs as soon as it is killed."""
    store, keys = two_keys
    root = tmp_path / "apps"
    assert NODE is not None
    sleeper = subprocess.Popen([NODE, "-e", "setTimeout(() => {}, 60000)"])
    start = scratch.start_time(sleeper.pid)
    assert start
    held = root / "bundles" / ".locks" / f"{NAME}.held"
    held.mkdir(parents=True)
    token = f"{sleeper.pid}-{start}-0a0b0c"
    (held / "owner.json").write_text(json.dumps({"by": "install.mjs", "host": os.uname().nodename, "pid": sleeper.pid,
                                                 "since": "2026-12-04T00:00:00Z", "start": start, "token": token}))
    p = cli_install(store, keys[0], root)
    time.sleep(3)
    assert p.poll() is None  # waiting
    sleeper.kill()
    sleeper.wait()
    rc, _out, err = finish(p)
    assert rc == 0, err
    assert f"waiting for pid {sleeper.pid} (install.mjs), since 2026-12-04T00:00:00Z" in err
    assert intact(root, keys, broken=token) == keys[0]


def test_node_and_the_cli_installing_one_name_at_once_lose_nothing_over_20_rounds(two_keys: tuple[Path, list[str]],
                                                                                  tmp_path: Path) -> None:
    """Each round: two CLI processes and two Node processes install the two keys of one name into one root, the
    Node ones started while the CLI ones are starting up. Every process exits 0; the slot then holds exactly one
    complete, checked install (the last to swap wins) and no stage, version or lock is left."""
    store, keys = two_keys
    root = tmp_path / "apps"
    rnd = random.Random(32)
    won: dict[str, int] = {k: 0 for k in keys}
    waits = dict.fromkeys(["CLI for CLI", "CLI for Node", "Node for CLI", "Node for Node"], 0)
    for i in range(20):
        procs = [cli_install(store, keys[i % 2], root), cli_install(store, keys[(i + 1) % 2], root)]
        time.sleep(rnd.uniform(0.1, 0.6))  # the CLI is importing; Node starts in some 50 ms
        procs += [node_install(store, keys[(i + 1) % 2], root), node_install(store, keys[i % 2], root)]
        results = [finish(p) for p in procs]
        for rc, _out, err in results:
            assert rc == 0, f"round {i}: {err}"
        cli_waited = [err for _rc, _out, err in results[:2] if "waiting for pid" in err]
        node_waited = [json.loads(out)["waited_for"] for _rc, out, _err in results[2:]]
        waits["CLI for CLI"] += sum("(llamabundle " in e for e in cli_waited)
        waits["CLI for Node"] += sum("(install.mjs)" in e for e in cli_waited)
        waits["Node for CLI"] += sum(bool(w) and w.startswith("llamabundle ") for w in node_waited)
        waits["Node for Node"] += sum(bool(w) and w.startswith("install.mjs ") for w in node_waited)
        won[intact(root, keys)] += 1
    assert sum(won.values()) == 20
    assert waits["CLI for Node"] + waits["Node for CLI"] > 0, f"the languages never met at the lock: {waits}"
    print(f"20 rounds: final install {won}; waits {waits}")
