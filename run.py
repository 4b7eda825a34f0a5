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

This file holds the algorithm and its loop, top to bottom, one ruler per section: Args, constants,
integer math, model, GPU product kernel, forward, noise, ES step, integer ranges, flags, data
stream, sampling and diagnostics, loop, and main. Importing it does nothing: `python run.py` calls
main(). Beside it, egg/ holds the tools a run uses (flags, files, corpora, checkpoints and resume,
devices and processes, the record, diagnostics, PBT, sampling, HLO reading: its __init__.py) and
never imports this file; bench.py, compare.py, scripts/ and baselines/ import it.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path
from typing import Annotated, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from egg import UserError, checkpoints, cluster, corpora, flags, pbt, record, resume, sampling, supervisor
from egg import diagnostics as diagnosis
from egg.cluster import StopSignal, awaiting_jax_verdict, global_array, host_copy, local_copy, stop_requested
from egg.files import own
from egg.flags import check_range, check_ranges, flag, flat, parse, replace, section
from egg.hlo import Compiled, compile_fault, compile_now
from egg.record import describe_spread, replica_metrics, run_folder, save_dir_of, tolerated

# ------------------------------------------------------------------------------------------------
# Args. Each flag's facts (its allowed range, whether it changes training, upstream nano-egg's
# value, where it acts) are written once, beside the flag (egg/flags.py); the checks, the resume
# comparison, the --algorithm upstream preset and --help derive from them.

ROUNDS_TO_ZERO = "from 7 on every bias and gain perturbation rounds to 0 (the noise table's |entries| <= 46)"
INT16 = "its running sum is int16"
Rule = Literal["ztest", "momentum", "adam"]
# where a flag acts: under these update rules
WITH_M, WITH_V, ZTEST_ONLY = (("optimizer", rules) for rules in (("momentum", "adam"), ("adam",), ("ztest",)))


@dataclass(frozen=True)
class ModelFlags:
    n_layer: Annotated[int, *flag("[1, inf)", training=True)] = 6
    """number of minGRU blocks"""
    n_embd: Annotated[int, *flag("[1, inf)", training=True)] = 256
    """width of the residual stream (a multiple of 4)"""
    mlp_relu: Annotated[bool, *flag(training=True)] = False
    """a ReLU between the MLP's two matrices (upstream has none)"""
    init_std: Annotated[int, *flag("[0, 32]", upstream=16, why="16: upstream's N(0, 1)")] = 4
    """standard deviation of every matrix's initial entries in int8 steps (real = q / 16; 0: zeros)"""
    kernels: Literal["auto", "xla", "pallas"] = "auto"
    """products by the Pallas kernel (interpreted on the CPU) or XLA (auto: pallas on a GPU); the same bits"""


@dataclass(frozen=True)
class Args:
    """egg-jax's flags. options: the run, the population, EGGROLL, validation; then the model and tools."""

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
    """perturbations a member evaluates in turn, each on its share of the bytes (0: 10, or fewer for int32)"""

    # EGGROLL
    algorithm: Literal["egg", "upstream"] = "egg"
    """'upstream': every flag whose help shows an 'upstream:' value set to it unless given (the control)"""
    alpha: Annotated[float, *flag("(0, inf)", training=True, why="a share <= 1, or a schedule's > 1")] = 4.0
    """<= 1: fixed share of parameters allowed to move; > 1: upstream's 1 / ((2**alpha - 1) t / T + 1)"""
    alpha_decay_timestep: Annotated[int, *flag("[1, inf)", training=True)] = 1000
    """T of the --alpha > 1 schedule: the share reaches 2**-alpha at generation T and keeps decaying"""
    alpha_floor: Annotated[float, *flag("[0, 1)", training=True, upstream=0.0, why="a share")] = 1 / 64
    """the --alpha > 1 schedule's share never falls below this (0: no floor; 1/64: none up to 4,200)"""
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
    optimizer: Annotated[Rule, *flag(training=True, upstream="ztest")] = "momentum"
    """update rule: test this generation's Z (ztest), a decaying sum of it (momentum), it over |Z| (adam)"""
    momentum_shift: Annotated[int, *flag("[1, 7]", training=True, acts_if=WITH_M, why=INT16)] = 2
    """momentum, adam: the running sum keeps 1 - 2**-shift of itself per generation"""
    max_step: Annotated[int, *flag("[0, 127]", training=True, upstream=1, acts_if=WITH_M)] = 0
    """momentum, adam: an entry whose sum holds k thresholds moves min(k, this); 0: 2 at 10,000 pairs, or 1"""
    scale_shift: Annotated[int, *flag("[1, 7]", training=True, acts_if=WITH_V, why=INT16)] = 4
    """adam: the running mean of |Z| keeps 1 - 2**-shift of itself per generation"""
    shared_pair_state: Annotated[bool, *flag(training=True, upstream=False)] = True
    """both members of an antithetic pair start each generation from one hidden state, their mean"""
    null_from_scores: Annotated[bool, *flag(training=True, acts_if=ZTEST_ONLY)] = False
    """ztest: scale the null std by sqrt(this generation's sum of squared scores / its expected value)"""

    # validation
    validate_every: Annotated[int, *flag("[0, inf)")] = 0
    """generations between noise-free validations (0: only at the end)"""
    validation_batch_size: Annotated[int, *flag("[1, inf)")] = 1024
    """rows the validation data is cut into (evaluated in parallel)"""
    validation_tokens: Annotated[int, *flag("[0, inf)")] = 0
    """bytes per validation row (0: the whole held-out part)"""

    # the model's flags, and the tools' (egg/): each group apart in --help, each flag still --NAME
    architecture: Annotated[ModelFlags, *section("model")] = ModelFlags()
    """the int8 minGRU: its shape, its start, how its products run"""
    corpus: Annotated[corpora.Flags, *section("data")] = corpora.Flags()
    """the training and validation bytes"""
    replication: Annotated[pbt.Flags, *section("pbt")] = pbt.Flags()
    """replicas and population-based training"""
    sampler: Annotated[sampling.Flags, *section("sampling")] = sampling.Flags()
    """text from a checkpoint's model (--sample) or during training (--sample_every)"""
    checkpointing: Annotated[checkpoints.Flags, *section("checkpoints")] = checkpoints.Flags()
    """checkpoints, resume"""
    tracking: Annotated[record.Flags, *section()] = record.Flags()
    """the run's record (runs/RUN_NAME/metrics.jsonl) and Weights & Biases"""
    hosts: Annotated[cluster.Flags, *section("cluster")] = cluster.Flags()
    """several hosts (jax.distributed; detected automatically under SLURM), and the CPU's devices"""
    health: Annotated[diagnosis.Flags, *section("diagnostics")] = diagnosis.Flags()
    """the int8 activations' and parameters' health"""


# ------------------------------------------------------------------------------------------------
# Constants. Every fixed-point format is named once here; "q" is the stored integer.

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
    alpha_floor: float  # the alpha schedule's least share (host only: the thresholds)
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
    shapes = dict(emb=(VOCAB, n), W1=(4 * n, n), W2=(n, 4 * n), head=(VOCAB, n))
    return shapes.get(name, (n, n) if name in MATRICES else (n,))


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
    split = (n // chunk, chunk)
    products = x.astype(i32).reshape(x.shape[:-1] + split + (1,)) * b.reshape(b.shape[:-2] + split + (-1,))
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
    dot = partial(jnp.einsum, "rdsn,mn->rdsm", preferred_element_type=i32)
    acc = jnp.stack([dot(x[k], w[k]) for k in range(len(w))])
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
        noise = round_shift(row, NOISE_FRAC + sides.shift[..., None] - WEIGHT_FRAC)
        return clip_int8(rows.astype(i32) + sides.sign[..., None] * noise)
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
# GPU product kernel: on a GPU each of a layer's products is one Pallas (Triton) kernel that reads its
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

TILE_ROWS, TILE_COLUMNS, TILE_DEPTH = 64, 128, 64  # at most: pairs, outputs and inputs of a tile
# at least, inputs: 16 deep, the kernel as JAX 0.11.2's Triton compiled it for an H200 summed every
# product about twice (docs/gpu.org); exact from 32 on. The interpreter, which the tests run, cannot show it
TILE_DEPTH_MIN = 32


def product_kernel_takes(pairs: int, distinct: int, m: int, n: int) -> bool:
    """Whether the kernel takes a product of these shapes: tiles of powers of two >= 16 (Triton's
    int8 dots), at least 32 inputs deep (TILE_DEPTH_MIN), whole tiles of pairs within the distinct
    ones."""
    shaped = all(x >= 16 and x & (x - 1) == 0 for x in (m, n)) and n >= TILE_DEPTH_MIN
    return shaped and distinct % 16 == 0 and pairs % distinct == 0


def int8_product(*refs, noisy: bool, gained: bool, added: bool, x_layered: bool, tile: tuple[int, ...]):
    """The kernel: one program of product_kernel's grid, the refs of its operands' blocks
    (product_specs) and its output's block; noisy: with factors; gained: with a layer norm's gain;
    added: with a residual; tile (rows, columns, depth, n)."""
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

        def absolute(k, total):
            return total + jnp.sum(jnp.abs(x_ref[x_at, 0, :, pl.ds(k * depth, depth)].astype(i32)), 1)

        total = jax.lax.fori_loop(0, n // depth, absolute, jnp.zeros((rows,), i32))

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


def product_cost(x, w, a, b, gain, residual, out):
    """The cost one product_kernel call declares (Pallas's CostEstimate: 2 operations a MAC): the
    bytes of one layer of each stacked operand (the call reads only `layer`'s), the residual and
    the output whole."""
    from jax.experimental import pallas as pl

    layers_x, layers = x.shape[0], w.shape[1]
    stacked = sum(o.nbytes // layers for o in (w, a, b, gain) if o is not None)  # one layer of each
    outputs = math.prod(out.shape)  # int8, written whole, as the residual is read whole
    moved = x.nbytes // layers_x + stacked + (residual.nbytes if residual is not None else 0) + outputs
    macs = outputs * w.shape[-1]
    return pl.CostEstimate(flops=2 * macs, transcendentals=0, bytes_accessed=moved)


def product_kernel(x, w, a, b, shifts, layer, gain, residual, x_layered: bool, interpret: bool):
    """Every member's int8 product with G matrices: out[g] = x' (W_g + sigma E_g)^T / (16 sqrt(n)), as
    int8, where x' = layer_norm(x, gain) (with a gain) or x, plus the residual (with one), as
    matmul, layer_norm and clipped_add compute it.

    x (Lx, K, Q, S n) int8 (Lx = L with x_layered: the states, read at `layer`); w (G, L, K, m, n);
    a (G, L, K, D, m) and b (G, L, K, D, n): the pairs' rank-1 factors (None: noise-free); shifts
    (K,) int32; layer () int32; gain (L, K, D, S n), (L, K, 1, n) (every row's) or None; residual
    (K, Q, S m) or None. Returns (G, K, Q, S m). A program (int8_product) computes a tile of
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
    kinds = dict(noisy=noisy, gained=gain is not None, added=residual is not None, x_layered=x_layered)
    program = partial(int8_product, **kinds, tile=(rows, columns, depth, n))
    in_specs, operands = product_specs(x, w, a, b, shifts, layer, gain, residual, (rows, columns, n))
    out = jax.ShapeDtypeStruct((groups, replicas, pairs, sides * m), jnp.int8)
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
        compiler_params=compiler,
        cost_estimate=product_cost(x, w, a, b, gain, residual, out),
    )(*operands)


def kernel_fault(device) -> str:
    """Why the product kernel cannot run on this GPU under this JAX ("" where it can), from one tile's
    program compiled (Pallas's Triton backend, which it uses, is deprecated since JAX 0.11)."""

    def kernel(x, w):
        return product_kernel(x, w, None, None, None, 0, None, None, x_layered=False, interpret=False)

    fault = compile_fault(kernel, device, ((1, 1, 16, 16), jnp.int8), ((1, 1, 1, 16, 16), jnp.int8))
    return fault and f"the GPU product kernel cannot run under JAX {jax.__version__} ({fault})"


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
        lift = (lambda x: x) if group[0] in BLOCK_NAMES else (lambda x: x[None])
        w = jnp.stack([lift(params[name]) for name in group])
        a = b = None
        if noise is not None:  # rank 1: (L, K, D, m, 1) -> (L, K, D, m)
            a, b = (jnp.stack([lift(noise[name][f])[..., 0] for name in group]) for f in (0, 1))
        operands[group] = (w, a, b)
    for name in ("ln1", "ln2", "ln_out"):
        gain = params[name] if name in BLOCK_NAMES else params[name][None]  # (L, K, 1, D, S, n)
        operands[name] = gain.reshape(gain.shape[:2] + (gain.shape[3], -1))
    return operands


def model_inputs(params, noise, sides: Sides, cfg: Config) -> Model:
    """The Model of these parameters (each (K, ...)) and noise (each (K, D, ...), or None)."""
    model, model_noise = {}, {}
    for name in PARAM_NAMES:
        nz, block = None if noise is None else noise[name], name in BLOCK_NAMES
        if name in MATRICES:  # shared by every member of a replica
            model[name] = jnp.moveaxis(params[name], 1, 0) if block else params[name]
            if nz is not None:
                model_noise[name] = jax.tree.map(lambda x: jnp.moveaxis(x, 2, 0), nz) if block else nz
        else:  # each member's own: ([L,] K, 1, D, S, n)
            vector = perturbed_vector(params[name], nz, sides)
            model[name] = jnp.moveaxis(vector, 4, 0) if block else vector
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

    rows, at = as_rows(x) if x_layered else as_rows(x)[None], jnp.asarray(0 if layer is None else layer, i32)
    gains, added = model.kernel[gain] if gain else None, None if residual is None else as_rows(residual)
    shifts = model.sides.shift.reshape(-1)
    out = product_kernel(rows, *found, shifts, at, gains, added, x_layered, model.interpret)
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
    if cfg.kernels != "xla":  # unrolled (as on a GPU, interpreted too): a GPU would run three kernels
        carry, seen = (x, states), []  # a layer for the loop itself
        for at in range(cfg.n_layer):
            carry, found = layer(carry, at)
            seen.append(found)
        (x, states), seen = carry, jax.tree.map(lambda *v: jnp.stack(v), *seen)
    else:
        (x, states), seen = jax.lax.scan(layer, (x, states), jnp.arange(cfg.n_layer))
    (logits,) = products(model, x, None, ("head",), gain="ln_out")
    return logits, states, ({**seen, "embedding": embedding, "logits": logits} if collect else {})


def forward(params, noise, states, inputs, targets, sigma_shifts, cfg: Config, collect: bool = False):
    """Every replica's M members reading T bytes: the one forward of training (with noise) and of
       validation, sampling and diagnostics (noise None). params: each (K, ...); noise: each (K, D, ...)
       for D distinct pairs (M a multiple of 2 D), or None; states (K, M, L, n) int8; inputs, targets
       (M, T) uint8, the same bytes for every replica; sigma_shifts (K,) int32 (None without noise).
       Returns the fitness (K, M) int32 (log2-likelihood sums at LL_FRAC), the states (K, M, L, n), the
       last byte's logits (K, M, 256) int8 and with `collect` every byte's int8 activations ({name: (T,
       ...)}, else empty). Member p
    = (r D + d) S + s has the model's axes (R, D, S) by a reshape; states put their layer
       axis first, so that the layer scan slices them without copies."""
    params = jax.tree.map(jnp.asarray, params)
    replicas, count = states.shape[:2]
    sides = 1 if noise is None else 2
    distinct = count // sides if noise is None else jax.tree.leaves(noise)[0].shape[1]
    layout = (count // (sides * distinct), distinct, sides)  # (R, D, S)
    shifts = jnp.zeros((replicas,), i32) if sigma_shifts is None else sigma_shifts
    model = model_inputs(params, noise, make_sides(shifts, sides), cfg)

    def step(carry, io):
        h, _ = carry
        tok, target = io
        logits, h, seen = token_logits(model, h, tok, cfg, collect)
        return (h, logits), (log2_likelihood(logits, target, model.tables), seen)  # (K, R, D, S)

    h = jnp.moveaxis(states, 2, 0).reshape((cfg.n_layer, replicas) + layout + (cfg.n_embd,))
    io = (inputs.T.reshape((-1,) + layout), targets.T.reshape((-1,) + layout))  # (T, R, D, S)
    logits = jnp.zeros((replicas,) + layout + (VOCAB,), jnp.int8)
    (h, logits), (ll, seen) = jax.lax.scan(step, (h, logits), io)
    states = jnp.moveaxis(h.reshape((cfg.n_layer, replicas, count, cfg.n_embd)), 0, 2)
    fitness = jnp.sum(ll, axis=0).reshape(replicas, count)
    return fitness, states, logits.reshape(replicas, count, VOCAB), seen


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
        if name in MATRICES and cfg.rank:  # A, B
            factors = (shape[0], cfg.rank), (shape[1], cfg.rank)
            pieces += [(name, layers + factors[0], "gauss"), (name, layers + factors[1], "gauss_rank")]
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


@cache
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


@cache
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


class Replica(NamedTuple):
    """One replica's own settings: its seed (--seed + its index, its own for the whole run) and what
    --replica_NAME gives it and population-based training moves."""

    seed: int
    alpha: float
    alpha_decay_timestep: int
    sigma_shift: int


def alpha_at(cfg: Config, replica: Replica, generation: int) -> float:
    """Share of parameters allowed to move at a generation (the Z-test's two-sided level): the
    replica's alpha itself if <= 1, else upstream's 1 / ((2**alpha - 1) t / T + 1) for t =
    generation, T = alpha_decay_timestep: 1 at t = 0, 2**-alpha at t = T, decaying on, but never
    below --alpha_floor (upstream's has no floor). It depends on t only, not on --num_epochs, so a
    run extended on resume continues it exactly."""
    if replica.alpha <= 1:
        return replica.alpha
    decay = 1.0 / ((2.0**replica.alpha - 1.0) * generation / replica.alpha_decay_timestep + 1.0)
    return max(decay, cfg.alpha_floor)


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


def z_thresholds(cfg: Config, alpha: float) -> np.ndarray:
    """(2,) int32, for matrix / vector entries: what --optimizer tests at a share alpha allowed to
    move. ztest: floor(z x null std of Z) for z = z_(1 - alpha/2), so that for the integer Z, |Z| >
    threshold exactly when |Z| > z x std; momentum: the same for m. adam: the multiplier
    K = round(z x (std m / std u) sqrt(pi / 2) 2**(SCALE_FRAC - scale_shift)) of the test
    |m| 2**SCALE_FRAC > K v, as v / 2**scale_shift estimates E|u| = std u sqrt(2 / pi), capped at
    2**16 - 1. A level too small for float64 (1 - alpha / 2 rounds to 1) gets the largest int32
    (adam: the cap): nothing moves."""
    z = statistics.NormalDist().inv_cdf(1 - alpha / 2) if 1 - alpha / 2 < 1 else math.inf
    if cfg.optimizer == "adam":
        ratio = momentum_null_std(cfg) / u_null_std(cfg) * math.sqrt(math.pi / 2)
        multiplier = np.round(z * ratio * 2.0 ** (SCALE_FRAC - cfg.scale_shift))
        return np.minimum(multiplier, SCALE_MAX).astype(np.int32)
    stds = momentum_null_std(cfg) if cfg.optimizer == "momentum" else np.array(null_std(cfg))
    return np.minimum(np.floor(z * stds), INT32_MAX).astype(np.int32)


def replica_inputs(cfg: Config, replicas: list[Replica], generation: int) -> tuple:
    """The step's per-replica int32 arguments at a generation: thresholds (K, 2), seeds, sigma_shifts (K,)."""
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
    slots = [(slot, name) for slot in optimizer_slots(cfg) for name in PARAM_NAMES]
    return {f"{s}/{name}": jnp.full(full_shape(name, cfg), start[s](name), STATE) for s, name in slots}


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
       spent on the move (docs/results.org); adam: besides, v = v - round(v / 2**scale_shift) + |u|,
       and k = floor(|m| 2**SCALE_FRAC / (threshold v + 1)) (k >= 1 where |m| 2**SCALE_FRAC > threshold
       v), m restarting likewise. Ranges:
    |u| <= 127, so |m| and v stay <= 127 x 2**shift <= 16256 for shifts <= 7
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
        m, v = opt.get(f"m/{name}"), opt.get(f"v/{name}")
        step, m, v = rule_step(z[name], u, m, v, thresholds[kind_of(name)], cfg)
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
        first = segment * cfg.distinct_pairs + offset
        return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, first, distinct, 1), noise)

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
        fitness, states, _, _ = forward(params, nz, states, inputs, targets, sigma_shifts, cfg)
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
    replicated parameters and update rule state. For bench.py, part="fitness" stops before the
    update and part="inference" runs the same members and tokens without noise."""
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
        update = by_replica(partial(apply_rule, cfg=cfg))
        params, opt, moved = update(params, opt, z_of(weights), flat, thresholds)
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
    """Noise-free log2-likelihood sums of each row by each replica: evaluate(params, rows (R, L) uint8)
    -> (K, R), the rows spread over the devices (R a multiple of twice their number), replicated."""

    def evaluate(params, rows):
        h = jnp.zeros((cfg.replicas, rows.shape[0], cfg.n_layer, cfg.n_embd), jnp.int8)
        return forward(params, None, h, rows[:, :-1], rows[:, 1:], None, cfg)[0]

    rows = jax.sharding.PartitionSpec(POP)
    local = jax.shard_map(evaluate, mesh=mesh, in_specs=(REPLICATED, rows), out_specs=SPREAD, check_vma=False)
    return jax.jit(local, out_shardings=jax.sharding.NamedSharding(mesh, REPLICATED))


def init_run(cfg: Config, replicas: list[Replica]):
    """(params, opt, states) of a fresh run, each with the leading replica axis: each replica's
    parameters from its own seed, update rule states from their start, hidden states at zero."""
    seeds = jnp.array([r.seed for r in replicas], i32)
    params = jax.jit(jax.vmap(partial(init_params, cfg)))(seeds)
    stack = partial(jax.tree.map, lambda x: jnp.broadcast_to(x, (cfg.replicas,) + x.shape))
    states = jnp.zeros((cfg.replicas, cfg.population, cfg.n_layer, cfg.n_embd), jnp.int8)
    return params, stack(init_optimizer(cfg)), states


# ------------------------------------------------------------------------------------------------
# Integer ranges. Every int32 accumulator's worst case, from the int8 ranges and the config:
# a configuration for which one could exceed 2**31 - 1 is refused before anything runs. Fixed
# bounds need no check: layer norm < 2**30, divide_to_int8 < 2**28, log-sum-exp s <= 2**28.

# |log2 p(target)| at LL_FRAC: the target 254 logit steps below the top (254 * 16), plus log2 s
# for s <= 2**28 (2**LL_FRAC per bit above EXP_FRAC, one more for the mantissa)
LL_BOUND = 254 * 2 ** (LL_FRAC - LOGIT_FRAC) + (28 - EXP_FRAC + 1) * 2**LL_FRAC


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
    squares = noise_pairs(cfg) * (cfg.population // (2 * cfg.distinct_pairs) * score_max) ** 2
    remainders = 0 if cfg.fast_fitness else (-(-pairs // remainders_chunk(pairs)) + cfg.devices) * pairs
    largest = max(math.prod(param_shape(k, cfg)) for k in PARAM_NAMES)
    smaller = "a smaller --parallel_generations_per_gpu" + " or --segments" * (cfg.segments > 1)
    smaller += ", or --fast_fitness" * (not cfg.fast_fitness)  # what shrinks Z and the sums of scores
    return {
        "matmul accumulator x W^T + sigma x E^T": (INT8_MAX**2 * n_in + u_a, "a smaller --n_embd or --rank"),
        "low-rank product x B": (x_b, "a smaller --n_embd"),
        "fitness (log2-likelihood sum)": (LL_BOUND * cfg.tokens, "a smaller --tokens_per_update"),
        # both members' fitness lie in [-LL_BOUND T, 0]
        "fitness difference of a pair": (LL_BOUND * cfg.tokens, "a smaller --tokens_per_update"),
        "Z of a matrix entry": (z_matrix, smaller),
        "Z of a vector entry": (z_vector, smaller),
        # counted whether or not --null_from_scores computes it, so that --segments 0 picks one
        # count for a configuration whatever that flag says
        "sum of squared pair weights (--null_from_scores)": (squares, smaller),
        "sum of |pair difference| mod pairs (normalised fitness)": (remainders, smaller),
        "count of moved entries of one layer's tensor": (largest, "a smaller --n_embd"),
    }


def num_parameters(cfg: Config) -> int:
    """Parameters of one model."""
    return sum(math.prod(full_shape(k, cfg)) for k in PARAM_NAMES)


def make_config(args: Args, devices: int | None = None, platform: str = "cpu") -> Config:
    """The static configuration of a run on `devices` JAX devices of a platform (default: one CPU's
    worth). A CPU split into --cpu_devices of them counts as one device of
    --parallel_generations_per_gpu."""
    shards, gpu = max(args.hosts.cpu_devices, 1), platform in ("gpu", "cuda", "rocm")
    devices = shards if devices is None else devices
    population = args.parallel_generations_per_gpu * devices // shards
    auto = "pallas" if gpu else "xla"  # --kernels auto
    kernels = {"xla": "xla", "pallas": "pallas" if gpu else "interpret"}.get(args.architecture.kernels, auto)
    segments = min(args.segments or AUTO_SEGMENTS, args.tokens_per_update)
    derived = dict(population=population, tokens=args.tokens_per_update, devices=devices, kernels=kernels)
    derived |= dict(segments=segments, noise_per_segment=gpu, replicas=args.replication.replicas)
    derived["distinct_pairs"] = (args.num_perturbations or population) // 2
    # the rest as the flags of the same names say
    cfg = Config(**{k: derived[k] if k in derived else flat(args)[k] for k in Config._fields})
    while not args.segments and cfg.segments > 1 and max(accumulator_bounds(cfg).values())[0] > INT32_MAX:
        cfg = cfg._replace(segments=cfg.segments - 1)  # --segments 0: as many as the int32 bounds allow
    return cfg._replace(max_step=args.max_step or (2 if scored_pairs(cfg) >= STEP2_PAIRS else 1))


def mesh_config(args: Args, mesh: jax.sharding.Mesh) -> Config:
    """make_config for a run on this mesh's devices and platform."""
    return make_config(args, mesh.size, mesh.devices.flat[0].platform)


# ------------------------------------------------------------------------------------------------
# Flags: each replica's settings, and the checks every flag's facts and the int32 bounds imply
# (egg/flags.py reads the command line and applies the --algorithm upstream preset).

REPLICA_SETTINGS = Replica._fields[1:]  # what each replica sets for itself (--replica_NAME)


def replicas_of(args: Args) -> list[Replica]:
    """Each replica's settings: seed --seed + its index, the rest its --replica_NAME value, else --NAME."""
    rep, count = args.replication, args.replication.replicas
    given = {k: getattr(rep, f"replica_{k}") or (getattr(args, k),) * count for k in REPLICA_SETTINGS}
    return [Replica(args.seed + r, *(given[k][r] for k in REPLICA_SETTINGS)) for r in range(count)]


def single_run(args: Args, **changes) -> Args:
    """These flags without replicas (and PBT), with `changes`."""
    lists = {f"replica_{name}": () for name in REPLICA_SETTINGS}
    return replace(args, **{"replicas": 1, "pbt_every": 0, **lists, **changes})


def check_bounds(cfg: Config) -> None:
    """Refuse a configuration whose int32 accumulators could overflow (accumulator_bounds)."""
    for name, (bound, remedy) in accumulator_bounds(cfg).items():
        if bound > INT32_MAX:
            raise UserError(f"the {name} could reach {bound:,} > 2**31 - 1 (int32): use {remedy}")


def check_args(args: Args) -> None:
    """Refuse a bad configuration with one clear line, naming the flag, before anything is compiled."""
    check_ranges(args)
    p, g, n = args.parallel_generations_per_gpu, args.group_size, args.num_perturbations
    rep = args.replication
    k, proc, procs = rep.replicas, args.hosts.proc_id, args.hosts.num_procs
    pbt_refusal = f"--pbt_every needs --replicas 4 or more (the worst quarter copies the best), got {k}"
    refusals = [
        (p % 2, f"--parallel_generations_per_gpu must be even (antithetic pairs), got {p}"),
        (g % 2 or p % g, f"--group_size must be even and divide the population {p}, got {g}"),
        (n and (n % 2 or p % n), f"--num_perturbations must be even and divide the population {p}, got {n}"),
        (args.architecture.n_embd % 4, f"--n_embd must be a multiple of 4, got {args.architecture.n_embd}"),
        (proc >= procs, f"--proc_id must be below --num_procs, got {proc} of {procs}"),
        (rep.pbt_every and k < 4, pbt_refusal),
    ]
    for name, given in ((name, len(getattr(rep, f"replica_{name}"))) for name in REPLICA_SETTINGS):
        one_each = f"give one per replica (--replicas {k})"
        refusals.append((given and given != k, f"--replica_{name} has {given} value(s): {one_each}"))
    for refusal in (text for refused, text in refusals if refused):
        raise UserError(refusal)
    for k, replica in enumerate(replicas_of(args)):
        for name in REPLICA_SETTINGS:
            check_range(Args, name, getattr(replica, name), f" (replica {k})" if rep.replicas > 1 else "")
    check_bounds(make_config(args))


def check_z_test(cfg: Config, replicas: list[Replica]) -> None:
    """Refuse a fixed alpha of a replica so small that its threshold is beyond the largest |Z|
    (momentum: |m|) an entry can reach at this population: no parameter could ever move. (A
    schedule starts at alpha 1; adam's test compares with a running scale and has no such bound.)"""
    if cfg.optimizer == "adam":
        return
    bounds, ztest = accumulator_bounds(cfg), cfg.optimizer == "ztest"
    statistic, remedy = "|Z|" if ztest else "running sum |m|", "use a larger --alpha or population"
    for replica in replicas:
        thresholds = z_thresholds(cfg, alpha_at(cfg, replica, 0))
        for kind, threshold in zip(("matrix", "vector"), thresholds, strict=True):
            reach = bounds[f"Z of a {kind} entry"][0] if ztest else INT8_MAX << cfg.momentum_shift
            if threshold >= reach:
                raise UserError(
                    f"--alpha {replica.alpha:g} at population {cfg.population}: the Z-test threshold "
                    f"{threshold:,} is beyond the largest {statistic} a {kind} entry can reach ({reach:,}), "
                    f"so nothing would ever move; {remedy}"
                )


def parse_args(argv: list[str], cls: type = None) -> Args:
    """Args (or a subclass's flags: bench.py's) from the command line (egg/flags.py: tyro's forms,
    the sweeps' booleans, the --algorithm upstream preset); with --resume PATH, over that run's."""
    if flags.flag_given(argv, "benchmark"):
        raise UserError("--benchmark: run python bench.py with the same flags (with --target h100: the GPU)")
    args = parse(cls or Args, argv)
    recorded = resume.run_flags(args.checkpointing.resume)  # --resume PATH: that run's flags
    return parse(cls or Args, argv, recorded) if recorded else args


# ------------------------------------------------------------------------------------------------
# Data stream: what every generation reads of the training bytes (egg/corpora.py opens them: a
# read-only memory-mapped uint8 array, documents separated by byte 0), and the validation rows.


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


class Data(NamedTuple):
    """A run's bytes: for training, and the validation rows with what the baselines reach on them."""

    train: np.ndarray  # read-only, memory-mapped
    stream: Stream  # where every generation reads it
    valid_rows: np.ndarray  # (rows, L) uint8
    rows: jax.Array  # the same, padded to an even share per device, spread over the devices
    baselines: dict[str, float]  # bits/byte of a unigram and a bigram model and gzip (egg/corpora.py)


def read_data(args: Args, cfg: Config, mesh) -> Data:
    """The run's bytes: --data's (egg/corpora.py), at least two validation rows' worth held out when
    --data itself is cut."""
    train, valid = corpora.open_data(args.corpus, 2 * args.validation_batch_size)
    stream, valid_rows = make_stream(len(train), cfg), validation_rows(valid, args)
    padding = -len(valid_rows) % (2 * mesh.size)  # rows spread evenly over the devices, in pairs
    rows = global_array(np.pad(valid_rows, ((0, padding), (0, 0))), mesh, jax.sharding.PartitionSpec(POP))
    baselines = corpora.cached_baselines(train, valid_rows, args.corpus.dir_path)
    return Data(train, stream, valid_rows, rows, baselines)


# ------------------------------------------------------------------------------------------------
# Sampling and diagnostics: one model read noise-free (forward without noise), for text from its
# integer logits and for the health of its int8 activations.


@cache
def make_reader(cfg: Config, collect: bool = False):
    """One model (no replica axis) reading bytes noise-free, jitted: read(params, states (M, L, n),
    inputs (M, T) uint8) -> (states, the last byte's logits (M, 256) int8, with `collect` all else)."""

    def read(params, states, inputs):
        params = jax.tree.map(lambda p: jnp.asarray(p)[None], params)  # a run of one replica
        _, states, logits, seen = forward(params, None, states[None], inputs, inputs, None, cfg, collect)
        return states[0], logits[0], seen

    return jax.jit(read)


def sample_text(params, cfg: Config, sampler: sampling.Flags, seed: int) -> bytes:
    """--prompt and its continuation by --max_new_bytes bytes (egg/sampling.py draws them, the same
    for a seed), the prompt read after a byte 0 (the document separator); the last logits of each call
    (log2-probabilities at LOGIT_FRAC) are read on the host as bits: a sync point."""
    read, h = make_reader(cfg), jnp.zeros((1, cfg.n_layer, cfg.n_embd), jnp.int8)

    def next_bits(data: bytes) -> np.ndarray:
        nonlocal h
        for byte in data:  # a byte a call: one program, compiled once, for the prompt and the draws
            h, logits, _ = read(params, h, np.array([[byte]], np.uint8))
        return np.asarray(logits[0], np.float64) / 2**LOGIT_FRAC

    prompt = sampling.prompt_bytes(sampler.prompt)
    return prompt + sampling.continuation(next_bits, b"\0" + prompt, sampler, seed)


def activations(params, rows: np.ndarray, cfg: Config) -> dict:
    """Every int8 activation of one model reading rows (R, L) noise-free: {name: (R, L, [n_layer,]
    width)}, block activations with their layer axis."""
    h = jnp.zeros((rows.shape[0], cfg.n_layer, cfg.n_embd), jnp.int8)
    seen = make_reader(cfg, collect=True)(params, h, rows)[2]  # (L, [n_layer,] K, 1, R, 1, width)
    out = {}
    for name, x in seen.items():
        x = x.reshape(x.shape[: x.ndim - 5] + (x.shape[-3], x.shape[-1]))  # (L, [n_layer,] R, width)
        out[name] = jnp.moveaxis(x, -2, 0)
    return out


# ------------------------------------------------------------------------------------------------
# Loop: a run is opened (every refusal before it creates anything), compiled ahead of time, then
# trained, validating, exploiting (PBT), diagnosing, sampling, logging and saving where the flags
# say. The host never holds the device up: generation N + 1 is dispatched before N's numbers are
# read, and the host waits for the device only where it reads its values ("sync point").


def expected_arrays(cfg: Config) -> checkpoints.Expected:
    """What a run of this configuration reads from a checkpoint (egg/checkpoints.py)."""
    opt = {f"{slot}/{k}": full_shape(k, cfg) for slot in optimizer_slots(cfg) for k in PARAM_NAMES}
    states, model = (cfg.population, cfg.n_layer, cfg.n_embd), f"{cfg.n_embd}D-{cfg.n_layer}L"
    params = {k: full_shape(k, cfg) for k in PARAM_NAMES}
    return checkpoints.Expected(params, opt, states, cfg.replicas, model)


def starting_point(args: Args, save_dir: Path, cfg: Config, identity: dict, writer: bool) -> tuple:
    """(params, opt, states) on the host, each with the replica axis, the replicas' settings, and the
    checkpoint continued (egg/resume.py finds and checks it) or None: a fresh run's, or the
    checkpoint's, whose states or update rule state start afresh where they cannot carry over."""
    how, allow = args.checkpointing.resume, args.checkpointing.allow_changes
    acting = partial(flags.acts, Args)  # where a flag acts: a change that does not is no change
    found = resume.continue_from(how, save_dir, expected_arrays(cfg), identity, acting, allow, writer)
    if found is None:
        return init_run(cfg, replicas_of(args)), replicas_of(args), None
    fresh = init_run(cfg, replicas_of(args)) if found.opt is None or found.states is None else None
    opt = fresh[1] if found.opt is None else found.opt
    states = fresh[2] if found.states is None else found.states
    # the checkpoint's settings, as PBT left them, unless --allow_changes accepted new ones
    replica_flags = ("seed", *REPLICA_SETTINGS, *(f"replica_{name}" for name in REPLICA_SETTINGS))
    kept = None if any(k in found.changes for k in replica_flags) else found.meta.get("replica_settings")
    return (found.params, opt, states), [Replica(**x) for x in kept] if kept else replicas_of(args), found


def start_devices(args: Args) -> tuple[Args, jax.sharding.Mesh]:
    """Join the other processes and start the mesh: (the flags as used, the mesh). On a GPU: no CPU
    split, and XLA's products where the kernel cannot run (kernel_fault), said in one line."""
    cluster.init_distributed(args.hosts)
    mesh = cluster.population_mesh(POP)
    if mesh.devices.flat[0].platform == "cpu":
        return args, mesh
    args = replace(args, cpu_devices=1)
    fault = kernel_fault(mesh.devices.flat[0]) if mesh_config(args, mesh).kernels == "pallas" else ""
    if fault and args.architecture.kernels == "pallas":
        raise UserError(f"--kernels pallas: {fault}; use --kernels xla or auto")
    if fault and jax.process_index() == 0:
        print(f"products by XLA, the same bits: {fault}")
    return (replace(args, kernels="xla") if fault else args), mesh


def on_mesh(carry: tuple, mesh) -> tuple:
    """(params, opt, states): parameters and update rule state replicated on every device, hidden
    states spread over the population."""
    params, opt, states = carry
    params, opt = jax.tree.map(lambda p: global_array(p, mesh, REPLICATED), (params, opt))
    return params, opt, global_array(states, mesh, SPREAD)


def compile_generation(cfg: Config, mesh, part: str, carry: tuple, batch, inputs: tuple) -> Compiled:
    """make_generation_step's program for these arguments, compiled now (the first call then runs,
    and the program's memory and collectives are known before it does)."""
    return compile_now(make_generation_step(cfg, mesh, part).lower(*carry, batch, np.int32(0), *inputs))


class Progress(NamedTuple):
    """What changes as a run trains, besides the generation."""

    carry: tuple  # (params, opt, states) on the mesh, each with the replica axis
    replicas: list[Replica]  # each replica's settings (PBT moves them)
    scores: list[float]  # each replica's last validation bits/byte
    leader: int  # the best replica by that validation


class Run(NamedTuple):
    """What a training run sets up before its first generation."""

    args: Args  # as used (the CPU split settled)
    cfg: Config
    mesh: jax.sharding.Mesh
    writer: bool  # process 0: it alone prints, logs and writes checkpoints
    data: Data
    checkpointer: checkpoints.Checkpointer
    resumed: resume.Found | None  # the checkpoint continued: its folder, meta and accepted changes
    start: int  # the first generation: 0, or the checkpoint's
    progress: Progress  # its arrays on the mesh and the replicas' settings
    claims: list  # the writer's locks on the run folder and save_dir, held until the process ends


def open_run(args: Args, stop: StopSignal) -> Run:
    """Check, join the other processes, own the run's folders, read the data, find the checkpoint to
    resume: everything that can be refused is, before the run writes anything of its own."""
    check_args(args)
    args, mesh = start_devices(args)
    stop.again()
    cfg = mesh_config(args, mesh)
    check_bounds(cfg)
    check_z_test(cfg, replicas_of(args))
    writer, save_dir = jax.process_index() == 0, save_dir_of(args)
    places = [(run_folder(args), "metrics to --runs_dir", "--run_name")]
    places.append((save_dir, "checkpoints to --save_dir", "--save_dir"))
    for place in places * writer:  # a folder another run owns is refused at once
        own(*place, probe=True)
    with stop.interruptible("while reading the data: nothing saved"):
        data = read_data(args, cfg, mesh)
    claims = [own(*place) for place in places * writer]  # the run's own from now on (egg/files.py)
    identity = resume.training_identity(args, cfg.population, cfg.max_step, data.train)
    carry, replicas, resumed = starting_point(args, save_dir, cfg, identity, writer)
    keep = args.checkpointing.keep_checkpoints
    checkpointer = checkpoints.Checkpointer(save_dir, flat(args), keep, identity, writer)
    if resumed is not None:
        checkpointer.best = resumed.meta.get("best_val_bits_per_byte", math.inf)
    progress = Progress(on_mesh(carry, mesh), replicas, [math.nan] * cfg.replicas, 0)
    start = resumed.meta["generation"] if resumed else 0
    return Run(args, cfg, mesh, writer, data, checkpointer, resumed, start, progress, claims)


def batch_on_mesh(run: Run, generation: int) -> jax.Array:
    return global_array(batch_at(run.data.train, run.data.stream, run.cfg, generation), run.mesh, REPLICATED)


def bits_per_byte(log2_likelihood_sum, num_tokens: int) -> float:
    return -float(log2_likelihood_sum) / (num_tokens * 2**LL_FRAC)


class InFlight(NamedTuple):
    """A generation dispatched whose numbers the host has not read yet."""

    generation: int
    fitness: jax.Array  # (K, members) int32, spread over the devices
    moved: jax.Array  # (K, tensors) int32, entries moved per tensor and layer
    replicas: list[Replica]  # the settings it ran with
    dispatched: float  # when (time.time())


def dispatch(run: Run, compiled: Compiled, progress: Progress, generation: int, batch) -> tuple:
    """Start a generation on the device and return at once (JAX dispatches asynchronously): the
    progress holding its future arrays, and the generation in flight."""
    inputs, tick = replica_inputs(run.cfg, progress.replicas, generation), time.time()
    *carry, fitness, moved = compiled.step(*progress.carry, batch, np.int32(generation), *inputs)
    flight = InFlight(generation, fitness, moved, progress.replicas, tick)
    return progress._replace(carry=tuple(carry)), flight


def generation_metrics(run: Run, flight: InFlight, console: record.Console) -> tuple[dict, np.ndarray]:
    """(train/ and perf/ metrics, moved counts (K, tensors)) of a generation in flight, from the
    fitness of process 0's members. Sync point: waits for this generation (the next one may
    already be running)."""
    cfg, bits, size = run.cfg, partial(bits_per_byte, num_tokens=run.cfg.tokens), num_parameters(run.cfg)
    fitness, moved = local_copy(flight.fitness, axis=1).astype(np.int64), host_copy(flight.moved)
    seconds = console.lap(flight.generation, flight.dispatched)
    alphas = [float(alpha_at(cfg, r, flight.generation)) for r in flight.replicas]
    per_replica = [record.train_metrics(*x, bits, size) for x in zip(fitness, moved, alphas, strict=True)]
    tokens = cfg.population * cfg.tokens * cfg.replicas
    metrics = replica_metrics(per_replica, flight.replicas)
    return {**metrics, "perf/tokens_per_s": tokens / seconds, "perf/seconds": seconds}, moved


def replica_of(tree, k: int):
    """Replica k's arrays: one model's, without the replica axis."""
    return jax.tree.map(lambda x: x[k], tree)


def due(every: int, done: int) -> bool:
    return bool(every) and done % every == 0


class Due(NamedTuple):
    """What follows a generation, by the flags: the loop waits for the generation where one is due."""

    validate: bool  # (and exploit and explore, with PBT due)
    diagnose: bool
    sample: bool
    save: bool


def due_after(args: Args, done: int, stopping: bool) -> Due:
    last = done == args.num_epochs
    validate = last or due(args.validate_every, done) or due(args.replication.pbt_every, done)
    diagnose = due(args.health.log_every or 10 * args.health.debug, done)
    save = last or stopping or due(args.checkpointing.save_every, done)
    return Due(validate, diagnose, due(args.sampler.sample_every, done), save)


def validation_phase(run: Run, evaluate, progress: Progress, done: int, log) -> tuple[Progress, dict]:
    """Validate every replica noise-free (a sync point), keep the best model, and with PBT due,
    exploit and explore."""
    rows, replicas, carry = run.data.valid_rows, progress.replicas, progress.carry
    ll = host_copy(evaluate(carry[0], run.data.rows))[:, : len(rows)]
    scores = [bits_per_byte(np.sum(x, dtype=np.int64), rows.shape[0] * (rows.shape[1] - 1)) for x in ll]
    leader = min(range(len(scores)), key=lambda k: (scores[k], k))
    metrics = replica_metrics([{"val/bits_per_byte": v} for v in scores], replicas)
    metrics |= {f"val/{k}_bits_per_byte": v for k, v in run.data.baselines.items()}
    baselines, spread = corpora.describe_baselines(run.data.baselines), describe_spread(scores)
    log(f"generation {done}: validation {scores[leader]:.2f} bits/byte{spread} ({baselines})")
    if scores[leader] < run.checkpointer.best:
        which = {"replica": leader, "replica_setting": replicas[leader]._asdict()} if len(scores) > 1 else {}
        best = replica_of(jax.tree.map(host_copy, carry), leader)  # every process takes part: a sync point
        run.checkpointer.offer_best(done, best, scores[leader], which)
    if due(run.args.replication.pbt_every, done):
        sigma = flags.facts_of(Args)["sigma_shift"]  # explored within its range
        source, replicas, lineage = pbt.pbt_step(scores, replicas, run.args.seed, done, sigma[:2])
        carry, metrics["pbt/lineage"] = pbt.copy_replicas(carry, source), lineage
        log(f"generation {done}: population-based training: {pbt.describe_lineage(lineage)}")
    return Progress(carry, replicas, scores, leader), metrics


def diagnostics_phase(run: Run, params, moved: np.ndarray, replicas: list[Replica], done: int, log) -> dict:
    """diag/ metrics of every replica (and with --debug their tables): a sync point."""
    per_replica, shape = [], partial(full_shape, cfg=run.cfg)
    tensors = {k: (shape(k)[0] if k in BLOCK_NAMES else 1, math.prod(shape(k))) for k in PARAM_NAMES}
    for k in range(run.cfg.replicas):
        model = replica_of(params, k)
        seen = jax.tree.map(host_copy, activations(model, run.data.valid_rows[:16, :65], run.cfg))
        shares = diagnosis.moved_shares(moved[k], tensors)  # as apply_rule counts them
        per_replica.append(diagnosis.diagnostics(seen, jax.tree.map(host_copy, model), shares, INT8_MAX))
        if run.args.health.debug:
            who = f" replica {k}" if run.cfg.replicas > 1 else ""
            log(f"generation {done}{who} diagnostics:\n{diagnosis.diagnostics_table(per_replica[-1])}")
    return replica_metrics(per_replica, replicas, summary=False)


def host_work(run: Run, evaluate, progress: Progress, done: int, moved, todo: Due, stopping: bool, log):
    """What follows a generation where the flags say (todo): validation (and PBT), diagnostics, a
    sample, a checkpoint. Returns the progress and the metrics."""
    args, metrics = run.args, {}
    if todo.validate:
        progress, metrics = validation_phase(run, evaluate, progress, done, log)
    if todo.diagnose:
        with tolerated(f"generation {done}'s diagnostics", log):  # an aside: its error is said, no more
            metrics |= diagnostics_phase(run, progress.carry[0], moved, progress.replicas, done, log)
    if todo.sample:
        with tolerated(f"generation {done}'s sample", log):
            model = replica_of(progress.carry[0], progress.leader)
            text = sampling.printable(sample_text(model, run.cfg, args.sampler, args.seed + done))
            log(f"generation {done} sample: {text}")
            metrics["samples/text"] = text
    if todo.save:
        scores, leader, meta = progress.scores, progress.leader, {}
        if run.cfg.replicas > 1:
            meta = {"replica_settings": [r._asdict() for r in progress.replicas], "best_replica": leader}
            meta["replica_val_bits_per_byte"] = scores
        arrays = jax.tree.map(host_copy, progress.carry)  # every process takes part: a sync point
        folder = run.checkpointer.save(done, arrays, scores[leader], meta)
        if stopping:  # every process says so: they all stop after the same generation
            print(f"process {jax.process_index()} stopped by signal after generation {done}: saved {folder}")
    return progress, metrics


def finish(run: Run, progress: Progress, metrics: dict, stopped: bool, console: record.Console) -> dict:
    """The run's last lines (its validation, where it went and how to go on); the last metrics with
    the parameters (every replica's) on the host. `stopped`: a stop signal ended it early."""
    cfg, scores, leader = run.cfg, progress.scores, progress.leader
    console.close(cfg.population * cfg.tokens * cfg.replicas)
    if not stopped:
        which = pbt.settings_text(progress.replicas[leader]._asdict()) if cfg.replicas > 1 else ""
        console.log(record.describe_end(scores, leader, which, run.args.num_epochs))
    console.log(record.where_it_went(run.args, stopped))
    return {**metrics, "params": jax.tree.map(host_copy, progress.carry[0])}


def first_generation(run: Run, console: record.Console, stop: StopSignal) -> tuple:
    """What precedes the first generation: said before the step compiles and after, its memory
    checked, the record opened. Returns (the compiled step, the first batch)."""
    cfg, start, args, resumed = run.cfg, run.start, run.args, run.resumed
    changes = resume.describe_changes(resumed.changes) if resumed else ""  # what --allow_changes let by
    if resumed is not None:
        console.log(f"resuming from {resumed.folder} at generation {start}; changed: {changes or 'nothing'}")
    sizes = (num_parameters(cfg), scored_pairs(cfg), len(run.data.train), run.data.valid_rows.size)
    console.log(record.describe_run(run_folder(args).name, cfg, run.mesh, args.hosts.cpu_devices, *sizes))
    batch, inputs = batch_on_mesh(run, start), replica_inputs(cfg, run.progress.replicas, start)
    compiled = compile_generation(cfg, run.mesh, "train", run.progress.carry, batch, inputs)
    console.log(compiled.describe("generation step", "generation"))
    p, g, n = args.parallel_generations_per_gpu, args.group_size, args.num_perturbations
    cluster.check_memory(run.mesh, compiled.temporaries, p, math.lcm(2, g, n or 2))  # as check_args asks
    kept = f"{resumed.folder} stays the newest checkpoint" if resumed else "nothing saved"
    stop.check(f"before generation {start + 1}: {kept}")
    baselines = corpora.describe_baselines(run.data.baselines)
    console.log(f"baselines on the validation bytes, in bits/byte: {baselines}")
    summary = {f"baseline/{k}": v for k, v in run.data.baselines.items()}
    console.record = record.RunRecord(run_folder(args), flat(args), summary, start, run.writer, args.tracking)
    if changes:
        console.record.log({"resume/changed": changes}, start)
    return compiled, batch


def train(args: Args) -> dict:
    """Train up to --num_epochs generations; return the last metrics (and the parameters). A stop
    signal ends the run after the generation in flight, saved, exiting 128 + the signal's number;
    before the first generation it raises Stopped (nothing to save)."""
    with StopSignal(not cluster.several_processes(args.hosts)) as stop:
        started, run = time.time(), open_run(args, stop)
        args, start, progress = run.args, run.start, run.progress
        console = record.Console(args.num_epochs, start, run.writer, started)
        if start >= args.num_epochs:
            console.log(f"nothing to do: the checkpoint is at generation {start}; give --num_epochs above it")
            return finish(run, progress, {}, True, console)
        compiled, batch = first_generation(run, console, stop)
        evaluate = make_evaluate(run.cfg, run.mesh)  # compiled on first use
        metrics, stopping, flight = {}, False, None
        for generation in range(start, args.num_epochs):
            done = generation + 1
            with awaiting_jax_verdict(args.hosts.heartbeat_timeout):
                progress, sent = dispatch(run, compiled, progress, generation, batch)
                if done < args.num_epochs:  # the next generation's bytes, while the device works
                    batch = batch_on_mesh(run, done)
                if flight is not None:  # the generation before: done, or about to be
                    console.show(generation_metrics(run, flight, console)[0], done - 1, *progress[2:])
                flight, stopping = sent, stop_requested(stop) and done < args.num_epochs  # the last: finished
                if any(todo := due_after(args, done, stopping)):  # this generation's values are needed now
                    metrics, moved = generation_metrics(run, flight, console)
                    work = (evaluate, progress, done, moved, todo, stopping, console.log)
                    progress, found = host_work(run, *work)
                    console.show(metrics := {**metrics, **found}, done, *progress[2:])
                    flight = None
            if stopping:
                break
        last = finish(run, progress, metrics, stopping, console)
    if stopping:  # the code a job script requeues on (docs/design.org)
        raise SystemExit(cluster.stopped_code(stop))
    return last


# ------------------------------------------------------------------------------------------------
# Main: the platform, the CPU split and the compilation cache, set before JAX starts; then train or
# sample. A run of several processes is launched under a supervisor (egg/supervisor.py).


def sample(args: Args) -> str:
    """--sample: print a continuation of --prompt by the model of --resume (a stop signal: Stopped)."""
    sampler, how = args.sampler, args.checkpointing.resume
    check_ranges(args)
    with StopSignal() as stop:  # from here on a stop signal ends it in one line (the model loaded first)
        found = resume.sampled(how, save_dir_of(args), sampler.sample_replica)
        cfg = make_config(single_run(args, **found.shape))
        expected = expected_arrays(cfg._replace(replicas=found.replicas))
        params = checkpoints.load_checkpoint(found.folder, expected)[0]
        if found.setting:
            print(f"replica {found.chosen} of {found.replicas} ({pbt.settings_text(found.setting)})")
        model = jax.tree.map(jnp.asarray, replica_of(params, found.chosen))
        text = sampling.printable(sample_text(model, cfg, sampler, args.seed))
        stop.check("while sampling")
    print(text)
    return text


def prepare_jax(args: Args, platform: str = "") -> Args:
    """Before JAX starts: the platform (`platform`, else --platform), the CPU split (the flags as
    used: --cpu_devices settled) and the compilation cache."""
    p, g, n = args.parallel_generations_per_gpu, args.group_size, args.num_perturbations
    shards = cluster.prepare(args.hosts, platform, p, g, n, args.rank == 0, args.corpus.dir_path)
    return replace(args, cpu_devices=shards)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse_args(argv)
        if cluster.several_processes(args.hosts) and not supervisor.supervised():
            raise SystemExit(supervisor.supervise(Path(__file__).resolve(), argv, args))
        args = prepare_jax(args)
        sample(args) if args.sampler.sample else train(args)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except cluster.Stopped as stopped:  # before anything was left to save (docs/design.org: exit codes)
        raise SystemExit(stopped.say()) from None


if __name__ == "__main__":
    try:
        main()
    finally:  # the run has ended: a stop signal now would only interrupt JAX's exit handlers
        cluster.ignore_stop_signals()
