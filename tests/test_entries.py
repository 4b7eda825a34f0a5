"""Every entry's facts, by one test for each table over every entry of run.py's tables and of
tests/toys.py's: a shaping's scores lie within its largest where it makes them (before shape_fitness
clips them) and their root mean square on fitness unrelated to the noise is its declared null's
within 5%; a rule's state stays within its dtype at extreme inputs; a model's activations are int8
within [-127, 127] and its products' int32 accumulators, measured in int64 beside them, within the
worst cases it declares, at extreme parameters, noise and bytes."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import add_entries
from toys import CENTERED_RANKS, GRU, PAIR, TALLY

import run
from egg import flags

TOYS = dict(
    shapings={"centered_ranks": CENTERED_RANKS},
    rules={"tally": TALLY},
    models={"gru": GRU, "pair": PAIR},
)
SHAPINGS = [*run.SHAPINGS, *TOYS["shapings"]]
RULES = [*run.RULES, *TOYS["rules"]]
MODELS = [*run.MODELS, *TOYS["models"]]


@pytest.fixture
def toys(monkeypatch):
    add_entries(monkeypatch, **TOYS)


def config(*given, **changes):
    """A small run's Config, population 1024 in one segment."""
    small = ["--n_embd", "16", "--n_layer", "2", "--parallel_generations_per_gpu", "1024"]
    args = run.parse_args([*small, "--segments", "1", "--alpha", "0.1", *given])
    return run.make_config(flags.replace(args, **changes))


@pytest.mark.parametrize("name", SHAPINGS)
def test_every_shapings_scores_lie_within_its_largest_and_its_null_is_as_declared(toys, name):
    shaping = run.SHAPINGS[name]
    cfg = config("--shaping", name)
    own = cfg.shaping_flags
    rng = np.random.default_rng(0)

    def scores(fitness):
        pairs = fitness.size // 2
        return np.asarray(shaping.scores(jnp.asarray(fitness, jnp.int32), pairs, None, own))

    # fitness unrelated to the noise: 4 segments of 4096 pairs, log-likelihood sums of 100 bytes
    unrelated = np.round(rng.normal(-100 * 5 * 256, 3000, (4, 4096, 2)))
    null = scores(unrelated)
    assert null.dtype == np.int8 and np.abs(null).max() <= shaping.largest
    rms = float(np.sqrt(np.mean(null.astype(np.float64) ** 2)))
    print(f"{name}: null root mean square {rms:.3f}, declared {shaping.rms(own):.3f}")
    assert abs(rms / shaping.rms(own) - 1) < 0.05
    # and at the extremes of the fitness sum: the worst and best sums, all ties, one outlier
    worst = -run.LL_BOUND * cfg.tokens
    extremes = [
        np.tile([[0, worst], [worst, 0]], (512, 1)),
        np.zeros((1024, 2)),
        np.concatenate([np.zeros((1023, 2)), [[0, worst]]]),
        rng.choice([0, worst], (1024, 2)),
    ]
    for fitness in extremes:
        found = scores(fitness)
        assert found.dtype == np.int8 and np.abs(found).max() <= shaping.largest


def flag_extremes(rule, sizes):
    """The rule's own flags at their defaults and each ranged int flag at its range's ends, with
    the values it chooses where they say 0."""
    if rule.flags is None:
        return [None]
    facts = flags.facts_of(rule.flags)
    found = [rule.flags()]
    for field in dataclasses.fields(rule.flags):
        if field.type in (int, "int") or isinstance(field.default, int):
            ends = (facts[field.name].low, facts[field.name].high)
            found += [rule.flags(**{field.name: int(end)}) for end in ends if np.isfinite(end)]
    return [rule.resolve(f, sizes) if rule.resolve else f for f in found]


@pytest.mark.parametrize("name", RULES)
def test_every_rules_state_stays_within_its_dtype_at_extreme_inputs(toys, name):
    """Z at the largest magnitude the bounds allow, of one sign, alternating and at random, for
    200 generations with thresholds nothing passes, everything passes and in between, at each of
    the rule's flags' extreme values: every slot's new state (int32, before apply_rule stores it)
    within its dtype."""
    rule = run.RULES[name]
    cfg = config("--optimizer", name)
    reach = run.accumulator_bounds(cfg)["Z of a matrix entry"][0]
    sizes = run.Sizes(run.num_parameters(cfg), run.scored_pairs(cfg))
    rng = np.random.default_rng(1)
    generations, entries = 200, 64
    # (generations, kind, entries): one sign, alternating, at random
    signs = np.stack([np.ones(generations), 1 - 2 * (np.arange(generations) % 2)], 1)
    kinds = np.concatenate(
        [
            np.repeat(signs[:, :, None] * reach, entries, 2),
            rng.integers(-reach, reach + 1, (generations, 1, entries)),
        ],
        1,
    )
    for own in flag_extremes(rule, sizes):
        for z_std in run.null_std(cfg):
            thresholds = jnp.asarray([run.INT32_MAX, 0, int(2 * z_std)], jnp.int32)
            # each kind of Z under each threshold: (generations, thresholds x kinds, entries)
            z = jnp.asarray(np.tile(kinds, (1, 3, 1)), jnp.int32)
            evidence = run.Evidence(jnp.repeat(thresholds, 3)[:, None], z_std, jnp.zeros(1), 1.0)

            def generation(state, z_now, own=own, evidence=evidence):
                moves, new = rule.step(z_now, state, evidence, own)
                stored = {slot: new[slot].astype(dtype) for slot, dtype in rule.state.items()}
                return stored, (new, moves)

            start = {slot: jnp.zeros(z.shape[1:], dtype) for slot, dtype in rule.state.items()}
            new, moves = jax.jit(lambda z, start=start, f=generation: jax.lax.scan(f, start, z)[1])(
                z
            )
            assert np.asarray(moves).dtype == np.int32
            for slot, dtype in rule.state.items():
                values, info = np.asarray(new[slot]), jnp.iinfo(dtype)
                assert info.min <= values.min() and values.max() <= info.max, (own, slot)


def recorded_matmul(monkeypatch) -> dict:
    """run.matmul with each accumulator also computed in int64 on the host, beside it (a callback
    from the compiled program): the largest magnitude of x W^T + the noise term, and of x B."""
    largest, matmul = {"matmul": 0, "x B": 0}, run.matmul

    def record(x, w, a, b, full, sign, shift):
        x64, shift = np.asarray(x, np.int64), int(shift)
        sign = np.asarray(sign)[..., None]
        acc = x64 @ np.asarray(w, np.int64).T
        if a.size:  # (D, m, r), (D, n, r)
            xb = np.einsum("edsn,dnq->edsq", x64, np.asarray(b, np.int64))
            u = sign * (xb >> run.NOISE_FRAC)
            acc = acc + (np.einsum("edsq,dmq->edsm", u, np.asarray(a, np.int64)) >> shift)
            largest["x B"] = max(largest["x B"], int(np.abs(xb).max()))
        elif full.size:
            noise = np.einsum("edsn,dmn->edsm", x64, np.asarray(full, np.int64))
            acc = acc + ((sign * noise) >> shift)
        largest["matmul"] = max(largest["matmul"], int(np.abs(acc).max()))

    def recording(x, w, nz, sides):
        none = jnp.zeros(0, jnp.int8)
        a, b = nz if isinstance(nz, tuple) else (none, none)
        full = nz if nz is not None and not isinstance(nz, tuple) else none
        jax.debug.callback(record, x, w, a, b, full, sides.sign, sides.shift)
        return matmul(x, w, nz, sides)

    monkeypatch.setattr(run, "matmul", recording)
    return largest


def extreme_noise(cfg, sign: int):
    """Two pairs' noise at the tables' largest entries (B's at the largest of its own table), of
    one sign."""
    tables = run.make_tables(cfg.rank)
    a, b = (int(np.abs(t).max()) for t in (tables.gauss, tables.gauss_rank))
    noise = {}
    for name, shape, table in run.noise_pieces(cfg):
        entry = a if table == "gauss" else b
        noise[name] = noise.get(name, ()) + (jnp.full((2, *shape), sign * entry, jnp.int8),)
    return {k: v if len(v) == 2 else v[0] for k, v in noise.items()}


@pytest.mark.parametrize("name", MODELS)
def test_every_models_activations_are_int8_and_accumulators_within_its_bounds(
    toys, monkeypatch, name
):
    """Parameters all +127, all -127 or +-127 at random, with the noise's largest entries of either
    sign or none, reading bytes 255, 0 and at random: every activation int8 within [-127, 127], and
    every product's accumulators within the model's declared worst cases (rank 1, sigma_shift 0:
    the noise at its largest)."""
    cfg = config("--model", name, "--tokens_per_update", "3", parallel_generations_per_gpu=8)
    model, bounds = run.MODELS[name], run.accumulator_bounds(cfg)
    largest = recorded_matmul(monkeypatch)
    rng = np.random.default_rng(2)
    shapes = {k: run.full_shape(p, cfg) for k, p in run.parameters_of(cfg).items()}
    settings = {
        "+127": lambda shape: np.full(shape, 127),
        "-127": lambda shape: np.full(shape, -127),
        "random": lambda shape: rng.choice([-127, 127], shape),
    }
    rows = [np.full(3, 255, np.uint8), np.zeros(3, np.uint8), rng.integers(0, 256, 3, np.uint8)]

    @jax.jit
    def activations(params, noise, tokens):
        """Every activation of members (1, 2, S) reading the bytes, as the forward reads them."""
        members = (1, 2, 1 if noise is None else 2)  # (R, D, S)
        w = run.perturbed(params, noise, run.make_sides(0, members[2]), cfg)
        if model.window is not None:
            return [model.window(w, tokens, cfg)[1]]
        states = jnp.zeros((math.prod(members), *model.state(cfg)), jnp.int8)

        def read(carried, byte):
            _, carried, seen = model.step(w, carried, byte, cfg)
            return carried, seen

        return [jax.lax.scan(read, model.begin(states, members, cfg), tokens)[1]]

    for setting, values in settings.items():
        params = {k: jnp.asarray(values(shape), jnp.int8) for k, shape in shapes.items()}
        for noise in (extreme_noise(cfg, 1), extreme_noise(cfg, -1), None):
            sides = 1 if noise is None else 2
            for row in rows:
                tokens = jnp.asarray(np.broadcast_to(row[:, None, None, None], (3, 1, 2, sides)))
                for seen in activations(params, noise, tokens):
                    jax.effects_barrier()
                    for key, x in seen.items():
                        x = np.asarray(x)
                        assert x.dtype == np.int8 and np.abs(x).max() <= 127, (setting, key)
    print(f"{name}: largest accumulators {largest}")
    assert largest["matmul"] <= bounds["matmul accumulator x W^T + sigma x E^T"][0]
    assert largest["x B"] <= bounds["low-rank product x B"][0]
    assert largest["matmul"] > 0 and largest["x B"] > 0
