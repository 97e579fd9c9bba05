"""nvcc's compiler launcher, written by llamabundle into a CUDA build tree and run by CMake in front of every
CUDA compile (CMAKE_CUDA_COMPILER_LAUNCHER, before ccache): it makes NVIDIA's compiler give the same bytes
in every run. Standalone (run as `python -I nvcc_launch.py SOURCE_ROOT BUILD_ROOT CICC_PIN.so COMMAND...`,
the roots as the build names them; it imports nothing of llamabundle).

Two things made ggml-cuda's objects differ between two builds of the same inputs (measured with nvcc
13.0.88 on llama.cpp's fattn-tile instances; bench/results/gpu-h200-cuda-repro/):

1. cudafe++ names a function-local `__shared__` variable after a module id hashed from the working
   directory and its process id: `-frandom-seed=<the source file's path in the tree>` replaces both.
2. cicc (NVVM) is not deterministic on identical input: it seeds rand() from the time and its pid, and
   its optimiser's choices follow heap addresses and how long it has run. Address randomisation off
   (personality ADDR_NO_RANDOMIZE, inherited by every process nvcc starts), and in cicc a fixed srand()
   seed and clocks that tick per call (CICC_PIN.so, through LD_PRELOAD) make its output identical run to
   run. Its memory layout still follows the lengths of the paths it is given and of its environment, so
   the build runs through source and build paths of one fixed length (build.py), PWD (which the shell
   ninja runs sets to the real directory) is the build's fixed-length path, and in nvcc and cicc the pin
   answers getcwd(), realpath() and readlink("/proc/self/exe") with the fixed paths of the source, the
   build and the toolkit (LLAMABUNDLE_FIXED_PATHS): cicc keeps the working directory on its heap, nvcc
   hands it the resolved source path (--orig_src_path_name), both find the toolkit from where they run,
   and the real lengths of any of these changed the PTX (fattn-tile dkq72 with build directories of 53
   and 92 characters, dkq40 with sources at 53 and 125 and with toolkits at 69 and 104, each stable run
   to run; identical with the pin).
"""

from __future__ import annotations

import ctypes
import os
import sys

ADDR_NO_RANDOMIZE = 0x0040000


def seed_of(command: list[str], root: str) -> str | None:
    """The source file's path relative to the tree (`-c FILE`), or its name when it lies elsewhere."""
    if "-c" not in command or command.index("-c") + 1 >= len(command):
        return None
    source = command[command.index("-c") + 1]
    prefix = root.rstrip("/") + "/"
    return source[len(prefix):] if source.startswith(prefix) else os.path.basename(source)


def no_address_randomisation() -> bool:
    """Turn address randomisation off for this process and what it executes; False where the kernel or a
    seccomp profile (Docker's default) refuses it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        current = int(libc.personality(0xFFFFFFFF))
        return current != -1 and int(libc.personality(current | ADDR_NO_RANDOMIZE)) != -1
    except (OSError, AttributeError):
        return False


def main(argv: list[str]) -> int:
    if len(argv) < 5:
        sys.stderr.write("usage: nvcc_launch.py SOURCE_ROOT BUILD_ROOT CICC_PIN.so COMMAND...\n")
        return 2
    root, build, pin, command = argv[1], argv[2], argv[3], argv[4:]
    if not os.path.isfile(pin):
        sys.stderr.write(f"llamabundle: {pin} is missing (the build compiles it before configuring): "
                         "run the llamabundle build again\n")
        return 2
    seed = seed_of(command, root)
    if seed is not None:
        command = [*command, f"-frandom-seed={seed}"]
    no_address_randomisation()  # llamabundle warned before the build where this machine refuses it
    if os.path.isdir(build) and os.path.samefile(build, "."):
        os.environ["PWD"] = build
    # nvcc's toolkit, <toolkit>/bin/nvcc (its fixed link): nvcc is the command, or follows a compiler cache (ccache nvcc …)
    nvcc = next((c for c in command if os.path.basename(c) in ("nvcc", "nvcc.exe")), command[0])
    toolkit = os.path.dirname(os.path.dirname(nvcc))
    fixed = [root, build, *([toolkit] if os.path.isabs(toolkit) else [])]
    os.environ["LLAMABUNDLE_FIXED_PATHS"] = ":".join(fixed)  # what the pin maps the real directories back to
    preload = os.environ.get("LD_PRELOAD")
    os.environ["LD_PRELOAD"] = f"{pin}:{preload}" if preload else pin
    try:
        os.execvp(command[0], command)
    except OSError as e:
        sys.stderr.write(f"llamabundle: cannot run {command[0]}: {e.strerror}\n")
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv))
