"""Every entry's facts, by one test for each table over every entry of run.py's tables and of
tests/toys.py's: a shaping's scores lie within its largest where it makes them (before shape_fitness
clips them) and their root mean square on fitness unrelated to the noise is its declared null's
within 5%; a rule's state stays within its dtype at extreme inputs; a model's activations are int8
within [-127, 127] and its products' int32 accumulators, measured in int64 beside them, within the
worst cases it declares, at extreme parameters, noise and bytes. An entry that understates one of
them is found, not wrapped silently."""

import dataclasses
import math
from functools import partial

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
            problems += null_problems(name, found, fitness.size // 2)
    # a small population's: 2,048 updates of 8 pairs (16 members) each, unrelated to the noise
    few = jnp.asarray(np.round(rng.normal(0, 3000, (2048, 8, 2))), jnp.int32)
    found = jax.jit(jax.vmap(lambda f: shaping.scores(f, 8, None, own)))(few)
    return problems + null_problems(name, np.asarray(found), 8)


def null_problems(name: str, scores: np.ndarray, pairs: int) -> list[str]:
    """A shaping's scores' root mean square on fitness unrelated to the noise, more than 5% off its
    declared null at the pairs an update weighs."""
    declared = run.SHAPINGS[name].rms(config("--shaping", name).shaping_flags, pairs)
    rms = float(np.sqrt(np.mean(scores.astype(np.float64) ** 2)))
    print(f"{name}: null root mean square {rms:.3f} at {pairs} pairs, declared {declared:.3f}")
    if abs(rms / declared - 1) < 0.05:
        return []
    return [f"null root mean square {rms:.3f} at {pairs} pairs, declared {declared:.3f}"]


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
            if np.any(np.asarray(moves)[:, :3]):  # under a threshold nothing passes
                problems.append("moves where nothing passes its test")
            for slot, dtype in rule.state.items():
                values, info = np.asarray(new[slot]), jnp.iinfo(dtype)
                if values.min() < info.min or values.max() > info.max:
                    problems.append(f"{slot} reaches {np.abs(values).max():,} beyond {info.dtype}")
    return problems


@pytest.mark.parametrize("name", RULES)
def test_every_rules_state_stays_within_its_dtype_at_extreme_inputs(toys, name):
    assert rule_problems(name) == []


def calibration_problems(name: str) -> list[str]:
    """What a rule's thresholds break of their meaning: under the null (Z normal with the declared
    std, unrelated from one generation to the next), its state first run for 600 generations under
    a threshold nothing passes (the state's null, undisturbed by moves), the share of 40,000
    entries that pass its test at a generation (whose moves or new state differ from those under
    the threshold nothing passes) more than 15% off alpha, for a matrix's and a vector's Z, at
    alpha 0.02, at each of its flags' extreme values."""
    rule, problems = run.RULES[name], []
    cfg = config("--optimizer", name)
    sizes = run.Sizes(run.num_parameters(cfg), run.scored_pairs(cfg))
    alpha, entries, burn = 0.02, 40_000, 600
    for own in dict.fromkeys(flag_extremes(rule, sizes)):
        for kind, z_std in enumerate(run.null_std(cfg._replace(rule_flags=own))):
            threshold = int(run.z_thresholds(cfg._replace(rule_flags=own), alpha)[kind])

            def step(state, z, threshold, own=own, z_std=z_std):
                evidence = run.Evidence(jnp.int32(threshold), z_std, jnp.zeros(1, jnp.int32), 1.0)
                moves, new = rule.step(z, state, evidence, own)
                return moves, {slot: new[slot].astype(rule.state[slot]) for slot in rule.state}

            @jax.jit
            def passed(key, threshold=threshold, step=step, z_std=z_std):
                def generation(state, key):
                    z = jnp.round(jax.random.normal(key, (entries,)) * z_std).astype(jnp.int32)
                    return step(state, z, run.INT32_MAX)[1], None

                start = {slot: jnp.zeros(entries, dtype) for slot, dtype in rule.state.items()}
                keys = jax.random.split(key, burn + 1)
                state = jax.lax.scan(generation, start, keys[:-1])[0]
                z = jnp.round(jax.random.normal(keys[-1], (entries,)) * z_std).astype(jnp.int32)
                (moves, new), (still, kept) = (
                    step(state, z, threshold),
                    step(state, z, run.INT32_MAX),
                )
                differs = moves != still
                for slot in new:
                    differs |= new[slot] != kept[slot]
                return jnp.mean(differs)

            share = float(passed(jax.random.key(kind)))
            print(f"{name} {own}: {share:.4f} of the entries pass at alpha {alpha} ({kind})")
            if abs(share / alpha - 1) > 0.15:
                which = ("matrix", "vector")[kind]
                problems.append(f"{share:.4f} of {which} entries pass at alpha {alpha}")
    return problems


@pytest.mark.parametrize("name", RULES)
def test_every_rules_threshold_passes_the_share_alpha_under_the_null(toys, name):
    assert calibration_problems(name) == []


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
    multiplied = recorded_products(monkeypatch)
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
        states = jnp.zeros((math.prod(members), *model.state(cfg)), jnp.int8)
        if model.window is not None:  # twice: the second window attends the first's, carried
            _, carried, first = model.window(w, model.begin(states, members, cfg), tokens, cfg)
            return [first, model.window(w, carried, tokens, cfg)[2]]

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
    for names in multiplied - set(model.groups):  # the GPU kernel takes declared groups alone
        problems.add(f"products of {', '.join(names)}, a group it does not declare")
    if model.window is not None and model.context is None:
        problems.add("a window model that declares no context")
    return sorted(problems)


def recorded_products(monkeypatch) -> set:
    """run.products, each call's tuple of matrices recorded (as the program is traced)."""
    called, products = set(), run.products

    def recording(w, x, names, *args, **kwargs):
        called.add(tuple(names))
        return products(w, x, names, *args, **kwargs)

    monkeypatch.setattr(run, "products", recording)
    return called


@pytest.mark.parametrize("name", MODELS)
def test_every_models_activations_are_int8_and_accumulators_within_its_bounds(
    toys, monkeypatch, name
):
    assert model_problems(name, monkeypatch) == []


def objective_problems(name: str) -> list[str]:
    """What an objective breaks of its declared facts: a member's fitness (made in the step: the
    log-likelihood of bytes 255, 0 or at random; a reward of what members write to the addition
    task's prompts, greedily and at a temperature) beyond its declared span, at parameters +-127
    with the noise's largest entries; a span whose pair difference overflows int32; a reward
    scored on the host (any float) beyond it; a metric that is not a float."""
    objective, problems = run.OBJECTIVES[name], set()
    task = ["--task", "addition", "--completion_bytes", "4"] if objective.reads == "prompts" else []
    cfg = config("--objective", name, "--tokens_per_update", "3", *task)
    cfg = cfg._replace(population=4, distinct_pairs=2)
    least, most, _ = objective.span(cfg)
    if most - least > run.INT32_MAX:
        problems.add(f"a pair's difference reaches {most - least:,} beyond int32")
    rng = np.random.default_rng(3)
    shapes = {k: run.full_shape(p, cfg) for k, p in run.parameters_of(cfg).items()}
    rows = [np.full(6, 255), np.zeros(6), rng.integers(0, 256, 6)]
    if objective.reads == "prompts":  # prompts as the task's (digits), and bytes at random
        rows = [np.frombuffer(b"\x0099+99=", np.uint8), np.frombuffer(b"\x000+0=", np.uint8)]
        rows += [rng.integers(1, 256, 7)]

    @partial(jax.jit, static_argnums=3)
    def fitness(params, noise, row, temperature):
        flags = cfg.objective_flags
        own = (
            cfg
            if flags is None
            else cfg._replace(objective_flags=temperature_of(flags, temperature))
        )
        states = jnp.zeros((4, *run.carried_state(own)), jnp.int8)
        inputs = jnp.broadcast_to(jnp.asarray(row, jnp.uint8), (4, len(row)))
        if objective.reads == "prompts":
            answers = jnp.full((4, 1, 3), ord("9"), jnp.uint8)
            inputs = run.Prompts(inputs[:, None], answers)
        draws = run.draw_sources(own, 0, jnp.int32(0), 0, 4)
        out = objective.fitness(own, params, lambda s: noise, states, inputs, 0, draws)[0]
        return out

    for value in (127, -127, None):
        params = {
            k: jnp.asarray(
                rng.choice([-127, 127], s) if value is None else np.full(s, value), jnp.int8
            )
            for k, s in shapes.items()
        }
        for noise in (extreme_noise(cfg, 1), extreme_noise(cfg, -1)):
            for row in rows:
                for temperature in (0.0, 1.0):
                    found = np.asarray(fitness(params, noise, row, temperature))
                    if found.dtype != np.int32 or found.min() < least or found.max() > most:
                        problems.add(
                            f"a fitness of {found.min():,} to {found.max():,} beyond its span"
                        )
    if objective.reads == "prompts":  # scored on the host
        found = run.reward_as_fitness(np.array([1e300, -1e300, 2.0**-20, -0.5]))
        if found.min() < least or found.max() > most:
            problems.add(
                f"a host reward's fitness of {found.min():,} to {found.max():,} beyond its span"
            )
    if not all(isinstance(objective.value(f, cfg), float) for f in (least, most)):
        problems.add("a metric that is not a float")
    return sorted(problems)


def temperature_of(flags, temperature: float):
    """An objective's own flags at this --completion_temperature."""
    return dataclasses.replace(flags, completion_temperature=temperature)


@pytest.mark.parametrize("name", run.OBJECTIVES)
def test_every_objectives_fitness_lies_within_its_declared_span(name):
    assert objective_problems(name) == []


def test_an_understated_fact_of_an_entry_is_found(monkeypatch):
    """Entries that understate the truth: a shaping whose scores go beyond its largest, one whose
    null is not its declared one, one whose null cannot see the pairs; a rule whose tally outgrows
    its int8 state, one whose declared spread misstates its null, one that moves whatever its
    threshold; a model that declares its products' bounds for half its width, one that leaves a
    product out of its groups; an objective whose span is too narrow: each found, none silent."""
    doubled = CENTERED_RANKS._replace(largest=63)  # scores up to 127
    loud = run.SHAPINGS["sign"]._replace(rms=lambda flags, pairs: 1.2)
    many = CENTERED_RANKS._replace(rms=lambda flags, pairs: 127 / 6**0.5)  # many pairs' alone
    unclipped = TALLY._replace(
        step=lambda z, state, evidence, flags: (
            jnp.zeros_like(z),
            {"t": state["t"].astype(jnp.int32) + jnp.sign(z)},  # never moves, never clipped
        )
    )
    passes = run.RULES["ztest"]._replace(  # the Z-test without a flag of its own
        step=lambda z, state, evidence, flags: (
            jnp.sign(z) * (jnp.abs(z) > evidence.threshold),
            {},
        ),
        flags=None,
    )
    wide = passes._replace(spread=lambda z_std, flags: 1.3 * z_std)
    restless = passes._replace(step=lambda z, state, evidence, flags: (jnp.full_like(z, 100), {}))
    narrow = GRU._replace(bounds=lambda cfg: run.product_bounds(cfg.n_embd // 2, cfg.rank))
    ungrouped = GRU._replace(groups=GRU.groups[:2] + GRU.groups[3:])  # Uh's product left out
    short = run.OBJECTIVES["likelihood"]._replace(span=lambda cfg: (-1000, 0, ""))
    add_entries(
        monkeypatch,
        shapings={"doubled": doubled, "loud": loud, "many": many},
        rules={"unclipped": unclipped, "wide": wide, "restless": restless},
        models={"narrow": narrow, "ungrouped": ungrouped},
        objectives={"short": short},
    )
    found = shaping_problems("doubled")
    assert "scores beyond its largest 63 (unrelated)" in found
    assert all(problem.startswith("scores beyond its largest 63 (") for problem in found)
    assert shaping_problems("loud") == [
        "null root mean square 1.000 at 16384 pairs, declared 1.200",
        "null root mean square 1.000 at 8 pairs, declared 1.200",
    ]
    assert shaping_problems("many") == ["null root mean square 56.919 at 8 pairs, declared 51.848"]
    assert rule_problems("unclipped")[0] == "t reaches 128 beyond int8"  # the first wrap
    found = calibration_problems("wide")
    assert len(found) == 2 and all(" entries pass at alpha 0.02" in x for x in found)
    assert rule_problems("restless") == ["moves where nothing passes its test"] * 2
    assert model_problems("ungrouped", monkeypatch) == [
        "products of Uh, a group it does not declare"
    ]
    assert objective_problems("short")[0].endswith("beyond its span")
    found = model_problems("narrow", monkeypatch)
    assert found == [
        "the low-rank product x B reaches 93,472 (46,736)",
        "the matmul accumulator x W^T + sigma x E^T reaches 522,648 (263,398)",
    ]
