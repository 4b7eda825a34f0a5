"""What several test files share: running the command line (in a new process or in this one) and
its one-line errors."""

import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import run

ROOT = Path(__file__).resolve().parent.parent
CACHE = os.environ["EGG_TEST_CORPORA"]  # --dir_path of the tests' runs (set by conftest.py)


def cli(*flags, cwd=ROOT, env=None, timeout=600):
    """python run.py FLAGS in a fresh process."""
    return subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *flags],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def optimised_env() -> dict:
    """This environment with XLA's own compilation settings back (conftest.py trades run time for
    compile time in the compile-bound tests): for a subprocess that trains long enough for them to
    pay (3x here)."""
    return dict(
        os.environ, XLA_FLAGS=os.environ["XLA_FLAGS"].replace(os.environ["EGG_TEST_FAST_COMPILE"], "")
    )


def one_line_error(result, message):
    """Bad input: exit code 2 and one line on stderr holding `message`, no traceback."""
    assert result.returncode == 2, result.stderr[-1000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.stderr, result.stderr


class Result(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def in_process(capsys, *flags) -> Result:
    """run.main(FLAGS) in this process, without a new interpreter's start-up (most of a short
    subprocess's time is `import jax`): its exit code and what it printed."""
    capsys.readouterr()
    try:
        run.main(list(flags))
        code = 0
    except SystemExit as exit:
        code = exit.code
    out, err = capsys.readouterr()
    return Result(code, out, err)
