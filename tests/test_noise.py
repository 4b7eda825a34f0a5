"""Counter-based noise and the low-rank perturbed forward."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import generation_noise, init_params, member_embed, member_matmul, member_vector

import run
from egg import flags


def cfg(**overrides):
    args = dict(n_embd=16, n_layer=2, parallel_generations_per_gpu=8, num_epochs=4)
    args.update(overrides)
    return run.make_config(flags.replace(run.Args(), **args))


def eager_pair_noise(c, bucket, pair, segment=0, seed=0):
    """One pair's noise in one segment, as generation_noise builds it for every pair."""
    return run.words_to_noise(c, run.mix_segment(run.pair_words(c, seed, bucket, pair), segment))


# compiled once a configuration and segment (op by op, each operation compiles on its own)
pair_noise = jax.jit(eager_pair_noise, static_argnums=(0, 3))


def flat(noise):
    return np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(noise)]).astype(
        np.float64
    )


def test_same_counters_give_the_same_values_jitted_or_not():
    c = cfg(n_embd=8, n_layer=1)
    eager = eager_pair_noise(c, 3, 2)
    jitted = jax.jit(lambda b, k: eager_pair_noise(c, b, k))(3, 2)
    batched = jax.tree.map(lambda x: x[2], run.generation_noise(c, 0, jnp.int32(3)))
    leaves = (jax.tree.leaves(eager), jax.tree.leaves(jitted), jax.tree.leaves(batched))
    for x, y, z in zip(*leaves, strict=True):
        np.testing.assert_array_equal(x, y)
        np.testing.assert_array_equal(x, z)


def test_mean_and_variance_as_intended():
    c = cfg(n_embd=64)
    values = np.concatenate([flat(pair_noise(c, 0, k)) for k in range(8)])
    gauss = run.make_tables(1).gauss.astype(np.float64)
    mean, var = gauss.mean(), gauss.var()  # the table is every quantile once: exact moments
    assert mean == 0 and 15**2 < var < 16**2  # N(0, 1) at 4 fractional bits, tails cut at 2.9 sd
    n = values.size
    assert abs(values.mean()) < 5 * math.sqrt(var / n)
    fourth = np.mean(gauss**4)
    assert abs(values.var() - var) < 5 * math.sqrt((fourth - var**2) / n)


@pytest.mark.parametrize("rank", [2, 3, 16])
def test_rank_scaling_keeps_the_variance_of_a_b_transposed(rank):
    tables = run.make_tables(rank)
    a, b = tables.gauss.astype(np.float64), tables.gauss_rank.astype(np.float64)
    # entry variance of A B^T / 256 (a sum of r products) stays ~1 whatever the rank
    assert abs(rank * a.var() * b.var() / 2**16 - 0.95) < 0.1


def corr(x, y):
    return float(np.corrcoef(x, y)[0, 1])


def test_independence_between_pairs_parameters_and_generations():
    c = cfg(n_embd=64)
    base = pair_noise(c, 0, 0)
    other_pair = pair_noise(c, 0, 1)
    other_generation = pair_noise(c, 1, 0)
    bound = 5 / math.sqrt(flat(base).size)
    assert abs(corr(flat(base), flat(other_pair))) < bound
    assert abs(corr(flat(base), flat(other_generation))) < bound
    wf, uf = np.asarray(base["Wf"][0]).ravel(), np.asarray(base["Uf"][0]).ravel()
    layers = np.asarray(base["Wf"][0][0]).ravel(), np.asarray(base["Wf"][0][1]).ravel()
    assert abs(corr(wf, uf)) < 5 / math.sqrt(wf.size)
    assert abs(corr(*layers)) < 5 / math.sqrt(layers[0].size)
    a, b = (np.asarray(x).ravel()[:64] for x in base["W1"])
    assert not np.array_equal(a, b)


def test_noise_reuse():
    for reuse, same, different in ((0, [(0, 999)], []), (4, [(0, 3), (4, 7)], [(3, 4)])):
        c = cfg(noise_reuse=reuse)
        for g1, g2 in same + different:
            x = flat(generation_noise(c, 0, jnp.int32(g1)))
            y = flat(generation_noise(c, 0, jnp.int32(g2)))
            assert np.array_equal(x, y) == ((g1, g2) in same)


def test_antithetic_members_get_opposite_perturbations():
    nz = pair_noise(cfg(), 0, 0)["bf"][0]
    zero = jnp.zeros(16, jnp.int8)
    plus = member_vector(zero, nz, 1, 4)
    minus = member_vector(zero, nz, -1, 4)
    np.testing.assert_array_equal(plus, -minus)
    assert np.any(plus != 0)


@pytest.mark.parametrize("rank", [1, 3])
@pytest.mark.parametrize("sign", [1, -1])
def test_low_rank_forward_equals_forward_with_w_plus_sigma_e_materialised(rank, sign):
    sigma_shift = 2
    rng = np.random.default_rng(rank)
    w = rng.integers(-60, 61, (96, 64)).astype(np.int8)
    tables = run.make_tables(rank)
    a = tables.gauss[rng.integers(0, 256, (96, rank))]
    b = tables.gauss_rank[rng.integers(0, 256, (64, rank))]
    sigma = 2.0**-sigma_shift
    # explicit: W' = W/16 + sign sigma A B^T / 256 (real units), output = x W'^T * 16 / (16 sqrt(n))
    e = a.astype(np.float64) @ b.T.astype(np.float64) / 2**8
    w_real = w / 16 + sign * sigma * e
    worst, exact_share = 0.0, []
    for _ in range(40):
        x = rng.integers(-127, 128, 64).astype(np.int8)
        want = x.astype(np.float64) @ w_real.T * 16 / (16 * math.sqrt(64))
        got = member_matmul(x, w, (a, b), sign, sigma_shift).astype(np.float64)
        want_int = np.clip(np.floor(want), -127, 127)
        worst = max(worst, np.max(np.abs(got - np.clip(want, -127, 127))))
        exact_share.append(np.mean(got == want_int))
    assert worst < 1.1  # a floor of the exact value, up to the int32 rounding of (x B) >> 4
    assert np.mean(exact_share) > 0.97


def test_init_std_scales_upstreams_normal_entries_exactly():
    """--init_std s: each matrix entry is upstream's (s = 16: the quantile table's entry itself)
    times s / 16, rounded half away from zero, in exact integers; vectors are as upstream's."""
    upstream = jax.tree.map(np.asarray, init_params(cfg(init_std=16), 0))
    matrices = [k for k, p in run.parameters_of(cfg()).items() if p.matrix]
    table = set(run.make_tables(1).gauss.tolist())
    for s in (0, 1, 3, 4, 32):
        params = jax.tree.map(np.asarray, init_params(cfg(init_std=s), 0))
        for name, q in upstream.items():
            assert params[name].dtype == np.int8, name
            if name not in matrices:
                np.testing.assert_array_equal(params[name], q)
                continue
            assert set(np.unique(q).tolist()) <= table, name
            wide = q.astype(np.int64)
            want = np.sign(wide) * ((np.abs(wide) * s + 8) // 16)
            np.testing.assert_array_equal(params[name], want, err_msg=f"{name}, init_std {s}")
    entries = np.concatenate([params[k].ravel() for k in matrices]).astype(np.float64)
    assert abs(entries.std() - 32) < 2  # s = 32: twice upstream's scale, unclipped (|q| <= 92)


@pytest.mark.parametrize("rank", [1, 3])
def test_embedding_perturbation_equals_explicit_row(rank):
    c, sigma_shift = cfg(n_embd=16, rank=rank), 1
    nz = pair_noise(c, 0, 2)["emb"]
    params = init_params(c, 0)
    a, b = (np.asarray(x, np.float64) for x in nz)
    explicit = np.asarray(params["emb"], np.float64) + 16 * 2.0**-sigma_shift * (a @ b.T) / 2**8
    for tok in (0, 65, 255):
        got = member_embed(params["emb"], tok, nz, 1, sigma_shift)
        assert np.max(np.abs(got - np.clip(explicit[tok], -127, 127))) < 1


@pytest.mark.parametrize("sign", [1, -1])
def test_full_rank_forward_equals_explicit_w_plus_sigma_e(sign):
    """--rank 0 (naive ES): a full noise matrix E, x (W + sigma E)^T computed directly."""
    c, sigma_shift = cfg(n_embd=64, rank=0), 2
    rng = np.random.default_rng(7)
    w = rng.integers(-60, 61, (96, 64)).astype(np.int8)
    e = run.make_tables(0).gauss[rng.integers(0, 256, (96, 64))]
    w_real = w / 16 + sign * 2.0**-sigma_shift * e / 16
    for _ in range(20):
        x = rng.integers(-127, 128, 64).astype(np.int8)
        want = np.clip(x.astype(np.float64) @ w_real.T / math.sqrt(64), -127, 127)
        got = member_matmul(x, w, e, sign, sigma_shift)
        assert np.max(np.abs(got - want)) < 1  # the floor of the exact value
    full = pair_noise(c, 0, 0)
    assert (
        full["Wf"].shape == (2, 64, 64)
        and full["emb"].shape == (256, 64)
        and full["bf"].shape == (2, 64)
    )


@pytest.mark.parametrize("n", [256, 64, 48, 37, 8])
@pytest.mark.parametrize("rank", [1, 3])
def test_chunked_rank_product_is_the_exact_dot(n, rank):
    rng = np.random.default_rng(n + rank)
    gauss = run.make_tables(rank).gauss
    for x, b in (
        (rng.integers(-127, 128, n), gauss[rng.integers(0, 256, (n, rank))]),
        (np.full(n, 127), np.full((n, rank), gauss.min())),  # the most negative sum
        (np.full(n, -127), np.full((n, rank), gauss.min())),  # the most positive
    ):
        x, b = x.astype(np.int8), b.astype(np.int8)
        want = x.astype(np.int64) @ b.astype(np.int64)
        got = np.asarray(run.chunked_dot(jnp.asarray(x), jnp.asarray(b)))
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, want)


def test_pair_noise_is_one_stream_of_bytes_cut_in_order():
    """The documented counter contract: byte k of pair p's stream in bucket g indexes the table of
    noise entry k (pieces in the model's parameters' order, A before B), the stream being threefry's
    32-bit words of key (seed, 1, g, p) read as little-endian bytes."""
    c, seed = cfg(n_embd=8, n_layer=2, rank=2), 5
    bucket, pair = 3, 1
    root = jax.random.fold_in(jax.random.key(seed, impl="threefry2x32"), 1)
    key = jax.random.fold_in(jax.random.fold_in(root, bucket), pair)
    pieces = run.noise_pieces(c)
    total = sum(math.prod(shape) for _, shape, _ in pieces)
    words = np.asarray(jax.random.bits(key, (-(-total // 4),), jnp.uint32))
    stream = words.astype("<u4").view(np.uint8)
    tables = run.make_tables(c.rank)
    noise, offset = pair_noise(c, bucket, pair, seed=seed), 0
    seen = {}
    for name, shape, table in pieces:
        size = math.prod(shape)
        want = getattr(tables, table)[stream[offset : offset + size].reshape(shape)]
        got = noise[name][seen.get(name, 0)] if isinstance(noise[name], tuple) else noise[name]
        np.testing.assert_array_equal(got, want)
        seen[name], offset = seen.get(name, 0) + 1, offset + size
    assert offset == total and offset > len(run.parameters_of(c))


def numpy_lowbias32(x):
    """C. Wellons' lowbias32 in numpy uint32 arithmetic (products wrap modulo 2**32)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def test_segment_noise_is_segment_zeros_stream_remixed():
    """The documented contract of --segments: segment s >= 1's stream of pair k is lowbias32
    applied twice to each of segment 0's threefry words plus s x 0x9E3779B9 (mod 2**32), cut and
    looked up as segment 0's; generation_noise lays the pairs out segment-major (s D + k)."""
    c, seed = cfg(n_embd=8, n_layer=2, rank=2, segments=3, tokens_per_update=9), 5
    bucket, pair = 3, 1
    words = np.asarray(run.pair_words(c, seed, bucket, pair))
    batched = generation_noise(c, seed, jnp.int32(bucket))
    for segment in range(c.segments):
        with np.errstate(over="ignore"):
            mixed = words + np.uint32(segment * 0x9E3779B9 % 2**32)
            mixed = numpy_lowbias32(numpy_lowbias32(mixed)) if segment else words
        want = run.words_to_noise(c, jnp.asarray(mixed))
        got = pair_noise(c, bucket, pair, segment, seed)
        laid_out = jax.tree.map(lambda x, s=segment: x[s * c.distinct_pairs + pair], batched)
        for x, y, z in zip(*map(jax.tree.leaves, (want, got, laid_out)), strict=True):
            np.testing.assert_array_equal(x, y)
            np.testing.assert_array_equal(x, z)


def test_segments_noise_is_independent_and_normal_like_segment_zeros():
    """Remixed streams keep the table's distribution and share nothing with segment 0 or each
    other: means and variances as intended, correlations within 5 standard errors, and the joint
    distribution of two segments' bytes (their top 4 bits, 16 x 16 cells) uniform by a chi-square
    test at the 0.1% level."""
    c = cfg(n_embd=64, segments=3)
    words = jnp.stack([run.pair_words(c, 0, 0, k) for k in range(4)])
    streams = [np.asarray(run.mix_segment(words, s)).ravel() for s in range(3)]
    gauss = run.make_tables(1).gauss.astype(np.float64)
    for s in (1, 2):
        values = flat(jax.vmap(lambda w, s=s: run.words_to_noise(c, run.mix_segment(w, s)))(words))
        n = values.size
        assert abs(values.mean()) < 5 * math.sqrt(gauss.var() / n)
        assert abs(values.var() - gauss.var()) < 5 * math.sqrt(
            (np.mean(gauss**4) - gauss.var() ** 2) / n
        )
        for other in range(s):
            x, y = (streams[i].view(np.uint8).astype(np.float64) for i in (s, other))
            assert abs(corr(gauss[x.astype(int)], gauss[y.astype(int)])) < 5 / math.sqrt(x.size)
            counts = np.histogram2d(x // 16, y // 16, bins=16, range=[[0, 16], [0, 16]])[0]
            expected = x.size / 256
            chi2 = float(np.sum((counts - expected) ** 2 / expected))
            assert chi2 < 330, chi2  # 255 degrees of freedom: P(chi2 > 330) < 0.001


def test_largest_sigma_shift_is_the_last_at_which_vectors_are_perturbed():
    """--sigma_shift's range (its Facts) ends at the shift beyond which every table entry rounds to
    0: a vector moves by round_shift(q, sigma_shift + NOISE_FRAC - WEIGHT_FRAC) for a noise entry q,
    which is >= 1 while |q| >= 2**(shift - 1)."""
    table = jnp.asarray(run.make_tables(1).gauss)
    zero = jnp.zeros(table.shape, jnp.int8)
    largest = int(np.abs(run.make_tables(1).gauss).max()).bit_length() - (
        run.NOISE_FRAC - run.WEIGHT_FRAC
    )
    # the table's largest |entry| is 46 < 2**6
    assert largest == flags.facts_of(run.Args)["sigma_shift"].high == 6
    for shift, perturbed in ((largest, True), (largest + 1, False)):
        moved = member_vector(zero, table, 1, shift)
        assert bool(np.any(moved != 0)) is perturbed, shift
    run.check_args(flags.replace(run.Args(), sigma_shift=largest))
    with pytest.raises(run.UserError, match="rounds to 0"):
        run.check_args(flags.replace(run.Args(), sigma_shift=largest + 1))
