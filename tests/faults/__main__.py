"""`python -m tests.faults [--before REF] [--only TEXT] [--json FILE]`: run the fault matrix against this
checkout (and, with --before, against a worktree of REF: the exit code each case had there) and print its
table and totals."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.faults.cases import CASES, ROOT, Outcome, run_case


def _worktree(ref: str, where: Path) -> Path:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(where), ref], check=True)
    return where


def _cell(o: Outcome | None) -> str:
    if o is None:
        return ""
    if o.code is None:
        return "skipped"
    return (str(o.code) + (" traceback" if o.traceback else "") + (f", {o.left_bytes} bytes left" if o.left_bytes else "")
            + (f", {len(o.procs)} running" if o.procs else ""))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.faults", description=__doc__)
    ap.add_argument("--before", metavar="REF", help="also run each case against a worktree of this commit")
    ap.add_argument("--only", metavar="TEXT", help="only the cases whose group or name holds TEXT")
    ap.add_argument("--json", metavar="FILE", type=Path, help="write every outcome there")
    args = ap.parse_args(argv)
    cases = [c for c in CASES if not args.only or args.only in f"{c.group} {c.id}"]
    work = Path(tempfile.mkdtemp(prefix="lb-faults-"))
    before_tree = _worktree(args.before, work / "before-tree") if args.before else None
    rows = []
    try:
        for i, c in enumerate(cases):
            now = run_case(c, work / f"now-{i}", ROOT)
            was = run_case(c, work / f"before-{i}", before_tree) if before_tree else None
            rows.append((c, was, now))
            print(f"[{i + 1}/{len(cases)}] {c.group}: {c.id}: {_cell(now)}", file=sys.stderr)
    finally:
        if before_tree is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before_tree)], check=False)
        shutil.rmtree(work, ignore_errors=True)
    print(f"| group | case | documented | {'before (' + args.before + ') | ' if args.before else ''}now | bytes left | processes left |")
    print(f"|---|---|---|{'---|' if args.before else ''}---|---|---|")
    for c, was, now in rows:
        before = f"{_cell(was)} | " if args.before else ""
        print(f"| {c.group} | {c.id} | {c.expect} | {before}{_cell(now)} | {now.left_bytes} | {len(now.procs)} |")
    ran = [(c, now) for c, _was, now in rows if now.code is not None]
    refused = sum(1 for c, now in ran if now.code == c.expect and c.expect != 0)
    survived = sum(1 for c, now in ran if now.code == c.expect and c.expect == 0)
    print(f"\nfaults tried {len(ran)} (skipped {len(rows) - len(ran)}); refused with the documented exit code "
          f"{refused}; survived {survived}; other exit codes {len(ran) - refused - survived}; bytes left "
          f"{sum(now.left_bytes for _, now in ran)}; processes left {sum(len(now.procs) for _, now in ran)}; "
          f"tracebacks {sum(now.traceback for _, now in ran)}")
    if args.before:
        before_ok = sum(1 for c, was, _ in rows if was is not None and was.code == c.expect and not was.traceback)
        print(f"before ({args.before}): {before_ok} of {len(rows)} cases ended as documented; "
              f"tracebacks {sum(1 for _, was, _ in rows if was is not None and was.traceback)}")
    if args.json:
        args.json.write_text(json.dumps([{"group": c.group, "case": c.id, "expect": c.expect,
                                          "now": vars(now), "before": vars(was) if was else None}
                                         for c, was, now in rows], indent=1), encoding="utf-8")
    bad = [c for c, now in ran if now.code != c.expect or now.traceback or now.left_bytes or now.procs]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
