"""net.download against a real HTTP server on loopback (tests/loopback.py): resume (Range/If-Range), retries,
size and sha256 checks, redirects that must not carry the token, the .part left for the next run, and
concurrent downloads of one file taking turns on its lock."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from rich.console import Console

from llamabundle import net
from llamabundle.errors import StoreError, ToolchainError, VerifyError
from llamabundle.log import Log, ProgressHandle
from tests.loopback import Loopback, Reply, Request, ranged

BODY = bytes(range(256)) * 12_289  # 3 MiB + 256 bytes: more than one 1 MiB chunk
SHA = hashlib.sha256(BODY).hexdigest()
ETAG = '"v1"'

Answer = Callable[[Request], Reply]


class Server:
    """A tests/loopback.py server: `replies` are used once each, in order, then `default` for every request;
    `seen` holds each request's path and (lower-case) headers."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.replies: list[Answer] = []
        self.default: Answer = serve()
        self.loop = Loopback(self._answer, host=host).start()
        self.url = self.loop.url

    def _answer(self, req: Request) -> Reply:
        answer = self.replies.pop(0) if self.replies else self.default
        return answer(req)

    def close(self) -> None:
        self.loop.close()

    @property
    def seen(self) -> list[dict[str, str]]:
        return [{"path": r.path, **r.headers} for r in self.loop.requests]

    def ranges(self) -> list[str | None]:
        return [s.get("range") for s in self.seen]


def serve(body: bytes = BODY, *, etag: str | None = ETAG, ranges: bool = True, cut: int | None = None,
          length: bool = True, headers: dict[str, str] | None = None) -> Answer:
    """A file server: honours Range (with If-Range against `etag`) when `ranges`; `cut` hangs up after
    that many body bytes while announcing the full Content-Length; `length=False` sends no Content-Length."""
    return lambda req: ranged(req, body, etag=etag, ranges=ranges, headers=headers, cut=cut, length=length)


def status(code: int, headers: dict[str, str] | None = None) -> Answer:
    return lambda req: Reply(code, headers or {})


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


@pytest.fixture
def no_sleep(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    slept: list[float] = []
    monkeypatch.setattr(net, "_sleep", slept.append)
    return slept


def log() -> Log:
    return Log(console=Console(file=io.StringIO(), width=200, color_system=None))


def get(server: Server, dest: Path, path: str = "/f", **kw: object) -> str:
    kw.setdefault("backoff", 0)
    return net.download(server.url + path, dest, http=net.session(), log=log(), connect_timeout=2,
                        read_timeout=5, **kw)  # type: ignore[arg-type]


def leftovers(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.parent.iterdir() if p.name != dest.name)


def write_part(dest: Path, data: bytes, url: str | None, validator: str | None) -> None:
    dest.with_name(dest.name + ".part").write_bytes(data)
    if url is not None:
        dest.with_name(dest.name + ".part.json").write_text(json.dumps({"url": url, "validator": validator, "total": len(BODY)}))


# ----------------------------------------------------------------------------------- success


def test_plain_download_returns_sha256_and_renames_atomically(tmp_path: Path, server: Server) -> None:
    dest = tmp_path / "d" / "file.bin"
    assert get(server, dest, sha256=SHA.upper(), size=len(BODY)) == SHA
    assert dest.read_bytes() == BODY
    assert leftovers(dest) == []
    assert len(server.seen) == 1 and server.ranges() == [None]
    assert server.seen[0]["user-agent"].startswith("llamabundle/")


def test_gzip_content_encoding_is_hashed_as_served(tmp_path: Path, server: Server) -> None:
    served = gzip.compress(b"hello " * 1000)
    server.default = serve(served, headers={"Content-Encoding": "gzip", "Content-Type": "text/plain"})
    dest = tmp_path / "f.gz"
    got = get(server, dest, size=len(served))
    assert got == hashlib.sha256(served).hexdigest() != hashlib.sha256(b"hello " * 1000).hexdigest()
    assert dest.read_bytes() == served


def test_progress_reports_bytes_done_of_total(tmp_path: Path, server: Server) -> None:
    calls: list[tuple[int, int | None]] = []

    class Recording(ProgressHandle):
        def update(self, done: int, total: int | None = None) -> None:
            calls.append((done, total))

    class L(Log):
        @contextmanager
        def progress(self, title: str, total: int | None = None, *, unit: str = "") -> Iterator[ProgressHandle]:
            assert title == "download f" and total == len(BODY) and unit == "bytes"
            yield Recording()

    net.download(server.url + "/f", tmp_path / "f", http=net.session(), log=L(quiet=True), backoff=0)
    assert calls[0] == (0, len(BODY)) and calls[-1] == (len(BODY), len(BODY))
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_a_byte_progress_shows_sizes_and_a_rate(capsys: pytest.CaptureFixture[str]) -> None:
    import io

    from rich.console import Console

    buf = io.StringIO()
    log = Log(console=Console(file=buf, force_terminal=True, width=200))
    with log.progress("download big.zip", 200_000_000, unit="bytes") as bar:
        bar.update(100_000_000)
    assert "100.0/200.0 MB" in buf.getvalue()  # rich's DownloadColumn (the rate column needs two samples in time)
    plain = io.StringIO()
    with Log(console=Console(file=plain, width=200)).progress("download big.zip", 200_000_000, unit="bytes") as bar:
        bar.update(100_000_000)
    assert "download big.zip: 100.0/200.0 MB (50%," in plain.getvalue() and "MB/s)" in plain.getvalue()


# ---------------------------------------------------------------------------------- mismatch


def test_sha256_mismatch_deletes_the_part_and_raises_the_given_error(tmp_path: Path, server: Server) -> None:
    dest = tmp_path / "f"
    with pytest.raises(ToolchainError) as e:
        get(server, dest, sha256="0" * 64, mismatch_error=ToolchainError)
    assert e.value.exit_code == 3
    assert e.value.what == f"sha256 mismatch for {server.url}/f"
    assert e.value.why == f"expected {'0' * 64}, got {SHA}"
    assert e.value.fix
    assert not dest.exists() and leftovers(dest) == []


def test_more_bytes_than_size_announced_aborts_before_reading(tmp_path: Path, server: Server) -> None:
    dest = tmp_path / "f"
    with pytest.raises(VerifyError) as e:
        get(server, dest, size=1000)
    assert e.value.exit_code == 5
    assert e.value.what == f"size mismatch for {server.url}/f"
    assert e.value.why == f"the server announces {len(BODY)} bytes, expected 1000"
    assert not dest.exists() and leftovers(dest) == []
    assert len(server.seen) == 1  # not retried


def test_more_bytes_than_size_streamed_aborts_at_once(tmp_path: Path, server: Server) -> None:
    sent: list[int] = []

    def endless(req: Request) -> Reply:  # no Content-Length: 64 MiB unless the client hangs up first
        def chunks() -> Iterator[bytes]:
            n = 0
            try:
                for _ in range(256):
                    yield b"\xff" * (1 << 18)  # the harness stops asking once a write fails
                    n += 1 << 18
            finally:
                sent.append(n)

        return Reply(200, body=chunks())

    server.default = endless
    dest = tmp_path / "f"
    with pytest.raises(ToolchainError) as e:
        get(server, dest, size=1000, mismatch_error=ToolchainError)
    assert e.value.why == "the server sent more than the expected 1000 bytes"
    assert not dest.exists() and leftovers(dest) == []
    deadline = time.monotonic() + 5
    while not sent and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sent and sent[0] < 64 << 20  # the client hung up long before the end
    assert len(server.seen) == 1


def test_fewer_bytes_than_size_is_a_mismatch(tmp_path: Path, server: Server) -> None:
    server.default = serve(BODY[:500], length=False)
    dest = tmp_path / "f"
    with pytest.raises(ToolchainError) as e:
        get(server, dest, size=1000, mismatch_error=ToolchainError)
    assert e.value.why == "expected 1000 bytes, got 500"
    assert not dest.exists() and leftovers(dest) == []


# ------------------------------------------------------------------------------------ resume


def test_truncated_body_is_resumed_with_range_in_the_same_call(tmp_path: Path, server: Server) -> None:
    half = len(BODY) // 2
    server.replies = [serve(cut=half)]  # announces the full Content-Length, sends half, hangs up
    dest = tmp_path / "f"
    assert get(server, dest, sha256=SHA, size=len(BODY)) == SHA
    assert dest.read_bytes() == BODY and leftovers(dest) == []
    assert server.ranges() == [None, f"bytes={half}-"]
    assert server.seen[1]["if-range"] == ETAG


def test_drops_use_up_the_retries_then_the_part_is_kept_for_the_next_call(tmp_path: Path, server: Server) -> None:
    server.default = serve(cut=1000)
    dest = tmp_path / "f"
    with pytest.raises(net.NetworkError) as e:
        get(server, dest, retries=2)
    assert e.value.exit_code == 6 and "dropped" in e.value.why
    assert server.ranges() == [None, "bytes=1000-", "bytes=2000-"]
    assert dest.with_name("f.part").read_bytes() == BODY[:3000]
    assert json.loads(dest.with_name("f.part.json").read_text())["validator"] == ETAG

    server.default = serve()
    assert get(server, dest, sha256=SHA) == SHA
    assert server.ranges()[-1] == "bytes=3000-" and server.seen[-1]["if-range"] == ETAG
    assert leftovers(dest) == []


def test_a_drop_on_a_server_without_ranges_fails_at_once(tmp_path: Path, server: Server) -> None:
    server.default = serve(ranges=False, etag=None, cut=1000)
    with pytest.raises(net.NetworkError) as e:
        get(server, tmp_path / "f")
    assert e.value.what == f"cannot download {server.url}/f"
    assert "Accept-Ranges" in e.value.why
    assert len(server.seen) == 1


@pytest.mark.race
def test_keyboard_interrupt_keeps_the_part_and_the_next_call_resumes_with_if_range(tmp_path: Path, server: Server) -> None:
    class Interrupt(ProgressHandle):
        def update(self, done: int, total: int | None = None) -> None:
            if done >= 1 << 20:
                raise KeyboardInterrupt

    class L(Log):
        @contextmanager
        def progress(self, title: str, total: int | None = None, *, unit: str = "") -> Iterator[ProgressHandle]:
            yield Interrupt()

    dest = tmp_path / "f"
    with pytest.raises(KeyboardInterrupt):
        net.download(server.url + "/f", dest, http=net.session(), log=L(quiet=True), sha256=SHA, backoff=0)
    assert not dest.exists()
    kept = dest.with_name("f.part").read_bytes()
    assert kept == BODY[: 1 << 20]
    assert json.loads(dest.with_name("f.part.json").read_text()) == {"url": server.url + "/f", "validator": ETAG,
                                                                      "total": len(BODY)}

    assert get(server, dest, sha256=SHA) == SHA
    assert server.seen[-1]["range"] == f"bytes={1 << 20}-" and server.seen[-1]["if-range"] == ETAG
    assert dest.read_bytes() == BODY and leftovers(dest) == []


def test_leftover_part_without_validator_is_resumed_without_if_range(tmp_path: Path, server: Server) -> None:
    dest = tmp_path / "f"
    write_part(dest, BODY[:777], url=None, validator=None)
    assert get(server, dest, sha256=SHA) == SHA
    assert server.ranges() == ["bytes=777-"] and "if-range" not in server.seen[0]
    assert dest.read_bytes() == BODY


def test_leftover_part_of_another_url_is_discarded(tmp_path: Path, server: Server) -> None:
    dest = tmp_path / "f"
    write_part(dest, b"x" * 777, url=server.url + "/other", validator=ETAG)
    assert get(server, dest, sha256=SHA) == SHA
    assert server.ranges() == [None]


def test_server_ignoring_range_restarts_from_zero(tmp_path: Path, server: Server) -> None:
    server.default = serve(ranges=False)
    dest = tmp_path / "f"
    write_part(dest, b"garbage!" * 100, url=server.url + "/f", validator=ETAG)  # would corrupt the file if appended to
    assert get(server, dest, sha256=SHA, size=len(BODY)) == SHA
    assert server.ranges() == ["bytes=800-"]
    assert dest.read_bytes() == BODY and leftovers(dest) == []


def test_changed_etag_makes_the_server_send_the_whole_new_file(tmp_path: Path, server: Server) -> None:
    new = b"new contents " * 100_000
    server.default = serve(new, etag='"v2"')
    dest = tmp_path / "f"
    write_part(dest, BODY[:5000], url=server.url + "/f", validator=ETAG)
    assert get(server, dest, sha256=hashlib.sha256(new).hexdigest()) == hashlib.sha256(new).hexdigest()
    assert server.seen[0]["range"] == "bytes=5000-" and server.seen[0]["if-range"] == ETAG
    assert dest.read_bytes() == new


def test_416_with_a_complete_part_is_done_and_verified(tmp_path: Path, server: Server) -> None:
    dest = tmp_path / "f"
    write_part(dest, BODY, url=server.url + "/f", validator=ETAG)
    assert get(server, dest, sha256=SHA, size=len(BODY)) == SHA
    assert server.ranges() == [f"bytes={len(BODY)}-"]
    assert dest.read_bytes() == BODY and leftovers(dest) == []


def test_complete_part_with_wrong_bytes_is_a_mismatch(tmp_path: Path, server: Server) -> None:
    dest = tmp_path / "f"
    write_part(dest, b"\0" * len(BODY), url=server.url + "/f", validator=ETAG)
    with pytest.raises(VerifyError):
        get(server, dest, sha256=SHA)
    assert leftovers(dest) == [] and not dest.exists()


# ------------------------------------------------------------------------------------ status


def test_500_then_200_succeeds_after_one_retry(tmp_path: Path, server: Server) -> None:
    server.replies = [status(500)]
    assert get(server, tmp_path / "f", sha256=SHA) == SHA
    assert len(server.seen) == 2


def test_persistent_500_is_a_network_error_after_all_retries(tmp_path: Path, server: Server, no_sleep: list[float]) -> None:
    server.default = status(503)
    dest = tmp_path / "f"
    with pytest.raises(net.NetworkError) as e:
        get(server, dest, retries=3, backoff=0.5)
    assert e.value.exit_code == 6
    assert "HTTP 503" in e.value.why
    assert len(server.seen) == 4
    assert no_sleep == [0.5, 1.0, 2.0]
    assert not dest.exists() and leftovers(dest) == []


def test_404_fails_at_once(tmp_path: Path, server: Server) -> None:
    server.default = status(404)
    with pytest.raises(net.NetworkError) as e:
        get(server, tmp_path / "f")
    assert e.value.exit_code == 6
    assert e.value.what == f"GET {server.url}/f answered HTTP 404"
    assert len(server.seen) == 1


@pytest.mark.parametrize(("after", "slept"), [("7", 7.0), ("120", 30.0), ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0)])
def test_429_honours_retry_after_up_to_30_seconds(tmp_path: Path, server: Server, no_sleep: list[float],
                                                  after: str, slept: float) -> None:
    server.replies = [status(429, {"Retry-After": after})]
    assert get(server, tmp_path / "f") == SHA
    assert len(server.seen) == 2
    assert no_sleep == [slept]


# --------------------------------------------------------------------------- redirects, token


@pytest.fixture
def other_host() -> Iterator[Server]:
    try:
        s = Server("127.0.0.2")
    except OSError:
        s = Server("localhost")  # vs 127.0.0.1: another host name all the same
    yield s
    s.close()


def redirect(location: str) -> Reply:
    return status(302, {"Location": location})


def test_token_goes_to_the_origin_only_never_to_the_redirect_host(tmp_path: Path, server: Server, other_host: Server) -> None:
    assert net.origin(server.url) != net.origin(other_host.url)
    server.replies = [redirect("/moved"), redirect(other_host.url + "/asset")]
    dest = tmp_path / "f"
    assert get(server, dest, sha256=SHA, token="s3cret", headers={"Accept": "application/octet-stream"}) == SHA
    assert [s["path"] for s in server.seen] == ["/f", "/moved"]
    assert all(s["authorization"] == "Bearer s3cret" for s in server.seen)  # same origin: kept
    assert [s["path"] for s in other_host.seen] == ["/asset"]
    assert "authorization" not in other_host.seen[0]
    assert other_host.seen[0]["accept"] == "application/octet-stream"


def test_resume_after_redirect_sends_range_to_the_target(tmp_path: Path, server: Server, other_host: Server) -> None:
    half = len(BODY) // 2
    server.default = redirect(other_host.url + "/asset")
    other_host.replies = [serve(cut=half)]
    assert get(server, tmp_path / "f", sha256=SHA, token="t") == SHA
    assert other_host.ranges() == [None, f"bytes={half}-"]
    assert not any("authorization" in s for s in other_host.seen)


def test_redirect_loop_is_a_network_error(tmp_path: Path, server: Server) -> None:
    server.default = redirect("/f")
    with pytest.raises(net.NetworkError, match="redirected more than"):
        get(server, tmp_path / "f")


# ------------------------------------------------------------------------------- connection


def test_connection_refused_is_a_network_error_without_retries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    slept: list[float] = []
    monkeypatch.setattr(net, "_sleep", slept.append)  # a retry would back off first
    with pytest.raises(net.NetworkError) as e:
        net.download(f"http://127.0.0.1:{port}/f", tmp_path / "f", http=net.session(), log=log(), connect_timeout=2)
    assert slept == []  # default retries and backoff: refused is not retried
    assert e.value.exit_code == 6
    assert e.value.why == "connection refused"
    assert leftovers(tmp_path / "f") == []


# ------------------------------------------------------------------------- concurrent downloads


class Recording:
    """A sink that keeps what it is fed (and how often it was told to start over)."""

    def __init__(self) -> None:
        self.data, self.resets = bytearray(), 0

    def update(self, data: bytes) -> None:
        self.data += data

    def reset(self) -> None:
        self.data.clear()
        self.resets += 1


@pytest.mark.race
def test_concurrent_downloads_to_one_dest_take_turns_and_download_once(tmp_path: Path, server: Server) -> None:
    dest = tmp_path / "d" / "f"
    barrier = threading.Barrier(3)
    results: list[object] = [None] * 3

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = get(server, dest, sha256=SHA, size=len(BODY))
        except BaseException as e:  # noqa: BLE001
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [SHA, SHA, SHA]
    assert dest.read_bytes() == BODY and leftovers(dest) == []  # no .part, .part.json or .part.lock
    assert len(server.seen) == 1  # the others found it there, with the pinned sha256


def test_a_dest_already_there_with_the_pinned_sha256_is_used_and_fed_to_the_sink(tmp_path: Path,
                                                                                 server: Server) -> None:
    dest = tmp_path / "f"
    dest.write_bytes(BODY)
    sink = Recording()
    assert get(server, dest, sha256=SHA, sink=sink) == SHA
    assert server.seen == [] and bytes(sink.data) == BODY and leftovers(dest) == []


def test_a_dest_with_other_bytes_is_downloaded_again(tmp_path: Path, server: Server) -> None:
    dest = tmp_path / "f"
    dest.write_bytes(b"\0" * len(BODY))
    sink = Recording()
    assert get(server, dest, sha256=SHA, sink=sink) == SHA
    assert len(server.seen) == 1 and dest.read_bytes() == BODY and bytes(sink.data) == BODY
    assert leftovers(dest) == []


def test_without_a_pinned_sha256_dest_is_downloaded_again(tmp_path: Path, server: Server) -> None:
    dest = tmp_path / "f"
    dest.write_bytes(BODY)
    assert get(server, dest) == SHA
    assert len(server.seen) == 1


def test_a_download_waits_for_the_holder_of_the_lock(tmp_path: Path, server: Server,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from filelock import FileLock

    monkeypatch.setattr(net, "LOCK_TIMEOUT", 20.0)  # a bug fails the test instead of hanging it
    dest = tmp_path / "f"
    locked, done = threading.Event(), threading.Event()

    def other() -> None:  # another downloader: holds the lock, completes the file, then lets go
        with FileLock(str(dest) + ".part.lock"):
            locked.set()
            time.sleep(0.3)
            dest.write_bytes(BODY)
        done.set()

    t = threading.Thread(target=other)
    t.start()
    assert locked.wait(5)
    buf = io.StringIO()
    got = net.download(server.url + "/f", dest, http=net.session(), sha256=SHA, backoff=0,
                       log=Log(console=Console(file=buf, width=200, color_system=None)))
    t.join()
    assert done.is_set() and got == SHA and server.seen == []
    assert "download f: another process is downloading it; waiting for it" in buf.getvalue()
    assert "already there" in buf.getvalue()


def test_waiting_too_long_for_the_lock_is_a_store_error(tmp_path: Path, server: Server,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from filelock import FileLock

    monkeypatch.setattr(net, "LOCK_TIMEOUT", 0.2)
    dest = tmp_path / "f"
    with FileLock(str(dest) + ".part.lock"), pytest.raises(StoreError) as e:
        get(server, dest, sha256=SHA)
    assert e.value.exit_code == 6 and "another process has been downloading" in e.value.what
    assert server.seen == []


@pytest.mark.race
def test_a_lock_file_left_by_a_killed_run_is_taken_and_removed(tmp_path: Path, server: Server) -> None:
    dest = tmp_path / "f"
    dest.with_name("f.part.lock").write_text("")  # SIGKILL leaves the file; its lock died with the process
    write_part(dest, BODY[:1000], url=server.url + "/f", validator=ETAG)
    assert get(server, dest, sha256=SHA) == SHA
    assert server.ranges() == ["bytes=1000-"]  # resumed across runs, as before
    assert dest.read_bytes() == BODY and leftovers(dest) == []


def test_the_lock_is_given_back_when_a_download_fails(tmp_path: Path, server: Server) -> None:
    server.default = serve(cut=1000)
    dest = tmp_path / "f"
    with pytest.raises(net.NetworkError):
        get(server, dest, retries=0)
    assert leftovers(dest) == ["f.part", "f.part.json"]  # kept for a resume; the lock file is gone
    server.default = serve()
    assert get(server, dest, sha256=SHA) == SHA and leftovers(dest) == []
