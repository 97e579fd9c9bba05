"""verify --level ops through RPC (backends/rpc.py, data/rpc_preload.c): test-backend-ops has no option naming an RPC
server, so `build --ops-tool` builds a preload beside it that adds the servers of LLAMABUNDLE_RPC_SERVERS once ggml
has loaded its modules, and the ops level runs the tool against RPC0 with the bundle's own server listening.

The preload is compiled here with the C compiler and run in a real process against a stand-in of ggml's registry
(a small shared library with the functions it calls) and a stand-in test-backend-ops that calls
ggml_backend_load_all and asks which device supports which op; the real ones are in tests/e2e/test_rpc_bundle.py."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from llamabundle import platforms
from llamabundle.backends.rpc import RPC, SERVERS_ENV, SUPPORTS_AS_ENV, preload_of
from llamabundle.compilers import read_cmake_cache
from llamabundle.errors import BuildError, VerifyError
from llamabundle.log import Log
from tests.processes import alive
from tests.unit.test_rpc_backend import bundle, env

CC = shutil.which("gcc") or shutil.which("cc")
pytestmark = pytest.mark.skipif(CC is None or not sys.platform.startswith("linux"), reason="needs a C compiler on Linux")
LINUX = platforms.get("linux-x86_64")

# ggml's registry, as much of it as the preload uses: the RPC module "loads" in ggml_backend_load_all unless
# FAKE_NO_RPC is set, ggml_backend_rpc_add_server refuses "bad:1", ggml_backend_register prints what it was given.
# Devices are their names (a backend is its device): RPC0 says it supports every op, as ggml's RPC client does at the
# pinned commit; CUDA0 supports ADD only; ggml_backend_supports_op asks its device, as ggml's does.
FAKE_GGML = r"""
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
static int rpc_loaded;
static const char *rpc_name = "RPC";
static void *add_server(const char *endpoint) {
    if (strcmp(endpoint, "bad:1") == 0) return NULL;
    return strdup(endpoint);
}
void ggml_backend_load_all(void) { rpc_loaded = getenv("FAKE_NO_RPC") == NULL; printf("modules loaded\n"); }
void *ggml_backend_reg_by_name(const char *name) { return rpc_loaded && strcmp(name, "RPC") == 0 ? (void *)rpc_name : NULL; }
void *ggml_backend_reg_get_proc_address(void *reg, const char *name) {
    return reg == rpc_name && strcmp(name, "ggml_backend_rpc_add_server") == 0 ? (void *)add_server : NULL;
}
void ggml_backend_register(void *reg) { printf("registered %s\n", (const char *)reg); }
const char *ggml_backend_dev_name(void *dev) { return dev; }
void *ggml_backend_dev_by_name(const char *name) {
    static const char *here[] = {"CPU", "CUDA0", "RPC0"};
    for (int i = 0; i < 3; i++) if (strcmp(name, here[i]) == 0) return (void *)here[i];
    return NULL;
}
void *ggml_backend_get_device(void *backend) { return backend; }
bool ggml_backend_dev_supports_op(void *dev, const void *op) {
    return strncmp(dev, "RPC", 3) == 0 || strcmp(dev, "CPU") == 0 || strcmp(op, "ADD") == 0;
}
bool ggml_backend_supports_op(void *backend, const void *op) { return ggml_backend_dev_supports_op(ggml_backend_get_device(backend), op); }
"""
FAKE_TOOL = r"""
#include <stdbool.h>
#include <stdio.h>
void ggml_backend_load_all(void);
void *ggml_backend_dev_by_name(const char *name);
bool ggml_backend_supports_op(void *backend, const void *op);
bool ggml_backend_dev_supports_op(void *dev, const void *op);
int main(int argc, char **argv) {
    ggml_backend_load_all();
    for (int i = 1; i + 1 < argc; i += 2) {  /* DEVICE OP ...: asked of the backend, then of the device */
        void *dev = ggml_backend_dev_by_name(argv[i]);
        printf("%s %s %d %d\n", argv[i], argv[i + 1], ggml_backend_supports_op(dev, argv[i + 1]),
               ggml_backend_dev_supports_op(dev, argv[i + 1]));
    }
    printf("tests ran\n");
    return 0;
}
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stand-in ggml and tool, and the preload as `after_ops_tool` builds it from a CMake cache naming the
    compiler."""
    d = tmp_path_factory.mktemp("rpcops")
    (d / "ggml.c").write_text(FAKE_GGML)
    (d / "tool.c").write_text(FAKE_TOOL)
    assert CC is not None
    subprocess.run([CC, "-shared", "-fPIC", "-o", d / "libggml.so", d / "ggml.c"], check=True)
    subprocess.run([CC, "-o", d / "test-backend-ops", d / "tool.c", f"-L{d}", "-lggml", "-Wl,-rpath,$ORIGIN"], check=True)
    (d / "tree").mkdir()
    (d / "tree" / "CMakeCache.txt").write_text(f"// the C compiler\nCMAKE_C_COMPILER:STRING={CC}\nGGML_RPC:BOOL=ON\n")
    RPC.after_ops_tool(d / "test-backend-ops", build_dir=d / "tree", platform=LINUX, log=Log(), env=env())
    return d


def run_tool(d: Path, *args: str, **more: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(d / "test-backend-ops"), *args], env={**env(LD_PRELOAD=str(preload_of(d / "test-backend-ops"))),
                                                              **more}, capture_output=True, text=True, timeout=30)


def test_the_preload_is_built_beside_the_tool_and_leaves_nothing_else(built: Path) -> None:
    assert preload_of(built / "test-backend-ops") == built / "test-backend-ops.rpc-preload.so"
    assert (built / "test-backend-ops.rpc-preload.so").is_file()
    assert not list(built.glob("*.partial*")), "the source and the partial library are gone"


def test_each_server_named_is_added_after_the_modules_load(built: Path) -> None:
    got = run_tool(built, **{SERVERS_ENV: "127.0.0.1:50052,10.0.0.2:50053"})
    assert got.returncode == 0, got.stderr
    assert got.stdout.splitlines() == ["modules loaded", "registered 127.0.0.1:50052", "registered 10.0.0.2:50053",
                                       "tests ran"]


def test_without_servers_the_tool_runs_as_it_would(built: Path) -> None:
    got = run_tool(built)
    assert got.returncode == 0 and got.stdout.splitlines() == ["modules loaded", "tests ran"]


def test_an_rpc_device_answers_supports_op_as_the_device_it_serves(built: Path) -> None:
    asked = ("RPC0", "ADD", "RPC0", "MUL_MAT", "CUDA0", "MUL_MAT", "CPU", "MUL_MAT")
    got = run_tool(built, *asked, **{SUPPORTS_AS_ENV: "CUDA0"})
    assert got.returncode == 0, got.stderr
    assert got.stdout.splitlines()[1:] == ["RPC0 ADD 1 1", "RPC0 MUL_MAT 0 0", "CUDA0 MUL_MAT 0 0", "CPU MUL_MAT 1 1",
                                           "tests ran"], "RPC0 answers as CUDA0; the local devices as themselves"
    plain = run_tool(built, *asked)
    assert plain.stdout.splitlines()[1:3] == ["RPC0 ADD 1 1", "RPC0 MUL_MAT 1 1"], "unnamed: the RPC client's own answer"


@pytest.mark.parametrize(("more", "said"), [
    ({SUPPORTS_AS_ENV: "Vulkan7"}, "LLAMABUNDLE_RPC_SUPPORTS_AS names Vulkan7, not a device here"),
    ({SERVERS_ENV: "127.0.0.1:50052", "FAKE_NO_RPC": "1"}, "the RPC backend module did not load"),
    ({SERVERS_ENV: "127.0.0.1:50052,bad:1"}, "could not add the RPC server bad:1"),
    ({SERVERS_ENV: "x" * 5000}, "LLAMABUNDLE_RPC_SERVERS is too long"),
])
def test_a_failure_stops_the_tool_before_any_test_and_says_why(built: Path, more: dict[str, str], said: str) -> None:
    got = run_tool(built, "RPC0", "ADD", **more)
    assert got.returncode == 3
    assert said in got.stderr and "tests ran" not in got.stdout


def test_no_compiler_recorded_is_a_clear_build_error(tmp_path: Path) -> None:
    (tmp_path / "CMakeCache.txt").write_text("GGML_RPC:BOOL=ON\n")
    with pytest.raises(BuildError, match="CMake recorded no C compiler"):
        RPC.after_ops_tool(tmp_path / "test-backend-ops", build_dir=tmp_path, platform=LINUX, log=Log(), env=env())


def test_a_windows_tool_gets_no_preload_and_its_ops_level_says_why(tmp_path: Path) -> None:
    windows = platforms.get("windows-x86_64")
    RPC.after_ops_tool(tmp_path / "test-backend-ops.exe", build_dir=tmp_path, platform=windows, log=Log(), env=env())
    assert list(tmp_path.iterdir()) == []
    root, m = bundle(tmp_path)
    got = RPC.ops_devices(root, m, platform=windows, runner=[], env=env(), tool=tmp_path / "t.exe")
    assert not got.devices and "no LD_PRELOAD" in (got.skipped or "")


def test_each_run_gets_a_server_of_its_own_for_as_long_as_it_lasts(tmp_path: Path, built: Path) -> None:
    root, m = bundle(tmp_path)
    tool = built / "test-backend-ops"
    got = RPC.ops_devices(root, m, platform=LINUX, runner=[], env=env(), tool=tool)
    assert list(got.devices) == ["RPC0"] and got.skipped is None
    ports = []
    for _ in range(2):
        with got.devices["RPC0"]() as run_env:
            endpoint = run_env[SERVERS_ENV]
            assert endpoint.startswith("127.0.0.1:") and run_env["LD_PRELOAD"] == str(preload_of(tool))
            assert run_env[SUPPORTS_AS_ENV] == "CPU" == got.serves
            ports.append(int(endpoint.rsplit(":", 1)[1]))
            socket.create_connection(("127.0.0.1", ports[-1]), timeout=5).close()
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", ports[-1]), timeout=1)
    assert not alive(int((root / "server.pid").read_text())), "the last run's server is stopped too"


def test_what_the_server_said_goes_with_a_failed_run(tmp_path: Path, built: Path) -> None:
    root, m = bundle(tmp_path)
    got = RPC.ops_devices(root, m, platform=LINUX, runner=[], env=env(), tool=built / "test-backend-ops")
    with pytest.raises(VerifyError) as e, got.devices["RPC0"]():
        raise VerifyError("test-backend-ops -b RPC0 -o ADD exited with -6", details="client words")
    assert e.value.details.startswith("client words\n--- ggml-rpc-server ---\nlistening on 127.0.0.1:")
    assert e.value.details.endswith(", serving CPU"), "no GPU tested here: the server serves the CPU"


def test_where_a_gpu_is_tested_the_server_serves_it_and_rpc0_answers_as_it(tmp_path: Path, built: Path) -> None:
    root, m = bundle(tmp_path)
    got = RPC.ops_devices(root, m, platform=LINUX, runner=[], env=env(), tool=built / "test-backend-ops",
                          gpus=["CUDA0", "CUDA1"])
    assert got.serves == "CUDA0"
    with pytest.raises(VerifyError) as e, got.devices["RPC0"]() as run_env:
        assert run_env[SUPPORTS_AS_ENV] == "CUDA0"
        raise VerifyError("test-backend-ops -b RPC0 -o MUL_MAT exited with -6")
    assert (e.value.details or "").endswith(", serving CUDA0")


def test_no_preload_or_no_native_run_adds_no_device_and_says_why(tmp_path: Path, built: Path) -> None:
    root, m = bundle(tmp_path)
    emulated = RPC.ops_devices(root, m, platform=LINUX, runner=["qemu-x"], env=env(), tool=built / "test-backend-ops")
    assert not emulated.devices and "natively" in (emulated.skipped or "")
    none = RPC.ops_devices(root, m, platform=LINUX, runner=[], env=env(), tool=tmp_path / "other-tool")
    assert not none.devices and "rebuild with --ops-tool" in (none.skipped or "")


def test_the_cmake_cache_is_read_by_name(tmp_path: Path) -> None:
    (tmp_path / "CMakeCache.txt").write_text("# c\n//doc\nCMAKE_C_COMPILER:FILEPATH=/usr/bin/clang-19\n"
                                              "CMAKE_C_COMPILER_TARGET:STRING=aarch64-linux-gnu\nEMPTY:STRING=\n")
    assert read_cmake_cache(tmp_path) == {"CMAKE_C_COMPILER": "/usr/bin/clang-19",
                                          "CMAKE_C_COMPILER_TARGET": "aarch64-linux-gnu", "EMPTY": ""}
    assert read_cmake_cache(tmp_path / "none") == {}
