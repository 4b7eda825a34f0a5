"""Trying an idea is one entry: a fitness shaping over the members (centered ranks), an update rule
with a flag of its own (a tally of passed tests) and two models (EGG without its MLP; one that
reads a window of bytes), each added to its table (tests/toys.py, entry for entry docs/design.org's
"Trying an idea") and nowhere else, are taken by --shaping, --optimizer and --model, listed in
--help, calibrated, bounded, trained, saved and resumed bit for bit; a checkpoint from before a
rule's flag is refused naming the flag, and continues as it would have with --allow_changes."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY, add_entries, in_process, one_line_error
from toys import CENTERED_RANKS, GRU, PAIR, TALLY, TallyFlags, centered_rank_rms, tally_step

import run
from egg import checkpoints, flags


@pytest.fixture
def ideas(monkeypatch):
    add_entries(
        monkeypatch,
        shapings={"centered_ranks": CENTERED_RANKS},
        rules={"tally": TALLY},
        models={"gru": GRU, "pair": PAIR},
    )


NEW = ["--shaping", "centered_ranks", "--optimizer", "tally", "--model", "gru"]


def test_new_entries_are_flags_with_derived_thresholds_bounds_and_state(ideas, capsys):
    args = run.parse_args([*NEW, "--tally_votes", "3", "--n_embd", "16", "--n_layer", "2"])
    run.check_args(args)
    facts = flags.facts_of(run.Args)
    assert (
        "centered_ranks" in facts["shaping"].choices() and "tally" in facts["optimizer"].choices()
    )
    assert "gru" in facts["model"].choices() and facts["tally_votes"].training
    cfg = run.make_config(args)
    assert (
        cfg.rule_flags == TallyFlags(3)
        and run.num_parameters(cfg) == 256 * 16 * 2 + 2 * (4 * 16 * 16 + 3 * 16) + 16
    )
    sign = run.make_config(flags.replace(args, shaping="sign"))
    # the null std of a vector's Z grows with the scores' root mean square: the centered ranks'
    # at the pairs an update weighs (near 127 / sqrt(6)) times the sign scores'
    rms = centered_rank_rms(None, run.scored_pairs(cfg))
    assert 127 / 6**0.5 < rms < 1.001 * 127 / 6**0.5
    assert run.null_std(cfg)[1] == pytest.approx(rms * run.null_std(sign)[1])
    # the rule tests |Z| as the Z-test does: the same thresholds
    ztest = run.make_config(flags.replace(args, optimizer="ztest"))
    np.testing.assert_array_equal(run.z_thresholds(cfg, 0.1), run.z_thresholds(ztest, 0.1))
    state = run.init_state(cfg)
    assert state["t/Wf"].dtype == jnp.int8 and set(state) == {
        f"t/{k}" for k in run.parameters_of(cfg)
    }
    # the rule's flag acts under it alone, in a group of its own in --help
    assert run.CONDITIONS["tally_votes"] == ("optimizer", ("tally",))
    with pytest.raises(SystemExit):
        run.parse_args(["--help"])
    assert "tally options" in capsys.readouterr().out
    with pytest.raises(run.UserError, match=r"--tally_votes must be in \[1, 127\], got 0"):
        run.check_args(run.parse_args([*NEW, "--tally_votes", "0"]))


def test_a_flag_of_an_entry_that_is_no_flag_is_refused_on_import(monkeypatch):
    """An entry's flags whose name another flag has, or that are not a frozen flags dataclass."""

    @dataclasses.dataclass(frozen=True)
    class Clash:
        seed: int = 0

    @dataclasses.dataclass
    class Loose:
        tally_votes: int = 2

    for own, message in ((Clash, "the name seed is taken"), (Loose, "a frozen dataclass")):
        monkeypatch.setitem(run.RULES, "tally", TALLY._replace(flags=own))
        with pytest.raises(TypeError, match=message):
            run.every_flag()


def train(capsys, runs, *given):
    result = in_process(capsys, *TINY, "--runs_dir", str(runs), "--save_every", "2", *given)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def final(runs, generation=6):
    (folder,) = runs.glob(f"*/checkpoints/gen-{generation:08d}")
    return folder


@pytest.mark.parametrize("given", [[*NEW, "--tally_votes", "3"], ["--model", "pair"]])
def test_new_entries_train_save_and_resume_bit_for_bit(ideas, tmp_path, capsys, given):
    whole = train(capsys, tmp_path / "a", *given, "--num_epochs", "6")
    assert "validation bits/byte" in whole.stdout
    train(capsys, tmp_path / "b", *given, "--num_epochs", "4")
    resumed = train(capsys, tmp_path / "b", *given, "--num_epochs", "6", "--resume", "auto")
    assert "resuming from" in resumed.stdout
    a, b = final(tmp_path / "a"), final(tmp_path / "b")
    with np.load(a / "params.npz") as f, np.load(a.parent / "gen-00000002" / "params.npz") as g:
        assert any(np.any(f[k] != g[k]) for k in f.files)  # it moved parameters
    assert checkpoints.checkpoint_digest(a) == checkpoints.checkpoint_digest(b)
    meta = json.loads((a / "meta.json").read_text())
    assert meta["model"] == f"{run.parse_args(given).model.model} 8D-2L"
    if "tally" in given:
        with np.load(a / "optimizer.npz") as f:  # the rule's own state, kept
            assert f["t/Wf"].dtype == np.int8 and np.any(f["t/Wf"] != 0)
    sample = in_process(capsys, "--sample", "--resume", str(a), "--max_new_bytes", "12")
    assert sample.returncode == 0 and sample.stdout.startswith("The "), sample.stderr[-2000:]


def test_a_checkpoint_from_before_a_rules_flag(monkeypatch, tmp_path, capsys):
    """The tally rule before its flag (two votes), then the flag added: a run of it is refused
    naming the flag and --allow_changes, with which it continues as it would have. (A checkpoint
    whose rule does not read a flag it predates resumes: tests/test_checkpoints.py.)"""
    before = TALLY._replace(step=lambda *given: tally_step(*given[:3], TallyFlags()), flags=None)
    add_entries(monkeypatch, rules={"tally": before})
    train(capsys, tmp_path / "tally", "--optimizer", "tally", "--num_epochs", "4")
    add_entries(monkeypatch, rules={"tally": TALLY})
    more = ["--optimizer", "tally", "--num_epochs", "6", "--resume", "auto"]
    refused = in_process(capsys, *TINY, "--runs_dir", str(tmp_path / "tally"), *more)
    one_line_error(refused, "gen-00000004 predates --tally_votes, which its training would read:")
    assert "give --allow_changes to continue it with --tally_votes (not recorded) -> 2" in (
        refused.stderr
    )
    resumed = train(capsys, tmp_path / "tally", *more, "--allow_changes")
    assert "changed: --tally_votes (not recorded) -> 2" in resumed.stdout
    whole = tmp_path / "whole"
    train(capsys, whole, "--optimizer", "tally", "--num_epochs", "6")
    digests = [checkpoints.checkpoint_digest(final(x)) for x in (tmp_path / "tally", whole)]
    assert digests[0] == digests[1]
