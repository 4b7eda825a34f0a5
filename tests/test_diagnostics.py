"""Integer-health diagnostics (egg/diagnostics.py) against numpy on known tensors, and what run.py
feeds them: the activations of its one noise-free forward and the moved counts of its update."""

import math

import jax
import numpy as np
import pytest
from helpers import es_update, fitness_of_one_model, generation_noise, init_params, thresholds

import run
from egg import flags
from egg.diagnostics import health, moved_shares, table, tensor_stats


def test_tensor_stats_match_numpy():
    values = np.array([127, 127, -127, 0, 0, 0, 0, 5], np.int8)
    stats = tensor_stats(values, 127)
    p = np.array([2, 1, 4, 1]) / 8
    assert stats["mean"] == pytest.approx(values.astype(float).mean())
    assert stats["std"] == pytest.approx(values.astype(float).std())
    assert stats["entropy"] == pytest.approx(-(p * np.log2(p)).sum())
    assert stats["saturated"] == pytest.approx(3 / 8)
    every = tensor_stats(np.arange(-127, 128, dtype=np.int8), 127)
    assert every["entropy"] == pytest.approx(math.log2(255)) and every["mean"] == 0
    assert tensor_stats(np.zeros(10, np.int8), 127)["entropy"] == 0


def setup():
    cfg = run.make_config(
        flags.replace(run.Args(), n_embd=8, n_layer=2, parallel_generations_per_gpu=4)
    )
    params = jax.tree.map(np.array, init_params(cfg, 0))  # writable copies
    rows = np.random.default_rng(0).integers(1, 256, (3, 12)).astype(np.uint8)
    return cfg, params, rows


def test_probe_sees_the_real_activations():
    cfg, params, rows = setup()
    seen = jax.tree.map(np.asarray, run.activations(params, rows, cfg))
    np.testing.assert_array_equal(seen["embedding"], params["emb"][rows])
    assert seen["gate"].shape == (3, 12, 2, 8) and seen["mlp_hidden"].shape == (3, 12, 2, 32)
    # upstream's MLP: no ReLU
    assert seen["logits"].shape == (3, 12, 256) and (seen["mlp_hidden"] < 0).any()
    _, h = fitness_of_one_model(
        params, None, np.zeros((2, 2, 8), np.int8), rows[:2], rows[:2], 0, cfg
    )
    np.testing.assert_array_equal(seen["state"][:2, -1], h)  # the states after the last byte


def test_moved_shares_are_each_parameters_share_of_entries_that_moved():
    """From the update's counts (a tensor's, a block parameter's layer by layer) against the
    parameters themselves before and after."""
    args = flags.replace(
        run.Args(),
        n_embd=8,
        n_layer=2,
        parallel_generations_per_gpu=8,
        alpha=0.5,
        optimizer="ztest",
        segments=1,
    )
    cfg = run.make_config(args)
    params = jax.tree.map(np.asarray, init_params(cfg, 0))
    scores = np.random.default_rng(1).integers(-127, 128, run.scored_pairs(cfg)).astype(np.int8)
    noise = generation_noise(cfg, 0, 0)
    new, _, moved = es_update(params, {}, noise, scores, thresholds(args, cfg), cfg)
    model = run.parameters_of(cfg)
    tensors = {k: (2 if p.layered else 1, np.asarray(params[k]).size) for k, p in model.items()}
    shares = moved_shares(np.asarray(moved), tensors)
    want = {name: float(np.mean(np.asarray(new[name]) != params[name])) for name in model}
    assert (
        shares == pytest.approx(want)
        and min(want.values()) < max(want.values())
        and max(want.values()) > 0
    )


def test_parameter_shares_and_table_colours():
    cfg, params, rows = setup()
    seen = jax.tree.map(np.asarray, run.activations(params, rows, cfg))
    params["Wf"].flat[:16] = 127  # 16 of 2 * 64 entries at the saturated value
    shares = {name: 0.0 for name in run.parameters_of(cfg)} | {"Wf": 16 / 128}
    values = health(seen, params, shares, run.INT8_MAX)
    assert values["diag/param_Wf/moved"] == pytest.approx(16 / 128)
    assert values["diag/param_Wf/saturated"] == pytest.approx(np.mean(np.abs(params["Wf"]) == 127))
    assert values["diag/param_head/moved"] == 0
    state1 = tensor_stats(seen["state"][:, :, 1], 127)["entropy"]
    assert values["diag/state1/entropy"] == pytest.approx(state1)
    text = table(values)
    assert "\033[31mparam_Wf" in text and "\033[32mparam_head" in text  # 12.5% saturated: red
    assert len(text.splitlines()) == 1 + 2 + 5 * 2 + len(run.parameters_of(cfg))
