"""What several test files share: the tiny run's configuration, running the command line (in a new
process or in this one), its one-line errors, and calling run.py's replica-axis functions for a
single model."""

import contextlib
import io
import os
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import run
from egg import checkpoints, flags

ROOT = Path(__file__).resolve().parent.parent
CACHE = os.environ["EGG_TEST_CORPORA"]  # --dir_path of the tests' runs (set by conftest.py)


def cli(*flags, cwd=ROOT, env=None, timeout=600, script="run.py"):
    """python run.py FLAGS (or another of the repository's scripts) in a fresh process."""
    return subprocess.run(
        [sys.executable, str(ROOT / script), *flags],
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
        os.environ,
        XLA_FLAGS=os.environ["XLA_FLAGS"].replace(os.environ["EGG_TEST_FAST_COMPILE"], ""),
    )


# XLA's optimisations back for one program (conftest.py turns them off in the whole process: most
# of the tests' programs spend more time compiling than running), as jax.jit's compiler_options or
# Lowered.compile's: for a program that runs long (3x faster here); integer results do not depend on
# them
OPTIMISED = {"xla_backend_optimization_level": 3}


def devices_env(devices) -> dict:
    """This environment with `devices` virtual CPU devices, or (None) no device count set from
    outside, compiled as conftest.py compiles (these programs run a few generations: they spend
    most of their time compiling)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    count = "" if devices is None else f"--xla_force_host_platform_device_count={devices} "
    env["XLA_FLAGS"] = count + os.environ["EGG_TEST_FAST_COMPILE"]
    return env


def one_line_error(result, message):
    """Bad input: exit code 2 and one line on stderr holding `message`, no traceback."""
    assert result.returncode == 2, result.stderr[-1000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in result.stderr, (
        result.stderr
    )


class Result(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def in_process(capsys, *flags) -> Result:
    """run.main(FLAGS) in this process, without a new interpreter's start-up (most of a short
    subprocess's time is `import jax`): its exit code and what it printed."""
    capsys.readouterr()
    code = main_code(flags)
    out, err = capsys.readouterr()
    return Result(code, out, err)


def main_code(flags) -> int:
    """run.main(FLAGS)'s exit code: 0, or the code it exits with."""
    try:
        run.main(list(flags))
        return 0
    except SystemExit as exit:
        return exit.code


def run_here(*flags) -> Result:
    """run.main(FLAGS) in this process, what it prints caught here rather than by capsys (which a
    module's fixture cannot take): for a run that needs no process of its own (no signal, no kill,
    no device count of its own), without an interpreter's start-up and the tracing this one has
    done."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main_code(flags)
    return Result(code, out.getvalue(), err.getvalue())


# The tiny run every end-to-end test trains: 8D-2L, population 16 in groups of 4, 8 bytes a member,
# validated on 8 rows of 16 bytes, a fixed share alpha 0.2. The pinned hashes of test_replicas.py
# are this run's.
TINY = (
    f"--data stdlib --dir_path {CACHE} --n_embd 8 --n_layer 2 --parallel_generations_per_gpu 16 "
    "--group_size 4 --tokens_per_update 8 --validation_batch_size 8 --validation_tokens 16 "
    "--alpha 0.2"
).split()


def add_entries(monkeypatch, **entries):
    """Each entry added to its table (models=, shapings=, rules=, objectives= {name: entry}), then
    what importing run.py derives from the tables: Args and CONDITIONS (run.every_flag)."""
    for table, added in entries.items():
        for name, entry in added.items():
            monkeypatch.setitem(getattr(run, table.upper()), name, entry)
    every, conditions = run.every_flag()
    monkeypatch.setattr(run, "Args", every)
    monkeypatch.setattr(run, "CONDITIONS", conditions)


def tiny_args(*given, **changes) -> run.Args:
    """The tiny run's Args (TINY), with more flags and changed fields, for the tests that call
    run.py's functions directly."""
    return flags.replace(run.parse_args([*TINY, *given]), **changes)


def chosen(cfg, name: str):
    """A setting as make_config chose it: the Config's own, else its entries' own flags'."""
    for own in (cfg.rule_flags, cfg.shaping_flags, cfg.model_flags):
        if own is not None and hasattr(own, name):
            return getattr(own, name)
    return getattr(cfg, name)


def thresholds(args: run.Args, cfg, generation: int = 0) -> np.ndarray:
    """run.z_thresholds (2,) of the flags' first replica at a generation."""
    return run.z_thresholds(cfg, run.alpha_at(cfg, run.replicas_of(args)[0], generation))


def alpha_schedule(args: run.Args) -> np.ndarray:
    """run.alpha_at of the flags' first replica at generations 0, ..., --num_epochs - 1."""
    cfg, replica = run.make_config(args), run.replicas_of(args)[0]
    return np.array([run.alpha_at(cfg, replica, t) for t in range(args.num_epochs)])


def z_thresholds(args: run.Args, cfg) -> np.ndarray:
    """(--num_epochs, 2) int32: thresholds at every generation of the flags' first replica."""
    return np.stack([thresholds(args, cfg, t) for t in range(args.num_epochs)])


def upstream_args(**changes) -> run.Args:
    """Args of upstream's algorithm (--algorithm upstream) with these fields: the Z-test's tests."""
    return flags.replace(run.parse_args(["--algorithm", "upstream"]), **changes)


def fitness_of_one_model(params, noise, states, inputs, targets, sigma_shift: int, cfg):
    """run.forward of one model, compiled as the generation step is: (fitness (M,), states)."""
    forward = jax.jit(run.forward, static_argnums=6, compiler_options=run.compiler_options(cfg))
    fitness, states = forward(params, noise, states, inputs, targets, np.int32(sigma_shift), cfg)
    return np.asarray(fitness), np.asarray(states)


# one program each, compiled once a configuration, as a run compiles them (called op by op, each of
# their operations would compile on its own: hundreds a configuration)
generation_noise = jax.jit(run.generation_noise, static_argnums=0)
init_params = jax.jit(run.init_params, static_argnums=0)


@partial(jax.jit, static_argnums=5)
def es_update(params, rule_state, noise, scores, thresholds, cfg):
    """One model's update as the generation step makes it from every noise of the generation
    (run.generation_noise) and the scores (scored_pairs,), segment-major: the pairs' weights, Z of
    every parameter, then the rule; compiled as one program, as generation_noise."""
    # (noise_pairs,), as generation_noise orders them
    weights = run.pair_weights(scores, cfg).reshape(-1)
    z = run.z_statistics(noise, weights, cfg)
    return run.apply_rule(params, rule_state, z, weights, thresholds, cfg)


def one_model_step(step, carry, batch, generation: int, thresholds, seed: int, sigma_shift: int):
    """A compiled step (run.make_generation_step) of a single model: carry (params, rule_state,
    states) without the replica axis in and out; (params, opt, states, fitness, moved) as numpy."""
    add = partial(jax.tree.map, lambda x: np.asarray(x)[None])
    inputs = (
        np.asarray(thresholds)[None],
        np.array([seed], np.int32),
        np.array([sigma_shift], np.int32),
    )
    out = step(*add(carry), batch, np.int32(generation), *inputs)
    return jax.tree.map(lambda x: np.asarray(x)[0], out)


def checkpoint_digest(folder: Path) -> str:
    """checkpoints.checkpoint_digest, the arrays' dtypes checked first."""
    for name, dtype in (
        ("params.npz", np.int8),
        ("states.npz", np.int8),
        ("optimizer.npz", np.int16),
    ):
        if (folder / name).exists():
            with np.load(folder / name) as f:
                assert all(f[key].dtype == dtype for key in f.files), name
    return checkpoints.checkpoint_digest(folder)


# One member on its own: run.py's model functions take the members' axes (R, D, S); these give
# them one member (all three of size 1) on the given side, and take its result back out.


def member_sides(sign: int, sigma_shift: int) -> run.Sides:
    return run.Sides(jnp.full((1, 1, 1), sign, jnp.int32), jnp.int32(sigma_shift))


def pair_axes(nz):
    """One pair's noise (a tuple of factors, or one array) with the axis D = 1 in front."""
    if nz is None:
        return None
    return (
        tuple(jnp.asarray(f)[None] for f in nz) if isinstance(nz, tuple) else jnp.asarray(nz)[None]
    )


def member_vector(p, nz, sign: int, sigma_shift: int):
    """run.perturbed_vector of one member: p (n,) with its pair's noise (n,)."""
    out = run.perturbed_vector(jnp.asarray(p), pair_axes(nz), member_sides(sign, sigma_shift))
    return np.asarray(out).reshape(np.shape(p))


def member_matmul(x, w, nz, sign: int, sigma_shift: int):
    """run.matmul of one member: x (n,), w (m, n), nz its pair's (A, B), full noise, or None ->
    (m,)."""
    x = jnp.asarray(x).reshape(1, 1, 1, -1)
    out = run.matmul(x, jnp.asarray(w), pair_axes(nz), member_sides(sign, sigma_shift))
    return np.asarray(out).reshape(-1)


def member_embed(emb, tok: int, nz, sign: int, sigma_shift: int):
    """run.embed of one member reading byte `tok` -> (n,)."""
    tok = jnp.full((1, 1, 1), tok, jnp.uint8)
    noise = None if nz is None else {"emb": pair_axes(nz)}
    w = run.Perturbed(
        {"emb": jnp.asarray(emb)},
        noise,
        member_sides(sign, sigma_shift),
        None,
        None,
        False,
        None,
        0,
        1,
    )
    return np.asarray(run.embed(w, "emb", tok)).reshape(-1)
