"""Ideas as a researcher adds them to run.py: entry for entry what docs/design.org's "Trying an
idea" shows, each one entry of a table beside its peers (its own flags beside it).
tests/test_ideas.py adds them and trains, saves and resumes with them; tests/test_entries.py checks
their facts with run.py's own entries'."""

import math
from dataclasses import dataclass
from functools import partial
from typing import Annotated

import jax
import jax.numpy as jnp

import run
from egg.flags import flag

# A fitness shaping over the members: OpenAI's centered ranks.


def centered_rank_scores(fitness, pairs, axis, flags):
    """Each pair's members' rank difference among every member (of every segment), scaled to
    int8: 127 (r+ - r-) / (M - 1), rounded toward zero, for ranks r in [0, M) of M = 2 pairs."""
    every = fitness if axis is None else jax.lax.all_gather(fitness, axis, axis=-2, tiled=True)
    ranks = jnp.argsort(jnp.argsort(every.reshape(-1))).reshape(every.shape)
    if axis is not None:  # this device's pairs
        first = jax.lax.axis_index(axis) * fitness.shape[-2]
        ranks = jax.lax.dynamic_slice_in_dim(ranks, first, fitness.shape[-2], axis=-2)
    difference = run.INT8_MAX * (ranks[..., 0] - ranks[..., 1])
    return (jnp.sign(difference) * (jnp.abs(difference) // (2 * pairs - 1))).astype(jnp.int8)


def centered_rank_rms(flags, pairs):
    """The null's: two distinct ranks of M = 2 pairs members, E[(r+ - r-)**2] = M (M + 1) / 6,
    times (127 / (M - 1))**2 (127 / sqrt(6) for many members; 127 for one pair)."""
    members = 2 * pairs
    return run.INT8_MAX / (members - 1) * (members * (members + 1) / 6) ** 0.5


CENTERED_RANKS = run.Shaping(centered_rank_scores, run.INT8_MAX, centered_rank_rms, lambda cfg: {})


# An update rule with a flag of its own: a tally of passed tests.


@dataclass(frozen=True)
class TallyFlags:
    """the tally rule's own flags (--optimizer tally)"""

    tally_votes: Annotated[int, *flag("[1, 127]", training=True)] = 2
    """passed tests of one sign an entry needs to move"""


def tally_step(z, state, evidence, flags):
    """An int8 tally t of the generations whose Z passes the Z-test, by sign; the entry moves the
    way of t once |t| reaches --tally_votes, t then restarting at 0."""
    vote = jnp.sign(z) * (jnp.abs(z) > evidence.threshold)
    t = jnp.clip(state["t"].astype(jnp.int32) + vote, -127, 127)
    move = jnp.sign(t) * (jnp.abs(t) >= flags.tally_votes)
    return move, {"t": jnp.where(move != 0, 0, t)}


TALLY = run.Rule(
    tally_step,
    spread=lambda z_std, flags: z_std,
    reach=lambda z_reach, flags: z_reach,
    tests="|Z|",
    state={"t": jnp.int8},
    flags=TallyFlags,
)


# A model: EGG's blocks without their MLP.


def gru_parameters(cfg):
    """EGG's, less the MLP's (ln2, W1, W2)."""
    return {k: p for k, p in run.egg_parameters(cfg).items() if k not in ("ln2", "W1", "W2")}


GRU = run.Model(
    gru_parameters,
    run.egg_state,
    run.egg_begin,
    run.egg_end,
    step=partial(run.egg_step, block=run.egg_gru),
    window=None,
    groups=(("Wf", "Wh"), ("Uf",), ("Uh",), ("head",)),
    bounds=lambda cfg: run.product_bounds(cfg.n_embd, cfg.rank),
    traffic=lambda cfg: 10 * cfg.n_embd * cfg.n_layer + 2 * cfg.n_embd + 2 * run.VOCAB,
)


# A model that reads a window: each byte's logits from its embedding and the byte before's.


def pair_parameters(cfg):
    n = cfg.n_embd
    return {
        "emb": run.Parameter((run.VOCAB, n), False, True, None),
        "before": run.Parameter((run.VOCAB, n), False, True, None),
        "ln_out": run.Parameter((n,), False, False, run.GAIN_ONE),
        "head": run.Parameter((run.VOCAB, n), False, True, None),
    }


def pair_window(w, carried, bytes_TxRxDxS, cfg):
    """A window's logits: byte t's embedding plus byte t - 1's other embedding (none for the
    window's first), layer-normed, through the head; nothing carried."""
    before = run.embed(w, "before", bytes_TxRxDxS)
    before = jnp.concatenate([jnp.zeros_like(before[:1]), before[:-1]])
    x = run.clipped_add(run.embed(w, "emb", bytes_TxRxDxS), before)
    (logits,) = run.products(w, x, ("head",), gain="ln_out")
    return logits, carried, {"embedding": x, "logits": logits}


PAIR = run.Model(
    pair_parameters,
    lambda cfg: (0,),  # nothing carried
    lambda states, layout, cfg: states.reshape(layout + (0,)),
    lambda carried, cfg: carried.reshape(math.prod(carried.shape[:3]), 0),  # (R, D, S, 0)
    step=None,
    window=pair_window,
    groups=(("head",),),
    bounds=lambda cfg: run.product_bounds(cfg.n_embd, cfg.rank),
    traffic=lambda cfg: 4 * cfg.n_embd + 2 * run.VOCAB,
    context=run.window_length,  # a segment's bytes: every byte but the first has one before it
)
