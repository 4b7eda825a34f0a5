"""What several test files share: running the command line, its one-line errors, and a slow
reference the population forward is compared against."""

import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

import run

ROOT = Path(__file__).resolve().parent.parent


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


def one_line_error(result, message):
    """Bad input: exit code 2 and one line on stderr holding `message`, no traceback."""
    assert result.returncode == 2, result.stderr[-1000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.stderr, result.stderr


def member_log2_likelihood(params, nz, sign, h, inputs, targets, cfg, tables):
    """One member alone, byte by byte: the sum of log2 p(target | prefix) at LL_FRAC and the final
    hidden states (run.population_fitness does the same for a whole population at once)."""

    def step(h, io):
        tok, target = io
        logits, h, _ = run.token_logits(params, nz, sign, h, tok, cfg, tables)
        return h, run.log2_likelihood(logits, target, tables)

    h, ll = jax.lax.scan(step, h, (inputs, targets))
    return jnp.sum(ll), h
