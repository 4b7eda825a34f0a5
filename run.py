"""egg-jax: pretrain an int8 byte language model with integer-only EGGROLL evolution strategies.

    python run.py --data stdlib --n_embd 64 --n_layer 2 --parallel_generations_per_gpu 256
    python run.py --data my_corpus.txt --validate_every 50
    python run.py --algorithm upstream ...     # upstream nano-egg's algorithm, the control
    python run.py --help

Weights, activations and hidden states are int8; products accumulate in int32; every rescale is a
shift, a clip to [-127, 127], a constant fixed-point multiplier or a small table. Training uses no
gradients and no floating point: each generation evaluates a population of low-rank antithetic
perturbations (noise from a counter-based RNG, never stored), shapes each pair's fitness into an
int8 score, and moves each parameter by whole steps where a test on the score-weighted noise
passes. One compiled step trains K >= 1 models side by side (--replicas): the method is written
for one model, and every_replica adds the replica axis, in one place.

This file is the method, top to bottom, one ruler per section: flags, formats, integer math,
products, models, forward, noise, objectives, fitness shapings, update rules, integer ranges,
generation step, data, reading a model, loop, and main. Importing it does nothing: `python run.py`
calls main().

A model, a fitness shaping and an update rule are each an entry in a table (MODELS, SHAPINGS,
RULES) that carries all the rest derives from it, its own flags included (docs/design.org, "Trying
an idea"). The reference path reads alone; each fast path is chosen in one named place: the GPU
product kernel (products), layers unrolled for a GPU's graphs (each_layer), noise built a segment
at a time (noise_sources). Beside this file, egg/ holds the tools a run uses (its __init__.py
lists them: the command line, checkpoints, corpora, processes and signals, the record, PBT, the
GPU product kernel...), which take values and never import this file; bench.py, compare.py,
scripts/ and baselines/ import it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import replace as replaced
from functools import cache, partial
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from egg import (
    UserError,
    autotune,
    checkpoints,
    cluster,
    command,
    corpus,
    diagnostics,
    kernel,
    pbt,
    record,
    resume,
    sampling,
    tasks,
)
from egg.cluster import StopSignal, awaiting_jax_verdict, global_array, host_copy, local_copy
from egg.files import own
from egg.flags import (
    aliases,
    check_ranges,
    conditions,
    entry_flags,
    facts_of,
    flag,
    flat,
    gathered,
    replace,
    section,
    since,
)
from egg.hlo import compile_now
from egg.pbt import Replica

# ------------------------------------------------------------------------------------------------
# Flags. Each flag's facts (its range or its choices, whether it changes training, upstream
# nano-egg's value) are written once, beside it (egg/flags.py): the checks, the resume comparison,
# the --algorithm upstream preset and --help derive from them. The tools' flags are groups of
# their own (egg/), each shown apart in --help under its name; so are a model's, a shaping's and a
# rule's own flags, declared beside its entry and gathered with these into Args (after the tables).
# Every flag is still --NAME.

ROUNDS_TO_ZERO = (
    "from 7 on every bias and gain perturbation rounds to 0 (the noise table's |entries| <= 46)"
)


def entries(table: str) -> Callable[[], tuple[str, ...]]:
    """A flag's choices: the names of a table's entries (MODELS, SHAPINGS, RULES), when asked."""
    return lambda: tuple(globals()[table])


# nano-egg's --fast_fitness: --shaping sign (--no-fast_fitness: normalised)
FAST_FITNESS = ("fast_fitness", ((True, "sign"), (False, "normalised")))


@dataclass(frozen=True)
class ModelFlags:
    model: Annotated[str, *flag(training=True, choices=entries("MODELS"), before="egg")] = "egg"
    """the model (MODELS): egg, nano-egg's minGRU; mingru, its gates from the input alone;
    transformer, egg.c's"""
    n_layer: Annotated[int, *flag("[1, inf)", training=True)] = 6
    """number of blocks"""
    n_embd: Annotated[int, *flag("[1, inf)", training=True)] = 256
    """width of the residual stream (a multiple of 4)"""
    init_std: Annotated[int, *flag("[0, 32]", upstream=16, why="16: upstream's N(0, 1)")] = 4
    """standard deviation of each matrix's first entries in int8 steps (real = q / 16; 0: zeros)"""
    residual_shift: Annotated[int, *flag("[-1, 7]", training=True, upstream=0, before=0)] = -1
    """a block's outputs join the residual stream divided by 2**this (-1: 2 from 100,000
    parameters, else 0)"""
    kernels: Literal["auto", "xla", "pallas"] = "auto"
    """who computes the products: egg/kernel.py or XLA's, the same bits (auto: XLA's on a CPU; on a
    GPU the fastest of PRODUCT_CANDIDATES at this run's shapes, timed there and kept)"""


@dataclass(frozen=True)
class RunFlags:
    """egg-jax's flags. options: the run, population, EGGROLL, validation; then the model, the
    tables' entries' own, the tools."""

    seed: Annotated[int, *flag("[0, inf)", training=True)] = 0
    """seed of the initial parameters and of every perturbation (replica k: seed + k)"""
    num_epochs: Annotated[int, *flag("[1, inf)")] = 1000
    """number of generations to train (one ES update each; the upstream name)"""

    # population
    parallel_generations_per_gpu: Annotated[int, *flag("[1, inf)")] = 1024
    """population size: members evaluated per generation and device (even)"""
    group_size: Annotated[int, *flag("[1, inf)", training=True)] = 2
    """members that share one data sequence (even, divides the population)"""
    tokens_per_update: Annotated[int, *flag("[1, inf)", training=True)] = 100
    """bytes each member predicts per generation"""
    segments: Annotated[int, *flag("[0, inf)", training=True, upstream=1)] = 0
    """perturbations a member evaluates in turn, each on its share of the bytes (0: 10, or fewer)"""

    # EGGROLL
    algorithm: Literal["egg", "upstream"] = "egg"
    """'upstream': every flag whose help shows an 'upstream:' value set to it unless given"""
    alpha: Annotated[
        float, *flag("(0, inf)", training=True, why="a share <= 1, or a schedule's > 1")
    ] = 4.0
    """<= 1: share of entries allowed to move; > 1: upstream's 1 / ((2**alpha - 1) t / T + 1)"""
    alpha_decay_timestep: Annotated[int, *flag("[1, inf)", training=True)] = 1000
    """T of the --alpha > 1 schedule: the share reaches 2**-alpha at generation T, decaying on"""
    alpha_floor: Annotated[float, *flag("[0, 1)", training=True, upstream=0.0, why="a share")] = (
        1 / 64
    )
    """the --alpha > 1 schedule's share never falls below this (0: no floor; 1/64: from t 4,200)"""
    sigma_shift: Annotated[int, *flag("[0, 6]", training=True, upstream=4, why=ROUNDS_TO_ZERO)] = 3
    """perturbation scale sigma = 2**-sigma_shift"""
    rank: Annotated[int, *flag("[0, 64]", training=True, why="0: full-rank noise")] = 1
    """rank r of each matrix perturbation A B^T / sqrt(r) (0: full-rank noise, naive ES)"""
    use_clt: Annotated[bool, *flag(training=True)] = True
    """weight the update by the noise values (else by their signs)"""
    shaping: Annotated[
        str,
        *flag(training=True, upstream="sign", choices=entries("SHAPINGS"), alias=FAST_FITNESS),
    ] = "normalised"
    """fitness shaping (SHAPINGS): each antithetic pair's int8 score from its two fitnesses"""
    noise_reuse: Annotated[int, *flag("[0, inf)", training=True)] = 1
    """generations that share one set of perturbations (0: one set for the whole run)"""
    num_perturbations: Annotated[int, *flag("[0, inf)", training=True)] = 0
    """number of distinct perturbations (even, divides the population; 0: one per member)"""
    optimizer: Annotated[str, *flag(training=True, upstream="ztest", choices=entries("RULES"))] = (
        "momentum"
    )
    """update rule (RULES): how an entry moves given its Z"""
    shared_pair_state: Annotated[bool, *flag(training=True, upstream=False)] = True
    """both members of an antithetic pair start each generation from one hidden state, their mean"""

    objective: Annotated[
        str, *flag(training=True, choices=entries("OBJECTIVES"), before="likelihood")
    ] = "likelihood"
    """what a member is scored on (OBJECTIVES): likelihood, of the bytes it reads; reward, of the
    completion it writes to a task's prompt (--task, --reward)"""

    # validation
    validate_every: Annotated[int, *flag("[0, inf)")] = 0
    """generations between noise-free validations (0: only at the end)"""
    validation_batch_size: Annotated[int, *flag("[1, inf)")] = 1024
    """rows the validation data is cut into (evaluated in parallel)"""
    validation_tokens: Annotated[int, *flag("[0, inf)")] = 0
    """bytes per validation row (0: the whole held-out part)"""

    # the model's flags, and the tools' (egg/), each group under its name in --help
    model: Annotated[ModelFlags, *section()] = ModelFlags()
    """the model: which, its shape, its start, how its products run"""
    corpus: Annotated[corpus.Flags, *section()] = corpus.Flags()
    """the training and validation bytes"""
    tasks: Annotated[tasks.Flags, *section()] = tasks.Flags()
    """prompts and rewards (--objective reward), or a task's worked examples to read"""
    pbt: Annotated[pbt.Flags, *section()] = pbt.Flags()
    """replicas and population-based training"""
    sampling: Annotated[sampling.Flags, *section()] = sampling.Flags()
    """text from a checkpoint's model (--sample) or during training (--sample_every)"""
    checkpoints: Annotated[checkpoints.Flags, *section()] = checkpoints.Flags()
    """checkpoints, resume"""
    record: Annotated[record.Flags, *section()] = record.Flags()
    """the run's record (runs/RUN_NAME/metrics.jsonl) and Weights & Biases"""
    cluster: Annotated[cluster.Flags, *section()] = cluster.Flags()
    """several hosts (jax.distributed; detected automatically under SLURM), and the CPU's devices"""
    diagnostics: Annotated[diagnostics.Flags, *section()] = diagnostics.Flags()
    """the int8 activations' and parameters' health"""


class Config(NamedTuple):
    """The static settings of the jitted functions (hashable): the flags they read, under the same
    names where they keep them, each resolved where a flag lets the run choose, and what make_config
    (in "Integer ranges") derives from the flags and the devices. What differs between replicas
    (seed, alpha, sigma_shift) is not here: the step takes it as arrays."""

    model: str  # an entry of MODELS (--model)
    n_layer: int
    n_embd: int
    init_std: int  # matrices' initial standard deviation in steps at WEIGHT_FRAC
    residual_shift: int  # --residual_shift, -1 resolved by the parameters
    model_flags: Any  # the model's own flags (its entry's flags dataclass), or None
    rank: int
    use_clt: bool
    shaping: str  # an entry of SHAPINGS
    shaping_flags: Any  # the shaping's own flags, or None
    rule: str  # an entry of RULES (--optimizer)
    rule_flags: Any  # the rule's own flags, resolved where the rule chooses (Rule.resolve), or None
    noise_reuse: int | None  # generations that share one set of perturbations (None: the whole run)
    shared_pair_state: bool
    group_size: int
    tokens: int  # --tokens_per_update
    objective: str  # an entry of OBJECTIVES (--objective)
    objective_flags: Any  # the objective's own flags, or None
    stop: int  # the byte a completion ends at (the task's: --stop)
    scorer: str | None  # the task's scorer in JAX where the step scores its rewards, else None
    alpha_floor: float  # the alpha schedule's least share (host only: the thresholds)
    population: int  # members of each replica, over all devices
    segments: int  # perturbations per member and generation, one after another (segment_lengths)
    distinct_pairs: int  # pairs with their own noise; members p and p + 2 * distinct_pairs share it
    devices: int  # devices the population is spread over, parallel_generations_per_gpu each
    replicas: int  # K: the leading axis of every parameter, state and per-replica input
    # the fast paths, each chosen by make_config and taken in one place
    kernels: str  # who computes the products (products): "xla", "pallas" or "interpret"
    kernel_options: kernel.Options  # how the kernel computes them (--kernels auto chooses on a GPU)
    unrolled: bool  # the layers unrolled, each state its own buffer (each_layer): a GPU's graphs
    noise_per_segment: bool  # each segment's noise built where used, twice (noise_sources): a GPU's


def segment_lengths(cfg: Config) -> tuple[tuple[int, int], ...]:
    """(count, bytes) of a member's segments in order: the first S - T % S segments take T // S
    bytes, the last T % S one more (S = --segments, at most T = --tokens_per_update)."""
    length, longer = divmod(cfg.tokens, cfg.segments)
    runs = ((cfg.segments - longer, length), (longer, length + 1))
    return tuple((count, n) for count, n in runs if count)


def window_length(cfg: Config) -> int:
    """The bytes a member reads with one perturbation in training: a segment's (the longest)."""
    return max(length for _, length in segment_lengths(cfg))


# ------------------------------------------------------------------------------------------------
# Formats. Every fixed-point format and integer range is named once here; "q" is the stored integer.

VOCAB = 256  # bytes
INT8_MAX = 127  # int8 tensors live in the symmetric range [-127, 127]
# every accumulator's worst case stays at or below this (see "Integer ranges")
INT32_MAX = 2**31 - 1
WEIGHT_FRAC = 4  # weights, embeddings, layer-norm gains and normalised activations: real = q / 2**4
NOISE_FRAC = 4  # noise entries: real = q / 2**4, standard deviation ~1
GATE_BITS = 8  # a GRU gate g = f + 127 in [0, 254]: the fraction g / 2**8 of the new state to take
LOGIT_FRAC = 4  # logits are log2-probabilities up to a constant: real = q / 2**4 bits
LL_FRAC = 8  # log-likelihoods and fitness, in bits: real = q / 2**8
EXP_FRAC = 20  # terms 2**(-d / 2**LOGIT_FRAC) of the log-sum-exp: real = q / 2**20, q <= 2**20
MANT_BITS = 10  # log2 of the mantissa is read from a table of 2**10 int32 entries (4 KiB)
RECIP_BITS = 16  # layer-norm multipliers 1/m for m in [1, 127]: real = q / 2**16
MUL_BITS = 14  # constant rescale multipliers: real = q / 2**14, q in (2**13, 2**14]
GAUSS_BITS = 8  # each noise entry is a 256-entry normal-quantile table indexed by 8 random bits
FIT_FRAC = 4  # normalised fitness scores: real = q / 2**4 (difference / mean |difference|), int8
STD_FRAC = 3  # standardised scores: real = q / 2**3 (difference / root mean square difference)
RMS_BITS = 8  # ...computed from |difference| / mean |difference| at q / 2**8, q < 2**15
U_STD_BITS = 4  # momentum: u = Z >> shift with u's null std in [2**4, 2**5), clipped to int8
ROOT_BITS = 15  # --null_from_scores: threshold x sqrt(S / S_null) from mantissas in [2**14, 2**15)
REWARD_FRAC = 16  # a reward as a member's fitness: real = q / 2**16, rounded to the nearest
# the largest |fitness| of a reward (|reward| <= 16,384; beyond, clipped), so that a pair's
# difference stays within int32
REWARD_LIMIT = 2**30 - 1
# a byte drawn at a temperature: argmax of logit + temperature x Gumbel noise, the noise from a
# table of 2**12 quantiles (int16, log2-units at LOGIT_FRAC) indexed by 12 random bits
GUMBEL_BITS = 12
TEMPERATURE_FRAC = 4  # --completion_temperature as the integer round(temperature x 2**4)
GAIN_ONE = 2**WEIGHT_FRAC  # a layer norm's gain of 1.0, where each starts
# every int8 product sums at least this many terms, zeros padding a shorter one (deepened): a GPU's
# int8 dot is 32 deep (Hopper's MMA), and XLA's 16-deep ones were wrong on an H200 (docs/gpu.org)
DOT_DEPTH = 32
# XLA's options for a program with full-rank noise (--rank 0, compiler_options): its products go to
# cuBLAS, not to XLA's Triton GEMMs, which summed some of them wrongly on an H200 (JAX 0.11.2;
# docs/gpu.org). No effect on a CPU.
FULL_RANK_OPTIONS = {"xla_gpu_enable_triton_gemm": False}
GPUS = ("gpu", "cuda", "rocm")  # JAX's names of the platforms the fast paths are for
AUTO_SEGMENTS = 10  # --segments 0: this many, or fewer where the int32 bounds require it
# from this many parameters the blocks' outputs join the residual stream at a quarter
# (--residual_shift -1 resolves to QUARTER_SHIFT, else 0): lower on every text and seed at 256D-6L
# and at 64D-2L (131,648), behind at the first run's one block, 32D-1L (28,832)
QUARTER_MODEL = 100_000
QUARTER_SHIFT = 2
# odd (2**32 / golden ratio): segment s's words are segment 0's plus s times this, remixed
SEGMENT_STEP = 0x9E3779B9
MATRIX, VECTOR = 0, 1  # the two kinds of parameter: index of their null std and threshold
i32 = jnp.int32
# ------------------------------------------------------------------------------------------------
# Integer math. In JAX `>>` on signed integers floors (rounds toward minus infinity).


class Tables(NamedTuple):
    """Small lookup tables, built on the host once (sizes in the comments)."""

    gauss: np.ndarray  # (256,) int8: round(16 * normal quantile), noise of std ~1 at NOISE_FRAC
    gauss_rank: np.ndarray  # (256,) int8: the same divided by sqrt(rank), for the B factors
    exp2_frac: np.ndarray  # (16,) int32: round(2**(EXP_FRAC - i/16)), i in [0, 16)
    log2_mant: np.ndarray  # (2**MANT_BITS,) int32: log2(1 + (i + 0.5) / 2**MANT_BITS) * 2**LL_FRAC
    # (2**GUMBEL_BITS,) int16: round(2**LOGIT_FRAC x -log2(-ln u)), u = (i + 0.5) / 2**GUMBEL_BITS:
    # Gumbel noise in the logits' units, in [-51, 208]
    gumbel: np.ndarray


@cache
def make_tables(rank: int) -> Tables:
    normal = statistics.NormalDist()
    quantiles = np.array([normal.inv_cdf((i + 0.5) / 2**GAUSS_BITS) for i in range(2**GAUSS_BITS)])
    mant = (np.arange(2**MANT_BITS) + 0.5) / 2**MANT_BITS
    uniform = (np.arange(2**GUMBEL_BITS) + 0.5) / 2**GUMBEL_BITS
    return Tables(
        gauss=np.round(quantiles * 2**NOISE_FRAC).astype(np.int8),
        gauss_rank=np.round(quantiles * 2**NOISE_FRAC / math.sqrt(max(rank, 1))).astype(np.int8),
        exp2_frac=np.round(2.0 ** (EXP_FRAC - np.arange(16) / 16)).astype(np.int32),
        log2_mant=np.round(np.log2(1 + mant) * 2**LL_FRAC).astype(np.int32),
        gumbel=np.round(-np.log2(-np.log(uniform)) * 2**LOGIT_FRAC).astype(np.int16),
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
    """floor(acc / divisor) clipped to int8, for a constant divisor >= 1: shifts and one multiply.

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


def log2_of_sum(s, tables: Tables):
    """log2(s / 2**EXP_FRAC) at LL_FRAC, for a sum s in [2**EXP_FRAC, 2**31) of terms
    2**(-d/16) at EXP_FRAC (int32): e + log2(1 + m), e its top bit (count leading zeros) and m the
    next MANT_BITS bits, read from a table."""
    exponent = 31 - jax.lax.clz(s)  # in [20, 30]
    mantissa = (s >> (exponent - MANT_BITS)) - (1 << MANT_BITS)
    return ((exponent - EXP_FRAC) << LL_FRAC) + jnp.asarray(tables.log2_mant)[mantissa]


def log2_likelihood(logits, target, tables: Tables):
    """log2 softmax(logits)[target] at LL_FRAC, integers only. logits (..., 256) int8 at LOGIT_FRAC;
    target (...) of bytes.

    With d = max - logits in [0, 254]: sum 2**(-d/16) = sum exp2_frac[d % 16] >> (d // 16), each
    term <= 2**20 and the largest exactly 2**20, so 2**20 <= s <= 2**28. log2 s = e + log2(1 + m)
    with e the top bit (count leading zeros) and m the next MANT_BITS bits, read from a table.
    """
    top = jnp.max(logits, axis=-1, keepdims=True).astype(i32)  # on int8: a quarter of the bytes
    logits = logits.astype(i32)
    d = top - logits
    log2_s = log2_of_sum(
        jnp.sum(jnp.asarray(tables.exp2_frac)[d & 15] >> (d >> 4), axis=-1), tables
    )
    target = jnp.broadcast_to(jnp.asarray(target, i32), logits.shape[:-1])
    picked = jnp.take_along_axis(logits, target[..., None], axis=-1)
    return ((picked - top)[..., 0] << (LL_FRAC - LOGIT_FRAC)) - log2_s


def deepened(x, axis: int, depth: int):
    """x with its `axis` padded with zeros to at least `depth` entries: a product contracting over
    it sums the same (see DOT_DEPTH)."""
    missing = depth - x.shape[axis]
    if missing <= 0:
        return x
    padding = [(0, 0)] * x.ndim
    padding[axis] = (0, missing)
    return jnp.pad(x, padding)


def shifted(x: int, k: int) -> int:
    """|x| / 2**k rounded half up: the magnitude round_shift gives, for a host integer."""
    return (abs(x) + ((1 << k) >> 1)) >> k


def isqrt(x):
    """floor(sqrt(x)) of a non-negative int32, bit by bit (the trial squares fit uint32)."""
    x = x.astype(jnp.uint32)
    root = jnp.zeros(x.shape, jnp.uint32)
    for bit in reversed(range(16)):
        trial = root | jnp.uint32(1 << bit)
        root = jnp.where(trial * trial <= x, trial, root)
    return root.astype(i32)


def scale_by_root(threshold, s, s_null: float):
    """threshold x sqrt(s / s_null), floored, within 1 + 2**-12 relative, all int32
    (--null_from_scores: s this generation's sum of squared pair weights, s_null its expected
    value).

    From mantissas in [2**14, 2**15): threshold = tm 2**te, sqrt(s) = r 2**-j (r = isqrt(s 4**j)
    with s 4**j in [2**28, 2**30)) and 1 / sqrt(s_null) = im 2**-ie (from the host); ((tm r) >> 15)
    im < 2**31. The largest int32 (nothing moves) stays so, s = 0 (all ties: every Z is 0) gives
    0, and s = s_null the threshold itself.
    """
    inverse = 1 / math.sqrt(s_null)
    ie = ROOT_BITS - 1 - int(math.floor(math.log2(inverse)))
    im = int(round(inverse * 2**ie))  # in [2**14, 2**15]
    te = 32 - jax.lax.clz(threshold) - ROOT_BITS  # the bit length of the threshold, less 15
    tm = jnp.where(te >= 0, threshold >> jnp.maximum(te, 0), threshold << jnp.maximum(-te, 0))
    j = (jax.lax.clz(jnp.maximum(s, 1)) - 2) >> 1
    r = isqrt(s << j * 2)
    product = ((tm * r) >> ROOT_BITS) * im
    shift = ROOT_BITS + te - j - ie
    room = jax.lax.clz(jnp.maximum(product, 1)) - 1  # left shifts that keep it an int32
    left = jnp.where(shift <= room, product << jnp.clip(shift, 0, 31), INT32_MAX)
    scaled = jnp.where(shift >= 0, left, product >> jnp.clip(-shift, 0, 31))
    same = s == int(s_null) if float(s_null).is_integer() else False
    return jnp.where((threshold == INT32_MAX) | same, threshold, jnp.where(s == 0, 0, scaled))


# ------------------------------------------------------------------------------------------------
# Products: how one replica's members read its parameters. Every model is written for one replica
# (every_replica adds the replica axis). Its members are laid out on the axes (R, D, S), in this
# order wherever they meet (a name's suffix, x_RxDxSxE, gives its shape): R repeats (members
# sharing a noise, R > 1 only under --num_perturbations) x D distinct pairs x S sides (S = 2: side
# 0 adds its pair's noise, side 1 subtracts it; S = 1 noise-free). A matrix is shared by every
# member and perturbed inside the product by its pair's low-rank factors A (D, m, r), B (D, n, r),
# never built; a vector is each member's own copy, perturbed by its pair's full noise. L layers, E
# the width (--n_embd), V = 256 bytes, T bytes of a sequence.


class Parameter(NamedTuple):
    """What the rest derives from one of a model's parameters (Model.parameters)."""

    shape: tuple[int, ...]  # one layer's; a matrix is (out, in)
    layered: bool  # stacked on a leading n_layer axis
    matrix: bool  # perturbed by low-rank factors A B^T, else (a vector) by full-shape noise
    start: int | None  # each entry's first value (int8); None: ~ N(0, init_std**2) steps


class Sides(NamedTuple):
    """How the noise enters the members, broadcast against their axes (R, D, S): sign_1x1xS int32,
    +1 or -1 per side; shift () int32, the replica's sigma_shift (traced: a shift by an amount known
    at run time is the same integer operation)."""

    sign: jax.Array
    shift: jax.Array


def make_sides(sigma_shift, sides: int) -> Sides:
    """Sides of S = `sides` (2: antithetic pairs, 1: noise-free) for this replica's shift."""
    return Sides(
        jnp.array([1, -1][:sides], i32).reshape(1, 1, sides), jnp.asarray(sigma_shift, i32)
    )


def perturbed_vector(p, nz, sides: Sides):
    """Every member's copy of a vector parameter p (..., n): p + sign x sigma x noise, with nz
    (D, ..., n) its pairs' noise, as (1, D, S, ..., n); p itself, as (1, 1, 1, ..., n), without
    noise."""
    if nz is None:
        return p[None, None, None]
    sign = sides.sign.reshape(sides.sign.shape + (1,) * (nz.ndim - 1))  # (1, 1, S, 1, ...)
    noise = round_shift(nz[None, :, None], NOISE_FRAC + sides.shift - WEIGHT_FRAC)
    return clip_int8(p.astype(i32) + sign * noise)


def chunked_dot(x, b):
    """x (..., n) int8 times b (..., n, r) int8 -> (..., r) int32, as exact int32 sums over chunks
    of at most 32 entries, then a sum of the chunks. Elementwise, so it fuses on any backend;
    XLA:CPU splits a longer reduction in two passes that store every int32 product, the chunks
    avoid that."""
    n = x.shape[-1]
    chunk = max(c for c in range(1, 33) if n % c == 0)
    split = (n // chunk, chunk)
    x_split = x.astype(i32).reshape(x.shape[:-1] + split + (1,))
    products = x_split * b.reshape(b.shape[:-2] + split + (-1,))
    parts = jnp.sum(products, axis=-2)  # (..., n // chunk, r)
    return sum(parts[..., k, :] for k in range(n // chunk))


def noise_term(xb, a, sign, shift):
    """A member's noise in x W^T's units: sign x (((x B) >> NOISE_FRAC) A^T) >> sigma_shift, for
    xb = x B (..., r) int32 and a = A (..., m, r) int8 (B at NOISE_FRAC already carries
    1 / sqrt(r)); sign and shift broadcast against the result (..., m) int32."""
    u = sign * (xb >> NOISE_FRAC)
    return jnp.sum(a * u[..., None, :], axis=-1) >> shift


def rescale(acc, n: int):
    """A product's int32 accumulator (x W^T at x's scale times 2**WEIGHT_FRAC) back to x's scale as
    int8: floor(acc / (2**WEIGHT_FRAC sqrt(n))) for n inputs, which keeps the output's spread ~
    x's."""
    return divide_to_int8(acc, 2**WEIGHT_FRAC * math.sqrt(n))


def matmul(x, w, nz, sides: Sides):
    """x (W + sigma E)^T / (16 sqrt(n)) as int8, E = A B^T never built. x_RxDxSxn int8 at any scale
    s; w (m, n); nz its pairs' low-rank factors A (D, m, r), B (D, n, r), a full noise (D, m, n)
    under --rank 0, or None. Returns (R, D, S, m).

    x W^T accumulates in int32 at scale s * 2**WEIGHT_FRAC; the noise term in the same units is
    noise_term's; rescale keeps the output's scale ~ s.
    """
    n = x.shape[-1]
    deep_x = deepened(x, -1, DOT_DEPTH)
    acc = jnp.einsum(
        "rdsn,mn->rdsm", deep_x, deepened(w, -1, DOT_DEPTH), preferred_element_type=i32
    )
    if isinstance(nz, tuple):
        a, b = (f[None, :, None] for f in nz)  # (1, D, 1, ..., r)
        acc = acc + noise_term(chunked_dot(x, b), a, sides.sign[..., None], sides.shift)
    elif nz is not None:  # --rank 0: a full (m, n) noise matrix E, one more matmul per member
        deep_nz = deepened(nz, -1, DOT_DEPTH)
        full = jnp.einsum("rdsn,dmn->rdsm", deep_x, deep_nz, preferred_element_type=i32)
        acc = acc + ((sides.sign[..., None] * full) >> sides.shift)
    return rescale(acc, n)


def product_bounds(widest: int, rank: int) -> dict[str, tuple[int, str]]:
    """The worst cases of matmul's int32 accumulators, for inputs of up to `widest` entries (a
    model's widest product): {accumulator: (largest magnitude, what would shrink it)}."""
    tables = make_tables(rank)
    a_max, b_max = (int(np.abs(t).max()) for t in (tables.gauss, tables.gauss_rank))
    x_b = INT8_MAX * b_max * widest  # x B
    u_a = (x_b >> NOISE_FRAC) * a_max * rank  # ((x B) >> 4) A^T
    if rank == 0:  # full-rank noise: x E^T
        x_b, u_a = 0, INT8_MAX * a_max * widest
    return {
        "matmul accumulator x W^T + sigma x E^T": (
            INT8_MAX**2 * widest + u_a,
            "a smaller --n_embd or --rank",
        ),
        "low-rank product x B": (x_b, "a smaller --n_embd"),
    }


def norm_scale(total, n: int):
    """A layer norm's multiplier round(2**RECIP_BITS / m) of a row, m = max(floor(mean |x|), 1) in
    [1, 127], from total = sum |x| over its n entries (<= 127 n): (2**17 + m) // 2m, never a tie."""
    mean = jnp.maximum(divide_to_int8(total, n).astype(i32), 1)
    return (2 ** (RECIP_BITS + 1) + mean) // (2 * mean)


def normalise(x, gain, scale):
    """clip((x gain scale) >> RECIP_BITS) as int8: |x gain| < 2**14, times scale <= 2**16."""
    return clip_int8((x.astype(i32) * gain.astype(i32) * scale) >> RECIP_BITS)


def layer_norm(x, gain):
    """Integer L1 layer norm of each row: gain x / mean|x|, int8 at WEIGHT_FRAC (mean |output| ~
    gain). x (..., n), gain broadcast against it."""
    total = jnp.sum(jnp.abs(x.astype(i32)), axis=-1, keepdims=True)
    return normalise(x, gain, norm_scale(total, x.shape[-1]))


def join(branch, x, shift: int):
    """A block's output joining the residual stream x: x + branch / 2**shift, the quotient rounded
    half away from zero, saturating (int8). --residual_shift: in a deep stack the sum of the blocks'
    outputs otherwise saturates the stream (docs/results.org)."""
    return clipped_add(x, round_shift(branch, shift) if shift else branch)


def rank1_noise_term(xb, a, sign, shift):
    """noise_term at rank 1, its one-term sum left out (the GPU kernels' tiles are 2-D): xb
    (..., 1) or (..., m) int32, a (..., m) int8."""
    return (a * (sign * (xb >> NOISE_FRAC))) >> shift


# what the GPU kernels compute in each tile: these functions, so that they and XLA agree bit for bit
ARITHMETIC = kernel.Arithmetic(rescale, norm_scale, normalise, rank1_noise_term, clipped_add)


class Perturbed(NamedTuple):
    """One replica's parameters as its members read them, built once outside the byte loop
    (perturbed, in "Forward"): params, the matrices shared by the members ([L,] m, n) and each
    member's perturbed vectors (1, D, S, n), layered ones with their layer axis first; noise, the
    matrices' (factors ([L,] D, m, r), or full noise), or None; the sides; the tables; and where
    egg/kernel.py computes the products, its operands (kernel_operands)."""

    params: dict
    noise: dict | None
    sides: Sides
    tables: Tables
    kernel: dict | None
    interpret: bool  # the kernel in Pallas's interpreter (on the CPU)
    options: kernel.Options  # how the kernel computes (Config.kernel_options)
    residual_shift: int  # how a block's outputs join the residual stream (join)
    replicas: int  # K, of which this is one: the kernel's tiles are chosen for all K (kernel.tiles)


def kernel_operands(params: dict, noise: dict | None, groups, layered: set[str]) -> dict:
    """egg/kernel.py's operands of each group of matrices that read one input (Model.groups), the
    group's matrices stacked (the one copy: once a forward), each with a layer axis (1 where it has
    none): w (G, L, m, n) and the rank-1 factors a (G, L, D, m), b (G, L, D, n), or None
    noise-free."""
    operands = {}
    for group in groups:

        def lift(x, name=group[0]):
            return x if name in layered else x[None]

        w = jnp.stack([lift(params[name]) for name in group])
        a = b = None
        if noise is not None:  # rank 1: (L, D, m, 1) -> (L, D, m)
            a, b = (jnp.stack([lift(noise[name][f])[..., 0] for name in group]) for f in (0, 1))
        operands[group] = (w, a, b)
    return operands


def embed(w: Perturbed, name: str, tok):
    """Row `tok` of the embedding matrix `name` (+ sigma E[tok]) of every member, int8 at
    WEIGHT_FRAC: tok_...xRxDxS (leading axes: a window's bytes) -> (..., R, D, S, E)."""
    rows = w.params[name][tok]
    nz, sides = None if w.noise is None else w.noise[name], w.sides
    if nz is None:
        return rows
    lookup = tok[..., None, None]  # each member's byte in its pair's noise: (..., R, D, S, 1, 1)
    pairs = (None,) * (tok.ndim - 2) + (slice(None), None)  # a pair's noise against the members
    if not isinstance(nz, tuple):  # --rank 0: a full (256, E) noise matrix
        row = jnp.take_along_axis(nz[pairs], lookup, axis=-2)[..., 0, :]
        noise = round_shift(row, NOISE_FRAC + sides.shift - WEIGHT_FRAC)
        return clip_int8(rows.astype(i32) + sides.sign[..., None] * noise)
    a, b = nz  # a (D, 256, r), b (D, E, r)
    a_tok = jnp.take_along_axis(a[pairs], lookup, axis=-2)  # (..., R, D, S, 1, r)
    pert = jnp.sum(b[pairs].astype(i32) * a_tok, axis=-1)  # at 2 * NOISE_FRAC
    shift = sides.shift + (2 * NOISE_FRAC - WEIGHT_FRAC)
    return clip_int8(rows.astype(i32) + ((sides.sign[..., None] * pert) >> shift))


def products(w: Perturbed, x, names: tuple[str, ...], layer=None, gain: str = "", residual=None):
    """x times each named matrix (with its noise) as matmul computes it, the one place that chooses
    who computes it: x_RxDxSxn, or x_...xRxDxSxn (a window's bytes: more repeats of each pair);
    first layer_norm(x, gain) with a gain name, then join(product, residual) with a residual.
    `layer` () int32 for layered parameters, None for others. Returns one (..., R, D, S, m) per
    name: by egg/kernel.py where the Perturbed has operands of this group of matrices and the
    kernel takes the shapes, else by XLA."""
    if x.ndim > 4:  # the leading axes as repeats
        rows = (-1,) + x.shape[-3:]
        joined = None if residual is None else residual.reshape((-1,) + residual.shape[-3:])
        outs = products(w, x.reshape(rows), names, layer, gain, joined)
        return [o.reshape(x.shape[:-1] + o.shape[-1:]) for o in outs]
    repeats, distinct, sides, n = x.shape
    pairs, m = repeats * distinct, w.params[names[0]].shape[-2]
    operands = w.kernel.get(names) if w.kernel else None
    at = (lambda p: p) if layer is None else (lambda p: jax.tree.map(lambda v: v[layer], p))
    if operands is None or not kernel.takes(pairs, distinct, m, n, w.options.backend):
        v = layer_norm(x, at(w.params[gain])) if gain else x
        noise = (lambda k: None) if w.noise is None else (lambda k: at(w.noise[k]))
        outs = [matmul(v, at(w.params[k]), noise(k), w.sides) for k in names]
        return [o if residual is None else join(o, residual, w.residual_shift) for o in outs]

    def as_rows(v):  # (R, D, S, n) -> (Q, S n): a view
        return v.reshape((pairs, -1))

    if gain and not w.options.normalises:  # XLA layer-normalises x, once a row
        x, gain = layer_norm(x, at(w.params[gain])), ""
    gains = None
    if gain:  # its rows, layer axis first: (L, D, S n), or (L, 1, n) noise-free (every row's)
        rows = w.params[gain] if layer is not None else w.params[gain][None]
        gains = rows.reshape(rows.shape[:1] + (rows.shape[2], -1))
    index = jnp.asarray(0 if layer is None else layer, i32)
    added = None if residual is None else as_rows(residual)
    arithmetic = ARITHMETIC._replace(add=partial(join, shift=w.residual_shift))
    options = dict(
        interpret=w.interpret, arithmetic=arithmetic, replicas=w.replicas, options=w.options
    )
    stacked, a, b = operands
    if a is not None and not w.options.sums_noise:  # XLA sums x B, once a row and matrix
        v = layer_norm(x, at(w.params[gain])) if gain else x
        xb = jnp.einsum("rdsn,gdn->gsrd", v, b[:, index], preferred_element_type=i32)
        options["xb"], b = xb.reshape(xb.shape[:2] + (pairs,)), None
    out = kernel.product(as_rows(x), stacked, a, b, w.sides.shift, index, gains, added, **options)
    return [o.reshape(x.shape[:-1] + (m,)) for o in out]


# ------------------------------------------------------------------------------------------------
# Models. An entry of MODELS carries all the rest derives from a model: its parameters (names in
# the noise stream's order, shapes, which are matrices, how each starts), the state each member
# carries from one generation to the next and that state's shape, its forward over one replica's
# members (by the byte, carrying a state, or by the window of bytes a member reads with one
# perturbation), its products through products() (which may hand them to the GPU kernel), the
# worst case of each int32 accumulator (refused before compiling where one exceeds int32), its
# int8 activations by name (--debug's table), and its own flags. --model picks one.


class Model(NamedTuple):
    """A model: what the method needs of it. Byte models give `step`, window models `window`.

    parameters(cfg) -> {name: Parameter}, in the noise stream's order
    state(cfg) -> one member's carried state's shape, int8 ((0,) for none)
    begin(states_Mx..., layout, cfg) -> what step (or window) carries from byte to byte (window to
    window), the members laid out (R, D, S) = layout, each array's axes ending (R, D, S, x);
    end(carried, cfg) -> the states (M, ...)
    step(w, carried, byte_RxDxS, cfg) -> (logits_RxDxSxV int8 at LOGIT_FRAC, carried, activations)
    window(w, carried, bytes_TxRxDxS, cfg) -> (logits_TxRxDxSxV, carried, activations), each byte's
    from those before in its window and what is carried (T at most its context; read_windows cuts
    longer reads), activations (T, [L,] R, D, S, width)
    context(cfg) -> a window model's context: the bytes it reads at once (a segment shorter than it
    is refused)
    groups: the matrices each call of products() multiplies one input by (the kernel stacks them)
    bounds(cfg) -> {accumulator: (its worst case, what would shrink it)}, products' included
    traffic(cfg) -> activation bytes a member reads and writes a byte, at least (bench.py's floor)
    flags: its own flags (a frozen flags dataclass beside it), or None
    check(cfg) -> why the model refuses this configuration, in a line naming the flag; "" if not
    resolve(flags, cfg) -> its flags with the values it chooses where they say 0 (None: none)
    The activations are {name: int8 array}, a layer's stacked on a leading L axis."""

    parameters: Callable[[Config], dict[str, Parameter]]
    state: Callable[[Config], tuple[int, ...]]
    begin: Callable
    end: Callable
    step: Callable | None
    window: Callable | None
    groups: tuple[tuple[str, ...], ...]
    bounds: Callable[[Config], dict[str, tuple[int, str]]]
    traffic: Callable[[Config], int]
    flags: type | None = None
    check: Callable[[Config], str] = lambda cfg: ""  # a refusal of this configuration, or ""
    context: Callable[[Config], int] | None = None
    resolve: Callable[[Any, Config], Any] | None = None


def layer_carry(states_L, cfg: Config):
    """The layers' states (L, ...) as a model's byte loop carries them: where the layers are
    unrolled (cfg.unrolled, the product kernel's, as on a GPU) a tuple of each layer's, each its own
    buffer that the kernels computing it write whole (written into a stack, each state would be a
    copy, one that cuts a GPU's command buffer: each byte three graphs, not one); else the stack
    the layers' scan reads."""
    return tuple(states_L) if cfg.unrolled else states_L


def each_layer(layer, x, states, cfg: Config):
    """x through every layer in turn, the one place that chooses how: layer(x, state, index) ->
    (x, state, seen); states as layer_carry makes them. Returns x, the new states (as carried) and
    each activation the layers saw, stacked on a leading L axis. Unrolled (cfg.unrolled: a loop
    costs a GPU three kernels a layer), else scanned."""
    if cfg.unrolled:
        new, seen = [], []
        for at, h in enumerate(states):
            x, h, activations = layer(x, h, at)
            new.append(h)
            seen.append(activations)
        return x, tuple(new), jax.tree.map(lambda *v: jnp.stack(v), *seen)

    def scanned(x, h_at):
        x, h, activations = layer(x, *h_at)
        return x, (h, activations)

    x, (states, seen) = jax.lax.scan(scanned, x, (states, jnp.arange(states.shape[0])))
    return x, states, seen


# EGG, upstream nano-egg's minGRU: per block a GRU whose gate and candidate read the input and the
# state (Uf, Uh) at every byte, then an MLP without a nonlinearity, each joining the residual
# stream.


def egg_parameters(cfg: Config) -> dict[str, Parameter]:
    """Byte embedding, n_layer blocks (ln1, the GRU's Wf Uf bf Wh Uh bh, ln2, the MLP's W1 W2), the
    output layer norm and the head. Matrices start ~ N(0, init_std**2) steps, gains at 1.0, biases
    at 0."""
    n = cfg.n_embd
    square, vector = Parameter((n, n), True, True, None), Parameter((n,), True, False, 0)
    gain = Parameter((n,), True, False, GAIN_ONE)
    return {
        "emb": Parameter((VOCAB, n), False, True, None),
        "ln1": gain,
        "Wf": square,
        "Uf": square,
        "bf": vector,
        "Wh": square,
        "Uh": square,
        "bh": vector,
        "ln2": gain,
        "W1": Parameter((4 * n, n), True, True, None),
        "W2": Parameter((n, 4 * n), True, True, None),
        "ln_out": gain._replace(layered=False),
        "head": Parameter((VOCAB, n), False, True, None),
    }


def egg_state(cfg: Config) -> tuple[int, ...]:
    """Each layer's hidden state, int8 using the full range (real = q / 127)."""
    return (cfg.n_layer, cfg.n_embd)


def egg_begin(states_MxLxE, layout: tuple[int, int, int], cfg: Config):
    """The members' states with their layer axis first, as the layers slice them: (L, R, D, S, E)
    in the members' layout (R, D, S)."""
    states = jnp.moveaxis(states_MxLxE, 1, 0)
    return layer_carry(states.reshape((cfg.n_layer,) + layout + (cfg.n_embd,)), cfg)


def egg_end(carried, cfg: Config):
    """The members' states (M, L, E) from what the byte loop carried."""
    return jnp.moveaxis(jnp.stack(carried).reshape((cfg.n_layer, -1, cfg.n_embd)), 0, 1)


def gru_move(x, h, g, c, cfg: Config):
    """The state h moved toward the candidate c by g / 256 of the way (g in [0, 254], c in int8:
    between h and c), joining the residual stream x: (the stream, the state, the activations)."""
    h = (h.astype(i32) + ((g * (c - h.astype(i32))) >> GATE_BITS)).astype(jnp.int8)
    gate, candidate = (g - INT8_MAX).astype(jnp.int8), c.astype(jnp.int8)
    return join(h, x, cfg.residual_shift), h, {"gate": gate, "candidate": candidate, "state": h}


def egg_gru(x, h, layer, w: Perturbed, cfg: Config):
    """A block's GRU, of every member: the new residual stream, this layer's new state and the
    GRU's int8 activations by name. x: the residual stream x_RxDxSxE, int8 at WEIGHT_FRAC; h: this
    layer's hidden state (R, D, S, E), using the full range (real = q / 127); layer () int32."""
    wf, wh = products(w, x, ("Wf", "Wh"), layer, gain="ln1")
    (uf,) = products(w, h, ("Uf",), layer)
    # forget gate: clipping to int8 is the (hard) sigmoid; g = f + 127 in [0, 254] is g / 256
    g = clipped_add(wf, uf, w.params["bf"][layer]).astype(i32) + INT8_MAX
    gated = ((g * h.astype(i32)) >> GATE_BITS).astype(jnp.int8)
    # candidate: clipping to int8 is the (hard) tanh
    (uh,) = products(w, gated, ("Uh",), layer)
    c = clipped_add(wh, uh, w.params["bh"][layer]).astype(i32)
    return gru_move(x, h, g, c, cfg)


def egg_block(x, h, layer, w: Perturbed, cfg: Config, gru=egg_gru):
    """One block of every member: its GRU, then an MLP (n -> 4n -> n, no nonlinearity, as
    upstream's) joining the residual stream; the new stream, state and activations."""
    x, h, seen = gru(x, h, layer, w, cfg)
    (hidden,) = products(w, x, ("W1",), layer, gain="ln2")
    (x,) = products(w, hidden, ("W2",), layer, residual=x)
    return x, h, {**seen, "mlp_hidden": hidden, "residual": x}


def egg_step(w: Perturbed, states, byte_RxDxS, cfg: Config, block=egg_block):
    """One byte through every member: its logits, the new states, the activations. The states
    restart from zero at byte 0, the separator before every document."""
    restart = (byte_RxDxS == 0)[..., None]
    states = jax.tree.map(lambda h: jnp.where(restart, jnp.zeros_like(h), h), states)
    embedding = embed(w, "emb", byte_RxDxS)
    x, states, seen = each_layer(partial(block, w=w, cfg=cfg), embedding, states, cfg)
    (logits,) = products(w, x, ("head",), gain="ln_out")
    return logits, states, {"embedding": embedding, **seen, "logits": logits}


def egg_bounds(cfg: Config) -> dict[str, tuple[int, str]]:
    """Its products' (the widest input: the MLP's down projection, 4 n); the gate's product g h
    stays below 2**15."""
    return product_bounds(4 * cfg.n_embd, cfg.rank)


def egg_traffic(cfg: Config) -> int:
    """Every product's int8 input and output, the state and the residual stream: 22 n a layer; 2 n
    + 2 x 256 around them (n the width)."""
    return 22 * cfg.n_embd * cfg.n_layer + 2 * cfg.n_embd + 2 * VOCAB


EGG_GROUPS = (("Wf", "Wh"), ("Uf",), ("Uh",), ("W1",), ("W2",), ("head",))  # by their input


# The minGRU as its paper defines it (Feng et al., "Were RNNs All We Needed?", as gruboros trains
# it): gate and candidate read the input alone, so the recurrence is elementwise. Otherwise EGG's
# block (its layer norms, MLP and joins): the two differ in what the gates read and nothing else.
# Its products run byte by byte, as EGG's, and it carries its state from window to window as EGG
# does: computed over a window at once (scripts/mingru_window.py), they ran at 0.84-0.99x the speed
# on this project's CPU in five configurations of six, 1.22x in one (docs/results.org).


def mingru_parameters(cfg: Config) -> dict[str, Parameter]:
    """EGG's without Uf and Uh."""
    return {k: p for k, p in egg_parameters(cfg).items() if k not in ("Uf", "Uh")}


def mingru_gru(x, h, layer, w: Perturbed, cfg: Config):
    """egg_gru with gate and candidate from the input alone: f = Wf x + bf, c = Wh x + bh, clipped
    to int8 (hard sigmoid and tanh); h moves toward c by (f + 127) / 256 of the way."""
    wf, wh = products(w, x, ("Wf", "Wh"), layer, gain="ln1")
    g = clipped_add(wf, w.params["bf"][layer]).astype(i32) + INT8_MAX
    c = clipped_add(wh, w.params["bh"][layer]).astype(i32)
    return gru_move(x, h, g, c, cfg)


def mingru_traffic(cfg: Config) -> int:
    """EGG's less the state-reading products' inputs and outputs: 18 n a layer."""
    return 18 * cfg.n_embd * cfg.n_layer + 2 * cfg.n_embd + 2 * VOCAB


# A transformer as egg.c and d-eggs train one, integer only: each block causal self-attention over
# the member's window (the bytes it reads with one perturbation) and the keys and values of the
# --carried bytes before it, then an MLP with a ReLU, each after its layer norm and joining the
# residual stream. A member carries those keys and values (int8, as computed, each with the
# perturbation of the segment that read its byte) from window to window, segment to segment and
# generation to generation, as EGG carries its GRU states: a window's bytes see as far back as
# --carried bytes before it, within their document (a byte 0 starts one: nothing before it is
# attended). Positions are distances (ALiBi's): each head's score lowered by a fixed slope times
# how far back its key is, no table, so a carried key's distance is known wherever it was
# computed (egg.c's learned embedding per place in the window was 0.08-0.17 bits/byte behind with
# keys carried, each keeping the place it was computed at: docs/results.org). The output layer is
# its own (tied to the embedding, EGG's was 0.13 bits/byte behind at 32D-1L: docs/results.org).
# Attention's softmax is the log-likelihood's: scores are int8 log2-units at LOGIT_FRAC, their sum
# of powers of two is read by the same tables, and each probability 2**(score - top - log2 sum)
# is read back from exp2_frac: no float, no division.

PROB_FRAC = 7  # attention's probabilities: real = q / 2**7, q in [0, 127]
SCORE_FRAC = 16  # a head's score multiplier: real = q / 2**16
SLOPE_FRAC = 8  # a head's score is lowered by slope x distance: slope q / 2**8 at LOGIT_FRAC


@dataclass(frozen=True)
class TransformerFlags:
    """the transformer's own flags (--model transformer)"""

    head_width: Annotated[int, *flag("[1, inf)", training=True)] = 16
    """width of each attention head (divides --n_embd)"""
    context: Annotated[int, *flag("[0, inf)", training=True)] = 0
    """bytes a window holds, read at once (0: a segment's bytes, as many as a member reads with
    one perturbation)"""
    carried: Annotated[int, *flag("[0, inf)", training=True, before=0)] = 64
    """bytes before the window whose keys and values each member carries (0: none, each window
    read alone)"""


def transformer_context(cfg: Config) -> int:
    """The bytes the transformer reads at once: --context, or a segment's."""
    return cfg.model_flags.context or window_length(cfg)


def transformer_span(cfg: Config) -> int:
    """The most bytes a byte attends to: its window's and the carried ones before it."""
    return cfg.model_flags.carried + transformer_context(cfg)


def transformer_parameters(cfg: Config) -> dict[str, Parameter]:
    """Byte embedding, n_layer blocks (ln1, the attention's Wq Wk Wv Wo, ln2, the MLP's W1 W2), the
    output layer norm and the head; started as EGG's are."""
    n = cfg.n_embd
    square, gain = Parameter((n, n), True, True, None), Parameter((n,), True, False, GAIN_ONE)
    return {
        "emb": Parameter((VOCAB, n), False, True, None),
        "ln1": gain,
        "Wq": square,
        "Wk": square,
        "Wv": square,
        "Wo": square,
        "ln2": gain,
        "W1": Parameter((4 * n, n), True, True, None),
        "W2": Parameter((n, 4 * n), True, True, None),
        "ln_out": gain._replace(layered=False),
        "head": Parameter((VOCAB, n), False, True, None),
    }


def transformer_state(cfg: Config) -> tuple[int, ...]:
    """The last --carried bytes a member read, each a row (C, 1 + 2 L n): 1 where a byte after the
    window may attend it (in the current document), else 0; then its key and value at each layer,
    int8 at WEIGHT_FRAC. (0,) with none carried."""
    carried = cfg.model_flags.carried
    return (carried, 1 + 2 * cfg.n_layer * cfg.n_embd) if carried else (0,)


def transformer_begin(states_MxCxK, layout: tuple[int, int, int], cfg: Config):
    """(flags (C, R, D, S, 1) int8, keys and values (L, 2, C, R, D, S, n) as layer_carry makes
    them) of the members laid out (R, D, S) = layout."""
    carried, n, layers = cfg.model_flags.carried, cfg.n_embd, cfg.n_layer
    rows = jnp.moveaxis(states_MxCxK.reshape(layout + (carried, 1 + 2 * layers * n)), 3, 0)
    kv = rows[..., 1:].reshape(rows.shape[:4] + (layers, 2, n))  # (C, R, D, S, L, 2, n)
    return rows[..., :1], layer_carry(jnp.moveaxis(kv, (4, 5), (0, 1)), cfg)


def transformer_end(carried, cfg: Config):
    """The members' states (M, C, 1 + 2 L n) from transformer_begin's layout ((0,) with none)."""
    flags, kv = carried
    kv = jnp.moveaxis(jnp.stack(kv), (0, 1), (4, 5))  # (C, R, D, S, L, 2, n)
    rows = jnp.concatenate([flags, kv.reshape(kv.shape[:4] + (2 * cfg.n_layer * cfg.n_embd,))], -1)
    return jnp.moveaxis(rows, 0, 3).reshape((math.prod(rows.shape[1:4]),) + transformer_state(cfg))


def score_multiplier(width: int) -> int:
    """q k^T of a head `width` wide (q, k at WEIGHT_FRAC) as a score at LOGIT_FRAC, log2-units:
    scaled by 1 / sqrt(width), then by log2(e) (a softmax's e**x is 2**(x log2 e)), at SCORE_FRAC.
    A constant of the configuration, made on the host as the tables are."""
    real = 2**LOGIT_FRAC * math.log2(math.e) / (2 ** (2 * WEIGHT_FRAC) * math.sqrt(width))
    return round(real * 2**SCORE_FRAC)


def distance_slopes(heads: int) -> np.ndarray:
    """Each head's score is lowered by its slope times the distance back, at SLOPE_FRAC in
    LOGIT_FRAC units a byte: ALiBi's slopes 2**(-8 (h + 1) / H) nats a byte (h = 0 .. H - 1) in
    log2-units, int64 (H,), made on the host: at H = 2, 1.44 and 0.09 sixteenths of a bit."""
    nats = 2.0 ** (-8 * (np.arange(heads) + 1) / heads)
    return np.round(nats * math.log2(math.e) * 2 ** (LOGIT_FRAC + SLOPE_FRAC)).astype(np.int64)


def attention_weights(scores, allowed, tables: Tables):
    """Each row's softmax over its last axis where allowed, as int8 at PROB_FRAC (0 elsewhere):
    scores int8 at LOGIT_FRAC. With d = top - score in [0, 254] (top: the row's largest allowed)
    and l = log2 of the sum of 2**(-d/16) (log2_of_sum, >= 0), p = 2**(-(d + l)/16) read from
    exp2_frac, floored to PROB_FRAC bits (the top's at most 2**PROB_FRAC, clipped to 127)."""
    s = jnp.where(allowed, scores.astype(i32), -INT8_MAX)
    d = jnp.max(s, axis=-1, keepdims=True) - s
    exp2_frac = jnp.asarray(tables.exp2_frac)
    terms = jnp.where(allowed, exp2_frac[d & 15] >> (d >> 4), 0)
    log2_s = log2_of_sum(jnp.sum(terms, axis=-1, keepdims=True), tables)
    sixteenths = d + ((log2_s + (1 << (LL_FRAC - LOGIT_FRAC - 1))) >> (LL_FRAC - LOGIT_FRAC))
    shift = jnp.minimum((sixteenths >> LOGIT_FRAC) + EXP_FRAC - PROB_FRAC, 31)
    p = jnp.minimum(exp2_frac[sixteenths & 15] >> shift, INT8_MAX)
    return jnp.where(allowed, p, 0).astype(jnp.int8)


def attention(q, k, v, allowed, w: Perturbed, cfg: Config):
    """Causal attention of every member over its window and the bytes carried before it: q (T, R,
    D, S, n), k and v (U, R, D, S, n) (the U - T carried, then the window's), int8 at WEIGHT_FRAC;
    allowed (R, D, S, T, U) the bytes each byte reads (attention_mask). Each head's score
    q k^T / sqrt(width) in log2-units, less floor(slope x distance) (distance_slopes), clipped to
    int8. Returns (T, R, D, S, n) int8: each head's sum p v at PROB_FRAC, floored back to v's
    scale."""
    width = cfg.model_flags.head_width

    def heads(x):  # (T, R, D, S, H, width)
        return x.reshape(x.shape[:-1] + (-1, width))

    # each product at least DOT_DEPTH deep: zeros added to what it sums over
    q_, k_ = (deepened(heads(x), -1, DOT_DEPTH) for x in (q, k))
    qk = jnp.einsum("trdshc,urdshc->rdshtu", q_, k_, preferred_element_type=i32)
    span, length = k.shape[0], q.shape[0]  # each query's distance to each key, (T, U)
    distance = np.maximum(np.arange(span - length, span)[:, None] - np.arange(span)[None, :], 0)
    bias = (distance_slopes(q.shape[-1] // width)[:, None, None] * distance) >> SLOPE_FRAC
    scores = ((qk * score_multiplier(width)) >> SCORE_FRAC) - jnp.asarray(bias, i32)  # (H, T, U)
    p = attention_weights(clip_int8(scores), allowed[..., None, :, :], w.tables)  # (R,D,S,H,T,U)
    p, values = deepened(p, -1, DOT_DEPTH), deepened(heads(v), 0, DOT_DEPTH)
    out = jnp.einsum("rdshtu,urdshc->trdshc", p, values, preferred_element_type=i32)
    return clip_int8(out >> PROB_FRAC).reshape(q.shape)


def attention_mask(bytes_TxRxDxS, flags_CxRxDxSx1):
    """The bytes each byte of a window reads, (R, D, S, T, C + T): the carried ones its document
    may read (flags 1) while no byte 0 comes before it in the window, then itself and those before
    it in its document (a byte 0 starts one, as it restarts EGG's state)."""
    documents = jnp.moveaxis(jnp.cumsum(bytes_TxRxDxS == 0, axis=0), 0, -1)  # (R, D, S, T)
    places = jnp.arange(bytes_TxRxDxS.shape[0])
    before = places[:, None] >= places[None, :]
    within = before & (documents[..., :, None] == documents[..., None, :])
    carried = jnp.moveaxis(flags_CxRxDxSx1[..., 0] != 0, 0, -1)  # (R, D, S, C)
    seen = carried[..., None, :] & (documents == 0)[..., None]
    return jnp.concatenate([seen, within], axis=-1)


def transformer_block(x, kv, allowed, layer, w: Perturbed, cfg: Config):
    """One block of every member: attention over its window and its carried keys and values kv
    (2, C, R, D, S, n), then an MLP (n -> 4n -> n, a ReLU between), each after its layer norm and
    joining the residual stream; the new stream, the last C bytes' keys and values, and
    activations."""
    q, k, v = products(w, x, ("Wq", "Wk", "Wv"), layer, gain="ln1")
    keys, values = jnp.concatenate([kv[0], k]), jnp.concatenate([kv[1], v])  # (C + T, R, D, S, n)
    attended = attention(q, keys, values, allowed, w, cfg)
    (x,) = products(w, attended, ("Wo",), layer, residual=x)
    (hidden,) = products(w, x, ("W1",), layer, gain="ln2")
    hidden = jnp.maximum(hidden, 0)
    (x,) = products(w, hidden, ("W2",), layer, residual=x)
    kept = jnp.stack([keys, values])[:, x.shape[0] :]
    return x, kept, {"attended": attended, "mlp_hidden": hidden, "residual": x}


def transformer_window(w: Perturbed, carried, bytes_TxRxDxS, cfg: Config):
    """A window's logits (T, R, D, S, 256), the state carried past it (transformer_begin's
    layout: the last C bytes of the carried ones and the window's) and activations (T, [L,] R, D,
    S, width)."""
    flags, kv = carried
    length = bytes_TxRxDxS.shape[0]
    embedding = embed(w, "emb", bytes_TxRxDxS)
    allowed = attention_mask(bytes_TxRxDxS, flags)

    def layer(x, kv, at):
        return transformer_block(x, kv, allowed, at, w, cfg)

    x, kv, seen = each_layer(layer, embedding, kv, cfg)
    (logits,) = products(w, x, ("head",), gain="ln_out")
    seen = {k: jnp.moveaxis(a, 0, 1) for k, a in seen.items()}  # each (T, L, R, D, S, width)
    # a byte stays attendable while no byte 0 follows it: those carried while the window has none
    documents = jnp.cumsum(bytes_TxRxDxS == 0, axis=0)[..., None]  # (T, R, D, S, 1)
    ahead = jnp.concatenate([flags * (documents[-1:] == 0), documents == documents[-1:]])
    flags = ahead[length:].astype(jnp.int8)
    return logits, (flags, kv), {"embedding": embedding, **seen, "logits": logits}


def transformer_bounds(cfg: Config) -> dict[str, tuple[int, str]]:
    """Its products' (the widest input: 4 n), a head's scores, attention's sum and its p v over
    the longest span a byte reads (the carried bytes and a window)."""
    width, span = cfg.model_flags.head_width, transformer_span(cfg)
    shorter, score = (
        "a smaller --carried or --context",
        width * INT8_MAX**2 * score_multiplier(width),
    )
    slope = int(distance_slopes(max(cfg.n_embd // width, 1))[0])  # the steepest head's
    return {
        **product_bounds(4 * cfg.n_embd, cfg.rank),
        "a head's score q k^T times its multiplier": (score, "a smaller --head_width"),
        "a head's score less its distance bias": (
            (score >> SCORE_FRAC) + ((slope * span) >> SLOPE_FRAC),
            shorter,
        ),
        "attention's sum of 2**(-d/16)": (span * 2**EXP_FRAC, shorter),
        "attention's sum p v": (span * INT8_MAX**2, shorter),
    }


def transformer_traffic(cfg: Config) -> int:
    """Every product's int8 input and output and the residual stream, 18 n a layer, with each
    head's scores and probabilities over its span, 4 H (C + W), and the carried keys and values
    read, 2 n C / W (C carried, W the window); 2 n + 2 x 256 around them."""
    heads, window = cfg.n_embd // cfg.model_flags.head_width, transformer_context(cfg)
    carried = cfg.model_flags.carried
    layer = 18 * cfg.n_embd + 4 * heads * transformer_span(cfg) + 2 * cfg.n_embd * carried // window
    return layer * cfg.n_layer + 2 * cfg.n_embd + 2 * VOCAB


def transformer_check(cfg: Config) -> str:
    """--head_width divides --n_embd."""
    width = cfg.model_flags.head_width
    if cfg.n_embd % width:
        return f"--head_width {width} does not divide --n_embd {cfg.n_embd}"
    return ""


MODELS = {
    "egg": Model(
        egg_parameters,
        egg_state,
        egg_begin,
        egg_end,
        step=egg_step,
        window=None,
        groups=EGG_GROUPS,
        bounds=egg_bounds,
        traffic=egg_traffic,
    ),
    "mingru": Model(
        mingru_parameters,
        egg_state,
        egg_begin,
        egg_end,
        step=partial(egg_step, block=partial(egg_block, gru=mingru_gru)),
        window=None,
        groups=(("Wf", "Wh"), ("W1",), ("W2",), ("head",)),
        bounds=egg_bounds,
        traffic=mingru_traffic,
    ),
    "transformer": Model(
        transformer_parameters,
        transformer_state,
        transformer_begin,
        transformer_end,
        step=None,
        window=transformer_window,
        groups=(("Wq", "Wk", "Wv"), ("Wo",), ("W1",), ("W2",), ("head",)),
        bounds=transformer_bounds,
        traffic=transformer_traffic,
        flags=TransformerFlags,
        check=transformer_check,
        context=transformer_context,
        resolve=lambda flags, cfg: replaced(flags, context=transformer_context(cfg)),
    ),
}


def parameters_of(cfg: Config) -> dict[str, Parameter]:
    """The model's parameters (its entry's), in the noise stream's order."""
    return MODELS[cfg.model].parameters(cfg)


def full_shape(p: Parameter, cfg: Config) -> tuple[int, ...]:
    """A parameter's shape as stored: layered ones with a leading n_layer axis."""
    return ((cfg.n_layer,) if p.layered else ()) + p.shape


def init_params(cfg: Config, seed):
    """One model's parameters from its seed, a dict of int8 arrays. Those that start random are
    ~ N(0, s^2) at WEIGHT_FRAC, s = init_std, drawn from the same quantile table as the noise (std
    2**NOISE_FRAC, |entries| <= 46) and scaled by s / 2**NOISE_FRAC, rounded half away from zero:
    |q| <= 46 x 32 / 16 = 92 at s <= 32 (no floating point)."""
    tables = make_tables(cfg.rank)
    key = jax.random.fold_in(jax.random.key(seed, impl="threefry2x32"), 0)  # 1: noise
    params = {}
    for i, (name, p) in enumerate(parameters_of(cfg).items()):
        shape = full_shape(p, cfg)
        if p.start is None:
            bits = jax.random.bits(jax.random.fold_in(key, i), shape, jnp.uint8)
            gauss = jnp.asarray(tables.gauss)[bits].astype(i32)
            params[name] = round_shift(gauss * cfg.init_std, NOISE_FRAC).astype(jnp.int8)
        else:
            params[name] = jnp.full(shape, p.start, jnp.int8)
    return params


# ------------------------------------------------------------------------------------------------
# Forward: the fitness of every member of one replica, the log2-likelihood of the bytes it read.


def perturbed(params, noise, sides: Sides, cfg: Config) -> Perturbed:
    """The Perturbed of one replica's parameters {name: ([L,] ...)} and noise ({name: (D, [L,]
    ...)}, or None): matrices shared, vectors each member's own, layered ones layer axis first."""
    weights, matrix_noise, layered = {}, {}, set()
    for name, p in parameters_of(cfg).items():
        nz = None if noise is None else noise[name]
        if p.layered:
            layered.add(name)
        if p.matrix:  # shared by every member
            weights[name] = params[name]
            if nz is not None:
                matrix_noise[name] = (
                    jax.tree.map(lambda x: jnp.moveaxis(x, 1, 0), nz) if p.layered else nz
                )
        else:  # each member's own: ([L,] 1, D, S, n)
            vector = perturbed_vector(params[name], nz, sides)
            weights[name] = jnp.moveaxis(vector, 3, 0) if p.layered else vector
    matrix_noise = None if noise is None else matrix_noise
    operands = None
    if cfg.kernels != "xla":
        operands = kernel_operands(weights, matrix_noise, MODELS[cfg.model].groups, layered)
    tables, interpret = make_tables(cfg.rank), cfg.kernels == "interpret"
    shift = cfg.residual_shift
    options = cfg.kernel_options
    return Perturbed(
        weights, matrix_noise, sides, tables, operands, interpret, options, shift, cfg.replicas
    )


def read_windows(w: Perturbed, carried, bytes_TxRxDxS, cfg: Config):
    """A window model's logits (T, R, D, S, 256), what it carries after them and its activations
    over T bytes, read a window (its context's bytes) at a time in turn, each window carrying on
    from the one before; the last one shorter where T is not a multiple."""
    model = MODELS[cfg.model]
    window = model.context(cfg)
    full, rest = divmod(bytes_TxRxDxS.shape[0], window)
    parts = []
    if full == 1:
        logits, carried, seen = model.window(w, carried, bytes_TxRxDxS[:window], cfg)
        parts.append((logits, seen))
    elif full:

        def read(carried, bytes_now):
            logits, carried, seen = model.window(w, carried, bytes_now, cfg)
            return carried, (logits, seen)

        split = bytes_TxRxDxS[: full * window]
        carried, out = jax.lax.scan(read, carried, split.reshape((full, window) + split.shape[1:]))
        parts.append(jax.tree.map(lambda x: x.reshape((full * window,) + x.shape[2:]), out))
    if rest:
        logits, carried, seen = model.window(w, carried, bytes_TxRxDxS[full * window :], cfg)
        parts.append((logits, seen))
    logits, seen = jax.tree.map(lambda *x: jnp.concatenate(x), *parts)
    return logits, carried, seen


def window_step(w: Perturbed, carried, byte_RxDxS, cfg: Config):
    """A window model reading one byte, as a byte model's step (write and --sample read so):
    carried = (its own carried state, the window so far (W, R, D, S) uint8, its bytes (R, D, S)
    int32). The byte's logits are the window's read so far (zeros after it: none is read); a full
    window's state is carried on and a new window begun. A byte 0 begins a new window: a document
    (a prompt, --sample's text) read from its start, its windows where training would cut them
    had it started one."""
    state, buffer, filled = carried
    filled = jnp.where(byte_RxDxS == 0, 0, filled)
    places = jnp.arange(buffer.shape[0]).reshape(-1, 1, 1, 1)
    buffer = jnp.where(places == filled, byte_RxDxS, jnp.where(places < filled, buffer, 0))
    logits, after, _ = MODELS[cfg.model].window(w, state, buffer, cfg)
    logits = jnp.take_along_axis(logits, filled[None, ..., None], axis=0)[0]
    filled = filled + 1
    full = filled == buffer.shape[0]
    state = jax.tree.map(lambda a, b: jnp.where(full[..., None], a, b), after, state)
    return logits, (state, buffer, jnp.where(full, 0, filled)), None


def reading(cfg: Config, count: int, layout: tuple[int, int, int]):
    """(step, carried): how count members laid out (R, D, S) = layout read bytes one at a time
    from zero states: a byte model's step, or a window model's window_step."""
    model = MODELS[cfg.model]
    carried = model.begin(jnp.zeros((count,) + model.state(cfg), jnp.int8), layout, cfg)
    if model.window is None:
        return model.step, carried
    window = model.context(cfg)
    empty = (jnp.zeros((window,) + layout, jnp.uint8), jnp.zeros(layout, i32))
    return window_step, (carried, *empty)


def forward(params, noise, states_MxS, inputs_MxT, targets_MxT, sigma_shift, cfg: Config):
    """One replica's M members reading T bytes: their fitness_M int32 (the log2-likelihood sums at
    LL_FRAC) and their states after the last byte (M, ...). The one forward of training (with
    noise) and validation (noise None).

    params: each ([L,] ...); noise: each (D, [L,] ...) for D distinct pairs, M a multiple of 2 D, or
    None; sigma_shift () int32 (None without noise). The members' layout is made here, a reshape:
    member p = (r D + d) S + s has the axes (R, D, S)."""
    model, count = MODELS[cfg.model], states_MxS.shape[0]
    sides = 1 if noise is None else 2
    distinct = count // sides if noise is None else jax.tree.leaves(noise)[0].shape[0]
    layout = (count // (sides * distinct), distinct, sides)  # (R, D, S)
    w = perturbed(params, noise, make_sides(0 if noise is None else sigma_shift, sides), cfg)
    inputs, targets = (x.T.reshape((-1,) + layout) for x in (inputs_MxT, targets_MxT))
    carried = model.begin(states_MxS, layout, cfg)
    if model.window is not None:
        logits, carried, _ = read_windows(w, carried, inputs, cfg)
        ll_TxRxDxS = log2_likelihood(logits, targets, w.tables)
    else:

        def read(carried, io):
            logits, carried, _ = model.step(w, carried, io[0], cfg)
            return carried, log2_likelihood(logits, io[1], w.tables)

        carried, ll_TxRxDxS = jax.lax.scan(read, carried, (inputs, targets))
    return jnp.sum(ll_TxRxDxS, axis=0).reshape(count), model.end(carried, cfg)


# ------------------------------------------------------------------------------------------------
# Noise. Every entry is a pure function of (seed, generation // noise_reuse, pair, segment, offset)
# through JAX's counter-based threefry RNG: nothing is pre-sampled or stored between generations.
# One stream of bytes per pair is cut into every parameter's noise: matrices get rank-r factors
# A (m, r), B (n, r); vectors (and matrices under --rank 0) full-shape noise. Segment 0's stream
# is threefry's; segment s >= 1 remixes it with a cheap bijection keyed by s (mix_segment).


def noise_pieces(cfg: Config) -> list[tuple[str, tuple[int, ...], str]]:
    """(parameter, shape, table) of each piece of a pair's noise, in stream order."""
    pieces = []
    for name, p in parameters_of(cfg).items():
        layers = (cfg.n_layer,) if p.layered else ()
        if p.matrix and cfg.rank:  # A, B
            pieces.append((name, layers + (p.shape[0], cfg.rank), "gauss"))
            pieces.append((name, layers + (p.shape[1], cfg.rank), "gauss_rank"))
        else:
            pieces.append((name, layers + p.shape, "gauss"))
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
    """A pair's noise from its stream: {name: (A, B) or full-shape noise}, int8 at NOISE_FRAC;
    layered parameters carry a leading n_layer axis. Byte i (little-endian within each word)
    indexes the table of noise entry i, pieces in noise_pieces order."""
    tables = make_tables(cfg.rank)
    bits = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)
    noise, offset = {}, 0
    for name, shape, table in noise_pieces(cfg):
        size = math.prod(shape)
        values = jnp.asarray(getattr(tables, table))[bits[offset : offset + size].reshape(shape)]
        noise[name] = noise.get(name, ()) + (values,)
        offset += size
    return {name: parts if len(parts) == 2 else parts[0] for name, parts in noise.items()}


def noise_pairs(cfg: Config) -> int:
    """Pairs with their own noise in a generation: segment s's pair k is s D + k (D distinct)."""
    return cfg.segments * cfg.distinct_pairs


def scored_pairs(cfg: Config) -> int:
    """Pair scores one update weighs: every antithetic pair's, in every segment."""
    return cfg.segments * cfg.population // 2


def bucket_of(cfg: Config, generation):
    """The noise's counter for a generation: generations share it in buckets of --noise_reuse (one
    bucket for the whole run where cfg.noise_reuse is None)."""
    if cfg.noise_reuse is None:
        return jnp.zeros_like(generation)
    return generation // cfg.noise_reuse


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
# Objectives: what a member is scored on, its fitness (an int32; larger is better), which the
# shapings and the rules take as they come, knowing nothing of where it came from. An entry of
# OBJECTIVES carries what the rest derives from it: what it reads (a corpus's bytes, or a task's
# prompts), its members' fitness in the compiled step, the range of that fitness (every int32
# bound of a member's and of a pair's difference, which every shaping relies on), whether members
# carry their states from one generation to the next, the segments --segments 0 gives, the metric
# it is reported and validated by, the flags it trains with unless told, and its own flags.
# --objective picks one.
#
# likelihood: the log2-likelihood sum of the bytes a member reads (forward), the members' states
# carried on. reward: each member continues a prompt by bytes it writes itself, each drawn from its
# own perturbed int8 logits inside the step (write), integer only; a reward scores the completions,
# and the score, rounded to REWARD_FRAC, is the fitness. A reward is a Python function called on
# the host between two compiled calls (the members write, then the update: egg/tasks.py), or a
# built-in task's scorer in JAX inside the one step (scored_in_step).


def pair_mean(states):
    """--shared_pair_state: both members of each antithetic pair (members 2k, 2k + 1) get the mean
    of their two states, rounded half away from zero (int8: |mean| <= 127). states (M, ...)."""
    pairs = states.astype(i32).reshape((states.shape[0] // 2, 2) + states.shape[1:])
    mean = round_shift(pairs[:, 0] + pairs[:, 1], 1).astype(jnp.int8)
    return jnp.repeat(mean, 2, axis=0)


def population_fitness(cfg: Config, params, noise_of, states, tokens, sigma_shift, draws_of=None):
    """likelihood: every segment of this device's members of one replica in turn (a scan per
    segment length): their fitness (segments, members) and states. tokens (members, T + 1);
    noise_of(segment) their noise, or None (noise-free: inference); draws_of: unread (the members
    write nothing)."""
    members = tokens.shape[0]

    def segment(states, xs):
        index, inputs, targets = xs
        if cfg.shared_pair_state:
            states = pair_mean(states)
        fitness, states = forward(
            params, noise_of(index), states, inputs, targets, sigma_shift, cfg
        )
        return states, fitness

    parts, segment_start, token_start = [], 0, 0
    for count, length in segment_lengths(cfg):

        def cut(x, a=token_start, n=count, length=length):  # (n, members, length): each segment's
            return jnp.moveaxis(x[:, a : a + n * length].reshape(members, n, length), 1, 0)

        indices = segment_start + jnp.arange(count)
        segments = (indices, cut(tokens[:, :-1]), cut(tokens[:, 1:]))
        states, out = jax.lax.scan(segment, states, segments)
        parts.append(out)
        segment_start, token_start = segment_start + count, token_start + count * length
    return jnp.concatenate(parts), states


@dataclass(frozen=True)
class RewardFlags:
    """the reward objective's own flags (--objective reward)"""

    completion_bytes: Annotated[int, *flag("[1, 4096]", training=True)] = 32
    """bytes each member writes after its prompt, at most (it stops at the task's --stop byte)"""
    completion_temperature: Annotated[
        float, *flag("[0, 16]", training=True, why="the Gumbel-max trick's int32 sum")
    ] = 0.0
    """0: each member writes its most likely byte; else draws it at this temperature (both members
    of a pair with the same random bits)"""


class Prompts(NamedTuple):
    """The reward objective's inputs: every group's prompt of every segment, (groups, segments, L)
    uint8, its bytes at the right and byte 0 before (a byte 0 restarts a byte model's state and
    starts a window model's document: the prompt is read from a fresh start); and what an in-step
    scorer compares completions with, (groups, segments, A) uint8 (A = 0 without one)."""

    prompts: Any
    answers: Any


def choose_bytes(logits, bits, temperature: int, tables: Tables):
    """The byte each member writes from its logits (..., 256) int8 at LOGIT_FRAC: at temperature 0
    its most likely one (the lowest of equals); else a draw of byte b with probability ~
    2**(logit_b / (16 t)), t = temperature / 2**TEMPERATURE_FRAC, by the Gumbel-max trick in
    integers: the largest logit x 2**TEMPERATURE_FRAC + temperature x gumbel[bits], bits (..., 256)
    the members' random indices into the table (|that| <= 127 x 16 + 208 x 256: int32)."""
    if not temperature:
        return jnp.argmax(logits, axis=-1).astype(jnp.uint8)
    noise = jnp.asarray(tables.gumbel)[bits].astype(i32) * temperature
    scores = (logits.astype(i32) << TEMPERATURE_FRAC) + noise
    return jnp.argmax(scores, axis=-1).astype(jnp.uint8)


def temperature_of(cfg: Config) -> int:
    """--completion_temperature as choose_bytes takes it: round(t x 2**TEMPERATURE_FRAC); 0 where
    the objective writes nothing."""
    if not isinstance(cfg.objective_flags, RewardFlags):
        return 0
    return round(cfg.objective_flags.completion_temperature * 2**TEMPERATURE_FRAC)


def pair_draws(cfg: Config, seed, generation, segment, pairs):
    """The random bits of the bytes pairs write in a segment, (completion_bytes, P, 256) uint16 in
    [0, 2**GUMBEL_BITS): threefry's, keyed by (seed, 2, generation, segment, pair) for pairs (P,)
    int32, each pair's index in the population: both members of a pair draw with the same bits,
    and a pair's draws depend on nothing but its index (not on the devices)."""
    root = jax.random.fold_in(jax.random.key(seed, impl="threefry2x32"), 2)  # 0: init, 1: noise
    key = jax.random.fold_in(jax.random.fold_in(root, generation), segment)
    shape = (cfg.objective_flags.completion_bytes, VOCAB)

    def bits(pair):
        return jax.random.bits(jax.random.fold_in(key, pair), shape, jnp.uint16)

    return jnp.moveaxis(jax.vmap(bits)(pairs) >> (16 - GUMBEL_BITS), 0, 1)


def draw_sources(cfg: Config, seed, generation, start, members: int):
    """draws_of(segment): the draws (pair_draws) of this device's `members` members, whose first is
    `start`, or None where they write greedily (--completion_temperature 0) or write nothing."""
    if not temperature_of(cfg):
        return None
    pairs = start // 2 + jnp.arange(members // 2)
    return lambda segment: pair_draws(cfg, seed, generation, segment, pairs)


def write(params, noise, prompts_MxL, bits, sigma_shift, cfg: Config):
    """Each of one replica's M members continuing its prompt (prompts_MxL uint8, as Prompts has
    them) by up to completion_bytes bytes, each drawn from the member's own logits (choose_bytes;
    bits (C, M / 2, 256) of each pair, or None: greedy), ending at the task's stop byte or at byte 0
    (a document's end): (M, C) uint8, each completion's bytes, then zeros (its stop byte not among
    them). noise and sigma_shift as forward's.

    Every model reads the prompt byte by byte from zero states, then each byte it writes (a window
    model by window_step: the prompt's document begun at its byte 0, its windows cut from there,
    nothing carried from before it)."""
    count = prompts_MxL.shape[0]
    sides = 1 if noise is None else 2
    distinct = count // sides if noise is None else jax.tree.leaves(noise)[0].shape[0]
    layout = (count // (sides * distinct), distinct, sides)  # (R, D, S)
    w = perturbed(params, noise, make_sides(0 if noise is None else sigma_shift, sides), cfg)
    length = cfg.objective_flags.completion_bytes
    step, carried = reading(cfg, count, layout)

    def read(carried, byte):  # the state after all of the prompt but its last byte
        return step(w, carried, byte, cfg)[1], None

    prompts = prompts_MxL.T.reshape((-1,) + layout)  # (L, R, D, S)
    state = jax.lax.scan(read, carried, prompts[:-1])[0]
    temperature, tables = temperature_of(cfg), w.tables
    pairs = (layout[0], layout[1], 1, VOCAB)  # a pair's draws, against the members' axes

    def write_byte(carry, bits_now):
        state, byte, ended = carry
        logits, state, _ = step(w, state, byte, cfg)
        drawn = None if bits_now is None else bits_now.reshape(pairs)
        new = choose_bytes(logits, drawn, temperature, tables)
        ended = ended | (new == cfg.stop) | (new == 0)
        return (state, new, ended), jnp.where(ended, 0, new).astype(jnp.uint8)

    start = (state, prompts[-1], jnp.zeros(layout, bool))
    out = jax.lax.scan(write_byte, start, bits, length=length)[1]  # (C, R, D, S)
    return jnp.moveaxis(out, 0, -1).reshape(count, length)


def population_completions(cfg: Config, params, noise_of, prompts, sigma_shift, draws_of):
    """Every segment of this device's members of one replica in turn: what each wrote, (segments,
    members, C) uint8. prompts (members, segments, L): each member's of each segment;
    noise_of(segment), draws_of(segment) (or None: greedy) their noise and draws."""

    def segment(_, xs):
        index, prompts_now = xs
        bits = None if draws_of is None else draws_of(index)
        return None, write(params, noise_of(index), prompts_now, bits, sigma_shift, cfg)

    segments = (jnp.arange(cfg.segments), jnp.moveaxis(prompts, 1, 0))
    return jax.lax.scan(segment, None, segments)[1]


def reward_fitness(cfg: Config, params, noise_of, states, inputs: Prompts, sigma_shift, draws_of):
    """reward, scored in the step (scored_in_step): what the members wrote, scored by the built-in
    task's scorer in JAX (egg/tasks.py's, at REWARD_FRAC): their fitness (segments, members) and
    their states, unchanged (none are carried)."""
    written = population_completions(cfg, params, noise_of, inputs.prompts, sigma_shift, draws_of)
    score = partial(tasks.SCORERS[cfg.scorer], frac=REWARD_FRAC)
    fitness = jax.vmap(score)(written, jnp.moveaxis(inputs.answers, 1, 0))
    return jnp.clip(fitness, -REWARD_LIMIT, REWARD_LIMIT), states


def reward_as_fitness(rewards: np.ndarray) -> np.ndarray:
    """Rewards (float) as members' fitness, int32: round(reward x 2**REWARD_FRAC) to the nearest
    (ties to even), clipped to +-REWARD_LIMIT."""
    scaled = np.rint(np.asarray(rewards, np.float64) * 2**REWARD_FRAC)
    return np.clip(scaled, -REWARD_LIMIT, REWARD_LIMIT).astype(np.int32)


class Objective(NamedTuple):
    """What a member is scored on.

    reads: "bytes" (a corpus: --data, or a --task's worked examples) or "prompts" (a --task's)
    fitness(cfg, params, noise_of, states, inputs, sigma_shift, draws_of) -> (fitness_SxM int32,
    states): this device's members' fitness of every segment in the step (scored_in_step), inputs
    their bytes (members, T + 1) or Prompts (members, segments, ...), draws_of their draws
    span(cfg) -> (least, most, what would shrink it): the range of a member's fitness (a pair's
    difference, the shapings' input, at most most - least)
    value(fitness, cfg) -> float: a member's fitness summed over the segments in the metric's units
    metric, higher: the name it is reported and validated by (train/METRIC, val/METRIC), and
    whether higher is better
    carries: whether members carry their states from one generation to the next (else they start
    every segment afresh, and keep none)
    segments: --segments 0 gives this many segments, or fewer where the int32 bounds require
    preset: {flag: value} it trains with where a run does not give the flag (nor --algorithm
    upstream set it), chosen by measurement (docs/results.org)
    flags: its own flags (a frozen flags dataclass beside it), or None"""

    reads: str
    fitness: Callable
    span: Callable[[Config], tuple[int, int, str]]
    value: Callable[[Any, Config], float]
    metric: str
    higher: bool
    carries: bool
    segments: int
    preset: dict
    flags: type | None = None


# |log2 p(target)| at LL_FRAC: the target 254 logit steps below the top (254 * 16), plus log2 s
# for s <= 2**28 (2**LL_FRAC per bit above EXP_FRAC, one more for the mantissa)
LL_BOUND = 254 * 2 ** (LL_FRAC - LOGIT_FRAC) + (28 - EXP_FRAC + 1) * 2**LL_FRAC


OBJECTIVES = {
    "likelihood": Objective(
        "bytes",
        population_fitness,
        # both members' fitness in [-LL_BOUND T, 0]
        span=lambda cfg: (-LL_BOUND * cfg.tokens, 0, "a smaller --tokens_per_update"),
        value=lambda fitness, cfg: -float(fitness) / (cfg.tokens * 2**LL_FRAC),  # bits/byte
        metric="bits_per_byte",
        higher=False,
        carries=True,
        segments=AUTO_SEGMENTS,
        preset={},
    ),
    "reward": Objective(
        "prompts",
        reward_fitness,
        span=lambda cfg: (-REWARD_LIMIT, REWARD_LIMIT, "nothing: rewards are clipped"),
        # a completion's mean reward
        value=lambda fitness, cfg: float(fitness) / (cfg.segments * 2**REWARD_FRAC),
        metric="reward",
        higher=True,
        carries=False,
        segments=1,
        # a reward's pairs mostly tie: scores in units of their root mean square keep the Z-test's
        # null (standardised); a fixed share, where the schedule would start at 1 and move every
        # entry of the model a run starts from (docs/design.org, docs/results.org: "Rewards")
        preset={"shaping": "standardised", "alpha": 0.2},
        flags=RewardFlags,
    ),
}


def scored_in_step(cfg: Config) -> bool:
    """Whether the members' fitness is made in the compiled step: an objective's that reads bytes
    always, one that reads prompts where the task has a scorer in JAX and no --reward replaces it
    (egg/tasks.py); else the host scores what they wrote between the writing and the update: the
    one place that chooses."""
    return OBJECTIVES[cfg.objective].reads == "bytes" or cfg.scorer is not None


def member_bytes(cfg: Config) -> int:
    """Bytes each member reads (an objective that reads bytes) or writes at most (one that reads
    prompts) a generation: what perf/tokens_per_s counts."""
    if OBJECTIVES[cfg.objective].reads == "bytes":
        return cfg.tokens
    return cfg.segments * cfg.objective_flags.completion_bytes


def carried_state(cfg: Config) -> tuple[int, ...]:
    """The shape of the state each member carries from one generation to the next: its model's
    where its objective carries states, else none, (0,)."""
    return MODELS[cfg.model].state(cfg) if OBJECTIVES[cfg.objective].carries else (0,)


# ------------------------------------------------------------------------------------------------
# Fitness shapings: how each antithetic pair's two fitnesses (member 2k's, which adds its noise, and
# member 2k + 1's, which subtracts it) become its int8 score, the pair's weight in Z. An entry of
# SHAPINGS carries what the rest derives from it: the Z-test's null (the scores' root mean square
# when fitness is unrelated to the noise), Z's int8 operand and int32 bounds (the largest |score|:
# scores are clipped to it where they are made), the worst case of any int32 sum of its own, and
# its own flags. --shaping picks one.


class Shaping(NamedTuple):
    """A fitness shaping: scores(fitness, pairs, axis, flags) -> int8 scores in [-largest, largest]
    of each pair, from fitness_...xQx2 int32 (each pair's two members' fitness, side 0 first),
    `pairs` pairs in all, spread over the mesh axis `axis` (None: all here), any leading axes (the
    segments); rms(flags, pairs) their null root mean square when they are made of `pairs` pairs
    (scored_pairs); bounds(cfg) the worst cases of its own int32
    sums, {name: value} (they grow with the pairs an update weighs); flags: its own (a frozen flags
    dataclass beside it), or None, which scores and rms are given."""

    scores: Callable
    largest: int
    rms: Callable[[Any], float]
    bounds: Callable[[Config], dict]
    flags: type | None = None


def differences(fitness):
    """Each pair's fitness difference (..., Q) int32: side 0's (+noise) less side 1's (-noise)."""
    return fitness[..., 0] - fitness[..., 1]


def sign_scores(fitness, pairs: int, axis, flags):
    """upstream's (--fast_fitness): the sign of each pair's difference."""
    return jnp.sign(differences(fitness)).astype(jnp.int8)


def remainders_chunk(pairs: int) -> int:
    """How many remainders v mod pairs (each < pairs) floor_mean sums at a time: as many as keep
    the sum int32."""
    return max(1, INT32_MAX // pairs)


def floor_mean(values, pairs: int, axis):
    """floor(sum / pairs) of non-negative int32 values over every pair (spread over the mesh axis
    `axis`, or all here with None), exactly, without a wider type: sum floor(v / pairs) + floor(sum
    (v mod pairs) / pairs), the second sum taken in chunks whose sums stay int32 (remainders_chunk):
    sum floor(c / pairs) over the chunks' sums c, plus floor(sum (c mod pairs) / pairs), under
    chunks x pairs (mean_bounds)."""
    rest = (values % pairs).reshape(-1)
    # no longer than the remainders: no padding beyond
    chunk = min(remainders_chunk(pairs), rest.size)
    sums = jnp.sum(jnp.pad(rest, (0, -rest.size % chunk)).reshape(-1, chunk), axis=1)
    parts = jnp.stack([jnp.sum(values // pairs), jnp.sum(sums // pairs), jnp.sum(sums % pairs)])
    quotients, chunked, rests = jax.lax.psum(parts, axis) if axis is not None else parts
    return quotients + chunked + rests // pairs


def ratio_bits(size, divisor, bits: int, most: int):
    """min(floor(2**bits x size / divisor), most) of int32 sizes >= 0 and divisors >= 1, for every
    int32 without a wider type: the quotient, then the fraction's bits by long division (the rest
    < divisor < 2**31: twice it fits uint32)."""
    quotient, rest = size // divisor, (size % divisor).astype(jnp.uint32)
    divisor = divisor.astype(jnp.uint32)
    scaled = jnp.minimum(quotient, most >> bits)  # more saturates below
    for _ in range(bits):
        rest = rest * 2
        bit = rest >= divisor
        rest = jnp.where(bit, rest - divisor, rest)
        scaled = scaled * 2 + bit.astype(i32)
    return jnp.where(quotient > most >> bits, most, scaled)


def normalised_scores(fitness, pairs: int, axis, flags):
    """sign(d) min(floor(2**FIT_FRAC |d| / m), 127) of each pair's difference d, m the floor mean
    |d| over every pair (at least 1), exactly for every int32 d without a wider type."""
    diff = differences(fitness)
    size = jnp.abs(diff)
    mean = jnp.maximum(floor_mean(size, pairs, axis), 1)
    return (jnp.sign(diff) * ratio_bits(size, mean, FIT_FRAC, INT8_MAX)).astype(jnp.int8)


def standardised_scores(fitness, pairs: int, axis, flags):
    """sign(d) min(round(2**STD_FRAC |d| / r), 127) of each pair's difference d, r the root mean
    square of every pair's, all int32: first q = min(floor(2**RMS_BITS |d| / m), 2**15 - 1), m
    the floor mean |d| (at least 1), then r = isqrt(floor(mean q**2)) (q**2 < 2**30) at q's
    scale, and the score rounded half up from 2**(STD_FRAC + 1) q < 2**19. A pair's score is its
    difference in units of the pairs' spread whatever their fitness's distribution: many ties (a
    reward's) or none (a likelihood's)."""
    diff = differences(fitness)
    size = jnp.abs(diff)
    mean = jnp.maximum(floor_mean(size, pairs, axis), 1)
    q = ratio_bits(size, mean, RMS_BITS, 2**15 - 1)
    root = jnp.maximum(isqrt(floor_mean(q * q, pairs, axis)), 1)  # 0: every pair tied
    score = (q * 2 ** (STD_FRAC + 1) + root) // (2 * root)
    return (jnp.sign(diff) * jnp.minimum(score, INT8_MAX)).astype(jnp.int8)


@cache
def normalised_rms(flags=None, pairs: int = 0) -> float:
    """The null root mean square of min(floor(16 |d| / mean|d|), 127) for normal d, over many
    pairs: exact from the normal CDF, as |d| / mean|d| = |z| sqrt(pi / 2) for a standard normal z
    (19.7, where the unfloored 16 sqrt(pi / 2) would say 20.1). Fewer pairs' mean holds each d, and
    their scores spread less: measured, 2% less at 8 pairs, 5% at 4, 19% at one (16: |d| is its
    own mean) (docs/design.org): the limit is kept at every count."""
    cdf = statistics.NormalDist().cdf
    width = math.sqrt(2 / math.pi) / 2**FIT_FRAC  # score k: |z| in [k width, (k + 1) width)
    second = sum(k * k * 2 * (cdf((k + 1) * width) - cdf(k * width)) for k in range(INT8_MAX))
    return math.sqrt(second + INT8_MAX**2 * 2 * (1 - cdf(INT8_MAX * width)))


def mean_bounds(cfg: Config) -> dict:
    """floor_mean's sum of the remainders v mod pairs: each chunk's below 2**31, their remainders'
    sum below (chunks + devices) x pairs."""
    pairs = scored_pairs(cfg)
    chunks = -(-pairs // remainders_chunk(pairs))
    return {
        "sum of a floor mean's remainders mod pairs (the shaping's)": (chunks + cfg.devices) * pairs
    }


def standardised_rms(flags=None, pairs: int = 0) -> float:
    """The null root mean square of round(8 |d| / r): the squares of d / r average exactly 1 over
    the pairs, whatever their distribution and count, and rounding adds 1/12 (the clip at 127, at
    16 root mean squares, is neglected: a pair beyond it needs fewer than 1 in 256 pairs to
    differ)."""
    return math.sqrt(2 ** (2 * STD_FRAC) + 1 / 12)


SHAPINGS = {
    "sign": Shaping(sign_scores, 1, lambda flags, pairs: 1.0, lambda cfg: {}),
    "normalised": Shaping(normalised_scores, INT8_MAX, normalised_rms, mean_bounds),
    "standardised": Shaping(standardised_scores, INT8_MAX, standardised_rms, mean_bounds),
}


def shape_fitness(fitness, cfg: Config, axis: str | None = None):
    """One int8 score per pair (--shaping's) from its two members' fitness: fitness (..., M) int32,
    members along the last axis, any leading axes (the segments). With `axis`, the pairs are spread
    over that mesh axis, and a shaping that needs all of them gathers them. The scores are clipped
    to the shaping's largest, which every bound derived from it assumes (tests/test_entries.py
    checks that no entry's scores need it)."""
    shaping = SHAPINGS[cfg.shaping]
    pairs = fitness.reshape(fitness.shape[:-1] + (-1, 2))
    count = pairs.size // 2 * (cfg.devices if axis is not None else 1)
    scores = shaping.scores(pairs, count, axis, cfg.shaping_flags)
    return jnp.clip(scores, -shaping.largest, shaping.largest).astype(jnp.int8)


def shaping_rms(cfg: Config) -> float:
    """The null root mean square of the run's shaping's scores, of every pair an update weighs."""
    return SHAPINGS[cfg.shaping].rms(cfg.shaping_flags, scored_pairs(cfg))


# ------------------------------------------------------------------------------------------------
# Update rules. Z of a parameter entry is its pairs' noise weighted by their scores, summed; when
# fitness is unrelated to the noise (the null) its spread is known exactly (null_std). An entry of
# RULES says how an entry moves given its Z, and what the rest derives from it: the threshold,
# z_(1 - alpha / 2) times the null spread of what the rule tests (so that a share alpha would
# pass under the null), and whether it reads one at all; the largest value what it tests can reach
# (a threshold beyond it is refused); its state per entry and that state's dtype (kept in
# checkpoints); its own flags, and the values it chooses where they say 0. --optimizer picks one.


class Evidence(NamedTuple):
    """What an update rule weighs for one parameter in a generation, besides its Z and state."""

    threshold: jax.Array  # () int32: z_(1 - alpha / 2) x spread(z_std), floored (z_thresholds)
    z_std: float  # Z's null std for this kind of parameter (null_std)
    weights: jax.Array  # (pairs,) int32: the pair weights Z was summed with
    null_square_sum: float  # their sum of squares' expected value under the null


class Sizes(NamedTuple):
    """What a rule's chosen settings may depend on."""

    parameters: int  # of one model
    pairs: int  # scored pairs an update weighs (scored_pairs)


class Rule(NamedTuple):
    """An update rule: step(z, state, evidence, flags) -> (moves, state), the int32 moves of each
    entry of a parameter (its Z, int32, the parameter's shape) and its new state ({slot: int32
    values within the slot's dtype}); spread(z_std, flags) the null std of what it tests; reach(
    z_reach, flags) the largest |that| for Z of at most z_reach; `tests` says what that is; state
    {slot: dtype}, every slot from 0 (stored in the dtype); alpha: whether it reads the threshold;
    flags: its own (a frozen flags dataclass beside it), or None; resolve(flags, Sizes): its flags
    with the values it chooses where they say 0 (None: it chooses none)."""

    step: Callable
    spread: Callable[[float, Any], float]
    reach: Callable[[int, Any], int]
    tests: str
    state: dict
    alpha: bool = True
    flags: type | None = None
    resolve: Callable[[Any, Sizes], Any] | None = None


def expected_square_sum(cfg: Config) -> float:
    """S_null: the expected sum of squared pair weights under the null, pairs x E[score**2]."""
    return scored_pairs(cfg) * shaping_rms(cfg) ** 2


@dataclass(frozen=True)
class ZTestFlags:
    """the Z-test's own flags (--optimizer ztest)"""

    null_from_scores: Annotated[bool, *flag(training=True)] = False
    """scale the null std by sqrt(this generation's sum of squared scores / its null mean)"""


def ztest_step(z, state, evidence: Evidence, flags: ZTestFlags):
    """upstream's Z-test: sign(Z) where |Z| > the threshold; with --null_from_scores the threshold
    times sqrt(S / S_null), S this generation's sum of squared pair weights."""
    threshold = evidence.threshold
    if flags.null_from_scores:
        square_sum = jnp.sum(evidence.weights * evidence.weights)
        threshold = scale_by_root(threshold, square_sum, evidence.null_square_sum)
    return jnp.sign(z) * (jnp.abs(z) > threshold), state


# --max_step 0: two steps at most from this many scored pairs an update (population / 2 x
# segments) or in a large model, one below (docs/results.org, "Population" and "The default
# model": two steps helped 256D-6L at 1,280 pairs, were level at 64D-2L, hurt 32D-1L)
STEP2_PAIRS = 10_000
# a large model (from this many parameters) moves up to two steps (--max_step 0), and its momentum
# keeps 7/8 of itself a generation, not 3/4 (--momentum_shift 0): each helped 256D-6L
# (docs/results.org, "The default model"); each was level at 64D-2L; nothing between their
# 131,648 and 4,856,064 parameters was measured
LARGE_MODEL = 1_000_000
MOMENTUM_SHIFT = 2  # --momentum_shift 0 below LARGE_MODEL: m keeps 3/4 of itself a generation
LARGE_MOMENTUM_SHIFT = 3  # from LARGE_MODEL: 7/8
INT16 = "its running sum is int16"


@dataclass(frozen=True)
class MomentumFlags:
    """the momentum rule's own flags (--optimizer momentum)"""

    momentum_shift: Annotated[int, *flag("[0, 7]", training=True, why=INT16)] = 0
    """its sum keeps 1 - 2**-shift of itself a generation (0: 3 from 1M parameters, else 2)"""
    max_step: Annotated[int, *flag("[0, 127]", training=True, upstream=1)] = 0
    """moves of up to this many steps (0: 2 from 10,000 pairs or 1M parameters, else 1)"""


def momentum_chooses(flags: MomentumFlags, sizes: Sizes) -> MomentumFlags:
    """--momentum_shift 0 and --max_step 0 chosen by the model's size and the pairs an update
    weighs."""
    large = sizes.parameters >= LARGE_MODEL
    shift = flags.momentum_shift or (LARGE_MOMENTUM_SHIFT if large else MOMENTUM_SHIFT)
    steps = flags.max_step or (2 if sizes.pairs >= STEP2_PAIRS or large else 1)
    return replaced(flags, momentum_shift=shift, max_step=steps)


def u_shift(z_std: float) -> int:
    """momentum: the right shift that takes Z to u, whose null std is then in [2**U_STD_BITS,
    2**(U_STD_BITS + 1)) (no shift when Z's is already smaller)."""
    return max(int(math.floor(math.log2(z_std))) - U_STD_BITS, 0)


def standardise(z, shift: int):
    """u = clip(round(Z / 2**shift), -127, 127), as int32."""
    reach = min(INT8_MAX << shift, INT32_MAX - (1 << shift))  # rounds to 127; no int32 overflow
    return jnp.clip(round_shift(jnp.clip(z, -reach, reach), shift), -INT8_MAX, INT8_MAX)


def momentum_step(z, state, evidence: Evidence, flags: MomentumFlags):
    """u = standardise(Z); m <- m - round(m / 2**momentum_shift) + u; the entry moves sign(m) x
    min(k, max_step) steps, k = floor(|m| / (threshold + 1)) the thresholds' worth m holds (k >= 1
    exactly where |m| > threshold), and m restarts at 0 where it moved: the evidence is spent on
    the move (docs/results.org). |u| <= 127, so |m| stays <= 127 x 2**shift <= 16256 for shifts
    <= 7 (int16: x - round(x / 2**k) + 127 <= 127 x 2**k for every x <= 127 x 2**k); a threshold
    of INT32_MAX (nothing moves) is divided by as INT32_MAX, not overflowed."""
    u = standardise(z, u_shift(evidence.z_std))
    m = state["m"].astype(i32) - round_shift(state["m"], flags.momentum_shift) + u
    held = jnp.abs(m) // (jnp.minimum(evidence.threshold, INT32_MAX - 1) + 1)
    steps = jnp.minimum(held, flags.max_step)
    return jnp.sign(m) * steps, {"m": jnp.where(steps > 0, 0, m)}


def momentum_spread(z_std: float, flags: MomentumFlags) -> float:
    """The null std of m = rho m + u, rho = 1 - 2**-momentum_shift: u's / sqrt(1 - rho**2) (u is
    independent from one generation to the next: every generation draws new noise), u's being Z's
    scaled by 2**-u_shift plus the rounding's variance 1/12 (none when the shift is 0; the clip to
    +-127 is more than 4 std out and is neglected)."""
    k = u_shift(z_std)
    u_std = math.sqrt((z_std / 2**k) ** 2 + (1 / 12 if k else 0))
    rho = 1 - 2.0**-flags.momentum_shift
    return u_std / math.sqrt(1 - rho**2)


RULES = {
    "ztest": Rule(
        ztest_step,
        spread=lambda z_std, flags: z_std,
        reach=lambda z_reach, flags: z_reach,
        tests="|Z|",
        state={},
        flags=ZTestFlags,
    ),
    "momentum": Rule(
        momentum_step,
        spread=momentum_spread,
        reach=lambda z_reach, flags: INT8_MAX << flags.momentum_shift,
        tests="running sum |m|",
        state={"m": jnp.int16},
        flags=MomentumFlags,
        resolve=momentum_chooses,
    ),
}


def weighted_max(cfg: Config) -> int:
    """Largest |w_j a| of a low-rank matrix's Z operand: a pair weight w_j (the scores of the pairs
    sharing noise j, summed) times an entry a of A (its sign under --no-use_clt)."""
    repeats = cfg.population // (2 * cfg.distinct_pairs)
    noise_max = int(np.abs(make_tables(cfg.rank).gauss).max()) if cfg.use_clt else 1
    return noise_max * repeats * SHAPINGS[cfg.shaping].largest


def weighted_shift(cfg: Config) -> int:
    """k of a low-rank matrix's Z operand round(w_j A_j / 2**k) (half away from zero), the smallest
    that keeps it int8, so that Z is an int8 x int8 product (2.2x faster than int16 x int8 on the
    CPU; the GPU's integer GEMMs take int8): 0 for sign scores (46 <= 127), 6 for normalised scores
    (127 x 46 = 5,842 -> 91), more where pairs share noise."""
    return next(k for k in range(32) if shifted(weighted_max(cfg), k) <= INT8_MAX)


@cache
def null_std(cfg: Config) -> tuple[float, float]:
    """Standard deviation of Z for a matrix entry and a vector entry when fitness is unrelated to
    the noise (the null), from the exact second moments of the noise tables (of their signs under
    --no-use_clt: the few zero entries count) and of the shaped scores. A low-rank matrix's Z sums
    round(w_j a / 2**k) b (weighted_shift): its variance is the exact one over 4**k, plus the
    rounding's (at most 1/12 a term: under 0.4% of it for normalised scores)."""
    tables = make_tables(cfg.rank)

    def second_moment(table):
        values = table.astype(np.float64) if cfg.use_clt else np.sign(table.astype(np.float64))
        return float(np.mean(values**2))

    a, b = second_moment(tables.gauss), second_moment(tables.gauss_rank)
    weighted = scored_pairs(cfg) * shaping_rms(cfg) ** 2 * a  # variance of sum_j w_j a_j
    if not cfg.rank:
        return math.sqrt(weighted), math.sqrt(weighted)
    k = weighted_shift(cfg)
    rounding = noise_pairs(cfg) / 12 if k else 0.0
    return math.sqrt((weighted / 4**k + rounding) * cfg.rank * b), math.sqrt(weighted)


def alpha_at(cfg: Config, replica: Replica, generation: int) -> float:
    """Share of parameters allowed to move at a generation (the test's two-sided level): the
    replica's alpha itself if <= 1, else upstream's 1 / ((2**alpha - 1) t / T + 1) for t =
    generation, T = alpha_decay_timestep: 1 at t = 0, 2**-alpha at t = T, decaying on, but never
    below --alpha_floor (upstream's has no floor). It depends on t only, not on --num_epochs, so a
    run extended on resume continues it exactly."""
    if replica.alpha <= 1:
        return replica.alpha
    decay = 1.0 / ((2.0**replica.alpha - 1.0) * generation / replica.alpha_decay_timestep + 1.0)
    return max(decay, cfg.alpha_floor)


def z_thresholds(cfg: Config, alpha: float) -> np.ndarray:
    """(2,) int32, for matrix / vector entries: floor(z x the rule's null spread) for z = z_(1 -
    alpha / 2), so that for the integer statistic, |it| > threshold exactly when |it| > z x spread.
    A level too small for float64 (1 - alpha / 2 rounds to 1) gets the largest int32: nothing
    moves."""
    z = statistics.NormalDist().inv_cdf(1 - alpha / 2) if 1 - alpha / 2 < 1 else math.inf
    rule = RULES[cfg.rule]
    spreads = np.array([rule.spread(std, cfg.rule_flags) for std in null_std(cfg)])
    return np.minimum(np.floor(z * spreads), INT32_MAX).astype(np.int32)


def replica_inputs(cfg: Config, replicas: list[Replica], generation: int) -> tuple:
    """The step's per-replica int32 arguments: thresholds (K, 2), seeds (K,), sigma_shifts (K,)."""
    thresholds = np.stack([z_thresholds(cfg, alpha_at(cfg, r, generation)) for r in replicas])
    seeds, sigma_shifts = np.array([(r.seed, r.sigma_shift) for r in replicas], np.int32).T
    return thresholds, seeds, sigma_shifts


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
        pairs = -(-DOT_DEPTH // b.shape[-1])  # the product sums over pairs and rank: DOT_DEPTH
        weighted, b = deepened(weighted, 0, pairs), deepened(b, 0, pairs)
        return jnp.einsum("k...mr,k...nr->...mn", weighted, b, preferred_element_type=i32)
    return jnp.einsum("k...,k->...", prepare(noise), weights, preferred_element_type=i32)


def z_statistics(noise, weights, cfg: Config) -> dict:
    """{parameter: Z} of these pairs' noise (leading axis: the pairs) and weights (pairs,)."""
    return {name: z_statistic(noise[name], weights, cfg) for name in parameters_of(cfg)}


def pair_weights(scores, cfg: Config):
    """(segments, distinct_pairs) int32: each noise's weight in Z, the scores (scored_pairs,),
    segment-major, of the pairs that share it summed."""
    repeats = cfg.population // (2 * cfg.distinct_pairs)
    return scores.astype(i32).reshape(cfg.segments, repeats, cfg.distinct_pairs).sum(1)


def init_state(cfg: Config) -> dict:
    """One model's update rule state, keyed 'SLOT/NAME', each the parameter's shape, from 0."""
    slots = RULES[cfg.rule].state
    return {
        f"{slot}/{name}": jnp.zeros(full_shape(p, cfg), dtype)
        for slot, dtype in slots.items()
        for name, p in parameters_of(cfg).items()
    }


def apply_rule(params, rule_state, z: dict, weights, thresholds, cfg: Config):
    """One model's update from its Z: each parameter moves where the rule (--optimizer) says,
    clipped to int8. weights: every noise's (pair_weights); thresholds (2,) int32, the matrices'
    and the vectors'; rule_state: the rule's (init_state), stored in each slot's dtype. Returns the
    new parameters, the new rule state and how many entries moved in each tensor, each layer counted
    apart (so that every count fits int32; the host adds them up)."""
    rule, stds, square_sum = RULES[cfg.rule], null_std(cfg), expected_square_sum(cfg)
    new, new_state, moved = {}, {}, []
    for name, p in parameters_of(cfg).items():
        kind = MATRIX if p.matrix else VECTOR
        evidence = Evidence(thresholds[kind], stds[kind], weights, square_sum)
        mine = {slot: rule_state[f"{slot}/{name}"] for slot in rule.state}
        step, mine = rule.step(z[name], mine, evidence, cfg.rule_flags)
        for slot, dtype in rule.state.items():
            new_state[f"{slot}/{name}"] = mine[slot].astype(dtype)
        new[name] = clip_int8(params[name].astype(i32) + step)
        changed = new[name] != params[name]
        layers = changed.shape[0] if p.layered else 1
        moved.append(jnp.sum(changed.reshape(layers, -1), axis=1, dtype=i32))
    return new, new_state, jnp.concatenate(moved)


ALPHA_FLAGS = ("alpha", "alpha_decay_timestep", "alpha_floor")  # act under rules that read alpha


def every_flag() -> tuple[type, dict]:
    """(Args, CONDITIONS) of the tables as they stand: every flag, the run's own (RunFlags) and each
    entry's, gathered (egg/flags.py); and {flag: (the flag that picks an entry, the entries under
    which it acts)}: an entry's own flags act under it alone, alpha's under the rules that read a
    threshold (a resume compares a setting only where it acts in both runs)."""
    tables = dict(model=MODELS, shaping=SHAPINGS, optimizer=RULES, objective=OBJECTIVES)
    thresholded = tuple(name for name, rule in RULES.items() if rule.alpha)
    alpha = {name: ("optimizer", thresholded) for name in ALPHA_FLAGS}
    return gathered("Args", RunFlags, **tables), conditions(**tables) | alpha


Args, CONDITIONS = every_flag()


# ------------------------------------------------------------------------------------------------
# Integer ranges. Every int32 accumulator's worst case, from the int8 ranges and the config: a
# configuration for which one could exceed 2**31 - 1 is refused before anything runs. Fixed
# bounds need no check: layer norm < 2**30, divide_to_int8 < 2**28, log-sum-exp s <= 2**28.


def fewer_pairs(cfg: Config) -> str:
    """What shrinks an accumulator that grows with the pairs an update weighs and their scores."""
    remedy = "a smaller --parallel_generations_per_gpu"
    if cfg.segments > 1:
        remedy += " or --segments"
    smallest = min(SHAPINGS, key=lambda name: SHAPINGS[name].largest)  # the smallest scores
    if SHAPINGS[cfg.shaping].largest > SHAPINGS[smallest].largest:
        remedy += f", or --shaping {smallest}"
    return remedy


def accumulator_bounds(cfg: Config) -> dict[str, tuple[int, str]]:
    """{accumulator: (largest magnitude it can reach, what would shrink it)}: the model's, the
    method's and the shaping's."""
    tables, shaping = make_tables(cfg.rank), SHAPINGS[cfg.shaping]
    b_max = int(np.abs(tables.gauss_rank).max())
    a_max = int(np.abs(tables.gauss).max())
    z_vector = scored_pairs(cfg) * shaping.largest * (a_max if cfg.use_clt else 1)
    k = weighted_shift(cfg)  # a low-rank Z sums int8 round(w_j a / 2**k) times b
    z_matrix = noise_pairs(cfg) * shifted(weighted_max(cfg), k) * cfg.rank
    z_matrix *= b_max if cfg.use_clt else 1
    if cfg.rank == 0:  # full-rank noise: Z sums single noise entries as a vector's does
        z_matrix = z_vector
    repeats = cfg.population // (2 * cfg.distinct_pairs)
    squares = noise_pairs(cfg) * (repeats * shaping.largest) ** 2
    largest = max(math.prod(p.shape) for p in parameters_of(cfg).values())
    smaller = fewer_pairs(cfg)
    least, most, span = OBJECTIVES[cfg.objective].span(cfg)
    bounds = MODELS[cfg.model].bounds(cfg) | {
        "fitness of a member": (max(-least, most), span),
        "fitness difference of a pair": (most - least, span),
        "Z of a matrix entry": (z_matrix, smaller),
        "Z of a vector entry": (z_vector, smaller),
        # counted whether or not --null_from_scores computes it, so that --segments 0 picks one
        # count for a configuration whatever that flag says
        "sum of squared pair weights (--null_from_scores)": (squares, smaller),
        "count of moved entries of one layer's tensor": (largest, "a smaller --n_embd"),
    }
    return bounds | {name: (bound, smaller) for name, bound in shaping.bounds(cfg).items()}


def num_parameters(cfg: Config) -> int:
    """Parameters of one model."""
    return sum(math.prod(full_shape(p, cfg)) for p in parameters_of(cfg).values())


def product_engine(flag: str, platform: str, rank: int) -> str:
    """Who computes the products (--kernels): egg/kernel.py's kernel on a GPU ("pallas") unless
    --kernels xla or the noise is not of rank 1, which the kernel does not take; on the CPU XLA, or
    the kernel in Pallas's interpreter ("interpret") with --kernels pallas. The same bits every way
    (a GPU that cannot run the kernel: start_devices)."""
    if flag == "xla" or rank != 1:
        return "xla"
    if platform not in GPUS:
        return "interpret" if flag == "pallas" else "xla"
    return "pallas"


def make_config(args: Args, devices: int | None = None, platform: str = "cpu") -> Config:
    """The static configuration of a run on `devices` JAX devices of a platform (default: one CPU's
    worth), every value the flags let the run choose chosen. A CPU split into --cpu_devices of them
    counts as one device of --parallel_generations_per_gpu."""
    shards = max(args.cluster.cpu_devices, 1)
    devices = shards if devices is None else devices
    population = args.parallel_generations_per_gpu * devices // shards
    kernels = product_engine(args.model.kernels, platform, args.rank)
    objective = OBJECTIVES[args.objective]
    segments = args.segments or objective.segments
    if objective.reads == "bytes":  # a segment of at least a byte
        segments = min(segments, args.tokens_per_update)
    cfg = Config(
        model=args.model.model,
        n_layer=args.model.n_layer,
        n_embd=args.model.n_embd,
        init_std=args.model.init_std,
        residual_shift=args.model.residual_shift,
        model_flags=entry_flags(args, MODELS, args.model.model),
        rank=args.rank,
        use_clt=args.use_clt,
        shaping=args.shaping,
        shaping_flags=entry_flags(args, SHAPINGS, args.shaping),
        rule=args.optimizer,
        rule_flags=entry_flags(args, RULES, args.optimizer),
        noise_reuse=args.noise_reuse or None,  # --noise_reuse 0: one set for the whole run
        shared_pair_state=args.shared_pair_state,
        group_size=args.group_size,
        tokens=args.tokens_per_update,
        objective=args.objective,
        objective_flags=entry_flags(args, OBJECTIVES, args.objective),
        stop=tasks.stop_byte(args.tasks),
        scorer=tasks.scorer(args.tasks),
        alpha_floor=args.alpha_floor,
        population=population,
        segments=segments,
        distinct_pairs=(args.num_perturbations or population) // 2,
        devices=devices,
        replicas=args.pbt.replicas,
        kernels=kernels,
        kernel_options=kernel.DEFAULT,
        unrolled=kernels != "xla",
        noise_per_segment=platform in GPUS,
    )
    while (
        not args.segments
        and cfg.segments > 1
        and max(accumulator_bounds(cfg).values())[0] > INT32_MAX
    ):
        cfg = cfg._replace(segments=cfg.segments - 1)  # --segments 0: as many as int32 allows
    parameters = num_parameters(cfg)
    sized_shift = QUARTER_SHIFT if parameters >= QUARTER_MODEL else 0
    shift = cfg.residual_shift if cfg.residual_shift >= 0 else sized_shift
    rule, model = RULES[cfg.rule], MODELS[cfg.model]
    rule_flags, model_flags = cfg.rule_flags, cfg.model_flags
    if rule.resolve is not None:
        rule_flags = rule.resolve(rule_flags, Sizes(parameters, scored_pairs(cfg)))
    if model.resolve is not None:
        model_flags = model.resolve(model_flags, cfg)
    return cfg._replace(residual_shift=shift, rule_flags=rule_flags, model_flags=model_flags)


def replicas_of(args: Args) -> list[Replica]:
    """Each replica's settings (egg/pbt.py): seed --seed + its index, the rest its --replica_NAME
    value, else --NAME."""
    return pbt.replicas(args.pbt, args.seed, {name: getattr(args, name) for name in pbt.EXPLORED})


def single_run(args: Args, **changes) -> Args:
    """These flags without replicas (and PBT), with `changes`."""
    return replace(args, **{**pbt.single(), **changes})


def member_unit(args: Args) -> int:
    """The members a device's share comes in: whole pairs, groups and blocks of distinct noises."""
    return math.lcm(2, args.group_size, args.num_perturbations or 2)


def check_bounds(cfg: Config) -> None:
    """Refuse a configuration whose int32 accumulators could overflow (accumulator_bounds)."""
    for name, (bound, remedy) in accumulator_bounds(cfg).items():
        if bound > INT32_MAX:
            raise UserError(f"the {name} could reach {bound:,} > 2**31 - 1 (int32): use {remedy}")


def check_window(cfg: Config) -> None:
    """Refuse a window model reading bytes whose context is longer than a segment: it would read
    fewer bytes at once than it declares."""
    model = MODELS[cfg.model]
    if model.window is None or OBJECTIVES[cfg.objective].reads != "bytes":
        return
    context, segment = model.context(cfg), window_length(cfg)
    if context > segment:
        raise UserError(
            f"--model {cfg.model} reads {context} bytes at once, but a member reads {segment} with "
            f"one perturbation (--tokens_per_update {cfg.tokens} in {cfg.segments} segments): give "
            "more --tokens_per_update or fewer --segments"
            + (", or a smaller --context" if hasattr(cfg.model_flags, "context") else "")
        )


def check_args(args: Args) -> None:
    """Refuse a bad configuration in one line naming the flag, before anything is compiled: every
    flag's range and choices and every replica's settings (egg/command.py), then the bounds."""
    command.check_flags(args, replicas_of)
    cfg = make_config(args)
    refusal = MODELS[cfg.model].check(cfg)
    if refusal:
        raise UserError(refusal)
    check_window(cfg)
    check_bounds(cfg)


def check_z_test(cfg: Config, replicas: list[Replica]) -> None:
    """Refuse a fixed alpha of a replica so small that its threshold is beyond the largest value of
    what the rule tests (|Z|, the running sum |m|) an entry can reach at this population: no
    parameter could ever move. (A schedule starts at alpha 1; a rule that reads no threshold reads
    no alpha.)"""
    bounds, rule = accumulator_bounds(cfg), RULES[cfg.rule]
    for replica in replicas if rule.alpha else ():
        thresholds = z_thresholds(cfg, alpha_at(cfg, replica, 0))
        for kind, threshold in zip(("matrix", "vector"), thresholds, strict=True):
            reach = rule.reach(bounds[f"Z of a {kind} entry"][0], cfg.rule_flags)
            if threshold >= reach:
                where = f"--alpha {replica.alpha:g} at population {cfg.population}"
                beyond = f"the largest {rule.tests} a {kind} entry can reach ({reach:,})"
                raise UserError(
                    f"{where}: the test's threshold {threshold:,} is beyond {beyond}, so nothing "
                    "would ever move; use a larger --alpha or population"
                )


# ------------------------------------------------------------------------------------------------
# Generation step: one generation of every replica as one jitted call on every device: each
# device evaluates its share of the population (population_fitness), the one collective gathers
# every pair's int8 score, then every device rebuilds all the noise from its counters and applies
# the identical update (update). Each is written for one replica; every_replica adds the replicas.

POP = "pop"  # the mesh axis the population (and the validation rows) are spread over
# parameters, update rule state, batches: whole everywhere
REPLICATED = jax.sharding.PartitionSpec()
# states and fitness (K, members, ...): members spread
SPREAD = jax.sharding.PartitionSpec(None, POP)


def every_replica(one_replica: Callable, shared: tuple[int, ...] = ()) -> Callable:
    """one_replica, written for one model, over the leading replica axis (K) of each of its
    arguments but those at the indices `shared` (the same for every replica): the one place the
    replicas are added. One replica is called as it is, its axis taken off and put back (a dot
    mapped over a replica axis of one, XLA:CPU computes with every weight copied transposed)."""

    def replicas(*args):
        mapped = [x for i, x in enumerate(args) if i not in shared]
        if jax.tree.leaves(mapped)[0].shape[0] == 1:
            alone = [
                x if i in shared else jax.tree.map(lambda v: v[0], x) for i, x in enumerate(args)
            ]
            return jax.tree.map(lambda v: v[None], one_replica(*alone))
        axes = tuple(None if i in shared else 0 for i in range(len(args)))
        return jax.vmap(one_replica, in_axes=axes)(*args)

    return replicas


def device_members(cfg: Config, batch):
    """(the first member of this device, its members' inputs) from the batch of every group's: one
    data sequence (T + 1) uint8, or Prompts, per group of members."""
    members = cfg.population // cfg.devices
    start = jax.lax.axis_index(POP) * members
    groups = (start + jnp.arange(members)) // cfg.group_size
    return start, jax.tree.map(lambda x: x[groups], batch)


def segment_noise_sources(cfg: Config, seed, generation, start):
    """noise_sources' fast path for a GPU's memory: each segment's noise built where it is used,
    twice (for the fitness, then for Z, summed segment by segment): the same noise and Z."""
    distinct = min(cfg.distinct_pairs, cfg.population // cfg.devices // 2)  # this device's
    offset = (start // 2) % cfg.distinct_pairs

    def noise_of(segment, first=offset, count=distinct):
        return segment_noise(cfg, seed, generation, segment, first, count)

    def z_of(weights):
        def add(z, segment):
            z_here = z_statistics(noise_of(segment, 0, cfg.distinct_pairs), weights[segment], cfg)
            return jax.tree.map(jnp.add, z, z_here), None

        zero = {k: jnp.zeros(full_shape(p, cfg), i32) for k, p in parameters_of(cfg).items()}
        return jax.lax.scan(add, zero, jnp.arange(cfg.segments))[0]

    return noise_of, z_of


def noise_sources(cfg: Config, seed, generation, start):
    """(noise_of, z_of) of one replica on the device whose first member is `start`: noise_of(
    segment) the noise of this device's pairs in a segment (its distinct pairs, ...); z_of(weights
    (segments, D)) every parameter's Z over every pair of every segment. Every segment's noise at
    once, threefry once a pair, kept for the update; the one place that chooses to build each
    segment's where it is used instead (cfg.noise_per_segment: a GPU's memory)."""
    if cfg.noise_per_segment:
        return segment_noise_sources(cfg, seed, generation, start)
    distinct = min(cfg.distinct_pairs, cfg.population // cfg.devices // 2)  # this device's
    offset = (start // 2) % cfg.distinct_pairs
    noise = generation_noise(cfg, seed, generation)  # (segments x D, ...)

    def noise_of(segment):
        first = segment * cfg.distinct_pairs + offset
        return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, first, distinct, 0), noise)

    def z_of(weights):
        return z_statistics(noise, weights.reshape(-1), cfg)

    return noise_of, z_of


def update(cfg: Config, params, rule_state, fitness, z_of, thresholds):
    """One replica's update from this device's members' fitness (segments, members): their scores
    (--shaping), every device's gathered (the one collective: an int8 score per pair and segment),
    the pair weights, Z, then the rule. Returns (params, rule_state, moved)."""
    scores = jax.lax.all_gather(shape_fitness(fitness, cfg, POP), POP, axis=1, tiled=True)
    weights = pair_weights(scores.reshape(-1), cfg)  # (segments, distinct pairs)
    return apply_rule(params, rule_state, z_of(weights), weights.reshape(-1), thresholds, cfg)


def compiler_options(cfg: Config) -> dict:
    """XLA's options for a program that perturbs the model: full rank's, or none."""
    return FULL_RANK_OPTIONS if cfg.rank == 0 else {}


def on_population(local, mesh: jax.sharding.Mesh, cfg: Config, batch=REPLICATED):
    """A per-device step local(params, rule_state, states, batch, generation, thresholds, seeds,
    sigma_shifts) -> (params, rule_state, states, fitness, moved) as one jitted program over the
    mesh:
    parameters, update rule state, batches (or what `batch` says) and per-replica inputs whole on
    every device, states and fitness spread over the population; the carried arrays donated; full
    rank's XLA options."""
    outs = (REPLICATED, REPLICATED, SPREAD, SPREAD, REPLICATED)
    step = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(REPLICATED, REPLICATED, SPREAD, batch) + (REPLICATED,) * 4,
        out_specs=outs,
        check_vma=False,
    )
    # the outputs' shardings stated: XLA would leave a model's states without entries (a window
    # model's, (K, P, 0)) whole on every device, and the next generation would refuse them
    shardings = tuple(jax.sharding.NamedSharding(mesh, spec) for spec in outs)
    options = compiler_options(cfg)
    return jax.jit(
        step, donate_argnums=(0, 1, 2), out_shardings=shardings, compiler_options=options
    )


# The jitted programs are made once per configuration (and mesh) in a process, as make_reader's and
# make_activations' are: a process that trains again (a resumed run, PBT's replicas, the tests)
# traces, lowers and compiles nothing twice.


@cache
def make_generation_step(cfg: Config, mesh: jax.sharding.Mesh):
    """One generation of every replica as one jitted call:

    step(params, rule_state, states, batch, generation, thresholds, seeds, sigma_shifts)
        -> (params, rule_state, states, fitness, moved)
    params, rule_state: each (K, ...); states (K, P, ...) int8; batch the inputs of every group of
    members, the same for every replica: a data sequence (P / group_size, T + 1) uint8, or Prompts
    (P / group_size, segments, ...); thresholds (K, 2), seeds (K,) and sigma_shifts (K,) int32,
    each replica's own. fitness (K, P) int32, summed over the segments; moved (K, tensors) int32.
    For an objective whose members' fitness is made in the step (scored_in_step)."""
    objective, members = OBJECTIVES[cfg.objective], cfg.population // cfg.devices

    def generation_of_one(params, rule_state, states, inputs, start, generation, *own):
        thresholds, seed, sigma_shift = own
        noise_of, z_of = noise_sources(cfg, seed, generation, start)
        draws_of = draw_sources(cfg, seed, generation, start, members)
        fitness, states = objective.fitness(
            cfg, params, noise_of, states, inputs, sigma_shift, draws_of
        )
        params, rule_state, moved = update(cfg, params, rule_state, fitness, z_of, thresholds)
        return params, rule_state, states, jnp.sum(fitness, axis=0), moved

    def local(params, rule_state, states, batch, generation, thresholds, seeds, sigma_shifts):
        start, inputs = device_members(cfg, batch)
        every = every_replica(generation_of_one, shared=(3, 4, 5))
        own = (thresholds, seeds, sigma_shifts)
        return every(params, rule_state, states, inputs, start, generation, *own)

    return on_population(local, mesh, cfg)


# the completions (K, segments, P, C): members spread
WRITTEN = jax.sharding.PartitionSpec(None, None, POP)


@cache
def make_writing_step(cfg: Config, mesh: jax.sharding.Mesh):
    """The first of a generation's two jitted calls where the host scores what the members wrote:
    write(params, batch, generation, seeds, sigma_shifts) -> written (K, segments, P, C) uint8,
    spread over the population (batch and the rest as make_generation_step's)."""
    members = cfg.population // cfg.devices

    def writing_of_one(params, inputs, start, generation, seed, sigma_shift):
        noise_of, _ = noise_sources(cfg, seed, generation, start)
        draws_of = draw_sources(cfg, seed, generation, start, members)
        return population_completions(cfg, params, noise_of, inputs.prompts, sigma_shift, draws_of)

    def local(params, batch, generation, seeds, sigma_shifts):
        start, inputs = device_members(cfg, batch)
        every = every_replica(writing_of_one, shared=(1, 2, 3))
        return every(params, inputs, start, generation, seeds, sigma_shifts)

    step = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(REPLICATED,) * 5,
        out_specs=WRITTEN,
        check_vma=False,
    )
    written = jax.sharding.NamedSharding(mesh, WRITTEN)
    return jax.jit(step, out_shardings=written, compiler_options=compiler_options(cfg))


@cache
def make_update_step(cfg: Config, mesh: jax.sharding.Mesh):
    """The second: the update from the fitness the host made of what the members wrote, a step of
    make_generation_step's signature whose batch is that fitness, (K, segments, P) int32 spread over
    the population (the states pass through)."""
    members = cfg.population // cfg.devices

    def update_of_one(params, rule_state, fitness, start, generation, thresholds, seed):
        _, z_of = noise_sources(cfg, seed, generation, start)
        params, rule_state, moved = update(cfg, params, rule_state, fitness, z_of, thresholds)
        return params, rule_state, jnp.sum(fitness, axis=0), moved

    def local(params, rule_state, states, fitness, generation, thresholds, seeds, sigma_shifts):
        start = jax.lax.axis_index(POP) * members
        every = every_replica(update_of_one, shared=(3, 4))
        out = every(params, rule_state, fitness, start, generation, thresholds, seeds)
        params, rule_state, total, moved = out
        return params, rule_state, states, total, moved

    return on_population(local, mesh, cfg, batch=WRITTEN)


def on_rows(one_replica: Callable, mesh: jax.sharding.Mesh):
    """one_replica(params, rows) of every replica as one jitted program: the rows spread over the
    devices (R a multiple of twice their number), the parameters whole on each, the result (K, R,
    ...) replicated."""
    local = jax.shard_map(
        every_replica(one_replica, shared=(1,)),
        mesh=mesh,
        in_specs=(REPLICATED, jax.sharding.PartitionSpec(POP)),
        out_specs=SPREAD,
        check_vma=False,
    )
    return jax.jit(local, out_shardings=jax.sharding.NamedSharding(mesh, REPLICATED))


@cache
def make_evaluate(cfg: Config, mesh: jax.sharding.Mesh):
    """Noise-free log2-likelihood sums of each row by each replica: evaluate(params, rows (R, T + 1)
    uint8) -> (K, R) (on_rows)."""

    def evaluate_one(params, rows):
        states = jnp.zeros((rows.shape[0],) + MODELS[cfg.model].state(cfg), jnp.int8)
        return forward(params, None, states, rows[:, :-1], rows[:, 1:], None, cfg)[0]

    return on_rows(evaluate_one, mesh)


@cache
def make_completer(cfg: Config, mesh: jax.sharding.Mesh):
    """Noise-free, greedy completions of each prompt by each replica: complete(params, rows (R, L)
    uint8) -> (K, R, C) uint8, as write makes them (on_rows)."""
    greedy = replaced(cfg.objective_flags, completion_temperature=0.0)
    greedy = cfg._replace(objective_flags=greedy)

    def complete_one(params, rows):
        return write(params, None, rows, None, None, greedy)

    return on_rows(complete_one, mesh)


@cache
def make_init(cfg: Config):
    """init(seeds (K,) int32) -> each replica's fresh parameters, jitted."""
    return jax.jit(every_replica(partial(init_params, cfg)))


def init_run(cfg: Config, replicas: list[Replica]):
    """(params, rule_state, states) of a fresh run, each with the leading replica axis: each
    replica's parameters from its own seed, update rule state from 0, states at zero."""
    seeds = jnp.array([r.seed for r in replicas], i32)
    params = make_init(cfg)(seeds)
    stack = partial(jax.tree.map, lambda x: jnp.broadcast_to(x, (cfg.replicas,) + x.shape))
    states = jnp.zeros((cfg.replicas, cfg.population) + carried_state(cfg), jnp.int8)
    return params, stack(init_state(cfg)), states


# ------------------------------------------------------------------------------------------------
# Data: what every generation reads of the training bytes (egg/corpus.py opens them: a read-only
# memory-mapped uint8 array, documents separated by byte 0), and the validation rows; or, where the
# objective reads prompts, every group's prompt (egg/tasks.py reads a task) and the held-out ones.


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
            f"{cfg.tokens + 1} bytes; use more data, a larger --group_size or fewer "
            "--tokens_per_update"
        )
    return Stream(stride, windows)


def batch_at(train: np.ndarray, stream: Stream, cfg: Config, generation: int) -> np.ndarray:
    """(sequences, T + 1) uint8: the bytes every sequence reads at this generation."""
    sequences = cfg.population // cfg.group_size
    starts = np.arange(sequences) * stream.stride + (generation % stream.windows) * cfg.tokens
    return np.asarray(train[starts[:, None] + np.arange(cfg.tokens + 1)])


def validation_rows(valid: np.ndarray, args: Args) -> np.ndarray:
    """(rows, T + 1) uint8: the validation bytes cut into --validation_batch_size rows."""
    if len(valid) < 2:
        raise UserError(f"validation data has {len(valid)} bytes: give at least 2")
    rows = min(args.validation_batch_size, len(valid) // 2)
    length = len(valid) // rows
    if args.validation_tokens:
        length = min(length, args.validation_tokens + 1)
    if LL_BOUND * (length - 1) > INT32_MAX:
        raise UserError(
            f"validation rows of {length} bytes could overflow the int32 log-likelihood sum: "
            f"use --validation_tokens {INT32_MAX // LL_BOUND} or less, or a larger "
            "--validation_batch_size"
        )
    starts = np.arange(rows) * (len(valid) // rows)
    return np.asarray(valid[starts[:, None] + np.arange(length)])


class Data(NamedTuple):
    """A run's bytes: for training, and the validation rows with what baselines reach on them."""

    train: np.ndarray  # read-only, memory-mapped
    stream: Stream  # where every generation reads it
    valid_rows: np.ndarray  # (rows, T + 1) uint8
    rows: jax.Array  # the same, padded to an even share per device, spread over the devices
    # bits/byte of a unigram and a bigram model and gzip (egg/corpus.py)
    baselines: dict[str, float]


TASK_BYTES = 2**22  # a task's worked examples, read in shuffled passes to at least 4 MiB


def task_bytes(task: tasks.Task) -> tuple[np.ndarray, np.ndarray]:
    """(train, validation) bytes of a task read on likelihood: its worked examples, the held-out
    prompts' apart (egg/tasks.py)."""
    train = tasks.worked_examples(task.train, task.stop, TASK_BYTES)
    if train is None:
        raise UserError(
            f"--task {task.name} has no worked examples to read (--objective likelihood): give a "
            "task with a 'completion' column, or --objective reward"
        )
    return train, tasks.worked_examples(task.valid, task.stop, 0)


def spread_rows(rows: np.ndarray, mesh) -> jax.Array:
    """Validation rows (R, ...) padded with zeros to an even share of every device, in pairs, and
    spread over them."""
    padding = -len(rows) % (2 * mesh.size)
    padded = np.pad(rows, ((0, padding),) + ((0, 0),) * (rows.ndim - 1))
    return global_array(padded, mesh, jax.sharding.PartitionSpec(POP))


class TaskPrompts(NamedTuple):
    """A reward run's prompts (egg/tasks.py reads the task): the training prompts, drawn a group's
    at a time in a fixed order, and the held-out prompts every validation writes for."""

    task: tasks.Task
    train: Prompts  # every training prompt (N, L) and answer (N, A), uint8
    order: np.ndarray  # (N,): the order the training prompts are drawn in
    valid_rows: np.ndarray  # (V, L) uint8: the held-out prompts validated on
    rows: jax.Array  # the same, padded to an even share per device, spread over the devices
    baselines: dict  # none: {}


def read_prompts(args: Args, mesh) -> TaskPrompts:
    """--task's prompts (egg/tasks.py), each left-padded with byte 0 to one length (the longest and
    a byte 0 before it, a fresh start), the first --validation_batch_size held-out ones validated
    on. Their order: one fixed shuffle, the same for every run (seeds differ in their noise alone,
    as they do on bytes)."""
    task = tasks.open_task(args.tasks)
    valid = task.valid.prompts[: args.validation_batch_size]
    length = 1 + max(tasks.longest(task.train.prompts), tasks.longest(valid))
    prompts = tasks.left_padded(task.train.prompts, length)
    train = Prompts(prompts, tasks.scored_against(task))
    order = np.random.default_rng(0).permutation(len(prompts))
    valid_rows = tasks.left_padded(valid, length)
    return TaskPrompts(task, train, order, valid_rows, spread_rows(valid_rows, mesh), {})


def prompts_at(data: TaskPrompts, cfg: Config, generation: int) -> tuple[np.ndarray, Prompts]:
    """(the rows (groups, segments) of the training prompts every group writes for at this
    generation, and those Prompts): the next groups x segments of the order, wrapping."""
    groups = cfg.population // cfg.group_size
    count = groups * cfg.segments
    at = (generation * count + np.arange(count)) % len(data.order)
    rows = data.order[at].reshape(cfg.segments, groups).T
    return rows, jax.tree.map(lambda x: x[rows], data.train)


def read_data(args: Args, cfg: Config, mesh):
    """The run's data: where the objective reads bytes, --data's (egg/corpus.py; at least two
    validation rows' worth held out when --data itself is cut) or a --task's worked examples, a
    Data; where it reads prompts, a --task's, a TaskPrompts."""
    if OBJECTIVES[cfg.objective].reads == "prompts":
        return read_prompts(args, mesh)
    if args.tasks.task:
        train, valid = task_bytes(tasks.open_task(args.tasks, rewarded=False))
    else:
        train, valid = corpus.open_data(args.corpus, 2 * args.validation_batch_size)
    stream, valid_rows = make_stream(len(train), cfg), validation_rows(valid, args)
    baselines = corpus.cached_baselines(train, valid_rows, args.corpus.dir_path)
    return Data(train, stream, valid_rows, spread_rows(valid_rows, mesh), baselines)


def batch_on_mesh(data, cfg: Config, mesh, generation: int):
    """A generation's inputs on every device: its data sequences, or its Prompts."""
    if isinstance(data, TaskPrompts):
        batch = prompts_at(data, cfg, generation)[1]
    else:
        batch = batch_at(data.train, data.stream, cfg, generation)
    return jax.tree.map(lambda x: global_array(x, mesh, REPLICATED), batch)


def bits_per_byte(log2_likelihood_sum, num_tokens: int) -> float:
    return -float(log2_likelihood_sum) / (num_tokens * 2**LL_FRAC)


# ------------------------------------------------------------------------------------------------
# Reading a model: one model reading bytes noise-free, for text from its integer logits and for the
# health of its int8 activations. A byte model reads a byte a call, carrying its state; a window
# model reads the window of its context's bytes before each.


def one_model(params, cfg: Config, rows: int) -> tuple[Perturbed, Any]:
    """One model's Perturbed, noise-free, for `rows` read side by side, and their zero states as
    it carries them reading a byte at a time (reading; laid out (1, rows, 1): R = S = 1)."""
    w = perturbed(params, None, make_sides(0, 1), cfg)
    return w, reading(cfg, rows, (1, rows, 1))[1]


@cache
def make_reader(cfg: Config):
    """read(params, carried, byte (1,) uint8) -> (carried, the next byte's logits (256,) int8 at
    LOGIT_FRAC), jitted: every model reads the byte and carries its state (reading)."""

    def read(params, carried, byte):
        w = one_model(params, cfg, 1)[0]
        step = reading(cfg, 1, (1, 1, 1))[0]
        logits, carried, _ = step(w, carried, byte.reshape(1, 1, 1), cfg)
        return carried, logits.reshape(VOCAB)

    return jax.jit(read)


def sample_text(params, cfg: Config, flags: sampling.Flags, seed: int, stop=None) -> bytes:
    """--prompt and its continuation by --max_new_bytes bytes (egg/sampling.py draws them, the same
    for a seed), or fewer, ending before a `stop` byte; the prompt read after a byte 0 (the
    document separator: from a fresh start, as write reads a prompt); the logits of each call
    (log2-probabilities at LOGIT_FRAC) are read on the host as bits: a sync point."""
    read, carried = make_reader(cfg), one_model(params, cfg, 1)[1]

    def next_bits(data: bytes) -> np.ndarray:
        nonlocal carried
        for byte in data:  # a byte a call: one program
            carried, logits = read(params, carried, np.array([byte], np.uint8))
        return np.asarray(logits, np.float64) / 2**LOGIT_FRAC

    prompt = sampling.prompt_bytes(flags.prompt)
    return prompt + sampling.continuation(next_bits, b"\0" + prompt, flags, seed, stop)


@cache
def make_activations(cfg: Config):
    """activations(params, rows (R, T) uint8) -> {name: (T, [L,] R, width)} int8: every activation
    of one model reading the rows side by side from zero states, jitted."""
    model = MODELS[cfg.model]

    def read_rows(params, rows):
        w = one_model(params, cfg, rows.shape[0])[0]
        carried = model.begin(
            jnp.zeros((rows.shape[0],) + model.state(cfg), jnp.int8), (1, rows.shape[0], 1), cfg
        )
        if model.window is not None:
            seen = read_windows(w, carried, rows.T.reshape(rows.shape[1], 1, -1, 1), cfg)[2]
        else:

            def read(carried, tok_R):
                _, carried, seen = model.step(w, carried, tok_R.reshape(1, -1, 1), cfg)
                return carried, seen

            seen = jax.lax.scan(read, carried, rows.T)[1]  # each (T, [L,] 1, R, 1, width)
        return {
            k: x.reshape(x.shape[: x.ndim - 4] + (x.shape[-3], x.shape[-1]))
            for k, x in seen.items()
        }

    return jax.jit(read_rows)


def activations(params, rows: np.ndarray, cfg: Config) -> dict:
    """Every int8 activation of one model reading rows (R, T) noise-free: {name: (R, T, [L,]
    width)}, layered activations with their layer axis."""
    return {k: jnp.moveaxis(x, -2, 0) for k, x in make_activations(cfg)(params, rows).items()}


# ------------------------------------------------------------------------------------------------
# Loop: a run is opened (every refusal before it writes anything), compiled ahead of time, then
# trained, validating, exploiting (PBT), diagnosing, sampling, logging and saving where the flags
# say. The host never holds the device up: generation N + 1 is dispatched before N's numbers are
# read, and the host waits for the device only where it reads its values ("sync point").


def default_run_name(args: Args) -> str:
    """A run's name from its flags: data (the task's, and "reward" where it writes), model (its
    entry where not egg, its shape), alpha, sigma_shift, rank, population x bytes (read, or
    written) x noise reuse, seed, and upstream's algorithm and the tag where given."""
    data = Path(args.tasks.task).stem if args.tasks.task else Path(args.corpus.data).name or "data"
    length = args.tokens_per_update
    if OBJECTIVES[args.objective].reads == "prompts":
        data, length = f"{data}-reward", args.reward.completion_bytes
    model = f"{args.model.n_embd}D{args.model.n_layer}L"
    if args.model.model != "egg":
        model = f"{args.model.model}{model}"
    population = f"{args.parallel_generations_per_gpu}x{length}x{args.noise_reuse}"
    noise = f"a{args.alpha:g}-s{args.sigma_shift}-r{args.rank}"
    name = f"{data}-{model}-{noise}-{population}-seed{args.seed}"
    if args.algorithm == "upstream":
        name += "-upstream"
    return f"{name}-{args.record.tag}" if args.record.tag else name


def run_folders(args: Args) -> record.Folders:
    """<runs_dir>/<run_name> (the run's record) and its checkpoints' folder (--save_dir)."""
    name = args.record.run_name or default_run_name(args)
    return record.folders(args.record.runs_dir, name, args.checkpoints.save_dir)


def mesh_config(args: Args, mesh: jax.sharding.Mesh) -> Config:
    """make_config for a run on this mesh's devices and platform."""
    return make_config(args, mesh.size, mesh.devices.flat[0].platform)


# --kernels auto's candidates on a GPU: who computes the products and the kernel's options, each
# the same integers (tests/test_kernels.py); the fastest at a run's shapes is taken
# (fastest_products). scripts/gpu_check.py times them beside the rest of its variants.
PRODUCT_CANDIDATES = {
    "the kernel": ("pallas", kernel.DEFAULT),
    "the kernel, layer norms before it": ("pallas", kernel.Options(normalises=False)),
    # layer norms and the noise's x B by XLA before it: its loop its MMAs alone
    "the kernel, its products alone": (
        "pallas",
        kernel.Options(normalises=False, sums_noise=False),
    ),
    # egg/mosaic.py's: the products alone on Mosaic GPU (TMA-staged, a wgmma group in flight)
    "the Mosaic GPU kernel": (
        "pallas",
        kernel.Options(normalises=False, sums_noise=False, backend="mosaic"),
    ),
    "XLA's products": ("xla", kernel.DEFAULT),
}
MOSAIC = "the Mosaic GPU kernel"  # --kernels pallas where Triton's cannot run
PRODUCTS_KEPT = "product_choices.json"  # the choices, beside the compilation cache (autotune.py)


def as_candidate(cfg: Config, name: str, platform: str) -> Config:
    """cfg with its products computed as the candidate `name` computes them on this platform (the
    kernel in Pallas's interpreter on a CPU)."""
    engine, options = PRODUCT_CANDIDATES[name]
    kernels = product_engine(engine, platform, cfg.rank)
    return cfg._replace(kernels=kernels, unrolled=kernels != "xla", kernel_options=options)


def make_probe(cfg: Config):
    """What --kernels auto times: one device's members of every replica reading a segment's bytes
    with their noise, every product of every layer as the generation step computes it, jitted:
    probe(params, states, tokens (members, bytes + 1) uint8, seeds, sigma_shifts) -> (fitness,
    states), for cfg of one device and one segment (fastest_products)."""

    def one(params, states, tokens, seed, sigma_shift):
        noise_of, _ = noise_sources(cfg, seed, jnp.int32(0), 0)
        return population_fitness(cfg, params, noise_of, states, tokens, sigma_shift)

    return jax.jit(every_replica(one, shared=(2,)))


def product_probe(cfg: Config) -> Config:
    """The configuration --kernels auto times: one device's share of the members, one segment's
    bytes (every product's shapes as the generation step's)."""
    length = -(-cfg.tokens // cfg.segments)
    share = cfg.population // cfg.devices
    return cfg._replace(population=share, devices=1, tokens=length, segments=1)


def probe_inputs(probe: Config, replicas: list[Replica], device) -> tuple:
    """make_probe's inputs on `device`: a fresh run's parameters and states, random bytes."""
    params, _, states = init_run(probe, replicas)
    _, seeds, sigma_shifts = replica_inputs(probe, replicas, 0)
    rows = (probe.population, probe.tokens + 1)
    tokens = np.random.default_rng(0).integers(0, 256, rows).astype(np.uint8)
    return jax.device_put((params, states, tokens, seeds, sigma_shifts), device)


def fastest_products(
    cfg: Config,
    device,
    replicas: list[Replica],
    kept: Path | None,
    clock=time.perf_counter,
    log=print,
    names: tuple[str, ...] = tuple(PRODUCT_CANDIDATES),
) -> str:
    """The name of the fastest of PRODUCT_CANDIDATES `names` for cfg's products on `device`: each
    one's probe timed there (egg/autotune.py), or as kept in the file `kept` for this device kind,
    JAX version and probe. Says which in one line (`log`)."""
    probe = product_probe(cfg)
    inputs = probe_inputs(probe, replicas, device)

    def build(name: str):  # a call of one candidate's probe (the first compiles it)
        call = make_probe(as_candidate(probe, name, device.platform))
        return lambda: jax.block_until_ready(call(*inputs))

    key = f"{device.device_kind} | JAX {jax.__version__} | {probe}"
    builds = {name: partial(build, name) for name in names}
    return autotune.choose(key, builds, kept, clock, log=log)


def start_devices(args: Args) -> tuple[Args, jax.sharding.Mesh, Config]:
    """Join the other processes and start the mesh: (the flags as used, the mesh, the run's
    Config). On a GPU: no CPU split; the candidates of PRODUCT_CANDIDATES whose Pallas backend
    compiles here (kernel.fault: Triton's, deprecated, and Mosaic GPU's); where Triton's cannot,
    --kernels pallas takes the Mosaic kernel, and where neither can, XLA's products (--kernels
    xla), said in one line (refused with --kernels pallas); with --kernels auto, the fastest
    candidate, chosen by the first process and taken by every other."""
    cluster.init_distributed(args.cluster)
    mesh = cluster.population_mesh(POP)
    if mesh.devices.flat[0].platform == "cpu":
        return args, mesh, mesh_config(args, mesh)
    args = replace(args, cpu_devices=1)
    cfg = mesh_config(args, mesh)
    if cfg.kernels != "pallas":
        return args, mesh, cfg
    platform = mesh.devices.flat[0].platform
    faults = {b: kernel.fault(mesh.devices.flat[0], ARITHMETIC, b) for b in kernel.BACKENDS}
    names = [n for n, (e, o) in PRODUCT_CANDIDATES.items() if e == "xla" or not faults[o.backend]]
    said = "; ".join(fault for fault in faults.values() if fault)
    kernels_run = [n for n in names if PRODUCT_CANDIDATES[n][0] == "pallas"]
    if not kernels_run and args.model.kernels == "pallas":
        raise UserError(f"--kernels pallas: {said}; use --kernels xla or auto")
    if said and jax.process_index() == 0:  # the one line: who computes the products instead
        instead = "XLA" if not kernels_run else "the Mosaic GPU kernel" if faults["triton"] else ""
        print(f"products by {instead}, the same bits: {said}" if instead else said)
    if not kernels_run:
        args = replace(args, kernels="xla")
        return args, mesh, mesh_config(args, mesh)
    if args.model.kernels != "auto":  # --kernels pallas: Triton's kernel, else Mosaic GPU's
        return args, mesh, cfg if not faults["triton"] else as_candidate(cfg, MOSAIC, platform)
    cache = jax.config.jax_compilation_cache_dir
    kept = Path(cache).parent / PRODUCTS_KEPT if cache else None
    chosen = np.int32(0)
    if jax.process_index() == 0:
        device = jax.local_devices()[0]
        best = fastest_products(cfg, device, replicas_of(args), kept, names=tuple(names))
        chosen = np.int32(names.index(best))
    if jax.process_count() > 1:  # a sync point: every process compiles the same program
        chosen = multihost_utils.broadcast_one_to_all(chosen)
    return args, mesh, as_candidate(cfg, names[int(chosen)], platform)


def data_fingerprint(data) -> str:
    """What a run trains on, cheaply identified: its training bytes', or its training prompts' and
    answers' (egg/corpus.py's fingerprint)."""
    if isinstance(data, TaskPrompts):
        return corpus.fingerprint(np.concatenate([x.reshape(-1) for x in data.train]))
    return corpus.fingerprint(data.train)


def training_identity(args: Args, cfg: Config, fingerprint: str) -> dict:
    """What decides how this run trains (egg/resume.py), compared when it resumes: its training
    flags, with the values it chose where a flag let it (the residual shift, the entries' own
    flags), its population and its data (its fingerprint: data_fingerprint)."""
    chosen = [cfg.model_flags, cfg.shaping_flags, cfg.rule_flags]
    resolved = {"residual_shift": cfg.residual_shift}
    for own_flags in chosen:
        resolved |= flat(own_flags) if own_flags is not None else {}
    return resume.training_identity(
        flat(args), facts_of(Args), resolved, cfg.population, fingerprint
    )


def model_name(cfg: Config) -> str:
    """The model and its shape, as checkpoints record it: "egg 8D-2L"."""
    return f"{cfg.model} {cfg.n_embd}D-{cfg.n_layer}L"


def expected_arrays(cfg: Config) -> checkpoints.Expected:
    """What a run of this configuration reads from a checkpoint (egg/checkpoints.py)."""
    params = {k: full_shape(p, cfg) for k, p in parameters_of(cfg).items()}
    states = (cfg.population, *carried_state(cfg))
    slots = RULES[cfg.rule].state
    return checkpoints.expected(params, slots, states, cfg.replicas, model_name(cfg))


def on_mesh(params, rule_state, states, mesh) -> tuple:
    """(params, rule_state, states): parameters and update rule state replicated on every device,
    hidden states spread over the population."""
    replicated = jax.tree.map(lambda p: global_array(p, mesh, REPLICATED), (params, rule_state))
    return *replicated, global_array(states, mesh, SPREAD)


def describe_data(cfg: Config, data) -> str:
    """What a run reads, in a few words: its bytes, or its task's prompts and how it writes."""
    if isinstance(data, TaskPrompts):
        own = cfg.objective_flags
        how = "greedily" if not temperature_of(cfg) else f"at {own.completion_temperature:g}"
        where = "in the step" if scored_in_step(cfg) else "on the host"
        return (
            f"{len(data.order):,} training prompts, {len(data.valid_rows):,} held-out ones, up to "
            f"{own.completion_bytes} bytes written {how} and scored {where}"
        )
    return f"{len(data.train):,} training bytes, {data.valid_rows.size:,} validation bytes"


def describe_run(name: str, cfg: Config, mesh, cpus: int, data) -> str:
    """A run's first line, said before its step compiles."""
    replicas = f"{cfg.replicas} replicas of " if cfg.replicas > 1 else ""
    split = f" (one CPU split into {cpus})" if cpus > 1 else ""
    settings = flat(cfg.rule_flags) if cfg.rule_flags is not None else {}
    rule = ", ".join([cfg.rule] + [f"--{k} {v}" for k, v in settings.items()])
    platform = mesh.devices.flat[0].platform
    window = MODELS[cfg.model].context
    reads = f", reading {window(cfg)} bytes at once" if window is not None else ""
    return (
        f"egg-jax {name}: {replicas}{num_parameters(cfg):,} int8 parameters{reads}, population "
        f"{cfg.population} on {mesh.size} {platform} device(s){split} in {jax.process_count()} "
        f"process(es), {cfg.segments} segment(s) a member ({scored_pairs(cfg):,} pairs an "
        f"update, {rule}), {describe_data(cfg, data)}; compiling the generation step"
    )


def first_local(x: jax.Array, axis: int) -> int:
    """The index on `axis` of the first entry this process holds of an array spread on it."""
    return min(shard.index[axis].start or 0 for shard in x.addressable_shards)


def written_fitness(written: jax.Array, generation: int, data: TaskPrompts, cfg: Config, mesh):
    """The fitness (K, segments, P) int32, spread over the population, of what the members wrote
    (K, segments, P, C) uint8 at a generation: this process's members' completions scored on the
    host by the task's rewards (egg/tasks.py), each for the prompt its group wrote for, as
    reward_as_fitness makes them; only the fitness crosses devices. Sync point."""
    mine = local_copy(written, axis=2)  # (K, segments, m, C): this process's members
    replicas, segments, count, length = mine.shape
    groups = (first_local(written, 2) + np.arange(count)) // cfg.group_size
    rows = prompts_at(data, cfg, generation)[0][groups].T  # (segments, m): their prompts
    indices = np.broadcast_to(rows, (replicas, segments, count)).reshape(-1)
    completions = [bytes(c).rstrip(b"\0") for c in mine.reshape(-1, length)]
    with cluster.refused_together(tasks.RewardFailed):  # every process stops in the same line
        rewards = tasks.score(data.task, data.task.train, indices, completions)
    fitness = reward_as_fitness(rewards).reshape(mine.shape[:3])
    sharding = jax.sharding.NamedSharding(mesh, WRITTEN)
    shape = (replicas, segments, cfg.population)
    return jax.make_array_from_process_local_data(sharding, fitness, shape)


class Compiled(NamedTuple):
    """A generation, compiled ahead of time: step(params, rule_state, states, batch, generation,
    thresholds, seeds, sigma_shifts) -> (params, rule_state, states, fitness, moved), as
    make_generation_step's; what compiling it said, in lines; the most temporaries of its
    programs, MiB."""

    step: Callable
    said: list[str]
    temporaries: float


def compile_generation(cfg: Config, mesh, carry: tuple, batch, start: int, inputs: tuple, data):
    """The generation step compiled for these arguments: one program where the step makes the
    members' fitness (scored_in_step); else two, the members' writing and the update, with the
    host's scoring between them (written_fitness)."""
    generation = np.int32(start)
    if scored_in_step(cfg):
        step = make_generation_step(cfg, mesh).lower(*carry, batch, generation, *inputs)
        compiled = compile_now(step)
        said = [compiled.describe("generation step", "generation")]
        return Compiled(compiled.step, said, compiled.temporaries)
    thresholds, seeds, sigma_shifts = inputs
    writing = make_writing_step(cfg, mesh).lower(carry[0], batch, generation, seeds, sigma_shifts)
    writing = compile_now(writing)
    shape = (cfg.replicas, cfg.segments, cfg.population)
    fitness = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=writing.step.output_shardings)
    updating = make_update_step(cfg, mesh).lower(*carry, fitness, generation, *inputs)
    updating = compile_now(updating)

    def step(params, rule_state, states, batch, generation, thresholds, seeds, sigma_shifts):
        written = writing.step(params, batch, generation, seeds, sigma_shifts)
        fitness = written_fitness(written, int(generation), data, cfg, mesh)  # sync point
        own = (thresholds, seeds, sigma_shifts)
        return updating.step(params, rule_state, states, fitness, generation, *own)

    said = [
        writing.describe("writing step", "generation"),
        updating.describe("update step", "generation"),
    ]
    return Compiled(step, said, max(writing.temporaries, updating.temporaries))


class Dispatched(NamedTuple):
    """A generation dispatched whose numbers the host has not read yet."""

    generation: int
    fitness: jax.Array  # (K, members) int32, spread over the devices
    moved: jax.Array  # (K, tensors) int32, entries moved per tensor and layer
    replicas: list[Replica]  # the settings it ran with
    at: float  # when (time.time())


def generation_metrics(
    cfg: Config, sent: Dispatched, console: record.Console
) -> tuple[dict, np.ndarray]:
    """(train/ and perf/ metrics, moved counts (K, tensors)) of a dispatched generation, from the
    fitness of process 0's members. Sync point: waits for this generation (the next one may
    already be running)."""
    fitness, moved = local_copy(sent.fitness, axis=1).astype(np.int64), host_copy(sent.moved)
    seconds = console.lap(sent.generation, sent.at)
    objective, size = OBJECTIVES[cfg.objective], num_parameters(cfg)
    value = partial(objective.value, cfg=cfg)
    per_replica = []
    for f, m, replica in zip(fitness, moved, sent.replicas, strict=True):
        alpha = float(alpha_at(cfg, replica, sent.generation)) if RULES[cfg.rule].alpha else None
        per_replica.append(record.train_metrics(f, m, alpha, value, size, objective.metric))
    settings = [r._asdict() for r in sent.replicas]
    metrics = record.replica_metrics(per_replica, settings, objective.metric, objective.higher)
    tokens = member_bytes(cfg) * cfg.population * cfg.replicas
    metrics |= {"perf/tokens_per_s": tokens / seconds, "perf/seconds": seconds}
    if objective.reads == "prompts":  # every member writes a completion of every segment's prompt
        metrics["perf/completions"] = cfg.population * cfg.segments * cfg.replicas
    return metrics, moved


def replica_of(tree, k: int):
    """Replica k's arrays: one model's, without the replica axis."""
    return jax.tree.map(lambda x: x[k], tree)


def due(every: int, done: int) -> bool:
    return bool(every) and done % every == 0


class Validation(NamedTuple):
    """A validation of every replica: each one's objective metric (bits/byte, mean reward), its
    val/ metrics, and a few held-out prompts with what the best replica wrote (none on bytes)."""

    scores: list[float]
    metrics: list[dict]
    examples: list[str]


def best_of(scores: list[float], higher: bool) -> int:
    """The best replica by its scores (the lower index of equals)."""
    return min(range(len(scores)), key=lambda k: (-scores[k] if higher else scores[k], k))


EXAMPLES = 3  # held-out prompts shown with what the best replica wrote at each validation


def shown(prompt: str, completion: bytes, reward: float) -> str:
    """A prompt, what a model wrote for it and its reward, as a line: "12+5=" -> "17" (1.000)."""
    text = sampling.printable(completion)
    return (
        f'"{sampling.printable(sampling.prompt_bytes(prompt))}" -> "{text}" (reward {reward:.3f})'
    )


def validate(cfg: Config, validator, params, data) -> Validation:
    """Every replica's noise-free validation: the bits/byte of the validation rows (validator:
    make_evaluate's), or the mean reward of its greedy completions of the held-out prompts
    (make_completer's) and their accuracy, the share with the task's full reward. Sync point."""
    rows = data.valid_rows
    if not isinstance(data, TaskPrompts):
        ll = host_copy(validator(params, data.rows))[:, : len(rows)]
        tokens = rows.shape[0] * (rows.shape[1] - 1)
        scores = [bits_per_byte(np.sum(x, dtype=np.int64), tokens) for x in ll]
        return Validation(scores, [{"val/bits_per_byte": v} for v in scores], [])
    written = host_copy(validator(params, data.rows))[:, : len(rows)]
    task, every, metrics = data.task, np.arange(len(rows)), []
    texts = []
    for completions in written:
        completions = [bytes(c).rstrip(b"\0") for c in completions]
        rewards = tasks.score(task, task.valid, every, completions)
        accuracy = float(np.mean(rewards >= task.full_reward))
        metrics.append({"val/reward": float(np.mean(rewards)), "val/accuracy": accuracy})
        texts.append(list(zip(completions, rewards, strict=True)))
    scores = [m["val/reward"] for m in metrics]
    chosen = texts[best_of(scores, higher=True)][:EXAMPLES]
    prompts = task.valid.prompts[:EXAMPLES]
    examples = [shown(p, c, r) for p, (c, r) in zip(prompts, chosen, strict=False)]
    return Validation(scores, metrics, examples)


def describe_validation(cfg: Config, validation: Validation, leader: int) -> str:
    """The best replica's validation in words, with the others' spread."""
    objective = OBJECTIVES[cfg.objective]
    spread = record.describe_spread(validation.scores, objective.higher)
    if objective.reads == "bytes":
        return f"{validation.scores[leader]:.3f} bits/byte{spread}"
    best = validation.metrics[leader]
    return f"reward {best['val/reward']:.3f}, accuracy {best['val/accuracy']:.3f}{spread}"


def diagnose(cfg: Config, params, moved: np.ndarray, data: Data) -> list[dict]:
    """diag/ metrics of every replica (egg/diagnostics.py), from the activations of 16 validation
    rows of 64 bytes, the parameters and the moved counts (K, tensors). Sync point."""
    tensors = {
        k: (cfg.n_layer if p.layered else 1, math.prod(full_shape(p, cfg)))
        for k, p in parameters_of(cfg).items()
    }
    health = []
    for k in range(cfg.replicas):
        model = jax.tree.map(host_copy, replica_of(params, k))
        seen = jax.tree.map(np.asarray, activations(model, data.valid_rows[:16, :65], cfg))
        shares = diagnostics.moved_shares(moved[k], tensors)  # as apply_rule counts them
        health.append(diagnostics.health(seen, model, shares, INT8_MAX))
    return health


def checkpoint_meta(replicas: list[Replica], scores: list[float], leader: int, metric: str) -> dict:
    """What a checkpoint of several replicas records besides the flags: their settings and last
    validations (of the objective's metric), and the best of them."""
    if len(replicas) == 1:
        return {}
    settings = [r._asdict() for r in replicas]
    return {
        "replica_settings": settings,
        "best_replica": leader,
        f"replica_val_{metric}": scores,
    }


class Ended(NamedTuple):
    """How a run ended: each replica's last validation (the objective's metric), the best one,
    their settings, and whether a stop signal ended it early."""

    scores: list[float]
    leader: int
    replicas: list[Replica]
    stopped: bool


def finish(console, args: Args, cfg: Config, folders, params, metrics: dict, ended: Ended) -> dict:
    """The run's last lines (its validation, where it went and how to go on); the last metrics, with
    every replica's parameters on the host."""
    what = "tokens" if OBJECTIVES[cfg.objective].reads == "bytes" else "bytes written"
    console.close(member_bytes(cfg) * cfg.population * cfg.replicas, what)
    if not ended.stopped:
        setting = ended.replicas[ended.leader]._asdict()
        which = pbt.settings_text(setting) if cfg.replicas > 1 else ""
        objective = OBJECTIVES[cfg.objective]
        end = record.describe_end(
            ended.scores, ended.leader, which, args.num_epochs, objective.metric, objective.higher
        )
        console.log(end)
    console.log(record.where_it_went(folders, args.num_epochs, ended.stopped))
    return {**metrics, "params": jax.tree.map(host_copy, params)}


def model_settings(training: dict) -> tuple[str, ...]:
    """The training settings that decide a checkpoint's model (`training`, its recorded ones):
    which, its shape, how its blocks join the residual stream, and its entry's own flags."""
    own = MODELS[training.get("model", "egg")].flags
    return ("model", "n_embd", "n_layer", "residual_shift", *(flat(own()) if own else ()))


def initial_params(spec: str, cfg: Config) -> tuple[dict, Path]:
    """(the parameters --init_from starts a run from, every replica's, (K, ...); the checkpoint
    they come from): that run's model (egg/resume.py finds it), the best of its replicas."""
    chosen = resume.initial(spec, model_settings, since(Args))
    expected = expected_arrays(cfg._replace(replicas=chosen.replicas))
    one = replica_of(checkpoints.load_checkpoint(chosen.folder, expected).params, chosen.chosen)
    every = jax.tree.map(lambda x: np.broadcast_to(x, (cfg.replicas,) + x.shape), one)
    return every, chosen.folder


def train(args: Args) -> dict:
    """Train up to --num_epochs generations; return the last metrics, with every replica's
    parameters on the host. A stop signal ends the run after the generation in flight, saved,
    exiting 128 + the signal's number; before the first generation it raises Stopped (nothing to
    save)."""
    with StopSignal(not cluster.several_processes(args.cluster)) as stop:
        started = time.time()

        # Open the run: everything that can be refused is, before the run writes anything.
        check_args(args)
        args, mesh, cfg = start_devices(args)
        stop.again()  # jax.distributed installs a SIGTERM handler of its own
        # Each process's refusals are the run's: process 0 alone owns the folders, every process
        # reads the data and the checkpoint; one refusing, all end in the same line.
        with cluster.refused_together():
            replicas = replicas_of(args)
            check_bounds(cfg)
            check_z_test(cfg, replicas)
            # process 0 alone prints, records and writes checkpoints
            writer = jax.process_index() == 0
            folders = run_folders(args)
            places = [
                (folders.run, "metrics to --runs_dir", "--run_name"),
                (folders.checkpoints, "checkpoints to --save_dir", "--save_dir"),
            ]
            places = places if writer else []
            for place in places:  # a folder another run owns is refused at once
                own(*place, probe=True)
            with stop.interruptible("while reading the data: nothing saved"):
                data = read_data(args, cfg, mesh)
            claims = [own(*place) for place in places]  # the run's own until the process ends
            # where it starts: fresh, or the checkpoint it continues (egg/resume.py finds it)
            wanted = resume.Wanted(
                expected=expected_arrays(cfg),
                identity=training_identity(args, cfg, data_fingerprint(data)),
                conditions=CONDITIONS,
                aliases=aliases(Args),
                retired=command.RETIRED_SETTINGS,
                retired_after=command.RETIRED_AFTER,
                since=since(Args),
            )
            how, allow = args.checkpoints.resume, args.checkpoints.allow_changes
            resumed = resume.continue_from(how, folders.checkpoints, wanted, allow, writer)
            initial = None  # --init_from: another run's model, where this run starts afresh
            if resumed is None and args.checkpoints.init_from:
                initial = initial_params(args.checkpoints.init_from, cfg)

        # The arrays it starts from: the checkpoint's, where they carry over, else fresh ones.
        params, rule_state, states = init_run(cfg, replicas)
        start = resumed.meta["generation"] if resumed else 0
        if resumed is not None:
            params = resumed.params
            rule_state = rule_state if resumed.rule_state is None else resumed.rule_state
            states = states if resumed.states is None else resumed.states
            # the replicas' settings as PBT left them, unless --allow_changes took new ones
            recorded = resumed.meta.get("replica_settings")
            if recorded and not set(resumed.changes) & set(pbt.SETTING_FLAGS):
                replicas = [Replica(**x) for x in recorded]
        if initial is not None:
            params = initial[0]
        keep, model = args.checkpoints.keep_checkpoints, wanted.expected.model
        objective = OBJECTIVES[cfg.objective]
        checkpointer = checkpoints.Checkpointer(
            folders.checkpoints,
            flat(args),
            keep,
            wanted.identity,
            writer,
            model,
            cfg.replicas,
            objective.metric,
            objective.higher,
        )
        if resumed is not None:
            checkpointer.best = resumed.meta.get(f"best_val_{objective.metric}", checkpointer.best)
        # (params, rule state, states): donated to the step, which returns their next values
        carry = on_mesh(params, rule_state, states, mesh)
        generations = args.num_epochs  # the generations to train, counted from the run's start
        console = record.Console(generations, start, writer, started, objective.metric)
        # each replica's last validation (the objective's metric), and the best replica
        scores, leader = [math.nan] * cfg.replicas, 0
        if start >= generations:
            more = f"the checkpoint is at generation {start}; give --num_epochs above it"
            console.log(f"nothing to do: {more}")
            ended = Ended(scores, leader, replicas, stopped=True)
            return finish(console, args, cfg, folders, carry[0], {}, ended)
        # what --allow_changes let by
        changes = resume.describe_changes(resumed.changes) if resumed else ""
        if resumed is not None:
            at = f"{resumed.folder} at generation {start}"
            console.log(f"resuming from {at}; changed: {changes or 'nothing'}")
        if initial is not None:
            console.log(f"starting from the model of {initial[1]}; all else afresh")

        # Compile ahead of time; the memory is checked before the first generation spends it.
        console.log(describe_run(folders.run.name, cfg, mesh, args.cluster.cpu_devices, data))
        batch = batch_on_mesh(data, cfg, mesh, start)
        inputs = replica_inputs(cfg, replicas, start)
        compiled = compile_generation(cfg, mesh, tuple(carry), batch, start, inputs, data)
        for line in compiled.said:
            console.log(line)
        members = args.parallel_generations_per_gpu
        with cluster.refused_together():  # each process checks its own devices' memory
            cluster.check_memory(mesh, compiled.temporaries, members, member_unit(args))
        saved = f"{resumed.folder} stays the newest checkpoint" if resumed else "nothing saved"
        stop.check(f"before generation {start + 1}: {saved}")
        baselines = corpus.describe_baselines(data.baselines)
        if baselines:
            console.log(f"baselines on the validation bytes, in bits/byte: {baselines}")
        summary = {f"baseline/{k}": v for k, v in data.baselines.items()}
        console.record = record.RunRecord(
            folders.run, flat(args), summary, start, writer, args.record
        )
        if changes:
            console.record.log({"resume/changed": changes}, start)
        reads_bytes = objective.reads == "bytes"
        # compiled on first use
        validator = (make_evaluate if reads_bytes else make_completer)(cfg, mesh)

        # The generations. Each is dispatched and runs while the host prepares the next one's
        # bytes and records the one before; the host waits for a generation only where its values
        # are needed: to validate, diagnose, sample, save or stop.
        metrics, stopping, pending = {}, False, None
        together = (UserError, tasks.RewardFailed)  # raised by every process together: at once
        verdict = awaiting_jax_verdict(args.cluster.heartbeat_timeout, together)
        with console.ends_with_the_bar(), verdict:
            for generation in range(start, generations):
                done = generation + 1
                last = done == generations
                inputs, at = replica_inputs(cfg, replicas, generation), time.time()
                *carry, fitness, moved = compiled.step(*carry, batch, np.int32(generation), *inputs)
                sent = Dispatched(generation, fitness, moved, replicas, at)  # running
                if not last:  # the next generation's bytes, while the device works
                    batch = batch_on_mesh(data, cfg, mesh, done)
                if pending is not None:  # the generation before: done, or about to be
                    console.show(
                        generation_metrics(cfg, pending, console)[0], done - 1, scores, leader
                    )
                pending = sent
                stopping = cluster.stop_requested(stop) and not last  # a signal in the last: finish
                validating = last or due(args.validate_every, done) or due(args.pbt.pbt_every, done)
                diagnosing = due(args.diagnostics.log_every or 10 * args.diagnostics.debug, done)
                sampling_now = due(args.sampling.sample_every, done)
                saving = last or stopping or due(args.checkpoints.save_every, done)
                if not (validating or diagnosing or sampling_now or saving):
                    continue
                metrics, moved = generation_metrics(cfg, sent, console)  # sync point
                pending = None
                settings = [r._asdict() for r in replicas]
                if validating:
                    validation = validate(cfg, validator, carry[0], data)  # sync point
                    scores = validation.scores
                    leader = best_of(scores, objective.higher)
                    metrics |= record.replica_metrics(
                        validation.metrics, settings, objective.metric, objective.higher
                    )
                    metrics |= {f"val/{k}_bits_per_byte": v for k, v in data.baselines.items()}
                    said = describe_validation(cfg, validation, leader)
                    beside = f" ({baselines})" if baselines else ""
                    console.log(f"generation {done}: validation {said}{beside}")
                    for example in validation.examples:
                        console.log(f"  {example}")
                    if checkpointer.improves(scores[leader]):  # every process copies: a sync point
                        best = replica_of(jax.tree.map(host_copy, tuple(carry)), leader)
                        which = {"replica": leader, "replica_setting": settings[leader]}
                        which = which if cfg.replicas > 1 else {}
                        checkpointer.offer_best(done, best, scores[leader], which)
                if validating and due(args.pbt.pbt_every, done):  # exploit, explore
                    sigma_range = facts_of(Args)["sigma_shift"][:2]  # explored within its range
                    source, replicas, lineage = pbt.pbt_step(
                        scores, replicas, args.seed, done, sigma_range, objective.higher
                    )
                    carry = list(pbt.copy_replicas(tuple(carry), source))
                    metrics["pbt/lineage"] = lineage
                    moves = pbt.describe_lineage(lineage)
                    console.log(f"generation {done}: population-based training: {moves}")
                if diagnosing:
                    with record.tolerated(f"generation {done}'s diagnostics", console.log):
                        health = diagnose(cfg, carry[0], moved, data)  # sync point
                        settings = [r._asdict() for r in replicas]  # as PBT left them
                        metrics |= record.replica_metrics(health, settings, summary=False)
                        for k, values in enumerate(health if args.diagnostics.debug else []):
                            who = f" replica {k}" if cfg.replicas > 1 else ""
                            table = diagnostics.table(values)
                            console.log(f"generation {done}{who} diagnostics:\n{table}")
                if sampling_now:
                    with record.tolerated(f"generation {done}'s sample", console.log):
                        model = jax.tree.map(host_copy, replica_of(carry[0], leader))  # sync point
                        text = sample_text(model, cfg, args.sampling, args.seed + done)
                        metrics["samples/text"] = sampling.printable(text)
                        console.log(f"generation {done} sample: {metrics['samples/text']}")
                # the record's line before the checkpoint: a checkpoint never holds a generation
                # the record lacks (a resume drops the lines after its checkpoint's generation)
                console.show(metrics, done, scores, leader)
                if saving:
                    arrays = jax.tree.map(host_copy, tuple(carry))  # every process: a sync point
                    meta = checkpoint_meta(replicas, scores, leader, objective.metric)
                    folder = checkpointer.save(done, arrays, scores[leader], meta)
                    if stopping:  # every process says so: they all stop after the same generation
                        where = f"generation {done}: saved {folder}"
                        print(f"process {jax.process_index()} stopped by signal after {where}")
                if stopping:
                    break
        ended = Ended(scores, leader, replicas, stopping)
        last = finish(console, args, cfg, folders, carry[0], metrics, ended)
        del claims  # the run has ended: its folders are free
    if stopping:  # the code a job script requeues on (docs/design.org)
        raise SystemExit(cluster.stopped_code(stop))
    return last


# ------------------------------------------------------------------------------------------------
# Main: the platform, the CPU split and the compilation cache, set before JAX starts; then train or
# sample. A run of several processes is launched under a supervisor (egg/supervisor.py).


SAMPLED_PROMPTS = 4  # --sample with a --task: its first held-out prompts continued


def task_samples(params, cfg: Config, args: Args) -> str:
    """--sample with a --task: the model's continuations of its first held-out prompts (drawn as
    --sample draws), each ending before the task's stop byte, with their rewards (egg/tasks.py)."""
    task = tasks.open_task(args.tasks)
    prompts = task.valid.prompts[:SAMPLED_PROMPTS]
    completions = []
    for i, prompt in enumerate(prompts):
        flags = replaced(args.sampling, prompt=prompt)
        text = sample_text(params, cfg, flags, args.seed + i, task.stop)
        completions.append(text[len(sampling.prompt_bytes(prompt)) :])
    rewards = tasks.score(task, task.valid, range(len(prompts)), completions)
    return "\n".join(map(shown, prompts, completions, rewards))


def sample(args: Args) -> str:
    """--sample: print a continuation of --prompt by --resume's model, or of a --task's first
    held-out prompts (a stop signal: Stopped)."""
    check_ranges(args)
    with StopSignal() as stop:  # from here on a stop signal ends it in one line, the model loaded
        which, folder = args.sampling.sample_replica, run_folders(args).checkpoints
        chosen = resume.sampled(args.checkpoints.resume, folder, which, model_settings, since(Args))
        model = {k: chosen.training[k] for k in model_settings(chosen.training)}
        cfg = make_config(single_run(args, **model))
        expected = expected_arrays(cfg._replace(replicas=chosen.replicas))
        params = checkpoints.load_checkpoint(chosen.folder, expected).params
        if chosen.setting:
            setting = pbt.settings_text(chosen.setting)
            print(f"replica {chosen.chosen} of {chosen.replicas} ({setting})")
        params = jax.tree.map(jnp.asarray, replica_of(params, chosen.chosen))
        if args.tasks.task:
            text = task_samples(params, cfg, args)
        else:
            text = sampling.printable(sample_text(params, cfg, args.sampling, args.seed))
        stop.check("while sampling")
    print(text)
    return text


def prepare_jax(args: Args, platform: str = "") -> Args:
    """Before JAX starts: the platform (`platform`, else --platform), the CPU split (the flags as
    used: --cpu_devices settled) and the compilation cache."""
    members, unit = args.parallel_generations_per_gpu, member_unit(args)
    shards = cluster.prepare(
        args.cluster, platform, members, unit, args.rank == 0, args.corpus.dir_path
    )
    return replace(args, cpu_devices=shards)


def parse_args(argv: list[str], cls: type | None = None) -> Args:
    """Args (or a subclass's flags: bench.py's) from the command line (egg/command.py), an
    --init_from run's model settings taken from its checkpoint, the objective's preset where a
    flag is not given."""
    return command.parse_args(
        cls or Args, argv, model_settings, lambda given: OBJECTIVES[given.objective].preset
    )


def work(args: Args) -> None:
    """What a command line asks: text from a checkpoint (--sample), else training."""
    args = prepare_jax(args)
    sample(args) if args.sampling.sample else train(args)


def main(argv: list[str] | None = None) -> None:
    command.main(argv, Path(__file__).resolve(), parse_args, work, run_folders)


if __name__ == "__main__":
    try:
        main()
    finally:  # the run has ended: a stop signal now would only interrupt JAX's exit handlers
        cluster.ignore_stop_signals()
