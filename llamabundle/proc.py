"""The one subprocess gateway: echoes `+ cmd`, finds the program first, streams output to a log,
bounds every child in time, and on failure raises the caller's error class with the last lines of output.

Every child runs in a process group of its own; a timeout, an interrupt (Ctrl-C) or a failure ends it and all
it started, printing or not. On Linux that includes what left the group with setsid (a helper of nvidia-smi or
llama-server): llamabundle is a child subreaper, the family is found in /proc and adopted orphans are reaped;
and each child runs under a guard (`_guard`, a subreaper too) that ends its whole family when llamabundle dies,
even by SIGKILL. A step silent for a while shows a heartbeat: the elapsed time on a terminal, a line every 30 s elsewhere (a CI
log silent for minutes looks hung, and some CI systems kill silent jobs).
"""

from __future__ import annotations

import collections
import functools
import os
import queue
import select
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NoReturn, cast

from .errors import LlamaBundleError, ToolchainError
from .log import Log

TAIL_LINES = 50
HEARTBEAT = 30.0  # seconds of silence between two "still running" lines on a pipe
KILL_GRACE = 5.0  # seconds between SIGTERM and SIGKILL of a process group
DEFAULT_TIMEOUT = 3600.0  # seconds: no child runs unbounded; long steps (builds) pass their own
ORPHAN_GRACE = 1.0  # seconds the output may stay open after the child exited (then its group is ended)
REAP_WAIT = 2.0  # seconds a kill waits for the killed to be gone (and reaps those reparented to us)
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER = 1, 4, 36  # <linux/prctl.h>
_LINUX = sys.platform.startswith("linux")
_EOF = object()
# Our children not waited for yet: never reaped here (that would take their returncode from their Popen).
_live: weakref.WeakSet[subprocess.Popen[Any]] = weakref.WeakSet()
# Orphans of our children that were reparented to us (ppid is ours: no one else can reap them, so their pid
# cannot be reused before we do) and left running: reaped when the next child starts, once they have exited.
_adopted: set[int] = set()


class Timeout(subprocess.TimeoutExpired):
    """A child of `capture` or `run_until` ran past its timeout (its process group was ended). `output` and
    `stderr` hold what it printed until then. Callers catch this, never subprocess's own class."""


def which(program: str, *, path: str | None = None, purpose: str = "", fix: str = "") -> str:
    found = shutil.which(program, path=path)
    if not found:
        raise ToolchainError(f"'{program}' was not found on PATH", why=purpose or f"llamabundle needs {program}",
                             fix=fix or f"install {program} and make sure it is on PATH")
    return found


@functools.cache
def _prctl() -> Callable[..., int] | None:
    """libc's prctl, resolved once (Linux); None elsewhere or where it cannot be."""
    if not _LINUX:
        return None
    import ctypes

    try:
        f = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    f.restype = ctypes.c_int
    return cast(Callable[..., int], f)


@functools.cache
def _subreaper() -> bool:
    """Make llamabundle a child subreaper, once, before its first child: a descendant whose parent exits (a
    helper that left with setsid, a daemon) is reparented to us instead of init, so a kill still finds it
    (`_family`) and we reap it. The setting is not inherited by our children."""
    prctl = _prctl()
    return prctl is not None and prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


@functools.cache
def _life() -> int | None:
    """The read end of a pipe whose write end only llamabundle holds (both close on exec; a guard closes its
    copy of the write end first thing): it reads end-of-file once llamabundle is gone, however it died."""
    try:
        r, w = os.pipe()
    except OSError:
        return None
    _LIFE_WRITE.append(w)  # held, never written, till the process ends
    return r


_LIFE_WRITE: list[int] = []
GUARD_END_WAIT = 10.0  # seconds a guard spends ending the family of a dead llamabundle


def _guarded(parent: int, prctl: Callable[..., int], life: int | None) -> Callable[[], None]:
    """The child's last step before exec: it forks. The fork goes on to exec the program, dying with the guard
    (PR_SET_PDEATHSIG); the child itself stays as the program's guard (`_guard`) and never returns, so the
    Popen's pid is the guard's: its exit status is the program's, its process group the program's too.
    Without a life pipe, or where the fork fails, the child execs the program itself, dying with llamabundle.

    subprocess warns that preexec_fn is unsafe with threads (the forked child may need a lock another thread
    held). This one runs after Python's own fork handling (GIL, import lock), with glibc's fork-safe malloc,
    and takes no lock of ours: prctl through a ctypes function resolved in the parent, fork, signal dispositions,
    select and /proc reads. It makes subprocess fork instead of vfork, a cost of no account here."""
    sigkill = int(signal.SIGKILL)

    def preexec() -> None:
        guard, program = parent, 0
        if life is not None:
            try:
                guard, program = os.getpid(), os.fork()
            except OSError:
                guard, program = parent, 0
        if program:
            _guard(program, life, prctl)  # never returns
        try:
            prctl(PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
            if os.getppid() != guard:  # the guard (or llamabundle) died between fork and prctl: no signal will come
                os.kill(os.getpid(), sigkill)
        except Exception:  # an error here would fail the start of the program itself
            pass

    return preexec


def _guard(program: int, life: int | None, prctl: Callable[..., int]) -> NoReturn:
    """Stand between llamabundle and `program` until it exits, then exit as it did (its code, or killed by its
    signal). A subreaper, so nothing the program starts can leave the guard's tree; when `life` reads
    end-of-file (llamabundle died), end that whole tree and exit. It ignores SIGINT, SIGTERM and SIGHUP (a kill
    of the process group reaches the program itself; the guard follows it out), holds none of the program's
    output and no file of llamabundle's."""
    code = 255
    try:
        for ignored in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(ignored, signal.SIG_IGN)
        prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        keep = life if life is not None else 2
        os.closerange(3, keep)
        os.closerange(keep + 1, 1 << 20)
        try:
            watch: int | None = os.pidfd_open(program)
        except (AttributeError, OSError):
            watch = None
        status = None
        while status is None:
            ready = select.select([fd for fd in (life, watch) if fd is not None], [], [],
                                  1.0 if watch is not None else 0.05)[0]
            if life is not None and life in ready:
                _end_tree(os.getpid())
                os._exit(137)
            status = _reap_children(program)
        if os.WIFEXITED(status):
            code = os.WEXITSTATUS(status)
        else:
            sig = os.WTERMSIG(status)
            code = 128 + sig
            with suppress(Exception):
                prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)  # no core of the guard
                signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
                signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
    except BaseException:
        pass
    os._exit(code)


def _reap_children(program: int) -> int | None:
    """Reap the guard's children that have exited (the program, or orphans of it that ended): the program's
    wait status once it has exited, else None."""
    status = None
    while True:
        try:
            pid, st = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status
        if pid == 0:
            return status
        if pid == program:
            status = st


def _end_tree(me: int) -> None:
    """Kill every descendant of `me` (a subreaper: its descendants are its children's trees and nothing else)
    and reap them, within GUARD_END_WAIT seconds."""
    deadline = time.monotonic() + GUARD_END_WAIT
    while time.monotonic() < deadline:
        try:
            table = _table()
        except OSError:
            table = {}
        tree, grew = {me}, True
        while grew:
            grew = False
            for pid, (_, ppid, _, _) in table.items():
                if ppid in tree and pid not in tree:
                    tree.add(pid)
                    grew = True
        for pid in tree - {me}:
            with suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            return  # no child left: no descendant either
        time.sleep(0.01)


def _group_kwargs() -> dict[str, Any]:
    if sys.platform == "win32":
        return {"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP}
    kwargs: dict[str, Any] = {"start_new_session": True}
    prctl = _prctl()
    if prctl is not None:
        _subreaper()
        kwargs["preexec_fn"] = _guarded(os.getpid(), prctl, _life())
    return kwargs


def _popen(argv: list[str], **kwargs: Any) -> subprocess.Popen[str]:
    """The child, in a process group of its own (and on Linux dying with us); adopted orphans that exited
    since the last start are reaped first."""
    _reap_adopted()
    p: subprocess.Popen[str] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, text=True, encoding="utf-8", errors="replace",
                                                **kwargs, **_group_kwargs())
    if sys.platform == "win32":  # pragma: no cover
        _join_job(p)
    _live.add(p)
    return p


def kill_group(p: subprocess.Popen[Any], *, grace: float = KILL_GRACE, spare: Iterable[int] = ()) -> None:
    """End the child and everything it started: SIGTERM, then SIGKILL after `grace` seconds, to its process
    group and, on Linux, to the rest of its family found in /proc (`_family`: what left the group with setsid
    too), but `spare`. Those reparented to us are reaped. On Windows: its job object (`_join_job`) is ended."""
    if sys.platform == "win32":  # pragma: no cover - exercised on the Windows CI job only
        if not _close_job(p, kill=True):
            subprocess.run(["taskkill", "/F", "/T", "/PID", str(p.pid)], capture_output=True, check=False)
        p.wait()
        return
    spared = set(spare)
    family = _family(p) - spared
    _signal(p, family, signal.SIGTERM)
    try:
        p.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    family |= _family(p, family) - spared  # started since, or reparented to us when their parent ended
    refused = _signal(p, family, signal.SIGKILL)  # the leader may be gone; those that ignored SIGTERM still get it
    p.wait()
    _reap(family - refused)


def _signal(p: subprocess.Popen[Any], family: Iterable[int], sig: int) -> set[int]:
    """Send sig to p's process group and to each of `family`; the pids that refused it (another user's) are
    returned: no use waiting for those to be gone."""
    refused = set()
    targets: list[tuple[Callable[[int, int], None], int]] = [(os.killpg, p.pid), *((os.kill, pid) for pid in family)]
    for send, pid in targets:
        try:
            send(pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            refused.add(pid)
    return refused


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, process group, session) of pid from /proc, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            line = f.read()
        fields = line[line.rindex(b")") + 2:].split()
        return fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[3])
    except (OSError, ValueError, IndexError):
        return None


def _table() -> dict[int, tuple[str, int, int, int]]:
    """Every process in /proc: pid -> (state, ppid, process group, session)."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (row := _stat(int(name))) is not None:
            table[int(name)] = row
    return table


def _pipes(p: subprocess.Popen[Any]) -> set[int]:
    """The inodes of the pipes we read p's output from."""
    found = set()
    for stream in (p.stdout, p.stderr):
        try:
            if stream is not None and stat.S_ISFIFO((st := os.fstat(stream.fileno())).st_mode):
                found.add(st.st_ino)
        except (OSError, ValueError):
            pass
    return found


def _holds(pid: int, pipes: set[int]) -> bool:
    """Whether pid holds the write end of one of `pipes` (a read end, say in a child forked from us while p
    ran, is not p's output)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if not (link.startswith("pipe:[") and link[6:-1].isdigit() and int(link[6:-1]) in pipes):
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                flags = next((int(ln.split()[1], 8) for ln in f if ln.startswith("flags:")), 0)
        except (OSError, ValueError, IndexError):
            continue
        if flags & os.O_ACCMODE == os.O_WRONLY:
            return True
    return False


def _family(p: subprocess.Popen[Any], known: Iterable[int] = (), *, holders: bool = True) -> set[int]:
    """What p started that is still there, p itself not included (Linux; elsewhere nothing is found): its
    descendants by parent links (from p only while it is unreaped: a reaped pid may be reused) and from `known`
    (found before, reparented to us since), every member of a process group or session that one of them leads
    (p's own, or one a descendant made with setsid) and, with `holders`, children of ours that hold p's output
    pipe open (orphans adopted from an exited p, still printing). Never us, our ancestors or another live child."""
    if not _LINUX:
        return set()
    try:
        table = _table()
    except OSError:
        return set()
    me = os.getpid()
    spared = {me, *(q.pid for q in list(_live) if q is not p and q.returncode is None)}
    up = table.get(me)
    while up is not None and up[1] > 0 and up[1] not in spared:
        spared.add(up[1])
        up = table.get(up[1])
    family = {p.pid, *known}
    parents = set(family) if p.returncode is None else family - {p.pid}
    pipes = _pipes(p) if holders else set()
    if pipes:
        for pid, (_, ppid, _, _) in table.items():
            if ppid == me and pid not in spared and pid not in family and _holds(pid, pipes):
                family.add(pid)
                parents.add(pid)
    grew = True
    while grew:
        grew = False
        for pid, (_, ppid, pgid, sid) in table.items():
            if pid not in family and pid not in spared and (ppid in parents or pgid in family or sid in family):
                family.add(pid)
                parents.add(pid)
                grew = True
    family.discard(p.pid)  # p is reaped by its Popen, never here
    return family


def _detached_holders(p: subprocess.Popen[Any]) -> set[int]:
    """Those of p's family that left its session (setsid) and hold its output open: a daemon it started
    (wineserver), reparented to p's guard or to us."""
    pipes = _pipes(p)
    return {pid for pid in _family(p) if (row := _stat(pid)) is not None and row[3] != p.pid and _holds(pid, pipes)}


def _reap(family: Iterable[int], *, wait: float = REAP_WAIT) -> None:
    """Wait a bounded while for the killed `family` to be gone, reaping those reparented to us (a subreaper's
    orphans are its own to wait for). A live child of ours (a Popen not waited for yet) is never waited on.
    Those still there at the end are left to `_reap_adopted` when they are our children."""
    if not _LINUX:
        return
    me = os.getpid()
    left = set(family) - {q.pid for q in list(_live) if q.returncode is None}
    deadline = time.monotonic() + wait
    while left:
        for pid in list(left):
            try:
                ended = os.waitpid(pid, os.WNOHANG)[0] == pid
            except ChildProcessError:  # not our child (now): gone, or a zombie whose parent lives on outside the
                row = _stat(pid)  # family (a container's PID 1 may never reap it); else it is still to come to us
                ended = row is None or (row[0] == "Z" and row[1] not in left)
            if ended:
                left.discard(pid)
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    _adopted.update(pid for pid in left if (row := _stat(pid)) is not None and row[1] == me)


def _reap_adopted() -> None:
    """Reap the orphans reparented to us that were left running (`_adopted`) and have exited since."""
    if not _adopted:
        return
    for pid in list(_adopted):
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == 0:
                continue
        except ChildProcessError:
            pass
        _adopted.discard(pid)


def _adopt(p: subprocess.Popen[Any]) -> None:
    """Note, without killing them, the orphans p left that were reparented to us (`_adopted`)."""
    me = os.getpid()
    _adopted.update(pid for pid in _family(p) if (row := _stat(pid)) is not None and row[1] == me)


def _nothing_left(p: subprocess.Popen[Any]) -> bool:
    """Cheaply: nothing p started can be left (p is reaped, its group is empty and we have no child at all:
    as a subreaper, anything left of it would be our child or a descendant of one)."""
    if not _subreaper():
        return False
    try:
        os.killpg(p.pid, 0)
        return False
    except ProcessLookupError:
        pass
    except PermissionError:
        return False
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return False


def _reader(stream: IO[str], lines: queue.Queue[object]) -> None:
    try:
        for line in stream:
            lines.put(line)
    except (OSError, ValueError):
        pass
    finally:
        lines.put(_EOF)


class _Heartbeat:
    """'still running' while a child is silent: a transient status with the elapsed time on a terminal,
    a plain line every `every` seconds elsewhere."""

    def __init__(self, log: Log, what: str, *, every: float) -> None:
        self.log, self.what, self.every = log, what, every
        self.start = self.last = time.monotonic()
        self.tty = log.console.is_terminal and not log.quiet
        self.status: Any = None

    def output(self) -> None:
        self.last = time.monotonic()
        if self.status is not None:
            self.status.stop()
            self.status = None

    def tick(self) -> None:
        now = time.monotonic()
        if self.tty:
            if now - self.last >= 2.0:
                text = f"    {self.what}: running for {_elapsed(now - self.start)}"
                if self.status is None:
                    self.status = self.log.console.status(text)
                    self.status.start()
                else:
                    self.status.update(text)
        elif now - self.last >= self.every:
            self.last = now
            self.log.info(f"    … still running: {self.what} ({_elapsed(now - self.start)})")

    def close(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None


def _elapsed(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


@contextmanager
def _started(argv: list[str], *, cwd: Path | None, env: Mapping[str, str] | None,
             stdout: int, stderr: int, raw_errors: bool = False) -> Iterator[subprocess.Popen[str]]:
    """The child, started in a process group of its own; the group is killed if the block raises."""
    try:
        p = _popen(argv, cwd=cwd, env=dict(env) if env is not None else None, stdout=stdout, stderr=stderr, bufsize=1)
    except OSError as e:
        if raw_errors:
            raise
        why = "the program does not exist" if isinstance(e, FileNotFoundError) else str(e)
        raise ToolchainError(f"cannot start {argv[0]}", why=why,
                             fix=f"install {os.path.basename(argv[0])}" if isinstance(e, FileNotFoundError)
                             else "check that it is an executable program") from None
    try:
        yield p
    except BaseException:
        kill_group(p)
        raise


def run(
    argv: Sequence[str],
    *,
    log: Log,
    error: type[LlamaBundleError],
    what: str,
    fix: str = "",
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = DEFAULT_TIMEOUT,
    log_path: Path | None = None,
    on_line: Callable[[str], None] | None = None,
    echo_output: bool = False,
    label: str | None = None,
    heartbeat: float = HEARTBEAT,
) -> str:
    """Run argv; return its combined output. Raises `error` with the output's tail on failure or when
    `timeout` seconds pass (the whole process group is killed either way, and on KeyboardInterrupt). The
    'still running' lines name `label` (what runs), else `what`."""
    argv = [str(a) for a in argv]
    log.command(argv)
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    chunks: list[str] = []
    deadline = time.monotonic() + timeout if timeout is not None else None
    beat = _Heartbeat(log, label or what, every=heartbeat)
    logf = open(log_path, "a", encoding="utf-8") if log_path else None
    try:
        with _started(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as p:
            assert p.stdout is not None
            lines: queue.Queue[object] = queue.Queue()
            reader = threading.Thread(target=_reader, args=(p.stdout, lines), daemon=True)
            reader.start()
            exited_at: float | None = None
            while True:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    kill_group(p)
                    raise error(f"{what}: timed out after {_elapsed(timeout or 0)}",
                                why=f"`{' '.join(argv[:3])} …` was still running and was stopped with its children",
                                fix=fix, details=_tail_block(tail, log_path))
                if exited_at is None and p.poll() is not None:
                    exited_at = now
                if exited_at is not None and now - exited_at > ORPHAN_GRACE:
                    kill_group(p)  # it exited, but something it started still holds the output open
                try:
                    item = lines.get(timeout=0.5 if deadline is None else max(0.01, min(0.5, deadline - now)))
                except queue.Empty:
                    beat.tick()
                    continue
                if item is _EOF:
                    break
                line = str(item)
                beat.output()
                if logf:
                    logf.write(line)
                tail.append(line.rstrip("\n"))
                if log_path is None:
                    chunks.append(line)
                if on_line:
                    on_line(line)
                if echo_output:
                    log.info(line.rstrip("\n"))
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                rc = wait_exit(p, left)
            except subprocess.TimeoutExpired:
                kill_group(p)
                raise error(f"{what}: timed out after {_elapsed(timeout or 0)}", fix=fix,
                            details=_tail_block(tail, log_path)) from None
            _reap_group(p)
    finally:
        beat.close()
        if logf:
            logf.close()
    if rc != 0:
        raise error(f"{what} (exit code {rc})", why=f"`{' '.join(argv[:3])} …` failed", fix=fix,
                    details=_tail_block(tail, log_path))
    return "".join(chunks) if log_path is None else "\n".join(tail)


def _reap_group(p: subprocess.Popen[Any]) -> None:
    """A finished step leaves nothing behind: what is left of its group and family is killed (and reaped)."""
    if sys.platform == "win32":  # pragma: no cover
        _close_job(p, kill=False)  # what is left in the child's job dies with it
        return
    family = set() if _nothing_left(p) else _family(p)
    refused = _signal(p, family, signal.SIGKILL)
    _reap(family - refused)


def _tail_block(tail: collections.deque[str], log_path: Path | None) -> str:
    out = [f"--- last {len(tail)} lines of output ---", *tail]
    if log_path:
        out.append(f"--- full log: {log_path}")
    return "\n".join(out)


def inherited(names: Sequence[str]) -> dict[str, str]:
    """The variables of this process's environment among `names`: what a child run in a clean environment
    keeps (the Vulkan loader's driver lookup, for one)."""
    return {k: os.environ[k] for k in names if k in os.environ}


def start_daemon(argv: Sequence[str], *, env: Mapping[str, str], log_path: Path, timeout: float = 120) -> int:
    """Run a command that starts a server and leaves it running (`sccache --start-server`), in a session of its
    own so that no group kill of ours reaches the server; what they say goes to `log_path` (the server may hold it
    open, so nothing waits for its end). The command's exit code; OSError or Timeout as `capture`."""
    args = [str(a) for a in argv]
    with log_path.open("wb") as out:
        try:
            return subprocess.run(args, env=dict(env), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True, timeout=timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            raise Timeout(args, timeout) from None


@contextmanager
def serving(argv: Sequence[str], *, cwd: Path, env: Mapping[str, str], log_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A server for the length of the block (a bundle's ggml-rpc-server in the load check): started in a process
    group of its own (stdin closed, as every child), its output in `log_path`; its whole group killed and reaped when the block
    ends, however it ends. OSError when it cannot be started, as subprocess raises it."""
    args = [str(a) for a in argv]
    with open(log_path, "w", encoding="utf-8") as out:
        p = _popen(args, cwd=cwd, env=dict(env), stdout=out, stderr=subprocess.STDOUT)
    try:
        yield p
    finally:
        if p.poll() is None:
            kill_group(p, grace=1.0)
        _reap_group(p)


def wait_exit(p: subprocess.Popen[Any], timeout: float | None) -> int:
    """p's exit code, as `p.wait(timeout)`, but woken the moment it exits: subprocess polls with sleeps that grow
    to 50 ms, which a short query pays on every run (`llama-server --list-devices` in a cache hit's load check).
    Linux's pidfd (5.3 and later) makes that a select; elsewhere, and where it is refused, p.wait as it is."""
    if timeout is not None and p.returncode is None and hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(p.pid)
        except OSError:  # an older kernel, a seccomp filter; or gone and reaped already
            return p.wait(timeout=timeout)
        try:
            if not select.select([fd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(p.args, timeout)
        finally:
            os.close(fd)
    return p.wait(timeout=timeout)


def capture(argv: Sequence[str], *, cwd: Path | None = None, env: Mapping[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run a short query command (no echo) and return the completed process, whatever its exit code.
    On timeout its process group is killed and `Timeout` raised; a program that cannot
    be started raises OSError, as subprocess does."""
    args = [str(a) for a in argv]
    with _started(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, raw_errors=True) as p:
        assert p.stdout is not None and p.stderr is not None
        chunks: tuple[list[str], list[str]] = ([], [])
        readers = [threading.Thread(target=_drain, args=(stream, into), daemon=True)
                   for stream, into in zip((p.stdout, p.stderr), chunks, strict=True)]
        for r in readers:
            r.start()
        deadline = time.monotonic() + timeout
        try:
            wait_exit(p, timeout)
        except subprocess.TimeoutExpired:
            kill_group(p, grace=1.0)
            for r in readers:
                r.join(timeout=5)
            raise Timeout(args, timeout, output="".join(chunks[0]), stderr="".join(chunks[1])) from None
        for r in readers:  # it exited; what it started may hold the output open a while, not for ever
            r.join(timeout=max(0.0, min(ORPHAN_GRACE, deadline - time.monotonic())))
        _reap_group(p)
        for r in readers:
            r.join(timeout=5)
    return subprocess.CompletedProcess(args, p.returncode, "".join(chunks[0]), "".join(chunks[1]))


def _drain(stream: Any, into: list[str]) -> None:
    try:
        for piece in iter(lambda: stream.read(1 << 16), ""):
            into.append(piece)
    except (OSError, ValueError):
        pass


@dataclass(frozen=True, kw_only=True)
class Watched:
    """What `run_until` saw: every line, and whether the child exited by itself (returncode) or was stopped."""
    lines: list[str]
    returncode: int | None  # None: it was stopped
    stopped: bool


def run_until(argv: Sequence[str], *, env: Mapping[str, str], cwd: Path, timeout: float, idle: float,
              done: Callable[[str], bool], settling: Callable[[], bool],
              stop: Callable[[], None] | None = None) -> Watched:
    """Run argv, reading stdout and stderr (merged) line by line as they stream, for a program that may not
    exit once it has said what is wanted (a Wine process). After each line `done(line)` says whether the
    wanted output is complete; while `settling()` is true, `idle` seconds without output complete it too.
    Then the process group is killed, `stop()` runs (e.g. `wineserver -k`) and the result says it was
    stopped. Past `timeout` seconds: `Timeout`, with the lines seen as its output. A program that cannot be
    started raises OSError."""
    args = [str(a) for a in argv]
    p = _popen(args, cwd=cwd, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert p.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()
    stream = p.stdout

    def read() -> None:
        try:
            for line in stream:
                lines.put(line)
        except (OSError, ValueError):
            pass
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    seen: list[str] = []
    complete = False
    deadline = time.monotonic() + timeout
    try:
        while not complete:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Timeout(args, timeout, output="\n".join(seen))
            waiting = settling()
            try:
                line = lines.get(timeout=min(left, idle) if waiting else min(left, 0.5))
            except queue.Empty:
                complete = waiting
                continue
            if line is None:  # it exited by itself
                return Watched(lines=seen, returncode=p.wait(), stopped=False)
            line = line.rstrip("\r\n")
            seen.append(line)
            complete = done(line)
    finally:
        if p.poll() is None:
            # What left p's tree but holds its output (wineserver: setsid, stderr kept) is stop()'s to end
            # gracefully (a SIGKILLed wineserver loses what it had not saved); what stop() leaves is killed then.
            held = _detached_holders(p) if stop is not None else set()
            kill_group(p, grace=0, spare=held)
            if stop is not None:
                stop()
            if held:
                _reap(held - _signal(p, held, signal.SIGKILL))
        else:
            _adopt(p)
        reader.join(timeout=5)
    return Watched(lines=seen, returncode=None, stopped=True)


# ------------------------------------------------------------------------------------------ Windows: job objects

_jobs: dict[int, int] = {}  # a child's pid -> the handle of its job object (Windows)
JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE, JOB_OBJECT_EXTENDED_LIMIT_INFORMATION = 0x2000, 9  # <winnt.h>

if sys.platform == "win32":  # pragma: no cover - exercised on the Windows CI job only
    def _join_job(p: subprocess.Popen[Any]) -> None:
        """Windows: put the child in a job object of its own that kills every process in it when its handle closes
        (JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE): when `kill_group` or `_reap_group` closes it, and when llamabundle
        dies (the system closes its handles). What the child starts joins the job, whatever becomes of the child,
        where taskkill /T follows parent links only. Where a job cannot be made, the kill falls back to taskkill."""
        import ctypes
        from ctypes import wintypes

        class Basic(ctypes.Structure):
            _fields_ = [("PerProcessUserTimeLimit", ctypes.c_int64), ("PerJobUserTimeLimit", ctypes.c_int64),
                        ("LimitFlags", wintypes.DWORD), ("MinimumWorkingSetSize", ctypes.c_size_t),
                        ("MaximumWorkingSetSize", ctypes.c_size_t), ("ActiveProcessLimit", wintypes.DWORD),
                        ("Affinity", ctypes.c_size_t), ("PriorityClass", wintypes.DWORD), ("SchedulingClass", wintypes.DWORD)]

        class Counters(ctypes.Structure):
            _fields_ = [(name, ctypes.c_uint64) for name in ("ReadOperationCount", "WriteOperationCount", "OtherOperationCount",
                                                              "ReadTransferCount", "WriteTransferCount", "OtherTransferCount")]

        class Extended(ctypes.Structure):
            _fields_ = [("BasicLimitInformation", Basic), ("IoInfo", Counters), ("ProcessMemoryLimit", ctypes.c_size_t),
                        ("JobMemoryLimit", ctypes.c_size_t), ("PeakProcessMemoryUsed", ctypes.c_size_t),
                        ("PeakJobMemoryUsed", ctypes.c_size_t)]

        try:
            k32 = ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined]
            k32.CreateJobObjectW.restype = wintypes.HANDLE
            k32.CreateJobObjectW.argtypes = [ctypes.c_void_p, wintypes.LPCWSTR]
            k32.SetInformationJobObject.argtypes = [wintypes.HANDLE, ctypes.c_int, ctypes.c_void_p, wintypes.DWORD]
            k32.AssignProcessToJobObject.argtypes = [wintypes.HANDLE, wintypes.HANDLE]
            k32.CloseHandle.argtypes = [wintypes.HANDLE]
            job = k32.CreateJobObjectW(None, None)
            if not job:
                return
            info = Extended()
            info.BasicLimitInformation.LimitFlags = JOB_OBJECT_LIMIT_KILL_ON_JOB_CLOSE
            if (k32.SetInformationJobObject(job, JOB_OBJECT_EXTENDED_LIMIT_INFORMATION, ctypes.byref(info), ctypes.sizeof(info))
                    and k32.AssignProcessToJobObject(job, int(p._handle))):  # type: ignore[attr-defined]
                _jobs[p.pid] = job
            else:
                k32.CloseHandle(job)
        except (OSError, AttributeError, ValueError):
            pass


    def _close_job(p: subprocess.Popen[Any], *, kill: bool) -> bool:
        """Windows: end what is left in the child's job (with `kill`, the child too, at once) by closing it;
        whether it had one."""
        job = _jobs.pop(p.pid, None)
        if job is None:
            return False
        import ctypes

        k32 = ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined]
        if kill:
            k32.TerminateJobObject(ctypes.c_void_p(job), 1)
        k32.CloseHandle(ctypes.c_void_p(job))
        return True
