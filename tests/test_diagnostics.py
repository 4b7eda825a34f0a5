"""Integer-health diagnostics against numpy on known tensors."""

import math

import jax
import numpy as np
import pytest
from helpers import fitness_of_one_model

import run


def test_tensor_stats_match_numpy():
    values = np.array([127, 127, -127, 0, 0, 0, 0, 5], np.int8)
    stats = run.tensor_stats(values)
    p = np.array([2, 1, 4, 1]) / 8
    assert stats["mean"] == pytest.approx(values.astype(float).mean())
    assert stats["std"] == pytest.approx(values.astype(float).std())
    assert stats["entropy"] == pytest.approx(-(p * np.log2(p)).sum())
    assert stats["saturated"] == pytest.approx(3 / 8)
    every = run.tensor_stats(np.arange(-127, 128, dtype=np.int8))
    assert every["entropy"] == pytest.approx(math.log2(255)) and every["mean"] == 0
    assert run.tensor_stats(np.zeros(10, np.int8))["entropy"] == 0


def setup():
    cfg = run.make_config(run.Args(n_embd=8, n_layer=2, parallel_generations_per_gpu=4))
    params = jax.tree.map(np.asarray, run.init_params(cfg, 0))
    rows = np.random.default_rng(0).integers(1, 256, (3, 12)).astype(np.uint8)
    return cfg, params, rows


def test_probe_sees_the_real_activations():
    cfg, params, rows = setup()
    seen = jax.tree.map(np.asarray, run.make_probe(cfg)(params, rows))
    np.testing.assert_array_equal(seen["embedding"], params["emb"][rows])
    assert seen["gate"].shape == (3, 12, 2, 8) and seen["mlp_hidden"].shape == (3, 12, 2, 32)
    assert seen["logits"].shape == (3, 12, 256) and (seen["mlp_hidden"] < 0).any()  # upstream's MLP: no ReLU
    _, h = fitness_of_one_model(params, None, np.zeros((2, 2, 8), np.int8), rows[:2], rows[:2], 0, cfg)
    np.testing.assert_array_equal(seen["state"][:2, -1], h)  # the states after the last byte


def test_parameter_shares_and_table_colours():
    cfg, params, rows = setup()
    seen = jax.tree.map(np.asarray, run.make_probe(cfg)(params, rows))
    moved = {k: v.copy() for k, v in params.items()}
    moved["Wf"].flat[:16] = 127  # 16 of 2 * 64 entries moved, to the saturated value
    values = run.diagnostics(seen, moved, params)
    assert values["diag/param_Wf/moved"] == pytest.approx(16 / 128)
    assert values["diag/param_Wf/saturated"] == pytest.approx(np.mean(np.abs(moved["Wf"]) == 127))
    assert values["diag/param_head/moved"] == 0
    assert values["diag/state1/entropy"] == pytest.approx(run.tensor_stats(seen["state"][:, :, 1])["entropy"])
    table = run.diagnostics_table(values)
    assert "\033[31mparam_Wf" in table and "\033[32mparam_head" in table  # 12.5% saturated: red
    assert len(table.splitlines()) == 1 + 2 + 5 * 2 + len(run.PARAM_NAMES)
