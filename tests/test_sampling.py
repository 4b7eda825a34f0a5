"""Sampling (egg/sampling.py) from the model's integer logits (run.py's noise-free reader): min_p,
presence penalty, greedy, reproducibility, and --sample on the command line."""

import dataclasses

import numpy as np
import pytest
import reference
from helpers import in_process, init_params, one_line_error

import run
from egg import checkpoints, flags, sampling


def logits_with(**bits):
    """Log2-probabilities in bits for the given bytes, -4 elsewhere (int8 logits at 4 fractional
    bits: -64 / 16)."""
    logits = np.full(256, -64, np.int8)
    for char, value in bits.items():
        logits[ord(char)] = value * 16
    return logits / 2**run.LOGIT_FRAC


def test_min_p_drops_unlikely_bytes():
    logits = logits_with(A=4, B=3, C=0)  # weights 1, 1/2, 1/16 relative to A; the rest 2**-8
    probs = sampling.probabilities(logits, np.zeros(256, bool), 1.0, 0.1, 0.0)
    np.testing.assert_allclose(probs[[65, 66]], [2 / 3, 1 / 3])
    assert probs.sum() == pytest.approx(1) and np.count_nonzero(probs) == 2
    kept = sampling.probabilities(logits, np.zeros(256, bool), 1.0, 0.05, 0.0)
    np.testing.assert_allclose(kept[[65, 66, 67]], np.array([1, 0.5, 1 / 16]) / 1.5625)


def test_presence_penalty_lowers_generated_bytes():
    logits = logits_with(A=4, B=3)
    generated = np.zeros(256, bool)
    generated[65] = True  # A already generated: 4 - 2 = 2 bits, now below B
    probs = sampling.probabilities(logits, generated, 1.0, 0.1, 2.0)
    np.testing.assert_allclose(probs[[65, 66]], [1 / 3, 2 / 3])


def test_temperature_sharpens_and_zero_is_greedy():
    logits = logits_with(A=4, B=3)
    cold = sampling.probabilities(logits, np.zeros(256, bool), 0.5, 0.0, 0.0)
    assert cold[65] / cold[66] == pytest.approx(4)  # 2 ** (1 bit / 0.5)
    for temperature in (0.0, 1e-9):
        greedy = sampling.probabilities(logits, np.zeros(256, bool), temperature, 1.0, 0.0)
        assert greedy[65] == 1 and greedy.sum() == 1


def model():
    args = flags.replace(run.Args(), n_embd=16, n_layer=1, seed=3)
    cfg = run.make_config(args)
    return sampling.Flags(max_new_bytes=40, prompt="def "), cfg, init_params(cfg, args.seed)


def test_sampling_is_reproducible_for_a_seed():
    args, cfg, params = model()
    first = run.sample_text(params, cfg, args, seed=1)
    assert len(first) == 4 + 40 and first.startswith(b"def ")
    assert run.sample_text(params, cfg, args, seed=1) == first
    assert run.sample_text(params, cfg, args, seed=2) != first


def test_min_p_one_at_low_temperature_is_greedy_decoding():
    args, cfg, params = model()
    args = dataclasses.replace(
        args, temperature=1e-6, min_p=1.0, presence_penalty=0.0, max_new_bytes=12
    )

    got = run.sample_text(params, cfg, args, seed=5).removeprefix(b"def ")
    text = list(b"\0def " + got)  # the prompt is read after a document separator
    zero = np.zeros((cfg.n_layer, cfg.n_embd), np.int64)
    _, _, logits = reference.member_fitness(params, None, 1, zero, text, text, 0)  # after each byte
    # each a most likely byte (int8 logits tie: min_p 1 keeps them all)
    for k, byte in enumerate(got):
        assert logits[4 + k][byte] == logits[4 + k].max()
    assert len(got) == 12


def test_undecodable_and_control_bytes_are_shown_safely():
    assert sampling.printable(b"ok \xff\xfe caf\xc3\xa9") == "ok \\xff\\xfe caf\u00e9"
    shown = sampling.printable(b"\x1b[2J\x07\r\x00line\nnext\ttab \xc2\x85 \x7f")
    assert shown == "\\x1b[2J\\x07\\x0d\\x00line\nnext\ttab \\u0085 \\x7f"
    # as argv gives them
    assert sampling.prompt_bytes("\udcff\udcfe caf\u00e9") == b"\xff\xfe caf\xc3\xa9"


def test_sample_from_a_checkpoint_on_the_command_line(tmp_path, capsys):
    args, cfg, params = model()
    model_flags = {"n_embd": 16, "n_layer": 1}
    checkpoints.save_checkpoint(
        tmp_path / "ckpt",
        params,
        {},
        np.zeros((cfg.population, cfg.n_layer, cfg.n_embd), np.int8),
        {"format": 3, "args": model_flags, "training": model_flags},
    )
    result = in_process(
        capsys,
        "--sample",
        "--resume",
        str(tmp_path / "ckpt"),
        "--prompt",
        "import ",
        "--max_new_bytes",
        "30",
        "--seed",
        "4",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("import ")
    expected = sampling.printable(
        run.sample_text(
            params, cfg, dataclasses.replace(args, prompt="import ", max_new_bytes=30), seed=4
        )
    )
    assert result.stdout.rstrip("\n") == expected
    # that checkpoint records no --residual_shift (its facts' before: 0); one that records 2 samples
    # with 2
    shifted = {**model_flags, "residual_shift": 2}
    states = np.zeros((cfg.population, cfg.n_layer, cfg.n_embd), np.int8)
    meta = {"format": 3, "args": model_flags, "training": shifted}
    checkpoints.save_checkpoint(tmp_path / "shifted", params, {}, states, meta)
    flags = ("--prompt", "import ", "--max_new_bytes", "30", "--seed", "4")
    result = in_process(capsys, "--sample", "--resume", str(tmp_path / "shifted"), *flags)
    assert result.returncode == 0, result.stderr[-2000:]
    quartered = run.sample_text(
        params,
        cfg._replace(residual_shift=2),
        dataclasses.replace(args, prompt="import ", max_new_bytes=30),
        seed=4,
    )
    assert result.stdout.rstrip("\n") == sampling.printable(quartered) != expected
    one_line_error(in_process(capsys, "--sample"), "--sample needs --resume")
