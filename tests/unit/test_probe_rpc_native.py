"""llamabundle-probe --rpc (data/programs/llamabundle-probe.cpp), the program itself: compiled here against a stand-in
ggml (the few declarations of ggml.h and ggml-backend.h it uses, and a library whose RPC backend "adds" a server by
registering its devices), then run against the stand-in servers of test_rpc_servers.py, which answer every way a
server can. Each server gets the reason `probe --rpc` (runtime/rpc_servers.py) gives it; only the servers that
answered are given to ggml, and their devices are listed. The real program with the real ggml-rpc-server is in
tests/e2e/test_rpc_bundle.py."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from llamabundle import data
from llamabundle.runtime import rpc_servers
from tests.unit.test_rpc_servers import server

CXX = shutil.which("g++") or shutil.which("c++")
pytestmark = pytest.mark.skipif(CXX is None or not sys.platform.startswith("linux"), reason="needs a C++ compiler on Linux")

GGML_H = """#pragma once
#include <stddef.h>
enum ggml_log_level { GGML_LOG_LEVEL_NONE, GGML_LOG_LEVEL_DEBUG, GGML_LOG_LEVEL_INFO, GGML_LOG_LEVEL_WARN,
                      GGML_LOG_LEVEL_ERROR, GGML_LOG_LEVEL_CONT };
typedef void (*ggml_log_callback)(enum ggml_log_level level, const char * text, void * user_data);
extern "C" void ggml_log_set(ggml_log_callback cb, void * user_data);
"""
GGML_BACKEND_H = """#pragma once
#include "ggml.h"
typedef struct fake_reg * ggml_backend_reg_t;
typedef struct fake_dev * ggml_backend_dev_t;
enum ggml_backend_dev_type { GGML_BACKEND_DEVICE_TYPE_CPU, GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_IGPU,
                             GGML_BACKEND_DEVICE_TYPE_ACCEL };
struct ggml_backend_dev_props { const char * name; const char * description; size_t memory_free; size_t memory_total;
                                enum ggml_backend_dev_type type; const char * device_id; };
extern "C" {
ggml_backend_reg_t ggml_backend_load(const char * path);
ggml_backend_reg_t ggml_backend_reg_by_name(const char * name);
const char * ggml_backend_reg_name(ggml_backend_reg_t reg);
size_t ggml_backend_reg_dev_count(ggml_backend_reg_t reg);
ggml_backend_dev_t ggml_backend_reg_dev_get(ggml_backend_reg_t reg, size_t index);
void * ggml_backend_reg_get_proc_address(ggml_backend_reg_t reg, const char * name);
void ggml_backend_register(ggml_backend_reg_t reg);
size_t ggml_backend_dev_count(void);
ggml_backend_dev_t ggml_backend_dev_get(size_t index);
const char * ggml_backend_dev_name(ggml_backend_dev_t dev);
void ggml_backend_dev_get_props(ggml_backend_dev_t dev, struct ggml_backend_dev_props * props);
ggml_backend_reg_t ggml_backend_dev_backend_reg(ggml_backend_dev_t dev);
}
"""
# The registry: the RPC backend is there unless FAKE_NO_RPC is set; ggml_backend_rpc_add_server makes a reg of
# FAKE_DEVICES devices (default 1: what the stand-in servers serve, which ggml would ask again), named RPC0, RPC1, ...
# across servers as ggml names them, and prints what it was given
FAKE_GGML = r"""
#include "ggml-backend.h"
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
struct fake_dev { std::string name, description; ggml_backend_reg_t reg; };
struct fake_reg { std::string name; std::vector<fake_dev *> devs; };
static fake_reg rpc_reg{"RPC", {}};
static std::vector<fake_reg *> regs;
static int added = 0;
static ggml_backend_reg_t add_server(const char * endpoint) {
    std::fprintf(stderr, "add_server %s\n", endpoint);
    auto * r = new fake_reg{std::string("RPC[") + endpoint + "]", {}};
    int n = std::getenv("FAKE_DEVICES") ? std::atoi(std::getenv("FAKE_DEVICES")) : 1;
    for (int i = 0; i < n; i++) r->devs.push_back(new fake_dev{"RPC" + std::to_string(added++), endpoint, r});
    return r;
}
extern "C" {
void ggml_log_set(ggml_log_callback, void *) {}
ggml_backend_reg_t ggml_backend_load(const char *) { return nullptr; }
ggml_backend_reg_t ggml_backend_reg_by_name(const char * name) {
    return std::getenv("FAKE_NO_RPC") || std::string(name) != "RPC" ? nullptr : &rpc_reg;
}
const char * ggml_backend_reg_name(ggml_backend_reg_t reg) { return reg->name.c_str(); }
size_t ggml_backend_reg_dev_count(ggml_backend_reg_t reg) { return reg->devs.size(); }
ggml_backend_dev_t ggml_backend_reg_dev_get(ggml_backend_reg_t reg, size_t i) { return reg->devs[i]; }
void * ggml_backend_reg_get_proc_address(ggml_backend_reg_t reg, const char * name) {
    return reg == &rpc_reg && std::string(name) == "ggml_backend_rpc_add_server" ? (void *) add_server : nullptr;
}
void ggml_backend_register(ggml_backend_reg_t reg) { regs.push_back(reg); }
size_t ggml_backend_dev_count(void) { size_t n = 0; for (auto * r : regs) n += r->devs.size(); return n; }
ggml_backend_dev_t ggml_backend_dev_get(size_t i) {
    for (auto * r : regs) { if (i < r->devs.size()) return r->devs[i]; i -= r->devs.size(); }
    return nullptr;
}
const char * ggml_backend_dev_name(ggml_backend_dev_t dev) { return dev->name.c_str(); }
void ggml_backend_dev_get_props(ggml_backend_dev_t dev, ggml_backend_dev_props * p) {
    p->name = dev->name.c_str(); p->description = dev->description.c_str(); p->memory_free = 1 << 20;
    p->memory_total = 2 << 20; p->type = GGML_BACKEND_DEVICE_TYPE_GPU; p->device_id = nullptr;
}
ggml_backend_reg_t ggml_backend_dev_backend_reg(ggml_backend_dev_t dev) { return dev->reg; }
}
"""


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("probe-rpc")
    (d / "ggml.h").write_text(GGML_H)
    (d / "ggml-backend.h").write_text(GGML_BACKEND_H)
    (d / "ggml.cpp").write_text(FAKE_GGML)
    (d / "llamabundle-probe.cpp").write_text(data.text("programs/llamabundle-probe.cpp"))
    assert CXX is not None
    subprocess.run([CXX, "-std=c++17", "-shared", "-fPIC", "-I", d, "-o", d / "libggml.so", d / "ggml.cpp"], check=True)
    subprocess.run([CXX, "-std=c++17", "-Wall", "-Werror", "-I", d, "-o", d / "llamabundle-probe",
                    d / "llamabundle-probe.cpp", f"-L{d}", "-lggml", "-ldl", "-Wl,-rpath,$ORIGIN"], check=True)
    (d / "modules").mkdir()  # no backend module: the stand-in's registry is what there is
    return d / "llamabundle-probe"


def run(probe: Path, *args: str, **env: str) -> dict[str, Any]:
    res = subprocess.run([str(probe), "--dir", str(probe.parent / "modules"), *args], capture_output=True, text=True,
                         timeout=60, env={"PATH": "/usr/bin:/bin", **env})
    assert res.returncode == 0, res.stderr
    got: dict[str, Any] = json.loads(res.stdout)
    jsonschema.validate(got, data.schema("llamabundle-probe"))
    got["_stderr"] = res.stderr
    return got


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_each_server_gets_the_reason_probe_gives_it_and_only_those_that_answered_reach_ggml(probe: Path) -> None:
    with server("ok", devices=2) as ok, server("ok", version=(8, 0, 0)) as newer_major, \
            server("ok", version=(7, 1, 0)) as newer_minor, server("ok", devices=0) as empty, \
            server("ok", devices=100000) as boastful, server("close") as closes, server("http") as http, \
            server("garbage") as garbage, server("ok", devices=2) as second:
        named = [ok, newer_major, newer_minor, empty, boastful, closes, http, garbage,
                 f"127.0.0.1:{closed_port()}", "no-port", "[::1]:99999", second]
        said = run(probe, "--rpc", ",".join(named), FAKE_DEVICES="2")
    got = [(s["endpoint"], s["reason"]) for s in said["rpc_servers"]]
    assert got == list(zip(named, ["rpc_ok", "rpc_version_mismatch", "rpc_version_mismatch", "rpc_no_devices",
                                   "rpc_not_rpc", "rpc_not_rpc", "rpc_not_rpc", "rpc_not_rpc", "rpc_unreachable",
                                   "rpc_endpoint_invalid", "rpc_endpoint_invalid", "rpc_ok"], strict=True))
    by = {s["endpoint"]: s for s in said["rpc_servers"]}
    assert (by[ok]["version"], by[ok]["devices"], by[ok]["device_names"]) == ("7.0.0", 2, ["RPC0", "RPC1"])
    assert by[second]["device_names"] == ["RPC2", "RPC3"], "named in order, as ggml names them"
    assert by[newer_major]["detail"] == "the server speaks 8.0.0, the bundle 7.0.0"
    assert by[boastful]["detail"] == "it claims 100000 devices" and by[boastful]["devices"] == 0
    assert by[garbage]["detail"] == "no ggml RPC answer to HELLO: an answer of 3 bytes where 28 were expected"
    assert "Connection refused" in by[named[8]]["detail"]
    assert said["_stderr"].splitlines() == [f"add_server {ok}", f"add_server {second}"], "no other server reaches ggml"
    assert [(d["name"], d["backend"], d["description"]) for d in said["devices"]] == \
        [("RPC0", f"RPC[{ok}]", ok), ("RPC1", f"RPC[{ok}]", ok), ("RPC2", f"RPC[{second}]", second),
         ("RPC3", f"RPC[{second}]", second)]


def test_the_reasons_are_those_of_probe_rpc(probe: Path) -> None:
    """The same kinds of server (each stand-in answers one conversation), asked by the program and by Python."""
    answers: list[list[tuple[str, str | None, list[str]]]] = []
    for ask in ("native", "python"):
        with server("ok", devices=1) as ok, server("ok", version=(6, 9, 0)) as old, server("http") as http:
            named = [ok, old, http, f"127.0.0.1:{closed_port()}", "host only"]
            if ask == "native":
                answers.append([(s["reason"], s["version"], s["device_names"])
                                for s in run(probe, "--rpc", ",".join(named))["rpc_servers"]])
            else:
                answers.append([(s.reason.value, s.version, list(s.device_names))
                                for s in rpc_servers.check_all(named, bundle_has_rpc=True)])
    assert answers[0] == answers[1]
    assert [a[0] for a in answers[0]] == ["rpc_ok", "rpc_version_mismatch", "rpc_not_rpc", "rpc_unreachable",
                                          "rpc_endpoint_invalid"]


def test_a_server_silent_past_the_timeout_is_not_rpc(probe: Path) -> None:
    with server("silent") as silent:
        (s,) = run(probe, "--rpc", silent)["rpc_servers"]
    assert s["reason"] == "rpc_not_rpc" and s["detail"].startswith("no ggml RPC answer to HELLO: ")


def test_without_the_rpc_backend_no_server_is_contacted(probe: Path) -> None:
    with socket.socket() as listening:  # a connection would be queued: none may be
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        said = run(probe, "--rpc", f"127.0.0.1:{listening.getsockname()[1]}", FAKE_NO_RPC="1")
        listening.setblocking(False)
        with pytest.raises(BlockingIOError):
            listening.accept()
    assert [(s["reason"], s["detail"]) for s in said["rpc_servers"]] == \
        [("rpc_backend_missing", "the bundle's ggml-rpc module did not load")]
    assert said["devices"] == []


def test_without_rpc_the_answer_is_as_before_and_drivers_refuses_it(probe: Path) -> None:
    assert "rpc_servers" not in run(probe)
    res = subprocess.run([str(probe), "--drivers", "--rpc", "127.0.0.1:1"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "--drivers goes with neither --dir nor --rpc" in res.stderr


# ------------------------------------------------------------------ the Winsock side, under Wine

MINGW = shutil.which("x86_64-w64-mingw32-g++-posix")
WINE = shutil.which("wine")


@pytest.mark.skipif(MINGW is None or WINE is None, reason="needs the mingw-w64 cross compiler and Wine")
def test_the_windows_program_asks_the_servers_through_winsock(tmp_path: Path) -> None:
    """The same program cross-compiled for Windows (Winsock: a connect that select() reports, a refusal in the
    exception set) against a stand-in ggml DLL, run under Wine against the stand-in servers: the same reasons; a
    closed port is refused at once with Winsock's words, not waited out."""
    assert MINGW is not None and WINE is not None
    for name, text in (("ggml.h", GGML_H), ("ggml-backend.h", GGML_BACKEND_H), ("ggml.cpp", FAKE_GGML),
                       ("llamabundle-probe.cpp", data.text("programs/llamabundle-probe.cpp"))):
        (tmp_path / name).write_text(text)
    static = ["-static-libgcc", "-static-libstdc++", "-static"]
    subprocess.run([MINGW, "-std=c++17", "-shared", "-I", tmp_path, "-o", tmp_path / "ggml.dll", tmp_path / "ggml.cpp",
                    f"-Wl,--out-implib,{tmp_path / 'libggml.a'},--exclude-libs,ALL", *static], check=True)
    subprocess.run([MINGW, "-std=c++17", "-Wall", "-Werror", "-I", tmp_path, "-o", tmp_path / "llamabundle-probe.exe",
                    tmp_path / "llamabundle-probe.cpp", f"-L{tmp_path}", "-lggml", "-lws2_32", *static], check=True)
    (tmp_path / "modules").mkdir()
    with server("ok", devices=1) as ok, server("ok", version=(8, 0, 0)) as newer, server("http") as http:
        named = [ok, newer, http, f"127.0.0.1:{closed_port()}", "no-port"]
        res = subprocess.run([WINE, str(tmp_path / "llamabundle-probe.exe"), "--dir", "modules", "--rpc", ",".join(named)],
                             cwd=tmp_path, capture_output=True, text=True, timeout=300,
                             env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "WINEPREFIX": str(tmp_path / "prefix"),
                                  "WINEDEBUG": "-all"})
    assert res.returncode == 0, res.stderr[-3000:]
    said = json.loads(res.stdout)
    got = [(s["reason"], s["version"], s["device_names"]) for s in said["rpc_servers"]]
    assert got == [("rpc_ok", "7.0.0", ["RPC0"]), ("rpc_version_mismatch", "8.0.0", []), ("rpc_not_rpc", None, []),
                   ("rpc_unreachable", None, []), ("rpc_endpoint_invalid", None, [])]
    assert "10061" in said["rpc_servers"][3]["detail"], said["rpc_servers"][3]  # WSAECONNREFUSED, not a timeout
    assert [d["name"] for d in said["devices"]] == ["RPC0"]
