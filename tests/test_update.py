"""The ES update against a slow numpy reference, fitness shaping and the Z-test's calibration."""

import dataclasses
import math
import statistics
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    OPTIMISED,
    alpha_schedule,
    chosen,
    es_update,
    generation_noise,
    init_params,
    z_thresholds,
)
from helpers import upstream_args as upstream
from reference import round_half_away

import run
from egg import flags


def tiny(**overrides):
    """A model small enough for the entry-by-entry references: 4D-1L, 4 pairs, rank 2."""
    return upstream(
        **{
            **dict(n_embd=4, n_layer=1, parallel_generations_per_gpu=8, num_epochs=10, rank=2),
            **overrides,
        }
    )


def rounded(x: int, k: int) -> int:
    """round_half_away of a Python integer, as one."""
    return int(round_half_away(x, k))


def operand_shift(c) -> int:
    """docs/design.org's k: the smallest shift that brings every w_j a (w_j the summed scores of the
    pairs sharing noise j, a an entry of A or its sign) within int8."""
    repeats = c.population // (2 * c.distinct_pairs)
    largest = (int(np.abs(run.make_tables(c.rank).gauss).max()) if c.use_clt else 1) * repeats
    largest *= 1 if c.shaping == "sign" else 127
    return next(k for k in range(32) if rounded(largest, k) <= 127)


def reference_z(params, noise, scores, c):
    """Entry by entry, as docs/design.org states it: w_j = the sum of the scores of the pairs k with
    noise j = k mod D; a low-rank matrix's Z = sum_j sum_r round(w_j a_j[i, r] / 2**k) b_j[l, r]
    (operand_shift's k), any other Z = sum_j w_j e_j[i]."""
    weights = [
        sum(int(scores[k]) for k in range(j, c.population // 2, c.distinct_pairs))
        for j in range(c.distinct_pairs)
    ]
    shift = operand_shift(c)
    zs = {}
    for name, p in params.items():
        low_rank = isinstance(noise[name], tuple)
        if low_rank:
            a_all, b_all = (np.asarray(x).astype(np.int64) for x in noise[name])
            if not c.use_clt:
                a_all, b_all = np.sign(a_all), np.sign(b_all)
        else:
            v_all = np.asarray(noise[name]).astype(np.int64)
            if not c.use_clt:
                v_all = np.sign(v_all)
        z = np.zeros(np.shape(p), np.int64)
        for index in np.ndindex(z.shape):
            for j, w in enumerate(weights):
                if low_rank:
                    *layer, row, col = index
                    a, b = a_all[j][tuple(layer)], b_all[j][tuple(layer)]
                    z[index] += sum(
                        rounded(w * int(a[row, r]), shift) * int(b[col, r]) for r in range(c.rank)
                    )
                else:
                    z[index] += w * int(v_all[j][index])
        zs[name] = z
    return zs


def reference_update(params, noise, scores, thresholds, c):
    """Move by sign(Z) where |Z| > the threshold of the entry's kind, clipped to [-127, 127]."""
    new = {}
    for name, z in reference_z(params, noise, scores, c).items():
        threshold = thresholds[0] if run.parameters_of(c)[name].matrix else thresholds[1]
        step = np.sign(z) * (np.abs(z) > threshold)
        new[name] = np.clip(np.asarray(params[name]).astype(np.int64) + step, -127, 127)
    return new


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(use_clt=False),
        dict(shaping="normalised"),
        dict(num_perturbations=4),
        dict(shaping="normalised", use_clt=False, num_perturbations=2),
        dict(rank=0),
    ],
)
def test_update_equals_slow_numpy_reference(overrides):
    args = tiny(**overrides)
    c = run.make_config(args)
    rng = np.random.default_rng(0)
    params = {
        k: jnp.asarray(rng.integers(-127, 128, np.shape(v)).astype(np.int8))
        for k, v in init_params(c, 0).items()
    }
    params["emb"] = params["emb"].at[0, 0].set(127)  # saturated entries stay in range
    noise = generation_noise(c, 0, jnp.int32(3))
    scores = np.array([1, -1, 1, 1] if c.shaping == "sign" else [100, -37, 5, -127])
    # low enough that many entries move (sign mode: |Z| <= pairs * rank)
    thresholds = np.array([300, 12] if c.use_clt else [2, 1], np.int32)
    got, _, moved = es_update(params, {}, noise, jnp.asarray(scores, jnp.int32), thresholds, c)
    want = reference_update(params, noise, scores, thresholds, c)
    changed = 0
    for name in run.parameters_of(c):
        np.testing.assert_array_equal(np.asarray(got[name]), want[name], err_msg=name)
        changed += int(np.sum(want[name] != np.asarray(params[name])))
    assert int(np.sum(moved)) == changed > 0 and moved.shape == (1 + 10 * c.n_layer + 2,)


def test_fast_fitness_is_the_sign_of_the_pair_difference():
    c = run.make_config(tiny())
    fitness = jnp.array([5, 3, -2, -2, -9, 0, 7, 100], jnp.int32)
    np.testing.assert_array_equal(run.shape_fitness(fitness, c), [1, 0, -1, -1])


def test_normalised_fitness_divides_by_mean_absolute_difference():
    c = run.make_config(tiny(shaping="normalised"))
    fitness = np.array([100, 0, 0, 300, 5, 5, 0, 4000], np.int32)  # diffs 100, -300, 0, -4000
    mean = (100 + 300 + 0 + 4000) // 4
    want = [100 * 16 // mean, -(300 * 16 // mean), 0, -(4000 * 16 // mean)]
    np.testing.assert_array_equal(run.shape_fitness(jnp.asarray(fitness), c), want)
    outlier = np.zeros(16, np.int32)
    outlier[0:14:2], outlier[14] = 1, 10000  # diffs 1 (x7) and 10000: 10000 * 16 / 1250 > 127
    np.testing.assert_array_equal(run.shape_fitness(jnp.asarray(outlier), c), [0] * 7 + [127])
    # all ties: zero scores, never a division by zero
    np.testing.assert_array_equal(run.shape_fitness(jnp.zeros(8, jnp.int32), c), 0)


def test_normalised_fitness_builds_nothing_larger_than_its_scores():
    """The remainders are summed in chunks of at most INT32_MAX // pairs: a chunk no longer than
    the remainders themselves (a whole one would pad 8 pairs' remainders to 268 million)."""
    for members in (16, 4096):
        c = run.make_config(tiny(shaping="normalised", parallel_generations_per_gpu=members))
        fitness = jnp.zeros((3, members), jnp.int32)  # e.g. three segments of the population
        program = jax.make_jaxpr(lambda f, c=c: run.shape_fitness(f, c))(fitness).jaxpr
        largest = max(v.aval.size for eqn in program.eqns for v in eqn.outvars)
        assert largest <= fitness.size, (members, largest)


def test_alpha_schedule_is_upstreams():
    fixed = alpha_schedule(flags.replace(run.Args(), alpha=0.25, num_epochs=5))
    np.testing.assert_allclose(fixed, 0.25)
    assert run.Args().alpha_decay_timestep == 1000  # upstream's default T
    assert flags.upstream_preset(run.Args)["alpha_floor"] == 0
    decay = alpha_schedule(
        flags.replace(
            run.Args(), alpha=4.0, num_epochs=4001, alpha_decay_timestep=1000, alpha_floor=0
        )
    )
    want = [1 / (15 * t / 1000 + 1) for t in range(4001)]  # 1 / ((2**alpha - 1) t / T + 1)
    np.testing.assert_allclose(decay, want, rtol=1e-15)
    assert decay[0] == 1.0 and decay[1000] == 1 / 16 and decay[4000] == 1 / 61  # no floor after T
    # the schedule depends on the generation only: extending --num_epochs continues it exactly
    longer = alpha_schedule(
        flags.replace(run.Args(), alpha=3.0, num_epochs=50, alpha_decay_timestep=7)
    )
    np.testing.assert_array_equal(
        alpha_schedule(flags.replace(run.Args(), alpha=3.0, num_epochs=20, alpha_decay_timestep=7)),
        longer[:20],
    )


def test_alpha_floor_stops_the_decay_and_leaves_the_fixed_share():
    floor = run.Args().alpha_floor
    assert floor == 1 / 64  # the default, chosen in docs/results.org
    args = flags.replace(
        run.Args(), alpha=4.0, num_epochs=6000, alpha_decay_timestep=1000, alpha_floor=floor
    )
    bare = alpha_schedule(dataclasses.replace(args, alpha_floor=0.0))
    floored = alpha_schedule(args)
    crossing = 4201  # 1 / (15 t / 1000 + 1) < 1/64 from t > 63000 / 15 = 4200 on
    np.testing.assert_array_equal(floored[:crossing], bare[:crossing])
    assert bare[crossing - 1] == floor > bare[crossing]
    assert (floored[crossing:] == floor).all()
    thresholds = z_thresholds(args, run.make_config(args))  # the floor reaches the Z-test too
    assert (thresholds[crossing:] == thresholds[crossing]).all()
    assert (thresholds[:crossing] <= thresholds[crossing]).all()
    fixed = dataclasses.replace(args, alpha=0.01)  # a fixed share is the share, floor or not
    np.testing.assert_array_equal(alpha_schedule(fixed), 0.01)


def test_a_level_too_small_for_float64_moves_nothing():
    args = upstream(
        alpha=60.0, num_epochs=3, alpha_decay_timestep=1, parallel_generations_per_gpu=64
    )
    thresholds = z_thresholds(args, run.make_config(args))
    assert thresholds[0].tolist() == [0, 0] and (thresholds[2] == run.INT32_MAX).all()


def test_thresholds_use_the_library_normal_quantile():
    args = upstream(alpha=0.05, num_epochs=3, parallel_generations_per_gpu=64)
    matrix_std, vector_std = run.null_std(run.make_config(args))
    z = statistics.NormalDist().inv_cdf(0.975)
    np.testing.assert_array_equal(
        z_thresholds(args, run.make_config(args))[1],
        [math.floor(z * matrix_std), math.floor(z * vector_std)],
    )


@pytest.mark.parametrize(
    "overrides",
    [dict(), dict(use_clt=False), dict(shaping="normalised"), dict(rank=3), dict(rank=0)],
)
def test_share_of_moved_parameters_under_the_null_is_alpha(overrides):
    """With fitness unrelated to the noise, a level-alpha Z-test moves ~alpha of the entries."""
    alpha = 0.2
    args = upstream(
        n_embd=16,
        n_layer=1,
        parallel_generations_per_gpu=512,
        num_epochs=1,
        alpha=alpha,
        **overrides,
    )
    c = run.make_config(args)
    params = init_params(c, 0)
    noise = generation_noise(c, 0, jnp.int32(0))
    rng = np.random.default_rng(1)
    fitness = jnp.asarray(rng.normal(0, 1000, c.population).astype(np.int32))
    scores = run.shape_fitness(fitness, c)
    _, _, moved = es_update(params, {}, noise, scores, z_thresholds(args, c)[0], c)
    total = sum(int(p.size) for p in params.values())
    share = int(np.sum(moved)) / total
    # entries are not independent (they share the fitness), so allow 3x the binomial spread
    assert abs(share - alpha) < 0.05, share


# run.z_statistic (and the momentum rule's step below) compiled with XLA's optimisations: the
# null's Z over tens of millions of noise values
z_statistic = jax.jit(run.z_statistic, static_argnums=2, compiler_options=OPTIMISED)


def null_z(cfg, rng, pairs, entries, fitness=None, checked=True):
    """One generation under the null: scores shaped from fitness unrelated to the noise (normal
    unless given), and Z of `entries` matrix entries and `entries` vector entries drawn from the
    noise tables, each from run.z_statistic (compiled as above) and (`checked`) checked against a
    plain numpy sum of docs/design.org's terms (float64: exact below 2**53): the first 1,000 entries
    of each kind at --rank 0, every low-rank matrix entry. Returns them and the sum of squared
    scores."""
    tables = run.make_tables(cfg.rank)

    def draw(table, shape):
        return table[rng.integers(0, 256, shape, dtype=np.uint8)]

    def plain(x):  # the values Z sums, as float64
        return (x if cfg.use_clt else np.sign(x)).astype(np.float64)

    if fitness is None:
        fitness = rng.normal(0, 1000, 2 * pairs).astype(np.int32)
    shaped = np.asarray(run.shape_fitness(jnp.asarray(fitness), cfg))
    weights = jnp.asarray(shaped, jnp.int32)
    vector = draw(tables.gauss, (pairs, entries))
    z_vector = np.asarray(z_statistic(jnp.asarray(vector), weights, cfg))
    if checked:  # the first thousand entries (float64 copies of them all cost more than Z)
        np.testing.assert_array_equal(z_vector[:1000], shaped @ plain(vector[:, :1000]))
    side = math.isqrt(entries)
    if cfg.rank:
        a, b = (
            draw(tables.gauss, (pairs, side, cfg.rank)),
            draw(tables.gauss_rank, (pairs, side, cfg.rank)),
        )
        z_matrix = np.asarray(z_statistic((jnp.asarray(a), jnp.asarray(b)), weights, cfg))
        if not checked:
            return z_matrix.ravel(), z_vector, int(np.sum(shaped.astype(np.int64) ** 2))
        product = shaped[:, None, None].astype(np.int64) * plain(a).astype(np.int64)
        operand = round_half_away(product, operand_shift(cfg))
        want = sum(
            operand[:, :, r].T.astype(np.float64) @ plain(b[:, :, r]) for r in range(cfg.rank)
        )
    else:  # --rank 0: a matrix entry has one full-rank noise value, as a vector entry does
        full = draw(tables.gauss, (pairs, side, side))
        z_matrix = np.asarray(z_statistic(jnp.asarray(full), weights, cfg))
        want = shaped @ plain(full.reshape(pairs, -1)[:, :1000])
    np.testing.assert_array_equal(z_matrix.ravel()[: want.size], want.ravel())
    return z_matrix.ravel(), z_vector, int(np.sum(shaped.astype(np.int64) ** 2))


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
    args = upstream(
        parallel_generations_per_gpu=2 * pairs,
        shaping="sign" if fast else "normalised",
        use_clt=clt,
        rank=rank,
        alpha=alpha,
        num_epochs=1,
    )
    cfg = run.make_config(args)
    thresholds = dict(zip(("matrix", "vector"), z_thresholds(args, cfg)[0].tolist(), strict=True))
    rng = np.random.default_rng(int(fast) + 2 * int(clt) + 4 * rank)
    samples = {"matrix": [], "vector": []}
    for _ in range(6):
        z_matrix, z_vector, _ = null_z(cfg, rng, pairs, 10_000)
        samples["matrix"].append(z_matrix)
        samples["vector"].append(z_vector)
    z = statistics.NormalDist().inv_cdf(1 - alpha / 2)
    for kind, threshold in thresholds.items():
        values = np.concatenate(samples[kind]).astype(np.float64)
        measured_std = values.std()
        share = np.mean(np.abs(values) > threshold)
        print(
            f"{kind}: threshold {threshold}, z x measured std {z * measured_std:.1f}, "
            f"share {share:.4f}"
        )
        assert abs(threshold / (z * measured_std) - 1) < 0.018, kind
        assert abs(share - alpha) < 0.009, kind


def reference_rule(z: int, m: int, threshold: int, shift: int, c) -> tuple[int, int]:
    """One entry of --optimizer momentum: (move, new m), as docs/design.org states it."""
    u = max(-127, min(127, rounded(z, shift)))
    m = m - rounded(m, c.rule_flags.momentum_shift) + u
    bar = threshold + 1  # |m| > threshold: |m| >= threshold + 1
    # bars' worth, at most max_step
    steps = max(k for k in range(c.rule_flags.max_step + 1) if abs(m) >= k * bar)
    return ((m > 0) - (m < 0)) * steps, 0 if steps else m


def u_shifts(c) -> list[int]:
    """docs/design.org's shift of Z to u for each kind: u's null std in [16, 32), from Z's."""
    return [max(int(math.floor(math.log2(std))) - 4, 0) for std in run.null_std(c)]


@pytest.mark.parametrize(
    "overrides",
    [
        dict(optimizer="momentum"),
        dict(optimizer="momentum", momentum_shift=1, shaping="normalised"),
        dict(optimizer="momentum", momentum_shift=3, num_perturbations=4, rank=0),
        dict(optimizer="momentum", max_step=3),
        dict(optimizer="momentum", max_step=2, shaping="normalised"),
    ],
)
def test_momentum_equals_an_entry_by_entry_reference_over_generations(overrides):
    """Four generations of es_update against reference_rule on Z from reference_z: parameters and
    the int16 state, exactly, with thresholds at alpha 0.5 so that many entries move each time."""
    args = tiny(alpha=0.5, **overrides)
    c = run.make_config(args)
    rng = np.random.default_rng(7)
    params = jax.tree.map(np.asarray, init_params(c, 0))
    state = jax.tree.map(np.asarray, run.init_state(c))
    assert state and all(x.dtype == np.int16 for x in state.values())
    shifts, thresholds = u_shifts(c), z_thresholds(args, c)
    ref_params = {k: v.astype(np.int64) for k, v in params.items()}
    ref_state = {k: v.astype(np.int64) for k, v in state.items()}
    longest = 0  # the longest move the reference made
    for generation in range(4):
        noise = generation_noise(c, 0, jnp.int32(generation))
        scores = rng.integers(-1, 2, 4) if c.shaping == "sign" else rng.integers(-127, 128, 4)
        params, state, moved = jax.tree.map(
            np.asarray,
            es_update(
                params, state, noise, jnp.asarray(scores, jnp.int32), thresholds[generation], c
            ),
        )
        for name, z in reference_z(ref_params, noise, scores, c).items():
            kind = 0 if run.parameters_of(c)[name].matrix else 1
            m = ref_state[f"m/{name}"]
            for index in np.ndindex(z.shape):
                threshold = int(thresholds[generation][kind])
                step, m[index] = reference_rule(
                    int(z[index]), int(m[index]), threshold, shifts[kind], c
                )
                ref_params[name][index] = min(127, max(-127, ref_params[name][index] + step))
                longest = max(longest, abs(step))
        for key in state:
            np.testing.assert_array_equal(state[key], ref_state[key], err_msg=key)
        for name in run.parameters_of(c):
            np.testing.assert_array_equal(params[name], ref_params[name], err_msg=name)
        assert int(np.sum(moved)) > 0
    # moves of several steps were made, and only where allowed
    assert (longest > 1) == (c.rule_flags.max_step > 1)


@pytest.mark.parametrize("momentum_shift, fast", [(2, True), (4, False)])
def test_momentum_thresholds_are_calibrated_under_the_null(momentum_shift, fast):
    """Fitness unrelated to the noise for 8 x 2**momentum_shift generations, fresh noise each. The
    thresholds are those of a level-alpha test on a running sum that never restarts: in the last
    quarter such a sum (numpy, int64) passes them for alpha of the entries within 0.015, matrices
    and vectors apart. The rule itself restarts m at each move, so fewer pass: between alpha / 8
    and alpha (0.10 at alpha 0.2 with shift 2)."""
    alpha, pairs = 0.2, 512
    args = flags.replace(
        run.Args(),
        n_embd=4,
        n_layer=1,
        parallel_generations_per_gpu=2 * pairs,
        optimizer="momentum",
        momentum_shift=momentum_shift,
        shaping="sign" if fast else "normalised",
        alpha=alpha,
        num_epochs=1,
        segments=1,  # the null std of one segment's pairs
    )
    cfg = run.make_config(args)
    thresholds, shifts, stds = z_thresholds(args, cfg)[0], u_shifts(cfg), run.null_std(cfg)
    rule = run.RULES["momentum"]

    @partial(jax.jit, static_argnums=3, compiler_options=OPTIMISED)
    def step(z, m, threshold, index):  # one kind's: its null std is a constant of the rule
        evidence = run.Evidence(threshold, stds[index], jnp.zeros(1, jnp.int32), 0.0)
        moves, kept_state = rule.step(z, {"m": m}, evidence, cfg.rule_flags)
        return moves, kept_state["m"].astype(jnp.int16)

    entries, generations = 10_000, 8 << momentum_shift
    sums = {kind: jnp.zeros(entries, jnp.int16) for kind in ("matrix", "vector")}
    kept = {kind: np.zeros(entries, np.int64) for kind in ("matrix", "vector")}
    rng = np.random.default_rng(momentum_shift + 10 * fast)
    shares = {(kind, which): [] for kind in ("matrix", "vector") for which in ("kept", "rule")}
    for generation in range(generations):
        z_matrix, z_vector, _ = null_z(cfg, rng, pairs, entries, checked=False)  # checked above
        for kind, z in (("matrix", z_matrix), ("vector", z_vector)):
            index = 1 if kind == "vector" else 0
            moves, sums[kind] = step(
                jnp.asarray(z), sums[kind], jnp.int32(thresholds[index]), index
            )
            u = np.clip(round_half_away(z.astype(np.int64), shifts[index]), -127, 127)
            m = kept[kind] - round_half_away(kept[kind], momentum_shift) + u
            kept[kind] = m
            if generation >= generations * 3 // 4:
                shares[kind, "kept"].append(np.mean(np.abs(m) > thresholds[index]))
                shares[kind, "rule"].append(float(np.mean(np.asarray(moves) != 0)))
    for kind in ("matrix", "vector"):
        kept_share, rule_share = np.mean(shares[kind, "kept"]), np.mean(shares[kind, "rule"])
        print(f"{kind}: share of a running sum kept {kept_share:.4f}, of the rule {rule_share:.4f}")
        assert abs(kept_share - alpha) < 0.015, kind
        assert alpha / 8 < rule_share < alpha, kind


def test_scale_by_root_is_threshold_times_root_of_the_ratio_within_its_bound():
    rng = np.random.default_rng(0)
    for _ in range(400):
        t, s = (int(rng.integers(0, 2 ** int(rng.integers(1, 31)))) for _ in range(2))
        s_null = float(rng.uniform(1, 2 ** int(rng.integers(1, 30))))
        got = int(run.scale_by_root(jnp.int32(t), jnp.int32(s), s_null))
        want = t * math.sqrt(s / s_null)
        if want >= run.INT32_MAX:
            assert got == run.INT32_MAX  # saturates: nothing can pass it
        else:
            assert abs(got - want) <= 1 + want * 2**-12, (t, s, s_null, got, want)
    # s = s_null: exact
    assert int(run.scale_by_root(jnp.int32(12345), jnp.int32(128), 128.0)) == 12345
    assert int(run.scale_by_root(jnp.int32(run.INT32_MAX), jnp.int32(5), 128.0)) == run.INT32_MAX
    assert int(run.scale_by_root(jnp.int32(100), jnp.int32(0), 128.0)) == 0  # all ties
    assert [int(run.isqrt(jnp.int32(x))) for x in (0, 1, 3, 4, 15, 16, run.INT32_MAX)] == [
        0,
        1,
        1,
        2,
        3,
        4,
        math.isqrt(run.INT32_MAX),
    ]


@pytest.mark.parametrize("fast, fitness", [(True, "ties"), (False, "heavy tails"), (False, "ties")])
def test_null_from_scores_keeps_the_moved_share_at_alpha(fast, fitness):
    """Fitness with a third of the pairs tied, or with Student-t (3 degrees of freedom)
    differences: the null std from the normal model is off, and the moved share with it; scaled
    by the scores actually used (--null_from_scores), the share is alpha within 0.01."""
    alpha, pairs = 0.2, 2048
    args = upstream(
        parallel_generations_per_gpu=2 * pairs,
        shaping="sign" if fast else "normalised",
        alpha=alpha,
        num_epochs=1,
        null_from_scores=True,
    )
    cfg = run.make_config(args)
    rng = np.random.default_rng(int(fast) + 2 * len(fitness))
    static = z_thresholds(args, cfg)[0]
    share = {True: [], False: []}
    for _ in range(4):
        values = (
            rng.standard_t(3, 2 * pairs) * 1000
            if fitness == "heavy tails"
            else rng.normal(0, 1000, 2 * pairs)
        )
        if fitness == "ties":
            tied = rng.random(pairs) < 1 / 3
            values[1::2][tied] = values[0::2][tied]
        z_matrix, z_vector, square_sum = null_z(cfg, rng, pairs, 10_000, values.astype(np.int32))
        scaled = run.scale_by_root(
            jnp.asarray(static), jnp.int32(square_sum), run.expected_square_sum(cfg)
        )
        for kind, z in ((0, z_matrix), (1, z_vector)):
            share[True].append(np.mean(np.abs(z) > int(scaled[kind])))
            share[False].append(np.mean(np.abs(z) > int(static[kind])))
    ours, normal_model = np.mean(share[True]), np.mean(share[False])
    print(f"share with the scores' null {ours:.4f}, with the normal model's {normal_model:.4f}")
    assert abs(ours - alpha) < 0.01
    assert abs(normal_model - alpha) > 0.02  # what the flag is for


def test_max_step_zero_allows_two_steps_where_an_update_weighs_step2_pairs():
    """--max_step 0 resolves by the scored pairs an update weighs (population / 2 x segments) and
    by the model's parameters, and a checkpoint records the resolved value."""

    # tiny() is upstream's, whose steps are 1: the default given
    def resolved(population, max_step=0, **model):
        args = tiny(
            parallel_generations_per_gpu=population,
            segments=1,
            optimizer="momentum",
            max_step=max_step,
        )
        args = dataclasses.replace(args, model=dataclasses.replace(args.model, **model))
        cfg = run.make_config(args)
        assert run.scored_pairs(cfg) == population // 2
        identity = run.training_identity(args, cfg, "8 bytes")
        return cfg.rule_flags.max_step, identity["max_step"]

    at = 2 * run.STEP2_PAIRS
    assert resolved(at - 2) == (1, 1) and resolved(at) == (2, 2)
    assert resolved(at, max_step=1) == (1, 1) and resolved(8, max_step=3) == (3, 3)
    # 128D-4L has 854,144 parameters, 128D-6L 1,248,384: the default model's 4,856,064 move twice
    assert resolved(8, n_embd=128, n_layer=4) == (1, 1)
    assert resolved(8, n_embd=128, n_layer=6) == (2, 2) == resolved(8, n_embd=256, n_layer=6)


def resolved_setting(name: str, *flags: str) -> int:
    """A setting of these flags (population 8) as make_config resolves it, checked to be what a
    checkpoint records."""
    args = run.parse_args(["--parallel_generations_per_gpu", "8", *flags])
    cfg = run.make_config(args)
    identity = run.training_identity(args, cfg, "8 bytes")
    assert identity[name] == chosen(cfg, name)
    return chosen(cfg, name)


def test_a_model_from_100000_parameters_quarters_its_blocks_outputs_unless_told():
    """--residual_shift -1 resolves to 2 from run.QUARTER_MODEL parameters, else 0; a given value
    stands; a checkpoint records the resolved value; upstream's algorithm adds them whole."""
    resolved = partial(resolved_setting, "residual_shift")
    small, quartered = ["--n_embd", "64", "--n_layer", "1"], ["--n_embd", "64", "--n_layer", "2"]
    assert resolved(*small) == 0 and resolved(*quartered) == 2 == resolved()  # 82,240; 131,648
    assert resolved("--n_embd", "32", "--n_layer", "1") == 0  # the first run's model
    assert resolved(*small, "--residual_shift", "2") == 2
    assert resolved(*quartered, "--residual_shift", "0") == 0
    assert resolved("--algorithm", "upstream") == 0


def test_a_model_from_a_million_parameters_keeps_a_longer_momentum_unless_told():
    """--momentum_shift 0 resolves to 3 from run.LARGE_MODEL parameters (m keeps 7/8 of itself a
    generation), else 2 (3/4); a given value stands; a checkpoint records the resolved value."""
    resolved = partial(resolved_setting, "momentum_shift")
    assert resolved() == 3 == resolved("--n_embd", "128", "--n_layer", "6")  # 4,856,064; 1,248,384
    assert resolved("--n_embd", "128", "--n_layer", "4") == 2  # 854,144
    assert resolved("--n_embd", "64", "--n_layer", "2") == 2 == resolved("--momentum_shift", "2")
    assert resolved("--n_embd", "64", "--n_layer", "2", "--momentum_shift", "4") == 4
