"""Replicas and population-based training over them. A replica's settings are a Replica: its seed
and what PBT explores (alpha, alpha_decay_timestep, sigma_shift), each given per replica by
--replica_NAME; its arrays are index k of the run's replica axis. Every pbt_every generations the
worst quarter by validation copies the best quarter's models and moves the copied settings one
step each (explore)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Annotated, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from egg import UserError
from egg.flags import flag


@dataclass(frozen=True)
class Flags:
    replicas: Annotated[int, *flag("[1, inf)", training=True)] = 1
    """models trained in one step, each with its own seed (--seed + index) and settings below"""
    replica_alpha: Annotated[tuple[float, ...], *flag(training=True)] = ()
    """--alpha of each replica, a list of --replicas values (empty: --alpha for every one)"""
    replica_alpha_decay_timestep: Annotated[tuple[int, ...], *flag(training=True)] = ()
    """--alpha_decay_timestep of each replica, a list of --replicas values (empty: the flag's)"""
    replica_sigma_shift: Annotated[tuple[int, ...], *flag(training=True)] = ()
    """--sigma_shift of each replica, a list of --replicas values (empty: the flag's)"""
    pbt_every: Annotated[int, *flag("[0, inf)", training=True)] = 0
    """generations between population-based training steps (0: none; needs --replicas >= 4)"""


# explore moves alpha and its decay by one of these factors (alpha > 1, a schedule: its excess over
# 1; alpha <= 1, a fixed share: itself, at most 1), and sigma_shift by one step, within its range.
# A shift halves or doubles the noise, a far larger step than the factors: it is taken half the
# time, else the copy keeps the winner's.
PBT_FACTORS = (0.8, 1.25)
SIGMA_STEPS = (-1, 0, 0, 1)
# what a copy moves (its seed stays its own)
EXPLORED = ("alpha", "alpha_decay_timestep", "sigma_shift")
PER_REPLICA = {name: f"replica_{name}" for name in EXPLORED}  # the flag that gives each replica one
SETTING_FLAGS = ("seed", *EXPLORED, *PER_REPLICA.values())  # what a replica's settings come from


class Replica(NamedTuple):
    """One replica's own settings: its seed (--seed + its index, its own for the whole run) and
    what --replica_NAME gives it and population-based training moves."""

    seed: int
    alpha: float
    alpha_decay_timestep: int
    sigma_shift: int


def replicas(flags: Flags, seed: int, defaults: dict) -> list[Replica]:
    """Each replica's settings: seed `seed` + its index, the rest its --replica_NAME value, else
    the run's own (`defaults`, by name)."""
    count = flags.replicas
    given = {k: getattr(flags, flag) or (defaults[k],) * count for k, flag in PER_REPLICA.items()}
    return [Replica(seed + r, *(given[k][r] for k in EXPLORED)) for r in range(count)]


def single() -> dict:
    """The flags of a run without replicas (and PBT)."""
    return {"replicas": 1, "pbt_every": 0, **{flag: () for flag in PER_REPLICA.values()}}


def check(flags: Flags) -> None:
    """Refuse per-replica lists of another length than --replicas, and PBT with too few replicas."""
    count = flags.replicas
    for name in PER_REPLICA.values():
        given = len(getattr(flags, name))
        if given and given != count:
            raise UserError(
                f"--{name} has {given} value(s): give one per replica (--replicas {count})"
            )
    if flags.pbt_every and count < 4:
        raise UserError(
            "--pbt_every needs --replicas 4 or more (the worst quarter copies the best), "
            f"got {count}"
        )


def explore(setting, rng: np.random.Generator, sigma_range: tuple[int, int]):
    """A copied replica's settings, each moved one random step (PBT_FACTORS, SIGMA_STEPS)."""
    f_alpha, f_decay = rng.choice(PBT_FACTORS, 2)
    alpha = setting.alpha
    alpha = min(alpha * f_alpha, 1.0) if alpha <= 1 else 1 + (alpha - 1) * f_alpha
    sigma_shift = int(np.clip(setting.sigma_shift + rng.choice(SIGMA_STEPS), *sigma_range))
    decay = max(1, round(setting.alpha_decay_timestep * f_decay))
    return setting._replace(
        alpha=round(float(alpha), 4), alpha_decay_timestep=decay, sigma_shift=sigma_shift
    )


def pbt_step(
    scores: list[float],
    settings: list,
    seed: int,
    generation: int,
    sigma_range: tuple[int, int],
    higher: bool = False,
):
    """Exploit and explore: the worst quarter of the replicas by their validation scores (lower is
    better; higher where `higher`; ties: the higher index is worse) each copies one of the best
    quarter (the worst the best, the second worst the second best, ...) and moves the copied
    settings (explore, from an RNG seeded by the run's seed and the generation, so a resumed run
    draws the same); each keeps its own seed, so no two replicas ever share their noise. Returns
    (the replica each replica's model now comes from, the new settings, the lineage: who copied
    whom, old -> new settings)."""
    order = sorted(range(len(scores)), key=lambda k: (-scores[k] if higher else scores[k], k))
    quarter = len(scores) // 4
    rng = np.random.default_rng([seed, generation])
    source, new, lineage = np.arange(len(scores), dtype=np.int32), list(settings), []
    for loser, winner in zip(order[::-1][:quarter], order[:quarter], strict=True):
        source[loser] = winner
        new[loser] = explore(settings[winner], rng, sigma_range)._replace(seed=settings[loser].seed)
        old = settings[loser]._asdict()
        lineage.append(
            {"replica": loser, "copied": winner, "old": old, "new": new[loser]._asdict()}
        )
    return source, new, lineage


@partial(jax.jit, donate_argnums=0)
def copy_replicas(trees, source):
    """Every replica's arrays replaced by those of replica source[k] (itself, or whom it copies)."""
    return jax.tree.map(lambda x: jnp.take(x, source, axis=0), trees)


def settings_text(setting: dict) -> str:
    """'alpha A, alpha_decay_timestep T, sigma_shift S' of a replica's settings (a dict)."""
    return ", ".join(f"{name} {setting[name]:g}" for name in EXPLORED)


def describe_lineage(lineage: list[dict]) -> str:
    """'replica L copies W (old settings -> new settings); ...'"""
    moves = [
        (x["replica"], x["copied"], settings_text(x["old"]), settings_text(x["new"]))
        for x in lineage
    ]
    return "; ".join(
        f"replica {loser} copies {winner} ({old} -> {new})" for loser, winner, old, new in moves
    )
