"""int32 accumulators at their real limits: every bound in run.accumulator_bounds is reached
exactly (compared with Python integers) at the largest setting the checks allow, and one step
past that setting is refused with a message naming the flag."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CACHE, OPTIMISED, in_process, init_params, member_matmul, one_line_error

import run
from egg import cluster, flags

WORST_NOISE = int(np.abs(run.make_tables(1).gauss).max())  # 46: the largest |noise entry|


def largest(key, step, **base):
    """The largest value of Args.key, a multiple of `step`, that check_ranges accepts (the
    search doubles, then bisects) and the error one step above it."""

    def refused(value):
        try:
            run.check_bounds(run.make_config(flags.replace(run.Args(), **{**base, key: value})))
        except run.UserError as error:
            return str(error)
        return None

    high = step
    while not refused(high):
        high *= 2
    low = high // 2
    while high - low > step:
        middle = (low + high) // 2 // step * step
        low, high = (low, middle) if refused(middle) else (middle, high)
    return low, refused(high)


def exact_shaped_scores(fitness, shaping: str = "normalised") -> list[int]:
    """A shaping's scores in Python integers: normalised's sign(d) min(floor(16 |d| / mean|d|),
    127); standardised's sign(d) min(round(8 q / r), 127), q = min(floor(256 |d| / mean|d|),
    2**15 - 1), r = isqrt(floor(mean q**2))."""
    diffs = [int(a) - int(b) for a, b in zip(fitness[0::2], fitness[1::2], strict=True)]
    mean = max(sum(abs(d) for d in diffs) // len(diffs), 1)
    signs = [(d > 0) - (d < 0) for d in diffs]
    if shaping == "normalised":
        return [s * min(16 * abs(d) // mean, 127) for s, d in zip(signs, diffs, strict=True)]
    q = [min(256 * abs(d) // mean, 2**15 - 1) for d in diffs]
    root = max(math.isqrt(sum(x * x for x in q) // len(q)), 1)
    return [s * min((16 * x + root) // (2 * root), 127) for s, x in zip(signs, q, strict=True)]


def test_matmul_at_the_largest_width_reaches_its_bound_exactly(monkeypatch, capsys):
    n_embd, error = largest("n_embd", 4)
    assert "matmul accumulator" in error and "--n_embd" in error
    bound = run.accumulator_bounds(run.make_config(flags.replace(run.Args(), n_embd=n_embd)))
    n_in = 4 * n_embd  # the MLP's down projection, the widest product
    rank = run.make_tables(1).gauss_rank
    # the int32 accumulator itself, before its division to int8
    monkeypatch.setattr(run, "divide_to_int8", lambda acc, divisor: acc)
    for sign in (1, -1):
        x = jnp.full(n_in, 127, jnp.int8)
        w = jnp.full((2, n_in), 127 * sign, jnp.int8)
        a = jnp.full((2, 1), WORST_NOISE * sign, jnp.int8)
        b = jnp.full((n_in, 1), int(np.abs(rank).max()), jnp.int8)
        acc = member_matmul(x, w, (a, b), 1, 0)
        want = bound["matmul accumulator x W^T + sigma x E^T"][0]
        assert acc.tolist() == [sign * want] * 2 and want <= run.INT32_MAX
        low_rank = int(np.asarray(run.chunked_dot(x, b))[0])
        assert low_rank == bound["low-rank product x B"][0] == 127 * int(np.abs(rank).max()) * n_in
    print(f"largest --n_embd {n_embd}: accumulator {want:,}")
    monkeypatch.undo()
    one_line_error(in_process(capsys, "--n_embd", str(n_embd + 4)), "use a smaller --n_embd")


def worst_case_params(cfg, target: int):
    """A model whose every prediction of byte `target` is as bad as int8 logits allow: the
    residual stream is the embedding (every block's gains zero), all +127, and the head gives
    `target` the logit -127 and every other byte +127."""
    params = {k: np.zeros_like(v) for k, v in init_params(cfg, 0).items()}
    params["emb"][:], params["ln_out"][:], params["head"][:] = 127, 127, 127
    params["head"][target] = -127
    return params


def test_validation_rows_and_fitness_at_the_longest_sequence_the_bound_allows(capsys):
    tokens = run.INT32_MAX // run.LL_BOUND  # the longest validation row and --tokens_per_update
    base = {"n_embd": 4, "n_layer": 1, "parallel_generations_per_gpu": 2, "group_size": 2}
    assert largest("tokens_per_update", 1, **base)[0] == tokens
    cfg = run.make_config(flags.replace(run.Args(), **base, tokens_per_update=tokens))
    params = worst_case_params(cfg, target=65)
    rows = run.validation_rows(
        np.full(2 * (tokens + 1), 65, np.uint8), flags.replace(run.Args(), validation_batch_size=2)
    )
    assert rows.shape == (2, tokens + 1)
    logits = np.full(256, 127, np.int8)
    logits[65] = -127
    worst = int(run.log2_likelihood(jnp.asarray(logits), 65, run.make_tables(1)))
    assert -run.LL_BOUND <= worst < -254 * 16
    with_replica_axis = {k: v[None] for k, v in params.items()}
    evaluate = run.make_evaluate(cfg, cluster.population_mesh(run.POP))
    # 337,230 bytes a row, one after another: XLA's optimisations pay (11 s to 4 s here)
    evaluate = evaluate.lower(with_replica_axis, rows).compile(OPTIMISED)
    fitness = np.asarray(evaluate(with_replica_axis, rows))[0]
    print(f"{tokens:,} tokens of log2-likelihood {worst}: fitness {fitness.tolist()}")
    assert fitness.tolist() == [worst * tokens] * 2 and worst * tokens < -(2**30)
    # the pair difference, in int32, through both shapings
    pairs = jnp.asarray(
        [0, worst * tokens, worst * tokens, 0, worst * tokens, worst * tokens], jnp.int32
    )
    for fast in (True, False):
        scores = np.asarray(
            run.shape_fitness(pairs, cfg._replace(shaping="sign" if fast else "normalised"))
        ).tolist()
        assert (
            scores == ([1, -1, 0] if fast else exact_shaped_scores(np.asarray(pairs))) != [0, 0, 0]
        )
    one_line_error(
        in_process(capsys, "--tokens_per_update", str(tokens + 1), "--group_size", "2"),
        "use a smaller --tokens_per_update",
    )
    longer = np.full(2 * (tokens + 2), 65, np.uint8)
    with pytest.raises(run.UserError, match=f"use --validation_tokens {tokens} or less"):
        run.validation_rows(longer, flags.replace(run.Args(), validation_batch_size=2))
    one_line_error(
        in_process(
            capsys,
            "--data",
            "stdlib",
            "--dir_path",
            CACHE,
            "--validation_tokens",
            str(tokens + 1),
            "--validation_batch_size",
            "1",
            "--valid_fraction",
            "0.1",
        ),
        "--validation_tokens",
    )


@pytest.mark.parametrize(
    "use_clt, shaping", [(True, "normalised"), (False, "normalised"), (True, "standardised")]
)
def test_shaped_fitness_at_the_largest_population_is_exact(use_clt, shaping):
    base = dict(shaping=shaping, use_clt=use_clt, segments=1)  # every pair's score at once
    population, error = largest("parallel_generations_per_gpu", 2, **base)
    assert "--shaping sign" in error
    cfg = run.make_config(
        flags.replace(run.Args(), parallel_generations_per_gpu=population, **base)
    )
    pairs = population // 2
    bounds = run.accumulator_bounds(cfg)
    biggest = run.LL_BOUND * (run.INT32_MAX // run.LL_BOUND)  # the largest pair difference allowed
    rng = np.random.default_rng(0)
    cases = {
        # every |difference| at its largest: the sum of |d| is ~pairs x 2**31
        "all largest": np.full(pairs, biggest),
        # remainders mod pairs at their largest, pairs - 1: every chunk's sum at its largest
        "remainders": np.full(pairs, (biggest // pairs) * pairs - 1),
        "one outlier": np.where(np.arange(pairs) == 3, biggest, 100),
        "spread": rng.integers(0, biggest, pairs),
        "small": rng.integers(0, 40, pairs),
    }
    chunk = run.remainders_chunk(pairs)
    rests = [int(d) % pairs for d in cases["remainders"]]
    chunk_sums = [sum(rests[i : i + chunk]) for i in range(0, pairs, chunk)]
    assert max(chunk_sums) == chunk * (pairs - 1) <= run.INT32_MAX < (chunk + 1) * pairs
    rests_of_chunks = sum(c % pairs for c in chunk_sums)
    bound = bounds["sum of a floor mean's remainders mod pairs (the shaping's)"][0]
    assert rests_of_chunks <= bound <= run.INT32_MAX < sum(rests)  # one sum of them would overflow
    for name, size in cases.items():
        signs = rng.choice([-1, 1], pairs)
        fitness = np.stack(
            [np.where(signs > 0, 0, -size), np.where(signs > 0, -size, 0)], 1
        ).ravel()
        got = np.asarray(run.shape_fitness(jnp.asarray(fitness, jnp.int32), cfg)).tolist()
        assert got == exact_shaped_scores(fitness, shaping), name
    print(f"population {population} (use_clt {use_clt}): scores exact")


@pytest.mark.parametrize("use_clt, fast", [(True, True), (False, True), (True, False)])
def test_z_at_the_largest_population_reaches_its_bound_exactly(use_clt, fast):
    base = {
        "use_clt": use_clt,
        "shaping": "sign" if fast else "normalised",
        "n_embd": 4,
        "segments": 1,
    }
    population, error = largest("parallel_generations_per_gpu", 2048, **base)
    # normalised scores: the int8 operand of Z (weighted_shift) leaves the squared weights binding
    assert ("Z of" if fast else "squared pair weights") in error
    # 1024 distinct pairs, each shared by population / 2048 pairs: their summed scores are the
    # weights, so Z reaches the same worst case as population / 2 distinct pairs would
    cfg = run.make_config(
        flags.replace(
            run.Args(), parallel_generations_per_gpu=population, num_perturbations=2048, **base
        )
    )
    tables = run.make_tables(1)
    a = jnp.full((1024, 1, 1), WORST_NOISE, jnp.int8)
    b = jnp.full((1024, 1, 1), int(np.abs(tables.gauss_rank).max()), jnp.int8)
    weights = jnp.full(1024, (population // 2048) * (1 if fast else 127), jnp.int32)
    z = int(run.z_statistic((a, b), weights, cfg)[0, 0])
    bounds = run.accumulator_bounds(cfg)
    assert z == bounds["Z of a matrix entry"][0] <= run.INT32_MAX
    v = int(run.z_statistic(a[:, :, 0], weights, cfg)[0])
    assert v == bounds["Z of a vector entry"][0] <= run.INT32_MAX


@pytest.mark.parametrize("fast", [True, False])
def test_bounds_count_every_segments_pairs(fast):
    """--segments S: one update weighs S times the pairs, so the largest population the bounds
    allow (Z's with sign scores, the squared pair weights' with normalised ones) is 1 / S of the one
    without segments (to the search's step), and the refusal names the flag; by default a population
    gets the most segments, up to 10, that the bounds allow."""
    base = {"n_embd": 4, "tokens_per_update": 100, "shaping": "sign" if fast else "normalised"}
    alone, _ = largest("parallel_generations_per_gpu", 64, segments=1, **base)
    segmented, error = largest("parallel_generations_per_gpu", 64, segments=4, **base)
    assert ("Z of" if fast else "squared pair weights") in error and "--segments" in error
    assert segmented == alone // 4 // 64 * 64
    # the default (--segments 0) takes 10, or as many as the bound allows: every population runs
    for population in (2 * alone // 10, alone // 2, alone):
        cfg = run.make_config(
            flags.replace(run.Args(), parallel_generations_per_gpu=population, **base)
        )
        run.check_bounds(cfg)
        assert cfg.segments == min(10, alone // population)
        refused = cfg._replace(segments=cfg.segments + 1)
        assert cfg.segments == 10 or "--segments" in str(
            pytest.raises(run.UserError, run.check_bounds, refused).value
        )
