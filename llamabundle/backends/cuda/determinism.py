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
/* Written by llamabundle (LD_PRELOAD, set by nvcc_launch.py).
   In NVIDIA's cicc only, srand() gets one fixed seed (cicc seeds it from the time and its process id)
   and the clocks tick one microsecond per call from a fixed instant (cicc's optimiser's choices follow
   how long it has run).
   In nvcc and cicc, getcwd(), realpath() and readlink("/proc/self/exe") answer with the build's
   fixed-length paths (LLAMABUNDLE_FIXED_PATHS, colon-separated: source, build, toolkit) where the real
   answer lies under the directory one of them links to: cicc keeps the working directory on its heap,
   nvcc passes it the resolved source path, both find the toolkit from where they run, and the lengths
   of all three changed the PTX through cicc's heap layout.
   Every other program nvcc starts is left alone. With address randomisation off, cicc's output is then
   the same in every run and in every directory. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static long long ticks;
static int named(const char *name) { return strcmp(program_invocation_short_name, name) == 0; }
static int pinned(void) { return named("cicc"); }
static int mapped(void) { return named("cicc") || named("nvcc"); }
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

/* `path` (resolved) with the real directory of a fixed path replaced by that fixed path, into out[cap];
   0 where none applies or it does not fit. */
static int to_fixed(const char *path, char *out, size_t cap) {
    const char *list = getenv("LLAMABUNDLE_FIXED_PATHS");
    char *(*real_realpath)(const char *, char *) = REAL("realpath", char *(*)(const char *, char *));
    char fixed[PATH_MAX], real[PATH_MAX];
    while (list && *list) {
        size_t n = strcspn(list, ":");
        if (n > 0 && n < sizeof fixed) {
            memcpy(fixed, list, n);
            fixed[n] = 0;
            size_t r;
            if (real_realpath(fixed, real) && (r = strlen(real)) > 1 && strncmp(path, real, r) == 0
                && (path[r] == 0 || path[r] == '/')) {
                if (n + strlen(path + r) + 1 > cap) return 0;
                memcpy(out, fixed, n);
                strcpy(out + n, path + r);
                return 1;
            }
        }
        list += n + (list[n] == ':');
    }
    return 0;
}
char *getcwd(char *buf, size_t size) {
    char *cwd = REAL("getcwd", char *(*)(char *, size_t))(NULL, 0);
    char fixed[PATH_MAX];
    if (!cwd) return NULL;
    const char *answer = mapped() && to_fixed(cwd, fixed, sizeof fixed) ? fixed : cwd;
    size_t n = strlen(answer) + 1;
    if (!buf) {
        buf = malloc(size > n ? size : n);
    } else if (size < n) {
        errno = ERANGE;
        buf = NULL;
    }
    if (buf) memcpy(buf, answer, n);
    free(cwd);
    return buf;
}
ssize_t readlink(const char *path, char *buf, size_t size) {
    ssize_t n = REAL("readlink", ssize_t (*)(const char *, char *, size_t))(path, buf, size);
    char real[PATH_MAX], fixed[PATH_MAX];
    if (n <= 0 || (size_t)n >= sizeof real || !mapped() || strcmp(path, "/proc/self/exe") != 0) return n;
    memcpy(real, buf, (size_t)n);
    real[n] = 0;
    if (!to_fixed(real, fixed, sizeof fixed) || strlen(fixed) > size) return n;
    size_t m = strlen(fixed);
    memcpy(buf, fixed, m);  /* readlink does not terminate what it writes; the longer real answer's tail is cleared */
    if ((size_t)n > m) memset(buf + m, 0, (size_t)n - m);
    return (ssize_t)m;
}
char *realpath(const char *path, char *resolved) {
    char *r = REAL("realpath", char *(*)(const char *, char *))(path, resolved);
    char fixed[PATH_MAX];
    if (!r || !mapped() || !to_fixed(r, fixed, sizeof fixed)) return r;
    if (resolved) return strcpy(resolved, fixed);  /* the caller's buffer holds PATH_MAX */
    free(r);
    return strdup(fixed);
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
        why="nvcc's output the same in every run (a per-file -frandom-seed, no address randomisation, cicc's seed and "
            "clocks pinned, the fixed paths for the working directory and resolved paths in nvcc and cicc)",
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
