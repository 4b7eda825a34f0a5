"""The jitted generation step: integer only, reproducible, antithetic and shared-noise layout."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from helpers import (
    fitness_of_one_model,
    generation_noise,
    init_params,
    one_model_step,
    z_thresholds,
)

import run
from egg import cluster, flags

FLOAT_TYPES = ("f16", "bf16", "f32", "f64")


def setup(**overrides):
    args = dict(
        n_embd=8,
        n_layer=2,
        parallel_generations_per_gpu=8,
        group_size=4,
        tokens_per_update=6,
        num_epochs=3,
        alpha=0.3,
    )
    args.update(overrides)
    args = flags.replace(run.Args(), **args)
    c = run.make_config(args)
    rng = np.random.default_rng(0)
    batch = rng.integers(0, 256, (c.population // c.group_size, c.tokens + 1)).astype(np.uint8)
    batch[:, 3] = 0  # a document separator mid-window
    return args, c, batch


def jaxpr_dtypes(jaxpr):
    """Every dtype appearing anywhere in a (closed) jaxpr, sub-jaxprs included."""
    seen = set()
    for eqn in jaxpr.eqns:
        for var in list(eqn.invars) + list(eqn.outvars):
            aval = getattr(var, "aval", None)
            if hasattr(aval, "dtype"):
                seen.add(str(aval.dtype))
        for param in eqn.params.values():
            subs = param if isinstance(param, (list, tuple)) else [param]
            for sub in subs:
                if hasattr(sub, "jaxpr"):
                    inner = sub.jaxpr if hasattr(sub.jaxpr, "eqns") else sub.jaxpr.jaxpr
                    seen |= jaxpr_dtypes(inner)
                elif hasattr(sub, "eqns"):
                    seen |= jaxpr_dtypes(sub)
    return seen


def step_and_evaluate(args, c, batch) -> tuple[dict, dict]:
    """(params, {name: (program, its inputs)}) of a fresh run's training step and validation, one
    device."""
    mesh = cluster.population_mesh(run.POP, jax.devices()[:1])
    replicas = run.replicas_of(args)
    params, opt, states = run.init_run(c, replicas)
    programs = {
        "step": (
            run.make_generation_step(c, mesh),
            (params, opt, states, batch, np.int32(0), *run.replica_inputs(c, replicas, 0)),
        ),
        "evaluate": (run.make_evaluate(c, mesh), (params, np.asarray(batch[:2]))),
    }
    return params, programs


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(shaping="sign", use_clt=False, rank=3),
        dict(rank=0),
        dict(optimizer="momentum"),
        dict(optimizer="momentum", shared_pair_state=False),
        dict(optimizer="ztest", null_from_scores=True),
        dict(replicas=2, replica_sigma_shift=(3, 5), replica_alpha=(0.3, 4.0), segments=3),
    ],
)
def test_generation_step_and_validation_have_no_floating_point(overrides):
    args, c, batch = setup(**overrides)
    _, programs = step_and_evaluate(args, c, batch)
    for name, (program, inputs) in programs.items():
        dtypes = jaxpr_dtypes(program.trace(*inputs).jaxpr.jaxpr)  # a jit's options stay top-level
        assert dtypes and not {d for d in dtypes if "float" in d or d.startswith("bf")}, (
            name,
            dtypes,
        )
        hlo = program.lower(*inputs).compile().as_text()
        assert "s32" in hlo and not [t for t in FLOAT_TYPES if t in hlo], name


@pytest.mark.parametrize("overrides", [{}, dict(replicas=2, replica_sigma_shift=(3, 5))])
def test_the_cpus_step_and_validation_copy_no_weight_transposed(overrides):
    """Each product is a plain dot of the weights as stored (m, n): a dot batched over the replica
    axis made XLA:CPU copy every weight transposed at every layer and byte."""
    args, c, batch = setup(n_embd=16, **overrides)
    params, programs = step_and_evaluate(args, c, batch)
    matrices = [k for k, p in run.parameters_of(c).items() if p.matrix]
    transposed = {tuple(params[k].shape[-1:-3:-1]) for k in matrices}  # (n, m) of each (m, n)
    for name, (program, inputs) in programs.items():
        hlo = program.lower(*inputs).compile().as_text()
        shapes = re.findall(r"s8\[([0-9,]+)\]\{[0-9,]+\} transpose\(", hlo)
        copies = [d for d in shapes if tuple(map(int, d.split(",")))[-2:] in transposed]
        assert "s32" in hlo and not copies, (name, copies)


def run_generations(step, args, c, batch, generations=3):
    carry = (
        init_params(c, args.seed),
        run.init_state(c),
        np.zeros((c.population, c.n_layer, c.n_embd), np.int8),
    )
    thresholds = z_thresholds(args, c)
    fitness = []
    for g in range(generations):
        *carry, f, _ = one_model_step(
            step, carry, batch, g, thresholds[g], args.seed, args.sigma_shift
        )
        fitness.append(f)
    return (*carry, fitness)


def test_generations_are_exactly_reproducible_and_move_parameters():
    args, c, batch = setup()
    step = run.make_generation_step(c, cluster.population_mesh(run.POP, jax.devices()[:1]))
    p1, _, s1, f1 = run_generations(step, args, c, batch)
    p2, _, s2, f2 = run_generations(step, args, c, batch)
    for name in run.parameters_of(c):
        np.testing.assert_array_equal(p1[name], p2[name])
    np.testing.assert_array_equal(s1, s2)
    np.testing.assert_array_equal(f1, f2)
    start = init_params(c, args.seed)
    assert sum(int(np.sum(p1[k] != start[k])) for k in run.parameters_of(c)) > 0


def test_num_perturbations_shares_noise_between_members():
    # one data sequence for all
    args, c, batch = setup(num_perturbations=4, group_size=8, segments=1)
    params, states = (
        init_params(c, args.seed),
        np.zeros((c.population, c.n_layer, c.n_embd), np.int8),
    )
    noise = generation_noise(c, args.seed, jnp.int32(0))
    assert jax.tree.leaves(noise)[0].shape[0] == 2
    tokens = np.repeat(batch, c.group_size, axis=0)
    fitness, _ = fitness_of_one_model(
        params, noise, states, tokens[:, :-1], tokens[:, 1:], args.sigma_shift, c
    )
    np.testing.assert_array_equal(fitness[:4], fitness[4:])  # members p and p + 4 are identical
    assert len(set(fitness[:4].tolist())) > 1


def test_shared_pair_state_gives_both_members_their_rounded_mean():
    states = np.array([[5], [8], [-5], [-8], [127], [126], [-127], [127]], np.int8).reshape(8, 1, 1)
    # (5 + 8) / 2 = 6.5 and (-5 - 8) / 2 = -6.5 round away from zero; 126.5 -> 127; 0
    want = np.array([7, 7, -7, -7, 127, 127, 0, 0], np.int8).reshape(8, 1, 1)
    np.testing.assert_array_equal(run.pair_mean(jnp.asarray(states)), want)
    args, c, batch = setup(shared_pair_state=True)
    step = run.make_generation_step(c, cluster.population_mesh(run.POP, jax.devices()[:1]))
    params, opt, states, _ = run_generations(step, args, c, batch, generations=2)
    assert np.any(states[0::2] != states[1::2])  # each pair's noise parted its members' states
    thresholds = z_thresholds(args, c)[2]

    def fitness(step, states):
        return one_model_step(
            step, (params, opt, states), batch, 2, thresholds, args.seed, args.sigma_shift
        )[3]

    as_mean = fitness(step, np.asarray(run.pair_mean(jnp.asarray(states))))
    # the step starts from the pair means
    np.testing.assert_array_equal(fitness(step, states), as_mean)
    own = run.make_generation_step(
        c._replace(shared_pair_state=False), cluster.population_mesh(run.POP, jax.devices()[:1])
    )
    assert np.any(fitness(own, states) != as_mean)


def test_state_resets_at_document_separator_and_carries_over_otherwise():
    args, c, batch = setup()
    params = init_params(c, args.seed)
    x, y = np.stack([batch[0, :-1]] * 2), np.stack([batch[0, 1:]] * 2)
    assert x[0, 3] == 0 and (x[0, 4:] != 0).all()  # one separator, after 3 bytes
    h0 = np.zeros((2, c.n_layer, c.n_embd), np.int8)
    h0[1] = 50  # member 1 starts from another state
    ll, h_end = fitness_of_one_model(params, None, h0, x, y, 0, c)
    # a different starting state changes nothing after the separator...
    np.testing.assert_array_equal(h_end[0], h_end[1])
    assert int(ll[0]) != int(ll[1])  # ...but the bytes before it saw the carried state
    assert np.any(np.asarray(h_end) != 0)
    alone, h_alone, _ = reference.member_fitness(params, None, 1, h0[1], x[1], y[1], 0)
    assert int(alone) == int(ll[1])
    np.testing.assert_array_equal(h_alone, h_end[1])
