"""The ES update against a slow numpy reference, fitness shaping and the Z-test's calibration."""

import math
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import run


def tiny(**overrides):
    args = dict(n_embd=4, n_layer=1, parallel_generations_per_gpu=8, num_epochs=10, rank=2)
    args.update(overrides)
    return run.Args(**args)


def reference_update(params, noise, scores, thresholds, c):
    """Entry by entry: Z = sum over pairs k of score_k * sum_r a_k[i, r] * b_k[j, r]."""
    pairs = c.population // 2
    new = {}
    for name, p in params.items():
        p = np.asarray(p).astype(np.int64)
        out = p.copy()
        low_rank = isinstance(noise[name], tuple)
        if low_rank:
            a_all, b_all = (np.asarray(x).astype(np.int64) for x in noise[name])
            if not c.use_clt:
                a_all, b_all = np.sign(a_all), np.sign(b_all)
        else:
            v_all = np.asarray(noise[name]).astype(np.int64)
            if not c.use_clt:
                v_all = np.sign(v_all)
        threshold = thresholds[0] if name in run.MATRICES else thresholds[1]
        for index in np.ndindex(p.shape):
            z = 0
            for k in range(pairs):
                j = k % c.distinct_pairs
                if low_rank:
                    *layer, row, col = index
                    a, b = a_all[j][tuple(layer)], b_all[j][tuple(layer)]
                    z += int(scores[k]) * sum(int(a[row, r] * b[col, r]) for r in range(c.rank))
                else:
                    z += int(scores[k]) * int(v_all[j][index])
            if abs(z) > threshold:
                out[index] = min(127, max(-127, p[index] + (1 if z > 0 else -1)))
        new[name] = out
    return new


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(use_clt=False),
        dict(fast_fitness=False),
        dict(num_perturbations=4),
        dict(fast_fitness=False, use_clt=False, num_perturbations=2),
        dict(rank=0),
    ],
)
def test_update_equals_slow_numpy_reference(overrides):
    args = tiny(**overrides)
    c = run.make_config(args)
    rng = np.random.default_rng(0)
    params = {
        k: jnp.asarray(rng.integers(-127, 128, np.shape(v)).astype(np.int8))
        for k, v in run.init_params(c).items()
    }
    params["emb"] = params["emb"].at[0, 0].set(127)  # saturated entries stay in range
    noise = run.generation_noise(c, jnp.int32(3))
    scores = np.array([1, -1, 1, 1] if c.fast_fitness else [100, -37, 5, -127])
    # low enough that many entries move (sign mode: |Z| <= pairs * rank)
    thresholds = np.array([300, 12] if c.use_clt else [2, 1], np.int32)
    got, _, moved = run.es_update(params, {}, noise, jnp.asarray(scores, jnp.int32), thresholds, c)
    want = reference_update(params, noise, scores, thresholds, c)
    changed = 0
    for name in run.PARAM_NAMES:
        np.testing.assert_array_equal(np.asarray(got[name]), want[name], err_msg=name)
        changed += int(np.sum(want[name] != np.asarray(params[name])))
    assert int(np.sum(moved)) == changed > 0 and moved.shape == (1 + 10 * c.n_layer + 2,)


def test_fast_fitness_is_the_sign_of_the_pair_difference():
    c = run.make_config(tiny())
    fitness = jnp.array([5, 3, -2, -2, -9, 0, 7, 100], jnp.int32)
    np.testing.assert_array_equal(run.shape_fitness(fitness, c), [1, 0, -1, -1])


def test_normalised_fitness_divides_by_mean_absolute_difference():
    c = run.make_config(tiny(fast_fitness=False))
    fitness = np.array([100, 0, 0, 300, 5, 5, 0, 4000], np.int32)  # diffs 100, -300, 0, -4000
    mean = (100 + 300 + 0 + 4000) // 4
    want = [100 * 16 // mean, -(300 * 16 // mean), 0, -(4000 * 16 // mean)]
    np.testing.assert_array_equal(run.shape_fitness(jnp.asarray(fitness), c), want)
    outlier = np.zeros(16, np.int32)
    outlier[0:14:2], outlier[14] = 1, 10000  # diffs 1 (x7) and 10000: 10000 * 16 / 1250 > 127
    np.testing.assert_array_equal(run.shape_fitness(jnp.asarray(outlier), c), [0] * 7 + [127])
    # all ties: zero scores, never a division by zero
    np.testing.assert_array_equal(run.shape_fitness(jnp.zeros(8, jnp.int32), c), 0)


def test_alpha_schedule_is_upstreams():
    fixed = run.alpha_schedule(run.Args(alpha=0.25, num_epochs=5))
    np.testing.assert_allclose(fixed, 0.25)
    assert run.Args().alpha_decay_timestep == 1000  # upstream's default T
    decay = run.alpha_schedule(run.Args(alpha=4.0, num_epochs=2001, alpha_decay_timestep=1000))
    want = [1 / (15 * t / 1000 + 1) for t in range(2001)]  # 1 / ((2**alpha - 1) t / T + 1)
    np.testing.assert_allclose(decay, want, rtol=1e-15)
    assert decay[0] == 1.0 and decay[1000] == 1 / 16 and decay[2000] == 1 / 31  # no floor after T
    # the schedule depends on the generation only: extending --num_epochs continues it exactly
    longer = run.alpha_schedule(run.Args(alpha=3.0, num_epochs=50, alpha_decay_timestep=7))
    np.testing.assert_array_equal(
        run.alpha_schedule(run.Args(alpha=3.0, num_epochs=20, alpha_decay_timestep=7)), longer[:20]
    )


def test_a_level_too_small_for_float64_moves_nothing():
    args = run.Args(alpha=60.0, num_epochs=3, alpha_decay_timestep=1, parallel_generations_per_gpu=64)
    thresholds = run.z_thresholds(args, run.make_config(args))
    assert thresholds[0].tolist() == [0, 0] and (thresholds[2] == run.INT32_MAX).all()


def test_thresholds_use_the_library_normal_quantile():
    args = run.Args(alpha=0.05, num_epochs=3, parallel_generations_per_gpu=64)
    matrix_std, vector_std = run.null_std(run.make_config(args))
    z = statistics.NormalDist().inv_cdf(0.975)
    np.testing.assert_array_equal(
        run.z_thresholds(args, run.make_config(args))[1],
        [math.floor(z * matrix_std), math.floor(z * vector_std)],
    )


@pytest.mark.parametrize(
    "overrides", [dict(), dict(use_clt=False), dict(fast_fitness=False), dict(rank=3), dict(rank=0)]
)
def test_share_of_moved_parameters_under_the_null_is_alpha(overrides):
    """With fitness unrelated to the noise, a level-alpha Z-test moves ~alpha of the entries."""
    alpha = 0.2
    args = run.Args(
        n_embd=16, n_layer=1, parallel_generations_per_gpu=512, num_epochs=1, alpha=alpha, **overrides
    )
    c = run.make_config(args)
    params = run.init_params(c)
    noise = run.generation_noise(c, jnp.int32(0))
    rng = np.random.default_rng(1)
    fitness = jnp.asarray(rng.normal(0, 1000, c.population).astype(np.int32))
    scores = run.shape_fitness(fitness, c)
    _, _, moved = jax.jit(lambda p, n, s, t: run.es_update(p, {}, n, s, t, c))(
        params, noise, scores, run.z_thresholds(args, c)[0]
    )
    total = sum(int(p.size) for p in params.values())
    share = int(np.sum(moved)) / total
    # entries are not independent (they share the fitness), so allow 3x the binomial spread
    assert abs(share - alpha) < 0.05, share


def null_z(cfg, rng, pairs, entries):
    """One generation under the null: scores shaped from normal fitness unrelated to the noise,
    and Z of `entries` matrix entries and `entries` vector entries drawn from the noise tables,
    each from run.z_statistic and checked against a plain numpy sum (float64: exact below 2**53)."""
    tables = run.make_tables(cfg.rank)

    def draw(table, shape):
        return table[rng.integers(0, 256, shape, dtype=np.uint8)]

    def plain(x):  # the values Z sums, as float64
        return (x if cfg.use_clt else np.sign(x)).astype(np.float64)

    fitness = rng.normal(0, 1000, 2 * pairs).astype(np.int32)
    shaped = np.asarray(run.shape_fitness(jnp.asarray(fitness), cfg))
    weights = jnp.asarray(shaped, jnp.int32)
    vector = draw(tables.gauss, (pairs, entries))
    z_vector = np.asarray(run.z_statistic(jnp.asarray(vector), weights, cfg))
    np.testing.assert_array_equal(z_vector, shaped @ plain(vector))
    side = math.isqrt(entries)
    if cfg.rank:
        a, b = draw(tables.gauss, (pairs, side, cfg.rank)), draw(tables.gauss_rank, (pairs, side, cfg.rank))
        z_matrix = np.asarray(run.z_statistic((jnp.asarray(a), jnp.asarray(b)), weights, cfg))
        want = sum((shaped[:, None] * plain(a[:, :, r])).T @ plain(b[:, :, r]) for r in range(cfg.rank))
    else:  # --rank 0: a matrix entry has one full-rank noise value, as a vector entry does
        full = draw(tables.gauss, (pairs, side, side))
        z_matrix = np.asarray(run.z_statistic(jnp.asarray(full), weights, cfg))
        want = (shaped @ plain(full).reshape(pairs, -1)).reshape(side, side)
    np.testing.assert_array_equal(z_matrix, want)
    return z_matrix.ravel(), z_vector


@pytest.mark.parametrize(
    "fast, clt, rank",
    [
        (True, True, 1),
        (True, False, 1),
        (False, True, 1),
        (False, False, 1),
        (True, True, 3),
        (True, True, 0),
    ],
)
def test_z_test_is_calibrated_for_matrices_and_vectors_separately(fast, clt, rank):
    """Under the null, the threshold is z_(1 - alpha/2) times the null std of Z measured on 60,000
    simulated entries of each kind (not the code's formula), within 1.8%, and the share of entries
    past it is alpha within 0.009: a 3% error in the null std moves the share by 0.0135."""
    alpha, pairs = 0.2, 4096
    args = run.Args(
        parallel_generations_per_gpu=2 * pairs,
        fast_fitness=fast,
        use_clt=clt,
        rank=rank,
        alpha=alpha,
        num_epochs=1,
    )
    cfg = run.make_config(args)
    thresholds = dict(zip(("matrix", "vector"), run.z_thresholds(args, cfg)[0].tolist(), strict=True))
    rng = np.random.default_rng(int(fast) + 2 * int(clt) + 4 * rank)
    samples = {"matrix": [], "vector": []}
    for _ in range(6):
        z_matrix, z_vector = null_z(cfg, rng, pairs, 10_000)
        samples["matrix"].append(z_matrix)
        samples["vector"].append(z_vector)
    z = statistics.NormalDist().inv_cdf(1 - alpha / 2)
    for kind, threshold in thresholds.items():
        values = np.concatenate(samples[kind]).astype(np.float64)
        measured_std = values.std()
        share = np.mean(np.abs(values) > threshold)
        print(f"{kind}: threshold {threshold}, z x measured std {z * measured_std:.1f}, share {share:.4f}")
        assert abs(threshold / (z * measured_std) - 1) < 0.018, kind
        assert abs(share - alpha) < 0.009, kind
