"""Loading a Windows bundle on Linux: its `llamabundle-probe.exe` (where it has one), then `wine llama-server.exe
--verbose --list-devices`, in a private prefix (never the user's ~/.wine). Wine 8 does not exit after the
device list, so that run is stopped once the list is complete."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from filelock import FileLock

from ... import proc
from ...errors import VerifyError
from ..load import (
    DEVICE,
    PROBE_PROGRAM,
    Loaded,
    checked_run,
    from_probe,
    read_list_devices,
    read_probe,
    until_complete,
    windows_env,
)

TIMEOUT = 300  # a new Wine prefix boots first (20-60 s)
QUIET = 2.0  # seconds without output after the device list: the list is complete
STOPPED = "stopped after the device list: Wine 8 does not exit"


def check_load(root: Path, *, prefix: Path) -> Loaded:
    """The CPU backend must load from inside the bundle (Wine prints Z:\\… paths). Skipped with a reason
    when wine is not installed."""
    wine = shutil.which("wine")
    if wine is None:
        return Loaded(level="skipped: wine is not installed (a Windows bundle runs on Linux only under Wine)")
    exe = root / "llama-server.exe"
    if not exe.is_file():
        raise VerifyError("the bundle has no llama-server.exe", fix="include llama-server in the recipe's targets")
    prefix.mkdir(parents=True, exist_ok=True)
    wine_dir = str(Path(wine).parent)
    env = {"PATH": f"{wine_dir}:/usr/bin:/bin", "HOME": str(prefix), "LANG": "C.UTF-8", "WINEPREFIX": str(prefix),
           "WINEDEBUG": "-all", "WINEDLLOVERRIDES": "mscoree,mshtml=", "TMPDIR": str(root.parent)}
    wineserver = shutil.which("wineserver", path=env["PATH"])

    def stop() -> None:
        if wineserver:
            proc.capture([wineserver, "-k"], env=env, timeout=60)

    stopped = []

    # the environment a native Windows run gets (platforms.load.clean_env), through a launcher that clears
    # Wine's own first (Wine gives every process its registry's TEMP, PATH and profile variables)
    native = windows_env(unix_to_wine(root), unix_to_wine(root.parent), WINE_SYSTEM_ROOT)
    launcher = root.parent / LAUNCHER
    launcher.write_text(launcher_script(native, unix_to_wine(exe), ["--verbose", "--list-devices"]),
                        encoding="utf-8", newline="\r\n")

    def run() -> list[str]:
        with FileLock(str(prefix) + ".lock"):  # one run per prefix: wineserver -k ends every process in it
            res = run_until_device_list([wine, "cmd", "/c", unix_to_wine(launcher)], env=env, cwd=root, stop=stop)
        if not res.stopped and res.returncode != 0:
            raise VerifyError(f"wine llama-server.exe --list-devices exited with {res.returncode}",
                              why="the bundle does not load under Wine", details="\n".join(res.lines[-20:]))
        stopped.append(res.stopped)
        return res.lines

    probe = root / f"{PROBE_PROGRAM}.exe"
    if probe.is_file():  # it answers for the bundle; llama-server.exe then runs once, to list the same devices
        said = _probe_under_wine(probe, root=root, native=native, env=env, prefix=prefix, wine=wine)
        lines = run()
        loaded = Loaded(level=f"passed (under Wine; {PROBE_PROGRAM}.exe, then llama-server.exe: "
                        + (STOPPED + ")" if stopped[-1] else "it exited 0)"), env=native, source=PROBE_PROGRAM)
        from_probe(said, root=root, loaded=loaded, server=lines, exe="llama-server.exe", translate=wine_to_unix)
        return loaded
    lines = until_complete(run)  # llama.cpp's log thread may lose lines at exit, as natively
    loaded = Loaded(level="passed (under Wine; " + (STOPPED + ")" if stopped[-1] else "it exited 0)"), env=native)
    read_list_devices(lines, root=root, loaded=loaded, exe="llama-server.exe", where=" under Wine",
                      translate=wine_to_unix)
    return loaded


def _probe_under_wine(probe: Path, *, root: Path, native: Mapping[str, str], env: Mapping[str, str], prefix: Path,
                      wine: str) -> dict[str, object]:
    """The bundle's probe run under Wine in the native environment (a launcher of its own): it exits by itself."""
    launcher = root.parent / PROBE_LAUNCHER
    launcher.write_text(launcher_script(native, unix_to_wine(probe), []), encoding="utf-8", newline="\r\n")
    with FileLock(str(prefix) + ".lock"):
        out = checked_run([wine, "cmd", "/c", unix_to_wine(launcher)], env=env, cwd=root, timeout=TIMEOUT,
                          what=f"wine {probe.name}", failed="the bundle does not load under Wine")
    return read_probe(out.stdout, root=root, exe=probe.name)


def run_until_device_list(argv: list[str], *, env: dict[str, str], cwd: Path, timeout: float | None = None,
                          quiet: float | None = None, stop: Callable[[], None] | None = None) -> proc.Watched:
    """Run argv until its device list is complete: 'Available devices:' was seen and either a line that is
    not a device follows or the output goes quiet for `quiet` seconds. Then it is stopped (and `stop()` runs)."""
    timeout = TIMEOUT if timeout is None else timeout
    state = {"in_list": False}

    def done(line: str) -> bool:
        if line.startswith("Available devices"):
            state["in_list"] = True
            return False
        return state["in_list"] and not DEVICE.match(line)

    try:
        return proc.run_until(argv, env=env, cwd=cwd, timeout=timeout, idle=QUIET if quiet is None else quiet,
                              done=done, settling=lambda: state["in_list"], stop=stop)
    except proc.Timeout as e:
        seen = (e.output or "").splitlines()
        raise VerifyError(f"{' '.join(Path(a).name for a in argv)} listed no devices in {timeout:.0f}s",
                          details="\n".join(seen[-20:])) from None
    except OSError as e:
        raise VerifyError(f"{argv[0]} could not be started", why=str(e)) from None


WINE_SYSTEM_ROOT = "C:\\windows"  # where a Wine prefix keeps Windows
LAUNCHER = "llamabundle-load.cmd"  # beside the bundle: runs it in the native environment
PROBE_LAUNCHER = "llamabundle-probe.cmd"  # the same, for the bundle's probe


def launcher_script(env: Mapping[str, str], exe: str, args: Sequence[str]) -> str:
    """A batch file that empties the environment, sets `env` and runs `exe args`, exiting with its code (cmd's
    `set "NAME=value"` takes any value but `%`, doubled here; Windows paths hold no `"`)."""
    lines = ["@echo off", "for /f \"delims==\" %%v in ('set') do set \"%%v=\""]
    lines += [f'set "{k}={v.replace("%", "%%")}"' for k, v in env.items()]
    lines += [" ".join([f'"{exe.replace("%", "%%")}"', *map(_batch_arg, args)]), "exit /b %ERRORLEVEL%"]
    return "\n".join(lines) + "\n"


def _batch_arg(arg: str) -> str:
    """An argument on a batch file's command line: quoted only where cmd would split or read it otherwise (a
    quoted plain word reaches some programs with its quotes: cmd.exe's own /c)."""
    arg = arg.replace("%", "%%")
    return f'"{arg}"' if not arg or re.search(r'[\s&|<>^()",;=]', arg) else arg


def unix_to_wine(path: Path) -> str:
    """/tmp/b/x.dll -> Z:\\tmp\\b\\x.dll (Wine maps Z: to /)."""
    return "Z:" + str(path.resolve()).replace("/", "\\")


def wine_to_unix(path: str) -> str:
    """Z:\\tmp\\b\\x.dll -> /tmp/b/x.dll (Wine maps Z: to /); other paths unchanged."""
    m = re.match(r"^[Zz]:[\\/](.*)$", path)
    return "/" + m.group(1).replace("\\", "/") if m else path
