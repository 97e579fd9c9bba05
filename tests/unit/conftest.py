"""Unit tests are hermetic: no network beyond loopback, and no build can be started by accident. The fixtures
that several test modules use are here too (their makings are in the helper modules of the tests package)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.fakegithub import FakeGitHub
    from tests.pefiles import Built
    from tests.redist import Repo

# the shared test helpers (tests.bundles, tests.probing, ...) import as a package however pytest is started
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

_BLOCKED_PROGRAMS = {"cmake", "ninja", "nvcc", "pip"}

# Ctrl-C is tested for real (a KeyboardInterrupt here, SIGINT to a child llamabundle): a test run started in
# the background of a shell (`cmd &`) inherits SIGINT ignored, and so would every child it starts.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _hermetic(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    real_connect = socket.socket.connect

    def guarded_connect(self: socket.socket, address: object) -> object:
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, str) and not (host.startswith("127.") or host in ("localhost", "::1")) and self.family != socket.AF_UNIX:
            raise OSError(f"unit tests may not reach the network ({host})")
        return real_connect(self, address)  # type: ignore[arg-type]

    monkeypatch.setattr(socket.socket, "connect", guarded_connect)
    monkeypatch.setattr(socket, "getaddrinfo", _loopback_only(socket.getaddrinfo))

    real_popen_init = subprocess.Popen.__init__

    def guarded_popen(self: subprocess.Popen, args: object, *a: object, **kw: object) -> None:  # type: ignore[type-arg]
        argv = [args] if isinstance(args, (str, bytes)) else list(args)  # type: ignore[call-overload]
        prog = str(argv[0]).rsplit("/", 1)[-1] if argv else ""
        if prog in _BLOCKED_PROGRAMS or (len(argv) > 2 and str(argv[1]) == "-m" and str(argv[2]) == "pip"):
            raise RuntimeError(f"unit tests may not run {prog} {' '.join(map(str, argv[1:3]))}: that is for e2e tests")
        real_popen_init(self, args, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded_popen)
    # Never touch the user's real cache or installed bundles from a unit test (plan runs an installed
    # bundle's llamabundle-memory when no --bundle is given).
    monkeypatch.setenv("LLAMABUNDLE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    monkeypatch.setenv("LLAMABUNDLE_DATA_DIR", str(tmp_path_factory.mktemp("data")))
    monkeypatch.delenv("LLAMABUNDLE_STORE", raising=False)
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)


def _loopback_only(real):  # type: ignore[no-untyped-def]
    def getaddrinfo(host, *a, **kw):  # type: ignore[no-untyped-def]
        if host not in (None, "localhost", "::1") and not str(host).startswith("127."):
            raise socket.gaierror(f"unit tests may not resolve {host}")
        return real(host, *a, **kw)

    return getaddrinfo


# ------------------------------------------------------------------------------------ shared fixtures


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """Real PE files compiled with mingw-w64 (tests/pefiles.py), made once a session."""
    from tests import pefiles

    return pefiles.build(tmp_path_factory.mktemp("pe"))


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Repo]:
    """The fake CUDA redist server (tests/redist.py): its archives, their manifest, a cache, served on loopback."""
    from llamabundle import net
    from tests import redist

    monkeypatch.setattr(net, "_sleep", lambda s: None)  # retries without waiting
    with redist.serve_repo(tmp_path) as r:
        yield r


@pytest.fixture
def cli_repo(repo: Repo, monkeypatch: pytest.MonkeyPatch) -> Repo:
    """`repo`, named by the environment as a `llamabundle toolkit` command reads it."""
    monkeypatch.setenv("LLAMABUNDLE_CACHE_DIR", str(repo.cache))
    monkeypatch.setenv("LLAMABUNDLE_CUDA_REDIST_URL", repo.server.url + "/")
    return repo


@pytest.fixture
def gh() -> Iterator[FakeGitHub]:
    """The fake GitHub (tests/fakegithub.py) holding the test repository (tests.ghstore.REPO), on loopback."""
    from tests.fakegithub import FakeGitHub
    from tests.ghstore import REPO, TOKEN

    with FakeGitHub(REPO, token=TOKEN) as g:
        yield g


@pytest.fixture
def recipe13(tmp_path: Path) -> Path:
    """A CUDA 13 recipe whose toolkit is the fake redist one (tests/redist.py's RECIPE_13)."""
    from tests.redist import RECIPE_13

    p = tmp_path / "linux-x86_64-cuda13.yaml"
    p.write_text(RECIPE_13)
    return p
