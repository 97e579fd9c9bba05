"""What makes nvcc's output the same in every build (nvcc_launch.py says why each part is needed): the
launcher and the pin of cicc's seed and clocks it preloads, written into the build tree and compiled there before configuring
(shown by `llamabundle show` with the other commands), and the check that this machine lets a process turn
its address randomisation off."""

from __future__ import annotations

import sys
from pathlib import Path

from ... import proc
from ..base import Launcher
from . import nvcc_launch

DIR = "llamabundle-cuda"  # in the build tree
CICC_PIN_C = """\
/* Written by llamabundle (LD_PRELOAD, set by nvcc_launch.py): in NVIDIA's cicc only (every other program
   nvcc starts is left alone), srand() gets one fixed seed (cicc seeds it from the time and its process id)
   and the clocks tick one microsecond per call from a fixed instant (cicc's optimiser's choices follow
   how long it has run). With address randomisation off, its output is then the same in every run. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>

static long long ticks;
static int pinned(void) { return strcmp(program_invocation_short_name, "cicc") == 0; }
static long long tick(void) { return 1700000000000000LL + ticks++; }  /* microseconds */
#define REAL(name, type) ((type)dlsym(RTLD_NEXT, name))

void srand(unsigned seed) {
    REAL("srand", void (*)(unsigned))(pinned() ? 1u : seed);
}
time_t time(time_t *t) {
    if (!pinned()) return REAL("time", time_t (*)(time_t *))(t);
    time_t now = (time_t)(tick() / 1000000);
    if (t) *t = now;
    return now;
}
int gettimeofday(struct timeval *tv, void *tz) {
    if (!pinned()) return REAL("gettimeofday", int (*)(struct timeval *, void *))(tv, tz);
    long long us = tick();
    tv->tv_sec = (time_t)(us / 1000000);
    tv->tv_usec = (suseconds_t)(us % 1000000);
    return 0;
}
int clock_gettime(clockid_t id, struct timespec *ts) {
    if (!pinned()) return REAL("clock_gettime", int (*)(clockid_t, struct timespec *))(id, ts);
    long long us = tick();
    ts->tv_sec = (time_t)(us / 1000000);
    ts->tv_nsec = (long)(us % 1000000) * 1000;
    return 0;
}
clock_t clock(void) {
    if (!pinned()) return REAL("clock", clock_t (*)(void))();
    return (clock_t)(ticks++);
}
"""


def launcher(*, c_compiler: str, source_dir: Path, build_dir: Path) -> Launcher:
    """The CUDA compiler launcher for a tree configured at `source_dir` / `build_dir` (the fixed-length
    paths the compiles see)."""
    d = build_dir / DIR
    script, pin_c, pin = d / "nvcc_launch.py", d / "cicc_pin.c", d / "cicc_pin.so"
    return Launcher(
        language="CUDA",
        argv=(sys.executable, "-I", str(script), str(source_dir), str(build_dir), str(pin)),
        files=((str(script), Path(nvcc_launch.__file__).read_text(encoding="utf-8")), (str(pin_c), CICC_PIN_C)),
        commands=((c_compiler, "-shared", "-fPIC", "-O2", "-o", str(pin), str(pin_c), "-ldl"),),
        why="nvcc's output the same in every run (a per-file -frandom-seed, no address randomisation, cicc's seed and clocks pinned)",
    )


def randomisation_refused() -> str | None:
    """Why this machine will not let the launcher turn address randomisation off (None: it will). Asked of a
    child process, so this one's personality is left alone."""
    probe = "import sys; from llamabundle.backends.cuda import nvcc_launch as n; sys.exit(0 if n.no_address_randomisation() else 1)"
    try:
        done = proc.capture([sys.executable, "-c", probe], timeout=60)
    except (OSError, proc.Timeout) as e:
        return f"the check could not run ({e})"
    return None if done.returncode == 0 else "personality(ADDR_NO_RANDOMIZE) was refused (a seccomp profile, e.g. Docker's default)"
