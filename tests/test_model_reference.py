"""The population forward against the independent slow reference (tests/reference.py), exactly."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from helpers import fitness_of_one_model, generation_noise, one_model_step, z_thresholds

import run
from egg import cluster, flags


def random_params(cfg, rng):
    """Parameters over the whole int8 range: typical values, with saturated entries mixed in."""
    params = {}
    for name, p in run.parameters_of(cfg).items():
        shape = run.full_shape(p, cfg)
        if p.start == run.GAIN_ONE:
            values = rng.normal(16, 12, shape)
        elif p.matrix:
            values = rng.normal(0, 20, shape)
        else:
            values = rng.normal(0, 40, shape)
        values = np.clip(np.round(values), -127, 127).astype(np.int8)
        saturated = rng.random(shape) < 0.05
        values[saturated] = rng.choice(np.array([-127, 127], np.int8), saturated.sum())
        params[name] = values
    return params


def pair(noise, k):
    return jax.tree.map(lambda x: np.asarray(x[k]), noise)


def window(cfg, rng, members):
    """Random states (two members saturated), bytes with separators (one as the first byte)."""
    states = rng.integers(-127, 128, (members, cfg.n_layer, cfg.n_embd)).astype(np.int8)
    states[0], states[1] = 127, -127
    tokens = rng.integers(0, 256, (members, cfg.tokens + 1)).astype(np.uint8)
    tokens[:, 4] = 0
    tokens[2, 0] = 0
    return states, tokens


# 12: rescales by a multiply, not a shift
@pytest.mark.parametrize(
    "n_embd, rank, sigma_shift, residual_shift",
    [(16, 1, 4, 2), (16, 3, 2, 0), (12, 2, 0, 1), (16, 0, 3, 0)],
)
def test_population_fitness_equals_the_reference_for_every_member(
    n_embd, rank, sigma_shift, residual_shift
):
    args = flags.replace(
        run.Args(),
        n_embd=n_embd,
        n_layer=2,
        parallel_generations_per_gpu=8,
        group_size=2,
        tokens_per_update=9,
        segments=1,  # the noise of one segment: population_fitness evaluates one
        rank=rank,
        sigma_shift=sigma_shift,
        residual_shift=residual_shift,
    )
    cfg = run.make_config(args)
    rng = np.random.default_rng(n_embd + 10 * rank + sigma_shift + 100)
    params = random_params(cfg, rng)
    states, tokens = window(cfg, rng, cfg.population)
    noise = generation_noise(cfg, args.seed, jnp.int32(5))
    fitness, final = fitness_of_one_model(
        params, noise, states, tokens[:, :-1], tokens[:, 1:], sigma_shift, cfg
    )
    for member in range(cfg.population):
        sign = 1 if member % 2 == 0 else -1  # member 2k adds pair k's noise, 2k + 1 subtracts it
        want, h, _ = reference.member_fitness(
            params,
            pair(noise, member // 2),
            sign,
            states[member],
            tokens[member, :-1],
            tokens[member, 1:],
            sigma_shift,
            residual_shift,
        )
        assert int(fitness[member]) == want, member
        np.testing.assert_array_equal(final[member], h, err_msg=str(member))
    assert len(set(fitness.tolist())) == cfg.population  # every member saw a different model


def carried_start(rows, cfg):
    """A member's transformer state (C, 1 + 2 L n) as the reference starts from: (flags (C,), keys
    (L, C, n), values (L, C, n))."""
    kv = np.asarray(rows[:, 1:], np.int64).reshape(len(rows), cfg.n_layer, 2, cfg.n_embd)
    return np.asarray(rows[:, 0], np.int64), kv[:, :, 0].swapaxes(0, 1), kv[:, :, 1].swapaxes(0, 1)


@pytest.mark.parametrize(
    "model, model_flags, rank, residual_shift",
    [
        ("mingru", {}, 2, 1),
        ("transformer", {"head_width": 4, "carried": 0}, 1, 0),
        ("transformer", {}, 0, 2),
        ("transformer", {"head_width": 4, "carried": 4}, 1, 0),
        ("transformer", {"carried": 9}, 2, 1),
    ],
)
def test_the_other_models_fitness_equals_the_reference_for_every_member(
    model, model_flags, rank, residual_shift
):
    """The minGRU whose gates read the input alone, and the transformer reading 11 bytes in
    windows of 6 (its validation's cut, as 'read_windows' makes it; a separator inside one), from
    a random carried state (keys, values and flags) where it carries one: every member's fitness
    and state after equal the reference's, which reads the row as one long window whose attention
    reaches --carried bytes before each window."""
    args = flags.replace(
        run.Args(),
        model=model,
        n_embd=16,
        n_layer=2,
        parallel_generations_per_gpu=8,
        group_size=2,
        tokens_per_update=6,
        segments=1,
        rank=rank,
        sigma_shift=2,
        residual_shift=residual_shift,
        **model_flags,
    )
    cfg = run.make_config(args)
    rng = np.random.default_rng(rank + 7 + 10 * residual_shift)
    params = random_params(cfg, rng)
    members, length = cfg.population, 11 if model == "transformer" else 6
    states = rng.integers(-127, 128, (members,) + run.MODELS[model].state(cfg)).astype(np.int8)
    if model == "transformer" and cfg.model_flags.carried:
        states[..., 0] = rng.integers(0, 2, states.shape[:2])  # the flags: 1 attendable
    tokens = rng.integers(0, 256, (members, length + 1)).astype(np.uint8)
    tokens[:, 3] = 0
    tokens[: members // 2, 3] = 7  # half the members read no separator: their start stays seen
    noise = generation_noise(cfg, args.seed, jnp.int32(5))
    fitness, final = fitness_of_one_model(
        params, noise, states, tokens[:, :-1], tokens[:, 1:], args.sigma_shift, cfg
    )
    width = cfg.model_flags.head_width if cfg.model_flags else 0
    for member in range(members):
        sign, noise_of = 1 - 2 * (member % 2), pair(noise, member // 2)
        inputs, targets = tokens[member, :-1], tokens[member, 1:]
        if model == "transformer":
            carried = cfg.model_flags.carried
            settings = (2, residual_shift, width, 6)
            start = carried_start(states[member], cfg) if carried else None
            want, _, after = reference.transformer_fitness(
                params,
                noise_of,
                sign,
                inputs,
                targets,
                *settings,
                carried=carried,
                start=start,
            )
            if carried:
                for got, expected in zip(carried_start(final[member], cfg), after, strict=True):
                    np.testing.assert_array_equal(got, expected, err_msg=str(member))
        else:
            want, h, _ = reference.member_fitness(
                params, noise_of, sign, states[member], inputs, targets, 2, residual_shift
            )
            np.testing.assert_array_equal(final[member], h, err_msg=str(member))
        assert int(fitness[member]) == want, member
    assert len(set(fitness.tolist())) == members  # every member saw a different model


def test_noise_free_logits_equal_the_reference_byte_by_byte():
    cfg = run.make_config(
        flags.replace(
            run.Args(), n_embd=16, n_layer=3, parallel_generations_per_gpu=4, tokens_per_update=12
        )
    )
    rng = np.random.default_rng(3)
    params = random_params(cfg, rng)
    _, tokens = window(cfg, rng, 3)
    seen = jax.tree.map(np.asarray, run.activations(params, tokens, cfg))
    zero = np.zeros((cfg.n_layer, cfg.n_embd), np.int64)
    for row in range(3):
        _, _, logits = reference.member_fitness(params, None, 1, zero, tokens[row], tokens[row], 0)
        np.testing.assert_array_equal(seen["logits"][row], logits)


def test_reference_log_softmax_equals_run_over_the_whole_range():
    rng = np.random.default_rng(0)
    tables = run.make_tables(1)
    cases = [rng.integers(-127, 128, 256) for _ in range(40)] + [
        np.full(256, 127),
        np.full(256, -127),
    ]
    spike = np.full(256, -127)
    spike[9] = 127
    for logits in [*cases, spike]:
        for target in (0, 9, int(np.argmin(logits)), 255):
            got = int(run.log2_likelihood(jnp.asarray(logits.astype(np.int8)), target, tables))
            assert got == reference.log2_softmax(logits, target)


@pytest.mark.parametrize("shared, fast", [(True, False), (False, True)])
def test_a_step_with_segments_equals_the_reference_segment_by_segment(shared, fast):
    """--segments 3 of 7 bytes (2, 2 and 3 of them): member p evaluates segment s with pair
    s D + p // 2's noise (D pairs a segment), from its pair's mean state (--shared_pair_state) or
    its own; one Z-test update weighs every segment's pair. Reference: reference.member_fitness
    segment by segment, the scores and Z (its int8 operand rounded as docs/design.org states) in
    numpy int64."""
    args = flags.replace(
        run.Args(),
        n_embd=8,
        n_layer=2,
        parallel_generations_per_gpu=8,
        tokens_per_update=7,
        segments=3,
        rank=2,
        alpha=0.5,
        optimizer="ztest",
        null_from_scores=False,
        shared_pair_state=shared,
        shaping="sign" if fast else "normalised",
    )
    cfg = run.make_config(args)
    rng = np.random.default_rng(11)
    params = random_params(cfg, rng)
    states, tokens = window(cfg, rng, cfg.population)
    batch = tokens[0::2]  # group_size 2: a pair's members read one sequence
    tokens = np.repeat(batch, 2, axis=0)
    thresholds = z_thresholds(args, cfg)[7]
    step = run.make_generation_step(cfg, cluster.population_mesh(run.POP, jax.devices()[:1]))
    new, _, final, fitness, _ = one_model_step(
        step, (params, {}, states), batch, 7, thresholds, args.seed, args.sigma_shift
    )

    noise = generation_noise(cfg, args.seed, jnp.int32(7))
    pairs, ends = cfg.population // 2, [0, 2, 4, 7]
    h = states.astype(np.int64)
    seg_fitness = np.zeros((cfg.segments, cfg.population), np.int64)
    for s in range(cfg.segments):
        if shared:
            mean = reference.round_half_away(h[0::2] + h[1::2], 1)
            h[0::2], h[1::2] = mean, mean
        part = slice(ends[s], ends[s + 1])
        for m in range(cfg.population):
            seg_fitness[s, m], h[m], _ = reference.member_fitness(
                params,
                pair(noise, s * pairs + m // 2),
                1 - 2 * (m % 2),
                h[m],
                tokens[m, :-1][part],
                tokens[m, 1:][part],
                args.sigma_shift,
            )
    np.testing.assert_array_equal(final, h)
    np.testing.assert_array_equal(fitness, seg_fitness.sum(0))
    diff = (seg_fitness[:, 0::2] - seg_fitness[:, 1::2]).reshape(-1).tolist()  # segment-major
    mean = max(sum(abs(d) for d in diff) // len(diff), 1)
    scores = [int(np.sign(d)) * (1 if fast else min(16 * abs(d) // mean, 127)) for d in diff]
    assert len(set(scores)) > 1 + (not fast)  # signs (and sizes), not all alike
    moved = 0
    for name, p in run.parameters_of(cfg).items():
        if isinstance(noise[name], tuple):
            a, b = (np.asarray(x).astype(np.int64) for x in noise[name])
            product = a * np.reshape(scores, (-1,) + (1,) * (a.ndim - 1))
            shift = 0 if fast else 6  # the int8 operand: |score x a| <= 127 x 46 = 5,842 -> 91
            operand = reference.round_half_away(product, shift)
            z = np.einsum("k...mr,k...nr->...mn", operand, b)
        else:
            z = np.einsum("k...,k->...", np.asarray(noise[name]).astype(np.int64), np.array(scores))
        step_ = np.sign(z) * (np.abs(z) > thresholds[0 if p.matrix else 1])
        want = np.clip(params[name].astype(np.int64) + step_, -127, 127)
        np.testing.assert_array_equal(new[name], want, err_msg=name)
        moved += int(np.sum(want != params[name]))
    assert moved > 0
    # the test's null counts every segment's pairs: as many pairs in one segment give its thresholds
    one = run.make_config(dataclasses.replace(args, segments=1, parallel_generations_per_gpu=24))
    # one byte each at most
    assert run.make_config(dataclasses.replace(args, segments=10)).segments == 7
    assert run.null_std(cfg) == run.null_std(one) and run.null_std(cfg) != run.null_std(
        cfg._replace(segments=1)
    )


def carrying(**changes):
    """A transformer 16D-2L of 8 members reading windows of 6 bytes, carrying --carried 8."""
    given = dict(n_embd=16, n_layer=2, parallel_generations_per_gpu=8, group_size=2)
    given.update(tokens_per_update=6, segments=1, head_width=4, carried=8)
    return run.make_config(flags.replace(run.Args(), model="transformer", **given | changes))


def test_a_byte_0_hides_every_carried_key():
    """Members whose window starts with byte 0 (a document's start) score the same from random
    carried keys, values and flags as from none; without the byte 0 the carried ones count."""
    cfg = carrying()
    rng = np.random.default_rng(11)
    params = random_params(cfg, rng)
    noise = generation_noise(cfg, 0, jnp.int32(1))
    tokens = rng.integers(1, 256, (cfg.population, 7)).astype(np.uint8)
    tokens[:, 0] = 0
    empty = np.zeros((cfg.population,) + run.carried_state(cfg), np.int8)
    full = rng.integers(-127, 128, empty.shape).astype(np.int8)
    full[..., 0] = 1

    def fitness(states, tokens):
        return fitness_of_one_model(params, noise, states, tokens[:, :-1], tokens[:, 1:], 2, cfg)

    np.testing.assert_array_equal(fitness(full, tokens)[0], fitness(empty, tokens)[0])
    tokens[:, 0] = 9
    assert np.all(fitness(full, tokens)[0] != fitness(empty, tokens)[0])


def test_a_window_model_read_a_byte_a_call_gives_its_windows_logits():
    """window_step (write's and --sample's reading) from a document's byte 0 gives each byte the
    logits read_windows gives it reading the row in windows, carrying keys and values across
    them."""
    cfg = carrying()
    rng = np.random.default_rng(5)
    params = random_params(cfg, rng)
    row = rng.integers(1, 256, (1, 23)).astype(np.uint8)
    row[0, 0] = 0
    want = np.asarray(run.activations(params, row, cfg)["logits"])[0]
    read, carried = run.make_reader(cfg), run.one_model(params, cfg, 1)[1]
    for at, byte in enumerate(row[0]):
        carried, logits = read(params, carried, np.array([byte], np.uint8))
        np.testing.assert_array_equal(np.asarray(logits), want[at], err_msg=str(at))
