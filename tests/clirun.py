"""Run `llamabundle` in the test process: llamabundle.cli.main with the given arguments."""

from __future__ import annotations

import pytest

from llamabundle.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    """llamabundle.cli.main in this process; returns (exit code, stdout, stderr)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return e.value.code, out, err
