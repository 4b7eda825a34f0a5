"""egg-jax: pretrain an int8 minGRU byte language model with integer-only EGGROLL evolution strategies.

    python run.py --data stdlib --n_embd 64 --n_layer 2 --parallel_generations_per_gpu 256
    python run.py --data my_corpus.txt --validate_every 50
    python run.py --algorithm upstream ...     # upstream nano-egg's algorithm, the control
    python run.py --help

Weights, activations and hidden states are int8; matmuls accumulate in int32; every rescale is a
shift, a clip to [-127, 127], a constant fixed-point multiplier or a small table. Training uses no
gradients and no floating point: each generation evaluates a population of low-rank antithetic
perturbations (noise from a counter-based RNG, never stored), and moves each parameter by +-1 where
a test on the fitness-weighted noise passes. One compiled step trains K >= 1 models side by side
(--replicas): every array of a run has a leading replica axis, and a single run is K = 1.

The file reads top to bottom, one ruler per section: Args, constants, integer math, model, GPU
kernels, forward, noise, ES step, devices, integer ranges, flags, data, baselines, checkpoints,
replicas and population-based training, sampling, diagnostics, loop, benchmark, GPU target,
main. Importing it does nothing: `python run.py` calls main().
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import sys
import sysconfig
import time
import typing
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import tyro

# ------------------------------------------------------------------------------------------------
# Args. Each flag's facts (its allowed range, whether it changes training, upstream nano-egg's
# value, what checkpoints that predate it were trained with) are written once, beside the flag;
# the checks, the resume comparison, the --algorithm upstream preset and --help derive from them.


class Facts(NamedTuple):
    """What run.py knows of a flag besides its type, default and help."""

    low: float = -math.inf  # the range of values allowed, low and high...
    high: float = math.inf
    open: tuple[bool, bool] = (False, False)  # ...and whether each end itself is excluded
    why: str = ""  # what the range protects, said when a value outside it is refused
    training: bool = False  # changes what a generation computes: compared when a run resumes
    upstream: Any = None  # upstream nano-egg's value, where it differs from ours (--algorithm upstream)
    before: Any = None  # the value of a checkpoint that predates the flag (None: every checkpoint has it)
    acts_if: tuple[str, tuple] | None = None  # (flag, values): it acts only where that flag holds one

    def ranged(self) -> bool:
        return (self.low, self.high) != (-math.inf, math.inf)

    def allowed(self) -> str:
        """The range in words: 'positive', '>= 0', '> 0', 'in [0, 6]', 'in (0, 0.5)', ..."""
        if self.high < math.inf:
            return f"in {'(['[not self.open[0]]}{self.low:g}, {self.high:g}{')]'[not self.open[1]]}"
        if (self.low, self.open[0]) == (1, False):
            return "positive"
        return f"{'>' if self.open[0] else '>='} {self.low:g}"

    def admits(self, value) -> bool:
        above = value > self.low if self.open[0] else value >= self.low
        return above and (value < self.high if self.open[1] else value <= self.high)


def flag(interval: str = "", **facts) -> tuple[Facts, Any]:
    """A flag's Annotated metadata (`Annotated[int, *flag("[0, 6]", training=True)]`): its Facts,
    the range written as an interval, and --help's hint with the range and upstream's value."""
    if interval:
        low, high = (float(x) for x in interval[1:-1].split(","))
        facts.update(low=low, high=high, open=(interval[0] == "(", interval[-1] == ")"))
    known = Facts(**facts)
    hint = "".join(
        [
            f"; {known.allowed()}" if known.ranged() else "",
            "" if known.upstream is None else f"; upstream: {known.upstream}",
        ]
    )
    return known, tyro.conf.arg(help_behavior_hint=lambda default: f"(default: {default}{hint})")


VALID_HINT = "(default: minipile's validation split, else the last --valid_fraction of --data)"
ROUNDS_TO_ZERO = (
    "from 7 on every bias and gain perturbation rounds to 0 (the noise table's largest |entry| is 46)"
)
INT16 = "its running sum is int16"
Rule = Literal["ztest", "momentum", "adam"]
WITH_M, WITH_V, ZTEST_ONLY = (
    ("optimizer", ("momentum", "adam")),
    ("optimizer", ("adam",)),
    ("optimizer", ("ztest",)),
)


@dataclass(frozen=True)
class Args:
    # experiment
    benchmark: bool = False
    """time training, fitness, inference and full-rank ES generations on random bytes, print a table"""
    target: Literal["", "h100"] = ""
    """with --benchmark: compile for this GPU here, without one, and report its program and a modeled
    speed instead of timing (targets/ holds its description)"""
    target_devices: Annotated[int, *flag("[1, inf)")] = 1
    """with --target: GPUs the population is spread over (the sharded program of one of them)"""
    seed: Annotated[int, *flag("[0, inf)", training=True)] = 0
    """seed of the initial parameters and of every perturbation (replica k: seed + k)"""
    num_epochs: Annotated[int, *flag("[1, inf)")] = 1000
    """number of generations to train (one ES update each; the upstream name)"""
    platform: Literal["", "cpu", "cuda", "rocm", "tpu"] = ""
    """JAX platform to run on (default: JAX's choice: its accelerator, else the CPU)"""

    # data
    data: str = "minipile"
    """training bytes: 'minipile', 'stdlib' (Python's own sources, offline), a file or a folder"""
    valid_data: Annotated[str | None, tyro.conf.arg(metavar="PATH", help_behavior_hint=VALID_HINT)] = None
    """a separate validation file or folder"""
    valid_fraction: Annotated[float, *flag("(0, 0.5)")] = 0.01
    """share of --data held out for validation when --valid_data is not given"""
    dir_path: str = str(Path(__file__).resolve().parent / "cached_files")
    """folder for cached corpora and their baselines (minipile and folders are converted here once)"""

    # population
    parallel_generations_per_gpu: Annotated[int, *flag("[1, inf)")] = 1024
    """population size: members evaluated per generation and device (even)"""
    group_size: Annotated[int, *flag("[1, inf)", training=True)] = 2
    """members that share one data sequence (even, divides the population)"""
    tokens_per_update: Annotated[int, *flag("[1, inf)", training=True)] = 100
    """bytes each member predicts per generation"""
    segments: Annotated[int, *flag("[0, inf)", training=True, upstream=1, before=1)] = 0
    """perturbations each member evaluates in turn per generation, each on the next tokens_per_update /
    segments bytes (one more for the last tokens_per_update % segments; at most one segment per
    byte): one update weighs segments times the antithetic pairs for the same forward compute (the
    noise generated and Z's contraction grow with it). 0: 10, or as many as keep the int32 bounds"""

    # EGGROLL
    algorithm: Literal["egg", "upstream"] = "egg"
    """'upstream': upstream nano-egg's algorithm and model, every flag whose help shows an 'upstream:'
    value set to it unless given on the command line (the control of every comparison)"""
    alpha: Annotated[
        float, *flag("(0, inf)", training=True, why="a share <= 1 or a schedule's exponent > 1")
    ] = 4.0
    """<= 1: fixed share of parameters allowed to move; > 1: upstream's 1 / ((2**alpha - 1) t / T + 1)"""
    alpha_decay_timestep: Annotated[int, *flag("[1, inf)", training=True)] = 1000
    """T of the --alpha > 1 schedule: the share reaches 2**-alpha at generation T and keeps decaying"""
    alpha_floor: Annotated[float, *flag("[0, 1)", training=True, upstream=0.0, before=0.0, why="a share")] = (
        1 / 64
    )
    """the --alpha > 1 schedule's share never falls below this (0: no floor); the default 1/64 leaves
    upstream's schedule as it is to generation 4,200 (alpha 4, T = 1000)"""
    sigma_shift: Annotated[int, *flag("[0, 6]", training=True, upstream=4, why=ROUNDS_TO_ZERO)] = 3
    """perturbation scale sigma = 2**-sigma_shift"""
    rank: Annotated[int, *flag("[0, 64]", training=True, why="0: full-rank noise")] = 1
    """rank r of each matrix perturbation A B^T / sqrt(r) (0: full-rank noise, naive ES, for comparison)"""
    use_clt: Annotated[bool, *flag(training=True)] = True
    """weight the update by the noise values (else by their signs)"""
    fast_fitness: Annotated[bool, *flag(training=True, upstream=True)] = False
    """fitness of a pair = sign of its difference (else the difference normalised by mean |difference|)"""
    noise_reuse: Annotated[int, *flag("[0, inf)", training=True)] = 1
    """generations that share one set of perturbations (0: one set for the whole run)"""
    num_perturbations: Annotated[int, *flag("[0, inf)", training=True)] = 0
    """number of distinct perturbations (even, divides the population; 0: one per member)"""
    optimizer: Annotated[Rule, *flag(training=True, upstream="ztest", before="ztest")] = "momentum"
    """update rule: 'ztest' (upstream's: move where this generation's Z passes the test), 'momentum'
    (where a decaying sum of standardised Z does), 'adam' (that sum over a running mean of |Z|)"""
    momentum_shift: Annotated[int, *flag("[1, 7]", training=True, before=2, acts_if=WITH_M, why=INT16)] = 2
    """momentum, adam: the running sum keeps 1 - 2**-shift of itself per generation"""
    max_step: Annotated[int, *flag("[0, 127]", training=True, upstream=1, before=1, acts_if=WITH_M)] = 0
    """momentum, adam: an entry whose running sum holds k thresholds' worth moves k steps, at most
    this many (1: one step wherever the test passes); 0: 1 where an update weighs fewer than
    STEP2_PAIRS scored pairs, else 2"""
    scale_shift: Annotated[int, *flag("[1, 7]", training=True, before=4, acts_if=WITH_V, why=INT16)] = 4
    """adam: the running mean of |Z| keeps 1 - 2**-shift of itself per generation"""
    shared_pair_state: Annotated[bool, *flag(training=True, upstream=False, before=False)] = True
    """both members of an antithetic pair start each generation from one hidden state, their mean"""
    null_from_scores: Annotated[bool, *flag(training=True, before=False, acts_if=ZTEST_ONLY)] = False
    """ztest: scale the Z-test's null std by sqrt(sum of this generation's squared scores / its
    expected value), so that ties and non-normal differences keep the moved share at alpha"""

    # replicas and population-based training
    replicas: Annotated[int, *flag("[1, inf)", training=True, before=1)] = 1
    """models trained side by side in one compiled step (a replica axis), each with its own parameters,
    states, update rule state, seed (--seed + its index) and the settings below (given as lists, not
    drawn); all see the same data"""
    replica_alpha: Annotated[tuple[float, ...], *flag(training=True, before=())] = ()
    """--alpha of each replica, given as a list of --replicas values (empty: --alpha for every one)"""
    replica_alpha_decay_timestep: Annotated[tuple[int, ...], *flag(training=True, before=())] = ()
    """--alpha_decay_timestep of each replica, a list of --replicas values (empty: the flag's)"""
    replica_sigma_shift: Annotated[tuple[int, ...], *flag(training=True, before=())] = ()
    """--sigma_shift of each replica, a list of --replicas values (empty: the flag's)"""
    pbt_every: Annotated[int, *flag("[0, inf)", training=True, before=0)] = 0
    """generations between population-based training steps (0: none; needs --replicas >= 4): the
    replicas ranked by validation bits/byte, the worst quarter copies the best quarter's model and
    moves the copied settings (explore: alpha and its decay by a factor, sigma_shift half the time
    by one)"""

    # model
    n_layer: Annotated[int, *flag("[1, inf)", training=True)] = 6
    """number of minGRU blocks"""
    n_embd: Annotated[int, *flag("[1, inf)", training=True)] = 256
    """width of the residual stream (a multiple of 4)"""
    mlp_relu: Annotated[bool, *flag(training=True, before=True)] = False
    """a ReLU between the MLP's two matrices (upstream has none)"""
    init_std: Annotated[int, *flag("[0, 32]", upstream=16, why="16: upstream's N(0, 1)")] = 4
    """standard deviation of every matrix's initial entries in int8 steps (real = q / 16): 16 is
    upstream's N(0, 1); 0 starts every matrix at zero"""
    kernels: Literal["auto", "xla", "pallas"] = "auto"
    """how the products run: 'pallas', each one Pallas kernel with its rank-1 term, rescale, layer norm
    and residual add (on a GPU; on the CPU interpreted, slowly, for tests); 'xla', left to XLA;
    'auto', pallas on a GPU, xla elsewhere. The same bits either way"""

    # validation
    validate_every: Annotated[int, *flag("[0, inf)")] = 0
    """generations between noise-free validations (0: only at the end)"""
    validation_batch_size: Annotated[int, *flag("[1, inf)")] = 1024
    """rows the validation data is cut into (evaluated in parallel)"""
    validation_tokens: Annotated[int, *flag("[0, inf)")] = 0
    """bytes per validation row (0: the whole held-out part)"""

    # tracking
    track: bool = False
    """log this run to Weights & Biases"""
    wandb_project: str = "egg-jax"
    """W&B project"""
    wandb_entity: Annotated[
        str | None, tyro.conf.arg(metavar="NAME", help_behavior_hint="(default: yours)")
    ] = None
    """W&B entity (team or user)"""
    tag: str = ""
    """a tag for the W&B run, also appended to the run name"""
    runs_dir: str = "runs"
    """folder holding one output folder per run (metrics.jsonl, config.json)"""
    run_name: str = ""
    """name of the run and of its output folder (default: built from the configuration)"""

    # several hosts (jax.distributed; detected automatically under SLURM)
    coord_addr: str = ""
    """address:port of process 0's coordinator, for a multi-host run started by hand"""
    num_procs: Annotated[int, *flag("[1, inf)")] = 1
    """number of processes of a multi-host run started by hand"""
    proc_id: Annotated[int, *flag("[0, inf)")] = 0
    """index of this process in a multi-host run started by hand (below --num_procs)"""
    heartbeat_timeout: Annotated[int, *flag("[2, inf)")] = 30
    """several processes: seconds without a heartbeat after which a process counts as lost, and the
    others stop (exit code 75) with its name, the newest checkpoint and the command that resumes.
    Heartbeats come from a thread of JAX's own, so a process that is slow but alive (compiling,
    validating, saving) keeps sending them"""
    cpu_devices: Annotated[int, *flag("[0, inf)", why="0: one per core")] = 0
    """on the CPU: the JAX devices this host is split into, each evaluating its share of the
    population on its own (0: one per core, fewer where the share would not hold whole groups; 1
    with --rank 0 or several processes; 1: one device, whose products XLA spreads over the
    cores). The CPU still counts as one device of --parallel_generations_per_gpu: the population,
    and every result, stay the same. Left at 1 when XLA_FLAGS or JAX_NUM_CPU_DEVICES set the device
    count (each device then counts as one)"""

    # diagnostics
    log_every: Annotated[int, *flag("[0, inf)")] = 0
    """generations between integer-health diagnostics, logged as diag/... (0: none)"""
    debug: bool = False
    """print the diagnostics as a colour-coded table (every --log_every generations, else every 10)"""

    # sampling
    sample: bool = False
    """generate text from the checkpoint given by --resume instead of training"""
    prompt: str = "The "
    """text the samples continue"""
    max_new_bytes: Annotated[int, *flag("[0, inf)")] = 200
    """bytes to generate per sample"""
    temperature: Annotated[float, *flag("[0, inf)")] = 0.6
    """sampling temperature (0: greedy)"""
    min_p: Annotated[float, *flag("[0, 1]")] = 0.08
    """drop bytes whose probability is below min_p times the most likely byte's"""
    presence_penalty: float = 0.2
    """bits subtracted from the log2-probability of every byte already generated"""
    sample_replica: int = -1
    """--sample from a checkpoint of several replicas: which one (-1: the best by its last validation)"""
    sample_every: Annotated[int, *flag("[0, inf)")] = 0
    """generations between samples printed (and logged) during training (0: none)"""

    # checkpoints
    save_dir: str = ""
    """folder of this run's checkpoints (default: <runs_dir>/<run_name>/checkpoints)"""
    save_every: Annotated[int, *flag("[0, inf)")] = 100
    """generations between checkpoints (0: only at the end and when stopped by a signal)"""
    keep_checkpoints: Annotated[int, *flag("[1, inf)")] = 3
    """periodic checkpoints to keep (the best by validation is kept besides)"""
    resume: str = ""
    """continue from a checkpoint folder, a save_dir (its latest), or 'auto' (the latest in --save_dir)"""
    allow_changes: bool = False
    """with --resume: continue although flags that change training differ from the checkpoint's (logged)"""


@cache
def flag_facts() -> dict[str, Facts]:
    """{flag: its Facts} for every field of Args (Facts() where it has none)."""
    hints = typing.get_type_hints(Args, include_extras=True)
    found = {
        name: [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, Facts)]
        for name, hint in hints.items()
    }
    return {name: facts[0] if facts else Facts() for name, facts in found.items()}


# What each replica sets for itself (--replica_NAME), and population-based training explores
REPLICA_SETTINGS = ("alpha", "alpha_decay_timestep", "sigma_shift")
# Flags that egg-jax once had, with the value that meant "off": a checkpoint trained with another
# value is refused (they did not help: docs/results.org, "Tried, not adopted"; the code is at b7524ed)
REMOVED_FLAGS = {"adapt_threshold": False, "adapt_noise": False}


# ------------------------------------------------------------------------------------------------
# Constants. Every fixed-point format is named once here; "q" is the stored integer.


class UserError(Exception):
    """Bad input from the user: printed as one line, exit code 2, no traceback."""


VOCAB = 256  # bytes
INT8_MAX = 127  # int8 tensors live in the symmetric range [-127, 127]
INT32_MAX = 2**31 - 1  # every accumulator's worst case stays at or below this (see "Integer ranges")
AUTO_SEGMENTS = 10  # --segments 0: this many, or fewer where the int32 bounds require it
# --max_step 0: two steps at most from this many scored pairs an update (population / 2 x segments),
# one below (docs/results.org, "Population")
STEP2_PAIRS = 10_000
SEGMENT_STEP = 0x9E3779B9  # odd (2**32 / golden ratio): segment s's words are remixed from word + s x this
WEIGHT_FRAC = 4  # weights, embeddings, layer-norm gains and normalised activations: real = q / 2**4
NOISE_FRAC = 4  # noise entries: real = q / 2**4, standard deviation ~1
GATE_BITS = 8  # GRU gate g = f + 127 in [0, 254]: the fraction g / 2**8 of the new state to take
LOGIT_FRAC = 4  # logits are log2-probabilities up to a constant: real = q / 2**4 bits
LL_FRAC = 8  # log-likelihoods and fitness, in bits: real = q / 2**8
EXP_FRAC = 20  # terms 2**(-d / 2**LOGIT_FRAC) of the log-sum-exp: real = q / 2**20, q <= 2**20
MANT_BITS = 10  # log2 of the mantissa is read from a table of 2**10 int32 entries (4 KiB)
RECIP_BITS = 16  # layer-norm reciprocals 1/m for m in [1, 127]: real = q / 2**16 (128 int32)
MUL_BITS = 14  # constant rescale multipliers: real = q / 2**14, q in (2**13, 2**14]
GAUSS_BITS = 8  # each noise entry is a 256-entry normal-quantile table indexed by 8 random bits
STATE = jnp.int16  # the update rule's per-entry state (momentum, adam)
SCALE_MAX = 2**16 - 1  # adam's largest threshold multiplier
FIT_FRAC = 4  # normalised fitness scores: real = q / 2**4 (difference / mean |difference|), int8
U_STD_BITS = 4  # momentum, adam: u = Z >> shift with u's null std in [2**4, 2**5), clipped to int8
SCALE_FRAC = 12  # adam's threshold multipliers: real = q / 2**12, q < 2**16
ROOT_BITS = 15  # --null_from_scores: threshold x sqrt(S / S_null) from mantissas in [2**14, 2**15)
MATRICES = ("emb", "Wf", "Uf", "Wh", "Uh", "W1", "W2", "head")  # everything else is a vector
PARAM_NAMES = ("emb", "ln1", "Wf", "Uf", "bf", "Wh", "Uh", "bh", "ln2", "W1", "W2", "ln_out", "head")
BLOCK_NAMES = PARAM_NAMES[1:11]  # stacked along a leading n_layer axis, scanned over
MATRIX, VECTOR = 0, 1  # the two kinds of parameter: index of their null std, shift and threshold
i32 = jnp.int32


def kind_of(name: str) -> int:
    """MATRIX or VECTOR: which of a (matrix, vector) pair of thresholds or shifts a parameter takes."""
    return MATRIX if name in MATRICES else VECTOR


class Config(NamedTuple):
    """Static settings of the jitted functions (derived from Args by make_config, hashable). What
    differs between replicas (seed, alpha, sigma_shift) is not here: the step takes it as arrays."""

    n_layer: int
    n_embd: int
    population: int  # members of each replica, over all devices
    group_size: int
    tokens: int
    segments: int  # perturbations per member per generation, one after another (segment_lengths)
    rank: int
    use_clt: bool
    fast_fitness: bool
    noise_reuse: int
    distinct_pairs: int  # pairs with their own noise; members p and p + 2 * distinct_pairs share it
    devices: int  # devices the population is spread over, parallel_generations_per_gpu each
    optimizer: str
    momentum_shift: int
    max_step: int  # --max_step, 0 resolved by the pairs an update weighs
    scale_shift: int
    shared_pair_state: bool
    null_from_scores: bool
    mlp_relu: bool
    init_std: int  # matrices' initial standard deviation in steps at WEIGHT_FRAC
    replicas: int  # K: the leading axis of every parameter, state and per-replica input
    kernels: str  # how products run: "xla", "pallas" (the GPU kernel) or "interpret" (it, on the CPU)
    noise_per_segment: bool  # build each segment's noise where it is used, twice (a GPU's memory)


# ------------------------------------------------------------------------------------------------
# Integer math. In JAX `>>` on signed integers floors (rounds toward minus infinity).


class Tables(NamedTuple):
    """Small lookup tables, built on the host once (sizes in the comments)."""

    gauss: np.ndarray  # (256,) int8: round(16 * normal quantile), noise of std ~1 at NOISE_FRAC
    gauss_rank: np.ndarray  # (256,) int8: the same divided by sqrt(rank), for the B factors
    exp2_frac: np.ndarray  # (16,) int32: round(2**(EXP_FRAC - i/16)), i in [0, 16)
    log2_mant: np.ndarray  # (2**MANT_BITS,) int32: log2(1 + (i + 0.5) / 2**MANT_BITS) * 2**LL_FRAC
    recip: np.ndarray  # (128,) int32: round(2**RECIP_BITS / m), recip[0] unused


@cache
def make_tables(rank: int) -> Tables:
    normal = statistics.NormalDist()
    quantiles = np.array([normal.inv_cdf((i + 0.5) / 2**GAUSS_BITS) for i in range(2**GAUSS_BITS)])
    mant = (np.arange(2**MANT_BITS) + 0.5) / 2**MANT_BITS
    return Tables(
        gauss=np.round(quantiles * 2**NOISE_FRAC).astype(np.int8),
        gauss_rank=np.round(quantiles * 2**NOISE_FRAC / math.sqrt(max(rank, 1))).astype(np.int8),
        exp2_frac=np.round(2.0 ** (EXP_FRAC - np.arange(16) / 16)).astype(np.int32),
        log2_mant=np.round(np.log2(1 + mant) * 2**LL_FRAC).astype(np.int32),
        recip=np.round(2**RECIP_BITS / np.maximum(np.arange(128), 1)).astype(np.int32),
    )


def clip_int8(x):
    """Clip an int32 tensor to [-127, 127] and store it as int8."""
    return jnp.clip(x, -INT8_MAX, INT8_MAX).astype(jnp.int8)


def clipped_add(*xs):
    """Saturating sum of int8 (or int32) tensors, as int8."""
    return clip_int8(sum(x.astype(i32) for x in xs))


def round_shift(x, shift: int):
    """x / 2**shift rounded half away from zero (symmetric, so +noise and -noise stay opposite)."""
    x = x.astype(i32)
    magnitude = (jnp.abs(x) + ((1 << shift) >> 1)) >> shift
    return jnp.sign(x) * magnitude


def divide_to_int8(acc, divisor: float):
    """floor(acc / divisor) clipped to int8, for a constant divisor >= 1, as shifts and one multiply.

    divisor = 2**k * c with c in [1, 2). acc is floored by 2**(k - g) (g guard bits), clipped to
    +-2**(8 + g) (beyond which the result saturates anyway), multiplied by round(2**MUL_BITS / c)
    <= 2**14 and floored by 2**(MUL_BITS + g): no intermediate exceeds 2**28. Exact when divisor
    is a power of two.
    """
    k = int(math.floor(math.log2(divisor)))
    mult = int(round(2**MUL_BITS * 2**k / divisor))
    guard = min(k, 6)
    z = jnp.clip(acc >> (k - guard), -(2 ** (8 + guard)), 2 ** (8 + guard))
    return clip_int8((z * mult) >> (MUL_BITS + guard))


def log2_likelihood(logits, target, tables: Tables):
    """log2 softmax(logits)[target] at LL_FRAC, integers only. logits: (..., 256) int8 at LOGIT_FRAC;
    target (...) of bytes.

    With d = max - logits in [0, 254]: sum 2**(-d/16) = sum exp2_frac[d % 16] >> (d // 16), each
    term <= 2**20 and the largest exactly 2**20, so 2**20 <= s <= 2**28. log2 s = e + log2(1 + m)
    with e the top bit (count leading zeros) and m the next MANT_BITS bits, read from a table.
    """
    logits = logits.astype(i32)
    top = jnp.max(logits, axis=-1, keepdims=True)
    d = top - logits
    s = jnp.sum(jnp.asarray(tables.exp2_frac)[d & 15] >> (d >> 4), axis=-1)
    exponent = 31 - jax.lax.clz(s)  # in [20, 28]
    mantissa = (s >> (exponent - MANT_BITS)) - (1 << MANT_BITS)
    log2_s = ((exponent - EXP_FRAC) << LL_FRAC) + jnp.asarray(tables.log2_mant)[mantissa]
    target = jnp.broadcast_to(jnp.asarray(target, i32), logits.shape[:-1])
    picked = jnp.take_along_axis(logits, target[..., None], axis=-1)
    return ((picked - top)[..., 0] << (LL_FRAC - LOGIT_FRAC)) - log2_s


def shifted(x: int, k: int) -> int:
    """|x| / 2**k rounded half up: the magnitude round_shift gives, for a host integer."""
    return (abs(x) + ((1 << k) >> 1)) >> k


def isqrt(x):
    """floor(sqrt(x)) of a non-negative int32, bit by bit (the trial squares fit uint32)."""
    x, root = x.astype(jnp.uint32), jnp.zeros(x.shape, jnp.uint32)
    for bit in reversed(range(16)):
        trial = root | jnp.uint32(1 << bit)
        root = jnp.where(trial * trial <= x, trial, root)
    return root.astype(i32)


def bit_length(x):
    """Bits of a non-negative int32 (0 for 0)."""
    return 32 - jax.lax.clz(x)


def scale_by_root(threshold, s, s_null: float):
    """--null_from_scores: threshold x sqrt(s / s_null) for the sum s of this generation's squared
    weights, floored, within 1 + 2**-12 relative; all int32, from mantissas in [2**14, 2**15): threshold
    = tm 2**te, sqrt(s) = r 2**-j (r = isqrt(s 4**j) with s 4**j in [2**28, 2**30)) and
    1 / sqrt(s_null) = im 2**-ie (from the host); ((tm r) >> 15) im < 2**31. The largest int32
    (nothing moves) stays so, s = 0 (all ties: every Z is 0) gives 0, and s = s_null the threshold
    itself."""
    inverse = 1 / math.sqrt(s_null)
    ie = ROOT_BITS - 1 - int(math.floor(math.log2(inverse)))
    im = int(round(inverse * 2**ie))  # in [2**14, 2**15]
    te = bit_length(threshold) - ROOT_BITS
    tm = jnp.where(te >= 0, threshold >> jnp.maximum(te, 0), threshold << jnp.maximum(-te, 0))
    j = (jax.lax.clz(jnp.maximum(s, 1)) - 2) >> 1
    r = isqrt(s << j * 2)
    product = ((tm * r) >> ROOT_BITS) * im
    shift = ROOT_BITS + te - j - ie
    room = jax.lax.clz(jnp.maximum(product, 1)) - 1  # left shifts that keep it an int32
    scaled = jnp.where(
        shift >= 0,
        jnp.where(shift <= room, product << jnp.clip(shift, 0, 31), INT32_MAX),
        product >> jnp.clip(-shift, 0, 31),
    )
    same = s == int(s_null) if float(s_null).is_integer() else False
    return jnp.where((threshold == INT32_MAX) | same, threshold, jnp.where(s == 0, 0, scaled))


# ------------------------------------------------------------------------------------------------
# Model: EGG, an int8 minGRU language model, evaluated for many members at once. Activations carry
# the members' axes (K, R, D, S, ...): replica, repeat (members that share a noise, R > 1 only under
# --num_perturbations), distinct pair and side (S = 2: side 0 adds its pair's noise, side 1
# subtracts it; S = 1 for the noise-free model); member p of a replica is p = (r D + d) S + s.
# Parameters carry K (a single run is K = 1); noise carries (K, D); `nz` is None for the noise-free
# model. A perturbed vector is built once per generation (perturbed_vector) and read by the model
# as a member-shaped parameter (K, 1, D, S, n).


class Sides(NamedTuple):
    """How the noise enters the members, broadcast against their axes (K, R, D, S): sign (1, 1, 1, S)
    int32, +1 or -1 per side; shift (K, 1, 1, 1) int32, each replica's sigma_shift (traced: a shift
    by an amount known at run time is the same integer operation)."""

    sign: jax.Array
    shift: jax.Array


def make_sides(sigma_shifts, sides: int) -> Sides:
    """Sides of S = `sides` (2: antithetic pairs, 1: noise-free) for replicas with these sigma_shifts (K,)."""
    return Sides(jnp.array([1, -1][:sides], i32).reshape(1, 1, 1, sides), sigma_shifts.reshape(-1, 1, 1, 1))


def param_shape(name: str, cfg: Config) -> tuple[int, ...]:
    """Shape of one parameter (one layer's, for block parameters); matrices are (out, in)."""
    n = cfg.n_embd
    return dict(emb=(VOCAB, n), W1=(4 * n, n), W2=(n, 4 * n), head=(VOCAB, n)).get(
        name, (n, n) if name in MATRICES else (n,)
    )


def full_shape(name: str, cfg: Config) -> tuple[int, ...]:
    """Shape of a parameter as stored: block parameters have a leading n_layer axis."""
    return (cfg.n_layer,) * (name in BLOCK_NAMES) + param_shape(name, cfg)


def init_params(cfg: Config, seed):
    """One model's parameters from its seed, a dict of int8 arrays. Matrices are (out, in) with
    entries ~ N(0, s^2) at WEIGHT_FRAC, s = init_std, drawn from the same quantile table as the
    noise (std 2**NOISE_FRAC, |entries| <= 46) and scaled by s / 2**NOISE_FRAC, rounded half away
    from zero: |q| <= 46 x 32 / 16 = 92 at s <= 32 (no floating point)."""
    tables = make_tables(cfg.rank)
    key = jax.random.fold_in(jax.random.key(seed, impl="threefry2x32"), 0)  # 1: noise
    params = {}
    for i, name in enumerate(PARAM_NAMES):
        shape = full_shape(name, cfg)
        if name in MATRICES:
            bits = jax.random.bits(jax.random.fold_in(key, i), shape, jnp.uint8)
            gauss = jnp.asarray(tables.gauss)[bits].astype(i32)
            params[name] = round_shift(gauss * cfg.init_std, NOISE_FRAC).astype(jnp.int8)
        elif name.startswith("ln"):
            params[name] = jnp.full(shape, 2**WEIGHT_FRAC, jnp.int8)  # gain 1.0
        else:
            params[name] = jnp.zeros(shape, jnp.int8)  # bias 0
    return params


def members(x):
    """A replica-shaped array (K, ...) with the members' other axes (R, D, S) inserted, of size 1."""
    return x[:, None, None, None]


def perturbed_vector(p, nz, sides: Sides):
    """Every member's copy of a vector parameter p (K, ..., n): p + sign * sigma * noise, with nz
    (K, D, ..., n) its pairs' noise, as (K, 1, D, S, ..., n); p itself, member-shaped, without noise."""
    if nz is None:
        return members(p)
    shift = sides.shift.reshape((-1, 1, 1, 1) + (1,) * (nz.ndim - 2))  # (K, 1, 1, 1, ...)
    sign = sides.sign.reshape(sides.sign.shape + (1,) * (nz.ndim - 2))
    noise = round_shift(nz[:, None, :, None], NOISE_FRAC + shift - WEIGHT_FRAC)  # (K, 1, D, 1, ..., n)
    return clip_int8(members(p).astype(i32) + sign * noise)


def chunked_dot(x, b):
    """x (..., n) int8 times b (..., n, r) int8 -> (..., r) int32, as exact int32 sums over chunks of
    at most 32 entries, then a sum of the chunks. Elementwise, so it fuses on any backend; XLA:CPU
    splits a longer reduction in two passes that store every int32 product, the chunks avoid that."""
    n = x.shape[-1]
    chunk = max(c for c in range(1, 33) if n % c == 0)
    lead = x.shape[:-1]
    products = x.astype(i32).reshape(lead + (n // chunk, chunk, 1)) * b.reshape(
        b.shape[:-2] + (n // chunk, chunk, -1)
    )
    parts = jnp.sum(products, axis=-2)  # (..., n // chunk, r)
    return sum(parts[..., k, :] for k in range(n // chunk))


def matmul(x, w, nz, sides: Sides):
    """x (W + sigma E)^T / (16 sqrt(n)) as int8, E = A B^T never built. x: (K, R, D, S, n) int8 at any
    scale s; w: (K, m, n); nz: its pairs' low-rank factors A (K, D, m, r), B (K, D, n, r), a full
    noise (K, D, m, n) under --rank 0, or None. Returns (K, R, D, S, m).

    x W^T accumulates in int32 at scale s * 2**WEIGHT_FRAC. With A and B at NOISE_FRAC (B already
    carries 1/sqrt(r)), sigma x E^T in the same units is ((x B) >> NOISE_FRAC) A^T >> sigma_shift.
    Dividing by sqrt(n) keeps the output's scale ~ s.
    """
    # one plain 2-D product per replica: as one batched dot XLA:CPU copies w transposed at every
    # layer and byte (9% of a generation at 256D-6L)
    acc = jnp.stack(
        [jnp.einsum("rdsn,mn->rdsm", x[k], w[k], preferred_element_type=i32) for k in range(len(w))]
    )
    shift = sides.shift[..., None]
    if isinstance(nz, tuple):
        a, b = (f[:, None, :, None] for f in nz)  # (K, 1, D, 1, ..., r)
        u = chunked_dot(x, b) >> NOISE_FRAC  # (K, R, D, S, r)
        term = jnp.sum(a * (sides.sign[..., None] * u)[..., None, :], axis=-1)
        acc = acc + (term >> shift)
    elif nz is not None:  # --rank 0: a full (m, n) noise matrix E, one more matmul per member
        full = jnp.einsum("krdsn,kdmn->krdsm", x, nz, preferred_element_type=i32)
        acc = acc + ((sides.sign[..., None] * full) >> shift)
    return divide_to_int8(acc, 2**WEIGHT_FRAC * math.sqrt(x.shape[-1]))


def embed(emb, tok, nz, sides: Sides):
    """Row `tok` of the embedding (+ sigma E[tok]) of every member, int8 at WEIGHT_FRAC. emb (K, 256,
    n); tok (R, D, S), the same bytes for every replica; returns (K, R, D, S, n)."""
    rows = emb[:, tok]
    if nz is None:
        return rows
    lookup = tok[None, ..., None, None]  # each member's byte in its pair's noise: (1, R, D, S, 1, 1)
    if not isinstance(nz, tuple):  # --rank 0: a full (256, n) noise matrix
        row = jnp.take_along_axis(nz[:, None, :, None], lookup, axis=4)[..., 0, :]
        shift = sides.shift[..., None]
        return clip_int8(
            rows.astype(i32) + sides.sign[..., None] * round_shift(row, NOISE_FRAC + shift - WEIGHT_FRAC)
        )
    a, b = nz  # a (K, D, 256, r), b (K, D, n, r)
    a_tok = jnp.take_along_axis(a[:, None, :, None], lookup, axis=4)  # (K, R, D, S, 1, r)
    pert = jnp.sum(b[:, None, :, None].astype(i32) * a_tok, axis=-1)  # (K, R, D, S, n) at 2 * NOISE_FRAC
    shift = sides.shift[..., None] + (2 * NOISE_FRAC - WEIGHT_FRAC)
    return clip_int8(rows.astype(i32) + ((sides.sign[..., None] * pert) >> shift))


def layer_norm(x, gain, tables: Tables):
    """Integer L1 layer norm of each row: gain * x / mean|x|, int8 at WEIGHT_FRAC (mean |output| ~
    gain). x (..., n), gain broadcast against it."""
    total = jnp.sum(jnp.abs(x.astype(i32)), axis=-1, keepdims=True)  # <= 127 n
    mean = jnp.maximum(divide_to_int8(total, x.shape[-1]).astype(i32), 1)  # floor mean |x|, [1, 127]
    scaled = x.astype(i32) * gain.astype(i32)  # |.| <= 127 * 127 < 2**14
    return clip_int8((scaled * jnp.asarray(tables.recip)[mean]) >> RECIP_BITS)  # < 2**30


# ------------------------------------------------------------------------------------------------
# GPU kernels: on a GPU each of a layer's products is one Pallas (Triton) kernel that reads its
# int8 operands once and writes int8: the shared GEMM x W^T, each member's rank-1 term, the rescale
# to int8 and, where the model has them, the layer norm before it and the residual add after it,
# all in registers (XLA leaves the int32 GEMM output to a second kernel, which reads it back). The
# kernel computes exactly what layer_norm, matmul and clipped_add compute (the tests compare them
# bit for bit, the kernel in Pallas's interpreter on the CPU).
#
# Its operands are views of the model's arrays, never copies: the members (K, R, D, S, n) as rows
# of pairs (K, Q = R D, S n), side s of pair q in the columns [s n, (s + 1) n); block parameters and
# states whole (L, ...), with the layer read inside the kernel (a slice taken outside would be a
# copy); matrices that read the same input stacked on a leading axis G (Wf and Wh).

PRODUCT_KERNEL = "int8_product"  # its name in the compiled program: int8_product_<bytes>_<MACs>
TILE_ROWS, TILE_COLUMNS, TILE_DEPTH = 64, 128, 64  # at most: pairs, outputs and inputs of a tile
# at least, inputs: 16 deep, the kernel as JAX 0.11.2's Triton compiled it for an H200 summed every
# product about twice (docs/gpu.org); exact from 32 on. The interpreter, which the tests run, cannot show it
TILE_DEPTH_MIN = 32


def power_of_two(x: int) -> bool:
    return x >= 16 and x & (x - 1) == 0


def product_kernel_takes(pairs: int, distinct: int, m: int, n: int) -> bool:
    """Whether the kernel takes a product of these shapes: tiles of powers of two >= 16 (Triton's
    int8 dots), at least 32 inputs deep (TILE_DEPTH_MIN), whole tiles of pairs within the distinct
    ones."""
    shaped = power_of_two(m) and power_of_two(n) and n >= TILE_DEPTH_MIN
    return shaped and distinct % 16 == 0 and pairs % distinct == 0


def product_program(*refs, noisy: bool, gained: bool, added: bool, x_layered: bool, tile: tuple[int, ...]):
    """One program of product_kernel's grid: the refs of its operands' blocks (product_specs) and its
    output's block; noisy: with factors; gained: with a layer norm's gain; added: with a residual;
    tile (rows, columns, depth, n)."""
    from jax.experimental import pallas as pl

    rows, columns, depth, n = tile
    divisor = 2**WEIGHT_FRAC * math.sqrt(n)
    refs = list(refs)
    layer_ref, x_ref, w_ref, out_ref = refs[0], refs[1], refs[2], refs[-1]
    a_ref, b_ref, shift_ref = refs[3:6] if noisy else (None, None, None)
    extra = refs[6 if noisy else 3 : -1]
    gain_ref = extra.pop(0) if gained else None
    residual_ref = extra.pop(0) if added else None
    at = layer_ref[0]
    x_at = at if x_layered else 0
    sign = 1 - 2 * pl.program_id(4)

    def inputs(k):  # the k-th (rows, depth) chunk of x, layer-normed with a gain
        chunk = x_ref[x_at, 0, :, pl.ds(k * depth, depth)]
        if not gained:
            return chunk
        g = gain_ref[at, 0, :, pl.ds(k * depth, depth)].astype(i32)
        return clip_int8((chunk.astype(i32) * g * recip[:, None]) >> RECIP_BITS)

    if gained:  # layer_norm's mean |x| and its reciprocal round(2**16 / mean), per row
        total = jax.lax.fori_loop(
            0,
            n // depth,
            lambda k, t: t + jnp.sum(jnp.abs(x_ref[x_at, 0, :, pl.ds(k * depth, depth)].astype(i32)), 1),
            jnp.zeros((rows,), i32),
        )
        mean = jnp.maximum(divide_to_int8(total, n).astype(i32), 1)
        recip = (2 ** (RECIP_BITS + 1) + mean) // (2 * mean)  # = tables.recip[mean], never a tie

    def accumulate(k, carry):
        acc, xb = carry
        chunk = inputs(k)
        weights = w_ref[0, at, 0, :, pl.ds(k * depth, depth)]
        acc = acc + jax.lax.dot_general(chunk, weights, (((1,), (1,)), ((), ())), preferred_element_type=i32)
        if noisy:
            xb = xb + jnp.sum(chunk.astype(i32) * b_ref[0, at, 0, :, pl.ds(k * depth, depth)].astype(i32), 1)
        return acc, xb

    zeros = (jnp.zeros((rows, columns), i32), jnp.zeros((rows,), i32))
    acc, xb = jax.lax.fori_loop(0, n // depth, accumulate, zeros)
    if noisy:  # the rank-1 term ((x B) >> NOISE_FRAC) A^T >> sigma_shift, on this side
        term = a_ref[0, at, 0].astype(i32) * (sign * (xb >> NOISE_FRAC))[:, None]
        acc = acc + (term >> shift_ref[0])
    out = divide_to_int8(acc, divisor)
    out_ref[0, 0] = out if not added else clipped_add(out, residual_ref[0])


def product_specs(x, w, a, b, shifts, layer, gain, residual, tile: tuple[int, int, int]):
    """product_kernel's operands and the block of each that a program of its grid (replica k, matrix
    g, pair tile i, column tile j, side s) reads, for tiles of (rows, columns) outputs over n inputs."""
    from jax.experimental import pallas as pl

    rows, columns, n = tile
    layers_x, layers = x.shape[0], w.shape[1]
    pair_tiles = (a.shape[3] if a is not None else x.shape[2]) // rows
    column_tiles = w.shape[3] // columns

    def pair(i):
        return i % pair_tiles

    spec = pl.BlockSpec
    in_specs = [
        spec((1,), lambda k, g, i, j, s: (0,)),
        spec((layers_x, 1, rows, n), lambda k, g, i, j, s: (0, k, i, s)),
        spec((1, layers, 1, columns, n), lambda k, g, i, j, s: (g, 0, k, j, 0)),
    ]
    operands = [jnp.reshape(layer, (1,)).astype(i32), x, w]
    if a is not None:
        in_specs += [
            spec((1, layers, 1, rows, columns), lambda k, g, i, j, s: (g, 0, k, pair(i), j)),
            spec((1, layers, 1, rows, n), lambda k, g, i, j, s: (g, 0, k, pair(i), 0)),
            spec((1,), lambda k, g, i, j, s: (k,)),
        ]
        operands += [a, b, shifts]
    if gain is not None and gain.shape[2] == 1:  # noise-free: one gain for every row
        in_specs.append(spec((layers, 1, 1, n), lambda k, g, i, j, s: (0, k, 0, 0)))
        operands.append(gain)
    elif gain is not None:
        in_specs.append(spec((layers, 1, rows, n), lambda k, g, i, j, s: (0, k, pair(i), s)))
        operands.append(gain)
    if residual is not None:
        in_specs.append(spec((1, rows, columns), lambda k, g, i, j, s: (k, i, s * column_tiles + j)))
        operands.append(residual)
    return in_specs, operands


def product_cost(x, w, a, b, gain, residual, out) -> tuple[int, int]:
    """(bytes, MACs) of one product_kernel call, as its name declares them: one layer of each stacked
    operand (the call reads only `layer`'s), the residual and the output whole."""
    layers_x, layers = x.shape[0], w.shape[1]
    per_layer = [x.nbytes // layers_x, w.nbytes // layers] + [
        o.nbytes // layers for o in (a, b, gain) if o is not None
    ]
    moved = sum(per_layer) + (residual.nbytes if residual is not None else 0) + math.prod(out.shape)
    return moved, math.prod(out.shape) * w.shape[-1]


def product_kernel(x, w, a, b, shifts, layer, gain, residual, x_layered: bool, interpret: bool):
    """Every member's int8 product with G matrices: out[g] = x' (W_g + sigma E_g)^T / (16 sqrt(n)), as
    int8, where x' = layer_norm(x, gain) (with a gain) or x, plus the residual (with one), as
    matmul, layer_norm and clipped_add compute it.

    x (Lx, K, Q, S n) int8 (Lx = L with x_layered: the states, read at `layer`); w (G, L, K, m, n);
    a (G, L, K, D, m) and b (G, L, K, D, n): the pairs' rank-1 factors (None: noise-free); shifts
    (K,) int32; layer () int32; gain (L, K, D, S n), (L, K, 1, n) (every row's) or None; residual
    (K, Q, S m) or None. Returns (G, K, Q, S m). A program (product_program) computes a tile of
    pairs and outputs of one side of one matrix."""
    from jax.experimental import pallas as pl

    layers_x, replicas, pairs, _ = x.shape
    groups, layers, _, m, n = w.shape
    sides = x.shape[3] // n
    noisy = a is not None
    distinct = a.shape[3] if noisy else pairs
    rows, columns, depth = (
        max(t for t in (16, 32, 64) if t <= cap and d % t == 0)
        for cap, d in ((TILE_ROWS, distinct), (TILE_COLUMNS, m), (TILE_DEPTH, n))
    )
    column_tiles = m // columns
    program = partial(
        product_program,
        noisy=noisy,
        gained=gain is not None,
        added=residual is not None,
        x_layered=x_layered,
        tile=(rows, columns, depth, n),
    )
    in_specs, operands = product_specs(x, w, a, b, shifts, layer, gain, residual, (rows, columns, n))
    out = jax.ShapeDtypeStruct((groups, replicas, pairs, sides * m), jnp.int8)
    moved, macs = product_cost(x, w, a, b, gain, residual, out)
    compiler = None
    if not interpret:
        from jax.experimental.pallas import triton as pallas_triton

        compiler = pallas_triton.CompilerParams(num_warps=4, num_stages=2)
    return pl.pallas_call(
        program,
        out_shape=out,
        grid=(replicas, groups, pairs // rows, column_tiles, sides),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((1, 1, rows, columns), lambda k, g, i, j, s: (g, k, i, s * column_tiles + j)),
        interpret=interpret,
        name=f"{PRODUCT_KERNEL}_{moved}_{macs}",
        compiler_params=compiler,
    )(*operands)


# ------------------------------------------------------------------------------------------------
# Forward: one byte through every member, each product by XLA or by the GPU kernel.


class Model(NamedTuple):
    """What the forward pass reads (model_inputs builds it once, outside the token loop): params,
    the matrices (K, ...) and each member's perturbed vectors (K, 1, D, S, n), block parameters
    with their layer axis first; noise, the matrices' (K, D, ...), or None; the sides; the tables;
    and under --kernels pallas, kernel: the kernel's operands (interpreted on the CPU)."""

    params: dict
    noise: dict | None
    sides: Sides
    tables: Tables
    kernel: dict | None
    interpret: bool


def layered(name: str) -> bool:
    return name in BLOCK_NAMES


KERNEL_GROUPS = (("Wf", "Wh"), ("Uf",), ("Uh",), ("W1",), ("W2",), ("head",))  # products, by input


def kernel_operands(params: dict, noise: dict | None, cfg: Config) -> dict:
    """The kernel's operands, everything with a layer axis (1 for the head and ln_out): for each
    group of KERNEL_GROUPS (w (G, L, K, m, n), a (G, L, K, D, m), b (G, L, K, D, n)), the matrices of
    a group stacked (the one copy: once a call, of the weights and the factors), a and b None
    noise-free; for each gain its rows (L, K, D, S n), or (L, K, 1, n) noise-free (every row's).
    Empty under --rank above 1, which the kernel does not take."""
    if noise is not None and cfg.rank != 1:
        return {}
    operands = {}
    for group in KERNEL_GROUPS:
        lift = (lambda x: x) if layered(group[0]) else (lambda x: x[None])
        w = jnp.stack([lift(params[name]) for name in group])
        a = b = None
        if noise is not None:  # rank 1: (L, K, D, m, 1) -> (L, K, D, m)
            a, b = (jnp.stack([lift(noise[name][f])[..., 0] for name in group]) for f in (0, 1))
        operands[group] = (w, a, b)
    for name in ("ln1", "ln2", "ln_out"):
        gain = params[name] if layered(name) else params[name][None]  # (L, K, 1, D, S, n)
        operands[name] = gain.reshape(gain.shape[:2] + (gain.shape[3], -1))
    return operands


def model_inputs(params, noise, sides: Sides, cfg: Config) -> Model:
    """The Model of these parameters (each (K, ...)) and noise (each (K, D, ...), or None)."""
    model, model_noise = {}, {}
    for name in PARAM_NAMES:
        nz = None if noise is None else noise[name]
        if name in MATRICES:  # shared by every member of a replica
            model[name] = jnp.moveaxis(params[name], 1, 0) if layered(name) else params[name]
            if nz is not None:
                model_noise[name] = jax.tree.map(lambda x: jnp.moveaxis(x, 2, 0), nz) if layered(name) else nz
        else:  # each member's own: ([L,] K, 1, D, S, n)
            vector = perturbed_vector(params[name], nz, sides)
            model[name] = jnp.moveaxis(vector, 4, 0) if layered(name) else vector
    model_noise = None if noise is None else model_noise
    kernel = kernel_operands(model, model_noise, cfg) if cfg.kernels != "xla" else None
    return Model(model, model_noise, sides, make_tables(cfg.rank), kernel, cfg.kernels == "interpret")


def products(model: Model, x, layer, names: tuple[str, ...], gain: str = "", residual=None, x_layered=False):
    """x times each named matrix (with its noise) as matmul computes it: x (K, R, D, S, n), or the
    states (L, K, R, D, S, n) read at `layer` when x_layered; first layer_norm(x, gain) with a gain
    name, then clipped_add(residual, product) with a residual. `layer` () int32 for block
    parameters, None for the head. Returns one (K, R, D, S, m) per name: by the kernel where the
    Model has its operands and it takes the shapes, else by XLA."""
    picked = x[layer] if x_layered else x
    replicas, repeats, distinct, sides, n = picked.shape
    pairs, m = repeats * distinct, model.params[names[0]].shape[-2]
    found = model.kernel.get(names) if model.kernel else None
    if found is None or not product_kernel_takes(pairs, distinct, m, n):
        at = (lambda p: p) if layer is None else (lambda p: jax.tree.map(lambda v: v[layer], p))
        v = layer_norm(picked, at(model.params[gain]), model.tables) if gain else picked
        noise = (lambda k: None) if model.noise is None else (lambda k: at(model.noise[k]))
        outs = [matmul(v, at(model.params[k]), noise(k), model.sides) for k in names]
        return [o if residual is None else clipped_add(residual, o) for o in outs]

    def as_rows(v):  # (..., K, R, D, S, n) -> (..., K, Q, S n): a view
        return v.reshape(v.shape[:-4] + (pairs, -1))

    out = product_kernel(
        as_rows(x) if x_layered else as_rows(x)[None],
        *found,
        model.sides.shift.reshape(-1),
        jnp.asarray(0 if layer is None else layer, i32),
        model.kernel[gain] if gain else None,
        None if residual is None else as_rows(residual),
        x_layered,
        model.interpret,
    )
    return [o.reshape(picked.shape[:-1] + (m,)) for o in out]


def block(x, states, layer, model: Model, cfg: Config, collect: bool = False):
    """One minGRU block of every member. x: residual stream (K, R, D, S, n) int8 at WEIGHT_FRAC;
    states: every layer's hidden state (L, K, R, D, S, n), using the full range (real = q / 127);
    layer () int32. Returns the new stream and this layer's new state, and with `collect` the
    block's int8 activations for diagnostics (else an empty dict)."""

    def vector(name):
        return model.params[name][layer]

    h = states[layer]
    wf, wh = products(model, x, layer, ("Wf", "Wh"), gain="ln1")
    (uf,) = products(model, states, layer, ("Uf",), x_layered=True)
    # forget gate: clipping to int8 is the (hard) sigmoid; g = f + 127 in [0, 254] is g / 256
    g = clipped_add(wf, uf, vector("bf")).astype(i32) + INT8_MAX
    gated = ((g * h.astype(i32)) >> GATE_BITS).astype(jnp.int8)
    # candidate: clipping to int8 is the (hard) tanh
    (uh,) = products(model, gated, layer, ("Uh",))
    c = clipped_add(wh, uh, vector("bh")).astype(i32)
    h = (h.astype(i32) + ((g * (c - h.astype(i32))) >> GATE_BITS)).astype(jnp.int8)  # between h, c
    x = clipped_add(x, h)
    (hidden,) = products(model, x, layer, ("W1",), gain="ln2")  # (..., 4n)
    hidden = jnp.maximum(hidden, 0) if cfg.mlp_relu else hidden
    (x,) = products(model, hidden, layer, ("W2",), residual=x)
    if not collect:
        return x, h, {}
    gate, candidate = (g - INT8_MAX).astype(jnp.int8), c.astype(jnp.int8)
    return x, h, {"gate": gate, "candidate": candidate, "state": h, "mlp_hidden": hidden, "residual": x}


def token_logits(model: Model, states, tok, cfg: Config, collect: bool = False):
    """One byte through every member: logits (K, R, D, S, 256) int8 at LOGIT_FRAC, new states (L, K,
    R, D, S, n), and with `collect` the int8 activations of every layer (else an empty dict). tok
    (R, D, S) uint8, the same for every replica. The states restart from zero at byte 0, the
    separator before every document."""
    states = jnp.where((tok == 0)[..., None], jnp.zeros_like(states), states)
    x = embed(model.params["emb"], tok, None if model.noise is None else model.noise["emb"], model.sides)

    def layer(carry, at):  # layer `at` reads its state, then writes the new one in its place
        x, states = carry
        x, h, seen = block(x, states, at, model, cfg, collect)
        return (x, states.at[at].set(h)), seen

    embedding = x
    with jax.named_scope("layers"):  # names the layers in the compiled program (gpu_kernels reads it)
        if cfg.kernels == "pallas":  # unrolled: a GPU would run three kernels a layer for the loop itself
            carry, seen = (x, states), []
            for at in range(cfg.n_layer):
                carry, found = layer(carry, at)
                seen.append(found)
            (x, states), seen = carry, jax.tree.map(lambda *v: jnp.stack(v), *seen)
        else:
            (x, states), seen = jax.lax.scan(layer, (x, states), jnp.arange(cfg.n_layer))
    (logits,) = products(model, x, None, ("head",), gain="ln_out")
    return logits, states, ({**seen, "embedding": embedding, "logits": logits} if collect else {})


# ------------------------------------------------------------------------------------------------
# Noise. Every entry is a pure function of (seed, generation // noise_reuse, pair, segment, offset)
# through JAX's counter-based threefry RNG: nothing is pre-sampled or stored between generations.
# One stream of bytes per pair is cut into every parameter's noise: matrices get rank-r factors
# A (m, r), B (n, r); vectors (and matrices under --rank 0) full-shape noise. Segment 0's stream
# is threefry's; segment s >= 1 remixes it with a cheap bijection keyed by s (mix_segment).


def noise_pieces(cfg: Config) -> list[tuple[str, tuple[int, ...], str]]:
    """(parameter, shape, table) of each piece of a pair's noise, in stream order."""
    pieces = []
    for name in PARAM_NAMES:
        layers = (cfg.n_layer,) * (name in BLOCK_NAMES)
        shape = param_shape(name, cfg)
        if name in MATRICES and cfg.rank:
            pieces += [
                (name, layers + (shape[0], cfg.rank), "gauss"),
                (name, layers + (shape[1], cfg.rank), "gauss_rank"),
            ]
        else:
            pieces.append((name, layers + shape, "gauss"))
    return pieces


def pair_words(cfg: Config, seed, bucket, pair):
    """Segment 0's stream of a pair: threefry's 32-bit words of key (seed, 1, bucket, pair), one
    threefry block per word (4 noise bytes), not per byte."""
    root = jax.random.fold_in(jax.random.key(seed, impl="threefry2x32"), 1)  # 0: init
    key = jax.random.fold_in(jax.random.fold_in(root, bucket), pair)
    total = sum(math.prod(shape) for _, shape, _ in noise_pieces(cfg))
    return jax.random.bits(key, (-(-total // 4),), jnp.uint32)


def lowbias32(x):
    """A bijection of uint32 with full avalanche (C. Wellons' lowbias32: xorshift-multiply)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def mix_segment(words, segment):
    """Segment s's stream from segment 0's: lowbias32 twice of each word plus s x SEGMENT_STEP (a
    bijection for each s, so every word stays uniform; distinct s give unrelated words): 14
    integer operations a word where threefry takes about a hundred. `segment`: an int, or a traced
    int32 (the same words: uint32 products wrap modulo 2**32 as the host's % does)."""
    if isinstance(segment, int):
        step = jnp.uint32(segment * SEGMENT_STEP % 2**32)
        return words if segment == 0 else lowbias32(lowbias32(words + step))
    mixed = lowbias32(lowbias32(words + segment.astype(jnp.uint32) * jnp.uint32(SEGMENT_STEP)))
    return jnp.where(segment == 0, words, mixed)


def words_to_noise(cfg: Config, words):
    """A pair's noise from its stream: {name: (A, B) or full-shape noise}, int8 at NOISE_FRAC; block
    parameters carry a leading n_layer axis. Byte i (little-endian within each word) indexes the
    table of noise entry i, pieces in noise_pieces order."""
    tables = make_tables(cfg.rank)
    bits = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)
    noise, offset = {}, 0
    for name, shape, table in noise_pieces(cfg):
        size = math.prod(shape)
        values = jnp.asarray(getattr(tables, table))[bits[offset : offset + size].reshape(shape)]
        noise[name] = noise[name] + (values,) if name in noise else (values,)
        offset += size
    return {name: parts if len(parts) == 2 else parts[0] for name, parts in noise.items()}


def segment_lengths(cfg: Config) -> tuple[tuple[int, int], ...]:
    """(count, bytes) of a member's segments in order: the first S - T % S segments take T // S
    bytes, the last T % S one more (S = --segments, at most T = --tokens_per_update)."""
    length, longer = divmod(cfg.tokens, cfg.segments)
    return tuple((count, n) for count, n in ((cfg.segments - longer, length), (longer, length + 1)) if count)


def noise_pairs(cfg: Config) -> int:
    """Pairs with their own noise in one generation: segment s's pair k has index s D + k (D distinct)."""
    return cfg.segments * cfg.distinct_pairs


def scored_pairs(cfg: Config) -> int:
    """Pair scores one update weighs: every antithetic pair's, in every segment."""
    return cfg.segments * cfg.population // 2


def bucket_of(cfg: Config, generation):
    """The noise's counter for a generation: generations share it in buckets of --noise_reuse."""
    return generation // cfg.noise_reuse if cfg.noise_reuse else jnp.zeros_like(generation)


def generation_noise(cfg: Config, seed, generation):
    """One replica's noise of every distinct pair of every segment for this generation: leaves with
    a leading (noise_pairs,) axis, segment-major: segment s's pair k is
    words_to_noise(cfg, mix_segment(pair_words(cfg, seed, bucket, k), s)). Threefry runs once per
    distinct pair, the remix once per segment."""
    bucket = bucket_of(cfg, generation)
    words = jax.vmap(lambda k: pair_words(cfg, seed, bucket, k))(jnp.arange(cfg.distinct_pairs))
    words = jnp.concatenate([mix_segment(words, s) for s in range(cfg.segments)])
    return jax.vmap(partial(words_to_noise, cfg))(words)


def segment_noise(cfg: Config, seed, generation, segment, first, count: int):
    """One replica's noise of the pairs first, ..., first + count - 1 of one segment (traced ints),
    as generation_noise has them (leading axis: the pairs), threefry run again for them."""
    bucket = bucket_of(cfg, generation)
    words = jax.vmap(lambda k: pair_words(cfg, seed, bucket, k))(first + jnp.arange(count))
    return jax.vmap(partial(words_to_noise, cfg))(mix_segment(words, segment))


# ------------------------------------------------------------------------------------------------
# ES step. Every array of a run carries a leading replica axis K (K = 1 for a single run). Members
# are laid out as (repeats, distinct_pairs, 2): member p = 2 * pair + side (+ repeat * 2 *
# distinct_pairs), side 0 adds the noise and side 1 subtracts it.


def single(params):
    """One model's parameters as a run of one replica's (a leading axis of 1)."""
    return jax.tree.map(lambda p: jnp.asarray(p)[None], params)


def population_fitness(params, noise, states, inputs, targets, sigma_shifts, cfg: Config):
    """Fitness (log2-likelihood sums at LL_FRAC) of every replica's M members, and their new states.

    params: each (K, ...); noise: each (K, D, ...) for D distinct pairs (M a multiple of 2 D), or
    None for the noise-free model (validation, inference: M even); states (K, M, L, n) int8;
    inputs, targets (M, T) uint8, the same bytes for every replica; sigma_shifts (K,) int32 (unused
    without noise). Returns fitness (K, M) int32 and the states (K, M, L, n).

    Member p = (r D + d) S + s has the model's axes (R, D, S) by a reshape. States put their layer
    axis first, so that the layer scan slices them without copies. What stays fixed over the
    tokens is built once: each member's perturbed vectors (model_inputs)."""
    params = jax.tree.map(jnp.asarray, params)
    replicas, count = states.shape[:2]
    sides = 1 if noise is None else 2
    distinct = count // sides if noise is None else jax.tree.leaves(noise)[0].shape[1]
    layout = (count // (sides * distinct), distinct, sides)  # (R, D, S)
    shifts = jnp.zeros((replicas,), i32) if sigma_shifts is None else sigma_shifts
    on_sides = make_sides(shifts, sides)
    model = model_inputs(params, noise, on_sides, cfg)

    def step(h, io):
        tok, target = io
        logits, h, _ = token_logits(model, h, tok, cfg)
        return h, log2_likelihood(logits, target, model.tables)  # (K, R, D, S)

    h = jnp.moveaxis(states, 2, 0).reshape((cfg.n_layer, replicas) + layout + (cfg.n_embd,))
    io = (inputs.T.reshape((-1,) + layout), targets.T.reshape((-1,) + layout))  # (T, R, D, S)
    with jax.named_scope("tokens"):
        h, ll = jax.lax.scan(step, h, io)
    states = jnp.moveaxis(h.reshape((cfg.n_layer, replicas, count, cfg.n_embd)), 0, 2)
    return jnp.sum(ll, axis=0).reshape(replicas, count), states


def remainders_chunk(pairs: int) -> int:
    """How many remainders d mod pairs (each < pairs) shape_fitness sums at a time: as many as keep
    the sum int32."""
    return max(1, INT32_MAX // pairs)


def shape_fitness(fitness, cfg: Config, axis: str | None = None):
    """One int8 score per pair from its two members' fitness (members along the last axis, any
    leading axes, e.g. segments): the sign of the difference (--fast_fitness), or
    min(floor(2**FIT_FRAC |d| / mean|d|), 127) with d's sign, the mean over every pair, exactly for
    every int32 d, without a wider type. With `axis`, the pairs are spread over that mesh axis and
    the mean is over all of them."""
    diff = fitness[..., 0::2] - fitness[..., 1::2]
    if cfg.fast_fitness:
        return jnp.sign(diff).astype(jnp.int8)
    size = jnp.abs(diff)
    pairs = diff.size * (cfg.devices if axis is not None else 1)
    # floor(sum / pairs) = sum floor(d / pairs) + floor(sum (d mod pairs) / pairs), the second sum
    # taken in chunks whose sums stay int32 (remainders_chunk): sum floor(c / pairs) over the
    # chunks' sums c, plus floor(sum (c mod pairs) / pairs), under chunks x pairs (accumulator_bounds)
    rest = (size % pairs).reshape(-1)
    chunk = min(remainders_chunk(pairs), rest.size)  # no longer than the remainders: no padding beyond
    sums = jnp.sum(jnp.pad(rest, (0, -rest.size % chunk)).reshape(-1, chunk), axis=1)
    parts = jnp.stack([jnp.sum(size // pairs), jnp.sum(sums // pairs), jnp.sum(sums % pairs)])
    quotients, chunked, rests = jax.lax.psum(parts, axis) if axis is not None else parts
    mean = jnp.maximum(quotients + chunked + rests // pairs, 1)
    quotient, rest, divisor = size // mean, (size % mean).astype(jnp.uint32), mean.astype(jnp.uint32)
    scaled = jnp.minimum(quotient, INT8_MAX >> FIT_FRAC)  # 8 or more saturates at 127 below
    for _ in range(FIT_FRAC):  # the fraction's bits by long division: rest < divisor < 2**31
        rest = rest * 2
        bit = rest >= divisor
        rest, scaled = jnp.where(bit, rest - divisor, rest), scaled * 2 + bit.astype(i32)
    scaled = jnp.where(quotient > INT8_MAX >> FIT_FRAC, INT8_MAX, scaled)
    return (jnp.sign(diff) * scaled).astype(jnp.int8)


def shaped_score_rms(fast_fitness: bool) -> float:
    """Root mean square of a pair's shaped score when fitness is unrelated to the noise: 1 for
    signs (no ties); for min(floor(16 |d| / mean|d|), 127) with normal d, exact from the normal CDF,
    as |d| / mean|d| = |z| sqrt(pi / 2) for a standard normal z (19.7, where the unfloored
    16 sqrt(pi / 2) would say 20.1)."""
    if fast_fitness:
        return 1.0
    cdf = statistics.NormalDist().cdf
    width = math.sqrt(2 / math.pi) / 2**FIT_FRAC  # score k: |z| in [k width, (k + 1) width)
    second = sum(k * k * 2 * (cdf((k + 1) * width) - cdf(k * width)) for k in range(INT8_MAX))
    return math.sqrt(second + INT8_MAX**2 * 2 * (1 - cdf(INT8_MAX * width)))


def weighted_max(cfg: Config) -> int:
    """Largest |w_j a| of a low-rank matrix's Z operand: a pair weight w_j (the scores of the pairs
    sharing noise j, summed) times an entry a of A (its sign under --no-use_clt)."""
    repeats = cfg.population // (2 * cfg.distinct_pairs)
    noise_max = int(np.abs(make_tables(cfg.rank).gauss).max()) if cfg.use_clt else 1
    return noise_max * repeats * (1 if cfg.fast_fitness else INT8_MAX)


def weighted_shift(cfg: Config) -> int:
    """k of a low-rank matrix's Z operand round(w_j A_j / 2**k) (half away from zero), the smallest
    that keeps it int8, so that Z is an int8 x int8 product (2.2x faster than int16 x int8 on the
    CPU; the GPU's integer GEMMs take int8): 0 for sign scores (46 <= 127), 6 for normalised scores
    (127 x 46 = 5,842 -> 91), more where pairs share noise."""
    return next(k for k in range(32) if shifted(weighted_max(cfg), k) <= INT8_MAX)


def null_std(cfg: Config) -> tuple[float, float]:
    """Standard deviation of Z for a matrix entry and a vector entry when fitness is unrelated to
    the noise (the Z-test's null hypothesis), from the exact second moments of the noise tables
    (of their signs under --no-use_clt: the few zero entries count) and of the shaped scores. A
    low-rank matrix's Z sums round(w_j a / 2**k) b (weighted_shift): its variance is the exact one
    over 4**k, plus the rounding's (at most 1/12 a term: under 0.4% of it for normalised scores)."""
    tables = make_tables(cfg.rank)
    pairs = scored_pairs(cfg)

    def second_moment(table):
        values = table.astype(np.float64) if cfg.use_clt else np.sign(table.astype(np.float64))
        return float(np.mean(values**2))

    a, b = second_moment(tables.gauss), second_moment(tables.gauss_rank)
    weighted = pairs * shaped_score_rms(cfg.fast_fitness) ** 2 * a  # variance of sum_j w_j a_j
    if not cfg.rank:
        return math.sqrt(weighted), math.sqrt(weighted)
    k = weighted_shift(cfg)
    rounding = noise_pairs(cfg) / 12 if k else 0.0
    return math.sqrt((weighted / 4**k + rounding) * cfg.rank * b), math.sqrt(weighted)


def alpha_schedule(args: Args) -> np.ndarray:
    """Share of parameters allowed to move at each generation (the Z-test's two-sided level):
    --alpha itself if <= 1, else upstream's 1 / ((2**alpha - 1) t / T + 1) for t = 0, 1, ...,
    T = --alpha_decay_timestep: 1 at t = 0, 2**-alpha at t = T, decaying on, but never below
    --alpha_floor (upstream's has no floor). It depends on t only, not on --num_epochs, so a run
    extended on resume continues it exactly."""
    steps = np.arange(args.num_epochs, dtype=np.float64)
    if args.alpha <= 1:
        return np.full(args.num_epochs, args.alpha)
    decay = 1.0 / ((2.0**args.alpha - 1.0) * steps / args.alpha_decay_timestep + 1.0)
    return np.maximum(decay, args.alpha_floor)


def expected_square_sum(cfg: Config) -> float:
    """S_null: the expected sum of squared pair weights (scores summed over the pairs sharing a
    noise) under the null, pairs x E[score**2]."""
    return scored_pairs(cfg) * shaped_score_rms(cfg.fast_fitness) ** 2


def u_shifts(cfg: Config) -> tuple[int, int]:
    """momentum, adam: the right shifts that take Z of a matrix / vector entry to u, whose null std
    is then in [2**U_STD_BITS, 2**(U_STD_BITS + 1)) (no shift when Z's is already smaller)."""
    return tuple(max(int(math.floor(math.log2(std))) - U_STD_BITS, 0) for std in null_std(cfg))


def u_null_std(cfg: Config) -> np.ndarray:
    """Null std of u = round(Z / 2**shift) per kind: Z's scaled, plus the rounding's variance 1/12
    (none when shift = 0). The clip to +-127 is more than 4 std out and is neglected."""
    pairs = zip(null_std(cfg), u_shifts(cfg), strict=True)
    return np.array([math.sqrt((std / 2**k) ** 2 + (1 / 12 if k else 0)) for std, k in pairs])


def momentum_null_std(cfg: Config) -> np.ndarray:
    """Null std of the running sum m = rho m + u, rho = 1 - 2**-momentum_shift: u's / sqrt(1 - rho**2)
    (u is independent from one generation to the next: every generation draws new noise)."""
    rho = 1 - 2.0**-cfg.momentum_shift
    return u_null_std(cfg) / math.sqrt(1 - rho**2)


def z_thresholds(args: Args, cfg: Config) -> np.ndarray:
    """(num_epochs, 2) int32 per generation, for matrix / vector entries: what --optimizer tests.
    ztest: floor(z x null std of Z) for z = z_(1 - alpha/2), so that for the integer Z, |Z| >
    threshold exactly when |Z| > z x std; momentum: the same for m. adam: the multiplier
    K = round(z x (std m / std u) sqrt(pi / 2) 2**(SCALE_FRAC - scale_shift)) of the test
    |m| 2**SCALE_FRAC > K v, as v / 2**scale_shift estimates E|u| = std u sqrt(2 / pi), capped at
    2**16 - 1. A level too small for float64 (1 - alpha / 2 rounds to 1) gets the largest int32
    (adam: the cap): nothing moves."""
    normal = statistics.NormalDist()
    z = np.array([normal.inv_cdf(1 - a / 2) if 1 - a / 2 < 1 else math.inf for a in alpha_schedule(args)])
    if cfg.optimizer == "adam":
        ratio = momentum_null_std(cfg) / u_null_std(cfg) * math.sqrt(math.pi / 2)
        multiplier = z[:, None] * ratio[None, :] * 2.0 ** (SCALE_FRAC - cfg.scale_shift)
        return np.minimum(np.round(multiplier), SCALE_MAX).astype(np.int32)
    stds = momentum_null_std(cfg) if cfg.optimizer == "momentum" else np.array(null_std(cfg))
    return np.minimum(np.floor(z[:, None] * stds[None, :]), INT32_MAX).astype(np.int32)


def z_statistic(noise, weights, cfg: Config):
    """Z of one parameter: sum_j round(w_j A_j / 2**k) B_j^T for a low-rank matrix (A, B), an int8 x
    int8 product (k = weighted_shift: Z / 2**k up to the rounding), else sum_j w_j E_j exactly (a
    vector, or a --rank 0 matrix); under --no-use_clt the noise's signs replace its values. Leading
    axis of the noise: j."""
    prepare = (lambda n: n) if cfg.use_clt else jnp.sign
    if isinstance(noise, tuple):
        a, b = map(prepare, noise)
        product = a.astype(i32) * weights.reshape((-1,) + (1,) * (a.ndim - 1))
        weighted = round_shift(product, weighted_shift(cfg)).astype(jnp.int8)
        return jnp.einsum("k...mr,k...nr->...mn", weighted, b, preferred_element_type=i32)
    return jnp.einsum("k...,k->...", prepare(noise), weights, preferred_element_type=i32)


def optimizer_slots(cfg: Config) -> tuple[str, ...]:
    """The update rule's state per parameter entry: none (ztest), m (momentum), m and v (adam)."""
    return {"ztest": (), "momentum": ("m",), "adam": ("m", "v")}[cfg.optimizer]


def init_optimizer(cfg: Config) -> dict:
    """One model's update rule state, int16, keyed 'SLOT/NAME', each the parameter's shape: m, the
    running sum of u (momentum, adam), from 0; v, the running sum of |u| (adam), from its null
    mean 2**scale_shift E|u|. Empty for ztest."""
    v0 = np.round(2**cfg.scale_shift * u_null_std(cfg) * math.sqrt(2 / math.pi)).astype(int)
    start = {"m": lambda name: 0, "v": lambda name: int(v0[kind_of(name)])}
    return {
        f"{slot}/{name}": jnp.full(full_shape(name, cfg), start[slot](name), STATE)
        for slot in optimizer_slots(cfg)
        for name in PARAM_NAMES
    }


def standardise(z, shift: int):
    """u = clip(round(Z / 2**shift), -127, 127): Z at a null std in [2**U_STD_BITS, 2**(U_STD_BITS
    + 1)) (u_shifts), as int32."""
    reach = min(INT8_MAX << shift, INT32_MAX - (1 << shift))  # rounds to 127; no int32 overflow
    return jnp.clip(round_shift(jnp.clip(z, -reach, reach), shift), -INT8_MAX, INT8_MAX)


def rule_step(z, u, m, v, threshold, cfg: Config):
    """(move, new m, new v) of each entry of one parameter under --optimizer:
    ztest: sign(Z) where |Z| > threshold (u, m and v unused);
    momentum: u = standardise(Z), m = m - round(m / 2**momentum_shift) + u; the entry moves
    sign(m) x min(k, max_step) steps, k = floor(|m| / (threshold + 1)) the thresholds' worth m holds
    (k >= 1 exactly where |m| > threshold), and m restarts at 0 where it moved: the evidence is
    spent on the move (kept, m moved the same entry again and again: 0.2-0.3 bits/byte worse at 300
    generations); adam: besides, v = v - round(v / 2**scale_shift) + |u|, and k = floor(|m|
    2**SCALE_FRAC / (threshold v + 1)) (k >= 1 where |m| 2**SCALE_FRAC > threshold v), m restarting
    likewise. Ranges: |u| <= 127, so |m| and v stay <= 127 x 2**shift <= 16256 for shifts <= 7
    (int16: x - round(x / 2**k) + 127 <= 127 x 2**k for every x <= 127 x 2**k); |m| 2**SCALE_FRAC <
    2**27 and threshold v < 2**16 x 2**14 (int32); a threshold of INT32_MAX (nothing moves) is
    divided by as INT32_MAX, not overflowed."""
    if cfg.optimizer == "ztest":
        return jnp.sign(z) * (jnp.abs(z) > threshold), m, v
    m = m.astype(i32) - round_shift(m, cfg.momentum_shift) + u
    if cfg.optimizer == "momentum":
        held = jnp.abs(m) // (jnp.minimum(threshold, INT32_MAX - 1) + 1)
    else:
        v = v.astype(i32) - round_shift(v, cfg.scale_shift) + jnp.abs(u)
        held = (jnp.abs(m) << SCALE_FRAC) // (v * threshold + 1)
        v = v.astype(STATE)
    steps = jnp.minimum(held, cfg.max_step)
    return jnp.sign(m) * steps, jnp.where(steps > 0, 0, m).astype(STATE), v


def pair_weights(scores, cfg: Config):
    """(segments, distinct_pairs) int32: each noise's weight in Z, the scores (scored_pairs,),
    segment-major, of the pairs that share it summed."""
    repeats = cfg.population // (2 * cfg.distinct_pairs)
    return scores.astype(i32).reshape(cfg.segments, repeats, cfg.distinct_pairs).sum(1)


def z_statistics(noise, weights, cfg: Config) -> dict:
    """{parameter: Z} of these pairs' noise (leading axis: the pairs) and weights (pairs,)."""
    return {name: z_statistic(noise[name], weights, cfg) for name in PARAM_NAMES}


def apply_rule(params, opt, z: dict, weights, thresholds, cfg: Config):
    """One model's update from its Z: each parameter moves by +-1 where --optimizer's test passes.

    weights: every noise's (pair_weights); thresholds (2,) int32, the matrices' and the vectors';
    opt: the rule's state (init_optimizer). Returns the new parameters, the new state and how many
    entries moved in each tensor, each layer counted apart (so that every count fits int32; the
    host adds them up)."""
    if cfg.optimizer == "ztest" and cfg.null_from_scores:
        square_sum = jnp.sum(weights * weights)
        thresholds = scale_by_root(thresholds, square_sum, expected_square_sum(cfg))
    shifts = u_shifts(cfg)
    new, new_opt, moved = {}, {}, []
    for name in PARAM_NAMES:
        u = None if cfg.optimizer == "ztest" else standardise(z[name], shifts[kind_of(name)])
        step, m, v = rule_step(
            z[name], u, opt.get(f"m/{name}"), opt.get(f"v/{name}"), thresholds[kind_of(name)], cfg
        )
        new_opt.update({f"{slot}/{name}": x for slot, x in (("m", m), ("v", v)) if x is not None})
        new[name] = clip_int8(params[name].astype(i32) + step)
        changed = new[name] != params[name]
        layers = changed.shape[0] if name in BLOCK_NAMES else 1
        moved.append(jnp.sum(changed.reshape(layers, -1), axis=1, dtype=i32))
    return new, new_opt, jnp.concatenate(moved)


def pair_mean(states):
    """--shared_pair_state: both members of each antithetic pair (members 2k, 2k + 1) get the mean
    of their two hidden states, rounded half away from zero (int8: |mean| <= 127). states (M, L, n)."""
    pairs = states.astype(i32).reshape((-1, 2) + states.shape[1:])
    mean = round_shift(pairs[:, 0] + pairs[:, 1], 1).astype(jnp.int8)
    return jnp.repeat(mean, 2, axis=0)


POP = "pop"  # the mesh axis the population (and the validation rows) are spread over
REPLICATED = jax.sharding.PartitionSpec()  # parameters, update rule state, batches: whole on every device
SPREAD = jax.sharding.PartitionSpec(None, POP)  # states and fitness (K, members, ...): members spread


def noise_sources(cfg: Config, seeds, generation, start, distinct: int):
    """(noise_of, z_of) of a device whose first member is `start` and which evaluates `distinct`
    noises: noise_of(segment) the noise of this device's pairs in a segment (K, distinct, ...);
    z_of(weights (K, S, D)) every parameter's Z (K, ...) over every pair of every segment. With
    cfg.noise_per_segment each segment's noise is built where it is used, twice (for the fitness,
    then for Z, summed segment by segment); else every segment's at once, threefry once a pair,
    kept for the update."""
    offset = (start // 2) % cfg.distinct_pairs
    if cfg.noise_per_segment:

        def noise_of(segment, first=offset, count=distinct):
            return jax.vmap(lambda seed: segment_noise(cfg, seed, generation, segment, first, count))(seeds)

        def z_of(weights):
            def add(z, segment):
                noise = noise_of(segment, 0, cfg.distinct_pairs)
                found = jax.vmap(partial(z_statistics, cfg=cfg))(noise, weights[:, segment])
                return jax.tree.map(jnp.add, z, found), None

            zero = {k: jnp.zeros((cfg.replicas,) + full_shape(k, cfg), i32) for k in PARAM_NAMES}
            return jax.lax.scan(add, zero, jnp.arange(cfg.segments))[0]

        return noise_of, z_of
    noise = jax.vmap(lambda seed: generation_noise(cfg, seed, generation))(seeds)  # (K, S D, ...)

    def noise_of(segment):
        return jax.tree.map(
            lambda x: jax.lax.dynamic_slice_in_dim(x, segment * cfg.distinct_pairs + offset, distinct, 1),
            noise,
        )

    def z_of(weights):
        return jax.vmap(partial(z_statistics, cfg=cfg))(noise, weights.reshape(weights.shape[0], -1))

    return noise_of, z_of


def segments_fitness(cfg: Config, params, noise_of, states, tokens, sigma_shifts):
    """Every segment in turn (a scan per segment length): fitness (S, K, members), states. tokens
    (members, T + 1): this device's members' bytes; noise_of(segment) their noise, or None."""
    members = tokens.shape[0]

    def segment(states, xs):
        index, inputs, targets = xs
        if cfg.shared_pair_state:
            states = jax.vmap(pair_mean)(states)
        nz = noise_of(index)
        fitness, states = population_fitness(params, nz, states, inputs, targets, sigma_shifts, cfg)
        return states, fitness

    parts, segment_start, token_start = [], 0, 0
    for count, length in segment_lengths(cfg):

        def cut(x, a=token_start, n=count, length=length):  # (n, members, length): each segment's bytes
            return jnp.moveaxis(x[:, a : a + n * length].reshape(members, n, length), 1, 0)

        indices = segment_start + jnp.arange(count)
        states, out = jax.lax.scan(segment, states, (indices, cut(tokens[:, :-1]), cut(tokens[:, 1:])))
        parts.append(out)
        segment_start, token_start = segment_start + count, token_start + count * length
    return jnp.concatenate(parts), states


def make_generation_step(cfg: Config, mesh: jax.sharding.Mesh, part: str = "train"):
    """One generation of every replica as one jitted call: population fitness, then the update.

    step(params, opt, states, batch, generation, thresholds, seeds, sigma_shifts)
        -> (params, opt, states, fitness, moved)
    params, opt: each (K, ...); states (K, P, L, n) int8; batch (P / group_size, T + 1) uint8, one
    data sequence per group of members, the same for every replica; thresholds (K, 2), seeds (K,)
    and sigma_shifts (K,) int32, each replica's own (traced: a shift by an amount known at run time
    is the same integer operation). Each device evaluates its parallel_generations_per_gpu members
    of every replica (states and fitness are sharded on their member axis); the one collective
    gathers every pair's int8 score in every segment (half a byte per member and segment); then
    every device rebuilds all the noise from its counters and applies the identical update to its
    replicated parameters and update rule state. For --benchmark, part="fitness" stops before the
    update and part="inference" runs the same members and tokens without noise.
    """
    members = cfg.population // cfg.devices  # per device
    distinct = min(cfg.distinct_pairs, members // 2)  # distinct noises a device evaluates
    by_replica = jax.vmap  # over the leading replica axis of every argument

    def local_step(params, opt, states, batch, generation, thresholds, seeds, sigma_shifts):
        start = jax.lax.axis_index(POP) * members  # this device's first member
        tokens = batch[(start + jnp.arange(members)) // cfg.group_size]  # (members, T + 1)
        if part == "inference":
            noise_of, z_of = (lambda segment: None), None
        else:
            noise_of, z_of = noise_sources(cfg, seeds, generation, start, distinct)
        fitness, states = segments_fitness(cfg, params, noise_of, states, tokens, sigma_shifts)
        if part != "train":
            return params, opt, states, jnp.sum(fitness, axis=0), jnp.zeros((), i32)
        shaped = by_replica(partial(shape_fitness, cfg=cfg, axis=POP))(jnp.moveaxis(fitness, 0, 1))
        scores = jax.lax.all_gather(shaped, POP, axis=2, tiled=True)  # (K, S, pairs)
        weights = by_replica(partial(pair_weights, cfg=cfg))(scores.reshape(scores.shape[0], -1))  # (K, S, D)
        flat = weights.reshape(weights.shape[0], -1)
        params, opt, moved = by_replica(partial(apply_rule, cfg=cfg))(
            params, opt, z_of(weights), flat, thresholds
        )
        return params, opt, states, jnp.sum(fitness, axis=0), moved

    step = jax.shard_map(
        local_step,
        mesh=mesh,
        in_specs=(REPLICATED, REPLICATED, SPREAD, REPLICATED, REPLICATED, REPLICATED, REPLICATED, REPLICATED),
        out_specs=(REPLICATED, REPLICATED, SPREAD, SPREAD, REPLICATED),
        check_vma=False,
    )
    return jax.jit(step, donate_argnums=(0, 1, 2))


def make_evaluate(cfg: Config, mesh: jax.sharding.Mesh):
    """Noise-free log2-likelihood sums of each row by each replica: evaluate(params, rows (R, L)
    uint8) -> (K, R), the rows spread over the devices (R a multiple of twice their number), the
    result replicated."""

    def evaluate(params, rows):
        h = jnp.zeros((cfg.replicas, rows.shape[0], cfg.n_layer, cfg.n_embd), jnp.int8)
        return population_fitness(params, None, h, rows[:, :-1], rows[:, 1:], None, cfg)[0]

    rows = jax.sharding.PartitionSpec(POP)
    local = jax.shard_map(evaluate, mesh=mesh, in_specs=(REPLICATED, rows), out_specs=SPREAD, check_vma=False)
    return jax.jit(local, out_shardings=jax.sharding.NamedSharding(mesh, REPLICATED))


def init_run(cfg: Config, seeds: list[int]):
    """(params, opt, states) of a fresh run, each with the leading replica axis: each replica's
    parameters from its own seed, update rule states from their start, hidden states at zero."""
    params = jax.jit(jax.vmap(partial(init_params, cfg)))(jnp.array(seeds, i32))
    stack = partial(jax.tree.map, lambda x: jnp.broadcast_to(x, (cfg.replicas,) + x.shape))
    states = jnp.zeros((cfg.replicas, cfg.population, cfg.n_layer, cfg.n_embd), jnp.int8)
    return params, stack(init_optimizer(cfg)), states


# ------------------------------------------------------------------------------------------------
# Devices: one mesh axis over every device of every process; arrays move between the host and it.


class QuietPluginErrors(logging.Filter):
    """Drops JAX's traceback of an accelerator plugin that cannot start on this machine (jax[cuda12]
    on a machine with no NVIDIA GPU logs ~10 lines of it, then uses the CPU): JAX's own choice of
    platform stands, without the noise. Kept where an NVIDIA device is present: there it tells why
    the GPU is not used. The last reason is kept for a --platform that cannot start."""

    seen: list[str] = []  # the reasons plugins gave, last last

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith("Jax plugin configuration error"):
            return True
        if record.exc_info and record.exc_info[1] is not None:
            QuietPluginErrors.seen.append(f"{type(record.exc_info[1]).__name__}: {record.exc_info[1]}")
        return Path("/dev/nvidiactl").exists()


def population_mesh(devices=None) -> jax.sharding.Mesh:
    """A 1-D mesh over every device of every process (or the given ones). The first call starts
    JAX's platform: one that cannot start (a --platform this machine lacks) is refused in one line."""
    if devices is None:
        try:
            devices = jax.devices()
        except (RuntimeError, AssertionError) as error:  # JAX asserts where a plugin failed to start
            reason = (QuietPluginErrors.seen or [str(error) or "no device"])[-1].splitlines()[0]
            raise UserError(f"JAX cannot start platform {jax.config.jax_platforms}: {reason}") from None
    return jax.sharding.Mesh(np.array(devices), (POP,))


def init_distributed(args: Args) -> None:
    """Join a multi-process run: given by --coord_addr / --num_procs / --proc_id, or detected by
    jax.distributed itself (SLURM with several tasks, and the other clusters it knows). A process
    silent for --heartbeat_timeout seconds counts as lost, and JAX terminates every other one
    (supervise turns that into one line)."""
    by_hand = bool(args.coord_addr) or args.num_procs > 1
    slurm = int(os.environ.get("SLURM_NTASKS", "1")) > 1
    if not (by_hand or slurm):
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # for CPU devices; else unused
    timeout = dict(heartbeat_timeout_seconds=args.heartbeat_timeout)
    if by_hand:
        jax.distributed.initialize(args.coord_addr, args.num_procs, args.proc_id, **timeout)
    else:
        jax.distributed.initialize(**timeout)


def global_array(x: np.ndarray, mesh, spec) -> jax.Array:
    """A host array, the same on every process, as a global array with the given sharding."""
    x = np.asarray(x)
    sharding = jax.sharding.NamedSharding(mesh, spec)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def on_mesh(params, opt, states, mesh):
    """Parameters and update rule state replicated on every device, hidden states spread over the
    population."""
    params, opt = jax.tree.map(lambda p: global_array(p, mesh, REPLICATED), (params, opt))
    return params, opt, global_array(states, mesh, SPREAD)


def host_copy(x: jax.Array) -> np.ndarray:
    """The whole of a global array on the host (a collective if it spans processes)."""
    if x.is_fully_replicated:
        return np.asarray(x.addressable_shards[0].data)
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def local_copy(x: jax.Array, axis: int) -> np.ndarray:
    """This process's part of an array sharded over the population, its `axis` (no communication)."""
    shards = sorted(x.addressable_shards, key=lambda shard: shard.index[axis].start or 0)
    return np.concatenate([np.asarray(shard.data) for shard in shards], axis=axis)


COLLECTIVE_OPS = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8}


def collective_traffic(hlo: str) -> list[tuple[str, int]]:
    """(operation, bytes each device receives) of every collective in a compiled program's HLO."""
    found = []
    for line in hlo.splitlines():
        match = re.search(rf"= (\(?[^=]*?\)?) ({'|'.join(COLLECTIVE_OPS)})(-start)?\(", line)
        if match:
            shapes = re.findall(r"(\w+)\[([\d,]*)\]", match.group(1))
            if match.group(3):  # an async start returns (operand, result): count the result
                shapes = shapes[-1:]
            size = sum(
                DTYPE_BYTES.get(t, 4) * math.prod(int(d) for d in dims.split(",") if d) for t, dims in shapes
            )
            found.append((match.group(2), size))
    return found


class Compiled(NamedTuple):
    """A generation step compiled ahead of time, and what its compiled program shows."""

    step: Any
    seconds: float  # compile time
    temporaries: float  # MiB of the program's own temporaries on a device
    traffic: int  # bytes each device receives through collectives per generation


def compile_generation(cfg: Config, mesh, part: str, carry: tuple, batch, inputs: tuple) -> Compiled:
    """make_generation_step's program for these arguments, compiled now (the first call then runs,
    and the program's memory and collectives are known before it does)."""
    tick = time.time()
    step = make_generation_step(cfg, mesh, part).lower(*carry, batch, np.int32(0), *inputs).compile()
    seconds = time.time() - tick
    temporaries = getattr(step.memory_analysis(), "temp_size_in_bytes", 0) / 2**20
    return Compiled(step, seconds, temporaries, sum(size for _, size in collective_traffic(step.as_text())))


# ------------------------------------------------------------------------------------------------
# Integer ranges. Every int32 accumulator's worst case, from the int8 ranges and the config:
# a configuration for which one could exceed 2**31 - 1 is refused before anything runs. Fixed
# bounds need no check: layer norm < 2**30, divide_to_int8 < 2**28, log-sum-exp s <= 2**28.

# |log2 p(target)| at LL_FRAC: the target 254 logit steps below the top (254 * 16), plus log2 s
# for s <= 2**28 (2**LL_FRAC per bit above EXP_FRAC, one more for the mantissa)
LL_BOUND = 254 * 2 ** (LL_FRAC - LOGIT_FRAC) + (28 - EXP_FRAC + 1) * 2**LL_FRAC
SMALLER_POPULATION = "a smaller --parallel_generations_per_gpu or --segments, or --fast_fitness"


def accumulator_bounds(cfg: Config) -> dict[str, tuple[int, str]]:
    """{accumulator: (largest magnitude it can reach, what would shrink it)}."""
    tables = make_tables(cfg.rank)
    a_max = int(np.abs(tables.gauss).max())
    b_max = int(np.abs(tables.gauss_rank).max())
    n_in = 4 * cfg.n_embd  # the widest matmul input (the MLP's down projection)
    x_b = INT8_MAX * b_max * n_in  # x B
    u_a = (x_b >> NOISE_FRAC) * a_max * cfg.rank  # ((x B) >> 4) A^T
    score_max = 1 if cfg.fast_fitness else INT8_MAX
    pairs = scored_pairs(cfg)
    z_vector = pairs * score_max * (a_max if cfg.use_clt else 1)
    k = weighted_shift(cfg)  # a low-rank Z sums int8 round(w_j a / 2**k) times b
    z_matrix = noise_pairs(cfg) * shifted(weighted_max(cfg), k) * cfg.rank
    z_matrix *= b_max if cfg.use_clt else 1
    if cfg.rank == 0:  # full-rank noise: x E^T, and Z sums single noise entries as a vector's does
        x_b, u_a, z_matrix = 0, INT8_MAX * a_max * n_in, z_vector
    repeats = cfg.population // (2 * cfg.distinct_pairs)
    return {
        "matmul accumulator x W^T + sigma x E^T": (INT8_MAX**2 * n_in + u_a, "a smaller --n_embd or --rank"),
        "low-rank product x B": (x_b, "a smaller --n_embd"),
        "fitness (log2-likelihood sum)": (LL_BOUND * cfg.tokens, "a smaller --tokens_per_update"),
        # both members' fitness lie in [-LL_BOUND T, 0]
        "fitness difference of a pair": (LL_BOUND * cfg.tokens, "a smaller --tokens_per_update"),
        "Z of a matrix entry": (z_matrix, SMALLER_POPULATION),
        "Z of a vector entry": (z_vector, SMALLER_POPULATION),
        # counted whether or not --null_from_scores computes it, so that --segments 0 picks one
        # count for a configuration whatever that flag says
        "sum of squared pair weights (--null_from_scores)": (
            noise_pairs(cfg) * (repeats * score_max) ** 2,
            SMALLER_POPULATION,
        ),
        "sum of |pair difference| mod pairs (normalised fitness), over its chunks": (
            0 if cfg.fast_fitness else (-(-pairs // remainders_chunk(pairs)) + cfg.devices) * pairs,
            SMALLER_POPULATION,
        ),
        "count of moved entries of one layer's tensor": (
            max(math.prod(param_shape(k, cfg)) for k in PARAM_NAMES),
            "a smaller --n_embd",
        ),
    }


def num_parameters(cfg: Config) -> int:
    """Parameters of one model."""
    return sum(math.prod(full_shape(k, cfg)) for k in PARAM_NAMES)


def make_config(args: Args, devices: int | None = None, platform: str = "cpu") -> Config:
    """The static configuration of a run on `devices` JAX devices of a platform (default: one CPU's
    worth). A CPU split into --cpu_devices of them counts as one device of
    --parallel_generations_per_gpu."""
    shards = max(args.cpu_devices, 1)
    devices = shards if devices is None else devices
    population = args.parallel_generations_per_gpu * devices // shards
    gpu = platform in ("gpu", "cuda", "rocm")
    kernels = {"xla": "xla", "pallas": "pallas" if gpu else "interpret"}.get(
        args.kernels, "pallas" if gpu else "xla"
    )
    derived = (
        "population",
        "tokens",
        "segments",
        "distinct_pairs",
        "devices",
        "kernels",
        "noise_per_segment",
    )
    cfg = Config(
        kernels=kernels,
        noise_per_segment=gpu,
        **{name: getattr(args, name) for name in Config._fields if name not in derived},  # as the flags say
        population=population,
        tokens=args.tokens_per_update,
        segments=min(args.segments or AUTO_SEGMENTS, args.tokens_per_update),
        distinct_pairs=(args.num_perturbations or population) // 2,
        devices=devices,
    )
    while (
        not args.segments
        and cfg.segments > 1
        and max(b for b, _ in accumulator_bounds(cfg).values()) > INT32_MAX
    ):
        cfg = cfg._replace(segments=cfg.segments - 1)  # --segments 0: as many as the int32 bounds allow
    return cfg._replace(max_step=args.max_step or (2 if scored_pairs(cfg) >= STEP2_PAIRS else 1))


def mesh_config(args: Args, mesh: jax.sharding.Mesh) -> Config:
    """make_config for a run on this mesh's devices and platform."""
    return make_config(args, mesh.size, mesh.devices.flat[0].platform)


# ------------------------------------------------------------------------------------------------
# Flags: each replica's settings, the checks every flag's facts and the int32 bounds imply, the
# --algorithm upstream preset, and the command line.


def replica_settings(args: Args) -> list[dict]:
    """Each replica's seed (--seed + its index) and settings (its --replica_NAME value, else --NAME)."""
    lists = {
        name: getattr(args, f"replica_{name}") or (getattr(args, name),) * args.replicas
        for name in REPLICA_SETTINGS
    }
    return [
        {"seed": args.seed + k, **{name: lists[name][k] for name in REPLICA_SETTINGS}}
        for k in range(args.replicas)
    ]


def single_run(args: Args, **changes) -> Args:
    """These flags without replicas (and PBT), with `changes` (e.g. one replica's settings)."""
    lists = {f"replica_{name}": () for name in REPLICA_SETTINGS}
    return dataclasses.replace(args, **{"replicas": 1, "pbt_every": 0, **lists, **changes})


def check_range(name: str, value, which: str = "") -> None:
    """Refuse a value outside the flag's range (Facts) with one line naming it; `which` names a replica."""
    facts = flag_facts()[name]
    if not facts.admits(value):
        why = f": {facts.why}" if facts.why else ""
        raise UserError(f"--{name} must be {facts.allowed()}, got {value}{which}{why}")


def check_ranges(cfg: Config) -> None:
    """Refuse a configuration whose int32 accumulators could overflow (accumulator_bounds)."""
    for name, (bound, remedy) in accumulator_bounds(cfg).items():
        if bound > INT32_MAX:
            raise UserError(
                f"the {name} could reach {bound:,} > 2**31 - 1 (int32) with this config: use {remedy}"
            )


def check_args(args: Args) -> None:
    """Refuse a bad configuration with one clear line, naming the flag, before anything is compiled."""
    for name, facts in flag_facts().items():
        if facts.ranged():
            check_range(name, getattr(args, name))
    p, g, n = args.parallel_generations_per_gpu, args.group_size, args.num_perturbations
    if p % 2:
        raise UserError(f"--parallel_generations_per_gpu must be even (antithetic pairs), got {p}")
    if g % 2 or p % g:
        raise UserError(f"--group_size must be even and divide the population {p}, got {g}")
    if n and (n % 2 or p % n):
        raise UserError(f"--num_perturbations must be even and divide the population {p}, got {n}")
    if args.n_embd % 4:
        raise UserError(f"--n_embd must be a multiple of 4, got {args.n_embd}")
    if args.proc_id >= args.num_procs:
        raise UserError(f"--proc_id must be below --num_procs, got {args.proc_id} of {args.num_procs}")
    for name in REPLICA_SETTINGS:
        given = getattr(args, f"replica_{name}")
        if given and len(given) != args.replicas:
            raise UserError(
                f"--replica_{name} has {len(given)} value(s): give one per replica "
                f"(--replicas {args.replicas})"
            )
    if args.pbt_every and args.replicas < 4:
        raise UserError(
            f"--pbt_every needs --replicas 4 or more (the worst quarter copies the best), got {args.replicas}"
        )
    for k, setting in enumerate(replica_settings(args)):
        for name in REPLICA_SETTINGS:
            check_range(name, setting[name], f" (replica {k})" if args.replicas > 1 else "")
    check_ranges(make_config(args))


def check_z_test(args: Args, cfg: Config) -> None:
    """Refuse a fixed --alpha of a replica so small that its threshold is beyond the largest |Z|
    (momentum: |m|) an entry can reach at this population: no parameter could ever move. (A
    schedule starts at alpha 1; adam's test compares with a running scale and has no such bound.)"""
    if cfg.optimizer == "adam":
        return
    bounds = accumulator_bounds(cfg)
    statistic = "|Z|" if cfg.optimizer == "ztest" else "running sum |m|"
    for setting in replica_settings(args):
        alone = single_run(args, **setting, num_epochs=1)
        for kind, threshold in zip(("matrix", "vector"), z_thresholds(alone, cfg)[0], strict=True):
            ztest = cfg.optimizer == "ztest"
            reach = bounds[f"Z of a {kind} entry"][0] if ztest else INT8_MAX << cfg.momentum_shift
            if threshold >= reach:
                raise UserError(
                    f"--alpha {setting['alpha']:g} at population {cfg.population}: the Z-test threshold "
                    f"{threshold:,} is beyond the largest {statistic} a {kind} entry can reach ({reach:,}), "
                    "so nothing would ever move; use a larger --alpha or population"
                )


def upstream_preset() -> dict[str, Any]:
    """--algorithm upstream: upstream nano-egg's value of every flag whose default here differs."""
    return {name: facts.upstream for name, facts in flag_facts().items() if facts.upstream is not None}


def flag_given(argv: list[str], name: str) -> bool:
    """Whether --name (spelt with underscores or dashes, with or without =value) is in argv."""
    spellings = {f"--{name}", f"--{name.replace('_', '-')}"}
    return any(word.partition("=")[0] in spellings for word in argv)


def parse_args(argv: list[str]) -> Args:
    """Args from the command line. Besides tyro's --flag / --no-flag, booleans also accept
    --flag=True|False and --flag True|False: the forms W&B sweep agents pass with ${args}."""
    booleans = {name for name, hint in typing.get_type_hints(Args).items() if hint is bool}
    out, i = [], 0
    while i < len(argv):
        word = argv[i]
        name, equals, value = word[2:].partition("=")
        if word.startswith("--") and name.replace("-", "_") in booleans:
            if not equals and i + 1 < len(argv) and argv[i + 1].lower() in ("true", "false"):
                equals, value = "=", argv[i + 1]
                i += 1
            if equals:
                if value.lower() not in ("true", "false"):
                    raise UserError(f"--{name} takes True or False, got {value!r}")
                word = f"--{name}" if value.lower() == "true" else f"--no-{name}"
        out.append(word)
        i += 1
    args = tyro.cli(Args, args=out, use_underscores=True)  # --help spells flags as upstream does
    if args.algorithm == "upstream":
        preset = upstream_preset()
        given = {k for k in preset if any(flag_given(out, f"{no}{k}") for no in ("", "no-", "no_"))}
        args = dataclasses.replace(args, **{k: v for k, v in preset.items() if k not in given})
    return args


# ------------------------------------------------------------------------------------------------
# Data: a corpus is a read-only memory-mapped uint8 array; documents are separated by byte 0.


def stdlib_folder() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(folder: Path, suffix: str = "") -> list[Path]:
    """Every regular file under `folder` (sorted, so the corpus is the same on every run)."""
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d not in skip and not d.startswith("."))
        files += [Path(root) / f for f in sorted(names) if f.endswith(suffix) and not f.startswith(".")]
    return [f for f in files if f.is_file()]


def temporary(path: Path) -> Path:
    """The hidden name under which a file or a checkpoint folder is written, or removed, before it
    is renamed: .NAME.tmpPID. A kill at any moment thus never leaves half of one under its real
    name, and a later start knows from the PID which leftovers are a dead process's (leftover_of)."""
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def leftover_of(path: Path) -> int | None:
    """The PID in a temporary's name (temporary), or None for any other name."""
    match = re.fullmatch(r"\..+\.tmp(\d+)", path.name)
    return int(match.group(1)) if match else None


@contextmanager
def atomic_file(path: Path):
    """Open `path` for binary writing under its temporary name, then fsync it and rename it into
    place (a failed write removes its temporary)."""
    tmp = temporary(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomic(path: Path, data: bytes) -> None:
    with atomic_file(path) as f:
        f.write(data)


def concatenate_files(files: list[Path], cache_dir: Path, name: str) -> Path:
    """Concatenate files, each prefixed by byte 0, into one cached file (streamed, never whole in
    memory; written atomically, so a kill never leaves a broken cache)."""
    stats = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    digest = hashlib.sha256(repr(stats).encode()).hexdigest()[:16]
    out = cache_dir / f"{name}-{digest}.bin"
    if out.exists():
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    with atomic_file(out) as sink:
        for f in files:
            sink.write(b"\0")
            with open(f, "rb") as source:
                shutil.copyfileobj(source, sink, 1 << 20)
    return out


MINIPILE = "JeanKaddour/minipile"
MINIPILE_SPLITS = ("train", "validation", "test")


def write_documents(texts, path: Path) -> None:
    """Stream texts to `path` as UTF-8 bytes, each document prefixed by byte 0 (atomically)."""
    with atomic_file(path) as sink:
        for text in texts:
            sink.write(b"\0" + text.encode("utf-8"))


def convert_splits(splits, cache_dir: Path, name: str) -> None:
    """Convert a datasets.DatasetDict (or any {split: Dataset}) with a 'text' column to one uint8
    file per split, batch by batch: the corpus is never held as a Python list."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    for split, dataset in splits.items():
        batches = dataset.iter(batch_size=1024)
        write_documents(
            (text for batch in batches for text in batch["text"]), cache_dir / f"{name}_{split}.bin"
        )


def hub_reachable(timeout: float = 5.0) -> bool:
    """Whether the Hugging Face hub answers (checked first, so an offline machine fails in
    seconds instead of retrying for minutes)."""
    import socket
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def load_minipile(cache_dir: str) -> dict[str, np.ndarray]:
    """minipile's splits as memory maps, downloaded and converted on the first use only."""
    folder = Path(cache_dir)
    paths = {split: folder / f"minipile_{split}.bin" for split in MINIPILE_SPLITS}
    if not all(p.exists() for p in paths.values()):
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "")
        if not offline and not hub_reachable():
            raise UserError(
                "cannot reach the Hugging Face hub to download minipile; train offline on Python's "
                "own sources with --data stdlib, or on your own text with --data PATH"
            )
        import datasets

        print(f"downloading {MINIPILE} and converting it to bytes in {folder} (once)")
        convert_splits(datasets.load_dataset(MINIPILE), folder, "minipile")
    return {split: np.memmap(path, dtype=np.uint8, mode="r") for split, path in paths.items()}


def load_corpus(spec: str, cache_dir: str, flag: str = "--data") -> np.ndarray:
    """Bytes of a corpus: 'stdlib', a file (raw bytes, or a uint8 .npy array) or a folder, as a
    read-only memory map. `flag` names the flag it came from in errors."""
    if spec == "stdlib":
        files = corpus_files(stdlib_folder(), ".py")
        version = f"py{sys.version_info[0]}{sys.version_info[1]}"
        path = concatenate_files(files, Path(cache_dir), f"stdlib-{version}")
    else:
        source = Path(spec).expanduser()
        if not source.exists():
            raise UserError(f"{flag} {spec}: no such path; give a file, a folder, 'stdlib' or 'minipile'")
        if source.is_dir():
            files = corpus_files(source)
            if not files:
                raise UserError(f"{flag} {spec}: the folder holds no files (hidden ones are skipped)")
            path = concatenate_files(files, Path(cache_dir), source.resolve().name or "root")
        else:
            path = source
    if path.stat().st_size == 0:
        raise UserError(f"{flag} {spec}: the file is empty; give a file with some text")
    if path.suffix == ".npy":  # e.g. upstream nano-egg's cached_files/minipile_train.npy
        try:
            array = np.load(path, mmap_mode="r")
        except (ValueError, OSError) as error:
            raise UserError(f"{flag} {spec}: not a readable .npy array ({error})") from None
        if array.dtype != np.uint8 or array.ndim != 1:
            raise UserError(
                f"{flag} {spec}: holds a {array.dtype} array of shape {array.shape}, not 1-D uint8 bytes"
            )
        return array
    return np.memmap(path, dtype=np.uint8, mode="r")


def open_data(args: Args) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) bytes. Validation is --valid_data if given, else minipile's validation
    split, else the last --valid_fraction of --data."""
    valid = None
    if args.data == "minipile":
        splits = load_minipile(args.dir_path)
        train, valid = splits["train"], splits["validation"]
    else:
        train = load_corpus(args.data, args.dir_path)
    if args.valid_data is not None:
        return train, load_corpus(args.valid_data, args.dir_path, "--valid_data")
    if valid is not None:
        return train, valid
    held_out = max(2 * args.validation_batch_size, int(len(train) * args.valid_fraction))
    if held_out >= len(train) // 2:
        raise UserError(
            f"--data has {len(train)} bytes: too few to hold out {held_out} for validation; "
            "give more data, a smaller --validation_batch_size, or --valid_data"
        )
    return train[:-held_out], train[-held_out:]


class Stream(NamedTuple):
    """Where each data sequence reads: sequence s starts at s * stride and advances
    tokens_per_update bytes per generation, wrapping after `windows` generations."""

    stride: int
    windows: int


def make_stream(num_bytes: int, cfg: Config) -> Stream:
    sequences = cfg.population // cfg.group_size
    stride = num_bytes // sequences
    windows = (stride - 1) // cfg.tokens
    if windows < 1:
        raise UserError(
            f"training data has {num_bytes} bytes: too short for {sequences} sequences of "
            f"{cfg.tokens + 1} bytes; use more data, a larger --group_size or fewer --tokens_per_update"
        )
    return Stream(stride, windows)


def batch_at(train: np.ndarray, stream: Stream, cfg: Config, generation: int) -> np.ndarray:
    """(sequences, T + 1) uint8: the bytes every sequence reads at this generation."""
    sequences = cfg.population // cfg.group_size
    starts = np.arange(sequences) * stream.stride + (generation % stream.windows) * cfg.tokens
    return np.asarray(train[starts[:, None] + np.arange(cfg.tokens + 1)])


def validation_rows(valid: np.ndarray, args: Args) -> np.ndarray:
    """(rows, L) uint8: the validation bytes cut into --validation_batch_size rows."""
    if len(valid) < 2:
        raise UserError(f"validation data has {len(valid)} bytes: give at least 2")
    rows = min(args.validation_batch_size, len(valid) // 2)
    length = len(valid) // rows
    if args.validation_tokens:
        length = min(length, args.validation_tokens + 1)
    if LL_BOUND * (length - 1) > INT32_MAX:
        raise UserError(
            f"validation rows of {length} bytes could overflow the int32 log-likelihood sum: "
            f"use --validation_tokens {INT32_MAX // LL_BOUND} or less, or a larger --validation_batch_size"
        )
    starts = np.arange(rows) * (len(valid) // rows)
    return np.asarray(valid[starts[:, None] + np.arange(length)])


# ------------------------------------------------------------------------------------------------
# Baselines: what classical compressors achieve on the very bytes the model is validated on.


def unigram_bigram_counts(train: np.ndarray, chunk: int = 1 << 22) -> tuple[np.ndarray, np.ndarray]:
    """Byte and byte-pair counts of the training data, read through the memory map in chunks."""
    unigram = np.zeros(256, np.int64)
    bigram = np.zeros(256 * 256, np.int64)
    for start in range(0, len(train), chunk):
        piece = np.asarray(train[start : start + chunk + 1])
        unigram += np.bincount(piece[:chunk], minlength=256)
        bigram += np.bincount(piece[:-1].astype(np.int64) * 256 + piece[1:], minlength=256 * 256)
    return unigram, bigram.reshape(256, 256)


def measure_baselines(train: np.ndarray, rows: np.ndarray) -> dict[str, float]:
    """Bits/byte on the validation rows' targets (rows[:, 1:]) of: a unigram and a bigram model
    estimated on train (add-one smoothing), and gzip -9 of the rows' bytes."""
    import gzip

    unigram, bigram = unigram_bigram_counts(train)
    targets, contexts = rows[:, 1:].ravel(), rows[:, :-1].ravel()
    log_unigram = np.log2(unigram + 1) - np.log2(unigram.sum() + 256)
    log_bigram = np.log2(bigram + 1) - np.log2(bigram.sum(1, keepdims=True) + 256)
    text = rows.tobytes()
    return {
        "unigram": float(-log_unigram[targets].mean()),
        "bigram": float(-log_bigram[contexts, targets].mean()),
        "gzip": 8 * len(gzip.compress(text, compresslevel=9)) / len(text),
    }


def cached_baselines(train: np.ndarray, rows: np.ndarray, cache_dir: str) -> dict[str, float]:
    """measure_baselines, computed once per (training file, validation rows) and kept as JSON."""
    source = Path(getattr(train, "filename", "") or "")
    stamp = (str(source), source.stat().st_mtime_ns if source.exists() else 0, len(train))
    digest = hashlib.sha256(repr(stamp).encode() + rows.tobytes()).hexdigest()[:16]
    path = Path(cache_dir) / f"baselines-{digest}.json"
    if path.exists():
        return json.loads(path.read_text())
    values = measure_baselines(train, rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(values).encode())
    return values


def describe_baselines(values: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:.2f}" for name, value in values.items())


# ------------------------------------------------------------------------------------------------
# Checkpoints. One folder per checkpoint, readable without run.py:
#   params.npz    the int8 parameters, one array per name in PARAM_NAMES (numpy's own format)
#   states.npz    the carried hidden states (population, n_layer, n_embd) int8
#   optimizer.npz the update rule's int16 state, one array per 'SLOT/NAME' (not for --optimizer ztest)
#   meta.json     generation, validation score, format version, every flag of the run, and the
#                 settings that decide its training (compared on resume)
# A run of K > 1 replicas stores every array with its leading (K,) axis; a single model, a run of
# one or the best replica of several, without it (as every checkpoint before replicas existed).
# Folders are written under their temporary name and renamed into place, and the pointer files
# LATEST and BEST are replaced by rename too: a kill at any moment leaves the previous checkpoints
# intact and never a half-written one under a real name.

CHECKPOINT_FORMAT = 3  # 2 adds meta["training"], 3 optimizer.npz and --optimizer's flags; all load


def default_run_name(args: Args) -> str:
    data = Path(args.data).name or "data"
    name = (
        f"{data}-{args.n_embd}D{args.n_layer}L-a{args.alpha:g}-s{args.sigma_shift}-r{args.rank}-"
        f"{args.parallel_generations_per_gpu}x{args.tokens_per_update}x{args.noise_reuse}-seed{args.seed}"
    )
    name += "-upstream" * (args.algorithm == "upstream")
    return f"{name}-{args.tag}" if args.tag else name


def save_dir_of(args: Args) -> Path:
    """--save_dir, by default <runs_dir>/<run_name>/checkpoints."""
    return Path(
        args.save_dir or Path(args.runs_dir) / (args.run_name or default_run_name(args)) / "checkpoints"
    )


def data_fingerprint(data: np.ndarray, samples: int = 64, size: int = 4096) -> str:
    """Identity of the training bytes, cheap on any size: their length and the SHA-256 of
    `samples` pieces of `size` bytes at evenly spaced places (the whole of a small corpus)."""
    starts = np.linspace(0, max(len(data) - size, 0), samples).astype(np.int64)
    digest = hashlib.sha256(np.int64(len(data)).tobytes())
    for start in starts:
        digest.update(np.asarray(data[start : start + size]).tobytes())
    return f"{len(data):,} bytes #{digest.hexdigest()[:12]}"


def training_identity(args: Args, cfg: Config, train_bytes: np.ndarray) -> dict:
    """Everything besides the generation counter that decides how a run trains: the flags whose
    Facts say so, the total population (members per device x devices: the device count alone
    changes nothing) and the training bytes. --num_epochs is not one: the alpha schedule, the noise
    and the data position depend on the generation counter only, so a run may be extended."""
    identity = {name: getattr(args, name) for name, facts in flag_facts().items() if facts.training}
    identity = {k: list(v) if isinstance(v, tuple) else v for k, v in identity.items()}  # as JSON has them
    identity["max_step"] = cfg.max_step  # --max_step 0 as resolved: what the steps were
    return {**identity, "population": cfg.population, "data": data_fingerprint(train_bytes)}


def acts(settings: dict, name: str) -> bool:
    """Whether a flag acts in these settings (Facts.acts_if: e.g. --momentum_shift only under
    --optimizer momentum or adam)."""
    condition = flag_facts()[name].acts_if if name in flag_facts() else None
    return condition is None or settings.get(condition[0]) in condition[1]


def checkpoint_settings(meta: dict) -> dict:
    """What a checkpoint was trained with: its record, and for each flag it does not record (it
    predates the flag) the flag's Facts.before. A format 1 checkpoint has only its flags."""
    recorded = meta.get("training") or meta.get("args", {})
    before = {name: facts.before for name, facts in flag_facts().items() if facts.before is not None}
    before = {k: list(v) if isinstance(v, tuple) else v for k, v in before.items()}  # as JSON has them
    return {**before, **recorded}


def training_changes(meta: dict, identity: dict) -> dict[str, tuple]:
    """{setting: (the checkpoint's value, this run's)} for every setting that differs and acts in
    both (where a flag acts in one only, the flag deciding that differs, and is listed)."""
    old = checkpoint_settings(meta)
    both = [k for k in identity if k in old and acts(old, k) and acts(identity, k)]
    return {k: (old[k], identity[k]) for k in both if old[k] != identity[k]}


def describe_changes(changes: dict[str, tuple]) -> str:
    names = {"population": "population", "data": "training data"}
    return ", ".join(f"{names.get(k, '--' + k)} {old} -> {new}" for k, (old, new) in changes.items())


def check_not_removed(meta: dict, folder: Path) -> None:
    """Refuse a checkpoint trained with a flag egg-jax no longer has (REMOVED_FLAGS) switched on."""
    old = checkpoint_settings(meta)
    for name, off in REMOVED_FLAGS.items():
        if old.get(name, off) != off:
            raise UserError(
                f"--resume: {folder} was trained with --{name}, which egg-jax no longer has; continue it "
                "with the code of commit b7524ed, or start a new run"
            )


class UnreadableCheckpoint(UserError):
    """A checkpoint whose files are missing or corrupt."""

    def __init__(self, folder: Path, reason: str):
        super().__init__(f"checkpoint {folder} is unreadable ({reason}): resume from another one")
        self.folder, self.reason = folder, reason


def save_checkpoint(folder: Path, params, opt, states, meta: dict) -> None:
    """Write a checkpoint folder atomically (nothing happens if it already exists)."""
    if folder.exists():
        return
    tmp = temporary(folder)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files = {"params.npz": params, "states.npz": {"states": states}, "optimizer.npz": opt}
    for name, arrays in files.items():
        if arrays:  # no optimizer.npz for --optimizer ztest
            with atomic_file(tmp / name) as f:
                np.savez(f, **{k: np.asarray(v) for k, v in arrays.items()})
    write_atomic(tmp / "meta.json", (json.dumps(meta, indent=1) + "\n").encode())
    os.replace(tmp, folder)


def remove_checkpoint(folder: Path) -> None:
    """Delete a checkpoint folder without ever leaving part of one under a real name: renamed to
    its temporary name first (which the next start removes, should a kill cut this short)."""
    tmp = temporary(folder)
    os.replace(folder, tmp)
    shutil.rmtree(tmp)


def load_checkpoint(folder: Path, cfg: Config):
    """(params, states or None, opt or None, meta) of a checkpoint folder, checked against this
    run's model, every array with the replica axis. States come back as None when the population
    layout differs (they cannot carry over), opt as None when the checkpoint holds no state of this
    run's --optimizer."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
        with np.load(folder / "params.npz") as f:
            params = {k: f[k] for k in f.files}
        with np.load(folder / "states.npz") as f:
            states = f["states"]
        opt = {}
        if (folder / "optimizer.npz").exists():
            with np.load(folder / "optimizer.npz") as f:
                opt = {k: f[k] for k in f.files}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
        raise UnreadableCheckpoint(folder, type(error).__name__) from None
    stored = (cfg.replicas,) if cfg.replicas > 1 else ()  # the leading axis a file of this run has
    if {k: v.shape for k, v in params.items()} != {
        k: stored + full_shape(k, cfg) for k in PARAM_NAMES
    } or any(v.dtype != np.int8 for v in params.values()):
        model = meta.get("args", {})
        held, mine = 1 if "replica" in meta else model.get("replicas", 1), cfg.replicas  # best-*: one
        raise UserError(
            f"checkpoint {folder} holds {f'{held} replicas of ' if held > 1 else ''}a "
            f"{model.get('n_embd')}D-{model.get('n_layer')}L model; this run is "
            f"{f'{mine} replicas of ' if mine > 1 else ''}{cfg.n_embd}D-{cfg.n_layer}L: pass the same "
            f"--n_embd and --n_layer{' and --replicas' if held != mine else ''}, or another checkpoint"
        )
    if states.shape != stored + (cfg.population, cfg.n_layer, cfg.n_embd) or states.dtype != np.int8:
        states = None
    want = {f"{slot}/{k}": stored + full_shape(k, cfg) for slot in optimizer_slots(cfg) for k in PARAM_NAMES}
    opt = {k: v for k, v in opt.items() if k in want}  # e.g. adam's v, resumed as momentum
    if {k: v.shape for k, v in opt.items()} != want or any(v.dtype != np.int16 for v in opt.values()):
        opt = None
    if not stored:  # a single model's file: give it the run's replica axis of 1
        params, states, opt = jax.tree.map(lambda x: x[None], (params, states, opt))
    return params, states, opt, meta


def checkpoint_digest(folder: Path) -> str:
    """SHA-256 (first 16 hex digits) of a checkpoint's parameters, hidden states and update rule
    state, each file's arrays in sorted order: equal digests, bit-identical training."""
    digest = hashlib.sha256()
    for name in ("params.npz", "states.npz", "optimizer.npz"):
        if (folder / name).exists():
            with np.load(folder / name) as f:
                for key in sorted(f.files):
                    digest.update(f[key].tobytes())
    return digest.hexdigest()[:16]


def checkpoints_in(save_dir: Path) -> list[Path]:
    """Periodic checkpoint folders, oldest first."""
    return sorted(p for p in save_dir.glob("gen-*") if p.is_dir())


def find_resume(resume: str, save_dir: Path) -> list[Path]:
    """Checkpoints to try, best first: --resume PATH (a checkpoint, or a save_dir's newest) or
    auto (the newest in save_dir, then older ones should it be unreadable). Newest means the
    highest generation, not LATEST: a kill between a checkpoint's rename and LATEST's leaves
    LATEST one save behind, and that complete checkpoint must not be skipped."""
    if resume == "auto":
        return checkpoints_in(save_dir)[::-1]
    path = Path(resume).expanduser()
    if checkpoints_in(path):
        path = checkpoints_in(path)[-1]
    if not (path / "meta.json").exists():
        raise UserError(f"--resume {resume}: no checkpoint there (a folder with meta.json, or a save_dir)")
    return [path]


def set_aside(folder: Path) -> Path | None:
    """Rename an unreadable checkpoint folder to corrupt-NAME (corrupt-NAME-2, ... if taken): kept
    for inspection, never deleted, and out of the way of the save that will reuse its name.
    None if there is no such folder or it cannot be renamed."""
    for k in range(1, 1000):
        target = folder.with_name(f"corrupt-{folder.name}" + (f"-{k}" if k > 1 else ""))
        if not target.exists():
            break
    try:
        folder.rename(target)
    except OSError:
        return None
    return target


def writable_folder(folder: Path, what: str) -> None:
    """Create `folder` and write a file in it, or refuse with one line: cannot write WHAT FOLDER."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / ".write-test", b"")
        (folder / ".write-test").unlink()
    except OSError as error:
        raise UserError(f"cannot write {what} {folder}: {error.strerror}") from None


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return pid > 0
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True


class Checkpointer:
    """Saves every --save_every generations, keeps the last --keep_checkpoints plus the best by
    validation bits/byte, and points LATEST and BEST at them. Only the writer (process 0) touches
    the disk; every process takes part in copying the arrays to the host."""

    def __init__(self, save_dir: Path, args: Args, training: dict | None = None, writer: bool = True):
        self.dir, self.args, self.writer = save_dir, args, writer
        self.training = training  # training_identity of the run, compared on resume
        self.best = math.inf

    def check_writable(self) -> None:
        """Fail early on an unwritable save_dir; remove what a killed save left half-written."""
        writable_folder(self.dir, "checkpoints to --save_dir")
        for path in self.dir.glob(".*"):
            pid = leftover_of(path)
            if pid is not None and not process_alive(pid):
                shutil.rmtree(path) if path.is_dir() else path.unlink()

    def write(
        self, name: str, arrays: tuple, generation: int, val_bpb: float, extra: dict, pointer: str
    ) -> Path:
        """Save (params, opt, states) as the folder `name` and point `pointer` (LATEST, BEST) at it."""
        folder = self.dir / name
        if self.writer:
            meta = {
                "format": CHECKPOINT_FORMAT,
                "generation": generation,
                "val_bits_per_byte": val_bpb,
                "best_val_bits_per_byte": self.best,
                "args": dataclasses.asdict(self.args),
                "training": self.training,
                **extra,
            }
            save_checkpoint(folder, *arrays, meta)
            write_atomic(self.dir / pointer, name.encode())
        return folder

    def save(self, generation: int, arrays: tuple, val_bpb: float, extra: dict) -> Path:
        """A periodic checkpoint of every replica (arrays with the replica axis; one model's alone
        is stored without it), the oldest beyond --keep_checkpoints removed."""
        if self.args.replicas == 1:
            arrays = jax.tree.map(lambda x: x[0], arrays)
        folder = self.write(f"gen-{generation:08d}", arrays, generation, val_bpb, extra, "LATEST")
        if self.writer:
            for old in checkpoints_in(self.dir)[: -self.args.keep_checkpoints]:
                remove_checkpoint(old)
        return folder

    def offer_best(self, generation: int, model: tuple, val_bpb: float, extra: dict) -> None:
        """Keep one model (params, opt, states without the replica axis) if its validation score
        is the best so far: the best replica's, as a single run's checkpoint, `extra` saying which."""
        if not val_bpb < self.best:
            return
        self.best = val_bpb
        folder = self.write(
            f"best-{val_bpb:.4f}-gen-{generation:08d}", model, generation, val_bpb, extra, "BEST"
        )
        if self.writer:
            for old in self.dir.glob("best-*"):
                if old != folder and old.is_dir():
                    remove_checkpoint(old)


class Resumed(NamedTuple):
    params: dict
    opt: dict  # the update rule's state
    states: np.ndarray
    generation: int
    best: float  # best validation bits/byte so far
    folder: Path
    changes: dict  # training_changes accepted with --allow_changes (empty otherwise)
    settings: list[dict] | None  # the replicas' settings as PBT left them (None: from the flags)


def resume_from(args: Args, save_dir: Path, cfg: Config, identity: dict, writer: bool) -> Resumed | None:
    """The checkpoint to continue from, or None for a fresh run. Reads only, except that the writer
    sets aside a checkpoint that --resume auto found unreadable and points LATEST at the one used."""
    if not args.resume:
        if checkpoints_in(save_dir) or (save_dir / "LATEST").exists():
            raise UserError(
                f"{save_dir} already holds checkpoints: continue them with --resume auto, "
                "or start another run with --run_name or --save_dir"
            )
        return None
    candidates = find_resume(args.resume, save_dir)
    for i, folder in enumerate(candidates):
        try:
            params, states, opt, meta = load_checkpoint(folder, cfg)
        except UnreadableCheckpoint as error:
            if args.resume != "auto" or i == len(candidates) - 1:
                raise
            aside = set_aside(folder) if writer else None
            moved = f"; set aside as {aside.name}" if aside else ""
            print(f"warning: checkpoint {folder} is unreadable ({error.reason}){moved}; trying an older one")
            continue
        check_not_removed(meta, folder)
        changes = training_changes(meta, identity)
        if changes and not args.allow_changes:
            raise UserError(
                f"--resume: {folder} was trained with other settings: {describe_changes(changes)}; "
                "give the checkpoint's values, or --allow_changes to continue with these"
            )
        if states is None or opt is None:
            _, fresh_opt, fresh_states = init_run(cfg, [s["seed"] for s in replica_settings(args)])
        if states is None:
            print(
                f"warning: {folder} was trained with another population layout: hidden states restart at zero"
            )
            states = fresh_states
        if opt is None:
            print(f"warning: {folder} holds no --optimizer {cfg.optimizer} state: it starts afresh")
            opt = fresh_opt
        if writer and i > 0:
            write_atomic(save_dir / "LATEST", folder.name.encode())
        best = meta.get("best_val_bits_per_byte", math.inf)
        # the checkpoint's settings, as PBT left them, unless --allow_changes accepted new ones
        replica_flags = ("seed", *REPLICA_SETTINGS, *(f"replica_{name}" for name in REPLICA_SETTINGS))
        settings = None if any(k in changes for k in replica_flags) else meta.get("replica_settings")
        return Resumed(params, opt, states, meta["generation"], best, folder, changes, settings)
    print(f"--resume auto: no checkpoint in {save_dir} yet, starting a new run")
    return None


# ------------------------------------------------------------------------------------------------
# Replicas and population-based training. Each replica's settings are a dict (seed, alpha,
# alpha_decay_timestep, sigma_shift); its arrays are index k of the replica axis.

# Population-based training: explore moves each copied setting one step, by one of these factors
# (alpha > 1, a schedule: its excess over 1; alpha <= 1, a fixed share: itself, at most 1) or by
# one shift (sigma_shift, within its range). A shift halves or doubles the noise, a far larger step
# than the factors: it is taken half the time, else the copy keeps the winner's (SIGMA_STEPS).
PBT_FACTORS = (0.8, 1.25)
SIGMA_STEPS = (-1, 0, 0, 1)


def explore(setting: dict, rng: np.random.Generator) -> dict:
    """A copied replica's settings, each moved one random step (PBT_FACTORS, SIGMA_STEPS)."""
    f_alpha, f_decay = rng.choice(PBT_FACTORS, 2)
    alpha = setting["alpha"]
    alpha = min(alpha * f_alpha, 1.0) if alpha <= 1 else 1 + (alpha - 1) * f_alpha
    sigma_facts = flag_facts()["sigma_shift"]
    sigma_shift = int(
        np.clip(setting["sigma_shift"] + rng.choice(SIGMA_STEPS), sigma_facts.low, sigma_facts.high)
    )
    decay = max(1, round(setting["alpha_decay_timestep"] * f_decay))
    return {
        **setting,
        "alpha": round(float(alpha), 4),
        "alpha_decay_timestep": decay,
        "sigma_shift": sigma_shift,
    }


def pbt_step(scores: list[float], settings: list[dict], seed: int, generation: int):
    """Exploit and explore: the worst quarter of the replicas by validation bits/byte (ties: the
    higher index is worse) each copies one of the best quarter (the worst the best, the second
    worst the second best, ...) and moves the copied settings (explore, from an RNG seeded by
    --seed and the generation, so a resumed run draws the same); each keeps its own seed, so no two
    replicas ever share their noise. Returns (the replica each replica's model now comes from,
    the new settings, the lineage: who copied whom, old -> new settings)."""
    order = sorted(range(len(scores)), key=lambda k: (scores[k], k))
    quarter = len(scores) // 4
    rng = np.random.default_rng([seed, generation])
    source, new, lineage = np.arange(len(scores), dtype=np.int32), list(settings), []
    for loser, winner in zip(order[::-1][:quarter], order[:quarter], strict=True):
        source[loser] = winner
        new[loser] = {**explore(settings[winner], rng), "seed": settings[loser]["seed"]}
        lineage.append({"replica": loser, "copied": winner, "old": settings[loser], "new": new[loser]})
    return source, new, lineage


@partial(jax.jit, donate_argnums=0)
def copy_replicas(trees, source):
    """Every replica's arrays replaced by those of replica source[k] (itself, or whom it copies)."""
    return jax.tree.map(lambda x: jnp.take(x, source, axis=0), trees)


def settings_text(setting: dict) -> str:
    return ", ".join(f"{name} {setting[name]:g}" for name in REPLICA_SETTINGS)


def describe_lineage(lineage: list[dict]) -> str:
    return "; ".join(
        f"replica {x['replica']} copies {x['copied']} "
        f"({settings_text(x['old'])} -> {settings_text(x['new'])})"
        for x in lineage
    )


def describe_spread(scores: list[float]) -> str:
    """' (best of K replicas, median M, worst W)', or nothing for a single run."""
    if len(scores) == 1:
        return ""
    return (
        f" (best of {len(scores)} replicas, median {statistics.median(scores):.2f}, worst {max(scores):.2f})"
    )


def replica_metrics(per_replica: list[dict], settings: list[dict], summary: bool = True) -> dict:
    """A single run's metrics as they are; with replicas, each replica's as replica/K/NAME with its
    settings (a series of its own in W&B), and with `summary` the best replica's bits/byte under
    the plain names (what sweeps and the progress bar read)."""
    if len(per_replica) == 1:
        return per_replica[0]
    out = {}
    for k, (values, setting) in enumerate(zip(per_replica, settings, strict=True)):
        out.update({f"replica/{k}/{name}": v for name, v in values.items()})
        out.update({f"replica/{k}/{name}": setting[name] for name in REPLICA_SETTINGS})
    if summary:
        out.update(
            {
                name: min(x[name] for x in per_replica)
                for name in per_replica[0]
                if name.endswith("bits_per_byte")
            }
        )
    return out


def replica_meta(settings: list[dict], scores: list[float], leader: int) -> dict:
    """What a checkpoint records of the replicas besides their arrays (nothing for a single run)."""
    if len(settings) == 1:
        return {}
    return {"replica_settings": settings, "replica_val_bits_per_byte": scores, "best_replica": leader}


def replica_of(tree, k: int):
    """Replica k's arrays: one model's, without the replica axis."""
    return jax.tree.map(lambda x: x[k], tree)


@cache
def schedule(args: Args, cfg: Config, alpha: float, decay_timestep: int) -> tuple[np.ndarray, np.ndarray]:
    """(share allowed to move, thresholds) at every generation of --num_epochs for a replica with
    this alpha and decay timestep (computed once per pair: PBT moves them)."""
    alone = single_run(args, alpha=alpha, alpha_decay_timestep=decay_timestep)
    return alpha_schedule(alone), z_thresholds(alone, cfg)


def replica_inputs(args: Args, cfg: Config, settings: list[dict], generation: int) -> tuple:
    """The step's per-replica arguments at a generation: thresholds (K, 2), seeds (K,) and
    sigma_shifts (K,), int32."""
    thresholds = [schedule(args, cfg, s["alpha"], s["alpha_decay_timestep"])[1][generation] for s in settings]
    seeds, sigma_shifts = (
        np.array([s[name] for s in settings], np.int32) for name in ("seed", "sigma_shift")
    )
    return np.stack(thresholds), seeds, sigma_shifts


# ------------------------------------------------------------------------------------------------
# Sampling: text from one model's noise-free integer logits.


def sampling_probabilities(logits, generated, temperature: float, min_p: float, penalty: float):
    """Next-byte probabilities from the model's int8 logits (log2-probabilities at LOGIT_FRAC):
    `penalty` bits off every byte already generated, divided by the temperature, then bytes
    below min_p times the most likely one dropped. Temperature 0 is greedy decoding."""
    bits = np.asarray(logits, np.float64) / 2**LOGIT_FRAC - penalty * np.asarray(generated, np.float64)
    if temperature <= 0:
        return (np.arange(VOCAB) == np.argmax(bits)).astype(np.float64)
    weights = np.exp2((bits - bits.max()) / temperature)
    weights[weights < min_p] = 0.0  # the most likely byte has weight exactly 1
    return weights / weights.sum()


@cache
def make_sampler(cfg: Config):
    """Noise-free next-byte logits: step(params, h (L, n), byte) -> (logits (256,) int8, h)."""
    sides = make_sides(jnp.zeros((1,), i32), 1)

    def step(params, h, byte):
        h = h[:, None, None, None, None]  # (L, K, R, D, S, n) of one member
        tok = jnp.asarray(byte).reshape(1, 1, 1)
        logits, h, _ = token_logits(model_inputs(single(params), None, sides, cfg), h, tok, cfg)
        return logits.reshape(VOCAB), h.reshape(h.shape[0], -1)

    return jax.jit(step)


def sample_text(params, cfg: Config, args: Args, seed: int) -> bytes:
    """Continue --prompt by --max_new_bytes bytes (deterministic for a seed). The prompt is fed
    after a byte 0, the document separator the model saw before every document."""
    step, rng = make_sampler(cfg), np.random.default_rng(seed)
    h = jnp.zeros((cfg.n_layer, cfg.n_embd), jnp.int8)
    for byte in b"\0" + args.prompt.encode():
        logits, h = step(params, h, np.uint8(byte))
    generated, out = np.zeros(VOCAB, bool), bytearray()
    for _ in range(args.max_new_bytes):
        probs = sampling_probabilities(logits, generated, args.temperature, args.min_p, args.presence_penalty)
        byte = int(rng.choice(VOCAB, p=probs))
        out.append(byte)
        generated[byte] = True
        logits, h = step(params, h, np.uint8(byte))
    return bytes(out)


def printable(data: bytes) -> str:
    """Bytes as text, with undecodable bytes shown as \\xNN escapes."""
    return data.decode("utf-8", errors="backslashreplace")


def sample(args: Args) -> str:
    """--sample: print a continuation of --prompt by the model of --resume."""
    if not args.resume:
        raise UserError("--sample needs --resume PATH (a checkpoint folder, or a save_dir)")
    for name, facts in flag_facts().items():
        if facts.ranged():
            check_range(name, getattr(args, name))
    found = find_resume(args.resume, save_dir_of(args))
    if not found:
        raise UserError(f"--sample --resume {args.resume}: no checkpoint in {save_dir_of(args)}")
    folder = found[0]
    try:
        meta = json.loads((folder / "meta.json").read_text())
        model = meta["args"]
    except (OSError, ValueError, KeyError):
        raise UnreadableCheckpoint(folder, "no meta.json with the run's flags") from None
    replicas = 1 if "replica" in meta else model.get("replicas", 1)  # a best-* folder holds one
    model_args = single_run(
        args, n_embd=model["n_embd"], n_layer=model["n_layer"], mlp_relu=model.get("mlp_relu", True)
    )
    cfg = make_config(dataclasses.replace(model_args, replicas=replicas))
    params = load_checkpoint(folder, cfg)[0]
    chosen = 0
    if replicas > 1:
        chosen = meta.get("best_replica", 0) if args.sample_replica < 0 else args.sample_replica
        if chosen >= replicas:
            raise UserError(f"--sample_replica {chosen}: {folder} holds replicas 0 to {replicas - 1}")
        print(f"replica {chosen} of {replicas} ({settings_text(meta['replica_settings'][chosen])})")
    model = jax.tree.map(jnp.asarray, replica_of(params, chosen))
    text = args.prompt + printable(sample_text(model, make_config(model_args), args, args.seed))
    print(text)
    return text


# ------------------------------------------------------------------------------------------------
# Diagnostics: the int8 activations' and parameters' health (--log_every, --debug).


def make_probe(cfg: Config):
    """Noise-free forward of a few rows, keeping every int8 activation: probe(params, rows (R, L)
    uint8) -> {name: (R, L, ...) int8}, block activations as (R, L, n_layer, ...)."""
    sides = make_sides(jnp.zeros((1,), i32), 1)

    def probe(params, rows):
        model = model_inputs(single(params), None, sides, cfg)

        def step(h, tok):  # the rows as the distinct pairs of one replica: (R, D, S) = (1, rows, 1)
            _, h, seen = token_logits(model, h, tok.reshape(1, -1, 1), cfg, collect=True)
            return h, seen

        h = jnp.zeros((cfg.n_layer, 1, 1, rows.shape[0], 1, cfg.n_embd), jnp.int8)
        seen = jax.lax.scan(step, h, rows.T)[1]  # (L, [n_layer,] 1, 1, R, 1, width)
        out = {}
        for name, x in seen.items():
            x = x.reshape(x.shape[: x.ndim - 5] + (x.shape[-3], x.shape[-1]))  # (L, [n_layer,] R, width)
            out[name] = jnp.moveaxis(x, -2, 0)  # (R, L, [n_layer,] width)
        return out

    return jax.jit(probe)


LAYER_TENSORS = ("gate", "candidate", "state", "mlp_hidden", "residual")


def tensor_stats(values: np.ndarray) -> dict[str, float]:
    """Mean, standard deviation, entropy of the value histogram in bits (0 to 8) and the share
    saturated at +-127, of an int8 tensor."""
    values = np.asarray(values).ravel().astype(np.int64)
    counts = np.bincount(values + 128, minlength=256)
    p = counts[counts > 0] / values.size
    return {
        "mean": float(values.mean()),
        "std": float(values.std()),
        "entropy": float(-(p * np.log2(p)).sum()),
        "saturated": float(np.mean(np.abs(values) == INT8_MAX)),
    }


def diagnostics(seen: dict, params: dict, before: dict) -> dict[str, float]:
    """diag/ metrics: activation statistics per tensor and layer; per parameter the share at
    +-127 and the share that moved in the last generation (params against before)."""
    out = {}
    for name in ("embedding", "logits"):
        out.update({f"diag/{name}/{k}": v for k, v in tensor_stats(seen[name]).items()})
    for name in LAYER_TENSORS:
        for layer in range(np.shape(seen[name])[2]):
            stats = tensor_stats(np.asarray(seen[name])[:, :, layer])
            out.update({f"diag/{name}{layer}/{k}": v for k, v in stats.items()})
    for name in PARAM_NAMES:
        p = np.asarray(params[name])
        out[f"diag/param_{name}/saturated"] = float(np.mean(np.abs(p) == INT8_MAX))
        out[f"diag/param_{name}/moved"] = float(np.mean(p != np.asarray(before[name])))
    return out


def diagnostics_table(values: dict[str, float]) -> str:
    """A compact table of the diag/ metrics, coloured: red where values saturate (> 5% at +-127)
    or collapse (entropy < 2 bits), yellow at > 1% or < 4 bits, green otherwise."""
    rows = {}
    for key, value in values.items():
        _, tensor, stat = key.split("/")
        rows.setdefault(tensor, {})[stat] = value

    def colour(text, saturated, entropy):
        code = 31 if saturated > 0.05 or entropy < 2 else 33 if saturated > 0.01 or entropy < 4 else 32
        return f"\033[{code}m{text}\033[0m"

    lines = [f"{'tensor':14} {'mean':>8} {'std':>8} {'entropy':>8} {'sat%':>6} {'moved%':>7}"]
    for tensor, stats in rows.items():
        if "entropy" in stats:
            text = (
                f"{tensor:14} {stats['mean']:8.2f} {stats['std']:8.2f} {stats['entropy']:8.2f} "
                f"{100 * stats['saturated']:6.2f} {'':>7}"
            )
            lines.append(colour(text, stats["saturated"], stats["entropy"]))
        else:
            blank = f"{'':>8} " * 3
            text = f"{tensor:14} {blank}{100 * stats['saturated']:6.2f} {100 * stats['moved']:7.3f}"
            lines.append(colour(text, stats["saturated"], 8.0))
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Loop: a run is opened (every refusal before it creates anything), compiled ahead of time, then
# trained generation by generation, validating, exploiting (PBT), diagnosing, sampling, logging and
# saving on the generations the flags say.


def bits_per_byte(log2_likelihood_sum, num_tokens: int) -> float:
    return -float(log2_likelihood_sum) / (num_tokens * 2**LL_FRAC)


def logged_before(line: str, generation: int) -> bool:
    """Whether a metrics.jsonl line is a whole record of a generation <= `generation` (a kill
    while writing can leave a last line cut short)."""
    try:
        return line.endswith("\n") and json.loads(line)["generation"] <= generation
    except (ValueError, KeyError):
        return False


class RunRecord:
    """Where a run's metrics go: always one JSON line per logged generation in
    <runs_dir>/<run_name>/metrics.jsonl; with --track also Weights & Biases. Only the writer
    (process 0) records; the other processes' record is a no-op."""

    def __init__(self, args: Args, name: str, summary: dict, generation: int, writer: bool = True):
        self.lines, self.wandb, self.samples = None, None, []
        if not writer:
            return
        folder = Path(args.runs_dir) / name
        folder.mkdir(parents=True, exist_ok=True)
        config = dataclasses.asdict(args)
        write_atomic(folder / "config.json", (json.dumps(config, indent=1) + "\n").encode())
        path = folder / "metrics.jsonl"
        if path.exists() and generation:  # resumed: drop what was logged after the checkpoint
            kept = [x for x in path.read_text().splitlines(True) if logged_before(x, generation)]
            write_atomic(path, "".join(kept).encode())
        elif path.exists():  # a new run under an old name: keep the old record aside
            path.rename(path.with_name(f"metrics-{int(path.stat().st_mtime)}.jsonl"))
        self.lines = open(path, "a")
        if args.track:
            import wandb

            tags = [args.tag] if args.tag else None
            self.wandb = wandb.init(
                project=args.wandb_project, entity=args.wandb_entity, name=name, config=config, tags=tags
            )
            self.wandb.summary.update(summary)

    def log(self, metrics: dict, generation: int) -> None:
        if self.lines is None:
            return
        self.lines.write(json.dumps({"generation": generation, **metrics}) + "\n")
        self.lines.flush()
        if self.wandb is not None:
            if "samples/text" in metrics:  # every sample so far, as one table
                import wandb

                self.samples.append([generation, metrics["samples/text"]])
                metrics = {**metrics, "samples/text": wandb.Table(["generation", "text"], self.samples)}
            # PBT's lineage (a list of records) as its JSON text: W&B would read a list as a histogram
            metrics = {k: json.dumps(v) if isinstance(v, list) else v for k, v in metrics.items()}
            self.wandb.log(metrics, step=generation)

    def close(self) -> None:
        if self.lines is not None:
            self.lines.close()
        if self.wandb is not None:
            self.wandb.finish()


class StopSignal:
    """Turns SIGTERM / SIGINT into a request to save and stop after the current generation."""

    def __init__(self):
        self.received = None
        self.previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.previous[sig] = signal.signal(sig, self.handle)
        return self

    def handle(self, signum, frame):
        self.received = signum

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def stop_requested(stop: StopSignal) -> bool:
    """Whether any process received a stop signal: all processes must stop at the same generation
    (a one-byte gather per generation, only in multi-process runs)."""
    if jax.process_count() == 1:
        return stop.received is not None
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.array([stop.received is not None], np.int8))
    return bool(np.max(flags))


@contextmanager
def awaiting_jax_verdict(args: Args):
    """In a run of several processes, an error inside a generation is most often a collective whose
    peer died (gloo: "connection reset by peer"): before raising it, wait for JAX to name the lost
    process, which it does by terminating this one within --heartbeat_timeout (supervise reports
    it). An error that JAX does not follow up is raised as it was."""
    try:
        yield
    except Exception:
        if jax.process_count() > 1:
            time.sleep(args.heartbeat_timeout + 10)
        raise


class Run(NamedTuple):
    """What a training run sets up before its first generation."""

    args: Args  # as used (the CPU split settled)
    cfg: Config
    mesh: jax.sharding.Mesh
    name: str
    writer: bool  # process 0: it alone prints, logs and writes checkpoints
    train_bytes: np.ndarray
    stream: Stream
    valid_rows: np.ndarray  # (rows, L) uint8
    rows: jax.Array  # the same, padded to an even share per device, spread over the devices
    baselines: dict[str, float]
    checkpointer: Checkpointer
    resumed: Resumed | None


def open_run(args: Args) -> Run:
    """Check, join the other processes, read the data, find the checkpoint to resume: everything
    that can be refused is, before the run creates anything of its own."""
    check_args(args)
    init_distributed(args)
    mesh = population_mesh()
    if mesh.devices.flat[0].platform != "cpu":  # JAX chose an accelerator: the CPU split does not apply
        args = dataclasses.replace(args, cpu_devices=1)
    cfg = mesh_config(args, mesh)
    check_ranges(cfg)
    check_z_test(args, cfg)
    writer = jax.process_index() == 0
    name = args.run_name or default_run_name(args)
    save_dir = save_dir_of(args)
    train_bytes, valid_bytes = open_data(args)
    stream = make_stream(len(train_bytes), cfg)
    valid_rows = validation_rows(valid_bytes, args)
    identity = training_identity(args, cfg, train_bytes)
    resumed = resume_from(args, save_dir, cfg, identity, writer)
    checkpointer = Checkpointer(save_dir, args, identity, writer)
    if writer:
        checkpointer.check_writable()
        writable_folder(Path(args.runs_dir) / name, "metrics to --runs_dir")
    baselines = cached_baselines(train_bytes, valid_rows, args.dir_path)
    padding = -len(valid_rows) % (2 * mesh.size)  # rows spread evenly over the devices, in pairs
    rows = global_array(np.pad(valid_rows, ((0, padding), (0, 0))), mesh, jax.sharding.PartitionSpec(POP))
    return Run(
        args, cfg, mesh, name, writer, train_bytes, stream, valid_rows, rows, baselines, checkpointer, resumed
    )


class Progress(NamedTuple):
    """What changes as a run trains, besides the generation."""

    carry: tuple  # (params, opt, states) on the mesh, each with the replica axis
    settings: list[dict]  # each replica's (PBT moves them)
    scores: list[float]  # each replica's last validation bits/byte
    leader: int  # the best replica by that validation


def starting_point(run: Run, log) -> tuple[Progress, int]:
    """The run's starting arrays on the mesh and generation: a fresh start, or the checkpoint's."""
    resumed, cfg = run.resumed, run.cfg
    settings = replica_settings(run.args) if resumed is None or resumed.settings is None else resumed.settings
    if resumed is None:
        carry, start = init_run(cfg, [s["seed"] for s in settings]), 0
    else:
        carry, start = (resumed.params, resumed.opt, resumed.states), resumed.generation
        run.checkpointer.best = resumed.best
        log(f"resuming from {resumed.folder} at generation {start}")
        if resumed.changes:
            log(f"continuing with changed settings (--allow_changes): {describe_changes(resumed.changes)}")
    progress = Progress(on_mesh(*carry, run.mesh), settings, [math.nan] * cfg.replicas, 0)
    return progress, start


def batch_on_mesh(run: Run, generation: int) -> jax.Array:
    return global_array(batch_at(run.train_bytes, run.stream, run.cfg, generation), run.mesh, REPLICATED)


def announce(run: Run, compiled: Compiled, log) -> None:
    """The run's first lines: the model, the devices, the data, the compiled step, the baselines."""
    cfg, args = run.cfg, run.args
    replicas = f"{cfg.replicas} replicas of " if cfg.replicas > 1 else ""
    split = f" (one CPU split into {args.cpu_devices})" if args.cpu_devices > 1 else ""
    steps = f", up to {cfg.max_step} steps a move" if cfg.max_step > 1 and cfg.optimizer != "ztest" else ""
    log(
        f"egg-jax {run.name}: {replicas}{num_parameters(cfg):,} int8 parameters, population {cfg.population} "
        f"on {run.mesh.size} {jax.devices()[0].platform} device(s){split} in {jax.process_count()} "
        f"process(es), {cfg.segments} segment(s) a member ({scored_pairs(cfg):,} pairs an update){steps}, "
        f"{len(run.train_bytes):,} training bytes, {run.valid_rows.size:,} validation bytes"
    )
    log(
        f"generation step compiled in {compiled.seconds:.1f} s: {compiled.traffic:,} bytes of cross-device "
        f"traffic per generation and device, {compiled.temporaries:,.1f} MiB of temporaries"
    )
    log(f"baselines on the validation bytes, in bits/byte: {describe_baselines(run.baselines)}")


def validate(run: Run, evaluate, params) -> list[float]:
    """Noise-free validation bits/byte of each replica."""
    rows = run.valid_rows
    ll = host_copy(evaluate(params, run.rows))[:, : len(rows)]
    return [bits_per_byte(np.sum(x, dtype=np.int64), rows.shape[0] * (rows.shape[1] - 1)) for x in ll]


def snapshot(carry: tuple) -> tuple:
    """Host copies of (params, opt, states), every replica (every process takes part)."""
    return jax.tree.map(host_copy, carry)


def generation_metrics(
    run: Run, settings: list[dict], fitness, moved, generation: int, seconds: float
) -> dict:
    """train/ and perf/ metrics of a generation, from the fitness of process 0's members (K,
    members) and the moved entries (K, tensors), on the host."""
    cfg, num_params = run.cfg, num_parameters(run.cfg)
    fitness, moved = fitness.astype(np.int64), np.sum(moved, axis=1, dtype=np.int64)
    per_replica = [
        {
            "train/bits_per_byte": bits_per_byte(f.mean(), cfg.tokens),
            "train/best_bits_per_byte": bits_per_byte(f.max(), cfg.tokens),
            "train/worst_bits_per_byte": bits_per_byte(f.min(), cfg.tokens),
            "train/moved_fraction": int(m) / num_params,
            "train/alpha": float(
                schedule(run.args, cfg, s["alpha"], s["alpha_decay_timestep"])[0][generation]
            ),
        }
        for f, m, s in zip(fitness, moved, settings, strict=True)
    ]
    tokens = cfg.population * cfg.tokens * cfg.replicas
    return {
        **replica_metrics(per_replica, settings),
        "perf/tokens_per_s": tokens / seconds,
        "perf/seconds": seconds,
    }


def validation_phase(run: Run, evaluate, progress: Progress, done: int, log) -> tuple[Progress, dict]:
    """Validate every replica, keep the best model, and with PBT due, exploit and explore."""
    scores = validate(run, evaluate, progress.carry[0])
    leader = min(range(len(scores)), key=lambda k: (scores[k], k))
    settings, carry = progress.settings, progress.carry
    metrics = replica_metrics([{"val/bits_per_byte": v} for v in scores], settings)
    metrics.update({f"val/{k}_bits_per_byte": v for k, v in run.baselines.items()})
    log(
        f"generation {done}: validation {scores[leader]:.2f} bits/byte{describe_spread(scores)} "
        f"({describe_baselines(run.baselines)})"
    )
    if scores[leader] < run.checkpointer.best:
        which = {"replica": leader, "replica_setting": settings[leader]} if run.cfg.replicas > 1 else {}
        best = replica_of(snapshot(carry), leader)
        run.checkpointer.offer_best(done, best, scores[leader], which)
    if run.args.pbt_every and done % run.args.pbt_every == 0:
        source, settings, lineage = pbt_step(scores, settings, run.args.seed, done)
        carry = copy_replicas(carry, source)
        metrics["pbt/lineage"] = lineage
        log(f"generation {done}: population-based training: {describe_lineage(lineage)}")
    return Progress(carry, settings, scores, leader), metrics


def diagnostics_phase(run: Run, probe, params, before: dict, settings: list[dict], done: int, log) -> dict:
    """diag/ metrics of every replica (and with --debug their tables)."""
    per_replica = []
    for k in range(run.cfg.replicas):
        model = replica_of(params, k)
        seen = jax.tree.map(host_copy, probe(model, run.valid_rows[:16, :65]))
        per_replica.append(diagnostics(seen, jax.tree.map(host_copy, model), replica_of(before, k)))
        if run.args.debug:
            who = f" replica {k}" if run.cfg.replicas > 1 else ""
            log(f"generation {done}{who} diagnostics:\n{diagnostics_table(per_replica[-1])}")
    return replica_metrics(per_replica, settings, summary=False)


def due(every: int, done: int) -> bool:
    return bool(every) and done % every == 0


def save_progress(run: Run, progress: Progress, done: int) -> Path:
    """A periodic checkpoint of every replica, with their settings and last validations."""
    scores, leader = progress.scores, progress.leader
    return run.checkpointer.save(
        done, snapshot(progress.carry), scores[leader], replica_meta(progress.settings, scores, leader)
    )


def progress_postfix(metrics: dict, progress: Progress) -> dict:
    """The progress bar's train and validation bits/byte and tokens/s."""
    scores, leader = progress.scores, progress.leader
    val = f"{scores[leader]:.3f}"
    if len(scores) > 1:
        val += f" (replica {leader}, median {statistics.median(scores):.3f})"
    return dict(
        train=f"{metrics['train/bits_per_byte']:.3f}", val=val, tok_s=f"{metrics['perf/tokens_per_s']:,.0f}"
    )


def finish(run: Run, progress: Progress, metrics: dict, timed: list[float], stopped: bool, log) -> dict:
    """The run's last lines; the last metrics with the parameters (every replica's) on the host.
    `stopped`: the run ended early because a process received a stop signal (every process agrees)."""
    cfg = run.cfg
    if timed:
        rate = cfg.population * cfg.tokens * cfg.replicas * len(timed) / sum(timed)
        log(f"mean training throughput {rate:,.0f} tokens/s (first generation, which compiles, excluded)")
    scores, leader = progress.scores, progress.leader
    if not stopped:
        which = ""
        if cfg.replicas > 1:
            which = f" (replica {leader} of {cfg.replicas}, {settings_text(progress.settings[leader])})"
            which += describe_spread(scores)
        log(f"validation bits/byte {scores[leader]:.4f} after {run.args.num_epochs} generations{which}")
    return {**metrics, "params": jax.tree.map(host_copy, progress.carry[0])}


def train_generation(
    run: Run, compiled: Compiled, programs: tuple, progress: Progress, generation: int, stop, log
):
    """One generation, and on the generations the flags say, what follows it: validation (and PBT),
    diagnostics, a sample, the record's line, a checkpoint. Returns the progress, the metrics, the
    seconds the step took and whether a stop signal ends the run here."""
    args, cfg, done = run.args, run.cfg, generation + 1
    evaluate, probe, record = programs
    tick = time.time()
    before = (
        jax.tree.map(host_copy, progress.carry[0]) if due(args.log_every or 10 * args.debug, done) else None
    )
    *carry, fitness, moved = compiled.step(
        *progress.carry,
        batch_on_mesh(run, generation),
        np.int32(generation),
        *replica_inputs(args, cfg, progress.settings, generation),
    )
    fitness, moved = local_copy(fitness, axis=1), host_copy(moved)  # process 0's members: logging only
    progress, seconds = progress._replace(carry=tuple(carry)), time.time() - tick
    metrics = generation_metrics(run, progress.settings, fitness, moved, generation, seconds)
    last = done == args.num_epochs
    if last or due(args.validate_every, done) or due(args.pbt_every, done):
        progress, found = validation_phase(run, evaluate, progress, done, log)
        metrics.update(found)
    if before is not None:
        metrics.update(diagnostics_phase(run, probe, progress.carry[0], before, progress.settings, done, log))
    if due(args.sample_every, done):
        model = replica_of(progress.carry[0], progress.leader)
        metrics["samples/text"] = text = printable(sample_text(model, cfg, args, args.seed + done))
        log(f"generation {done} sample: {args.prompt}{text}")
    record.log(metrics, done)
    stopping = stop_requested(stop)
    if last or stopping or due(args.save_every, done):
        folder = save_progress(run, progress, done)
        if stopping:  # every process says so: they all stop after the same generation
            print(f"process {jax.process_index()} stopped by signal after generation {done}: saved {folder}")
    return progress, metrics, seconds, stopping


def train(args: Args) -> dict:
    """Train up to --num_epochs generations; return the last metrics (and the parameters)."""
    from tqdm import tqdm

    started = time.time()
    run = open_run(args)
    args, cfg = run.args, run.cfg
    log = tqdm.write if run.writer else (lambda *a, **k: None)  # above the progress bar, not inside it
    progress, start = starting_point(run, log)
    if start >= args.num_epochs:
        log(f"nothing to do: the checkpoint is at generation {start}, --num_epochs is {args.num_epochs}")
        return {"params": jax.tree.map(host_copy, progress.carry[0])}
    inputs = replica_inputs(args, cfg, progress.settings, start)
    compiled = compile_generation(cfg, run.mesh, "train", progress.carry, batch_on_mesh(run, start), inputs)
    announce(run, compiled, log)
    summary = {f"baseline/{k}": v for k, v in run.baselines.items()}
    record = RunRecord(args, run.name, summary, start, run.writer)
    if run.resumed is not None and run.resumed.changes:
        record.log({"resume/changed": describe_changes(run.resumed.changes)}, start)
    evaluate, probe = make_evaluate(cfg, run.mesh), make_probe(cfg)  # compiled on first use
    timed, metrics, stopping = [], {}, False
    generations = range(start, args.num_epochs)
    bar = tqdm(generations, initial=start, total=args.num_epochs, dynamic_ncols=True, disable=not run.writer)
    with StopSignal() as stop:
        for generation in bar:
            with awaiting_jax_verdict(args):
                progress, metrics, seconds, stopping = train_generation(
                    run, compiled, (evaluate, probe, record), progress, generation, stop, log
                )
            if generation == start:
                log(f"first generation done {time.time() - started:.1f} s after start")
            else:
                timed.append(seconds)
            if stopping:
                break
            bar.set_postfix(progress_postfix(metrics, progress))
    bar.close()
    record.close()
    last = finish(run, progress, metrics, timed, stopping, log)
    if stop.received == signal.SIGINT:  # this process was interrupted: the shell's code for Ctrl-C
        raise SystemExit(130)
    return last


# ------------------------------------------------------------------------------------------------
# Benchmark: generations of each kind timed side by side on random bytes, one table.


def peak_rss() -> float:
    """This process's peak resident set size, GiB."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def peak_memory() -> tuple[float, str]:
    """Peak device memory on an accelerator, else the process's peak resident set size: (GiB, what)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"] / 2**30, "device memory"
    return peak_rss(), "RSS"


# A bare JAX process: import jax, one jitted int8 dot. Its peak RSS is the floor under any JAX
# program's on the same machine (0.3 GiB to 0.6 GiB seen, by CPU and JAX build). On Linux its own
# image's peak (VmHWM, KiB): ru_maxrss would also count the resident memory of the process that
# started it (6.9 GiB once, under a test process that held that much)
BARE_JAX = """
import resource, jax, jax.numpy as jnp
x = jnp.ones((64, 64), jnp.int8)
jax.jit(lambda a: jnp.dot(a, a, preferred_element_type=jnp.int32))(x).block_until_ready()
try:
    print(next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")))
except (OSError, StopIteration):
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def host_memory_left() -> float:
    """Bytes the host can still give (MemAvailable of /proc/meminfo; infinite where it is unknown)."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return math.inf
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:")), math.inf)


def memory_left(mesh) -> tuple[float, int]:
    """(bytes free, devices sharing them) for a compiled program's temporaries: on an accelerator one
    device's (its allocator's limit less what it holds), on the CPU the host's for all of them."""
    stats = mesh.devices.flat[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0), 1
    return host_memory_left(), len(mesh.local_devices)


def bare_jax_rss() -> float:
    """Peak RSS (GiB) of a bare JAX process on this machine and platform (nan if it fails)."""
    import subprocess

    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")  # beside us on a GPU
    if jax.config.jax_platforms:
        env["JAX_PLATFORMS"] = jax.config.jax_platforms
    result = subprocess.run([sys.executable, "-c", BARE_JAX], env=env, capture_output=True, text=True)
    words = result.stdout.split()
    return int(words[-1]) / 2**20 if result.returncode == 0 and words else math.nan


BENCHMARK_SECONDS = 240.0  # what --benchmark without --num_epochs aims to take, start-up aside
# members per device of two short full-rank runs that estimate (d)'s cost: it grows faster than
# the population (at 256D-6L: 0.05 s a member at 16, 0.08 at 64, 0.11 at 256), so it is extrapolated
# with the growth measured between the two
FULL_RANK_PROBES = (16, 64)


@dataclass
class Kind:
    """One kind of generation --benchmark times: its compiled step and what it measured."""

    label: str  # "a training", ...: its letter names it in the ratios
    cfg: Config
    compiled: Compiled
    batch: jax.Array
    inputs: tuple  # the step's per-replica arguments
    carry: tuple  # (params, opt, states), donated and returned by every generation
    seconds: list[float]  # the timed generations'
    first: float = 0.0  # seconds of its first generation, after compiling
    memory: float = 0.0  # peak memory after its first generation, GiB


def time_generation(kind: Kind, generation: int) -> float:
    tick = time.time()
    *carry, _, _ = jax.block_until_ready(
        kind.compiled.step(*kind.carry, kind.batch, np.int32(generation), *kind.inputs)
    )
    kind.carry = tuple(carry)
    kind.seconds.append(time.time() - tick)
    return kind.seconds[-1]


def prepare_kind(
    label: str, kind_args: Args, part: str, mesh, rng, notes: list, check_room=False
) -> Kind | None:
    """Compile one kind ahead of time and run its first generation. With `check_room`: None (and a
    note) where its temporaries would not fit in the memory left (memory_left; full-rank ES at the
    default model: every device builds all of its noise)."""
    cfg = mesh_config(kind_args, mesh)
    settings = replica_settings(kind_args)
    carry = on_mesh(*init_run(cfg, [s["seed"] for s in settings]), mesh)
    batch = rng.integers(0, 256, (cfg.population // cfg.group_size, cfg.tokens + 1), dtype=np.uint8)
    batch = global_array(batch, mesh, REPLICATED)
    inputs = replica_inputs(dataclasses.replace(kind_args, num_epochs=1), cfg, settings, 0)
    compiled = compile_generation(cfg, mesh, part, carry, batch, inputs)
    left, sharing = memory_left(mesh) if check_room else (math.inf, 1)
    if (need := compiled.temporaries * 2**20 * sharing) > left:
        notes.append(
            f"{label} skipped: its compiled program needs {need / 2**30:.1f} GiB of temporaries on "
            f"{sharing} device(s), more than the {left / 2**30:.1f} GiB free"
        )
        return None
    kind = Kind(label, cfg, compiled, batch, inputs, carry, [])
    kind.first = time_generation(kind, 0)
    kind.seconds.clear()
    kind.memory = peak_memory()[0]
    return kind


def plan_rounds(
    args: Args, kinds: list[Kind], mesh, rng, budget: float, left: float, notes: list
) -> tuple[int, int]:
    """(timed generations of a, b, c (and e), of d) that fit in `left` of `budget` seconds: d's cost
    estimated from two short full-rank runs (FULL_RANK_PROBES), d given at most half of the time."""
    full_rank = dataclasses.replace(args, rank=0)
    probed = {}  # population: seconds per generation
    unit = 2 * max(args.cpu_devices, 1)  # a probe's members split over the CPU's devices like the run's
    probes = {min(-(-m // unit) * unit, args.parallel_generations_per_gpu) for m in FULL_RANK_PROBES}
    tick = time.time()
    for members in sorted(probes):
        probe_args = dataclasses.replace(
            full_rank, parallel_generations_per_gpu=members, group_size=2, num_perturbations=0
        )
        probe = prepare_kind("probe", probe_args, "train", mesh, rng, notes)
        probed[probe.cfg.population] = time_generation(probe, 1)
        del probe  # its buffers
    (small, t_small), (large, t_large) = list(probed.items())[0], list(probed.items())[-1]
    growth = max(1.0, math.log(t_large / t_small) / math.log(large / small)) if large > small else 1.0
    cfg = kinds[0].cfg
    estimate = t_large * (cfg.population / large) ** growth * cfg.replicas
    left -= time.time() - tick
    full_rank_rounds = min(args.num_epochs, int(left / 2 / estimate) - 1)
    if full_rank_rounds < 1:
        notes.append(
            f"d full-rank ES skipped: one generation is estimated at {estimate:,.0f} s (measured at "
            f"population {' and '.join(map(str, probed))}, extrapolated to {cfg.population}); it needs "
            f"a first and a timed one, more than half of the {left:.0f} s left; give --num_epochs to "
            "run it"
        )
    left -= max(full_rank_rounds + 1, 0) * estimate
    rounds = max(3, min(args.num_epochs, int(left / sum(kind.first for kind in kinds))))
    notes.append(
        f"no --num_epochs: timed {rounds} generation(s) of {', '.join(k.label[0] for k in kinds)}"
        + (f" and {full_rank_rounds} of d" if full_rank_rounds >= 1 else "")
        + f", what fits in about {budget:.0f} s; give --num_epochs N to time N of each"
    )
    return rounds, full_rank_rounds


def print_benchmark(
    args: Args, kinds: list[Kind], rounds: int, bare: float, notes: list, mesh
) -> dict[str, float]:
    """The table, the ratios and the notes; returns the tokens/s of each kind timed, by letter."""
    device, memory_kind = jax.devices()[0], peak_memory()[1]
    cfg = kinds[0].cfg
    model = f"model {args.n_embd}D-{args.n_layer}L ({num_parameters(cfg):,} parameters)"
    members = f"population {cfg.population}, {args.tokens_per_update} tokens per member, rank {args.rank}"
    members = f"{cfg.replicas} replicas, each {members}" if cfg.replicas > 1 else members
    turns = [k.label[0] for k in kinds if not k.label.startswith("d")]
    timed = f"median of {rounds} generations each ({', '.join(turns)} taking turns)"
    split = f" (one CPU split into {args.cpu_devices})" if args.cpu_devices > 1 else ""
    print(
        f"device: {mesh.size} x {device.platform} ({device.device_kind}){split}; {model}; {members}; {timed}"
    )
    memory_header = f"peak {memory_kind} GiB"
    print(
        f"{'':18} {'tokens/s':>12} {'s/generation':>13} {'compile s':>10} {memory_header:>18} {'temp MiB':>9}"
    )
    rate = {}
    for kind in kinds:
        seconds = float(np.median(kind.seconds))
        rate[kind.label[0]] = kind.cfg.population * kind.cfg.replicas * kind.cfg.tokens / seconds
        print(
            f"{kind.label:18} {rate[kind.label[0]]:12,.0f} {seconds:13.4f} {kind.compiled.seconds:10.1f} "
            f"{kind.memory:18.2f} {kind.compiled.temporaries:9,.1f}"
        )
    versus = f"low-rank / full-rank ES (a/d): {rate['a'] / rate['d']:.1f}x; " if "d" in rate else ""
    print(
        f"training / inference (a/c): {rate['a'] / rate['c']:.1%}; {versus}update share of a generation: "
        f"{1 - rate['a'] / rate['b']:.1%}; peak {memory_kind} of training {kinds[0].memory:.2f} GiB (memory "
        "column: the process's peak so far; temp: the compiled program's own temporaries)"
    )
    print(
        f"peak RSS: this process {peak_rss():.2f} GiB, a bare JAX process on this machine (import, one "
        f"jitted int8 dot) {bare:.2f} GiB"
    )
    if "e" in rate:
        print(
            f"{cfg.replicas} replicas of population {cfg.population} / one run of "
            f"{cfg.replicas * cfg.population} (a/e): {rate['a'] / rate['e']:.1%}"
        )
    for note in notes:
        print(f"note: {note}")
    return rate


def benchmark(args: Args, budget: float | None = None) -> dict[str, float]:
    """Time generations of each kind on random bytes and print one table: (a) training, (b)
    fitness only, (c) noise-free inference of the same members and tokens, (d) naive full-rank ES
    (--rank 0) on the same model, and with replicas (e) one run of as many members. Each is compiled
    and run once first; then a, b, c (and e) take turns, one generation each, so that a slow spell
    of the machine hits them alike, and d runs alone, last (its large buffers, allocated and freed,
    slow whatever follows). Without `budget`: --num_epochs timed generations of every kind. With
    `budget` (seconds; main gives BENCHMARK_SECONDS when --num_epochs is not on the command line):
    as many as fit, at least 3, and d only if its cost fits (plan_rounds); what is shortened or
    skipped is printed with the reason. Peak memory is read after each kind's first generation,
    and the compiled program's temporaries beside it. Returns the tokens/s of each kind timed."""
    check_args(args)
    started = time.time()
    mesh = population_mesh()
    if mesh.devices.flat[0].platform != "cpu":  # JAX chose an accelerator: the CPU split does not apply
        args = dataclasses.replace(args, cpu_devices=1)
    rng = np.random.default_rng(args.seed)
    bare = bare_jax_rss()
    notes = []
    kinds = [
        prepare_kind("a training", args, "train", mesh, rng, notes),
        prepare_kind("b fitness only", args, "fitness", mesh, rng, notes),
        prepare_kind("c inference", args, "inference", mesh, rng, notes),
    ]
    if args.replicas > 1:  # the same members as one run: K x P, beside the K replicas of P
        whole = single_run(
            args, parallel_generations_per_gpu=args.parallel_generations_per_gpu * args.replicas
        )
        kinds.append(
            prepare_kind(
                f"e one run of {make_config(whole, mesh.size).population}", whole, "train", mesh, rng, notes
            )
        )
    rounds, full_rank_rounds = args.num_epochs, args.num_epochs
    if budget is not None:
        left = budget - (time.time() - started)
        rounds, full_rank_rounds = plan_rounds(args, kinds, mesh, rng, budget, left, notes)
    turns = list(kinds)
    if full_rank_rounds >= 1:
        full = prepare_kind(
            "d full-rank ES", dataclasses.replace(args, rank=0), "train", mesh, rng, notes, check_room=True
        )
        kinds += [full] if full else []
    for group, count in ((turns, rounds), (kinds[len(turns) :], full_rank_rounds)):
        for generation in range(1, 1 + count):
            for kind in group:
                time_generation(kind, generation)
    return print_benchmark(args, kinds, rounds, bare, notes, mesh)


# ------------------------------------------------------------------------------------------------
# GPU target: the program a GPU would run, compiled here without one ("deviceless": XLA's whole
# GPU pipeline on a topology read from targets/, no autotuning, nothing timed), its kernels read
# from the compiled HLO and costed by a stated model.

TARGET_FILES = {"h100": "targets/h100_sxm.txtpb"}  # GpuTargetConfigProto text, beside run.py


class Roofline(NamedTuple):
    """The cost model's device. A kernel costs max(its bytes / hbm, its MACs / int8_macs) + launch:
    HBM and tensor cores overlap, caches and on-chip reuse are ignored, and every kernel pays one
    launch (XLA's command buffers can hide some of it on a real GPU)."""

    name: str
    hbm: float  # bytes/s of device memory
    int8_macs: float  # dense int8 multiply-accumulates/s on the tensor cores
    launch: float  # seconds a kernel costs beyond its work (launch and tail), an assumption


# the H100 SXM's datasheet: 3.35 TB/s of HBM3, 1,979 dense int8 tera-operations/s (2 per MAC); 3 us a
# kernel is the order of back-to-back small kernels on any recent GPU
ROOFLINES = {"h100": Roofline("H100 SXM", 3.35e12, 1979e12 / 2, 3e-6)}


def target_mesh(target: str, devices: int) -> jax.sharding.Mesh:
    """A mesh of `devices` GPUs of the target, for compiling only (nothing can run on it)."""
    from jax.experimental import topologies

    text = (Path(__file__).resolve().parent / TARGET_FILES[target]).read_text()
    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=text, topology=f"1x1x{devices}"
        )
    except Exception as error:  # JAX without its CUDA plugin (jax[cuda12]): no GPU compiler here
        raise UserError(
            f"--target {target}: JAX cannot compile for it here ({str(error).splitlines()[0]})"
        ) from None
    return jax.sharding.Mesh(np.array(topology.devices), (POP,))


def abstract_inputs(args: Args, cfg: Config, mesh) -> tuple:
    """The generation step's arguments as shapes with their shardings on the mesh (no arrays)."""
    settings = replica_settings(args)
    carry = jax.eval_shape(lambda: init_run(cfg, [s["seed"] for s in settings]))
    everywhere, spread = (jax.sharding.NamedSharding(mesh, spec) for spec in (REPLICATED, SPREAD))

    def shaped(x, sharding=everywhere):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    params, opt, states = carry
    batch = jax.ShapeDtypeStruct(
        (cfg.population // cfg.group_size, cfg.tokens + 1), jnp.uint8, sharding=everywhere
    )
    inputs = replica_inputs(dataclasses.replace(args, num_epochs=1), cfg, settings, 0)
    generation = jax.ShapeDtypeStruct((), jnp.int32, sharding=everywhere)
    return (
        *jax.tree.map(shaped, (params, opt)),
        shaped(states, spread),
        batch,
        generation,
        *map(shaped, inputs),
    )


class Kernel(NamedTuple):
    """One kernel of a compiled GPU program, as its HLO shows it."""

    name: str
    kind: str  # "gemm" (a dot), "fusion", "copy", "collective" or another HLO opcode
    loop: str  # the innermost named loop it runs in: "" (none), "tokens" or "layers" (named scopes)
    runs: int  # times it runs per generation: the trip counts of the loops around it
    bytes: int  # read and written per run, from its operands' and results' shapes
    macs: int  # multiply-accumulates per run (a gemm's dot)
    shapes: str  # a gemm's operands and result, e.g. "s8[1024,256] x s8[256,256] -> s32[1024,256]"


HLO_DTYPE_BYTES = {**DTYPE_BYTES, "f16": 2, "bf16": 2, "f32": 4, "f64": 8}
# opcodes that launch nothing on a GPU (bookkeeping, aliases, loop control, the second half of async pairs)
NO_KERNEL = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
    "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "copy-done",
    "all-gather-done", "all-reduce-done", "collective-permute-done", "async-done", "async-update",
}  # fmt: skip
HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")


class Instruction(NamedTuple):
    name: str
    shapes: list  # [(dtype, dims)] of its result (several for a tuple)
    opcode: str
    operands: list  # names
    attributes: str  # everything after the operands


def hlo_shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [
        (t, tuple(int(d) for d in dims.split(",") if d))
        for t, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", text)
    ]


def shape_text(shape: tuple[str, tuple[int, ...]]) -> str:
    """An HLO shape as HLO writes it: s8[1024,256]."""
    return f"{shape[0]}[{','.join(map(str, shape[1]))}]"


def hlo_bytes(shapes) -> int:
    return sum(HLO_DTYPE_BYTES.get(dtype, 4) * math.prod(dims) for dtype, dims in shapes)


def hlo_computations(hlo: str) -> tuple[dict[str, list[Instruction]], str]:
    """{computation: its instructions} of a compiled module's text, and the entry computation's name."""
    computations, current, entry = {}, None, ""
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%([\w.\-]+) \(.*\{$", line)
        if head:
            current, computations[head.group(2)] = head.group(2), []
            entry = head.group(2) if head.group(1) else entry
        elif current and (match := HLO_INSTRUCTION.match(line)):
            rest, depth, end = match.group(4), 1, 0
            while depth and end < len(rest):  # the operands end at the matching parenthesis
                depth += {"(": 1, ")": -1}.get(rest[end], 0)
                end += 1
            operands = re.findall(r"%([\w.\-]+)", rest[: end - 1])
            shapes = hlo_shapes(match.group(2))
            computations[current].append(
                Instruction(match.group(1), shapes, match.group(3), operands, rest[end:])
            )
    return computations, entry


ELEMENTWISE_VIEWS = ("convert", "bitcast", "copy")  # ops a fusion may apply before slicing a parameter


def fusion_cost(body: list[Instruction], result) -> tuple[str, int, int, str]:
    """(kind, bytes, MACs, gemm shapes) of a fused kernel: each parameter read whole, except one
    that is only sliced, maybe after a conversion (the slices' entries are read), or updated in
    place (not read); the result written, less what an in-place update leaves untouched."""
    named = {x.name: x for x in body}
    users_of = {x.name: [u for u in body if x.name in u.operands] for x in body}

    def sliced_entries(name: str) -> int | None:
        """Entries of `name` that its users read through slices, or None where one reads it whole."""
        entries = 0
        for u in users_of[name]:
            if u.operands[0] != name:
                return None
            if u.opcode in ("dynamic-slice", "slice", "gather"):
                entries += sum(math.prod(dims) for _, dims in u.shapes)
            elif u.opcode in ELEMENTWISE_VIEWS and (inner := sliced_entries(u.name)) is not None:
                entries += inner
            elif u.opcode != "dynamic-update-slice":  # an in-place update reads nothing
                return None
        return entries

    total = hlo_bytes(result)
    for parameter in (x for x in body if x.opcode == "parameter"):
        entries = sliced_entries(parameter.name) if users_of[parameter.name] else None
        if entries is None:
            total += hlo_bytes(parameter.shapes)
        else:
            total += entries * HLO_DTYPE_BYTES.get(parameter.shapes[0][0], 4)
        for u in users_of[parameter.name]:  # in place: only the update is written
            if u.opcode == "dynamic-update-slice" and entries is not None:
                total -= hlo_bytes(u.shapes) - hlo_bytes(named[u.operands[1]].shapes)
    macs, shapes = 0, ""
    for dot in (x for x in body if x.opcode == "dot"):
        lhs, rhs = (named[o].shapes[0] for o in dot.operands[:2])
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", dot.attributes).group(1)
        macs += math.prod(dot.shapes[0][1]) * math.prod(lhs[1][int(d)] for d in contracting.split(",") if d)
        shapes = f"{shape_text(lhs)} x {shape_text(rhs)} -> {shape_text(dot.shapes[0])}"
    return ("gemm" if macs else "fusion"), total, macs, shapes


def gpu_kernels(hlo: str) -> list[Kernel]:
    """Every kernel a compiled GPU program launches, with how often per call: while loops multiply
    by their known trip counts, and a loop's name comes from the named scope of its scan (a kernel
    in the "layers" scope of the token loop, where the layers are unrolled, counts as the layers')."""
    computations, entry = hlo_computations(hlo)
    found = []

    def called(x: Instruction, key: str) -> str:
        return re.search(key + r"=%([\w.\-]+)", x.attributes).group(1)

    def walk(computation: str, runs: int, loop: str) -> None:
        shapes = {x.name: x.shapes for x in computations[computation]}
        for x in computations[computation]:
            # a kernel of a layer unrolled in the token loop belongs to the layers all the same
            unrolled = loop == "tokens" and re.search(r'op_name="[^"]*/layers/', x.attributes)
            where = "layers" if unrolled else loop
            if x.opcode == "while":
                trips = int((re.search(r'"known_trip_count":\{"n":"(\d+)"', x.attributes) or [0, 1])[1])
                path = re.search(r'op_name="([^"]*)"', x.attributes)
                scope = path.group(1).rsplit("/", 2)[-2] if path else ""
                named = "layers" if "layers" in scope else "tokens" if "tokens" in scope else loop
                walk(called(x, "body"), runs * trips, named)
                walk(called(x, "condition"), runs * trips, named)
            elif x.opcode == "call":
                walk(called(x, "to_apply"), runs, loop)
            elif x.opcode == "fusion":
                kind, size, macs, gemm = fusion_cost(computations[called(x, "calls")], x.shapes)
                found.append(Kernel(x.name, kind, where, runs, size, macs, gemm))
            elif declared := re.search(rf'name = "{PRODUCT_KERNEL}_(\d+)_(\d+)"', x.attributes):
                size, macs = map(int, declared.groups())  # what product_kernel reads, writes and multiplies
                x_in, w = (shapes[o][0] for o in x.operands[1:3])  # its operands: layer, x, w, ...
                gemm = f"{shape_text(x_in)} x {shape_text(w)} -> {shape_text(x.shapes[0])}"
                found.append(Kernel(x.name, "product", where, runs, size, macs, gemm))
            elif x.opcode not in NO_KERNEL:
                kind = (
                    "collective"
                    if x.opcode.startswith(COLLECTIVE_OPS)
                    else "copy"
                    if "copy" in x.opcode
                    else x.opcode
                )
                size = hlo_bytes(x.shapes) + sum(hlo_bytes(shapes.get(o, [])) for o in x.operands)
                found.append(Kernel(x.name, kind, where, runs, size, 0, ""))

    walk(entry, 1, "")
    return found


def modeled_seconds(kernels: list[Kernel], roofline: Roofline) -> float:
    """The cost model's time of one call of the program (Roofline)."""
    return sum(
        k.runs * (max(k.bytes / roofline.hbm, k.macs / roofline.int8_macs) + roofline.launch) for k in kernels
    )


def roofline_bytes(cfg: Config) -> tuple[float, float]:
    """(training, inference) bytes a token costs each member at the least (docs/design.org's
    roofline): the weights once per device's members, every product's int8 input and output, the
    state and the residual stream (22 n a layer, 2 n + 2 x 256 around them); in training also half
    its pair's rank-r factors and its own perturbed vectors."""
    n, layers, members = cfg.n_embd, cfg.n_layer, cfg.population // cfg.devices
    weights = num_parameters(cfg) / members
    activations = 22 * n * layers + 2 * n + 2 * VOCAB
    # one pair's A and B: 4 n x n and 2 n x 4n matrices a layer; a row of the embedding's A, its B, the head's
    factors = cfg.rank * (layers * (4 * 2 * n + 2 * 5 * n) + (1 + n) + (VOCAB + n))
    vectors = (4 * layers + 1) * n
    return weights + activations + factors / 2 + vectors, weights + activations


def describe_program(kernels: list[Kernel], cfg: Config, tokens_per_call: int) -> dict:
    """What a compiled generation's kernels add up to (the figures target_report prints)."""
    members = cfg.population // cfg.devices * cfg.replicas
    in_tokens = [k for k in kernels if k.loop in ("tokens", "layers")]
    per_token = sum(k.runs for k in in_tokens) / cfg.tokens
    per_layer = sum(k.runs for k in kernels if k.loop == "layers") / (cfg.tokens * cfg.n_layer)
    kinds = {}
    for k in kernels:
        kinds[k.kind] = kinds.get(k.kind, 0) + k.runs
    return {
        "kernels": sum(k.runs for k in kernels),
        "kinds": kinds,
        "per_token": per_token,
        "per_layer": per_layer,
        "bytes_per_token_member": sum(k.runs * k.bytes for k in in_tokens) / (cfg.tokens * members),
        "tokens_per_call": tokens_per_call,
    }


@contextmanager
def without_compilation_cache():
    """JAX's persistent cache cannot load a program compiled without its device back: keep such
    programs out of it (JAX decides once whether it uses the cache; a minimum compile time no
    compilation reaches keeps the entries from being written either way)."""
    before = jax.config.jax_enable_compilation_cache, jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_enable_compilation_cache", False)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", math.inf)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])


def compile_target(args: Args, part: str):
    """(compiled program, config, compile seconds) of a generation step for --target."""
    mesh = target_mesh(args.target, args.target_devices)
    cfg = mesh_config(dataclasses.replace(args, cpu_devices=1), mesh)  # GPUs: each counts as one
    check_ranges(cfg)
    tick = time.time()
    with without_compilation_cache():
        compiled = make_generation_step(cfg, mesh, part).lower(*abstract_inputs(args, cfg, mesh)).compile()
    return compiled, cfg, time.time() - tick


def print_target_report(
    args: Args, cfg: Config, roofline: Roofline, seconds: float, kernels, figures
) -> None:
    t, i = figures["training"], figures["inference"]
    least = roofline_bytes(cfg)
    best = [roofline.hbm / b * cfg.devices for b in least]  # tokens/s where bytes alone bound
    largest = sorted(kernels, key=lambda k: -k.bytes)[:3]
    kinds = ", ".join(f"{kind} {count:,}" for kind, count in sorted(t["kinds"].items()))
    gemms = sorted({(k.shapes, k.loop or "once") for k in kernels if k.kind in ("gemm", "product")})
    lines = [
        f"target: {args.target_devices} x {roofline.name}, compiled here without a device (XLA's GPU "
        f"pipeline, untuned GEMM tiles); model {args.n_embd}D-{args.n_layer}L; population "
        f"{cfg.population}, {cfg.tokens} tokens, {cfg.segments} segment(s); compiled in {seconds:.1f} s",
        f"temporaries: {figures['temporaries']:,.1f} MiB on each GPU",
        "largest kernels by bytes: " + "; ".join(f"{k.name} {k.bytes / 2**20:,.1f} MiB" for k in largest),
        f"kernels per generation: {kinds} ({t['kernels']:,} in all)",
        f"kernels per token: {t['per_token']:.0f} "
        + (f"({t['per_layer']:.0f} in each layer)" if t["per_layer"] else "(no layer loop left)"),
        "GEMMs (XLA's and the product kernel's): "
        + "; ".join(f"{shapes} ({loop})" for shapes, loop in gemms),
        "collectives per generation: "
        + (", ".join(f"{op} {size:,} B" for op, size in figures["collectives"]) or "none (one GPU)"),
        f"bytes per token and member: {t['bytes_per_token_member']:,.0f} B (roofline {least[0]:,.0f} B); "
        f"inference {i['bytes_per_token_member']:,.0f} B (roofline {least[1]:,.0f} B)",
        f"modeled training tokens/s: {t['tokens_per_s']:,.0f} ({t['seconds'] * 1e3:,.2f} ms a generation, "
        f"modeled; {t['tokens_per_s'] / best[0]:.0%} of the roofline's {best[0]:,.0f})",
        f"modeled inference tokens/s: {i['tokens_per_s']:,.0f} ({i['seconds'] * 1e3:,.2f} ms, modeled; "
        f"roofline {best[1]:,.0f}); training / inference: {t['tokens_per_s'] / i['tokens_per_s']:.0%}",
        f"cost model: each kernel max(bytes / {roofline.hbm / 1e12:.2f} TB/s, MACs / "
        f"{roofline.int8_macs / 1e12:.0f} T MAC/s) + {roofline.launch * 1e6:.0f} us",
    ]
    print("\n".join(lines))


def target_report(args: Args) -> dict:
    """--benchmark --target: compile the training and inference steps for the target GPU(s) and
    print what the compiled programs show and what the cost model says they take. Returns the
    figures (for the tests)."""
    check_args(args)
    roofline = ROOFLINES[args.target]
    train, cfg, seconds = compile_target(args, "train")
    infer = compile_target(args, "inference")[0]
    tokens = cfg.population * cfg.tokens * cfg.replicas  # per call, over every device
    kernels = {"training": gpu_kernels(train.as_text()), "inference": gpu_kernels(infer.as_text())}
    figures = {part: describe_program(found, cfg, tokens) for part, found in kernels.items()}
    for part, found in kernels.items():
        figures[part]["seconds"] = modeled_seconds(found, roofline)
        figures[part]["tokens_per_s"] = tokens / figures[part]["seconds"]
    figures["temporaries"] = getattr(train.memory_analysis(), "temp_size_in_bytes", 0) / 2**20
    figures["collectives"] = collective_traffic(train.as_text())
    print_target_report(args, cfg, roofline, seconds, kernels["training"], figures)
    return figures | {"cfg": cfg}


# ------------------------------------------------------------------------------------------------
# Main: the platform, the CPU split and the compilation cache, set before JAX starts; then train,
# benchmark or sample.


def select_platform(platform: str) -> None:
    """--platform if given (else JAX_PLATFORMS, else JAX's choice: its accelerator, the CPU when
    none is visible)."""
    if platform:
        jax.config.update("jax_platforms", platform)
    logging.getLogger("jax._src.xla_bridge").addFilter(QuietPluginErrors())


def cpu_share_fits(args: Args, shards: int) -> bool:
    """Whether each of `shards` devices' share of --parallel_generations_per_gpu holds whole groups
    (so whole antithetic pairs) and, with --num_perturbations, whole blocks of distinct noises: what
    check_args asks of every device's members."""
    p, n = args.parallel_generations_per_gpu, args.num_perturbations
    share, g = p // shards, args.group_size
    return p > 0 and g > 0 and p % shards == 0 and share % g == 0 and (n <= 0 or share % n == 0)


def split_cpu(args: Args) -> Args:
    """Args with --cpu_devices as used (1: not split), the host's CPU split into that many JAX
    devices before JAX starts (should JAX choose an accelerator, the run sets it back to 1). XLA
    spreads each product of a single CPU device over the cores, which for this model's small int8
    products costs more than it gains (docs/design.org, "Many devices and hosts"). Not split: on another
    --platform; where XLA_FLAGS or JAX_NUM_CPU_DEVICES set the device count; in a multi-process run
    unless --cpu_devices is given (every process must split alike); with --rank 0 unless given
    (every device builds the whole full-rank noise of the update: memory times the devices). Once
    JAX runs (main() called again in one process) its CPU devices stay as the first call split them."""
    given, p, g = args.cpu_devices, args.parallel_generations_per_gpu, args.group_size
    check_range("cpu_devices", given)
    forced = "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
    forced = forced or "JAX_NUM_CPU_DEVICES" in os.environ
    elsewhere = (args.platform or os.environ.get("JAX_PLATFORMS") or "cpu") != "cpu"
    if elsewhere or forced:
        if given > 1:
            where = "XLA_FLAGS or JAX_NUM_CPU_DEVICES set the device count" if forced else "not on the CPU"
            raise UserError(f"--cpu_devices {given}: {where}; leave --cpu_devices out")
        return dataclasses.replace(args, cpu_devices=1)
    if given and not cpu_share_fits(args, given):
        raise UserError(
            f"--cpu_devices {given} must split --parallel_generations_per_gpu {p} into equal shares, "
            f"each a multiple of --group_size {g} (and of --num_perturbations, if given)"
        )
    several = args.num_procs > 1 or int(os.environ.get("SLURM_NTASKS", "1")) > 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    fits = [s for s in range(1, cores + 1) if cpu_share_fits(args, s)]
    shards = given or (1 if several or args.rank == 0 else max(fits, default=1))
    try:
        jax.config.update("jax_num_cpu_devices", shards)
    except RuntimeError:  # JAX already runs in this process
        running = len(jax.devices("cpu"))
        if given and given != running:
            raise UserError(f"--cpu_devices {given}: JAX already runs on {running} CPU device(s)") from None
        shards = running
    return dataclasses.replace(args, cpu_devices=shards)


def enable_compilation_cache(dir_path: str) -> None:
    """Keep compiled programs in <dir_path>/jax_cache (unless JAX_COMPILATION_CACHE_DIR says
    otherwise), so a second run of the same configuration starts without compiling."""
    if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", str(Path(dir_path) / "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


EXIT_PROCESS_LOST = 75  # EX_TEMPFAIL: a process of the run was lost; resuming (--resume auto) will do
SUPERVISED = "EGG_JAX_SUPERVISED"  # set in the process a supervisor runs
GLOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [\w.]+:\d+\]")
JAX_TERMINATES = "Terminating process because the JAX distributed service detected fatal errors"


def several_processes(args: Args) -> bool:
    return bool(args.coord_addr) or args.num_procs > 1 or int(os.environ.get("SLURM_NTASKS", "1")) > 1


def lost_processes(log: str) -> str:
    """The processes JAX's log names as lost: 'Task N heartbeat timeout', the unhealthy tasks'
    list, or the coordinator itself when it is the one that stopped answering."""
    named = re.findall(r"Task (\d+) heartbeat timeout", log) + re.findall(r"heartbeats\):\s*(\d+)", log)
    if named:
        return "process " + ", ".join(map(str, sorted({int(n) for n in named})))
    return "process 0, the coordinator," if "coordination service" in log else "a process"


def relay_stderr(child) -> list[str]:
    """Pass the child's stderr through as it comes (a progress bar's updates too), but for JAX's
    account of a lost process: from its first line on, the lines are held and returned."""
    held, pending, ended = [], b"", True  # ended: the last line written has its newline
    while chunk := os.read(child.stderr.fileno(), 1 << 16):
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            text = line.decode(errors="replace")
            jax_error = GLOG_LINE.match(text) and text[0] in "EF" and re.search("coordinat|heartbeat", text)
            if held or jax_error:
                held.append(text)
            else:
                sys.stderr.buffer.write(line + b"\n")
                ended = True
        if pending and not held and not GLOG_LINE.match(pending.decode(errors="replace")):
            sys.stderr.buffer.write(pending)  # a progress bar's update: no newline
            pending, ended = b"", False
        sys.stderr.flush()
    if not ended:
        sys.stderr.write("\n")
    return held


def report_lost_process(args: Args, argv: list[str], log: str) -> None:
    """The supervisor's one line: what JAX says was lost, where its log went, the newest complete
    checkpoint and the command that resumes."""
    folder = Path(args.runs_dir) / (args.run_name or default_run_name(args))
    process = os.environ.get("SLURM_PROCID", args.proc_id)  # under SLURM --proc_id is not given
    record = (folder if folder.is_dir() else Path(".")) / f"process-{process}-lost.log"
    write_atomic(record, log.encode())
    saved, save_dir = checkpoints_in(save_dir_of(args)), save_dir_of(args)
    newest = f"the newest complete checkpoint is {saved[-1]}" if saved else f"no checkpoint in {save_dir} yet"
    flags, skip = [], False
    for word in argv:  # every flag but --resume and its value
        if not skip and not word.startswith("--resume"):
            flags.append(word)
        skip = word in ("--resume", "--resume_")
    command = shlex.join(["python", Path(sys.argv[0]).name, *flags, "--resume", "auto"])
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    print(
        f"error: {lost_processes(log)} stopped answering (JAX ended this one at {when}; its log: {record}); "
        f"{newest}; resume with: {command}",
        file=sys.stderr,
    )


def supervise(argv: list[str], args: Args) -> int:
    """Run this process's share of a several-process run as a child, and stand by. When a process is
    lost (silent for --heartbeat_timeout s), JAX terminates every other one, printing a C++ stack
    trace (JAX 0.10.2 offers no setting to do otherwise: docs/design.org); the supervisor keeps
    JAX's log of it in a file and says instead, in one line, what was lost, the newest complete
    checkpoint and the command that resumes, exiting EXIT_PROCESS_LOST. Anything else passes
    through: the child's output and exit code, and the stop signals it is sent."""
    import subprocess

    env = {**os.environ, SUPERVISED: "1"}
    child = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), *argv], env=env, stderr=subprocess.PIPE
    )
    for sig in (signal.SIGTERM, signal.SIGINT):  # the child saves and stops; this waits for it
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    log = "\n".join(relay_stderr(child))
    code = child.wait()
    if JAX_TERMINATES not in log:
        sys.stderr.write(log + ("\n" if log else ""))
        return 128 - code if code < 0 else code
    report_lost_process(args, argv, log)
    return EXIT_PROCESS_LOST


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
        if several_processes(args) and SUPERVISED not in os.environ:
            raise SystemExit(supervise(argv, args))
        select_platform(args.platform or ("cpu" if args.target else ""))  # --target: nothing runs on it
        args = split_cpu(args)
        enable_compilation_cache(args.dir_path)
        if args.benchmark and args.target:
            target_report(args)
        elif args.benchmark:
            benchmark(args, None if flag_given(argv, "num_epochs") else BENCHMARK_SECONDS)
        elif args.sample:
            sample(args)
        else:
            train(args)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
