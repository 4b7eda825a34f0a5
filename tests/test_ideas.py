"""Trying an idea is one entry: a fitness shaping added to run.SHAPINGS and an update rule added to
run.RULES (the two entries of docs/design.org's "Trying an idea", entry for entry) are taken by
--shaping and --optimizer, listed in --help, calibrated, bounded, trained, saved with their state's
dtype and resumed bit for bit, with nothing else changed."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY, in_process

import run
from egg import checkpoints, flags


def doubled_sign_scores(diff, pairs, axis):
    """Twice the sign of each pair's difference."""
    return (2 * jnp.sign(diff)).astype(jnp.int8)


def tally_step(z, state, test, cfg):
    """An int8 tally t of the generations whose Z passes the Z-test, by sign; the entry moves the
    way of t once |t| reaches 2, t then restarting at 0."""
    vote = jnp.sign(z) * (jnp.abs(z) > test.threshold)
    t = jnp.clip(state["t"].astype(jnp.int32) + vote, -127, 127)
    move = jnp.sign(t) * (jnp.abs(t) >= 2)
    return move, {"t": jnp.where(move != 0, 0, t).astype(jnp.int8)}


DOUBLED_SIGN = run.Shaping(doubled_sign_scores, 2, lambda: 2.0, lambda cfg: {})
TALLY = run.Rule(
    tally_step,
    spread=lambda z_std, cfg: z_std,
    reach=lambda z_reach, cfg: z_reach,
    tests="|Z|",
    state={"t": jnp.int8},
    flags=(),
)


@pytest.fixture
def ideas(monkeypatch):
    """The two entries, each added where it belongs, and nowhere else."""
    monkeypatch.setitem(run.SHAPINGS, "doubled_sign", DOUBLED_SIGN)
    monkeypatch.setitem(run.RULES, "tally", TALLY)


def test_a_new_shaping_and_rule_are_flags_with_derived_thresholds_and_bounds(ideas):
    args = run.parse_args(["--shaping", "doubled_sign", "--optimizer", "tally", "--rank", "1"])
    run.check_args(args)
    hint = flags.facts_of(run.Args)
    assert "doubled_sign" in hint["shaping"].choices() and "tally" in hint["optimizer"].choices()
    cfg = run.make_config(args)
    sign = run.make_config(flags.replace(args, shaping="sign"))
    # the null std of Z grows with the scores' root mean square: twice the sign scores' (Z's operand
    # round(w a / 2**k) keeps 2 x 46 within int8, k = 0 for both)
    assert run.weighted_shift(cfg) == run.weighted_shift(sign) == 0
    np.testing.assert_allclose(run.null_std(cfg), 2 * np.array(run.null_std(sign)))
    bounds, sign_bounds = run.accumulator_bounds(cfg), run.accumulator_bounds(sign)
    assert bounds["Z of a vector entry"][0] == 2 * sign_bounds["Z of a vector entry"][0]
    # the rule tests |Z| as the Z-test does: the same thresholds
    ztest = run.make_config(flags.replace(args, optimizer="ztest"))
    np.testing.assert_array_equal(run.z_thresholds(cfg, 0.1), run.z_thresholds(ztest, 0.1))
    state = run.init_state(cfg)
    assert state["t/Wf"].dtype == jnp.int8 and set(state) == {f"t/{k}" for k in run.PARAM_NAMES}


def test_a_new_shaping_and_rule_train_save_and_resume_bit_for_bit(ideas, tmp_path, capsys):
    new = ["--shaping", "doubled_sign", "--optimizer", "tally", "--save_every", "2"]
    whole = in_process(capsys, *TINY, *new, "--num_epochs", "6", "--runs_dir", str(tmp_path / "a"))
    assert whole.returncode == 0 and "validation bits/byte" in whole.stdout, whole.stderr[-2000:]
    parts = [*TINY, *new, "--runs_dir", str(tmp_path / "b")]
    assert in_process(capsys, *parts, "--num_epochs", "4").returncode == 0
    resumed = in_process(capsys, *parts, "--num_epochs", "6", "--resume", "auto")
    assert resumed.returncode == 0 and "resuming from" in resumed.stdout, resumed.stderr[-2000:]
    (a,), (b,) = (list((tmp_path / x).glob("*/checkpoints/gen-00000006")) for x in "ab")
    with np.load(a / "optimizer.npz") as f:
        assert f["t/Wf"].dtype == np.int8 and np.any(f["t/Wf"] != 0)  # the rule's own state, kept
    with np.load(a / "params.npz") as f, np.load(a.parent / "gen-00000002" / "params.npz") as g:
        assert any(np.any(f[k] != g[k]) for k in f.files)  # it moved parameters
    assert checkpoints.checkpoint_digest(a) == checkpoints.checkpoint_digest(b)
