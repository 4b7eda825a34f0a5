"""Every entry's facts, by one test for each table over every entry of run.py's tables and of
tests/toys.py's: a shaping's scores lie within its largest where it makes them (before shape_fitness
clips them) and their root mean square on fitness unrelated to the noise is its declared null's
within 5%; a rule's state stays within its dtype at extreme inputs; a model's activations are int8
within [-127, 127] and its products' int32 accumulators, measured in int64 beside them, within the
worst cases it declares, at extreme parameters, noise and bytes. An entry that understates one of
them is found, not wrapped silently."""

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


def shaping_problems(name: str) -> list[str]:
    """What a shaping's scores break of its declared facts: scores beyond its largest where it
    makes them (before shape_fitness clips them), on fitness unrelated to the noise or at the
    extremes of the fitness sum, and a root mean square on the unrelated fitness more than 5% off
    its declared null."""
    shaping = run.SHAPINGS[name]
    cfg = config("--shaping", name)
    own, problems = cfg.shaping_flags, []
    rng = np.random.default_rng(0)

    def scores(fitness):
        pairs = fitness.size // 2
        return np.asarray(shaping.scores(jnp.asarray(fitness, jnp.int32), pairs, None, own))

    # fitness unrelated to the noise: 4 segments of 4096 pairs, log-likelihood sums of 100 bytes;
    # then the worst and best sums, all ties, one outlier
    worst = -run.LL_BOUND * cfg.tokens
    cases = {
        "unrelated": np.round(rng.normal(-100 * 5 * 256, 3000, (4, 4096, 2))),
        "extremes": np.tile([[0, worst], [worst, 0]], (512, 1)),
        "ties": np.zeros((1024, 2)),
        "an outlier": np.concatenate([np.zeros((1023, 2)), [[0, worst]]]),
        "random extremes": rng.choice([0, worst], (1024, 2)),
    }
    for case, fitness in cases.items():
        found = scores(fitness)
        if found.dtype != np.int8 or np.abs(found).max() > shaping.largest:
            problems.append(f"scores beyond its largest {shaping.largest} ({case})")
        if case == "unrelated":
            rms = float(np.sqrt(np.mean(found.astype(np.float64) ** 2)))
            print(f"{name}: null root mean square {rms:.3f}, declared {shaping.rms(own):.3f}")
            if abs(rms / shaping.rms(own) - 1) >= 0.05:
                problems.append(f"null root mean square {rms:.3f}, declared {shaping.rms(own):.3f}")
    return problems


@pytest.mark.parametrize("name", SHAPINGS)
def test_every_shapings_scores_lie_within_its_largest_and_its_null_is_as_declared(toys, name):
    assert shaping_problems(name) == []


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


def rule_problems(name: str) -> list[str]:
    """What a rule's state breaks of its dtype: Z at the largest magnitude the bounds allow, of one
    sign, alternating and at random, for 200 generations with thresholds nothing passes, everything
    passes and in between, at each of the rule's flags' extreme values; every slot's new state
    (int32, before apply_rule stores it) checked against its dtype's range."""
    rule, problems = run.RULES[name], []
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
            if np.asarray(moves).dtype != np.int32:
                problems.append(f"moves of {np.asarray(moves).dtype}")
            for slot, dtype in rule.state.items():
                values, info = np.asarray(new[slot]), jnp.iinfo(dtype)
                if values.min() < info.min or values.max() > info.max:
                    problems.append(f"{slot} reaches {np.abs(values).max():,} beyond {info.dtype}")
    return problems


@pytest.mark.parametrize("name", RULES)
def test_every_rules_state_stays_within_its_dtype_at_extreme_inputs(toys, name):
    assert rule_problems(name) == []


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


# the accumulators of the transformer's attention, by the names its bounds give them
ATTENTION = {
    "score": "a head's score q k^T times its multiplier",
    "sum": "attention's sum of 2**(-d/16)",
    "p v": "attention's sum p v",
}


def recorded_attention(monkeypatch) -> dict:
    """run.attention with its accumulators also computed in int64 on the host, beside it: the
    largest magnitude of a head's q k^T times its multiplier, of the sum of 2**(-d/16) and of the
    sum p v (the probabilities recomputed in numpy from docs/design.org's description)."""
    largest, attention = dict.fromkeys(ATTENTION, 0), run.attention
    tables = run.make_tables(1)

    def record(q, k, v, allowed, width):
        def heads(x):  # (T, R, D, S, H, width)
            x = np.asarray(x, np.int64)
            return x.reshape(x.shape[:-1] + (-1, width))

        qk = np.einsum("trdshc,urdshc->rdshtu", heads(q), heads(k))
        scaled = qk * run.score_multiplier(width)
        largest["score"] = max(largest["score"], int(np.abs(scaled).max()))
        scores = np.clip(scaled >> run.SCORE_FRAC, -127, 127)
        allowed = np.asarray(allowed)[..., None, :, :]  # (R, D, S, 1, T, U): every head's
        s = np.where(allowed, scores, -127)
        d = s.max(-1, keepdims=True) - s
        exp2 = np.asarray(tables.exp2_frac, np.int64)
        total = np.where(allowed, exp2[d & 15] >> (d >> 4), 0).sum(-1, keepdims=True)
        largest["sum"] = max(largest["sum"], int(total.max()))
        exponent = np.frexp(total.astype(np.float64))[1] - 1  # the top bit: exact below 2**53
        mantissa = (total >> (exponent - run.MANT_BITS)) - (1 << run.MANT_BITS)
        log2_s = ((exponent - run.EXP_FRAC) << run.LL_FRAC) + np.asarray(tables.log2_mant)[mantissa]
        sixteenths = d + ((log2_s + 8) >> 4)
        shift = np.minimum((sixteenths >> 4) + run.EXP_FRAC - run.PROB_FRAC, 31)
        p = np.where(allowed, np.minimum(exp2[sixteenths & 15] >> shift, 127), 0)
        pv = np.einsum("rdshtu,urdshc->trdshc", p, heads(v))
        largest["p v"] = max(largest["p v"], int(np.abs(pv).max()))

    def recording(q, k, v, allowed, w, cfg):
        jax.debug.callback(record, q, k, v, allowed, cfg.model_flags.head_width)
        return attention(q, k, v, allowed, w, cfg)

    monkeypatch.setattr(run, "attention", recording)
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


def model_problems(name: str, monkeypatch) -> list[str]:
    """What a model breaks of its declared facts, at parameters all +127, all -127 or +-127 at
    random, with the noise's largest entries of either sign or none, reading bytes 255, 0 and at
    random: an activation that is not int8 within [-127, 127], a product's accumulator beyond the
    model's declared worst case (rank 1, sigma_shift 0: the noise at its largest)."""
    cfg = config("--model", name, "--tokens_per_update", "3", parallel_generations_per_gpu=8)
    model, bounds, problems = run.MODELS[name], run.accumulator_bounds(cfg), set()
    largest, attended = recorded_matmul(monkeypatch), recorded_attention(monkeypatch)
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
                        if x.dtype != np.int8 or np.abs(x).max() > 127:
                            problems.add(f"activation {key} beyond [-127, 127] ({setting})")
    recorded = (
        ("matmul", "matmul accumulator x W^T + sigma x E^T"),
        ("x B", "low-rank product x B"),
        *((key, name) for key, name in ATTENTION.items() if name in bounds),
    )
    largest = {**largest, **attended}
    print(f"{name}: largest accumulators {largest}")
    for key, accumulator in recorded:
        if not 0 < largest[key] <= bounds[accumulator][0]:
            problems.add(f"the {accumulator} reaches {largest[key]:,} ({bounds[accumulator][0]:,})")
    return sorted(problems)


@pytest.mark.parametrize("name", MODELS)
def test_every_models_activations_are_int8_and_accumulators_within_its_bounds(
    toys, monkeypatch, name
):
    assert model_problems(name, monkeypatch) == []


def test_an_understated_fact_of_an_entry_is_found(monkeypatch):
    """Four entries that understate the truth: a shaping whose scores go beyond its largest, one
    whose null is not its declared one, a rule whose tally outgrows its int8 state, a model that
    declares its products' bounds for half its width: each found, none wrapped silently."""
    doubled = CENTERED_RANKS._replace(largest=63)  # scores up to 127
    loud = run.SHAPINGS["sign"]._replace(rms=lambda flags: 1.2)
    unclipped = TALLY._replace(
        step=lambda z, state, evidence, flags: (
            jnp.zeros_like(z),
            {"t": state["t"].astype(jnp.int32) + jnp.sign(z)},  # never moves, never clipped
        )
    )
    narrow = GRU._replace(bounds=lambda cfg: run.product_bounds(cfg.n_embd // 2, cfg.rank))
    add_entries(
        monkeypatch,
        shapings={"doubled": doubled, "loud": loud},
        rules={"unclipped": unclipped},
        models={"narrow": narrow},
    )
    found = shaping_problems("doubled")
    assert "scores beyond its largest 63 (unrelated)" in found
    assert all(problem.startswith("scores beyond its largest 63 (") for problem in found)
    assert shaping_problems("loud") == ["null root mean square 1.000, declared 1.200"]
    assert rule_problems("unclipped")[0] == "t reaches 128 beyond int8"  # the first wrap
    found = model_problems("narrow", monkeypatch)
    assert found == [
        "the low-rank product x B reaches 93,472 (46,736)",
        "the matmul accumulator x W^T + sigma x E^T reaches 522,648 (263,398)",
    ]
