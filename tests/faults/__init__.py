"""The fault matrix (issue 30): hostile inputs, kills at chosen points, full and read-only disks, locales and
hanging tools, each run through the real CLI in a process of its own against a source tree, with its
documented exit code and what must hold after it: no traceback, no bytes left behind, no process left
running. `python -m tests.faults [--before REF]` prints the table (the exit code each case had at REF beside
today's); `tests/faults/test_matrix.py` (marker `faults`) runs the same cases in the test suite."""
