"""egg-jax: pretrain an int8 minGRU byte language model with integer-only EGGROLL evolution strategies.

    python run.py --data stdlib --n_embd 64 --n_layer 2 --parallel_generations_per_gpu 256
    python run.py --data my_corpus.txt --validate_every 50
    python run.py --help

Weights, activations and hidden states are int8; matmuls accumulate in int32; every rescale is a
shift, a clip to [-127, 127], a constant fixed-point multiplier or a small table. Training uses no
gradients and no floating point: each generation evaluates a population of low-rank antithetic
perturbations (noise from a counter-based RNG, never stored), and moves each parameter by +-1 where
a Z-test on the fitness-weighted noise passes. The file reads top to bottom: Args, constants,
integer math, model, noise, ES step, data, loop, main.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import signal
import statistics
import sys
import sysconfig
import time
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache, partial
from pathlib import Path
from typing import Annotated, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import tyro

VALID_HINT = "(default: minipile's validation split, else the last --valid_fraction of --data)"


@dataclass(frozen=True)
class Args:
    # experiment
    benchmark: bool = False
    """time training, fitness, inference and full-rank ES generations on random bytes, print a table"""
    seed: int = 0
    """seed of the initial parameters and of every perturbation"""
    num_epochs: int = 1000
    """number of generations to train (one ES update each; the upstream name)"""

    # data
    data: str = "minipile"
    """training bytes: 'minipile', 'stdlib' (Python's own sources, offline), a file or a folder"""
    valid_data: Annotated[str | None, tyro.conf.arg(metavar="PATH", help_behavior_hint=VALID_HINT)] = None
    """a separate validation file or folder"""
    valid_fraction: float = 0.01
    """share of --data held out for validation when --valid_data is not given"""
    dir_path: str = str(Path(__file__).resolve().parent / "cached_files")
    """folder for cached corpora and their baselines (minipile and folders are converted here once)"""

    # population
    parallel_generations_per_gpu: int = 1024
    """population size: members evaluated per generation (even)"""
    group_size: int = 2
    """members that share one data sequence (even, divides the population)"""
    tokens_per_update: int = 100
    """bytes each member predicts per generation"""
    segments: int = 0
    """perturbations each member evaluates in turn per generation, each on the next tokens_per_update /
    segments bytes (one more for the last tokens_per_update % segments; at most one segment per
    byte): one update weighs segments times the antithetic pairs for the same forward compute (the
    noise generated and Z's contraction grow with it). 0: 10, or as many as keep the int32 bounds"""

    # EGGROLL
    algorithm: Literal["egg", "upstream"] = "egg"
    """'upstream': upstream nano-egg's algorithm and model, every flag of UPSTREAM_ALGORITHM that is
    not on the command line set to upstream's value (the control of every comparison)"""
    alpha: float = 4.0
    """<= 1: fixed share of parameters allowed to move; > 1: upstream's 1 / ((2**alpha - 1) t / T + 1)"""
    alpha_decay_timestep: int = 1000
    """T of the --alpha > 1 schedule: the share reaches 2**-alpha at generation T and keeps decaying"""
    alpha_floor: float = 0.015625
    """the --alpha > 1 schedule's share never falls below this, in [0, 1) (0: upstream's, no floor);
    the default 1/64 leaves upstream's schedule as it is to generation 4,200 (alpha 4, T = 1000)"""
    sigma_shift: int = 3
    """perturbation scale sigma = 2**-sigma_shift, in [0, 6] (from 7 every bias and gain perturbation is 0;
    upstream's is 4)"""
    rank: int = 1
    """rank r of each matrix perturbation A B^T / sqrt(r) (0: full-rank noise, naive ES, for comparison)"""
    use_clt: bool = True
    """weight the update by the noise values (else by their signs)"""
    fast_fitness: bool = False
    """fitness of a pair = sign of its difference (else the difference normalised by mean |difference|)"""
    noise_reuse: int = 1
    """generations that share one set of perturbations (0: one set for the whole run)"""
    num_perturbations: int = 0
    """number of distinct perturbations (even, divides the population; 0: one per member)"""
    optimizer: Literal["ztest", "momentum", "adam"] = "momentum"
    """update rule: 'ztest' (upstream's: move where this generation's Z passes the test), 'momentum'
    (where a decaying sum of standardised Z does), 'adam' (that sum over a running mean of |Z|)"""
    momentum_shift: int = 2
    """momentum, adam: the running sum keeps 1 - 2**-shift of itself per generation, in [1, 7]"""
    scale_shift: int = 4
    """adam: the running mean of |Z| keeps 1 - 2**-shift of itself per generation, in [1, 7]"""
    shared_pair_state: bool = True
    """both members of an antithetic pair start each generation from one hidden state, their mean"""
    null_from_scores: bool = True
    """ztest: scale the Z-test's null std by sqrt(sum of this generation's squared scores / its
    expected value), so that ties and non-normal differences keep the moved share at alpha"""
    adapt_threshold: bool = False
    """scale each tensor's threshold, each layer's apart, by sqrt(its spread ratio: this generation's
    mean squared standardised Z over the null's), so every group moves about the same share whatever its
    signal; contains and replaces --null_from_scores's correction"""
    adapt_noise: bool = False
    """scale each tensor's noise, each layer's apart, by its own multiplier in [1/2, 2] (kept in the
    update rule's state): one step of 1/16 down per generation where its spread ratio is above the
    median group's, one up where not, steering every group's signal towards the same level"""

    # replicas and population-based training
    replicas: int = 1
    """models trained side by side in one compiled step (a replica axis), each with its own parameters,
    states, update rule state, seed (--seed + its index) and the settings below (given as lists, not
    drawn); all see the same data"""
    replica_alpha: tuple[float, ...] = ()
    """--alpha of each replica, given as a list of --replicas values (empty: --alpha for every one)"""
    replica_alpha_decay_timestep: tuple[int, ...] = ()
    """--alpha_decay_timestep of each replica, a list of --replicas values (empty: the flag's)"""
    replica_sigma_shift: tuple[int, ...] = ()
    """--sigma_shift of each replica, a list of --replicas values (empty: the flag's)"""
    pbt_every: int = 0
    """generations between population-based training steps (0: none; needs --replicas >= 4): the
    replicas ranked by validation bits/byte, the worst quarter copies the best quarter's model and
    moves the copied settings (explore: alpha and its decay by a factor, sigma_shift half the time
    by one)"""

    # model
    n_layer: int = 6
    """number of minGRU blocks"""
    n_embd: int = 256
    """width of the residual stream (a multiple of 4)"""
    mlp_relu: bool = False
    """a ReLU between the MLP's two matrices (upstream has none)"""
    init_std: int = 4
    """standard deviation of every matrix's initial entries in int8 steps (real = q / 16), in [0, 32]:
    16 is upstream's N(0, 1); 0 starts every matrix at zero"""

    # validation
    validate_every: int = 0
    """generations between noise-free validations (0: only at the end)"""
    validation_batch_size: int = 1024
    """rows the validation data is cut into (evaluated in parallel)"""
    validation_tokens: int = 0
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
    num_procs: int = 1
    """number of processes of a multi-host run started by hand"""
    proc_id: int = 0
    """index of this process in a multi-host run started by hand"""
    cpu_devices: int = 0
    """on the CPU: the JAX devices this host is split into, each evaluating its share of the
    population on its own (0: one per core, fewer where the share would not hold whole groups; 1
    with --rank 0 or several processes; 1: one device, whose products XLA spreads over the
    cores). The CPU still counts as one device of
    --parallel_generations_per_gpu: the population, and every result, stay the same. Left at 1 when
    XLA_FLAGS or JAX_NUM_CPU_DEVICES set the device count (each device then counts as one)"""

    # diagnostics
    log_every: int = 0
    """generations between integer-health diagnostics, logged as diag/... (0: none)"""
    debug: bool = False
    """print the diagnostics as a colour-coded table (every --log_every generations, else every 10)"""

    # sampling
    sample: bool = False
    """generate text from the checkpoint given by --resume instead of training"""
    prompt: str = "The "
    """text the samples continue"""
    max_new_bytes: int = 200
    """bytes to generate per sample"""
    temperature: float = 0.6
    """sampling temperature (0: greedy)"""
    min_p: float = 0.08
    """drop bytes whose probability is below min_p times the most likely byte's"""
    presence_penalty: float = 0.2
    """bits subtracted from the log2-probability of every byte already generated"""
    sample_replica: int = -1
    """--sample from a checkpoint of several replicas: which one (-1: the best by its last validation)"""
    sample_every: int = 0
    """generations between samples printed (and logged) during training (0: none)"""

    # checkpoints
    save_dir: str = ""
    """folder of this run's checkpoints (default: <runs_dir>/<run_name>/checkpoints)"""
    save_every: int = 100
    """generations between checkpoints (0: only at the end and when stopped by a signal)"""
    keep_checkpoints: int = 3
    """periodic checkpoints to keep (the best by validation is kept besides)"""
    resume: str = ""
    """continue from a checkpoint folder, a save_dir (its latest), or 'auto' (the latest in --save_dir)"""
    allow_changes: bool = False
    """with --resume: continue although flags that change training differ from the checkpoint's (logged)"""


# ------------------------------------------------------------------------------------------------
# Constants. Every fixed-point format is named once here; "q" is the stored integer.

VOCAB = 256  # bytes
INT8_MAX = 127  # int8 tensors live in the symmetric range [-127, 127]
INT32_MAX = 2**31 - 1  # every accumulator's worst case stays at or below this (see "Integer ranges")
AUTO_SEGMENTS = 10  # --segments 0: this many, or fewer where the int32 bounds require it
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
NOISE_SCALE_FRAC = 4  # --adapt_noise: a group's noise multiplier q, real = q / 2**4
NOISE_SCALE_RANGE = (8, 32)  # q's range: within a factor 2 of --sigma_shift's noise; 2 x 46 < 127
SPREAD_FRAC = 12  # --adapt_noise: a group's root spread ratio sqrt(r), real = q / 2**12
MATRICES = ("emb", "Wf", "Uf", "Wh", "Uh", "W1", "W2", "head")  # everything else is a vector
PARAM_NAMES = ("emb", "ln1", "Wf", "Uf", "bf", "Wh", "Uh", "bh", "ln2", "W1", "W2", "ln_out", "head")
BLOCK_NAMES = PARAM_NAMES[1:11]  # stacked along a leading n_layer axis, scanned over
i32 = jnp.int32


class Config(NamedTuple):
    """Static settings of the jitted functions (derived from Args, hashable)."""

    n_layer: int
    n_embd: int
    population: int
    group_size: int
    tokens: int
    segments: int  # perturbations per member per generation, one after another (segment_lengths)
    seed: int
    sigma_shift: int
    rank: int
    use_clt: bool
    fast_fitness: bool
    noise_reuse: int
    distinct_pairs: int  # pairs with their own noise; members p and p + 2 * distinct_pairs share it
    devices: int  # devices the population is spread over, parallel_generations_per_gpu each
    optimizer: str
    momentum_shift: int
    scale_shift: int
    shared_pair_state: bool
    null_from_scores: bool
    adapt_threshold: bool
    adapt_noise: bool
    mlp_relu: bool
    init_std: int  # matrices' initial standard deviation in steps at WEIGHT_FRAC
    replicas: int  # > 1: seed and sigma_shift are replica 0's here, each replica's traced in the step


# What each replica sets for itself (--replica_NAME), and population-based training explores
REPLICA_SETTINGS = ("alpha", "alpha_decay_timestep", "sigma_shift")
# the flags that decide the replicas' settings
REPLICA_FLAGS = ("seed", *REPLICA_SETTINGS, *(f"replica_{name}" for name in REPLICA_SETTINGS))


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
    """These flags without replicas (and PBT), with `changes`."""
    lists = {f"replica_{name}": () for name in REPLICA_SETTINGS}
    return dataclasses.replace(args, **{"replicas": 1, "pbt_every": 0, **lists, **changes})


def replica_args(args: Args, setting: dict) -> Args:
    """The flags of a run of this one replica alone."""
    return single_run(args, **setting)


def make_config(args: Args, devices: int | None = None) -> Config:
    """The static configuration of a run on `devices` JAX devices (default: one GPU's worth). A CPU
    split into --cpu_devices of them counts as one device of --parallel_generations_per_gpu."""
    shards = max(args.cpu_devices, 1)
    devices = shards if devices is None else devices
    population = args.parallel_generations_per_gpu * devices // shards
    distinct = args.num_perturbations or population
    first = replica_settings(args)[0]
    cfg = Config(
        n_layer=args.n_layer,
        n_embd=args.n_embd,
        population=population,
        group_size=args.group_size,
        tokens=args.tokens_per_update,
        segments=min(args.segments or AUTO_SEGMENTS, args.tokens_per_update),
        seed=first["seed"],
        sigma_shift=first["sigma_shift"],
        rank=args.rank,
        use_clt=args.use_clt,
        fast_fitness=args.fast_fitness,
        noise_reuse=args.noise_reuse,
        distinct_pairs=distinct // 2,
        devices=devices,
        optimizer=args.optimizer,
        momentum_shift=args.momentum_shift,
        scale_shift=args.scale_shift,
        shared_pair_state=args.shared_pair_state,
        null_from_scores=args.null_from_scores,
        adapt_threshold=args.adapt_threshold,
        adapt_noise=args.adapt_noise,
        mlp_relu=args.mlp_relu,
        init_std=args.init_std,
        replicas=args.replicas,
    )
    while (
        not args.segments
        and cfg.segments > 1
        and max(b for b, _ in accumulator_bounds(cfg).values()) > INT32_MAX
    ):
        cfg = cfg._replace(segments=cfg.segments - 1)  # --segments 0: as many as the int32 bounds allow
    return cfg


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
    """log2 softmax(logits)[target] at LL_FRAC, integers only. logits: (256,) int8 at LOGIT_FRAC.

    With d = max - logits in [0, 254]: sum 2**(-d/16) = sum exp2_frac[d % 16] >> (d // 16), each
    term <= 2**20 and the largest exactly 2**20, so 2**20 <= s <= 2**28. log2 s = e + log2(1 + m)
    with e the top bit (count leading zeros) and m the next MANT_BITS bits, read from a table.
    """
    logits = logits.astype(i32)
    top = jnp.max(logits)
    d = top - logits
    s = jnp.sum(jnp.asarray(tables.exp2_frac)[d & 15] >> (d >> 4))
    exponent = 31 - jax.lax.clz(s)  # in [20, 28]
    mantissa = (s >> (exponent - MANT_BITS)) - (1 << MANT_BITS)
    log2_s = ((exponent - EXP_FRAC) << LL_FRAC) + jnp.asarray(tables.log2_mant)[mantissa]
    return ((logits[target] - top) << (LL_FRAC - LOGIT_FRAC)) - log2_s


# ------------------------------------------------------------------------------------------------
# Model: EGG, an int8 minGRU language model. A "member" is one population member; `nz` is its
# noise (None for the noise-free model) and `sign` (+1 or -1) its antithetic side.


def param_shape(name: str, cfg: Config) -> tuple[int, ...]:
    """Shape of one parameter (one layer's, for block parameters); matrices are (out, in)."""
    n = cfg.n_embd
    return dict(emb=(VOCAB, n), W1=(4 * n, n), W2=(n, 4 * n), head=(VOCAB, n)).get(
        name, (n, n) if name in MATRICES else (n,)
    )


def full_shape(name: str, cfg: Config) -> tuple[int, ...]:
    """Shape of a parameter as stored: block parameters have a leading n_layer axis."""
    return (cfg.n_layer,) * (name in BLOCK_NAMES) + param_shape(name, cfg)


def init_params(cfg: Config):
    """Parameters as a dict of int8 arrays. Matrices are (out, in) with entries ~ N(0, s^2) at
    WEIGHT_FRAC, s = init_std, drawn from the same quantile table as the noise (std 2**NOISE_FRAC,
    |entries| <= 46) and scaled by s / 2**NOISE_FRAC, rounded half away from zero: |q| <= 46 x 32 / 16
    = 92 at s <= 32 (no floating point)."""
    tables = make_tables(cfg.rank)
    key = jax.random.fold_in(jax.random.key(cfg.seed, impl="threefry2x32"), 0)  # 1: noise
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


def vector(p, nz, sign, sigma_shift: int):
    """A vector parameter with its full-shape perturbation sign * sigma * noise."""
    if nz is None:
        return p
    return clip_int8(p.astype(i32) + sign * round_shift(nz, NOISE_FRAC + sigma_shift - WEIGHT_FRAC))


def chunked_dot(x, b):
    """x (n,) int8 times b (n, r) int8 -> (r,) int32, as exact int32 sums over chunks of at most 32
    entries, then a sum of the chunks. Elementwise, so it fuses on any backend; XLA:CPU splits a
    longer reduction in two passes that store every int32 product, the chunks avoid that."""
    n = x.shape[-1]
    chunk = max(c for c in range(1, 33) if n % c == 0)
    parts = jnp.sum(x.astype(i32).reshape(n // chunk, chunk, 1) * b.reshape(n // chunk, chunk, -1), axis=1)
    return sum(parts[k] for k in range(n // chunk))


def matmul(x, w, nz, sign, sigma_shift: int):
    """x (n,) int8 at any scale s -> x (W + sigma E)^T / (16 sqrt(n)) as int8, E = A B^T never built.

    x W^T accumulates in int32 at scale s * 2**WEIGHT_FRAC. With A (m, r) and B (n, r) at
    NOISE_FRAC (B already carries 1/sqrt(r)), sigma x E^T in the same units is
    ((x B) >> NOISE_FRAC) A^T >> sigma_shift. Dividing by sqrt(n) keeps the output's scale ~ s.
    """
    acc = jnp.dot(x, w.T, preferred_element_type=i32)
    if isinstance(nz, tuple):
        a, b = nz
        u = chunked_dot(x, b) >> NOISE_FRAC  # (r,)
        acc = acc + (jnp.sum(a * (sign * u), axis=1) >> sigma_shift)
    elif nz is not None:  # --rank 0: a full (m, n) noise matrix E, one more matmul per member
        acc = acc + ((sign * jnp.dot(x, nz.T, preferred_element_type=i32)) >> sigma_shift)
    return divide_to_int8(acc, 2**WEIGHT_FRAC * math.sqrt(x.shape[-1]))


def embed(emb, tok, nz, sign, sigma_shift: int):
    """Row `tok` of the embedding (+ sigma E[tok]), int8 at WEIGHT_FRAC."""
    if not isinstance(nz, tuple):  # noise-free, or --rank 0: a full (256, n) noise matrix
        return vector(emb[tok], None if nz is None else nz[tok], sign, sigma_shift)
    a, b = nz  # a (256, r), b (n, r)
    pert = jnp.dot(b, a[tok], preferred_element_type=i32)  # (n,) at 2 * NOISE_FRAC
    return clip_int8(emb[tok].astype(i32) + ((sign * pert) >> (2 * NOISE_FRAC - WEIGHT_FRAC + sigma_shift)))


def layer_norm(x, gain, tables: Tables):
    """Integer L1 layer norm: gain * x / mean|x|, int8 at WEIGHT_FRAC (mean |output| ~ gain)."""
    total = jnp.sum(jnp.abs(x.astype(i32)))  # <= 127 n
    mean = jnp.maximum(divide_to_int8(total, x.shape[-1]).astype(i32), 1)  # floor mean |x|, [1, 127]
    scaled = x.astype(i32) * gain.astype(i32)  # |.| <= 127 * 127 < 2**14
    return clip_int8((scaled * jnp.asarray(tables.recip)[mean]) >> RECIP_BITS)  # < 2**30


def block(x, h, p, nz, sign, cfg: Config, tables: Tables, collect: bool = False):
    """One minGRU block. x: residual stream (n,) int8 at WEIGHT_FRAC; h: hidden state (n,) int8
    using the full range (real = q / 127). Returns the new stream and state, and with `collect`
    the block's int8 activations for diagnostics (else an empty dict)."""

    def nzs(name):
        return None if nz is None else nz[name]

    def vec(name):
        return vector(p[name], nzs(name), sign, cfg.sigma_shift)

    def mm(v, name):
        return matmul(v, p[name], nzs(name), sign, cfg.sigma_shift)

    a = layer_norm(x, vec("ln1"), tables)
    # forget gate: clipping to int8 is the (hard) sigmoid; g = f + 127 in [0, 254] is g / 256
    g = clipped_add(mm(a, "Wf"), mm(h, "Uf"), vec("bf")).astype(i32) + INT8_MAX
    gated = ((g * h.astype(i32)) >> GATE_BITS).astype(jnp.int8)
    # candidate: clipping to int8 is the (hard) tanh
    c = clipped_add(mm(a, "Wh"), mm(gated, "Uh"), vec("bh")).astype(i32)
    h = (h.astype(i32) + ((g * (c - h.astype(i32))) >> GATE_BITS)).astype(jnp.int8)  # between h, c
    x = clipped_add(x, h)
    a = layer_norm(x, vec("ln2"), tables)
    hidden = mm(a, "W1")  # (4n,)
    hidden = jnp.maximum(hidden, 0) if cfg.mlp_relu else hidden
    x = clipped_add(x, mm(hidden, "W2"))
    if not collect:
        return x, h, {}
    gate, candidate = (g - INT8_MAX).astype(jnp.int8), c.astype(jnp.int8)
    return x, h, {"gate": gate, "candidate": candidate, "state": h, "mlp_hidden": hidden, "residual": x}


def token_logits(params, nz, sign, h, tok, cfg: Config, tables: Tables, collect: bool = False):
    """One byte through the model: logits (256,) int8 at LOGIT_FRAC, new states (L, n), and with
    `collect` the int8 activations of every layer (else an empty dict). The states h restart from
    zero at byte 0, the separator before every document."""
    h = jnp.where(tok == 0, jnp.zeros_like(h), h)

    def nzs(name):
        return None if nz is None else nz[name]

    x = embed(params["emb"], tok, nzs("emb"), sign, cfg.sigma_shift)
    block_params = {k: params[k] for k in BLOCK_NAMES}
    block_noise = None if nz is None else {k: nz[k] for k in BLOCK_NAMES}

    def layer(x, inputs):
        p, n, h_layer = inputs
        x, h_layer, seen = block(x, h_layer, p, n, sign, cfg, tables, collect)
        return x, (h_layer, seen)

    embedding = x
    x, (h, seen) = jax.lax.scan(layer, x, (block_params, block_noise, h))
    x = layer_norm(x, vector(params["ln_out"], nzs("ln_out"), sign, cfg.sigma_shift), tables)
    logits = matmul(x, params["head"], nzs("head"), sign, cfg.sigma_shift)
    return logits, h, ({**seen, "embedding": embedding, "logits": logits} if collect else {})


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


def pair_words(cfg: Config, bucket, pair):
    """Segment 0's stream of a pair: threefry's 32-bit words of key (seed, 1, bucket, pair), one
    threefry block per word (4 noise bytes), not per byte."""
    root = jax.random.fold_in(jax.random.key(cfg.seed, impl="threefry2x32"), 1)  # 0: init
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


def mix_segment(words, segment: int):
    """Segment s's stream from segment 0's: lowbias32 twice of each word plus s x SEGMENT_STEP (a
    bijection for each s, so every word stays uniform; distinct s give unrelated words): 14
    integer operations a word where threefry takes about a hundred."""
    if segment == 0:
        return words
    return lowbias32(lowbias32(words + jnp.uint32(segment * SEGMENT_STEP % 2**32)))


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


def generation_noise(cfg: Config, generation):
    """Noise of every distinct pair of every segment for this generation: leaves with a leading
    (noise_pairs,) axis, segment-major: segment s's pair k is
    words_to_noise(cfg, mix_segment(pair_words(cfg, bucket, k), s)). Threefry runs once per
    distinct pair, the remix once per segment."""
    bucket = generation // cfg.noise_reuse if cfg.noise_reuse else jnp.zeros_like(generation)
    words = jax.vmap(lambda k: pair_words(cfg, bucket, k))(jnp.arange(cfg.distinct_pairs))
    words = jnp.concatenate([mix_segment(words, s) for s in range(cfg.segments)])
    return jax.vmap(partial(words_to_noise, cfg))(words)


# ------------------------------------------------------------------------------------------------
# ES step. Members are laid out as (repeats, distinct_pairs, 2): member p = 2 * pair + side
# (+ repeat * 2 * distinct_pairs), side 0 adds the noise and side 1 subtracts it.


def population_fitness(params, noise, states, inputs, targets, cfg: Config, sigma_shift=None):
    """Fitness (log2-likelihood sums at LL_FRAC) of M members and their new states.
    states: (M, L, n) int8; inputs, targets: (M, T) uint8; noise: D pairs, M a multiple of 2 D,
    or None for the noise-free model (inference and validation, M even).

    The token scan is outermost and the members are vmapped inside it, laid out (repeats, D, 2)
    with layer axes first, so the layer scan slices its inputs without copies. What stays fixed
    over the tokens is built once: each member's perturbed vectors.

    Replicas: params, noise and states with a leading (K,) axis (states (K, M, L, n)), the same
    inputs for all, sigma_shift (K,) int32 (None: cfg's, e.g. without noise); fitness (K, M). The
    replica axis is one more member axis, inside the token and layer scans like the others (a vmap
    of this function around the scans sliced layers off a second axis at every token: 4 replicas
    of 256 ran at 79% of one run of 1024 on a 2-core CPU, against 92% this way)."""
    tables = make_tables(cfg.rank)
    params = jax.tree.map(jnp.asarray, params)
    lead = states.ndim - 3  # 1 with replicas
    replicas, members = (states.shape[0] if lead else 1), states.shape[lead]
    distinct = 1 if noise is None else jax.tree.leaves(noise)[0].shape[lead]
    layout = (members // (2 * distinct), distinct, 2)
    signs = jnp.array([1, -1], i32)
    if lead:  # each replica's (traced) sigma_shift; a single run's is static in cfg
        sigmas = jnp.full((replicas,), cfg.sigma_shift, i32) if sigma_shift is None else sigma_shift

    def layer_first(x, name):  # ([K,] D, L, ...) -> (L, [K,] D, ...) for block parameters
        return jnp.moveaxis(x, lead + 1, 0) if name in BLOCK_NAMES else x

    def sided(p, nz, sigma):  # perturbed vectors (2, D, [L,] n) -> ([L,] D, 2, n)
        out = jax.vmap(lambda sign: vector(p, nz, sign, sigma))(signs)
        return jnp.moveaxis(out, (0, 1), (2, 1)) if out.ndim == 4 else jnp.swapaxes(out, 0, 1)

    member_params, member_noise, axes, noise_axes, replica_axes, replica_noise_axes = ({} for _ in range(6))
    for name in PARAM_NAMES:
        block = name in BLOCK_NAMES
        if noise is None or name in MATRICES:  # shared by every member (of a replica)
            member_params[name] = jnp.moveaxis(params[name], lead, 0) if block else params[name]
            axes[name], replica_axes[name] = None, 1 if block else 0
            member_noise[name] = (
                None if noise is None else jax.tree.map(partial(layer_first, name=name), noise[name])
            )
            noise_axes[name] = replica_noise_axes[name] = None if noise is None else 1 if block else 0
        else:
            if lead:  # ([L,] K, D, 2, n)
                out = jax.vmap(sided)(params[name], noise[name], sigmas)
                member_params[name] = jnp.moveaxis(out, 0, 1) if block else out
            else:
                member_params[name] = sided(params[name], noise[name], cfg.sigma_shift)
            axes[name] = replica_axes[name] = 1 if block else 0
            member_noise[name], noise_axes[name], replica_noise_axes[name] = None, None, None

    def member(p, nz, sign, h, tok, sigma):
        c = cfg if sigma is None else cfg._replace(sigma_shift=sigma)
        logits, h, _ = token_logits(p, nz, sign, h, tok, c, tables)
        return logits, h

    by_side = jax.vmap(member, in_axes=(axes, None, 0, 1, 0, None), out_axes=(0, 1))
    by_pair = jax.vmap(by_side, in_axes=(axes, noise_axes, None, 1, 0, None), out_axes=(0, 1))
    by_members = jax.vmap(by_pair, in_axes=(None, None, None, 1, 0, None), out_axes=(0, 1))
    if lead:
        by_members = jax.vmap(
            by_members, in_axes=(replica_axes, replica_noise_axes, None, 1, None, 0), out_axes=(0, 1)
        )

    def step(h, io):
        tok, target = io
        logits, h = by_members(member_params, member_noise, signs, h, tok, sigmas if lead else None)
        target = jnp.broadcast_to(target, (replicas,) + target.shape)
        ll = jax.vmap(log2_likelihood, in_axes=(0, 0, None))(
            logits.reshape(replicas * members, VOCAB), target.reshape(replicas * members), tables
        )
        return h, ll.reshape(states.shape[: lead + 1])

    h = states.reshape(states.shape[:lead] + layout + states.shape[lead + 1 :])
    h = jnp.moveaxis(h, lead + 3, 0)  # (L, [K,] R, D, 2, n)
    io = (inputs.T.reshape((-1,) + layout), targets.T.reshape((-1,) + layout))
    h, ll = jax.lax.scan(step, h, io)
    return jnp.sum(ll, axis=0), jnp.moveaxis(h, 0, lead + 3).reshape(states.shape)


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
    total = (lambda x: jax.lax.psum(jnp.sum(x), axis)) if axis is not None else jnp.sum
    # floor(sum / pairs) = sum floor(d / pairs) + floor(sum (d mod pairs) / pairs): the first sum
    # is <= max |d| and the second < pairs**2 (both bounded in accumulator_bounds)
    mean = jnp.maximum(total(size // pairs) + total(size % pairs) // pairs, 1)
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


def shifted(x: int, k: int) -> int:
    """|x| / 2**k rounded half up: the magnitude round_shift gives, for a host integer."""
    return (abs(x) + ((1 << k) >> 1)) >> k


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


def isqrt(x):
    """floor(sqrt(x)) of a non-negative int32, bit by bit (the trial squares fit uint32)."""
    x, root = x.astype(jnp.uint32), jnp.zeros(x.shape, jnp.uint32)
    for bit in reversed(range(16)):
        trial = root | jnp.uint32(1 << bit)
        root = jnp.where(trial * trial <= x, trial, root)
    return root.astype(i32)


def expected_square_sum(cfg: Config) -> float:
    """S_null: the expected sum of squared pair weights (scores summed over the pairs sharing a
    noise) under the null, pairs x E[score**2]."""
    return scored_pairs(cfg) * shaped_score_rms(cfg.fast_fitness) ** 2


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
    rule = {"ztest": (), "momentum": ("m",), "adam": ("m", "v")}[cfg.optimizer]
    return rule + ("noise",) * cfg.adapt_noise


def state_shape(slot: str, name: str, cfg: Config) -> tuple[int, ...]:
    """m and v: one entry per parameter entry; noise: one per group (per layer of a block tensor)."""
    if slot == "noise":
        return (cfg.n_layer,) * (name in BLOCK_NAMES)
    return full_shape(name, cfg)


def init_optimizer(cfg: Config) -> dict:
    """The update rule's state, int16, keyed 'SLOT/NAME': m, the running sum of u (momentum,
    adam), from 0; v, the running sum of |u| (adam), from its null mean 2**scale_shift E|u|;
    noise, each group's noise multiplier (--adapt_noise), from 1 (2**NOISE_SCALE_FRAC). Empty for
    ztest alone."""
    v0 = np.round(2**cfg.scale_shift * u_null_std(cfg) * math.sqrt(2 / math.pi)).astype(int)

    def start(slot: str, name: str) -> int:
        return {"m": 0, "v": int(v0[int(name not in MATRICES)]), "noise": 2**NOISE_SCALE_FRAC}[slot]

    return {
        f"{slot}/{name}": jnp.full(state_shape(slot, name, cfg), start(slot, name), STATE)
        for slot in optimizer_slots(cfg)
        for name in PARAM_NAMES
    }


def standardise(z, shift: int):
    """u = clip(round(Z / 2**shift), -127, 127): Z at a null std in [2**U_STD_BITS, 2**(U_STD_BITS
    + 1)) (u_shifts), as int32."""
    reach = min(INT8_MAX << shift, INT32_MAX - (1 << shift))  # rounds to 127; no int32 overflow
    return jnp.clip(round_shift(jnp.clip(z, -reach, reach), shift), -INT8_MAX, INT8_MAX)


def spread_shift(entries: int) -> int:
    """Right shift of u**2 (<= 127**2 < 2**14) that keeps a sum of `entries` of them below 2**31."""
    return max(entries.bit_length() - 17, 0)


def spread(u, name: str, cfg: Config):
    """The spread ratio's two terms for each group (the tensor, or each layer of a stacked one):
    (sum((u**2) >> b) per group, int32 (layers,); its expectation under the null, a float),
    b = spread_shift. The ratio r ~ 1 when the group's Z is noise, > 1 when the fitness follows
    its noise (or the scores have heavier tails). Null expectation: entries x (E[u**2] / 2**b -
    (2**b - 1) / 2**(b + 1)), the floor of the shift taking (2**b - 1) / 2**(b + 1) on average."""
    layers = u.shape[0] if name in BLOCK_NAMES else 1
    groups = u.reshape(layers, -1)
    entries, b = groups.shape[1], spread_shift(groups.shape[1])
    mean_square = u_null_std(cfg)[int(name not in MATRICES)] ** 2
    expected = entries * (mean_square / 2**b - (2**b - 1) / 2 ** (b + 1))
    return jnp.sum((groups * groups) >> b, axis=1), expected


def adapted_threshold(threshold, u, name: str, cfg: Config):
    """--adapt_threshold: threshold x sqrt(r) per group, r its spread ratio (spread). Under the
    null r ~ 1 and nothing changes; a group whose Z spreads wider than the null gets a higher
    threshold, so every group moves about the share the test's level gives. Shaped like u's
    leading axes for broadcasting; adam's multiplier is capped at SCALE_MAX as z_thresholds' are."""
    square_sum, expected = spread(u, name, cfg)
    scaled = scale_by_root(threshold, square_sum, expected)
    if cfg.optimizer == "adam":
        scaled = jnp.minimum(scaled, SCALE_MAX)
    return scaled.reshape((-1,) + (1,) * (u.ndim - 1)) if name in BLOCK_NAMES else scaled[0]


def spread_root(u, name: str, cfg: Config):
    """sqrt(r) of each group's spread ratio (spread), int32 (layers,) at SPREAD_FRAC, within
    1 + 2**-12 relative (scale_by_root)."""
    square_sum, expected = spread(u, name, cfg)
    return scale_by_root(jnp.full(square_sum.shape, 2**SPREAD_FRAC, i32), square_sum, expected)


def adapted_noise(scales: dict, roots: dict) -> dict:
    """--adapt_noise: each group's noise multiplier q (int16 at NOISE_SCALE_FRAC, shaped (layers,) or
    ()) one step down where its root spread ratio (spread_root) is above the median group's, one up
    where not, within NOISE_SCALE_RANGE. r - 1 grows as the square of a group's noise (the fitness
    follows it more), so the steps steer every group towards the median group's signal: more noise
    for a group whose signal is lost among the others', less for one that stands out (smoothed
    less). Half the groups step each way, so the noise's overall scale stays --sigma_shift's.
    scales: {NAME: q}, roots: {NAME: sqrt(r)}, both by parameter name."""
    every = jnp.concatenate([roots[name].reshape(-1) for name in scales])
    median = jnp.sort(every)[every.size // 2]
    low, high = NOISE_SCALE_RANGE
    return {
        name: jnp.clip(
            q.astype(i32) + jnp.where(roots[name] > median, -1, 1).reshape(q.shape), low, high
        ).astype(STATE)
        for name, q in scales.items()
    }


def scale_noise(noise, opt):
    """--adapt_noise: the noise the members are perturbed with, each group's (A, or the full-shape
    noise) times its multiplier q / 2**NOISE_SCALE_FRAC, rounded half away from zero (int8: |entry|
    <= 2 x 46). The update's Z keeps the unscaled noise, so its null and thresholds are unchanged.
    Leaves with a leading (pairs,) axis, as generation_noise gives them."""

    def times(x, q, block: bool):
        if block:  # (pairs, layers, ...) against (layers,)
            q = q.reshape((1, -1) + (1,) * (x.ndim - 2))
        return round_shift(x.astype(i32) * q.astype(i32), NOISE_SCALE_FRAC).astype(jnp.int8)

    out = {}
    for name, nz in noise.items():
        q, block = opt[f"noise/{name}"], name in BLOCK_NAMES
        out[name] = (times(nz[0], q, block), nz[1]) if isinstance(nz, tuple) else times(nz, q, block)
    return out


def rule_step(z, u, m, v, threshold, cfg: Config):
    """(move in {-1, 0, 1}, new m, new v) of each entry of one parameter under --optimizer:
    ztest: sign(Z) where |Z| > threshold (u, m and v unused);
    momentum: u = standardise(Z), m = m - round(m / 2**momentum_shift) + u, sign(m)
    where |m| > threshold, and m restarts at 0 where the entry moved: the evidence is spent on the
    move (kept, m moved the same entry again and again: 0.2-0.3 bits/byte worse at 300 generations);
    adam: besides, v = v - round(v / 2**scale_shift) + |u|, sign(m) where |m| 2**SCALE_FRAC >
    threshold v, m restarting likewise. Ranges: |u| <= 127, so |m| and v stay <= 127 x 2**shift
    <= 16256 for shifts <= 7 (int16: x - round(x / 2**k) + 127 <= 127 x 2**k for every x <= 127 x
    2**k); |m| 2**SCALE_FRAC < 2**27 and threshold v < 2**16 x 2**14 (int32)."""
    if cfg.optimizer == "ztest":
        return jnp.sign(z) * (jnp.abs(z) > threshold), m, v
    m = m.astype(i32) - round_shift(m, cfg.momentum_shift) + u
    if cfg.optimizer == "momentum":
        passes = jnp.abs(m) > threshold
    else:
        v = v.astype(i32) - round_shift(v, cfg.scale_shift) + jnp.abs(u)
        passes = jnp.abs(m) << SCALE_FRAC > v * threshold
        v = v.astype(STATE)
    return jnp.sign(m) * passes, jnp.where(passes, 0, m).astype(STATE), v


def es_update(params, opt, noise, scores, thresholds, cfg: Config):
    """Move each parameter by +-1 where --optimizer's test on the fitness-weighted noise Z passes.

    scores: (scored_pairs,) shaped fitness, segment-major. Pairs sharing noise are summed first, so
    Z is one int32 matrix product per parameter. opt: the rule's state (init_optimizer). Returns the new
    parameters, the new state and how many entries moved in each tensor, each layer counted apart
    (so that every count fits int32; the host adds them up).
    """
    repeats = cfg.population // (2 * cfg.distinct_pairs)
    by_noise = scores.astype(i32).reshape(cfg.segments, repeats, cfg.distinct_pairs).sum(1)
    weights = by_noise.reshape(-1)  # (noise_pairs,), as generation_noise orders them
    shifts = u_shifts(cfg)
    if cfg.null_from_scores and cfg.optimizer == "ztest" and not cfg.adapt_threshold:
        thresholds = scale_by_root(thresholds, jnp.sum(weights * weights), expected_square_sum(cfg))
    new, new_opt, moved, roots = {}, {}, [], {}
    needs_u = cfg.optimizer != "ztest" or cfg.adapt_threshold or cfg.adapt_noise
    for name in PARAM_NAMES:
        z = z_statistic(noise[name], weights, cfg)
        kind = int(name not in MATRICES)
        u = standardise(z, shifts[kind]) if needs_u else None
        threshold = (
            adapted_threshold(thresholds[kind], u, name, cfg) if cfg.adapt_threshold else thresholds[kind]
        )
        m, v = opt.get(f"m/{name}"), opt.get(f"v/{name}")
        step, m, v = rule_step(z, u, m, v, threshold, cfg)
        new_opt.update({f"{slot}/{name}": x for slot, x in (("m", m), ("v", v)) if x is not None})
        if cfg.adapt_noise:
            roots[name] = spread_root(u, name, cfg)
        new[name] = clip_int8(params[name].astype(i32) + step)
        changed = new[name] != params[name]
        layers = changed.shape[0] if name in BLOCK_NAMES else 1
        moved.append(jnp.sum(changed.reshape(layers, -1), axis=1, dtype=i32))
    if cfg.adapt_noise:
        scales = adapted_noise({name: opt[f"noise/{name}"] for name in PARAM_NAMES}, roots)
        new_opt.update({f"noise/{name}": q for name, q in scales.items()})
    return new, new_opt, jnp.concatenate(moved)


POP = "pop"  # the mesh axis the population (and the validation rows) are spread over


def population_mesh(devices=None) -> jax.sharding.Mesh:
    """A 1-D mesh over every device of every process (or the given ones)."""
    return jax.sharding.Mesh(np.array(devices or jax.devices()), (POP,))


def population_spec(replica_axes: int) -> jax.sharding.PartitionSpec:
    """States and fitness: spread over the population axis, after the replica axis if any."""
    return jax.sharding.PartitionSpec(*(None,) * replica_axes, POP)


def pair_mean(states):
    """--shared_pair_state: both members of each antithetic pair (members 2k, 2k + 1) get the mean
    of their two hidden states, rounded half away from zero (int8: |mean| <= 127)."""
    pairs = states.astype(i32).reshape((-1, 2) + states.shape[1:])
    mean = round_shift(pairs[:, 0] + pairs[:, 1], 1).astype(jnp.int8)
    return jnp.repeat(mean, 2, axis=0)


def make_generation_step(cfg: Config, mesh: jax.sharding.Mesh, part: str = "train"):
    """One generation as one jitted call: population fitness, then the update.

    step(params, opt, states, batch, generation, thresholds) -> (params, opt, states, fitness, moved)
    batch: (P / group_size, T + 1) uint8, one data sequence per group of members, replicated.
    Each device evaluates its parallel_generations_per_gpu members (states and fitness are
    sharded); the one collective gathers every pair's int8 score in every segment (half a byte per
    member and segment); then every device rebuilds all the noise from its counters and applies
    the identical update to its replicated parameters and update rule state. For --benchmark,
    part="fitness" stops before the update and part="inference" runs the same members and tokens
    without noise.

    With cfg.replicas = K > 1 every replica runs this same step: params, opt, states and
    thresholds have a leading (K,) axis (the states sharded on their second), and step takes two
    more (K,) int32 arguments, each replica's seed and sigma_shift, traced where a single run has
    them static (shifts by a traced amount are the same integer operations). The noise, the
    shaping and the update are vmapped over the replicas; the population fitness takes the
    replica axis as one more member axis (population_fitness).
    """
    spec = jax.sharding.PartitionSpec
    members = cfg.population // cfg.devices  # per device
    distinct = min(cfg.distinct_pairs, members // 2)  # distinct noises a device evaluates
    lead = int(cfg.replicas > 1)  # the replica axis, if any

    def each(f, *xs):
        """f of every replica (a vmap over the replica axis), or of the single run."""
        return jax.vmap(f)(*xs) if lead else f(*xs)

    def local_step(params, opt, states, batch, generation, thresholds, seed=None, sigma_shift=None):
        first = jax.lax.axis_index(POP) * members
        tokens = batch[(first + jnp.arange(members)) // cfg.group_size]  # (members, T + 1)
        nothing = jnp.zeros((), i32)
        noise, local = None, None
        if part != "inference":
            # every pair's noise (the update needs them all), from each replica's seed
            if lead:
                noise = jax.vmap(lambda s: generation_noise(cfg._replace(seed=s), generation))(seed)
            else:
                noise = generation_noise(cfg, generation)
            offset = (first // 2) % cfg.distinct_pairs

            def this_device(n):  # ([K,] S D, ...) -> (S, [K,] distinct, ...): each segment's local pairs
                n = n.reshape(n.shape[:lead] + (cfg.segments, cfg.distinct_pairs) + n.shape[lead + 1 :])
                return jnp.moveaxis(jax.lax.dynamic_slice_in_dim(n, offset, distinct, axis=lead + 1), lead, 0)

            local = jax.tree.map(this_device, noise)

        def segment(states, xs):
            nz, inputs, targets = xs
            if cfg.shared_pair_state:
                states = each(pair_mean, states)
            if cfg.adapt_noise and nz is not None:
                nz = each(scale_noise, nz, opt)
            fitness, states = population_fitness(params, nz, states, inputs, targets, cfg, sigma_shift)
            return states, fitness

        parts, segment_start, token_start = [], 0, 0
        for count, length in segment_lengths(cfg):  # a scan over the segments of each length

            def cut(x, a=token_start, n=count, length=length):  # (n, members, length): each segment's bytes
                return jnp.moveaxis(x[:, a : a + n * length].reshape(members, n, length), 1, 0)

            nz = jax.tree.map(lambda x, a=segment_start, n=count: x[a : a + n], local)
            states, out = jax.lax.scan(segment, states, (nz, cut(tokens[:, :-1]), cut(tokens[:, 1:])))
            parts.append(out)
            segment_start, token_start = segment_start + count, token_start + count * length
        fitness = jnp.concatenate(parts)  # (S, [K,] members)
        if part != "train":
            return params, opt, states, jnp.sum(fitness, axis=0), nothing
        shaped = each(partial(shape_fitness, cfg=cfg, axis=POP), jnp.moveaxis(fitness, 0, lead))
        scores = jax.lax.all_gather(shaped, POP, axis=lead + 1, tiled=True)  # ([K,] S, pairs)
        scores = scores.reshape(scores.shape[:lead] + (-1,))
        params, opt, moved = each(partial(es_update, cfg=cfg), params, opt, noise, scores, thresholds)
        return params, opt, states, jnp.sum(fitness, axis=0), moved

    population = population_spec(lead)
    step = jax.shard_map(
        local_step,
        mesh=mesh,
        in_specs=(spec(), spec(), population, spec(), spec(), spec()) + (spec(), spec()) * lead,
        out_specs=(spec(), spec(), population, population, spec()),
        check_vma=False,
    )
    return jax.jit(step, donate_argnums=(0, 1, 2))


def make_evaluate(cfg: Config, mesh: jax.sharding.Mesh):
    """Noise-free log2-likelihood sums of each row: evaluate(params, rows (R, L) uint8) -> (R,),
    the rows spread over the devices (R a multiple of twice their number), the result replicated;
    with replicas, params with a leading (K,) axis and the result (K, R)."""
    spec = jax.sharding.PartitionSpec
    lead = (cfg.replicas,) * (cfg.replicas > 1)

    def evaluate(params, rows):
        h = jnp.zeros(lead + (rows.shape[0], cfg.n_layer, cfg.n_embd), jnp.int8)
        return population_fitness(params, None, h, rows[:, :-1], rows[:, 1:], cfg)[0]

    out = population_spec(len(lead))
    local = jax.shard_map(evaluate, mesh=mesh, in_specs=(spec(), spec(POP)), out_specs=out, check_vma=False)
    return jax.jit(local, out_shardings=jax.sharding.NamedSharding(mesh, spec()))


def initial_states(cfg: Config):
    return jnp.zeros((cfg.population, cfg.n_layer, cfg.n_embd), jnp.int8)


def init_replicas(cfg: Config, settings: list[dict]):
    """(params, opt, states) of a fresh run: with replicas, each replica's parameters from its own
    seed, stacked on a leading axis, as are the update rule states and hidden states."""
    if cfg.replicas == 1:
        return jax.jit(init_params, static_argnums=0)(cfg), init_optimizer(cfg), initial_states(cfg)
    seeds = jnp.array([s["seed"] for s in settings], i32)
    params = jax.jit(jax.vmap(lambda seed: init_params(cfg._replace(seed=seed))))(seeds)
    stack = partial(jax.tree.map, lambda x: jnp.broadcast_to(x, (cfg.replicas,) + x.shape))
    return params, stack(init_optimizer(cfg)), stack(initial_states(cfg))


def replica_thresholds(rows: list[np.ndarray], cfg: Config) -> np.ndarray:
    """The step's thresholds argument from each replica's (2,) row: (K, 2), or (2,) for a single run."""
    return np.stack(rows) if cfg.replicas > 1 else rows[0]


def replica_inputs(cfg: Config, settings: list[dict]) -> tuple:
    """The step's extra arguments: each replica's seed and sigma_shift (none for a single run)."""
    if cfg.replicas == 1:
        return ()
    return tuple(np.array([s[name] for s in settings], np.int32) for name in ("seed", "sigma_shift"))


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
    # the members' noise: --adapt_noise scales A (or full-shape noise) by up to its largest multiplier
    a_fwd = a_max * NOISE_SCALE_RANGE[1] // 2**NOISE_SCALE_FRAC if cfg.adapt_noise else a_max
    n_in = 4 * cfg.n_embd  # the widest matmul input (the MLP's down projection)
    x_b = INT8_MAX * b_max * n_in  # x B
    u_a = (x_b >> NOISE_FRAC) * a_fwd * cfg.rank  # ((x B) >> 4) A^T
    score_max = 1 if cfg.fast_fitness else INT8_MAX
    pairs = scored_pairs(cfg)
    z_vector = pairs * score_max * (a_max if cfg.use_clt else 1)
    k = weighted_shift(cfg)  # a low-rank Z sums int8 round(w_j a / 2**k) times b
    z_matrix = noise_pairs(cfg) * shifted(weighted_max(cfg), k) * cfg.rank
    z_matrix *= b_max if cfg.use_clt else 1
    if cfg.rank == 0:  # full-rank noise: x E^T, and Z sums single noise entries as a vector's does
        x_b, u_a, z_matrix = 0, INT8_MAX * a_fwd * n_in, z_vector
    return {
        "matmul accumulator x W^T + sigma x E^T": (INT8_MAX**2 * n_in + u_a, "a smaller --n_embd or --rank"),
        "low-rank product x B": (x_b, "a smaller --n_embd"),
        "fitness (log2-likelihood sum)": (LL_BOUND * cfg.tokens, "a smaller --tokens_per_update"),
        # both members' fitness lie in [-LL_BOUND T, 0]
        "fitness difference of a pair": (LL_BOUND * cfg.tokens, "a smaller --tokens_per_update"),
        "Z of a matrix entry": (
            z_matrix,
            "a smaller --parallel_generations_per_gpu or --segments, or --fast_fitness",
        ),
        "Z of a vector entry": (
            z_vector,
            "a smaller --parallel_generations_per_gpu or --segments, or --fast_fitness",
        ),
        "sum of squared pair weights (--null_from_scores)": (
            noise_pairs(cfg) * (cfg.population // (2 * cfg.distinct_pairs) * score_max) ** 2
            if cfg.null_from_scores
            else 0,
            "a smaller --parallel_generations_per_gpu or --segments, or --fast_fitness",
        ),
        "sum of |pair difference| mod pairs (normalised fitness)": (
            0 if cfg.fast_fitness else pairs * (pairs - 1),
            "a smaller --parallel_generations_per_gpu or --segments, or --fast_fitness",
        ),
        "count of moved entries of one layer's tensor": (
            max(math.prod(param_shape(k, cfg)) for k in PARAM_NAMES),
            "a smaller --n_embd",
        ),
    }


def num_parameters(cfg: Config) -> int:
    return sum(math.prod(param_shape(k, cfg)) * (cfg.n_layer if k in BLOCK_NAMES else 1) for k in PARAM_NAMES)


def check_ranges(cfg: Config) -> None:
    for name, (bound, flag) in accumulator_bounds(cfg).items():
        if bound > INT32_MAX:
            raise UserError(
                f"the {name} could reach {bound:,} > 2**31 - 1 (int32) with this config: use {flag}"
            )


def largest_sigma_shift() -> int:
    """The largest --sigma_shift at which a vector perturbation can be non-zero. A vector moves by
    round_shift(q, s) for a noise entry q (s = sigma_shift + NOISE_FRAC - WEIGHT_FRAC), which is
    >= 1 exactly while |q| >= 2**(s - 1): up to s = bit length of the table's largest |q| (46: 6)."""
    largest = int(np.abs(make_tables(1).gauss).max())
    return largest.bit_length() - (NOISE_FRAC - WEIGHT_FRAC)


def check_z_test(args: Args, cfg: Config) -> None:
    """Refuse a fixed --alpha so small that its threshold is beyond the largest |Z| (momentum: |m|)
    an entry can reach at this population: no parameter could ever move. (A schedule starts at
    alpha 1; adam's test compares with a running scale and has no such bound.)"""
    if cfg.optimizer == "adam":
        return
    bounds = accumulator_bounds(cfg)
    first = z_thresholds(dataclasses.replace(args, num_epochs=1), cfg)[0]
    statistic = "|Z|" if cfg.optimizer == "ztest" else "running sum |m|"
    for kind, threshold in zip(("matrix", "vector"), first, strict=True):
        reach = (
            bounds[f"Z of a {kind} entry"][0] if cfg.optimizer == "ztest" else INT8_MAX << cfg.momentum_shift
        )
        if threshold >= reach:
            raise UserError(
                f"--alpha {args.alpha:g} at population {cfg.population}: the Z-test threshold {threshold:,} "
                f"is beyond the largest {statistic} a {kind} entry can reach ({reach:,}), so nothing would "
                "ever move; use a larger --alpha or population"
            )


# ------------------------------------------------------------------------------------------------
# Data: a corpus is a read-only memory-mapped uint8 array; documents are separated by byte 0.


class UserError(Exception):
    """Bad input from the user: printed as one line, exit code 2, no traceback."""


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


@contextmanager
def atomic_file(path: Path):
    """Open `path` for binary writing under a hidden temporary name (.NAME.tmpPID), then fsync it
    and rename it into place: a kill at any moment never leaves a half-written file under the real
    name (a failed write removes its temporary)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
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
#   params.npz   the int8 parameters, one array per name in PARAM_NAMES (numpy's own format)
#   states.npz   the carried hidden states (population, n_layer, n_embd) int8
#   optimizer.npz the update rule's int16 state, one array per 'SLOT/NAME' (not for --optimizer ztest)
#   meta.json    generation, validation score, format version, every flag of the run, and the
#                settings that decide its training (compared on resume)
# A checkpoint is written into a hidden temporary folder and renamed into place, and the pointer
# files LATEST and BEST are replaced by rename too: a kill at any moment leaves the previous
# checkpoints intact and never a half-written one under a real name.

CHECKPOINT_FORMAT = 3  # 2 adds meta["training"], 3 optimizer.npz and --optimizer's flags; all load
# Flags that change what a generation computes. --num_epochs is not one: the alpha schedule, the
# noise and the data position depend on the generation counter only, so a run may be extended.
# Nor is --init_std: it decides the parameters a fresh run starts from, never a resumed one's.
TRAINING_FLAGS = (
    "seed",
    "alpha",
    "alpha_decay_timestep",
    "alpha_floor",
    "sigma_shift",
    "rank",
    "use_clt",
    "fast_fitness",
    "noise_reuse",
    "num_perturbations",
    "optimizer",
    "momentum_shift",
    "scale_shift",
    "shared_pair_state",
    "null_from_scores",
    "adapt_threshold",
    "adapt_noise",
    "group_size",
    "tokens_per_update",
    "segments",
    "n_layer",
    "n_embd",
    "mlp_relu",
    "replicas",
    "replica_alpha",
    "replica_alpha_decay_timestep",
    "replica_sigma_shift",
    "pbt_every",
)
# What a checkpoint that does not record a flag was trained with: format 2 and older record none
# of these, format 3 before --adapt_threshold, --adapt_noise, --replicas, --segments and --alpha_floor
# existed not those
MISSING_FLAGS = dict(
    alpha_floor=0.0,
    optimizer="ztest",
    momentum_shift=2,
    scale_shift=4,
    shared_pair_state=False,
    null_from_scores=False,
    adapt_threshold=False,
    adapt_noise=False,
    mlp_relu=True,
    replicas=1,
    segments=1,
    replica_alpha=[],
    replica_alpha_decay_timestep=[],
    replica_sigma_shift=[],
    pbt_every=0,
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
    """Everything besides the generation counter that decides how a run trains: the training flags,
    the total population (members per device x devices: the device count alone changes nothing)
    and the training bytes."""
    identity = {name: getattr(args, name) for name in TRAINING_FLAGS}
    identity = {k: list(v) if isinstance(v, tuple) else v for k, v in identity.items()}  # as JSON has them
    return {**identity, "population": cfg.population, "data": data_fingerprint(train_bytes)}


def training_changes(meta: dict, identity: dict) -> dict[str, tuple]:
    """{setting: (the checkpoint's value, this run's)} for every setting that differs. A format 1
    checkpoint has only its flags to compare."""
    old = meta.get("training") or {k: v for k, v in meta.get("args", {}).items() if k in TRAINING_FLAGS}
    old = {**MISSING_FLAGS, **old}
    return {k: (old[k], v) for k, v in identity.items() if k in old and old[k] != v}


def describe_changes(changes: dict[str, tuple]) -> str:
    names = {"population": "population", "data": "training data"}
    return ", ".join(f"{names.get(k, '--' + k)} {old} -> {new}" for k, (old, new) in changes.items())


class UnreadableCheckpoint(UserError):
    """A checkpoint whose files are missing or corrupt."""

    def __init__(self, folder: Path, reason: str):
        super().__init__(f"checkpoint {folder} is unreadable ({reason}): resume from another one")
        self.folder, self.reason = folder, reason


def save_checkpoint(folder: Path, params, states, meta: dict, opt: dict | None = None) -> None:
    """Write a checkpoint folder atomically (nothing happens if it already exists)."""
    if folder.exists():
        return
    tmp = folder.with_name(f".{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files = [("params.npz", params), ("states.npz", {"states": states})] + [("optimizer.npz", opt)] * bool(
        opt
    )
    for name, arrays in files:
        with atomic_file(tmp / name) as f:
            np.savez(f, **{k: np.asarray(v) for k, v in arrays.items()})
    write_atomic(tmp / "meta.json", (json.dumps(meta, indent=1) + "\n").encode())
    os.replace(tmp, folder)


def remove_checkpoint(folder: Path) -> None:
    """Delete a checkpoint folder without ever leaving part of one under a real name: renamed to
    its hidden temporary name first (which the next start removes, should a kill cut this short)."""
    tmp = folder.with_name(f".{folder.name}.tmp{os.getpid()}")
    os.replace(folder, tmp)
    shutil.rmtree(tmp)


def load_checkpoint(folder: Path, cfg: Config):
    """(params, states or None, opt or None, meta) of a checkpoint folder, checked against this
    run's model. States come back as None when the population layout differs (they cannot carry
    over), opt as None when the checkpoint holds no state of this run's --optimizer."""
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
    lead = (cfg.replicas,) * (cfg.replicas > 1)  # replicas are stacked on a leading axis
    want = {k: lead + full_shape(k, cfg) for k in PARAM_NAMES}
    got = {k: v.shape for k, v in params.items()}
    if got != want or any(v.dtype != np.int8 for v in params.values()):
        model = meta.get("args", {})
        held, mine = 1 if "replica" in meta else model.get("replicas", 1), cfg.replicas  # best-*: one
        raise UserError(
            f"checkpoint {folder} holds {f'{held} replicas of ' if held > 1 else ''}a "
            f"{model.get('n_embd')}D-{model.get('n_layer')}L model; this run is "
            f"{f'{mine} replicas of ' if mine > 1 else ''}{cfg.n_embd}D-{cfg.n_layer}L: pass the same "
            f"--n_embd and --n_layer{' and --replicas' if held != mine else ''}, or another checkpoint"
        )
    if states.shape != lead + (cfg.population, cfg.n_layer, cfg.n_embd) or states.dtype != np.int8:
        states = None
    want = {
        f"{slot}/{k}": lead + state_shape(slot, k, cfg) for slot in optimizer_slots(cfg) for k in PARAM_NAMES
    }
    opt = {k: v for k, v in opt.items() if k in want}  # e.g. --adapt_noise's multipliers, now off
    if {k: v.shape for k, v in opt.items()} != want or any(v.dtype != np.int16 for v in opt.values()):
        opt = None
    return params, states, opt, meta


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
    validation bits/byte, and points LATEST and BEST at them."""

    def __init__(self, save_dir: Path, args: Args, training: dict | None = None, writer: bool = True):
        self.dir, self.args, self.writer = save_dir, args, writer  # only the writer touches the disk
        self.training = training  # training_identity of the run, compared on resume
        self.best = math.inf

    def check_writable(self) -> None:
        """Fail early on an unwritable save_dir; remove what a killed save left half-written."""
        writable_folder(self.dir, "checkpoints to --save_dir")
        for tmp in self.dir.glob(".*.tmp*"):
            pid = tmp.name.rsplit(".tmp", 1)[1]
            if pid.isdigit() and not process_alive(int(pid)):
                if tmp.is_dir():
                    shutil.rmtree(tmp)
                else:
                    tmp.unlink()

    def meta(self, generation: int, val_bpb: float) -> dict:
        args = dataclasses.asdict(self.args)
        return {
            "format": CHECKPOINT_FORMAT,
            "generation": generation,
            "val_bits_per_byte": val_bpb,
            "best_val_bits_per_byte": self.best,
            "args": args,
            "training": self.training,
        }

    def save(self, generation: int, params, opt, states, val_bpb: float, extra: dict | None = None) -> Path:
        folder = self.dir / f"gen-{generation:08d}"
        if not self.writer:
            return folder
        save_checkpoint(folder, params, states, {**self.meta(generation, val_bpb), **(extra or {})}, opt)
        write_atomic(self.dir / "LATEST", folder.name.encode())
        for old in checkpoints_in(self.dir)[: -self.args.keep_checkpoints]:
            remove_checkpoint(old)
        return folder

    def offer_best(
        self, generation: int, params, opt, states, val_bpb: float, extra: dict | None = None
    ) -> None:
        """Keep this model if its validation score is the best so far (with replicas: the best
        replica's, as a single run's checkpoint, `extra` saying which)."""
        if not val_bpb < self.best:
            return
        self.best = val_bpb
        folder = self.dir / f"best-{val_bpb:.4f}-gen-{generation:08d}"
        if not self.writer:
            return
        save_checkpoint(folder, params, states, {**self.meta(generation, val_bpb), **(extra or {})}, opt)
        write_atomic(self.dir / "BEST", folder.name.encode())
        for old in self.dir.glob("best-*"):
            if old != folder and old.is_dir():
                remove_checkpoint(old)


# ------------------------------------------------------------------------------------------------
# Loop


def check_args(args: Args) -> None:
    """Refuse a bad configuration with one clear line, naming the flag, before anything is compiled."""
    p, g = args.parallel_generations_per_gpu, args.group_size
    positive = (
        "parallel_generations_per_gpu",
        "num_epochs",
        "tokens_per_update",
        "n_layer",
        "n_embd",
        "validation_batch_size",
        "group_size",
        "keep_checkpoints",
        "num_procs",
        "replicas",
    )
    for name in positive:
        if getattr(args, name) <= 0:
            raise UserError(f"--{name} must be positive, got {getattr(args, name)}")
    at_least_zero = (
        "validate_every",
        "noise_reuse",
        "num_perturbations",
        "validation_tokens",
        "log_every",
        "save_every",
        "sample_every",
        "max_new_bytes",
        "temperature",
        "seed",
        "pbt_every",
        "segments",
    )
    for name in at_least_zero:
        if not getattr(args, name) >= 0:
            raise UserError(f"--{name} must be >= 0, got {getattr(args, name)}")
    if p % 2:
        raise UserError(f"--parallel_generations_per_gpu must be even (antithetic pairs), got {p}")
    if g % 2 or p % g:
        raise UserError(f"--group_size must be even and divide the population {p}, got {g}")
    n = args.num_perturbations
    if n and (n % 2 or p % n):
        raise UserError(f"--num_perturbations must be even and divide the population {p}, got {n}")
    if args.n_embd % 4:
        raise UserError(f"--n_embd must be a multiple of 4, got {args.n_embd}")
    for name in REPLICA_SETTINGS:
        given = getattr(args, f"replica_{name}")
        if given and len(given) != args.replicas:
            raise UserError(
                f"--replica_{name} has {len(given)} value(s): give one per replica "
                f"(--replicas {args.replicas})"
            )
    if not 0 <= args.alpha_floor < 1:
        raise UserError(
            f"--alpha_floor must be in [0, 1) (a share of the parameters), got {args.alpha_floor}"
        )
    if args.pbt_every and args.replicas < 4:
        raise UserError(
            f"--pbt_every needs --replicas 4 or more (the worst quarter copies the best), got {args.replicas}"
        )
    for k, setting in enumerate(replica_settings(args)):
        which = f" (replica {k})" if args.replicas > 1 else ""
        if not setting["alpha"] > 0:
            raise UserError(
                "--alpha must be > 0 (a share < 1, or a schedule exponent > 1), "
                f"got {setting['alpha']}{which}"
            )
        if setting["alpha_decay_timestep"] <= 0:
            raise UserError(
                f"--alpha_decay_timestep must be positive, got {setting['alpha_decay_timestep']}{which}"
            )
        if not 0 <= setting["sigma_shift"] <= largest_sigma_shift():
            raise UserError(
                f"--sigma_shift must be in [0, {largest_sigma_shift()}], "
                f"got {setting['sigma_shift']}{which}: "
                f"from {largest_sigma_shift() + 1} on every bias and gain perturbation rounds to 0 "
                "(nothing to select)"
            )
    for name in ("momentum_shift", "scale_shift"):
        if not 1 <= getattr(args, name) <= 7:
            raise UserError(
                f"--{name} must be in [1, 7] (its running sum is int16), got {getattr(args, name)}"
            )
    if not 0 <= args.rank <= 64:
        raise UserError(f"--rank must be in [0, 64] (0: full-rank noise), got {args.rank}")
    if not 0 <= args.init_std <= 32:
        raise UserError(f"--init_std must be in [0, 32] (16: upstream's N(0, 1)), got {args.init_std}")
    if not 0 < args.valid_fraction < 0.5:
        raise UserError(f"--valid_fraction must be in (0, 0.5), got {args.valid_fraction}")
    if not 0 <= args.min_p <= 1:
        raise UserError(f"--min_p must be in [0, 1], got {args.min_p}")
    if not 0 <= args.proc_id < args.num_procs:
        raise UserError(f"--proc_id must be in [0, --num_procs), got {args.proc_id} of {args.num_procs}")
    check_ranges(make_config(args))


def bits_per_byte(log2_likelihood_sum, num_tokens: int) -> float:
    return -float(log2_likelihood_sum) / (num_tokens * 2**LL_FRAC)


def default_run_name(args: Args) -> str:
    data = Path(args.data).name or "data"
    name = (
        f"{data}-{args.n_embd}D{args.n_layer}L-a{args.alpha:g}-s{args.sigma_shift}-r{args.rank}-"
        f"{args.parallel_generations_per_gpu}x{args.tokens_per_update}x{args.noise_reuse}-seed{args.seed}"
    )
    name += "-upstream" * (args.algorithm == "upstream")
    return f"{name}-{args.tag}" if args.tag else name


def logged_before(line: str, generation: int) -> bool:
    """Whether a metrics.jsonl line is a whole record of a generation <= `generation` (a kill
    while writing can leave a last line cut short)."""
    try:
        return line.endswith("\n") and json.loads(line)["generation"] <= generation
    except (ValueError, KeyError):
        return False


class RunRecord:
    """Where a run's metrics go: always one JSON line per logged generation in
    <runs_dir>/<run_name>/metrics.jsonl; with --track also Weights & Biases."""

    def __init__(self, args: Args, name: str, summary: dict, generation: int):
        self.folder = Path(args.runs_dir) / name
        self.folder.mkdir(parents=True, exist_ok=True)
        config = dataclasses.asdict(args)
        write_atomic(self.folder / "config.json", (json.dumps(config, indent=1) + "\n").encode())
        path = self.folder / "metrics.jsonl"
        if path.exists() and generation:  # resumed: drop what was logged after the checkpoint
            kept = [x for x in path.read_text().splitlines(True) if logged_before(x, generation)]
            write_atomic(path, "".join(kept).encode())
        elif path.exists():  # a new run under an old name: keep the old record aside
            path.rename(path.with_name(f"metrics-{int(path.stat().st_mtime)}.jsonl"))
        self.lines = open(path, "a")
        self.wandb, self.samples = None, []
        if args.track:
            import wandb

            self.wandb = wandb.init(
                project=args.wandb_project,
                entity=args.wandb_entity,
                name=name,
                config=config,
                tags=[args.tag] if args.tag else None,
            )
            self.wandb.summary.update(summary)

    def log(self, metrics: dict, generation: int) -> None:
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


def save_dir_of(args: Args) -> Path:
    """--save_dir, by default <runs_dir>/<run_name>/checkpoints."""
    return Path(
        args.save_dir or Path(args.runs_dir) / (args.run_name or default_run_name(args)) / "checkpoints"
    )


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
        changes = training_changes(meta, identity)
        if changes and not args.allow_changes:
            raise UserError(
                f"--resume: {folder} was trained with other settings: {describe_changes(changes)}; "
                "give the checkpoint's values, or --allow_changes to continue with these"
            )
        fresh = init_replicas(cfg, replica_settings(args)) if states is None or opt is None else None
        if states is None:
            print(
                f"warning: {folder} was trained with another population layout: hidden states restart at zero"
            )
            states = fresh[2]
        if opt is None:
            print(f"warning: {folder} holds no --optimizer {cfg.optimizer} state: it starts afresh")
            opt = fresh[1]
        if writer and i > 0:
            write_atomic(save_dir / "LATEST", folder.name.encode())
        best = meta.get("best_val_bits_per_byte", math.inf)
        # the checkpoint's settings, as PBT left them, unless --allow_changes accepted new ones
        settings = None if any(k in changes for k in REPLICA_FLAGS) else meta.get("replica_settings")
        return Resumed(params, opt, states, meta["generation"], best, folder, changes, settings)
    print(f"--resume auto: no checkpoint in {save_dir} yet, starting a new run")
    return None


def init_distributed(args: Args) -> None:
    """Join a multi-process run: given by --coord_addr / --num_procs / --proc_id, or detected by
    jax.distributed itself (SLURM with several tasks, and the other clusters it knows)."""
    by_hand = bool(args.coord_addr) or args.num_procs > 1
    slurm = int(os.environ.get("SLURM_NTASKS", "1")) > 1
    if not (by_hand or slurm):
        return
    if jax.config.jax_platforms == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if by_hand:
        jax.distributed.initialize(args.coord_addr, args.num_procs, args.proc_id)
    else:
        jax.distributed.initialize()


def global_array(x: np.ndarray, mesh, spec) -> jax.Array:
    """A host array, the same on every process, as a global array with the given sharding."""
    x = np.asarray(x)
    sharding = jax.sharding.NamedSharding(mesh, spec)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def on_mesh(params, opt, states, mesh):
    """Parameters and update rule state replicated on every device, hidden states spread over the
    population."""
    spec = jax.sharding.PartitionSpec
    params, opt = jax.tree.map(lambda p: global_array(p, mesh, spec()), (params, opt))
    return params, opt, global_array(states, mesh, population_spec(states.ndim - 3))


def host_copy(x: jax.Array) -> np.ndarray:
    """The whole of a global array on the host (a collective if it spans processes)."""
    if x.is_fully_replicated:
        return np.asarray(x.addressable_shards[0].data)
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def local_copy(x: jax.Array, axis: int = 0) -> np.ndarray:
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


class NoRecord:
    """What processes other than 0 log: nothing."""

    def log(self, metrics: dict, generation: int) -> None:
        pass

    def close(self) -> None:
        pass


def train(args: Args) -> dict:
    """Train up to --num_epochs generations; return the last metrics (and the parameters)."""
    from tqdm import tqdm

    check_args(args)
    start = time.time()
    init_distributed(args)
    lead = jax.process_index() == 0  # only process 0 prints, logs and writes checkpoints
    mesh = population_mesh()
    cfg = make_config(args, mesh.size)
    check_ranges(cfg)
    for setting in replica_settings(args):
        check_z_test(replica_args(args, setting), cfg)
    spec = jax.sharding.PartitionSpec
    name = args.run_name or default_run_name(args)
    save_dir = save_dir_of(args)
    log = tqdm.write if lead else (lambda *a, **k: None)  # above the progress bar, not inside it
    # everything that can be refused is checked before the run creates anything of its own
    train_bytes, valid_bytes = open_data(args)
    stream = make_stream(len(train_bytes), cfg)
    valid_rows = validation_rows(valid_bytes, args)
    identity = training_identity(args, cfg, train_bytes)
    resumed = resume_from(args, save_dir, cfg, identity, writer=lead)
    settings = replica_settings(args) if resumed is None or resumed.settings is None else resumed.settings
    checkpointer = Checkpointer(save_dir, args, identity, writer=lead)
    if lead:
        checkpointer.check_writable()
        writable_folder(Path(args.runs_dir) / name, "metrics to --runs_dir")
    baselines = cached_baselines(train_bytes, valid_rows, args.dir_path)
    padding = -len(valid_rows) % (2 * mesh.size)  # rows spread evenly over the devices, in pairs
    rows = global_array(np.pad(valid_rows, ((0, padding), (0, 0))), mesh, spec(POP))
    schedules = {}  # (alpha, alpha_decay_timestep): (alpha, thresholds) per generation

    def schedule(setting: dict) -> tuple[np.ndarray, np.ndarray]:
        key = (setting["alpha"], setting["alpha_decay_timestep"])
        if key not in schedules:
            alone = replica_args(args, setting)
            schedules[key] = alpha_schedule(alone), z_thresholds(alone, cfg)
        return schedules[key]

    def thresholds(generation: int) -> np.ndarray:
        """(2,) for a single run, (replicas, 2) with replicas: each replica's own."""
        return replica_thresholds([schedule(s)[1][generation] for s in settings], cfg)

    if resumed is None:
        params, opt, states = init_replicas(cfg, settings)
        first = 0
    else:
        params, opt, states, first, checkpointer.best, folder, changes, _ = resumed
        log(f"resuming from {folder} at generation {first}")
        if changes:
            log(f"continuing with changed settings (--allow_changes): {describe_changes(changes)}")
        if first >= args.num_epochs:
            log(f"nothing to do: the checkpoint is at generation {first}, --num_epochs is {args.num_epochs}")
            return {"params": params}
    params, opt, states = on_mesh(params, opt, states, mesh)
    batch = global_array(batch_at(train_bytes, stream, cfg, first), mesh, spec())
    tick = time.time()
    lowered = make_generation_step(cfg, mesh).lower(
        params, opt, states, batch, np.int32(first), thresholds(first), *replica_inputs(cfg, settings)
    )
    step = lowered.compile()  # ahead of time: the program's memory and collectives are known up front
    traffic = sum(size for _, size in collective_traffic(step.as_text()))
    temporaries = getattr(step.memory_analysis(), "temp_size_in_bytes", 0)
    evaluate = make_evaluate(cfg, mesh)
    num_params = num_parameters(cfg)
    replicas = f"{cfg.replicas} replicas of " if cfg.replicas > 1 else ""
    split = f" (one CPU split into {args.cpu_devices})" if args.cpu_devices > 1 else ""
    log(
        f"egg-jax {name}: {replicas}{num_params:,} int8 parameters, population {cfg.population} on "
        f"{mesh.size} {jax.devices()[0].platform} device(s){split} in {jax.process_count()} process(es), "
        f"{cfg.segments} segment(s) a member ({scored_pairs(cfg):,} pairs an update), "
        f"{len(train_bytes):,} training bytes, {valid_rows.size:,} validation bytes"
    )
    log(
        f"generation step compiled in {time.time() - tick:.1f} s: {traffic:,} bytes of cross-device "
        f"traffic per generation and device, {temporaries / 2**20:,.1f} MiB of temporaries"
    )
    log(f"baselines on the validation bytes, in bits/byte: {describe_baselines(baselines)}")
    summary = {f"baseline/{k}": v for k, v in baselines.items()}
    record = RunRecord(args, name, summary, first) if lead else NoRecord()
    if resumed is not None and resumed.changes:
        record.log({"resume/changed": describe_changes(resumed.changes)}, first)

    def validate(params) -> list[float]:
        """Noise-free validation bits/byte of each replica."""
        ll = host_copy(evaluate(params, rows)).reshape(cfg.replicas, -1)[:, : len(valid_rows)]
        tokens = valid_rows.shape[0] * (valid_rows.shape[1] - 1)
        return [bits_per_byte(np.sum(x, dtype=np.int64), tokens) for x in ll]

    def snapshot(replica: int | None = None):
        """Host copies of the parameters, update rule state and hidden states (every process takes
        part): of every replica, or of one."""
        arrays = *jax.tree.map(host_copy, (params, opt)), host_copy(states)
        return arrays if replica is None else replica_of(arrays, replica, cfg)

    diagnose_every = args.log_every or (10 if args.debug else 0)
    probe, probe_rows = make_probe(cfg), valid_rows[:16, :65]  # compiled on first use only

    metrics, val_bpb, train_seconds, timed = {}, float("nan"), 0.0, 0
    scores, leader = [math.nan] * cfg.replicas, 0  # each replica's last validation, the best replica
    tokens_per_generation = cfg.population * cfg.tokens * cfg.replicas
    generations = range(first, args.num_epochs)
    bar = tqdm(generations, initial=first, total=args.num_epochs, dynamic_ncols=True, disable=not lead)
    with StopSignal() as stop:
        for generation in bar:
            tick = time.time()
            if generation > first:
                batch = global_array(batch_at(train_bytes, stream, cfg, generation), mesh, spec())
            diagnose = diagnose_every and (generation + 1) % diagnose_every == 0
            before = jax.tree.map(host_copy, params) if diagnose else None  # the step donates params
            params, opt, states, fitness, moved = step(
                params,
                opt,
                states,
                batch,
                np.int32(generation),
                thresholds(generation),
                *replica_inputs(cfg, settings),
            )
            # process 0's members: logging only
            fitness = local_copy(fitness, int(cfg.replicas > 1)).astype(np.int64).reshape(cfg.replicas, -1)
            moved = np.sum(host_copy(moved).reshape(cfg.replicas, -1), axis=1, dtype=np.int64)
            seconds = time.time() - tick
            if generation == first:
                log(f"first generation done {time.time() - start:.1f} s after start")
            else:
                train_seconds, timed = train_seconds + seconds, timed + 1
            done = generation + 1
            each = [
                {
                    "train/bits_per_byte": bits_per_byte(f.mean(), cfg.tokens),
                    "train/best_bits_per_byte": bits_per_byte(f.max(), cfg.tokens),
                    "train/worst_bits_per_byte": bits_per_byte(f.min(), cfg.tokens),
                    "train/moved_fraction": int(m) / num_params,
                    "train/alpha": float(schedule(setting)[0][generation]),
                }
                for f, m, setting in zip(fitness, moved, settings, strict=True)
            ]
            metrics = replica_metrics(each, settings)
            metrics.update({"perf/tokens_per_s": tokens_per_generation / seconds, "perf/seconds": seconds})
            last = done == args.num_epochs
            pbt = args.pbt_every and done % args.pbt_every == 0
            if last or pbt or (args.validate_every and done % args.validate_every == 0):
                scores = validate(params)
                if cfg.adapt_noise:  # read at validation only: no host copies on the other generations
                    metrics.update(replica_metrics(noise_scale_ranges(opt, cfg), settings, summary=False))
                leader = min(range(cfg.replicas), key=lambda k: (scores[k], k))
                val_bpb = scores[leader]
                metrics.update(replica_metrics([{"val/bits_per_byte": v} for v in scores], settings))
                metrics.update({f"val/{k}_bits_per_byte": v for k, v in baselines.items()})
                spread = describe_spread(scores)
                log(
                    f"generation {done}: validation {val_bpb:.2f} bits/byte{spread} "
                    f"({describe_baselines(baselines)})"
                )
                if val_bpb < checkpointer.best:
                    alone = (
                        {"replica": leader, "replica_setting": settings[leader]} if cfg.replicas > 1 else {}
                    )
                    checkpointer.offer_best(done, *snapshot(leader), val_bpb, alone)
                if pbt:
                    source, settings, lineage = pbt_step(scores, settings, args.seed, done)
                    params, opt, states = copy_replicas((params, opt, states), source)
                    metrics["pbt/lineage"] = lineage
                    log(f"generation {done}: population-based training: {describe_lineage(lineage)}")
            if diagnose:
                each = []
                for k in range(cfg.replicas):
                    mine = replica_of(params, k, cfg)
                    seen = jax.tree.map(host_copy, probe(mine, probe_rows))
                    each.append(diagnostics(seen, jax.tree.map(host_copy, mine), replica_of(before, k, cfg)))
                    if args.debug:
                        who = f" replica {k}" if cfg.replicas > 1 else ""
                        log(f"generation {done}{who} diagnostics:\n{diagnostics_table(each[-1])}")
                metrics.update(replica_metrics(each, settings, summary=False))
            if args.sample_every and done % args.sample_every == 0:
                text = printable(sample_text(replica_of(params, leader, cfg), cfg, args, args.seed + done))
                metrics["samples/text"] = text
                log(f"generation {done} sample: {args.prompt}{text}")
            record.log(metrics, done)
            stopping = stop_requested(stop)
            if last or stopping or (args.save_every and done % args.save_every == 0):
                folder = checkpointer.save(done, *snapshot(), val_bpb, replica_meta(settings, scores, leader))
                if stopping:  # every process says so: they all stop after the same generation
                    who = f"process {jax.process_index()}"
                    tqdm.write(f"{who} stopped by signal after generation {done}: saved {folder}")
                    break
            bar.set_postfix(
                train=f"{metrics['train/bits_per_byte']:.3f}",
                val=f"{val_bpb:.3f}"
                + (
                    f" (replica {leader}, median {statistics.median(scores):.3f})" if cfg.replicas > 1 else ""
                ),
                tok_s=f"{metrics['perf/tokens_per_s']:,.0f}",
            )
    bar.close()
    record.close()
    if timed:
        rate = tokens_per_generation * timed / train_seconds
        log(f"mean training throughput {rate:,.0f} tokens/s (first generation, which compiles, excluded)")
    if stop.received == signal.SIGINT:
        raise SystemExit(130)
    if not stop.received:
        best = f" (replica {leader} of {cfg.replicas}, {settings_text(settings[leader])})"
        best += describe_spread(scores)
        log(
            f"validation bits/byte {val_bpb:.4f} after {args.num_epochs} generations"
            + best * (cfg.replicas > 1)
        )
    metrics["params"] = jax.tree.map(host_copy, params)
    return metrics


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
    sigma_shift = int(np.clip(setting["sigma_shift"] + rng.choice(SIGMA_STEPS), 0, largest_sigma_shift()))
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


def replica_metrics(each: list[dict], settings: list[dict], summary: bool = True) -> dict:
    """A single run's metrics as they are; with replicas, each replica's as replica/K/NAME with its
    settings (a series of its own in W&B), and with `summary` the best replica's bits/byte under
    the plain names (what sweeps and the progress bar read)."""
    if len(each) == 1:
        return each[0]
    out = {}
    for k, (values, setting) in enumerate(zip(each, settings, strict=True)):
        out.update({f"replica/{k}/{name}": v for name, v in values.items()})
        out.update({f"replica/{k}/{name}": setting[name] for name in REPLICA_SETTINGS})
    if summary:
        out.update({name: min(x[name] for x in each) for name in each[0] if name.endswith("bits_per_byte")})
    return out


def noise_scale_ranges(opt: dict, cfg: Config) -> list[dict]:
    """--adapt_noise: the smallest and largest noise multiplier over the groups, of each replica
    (one host copy per tensor's multipliers, all replicas at once)."""
    scales = [host_copy(v).reshape(cfg.replicas, -1) for k, v in opt.items() if k.startswith("noise/")]
    scales = np.concatenate(scales, axis=1) / 2**NOISE_SCALE_FRAC
    return [
        {"train/noise_scale_min": float(x.min()), "train/noise_scale_max": float(x.max())} for x in scales
    ]


def replica_meta(settings: list[dict], scores: list[float], leader: int) -> dict:
    """What a checkpoint records of the replicas besides their arrays (nothing for a single run)."""
    if len(settings) == 1:
        return {}
    return {"replica_settings": settings, "replica_val_bits_per_byte": scores, "best_replica": leader}


def replica_of(tree, k: int, cfg: Config):
    """Replica k's arrays (a single run's are its own)."""
    return tree if cfg.replicas == 1 else jax.tree.map(lambda x: x[k], tree)


def stop_requested(stop: StopSignal) -> bool:
    """Whether any process received a stop signal: all processes must stop at the same generation
    (a one-byte gather per generation, only in multi-process runs)."""
    if jax.process_count() == 1:
        return stop.received is not None
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.array([stop.received is not None], np.int8))
    return bool(np.max(flags))


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
    """Noise-free next-byte logits: step(params, h, byte) -> (logits (256,) int8, h)."""
    tables = make_tables(cfg.rank)

    def step(params, h, byte):
        return token_logits(params, None, 1, h, byte, cfg, tables)[:2]

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
    folder = find_resume(args.resume, save_dir_of(args))[0]
    try:
        meta = json.loads((folder / "meta.json").read_text())
        model = meta["args"]
    except (OSError, ValueError, KeyError):
        raise UnreadableCheckpoint(folder, "no meta.json with the run's flags") from None
    replicas = 1 if "replica" in meta else model.get("replicas", 1)  # a best-* folder holds one
    model_args = single_run(
        args,
        n_embd=model["n_embd"],
        n_layer=model["n_layer"],
        mlp_relu=model.get("mlp_relu", True),
        replicas=replicas,
    )
    cfg = make_config(model_args)
    params = load_checkpoint(folder, cfg)[0]
    if replicas > 1:
        chosen = meta.get("best_replica", 0) if args.sample_replica < 0 else args.sample_replica
        if chosen >= replicas:
            raise UserError(f"--sample_replica {chosen}: {folder} holds replicas 0 to {replicas - 1}")
        params = replica_of(params, chosen, cfg)
        cfg = cfg._replace(replicas=1)
        print(f"replica {chosen} of {replicas} ({settings_text(meta['replica_settings'][chosen])})")
    text = args.prompt + printable(sample_text(jax.tree.map(jnp.asarray, params), cfg, args, args.seed))
    print(text)
    return text


def make_probe(cfg: Config):
    """Noise-free forward of a few rows, keeping every int8 activation: probe(params, rows (R, L)
    uint8) -> {name: (R, L, ...) int8}, block activations as (R, L, n_layer, ...)."""
    tables = make_tables(cfg.rank)

    def probe(params, rows):
        def step(h, tok):
            _, h, seen = token_logits(params, None, 1, h, tok, cfg, tables, collect=True)
            return h, seen

        def row(tokens):
            return jax.lax.scan(step, jnp.zeros((cfg.n_layer, cfg.n_embd), jnp.int8), tokens)[1]

        return jax.vmap(row)(rows)

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
# program's on the same machine (0.3 GiB to 0.6 GiB seen, by CPU and JAX build).
BARE_JAX = """
import resource, jax, jax.numpy as jnp
x = jnp.ones((64, 64), jnp.int8)
jax.jit(lambda a: jnp.dot(a, a, preferred_element_type=jnp.int32))(x).block_until_ready()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def host_memory_left() -> float:
    """Bytes the host can still give (MemAvailable of /proc/meminfo; infinite where it is unknown)."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return math.inf
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:")), math.inf)


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


def benchmark(args: Args, budget: float | None = None) -> dict[str, float]:
    """Time generations of each kind on random bytes and print one table: (a) training, (b)
    fitness only, (c) noise-free inference of the same members and tokens, (d) naive full-rank ES
    (--rank 0) on the same model. Each is compiled and run once first; then a, b and c take turns,
    one generation each, so that a slow spell of the machine hits them alike, and d runs alone.
    Without `budget`: --num_epochs timed generations of every kind. With `budget` (seconds; main
    gives BENCHMARK_SECONDS when --num_epochs is not on the command line): as many as fit, at least
    3, and d only if its cost, extrapolated from two short runs (FULL_RANK_PROBES), fits; what is shortened
    or skipped is printed with the reason. Peak memory is read after each kind's first generation,
    and the compiled program's temporaries beside it. Returns the tokens/s of each kind timed."""
    check_args(args)
    start = time.time()
    mesh = population_mesh()
    spec = jax.sharding.PartitionSpec
    rng = np.random.default_rng(args.seed)
    bare = bare_jax_rss()
    notes = []

    def prepare(label: str, kind_args: Args, part: str, check_room: bool = False) -> dict | None:
        """Compile one kind ahead of time and run its first generation. With `check_room`: None (and
        a note) where, on the CPU, its temporaries on every device would not fit in what the host
        has left (full-rank ES at the default model: every device builds all of its noise)."""
        cfg = make_config(kind_args, mesh.size)
        settings = replica_settings(kind_args)
        params, opt, states = on_mesh(*init_replicas(cfg, settings), mesh)
        batch = rng.integers(0, 256, (cfg.population // cfg.group_size, cfg.tokens + 1), dtype=np.uint8)
        kind = dict(label=label, cfg=cfg, batch=global_array(batch, mesh, spec()), seconds=[])
        one = [replica_args(dataclasses.replace(kind_args, num_epochs=1), s) for s in settings]
        kind["thresholds"] = replica_thresholds([z_thresholds(a, cfg)[0] for a in one], cfg)
        kind["inputs"] = (kind["thresholds"], *replica_inputs(cfg, settings))
        tick = time.time()
        lowered = make_generation_step(cfg, mesh, part).lower(
            params, opt, states, kind["batch"], np.int32(0), *kind["inputs"]
        )
        kind["step"] = lowered.compile()
        kind["compile"] = time.time() - tick
        kind["temporaries"] = getattr(kind["step"].memory_analysis(), "temp_size_in_bytes", 0) / 2**20
        need = kind["temporaries"] * 2**20 * len(mesh.local_devices)
        if check_room and mesh.devices.flat[0].platform == "cpu" and need > (left := host_memory_left()):
            notes.append(
                f"{label} skipped: its compiled program needs {need / 2**30:.1f} GiB of temporaries on this "
                f"process's {len(mesh.local_devices)} device(s), more than the {left / 2**30:.1f} GiB free"
            )
            return None
        kind["carry"] = (params, opt, states)
        kind["first"] = time_generation(kind, 0)
        kind["seconds"].clear()
        kind["memory"] = peak_memory()[0]
        return kind

    def time_generation(kind: dict, generation: int) -> float:
        tick = time.time()
        *kind["carry"], _, _ = jax.block_until_ready(
            kind["step"](*kind["carry"], kind["batch"], np.int32(generation), *kind["inputs"])
        )
        kind["seconds"].append(time.time() - tick)
        return kind["seconds"][-1]

    kinds = [
        prepare("a training", args, "train"),
        prepare("b fitness only", args, "fitness"),
        prepare("c inference", args, "inference"),
    ]
    if args.replicas > 1:  # the same members as one run: K x P, beside the K replicas of P
        members = args.parallel_generations_per_gpu * args.replicas
        whole = single_run(args, parallel_generations_per_gpu=members)
        kinds.append(prepare(f"e one run of {make_config(whole, mesh.size).population}", whole, "train"))
    full_rank = dataclasses.replace(args, rank=0)
    cfg = kinds[0]["cfg"]
    rounds, full_rank_rounds = args.num_epochs, args.num_epochs
    if budget is not None:
        probed = {}  # population: seconds per generation
        unit = 2 * max(args.cpu_devices, 1)  # a probe's members split over the CPU's devices like the run's
        probes = {min(-(-m // unit) * unit, args.parallel_generations_per_gpu) for m in FULL_RANK_PROBES}
        for members in sorted(probes):
            probe_args = dataclasses.replace(
                full_rank, parallel_generations_per_gpu=members, group_size=2, num_perturbations=0
            )
            probe = prepare("probe", probe_args, "train")
            probed[probe["cfg"].population] = time_generation(probe, 1)
            del probe  # its buffers
        (small, t_small), (large, t_large) = list(probed.items())[0], list(probed.items())[-1]
        growth = max(1.0, math.log(t_large / t_small) / math.log(large / small)) if large > small else 1.0
        estimate = t_large * (cfg.population / large) ** growth * cfg.replicas
        left = budget - (time.time() - start)
        per_round = sum(kind["first"] for kind in kinds)
        # d gets at most half of what is left, for its first generation and the timed ones
        full_rank_rounds = min(args.num_epochs, int(left / 2 / estimate) - 1)
        if full_rank_rounds < 1:
            notes.append(
                f"d full-rank ES skipped: one generation is estimated at {estimate:,.0f} s (measured at "
                f"population {' and '.join(map(str, probed))}, extrapolated to {cfg.population}); it needs "
                f"a first and a timed one, more than half of the {left:.0f} s left; give --num_epochs to "
                "run it"
            )
        left -= max(full_rank_rounds + 1, 0) * estimate
        rounds = max(3, min(args.num_epochs, int(left / per_round)))
        notes.append(
            f"no --num_epochs: timed {rounds} generation(s) of {', '.join(k['label'][0] for k in kinds)}"
            + (f" and {full_rank_rounds} of d" if full_rank_rounds >= 1 else "")
            + f", what fits in about {budget:.0f} s; give --num_epochs N to time N of each"
        )
    if full_rank_rounds >= 1:
        full = prepare("d full-rank ES", full_rank, "train", check_room=True)
        kinds += [full] if full else []
    # full-rank ES runs last and alone: its large buffers, allocated and freed, slow whatever follows
    turns = [kind for kind in kinds if not kind["label"].startswith("d")]
    for group, count in ((turns, rounds), (kinds[len(turns) :], full_rank_rounds)):
        for generation in range(1, 1 + count):
            for kind in group:
                time_generation(kind, generation)
    rate = {}
    device = jax.devices()[0]
    memory_kind = peak_memory()[1]
    model = f"model {args.n_embd}D-{args.n_layer}L ({num_parameters(cfg):,} parameters)"
    members = f"population {cfg.population}, {args.tokens_per_update} tokens per member, rank {args.rank}"
    members = f"{cfg.replicas} replicas, each {members}" if cfg.replicas > 1 else members
    timed = f"median of {rounds} generations each ({', '.join(k['label'][0] for k in turns)} taking turns)"
    split = f" (one CPU split into {args.cpu_devices})" if args.cpu_devices > 1 else ""
    device = f"{mesh.size} x {device.platform} ({device.device_kind}){split}"
    print(f"device: {device}; {model}; {members}; {timed}")
    memory_header = f"peak {memory_kind} GiB"
    print(
        f"{'':18} {'tokens/s':>12} {'s/generation':>13} {'compile s':>10} {memory_header:>18} {'temp MiB':>9}"
    )
    for kind in kinds:
        seconds = float(np.median(kind["seconds"]))
        members = kind["cfg"].population * kind["cfg"].replicas
        rate[kind["label"][0]] = members * kind["cfg"].tokens / seconds
        print(
            f"{kind['label']:18} {rate[kind['label'][0]]:12,.0f} {seconds:13.4f} {kind['compile']:10.1f} "
            f"{kind['memory']:18.2f} {kind['temporaries']:9,.1f}"
        )
    share = 1 - rate["a"] / rate["b"]
    versus = f"low-rank / full-rank ES (a/d): {rate['a'] / rate['d']:.1f}x; " if "d" in rate else ""
    print(
        f"training / inference (a/c): {rate['a'] / rate['c']:.1%}; {versus}update share of a generation: "
        f"{share:.1%}; peak {memory_kind} of training {kinds[0]['memory']:.2f} GiB (memory column: the "
        "process's peak so far; temp: the compiled program's own temporaries)"
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


# --algorithm upstream: upstream's values of every flag whose default here differs from upstream's
UPSTREAM_ALGORITHM = dict(
    alpha_floor=0.0,
    sigma_shift=4,
    segments=1,
    optimizer="ztest",
    fast_fitness=True,
    null_from_scores=False,
    shared_pair_state=False,
    init_std=16,
)


def flag_given(argv: list[str], name: str) -> bool:
    """Whether --name (spelt with underscores or dashes, with or without =value) is in argv."""
    spellings = {f"--{name}", f"--{name.replace('_', '-')}"}
    return any(word.partition("=")[0] in spellings for word in argv)


def parse_args(argv: list[str]) -> Args:
    """Args from the command line. Besides tyro's --flag / --no-flag, booleans also accept
    --flag=True|False and --flag True|False: the forms W&B sweep agents pass with ${args}."""
    booleans = {f.name for f in dataclasses.fields(Args) if f.type in ("bool", bool)}
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
        given = {
            k for k in UPSTREAM_ALGORITHM if any(flag_given(out, f"{no}{k}") for no in ("", "no-", "no_"))
        }
        args = dataclasses.replace(args, **{k: v for k, v in UPSTREAM_ALGORITHM.items() if k not in given})
    return args


def select_platform() -> None:
    """Use the CPU without probing for CUDA when this machine has no NVIDIA device: jax[cuda12]
    would otherwise print a traceback on every run before falling back to the CPU itself."""
    if "JAX_PLATFORMS" not in os.environ and not Path("/dev/nvidiactl").exists():
        jax.config.update("jax_platforms", "cpu")


def cpu_share_fits(args: Args, shards: int) -> bool:
    """Whether each of `shards` devices' share of --parallel_generations_per_gpu holds whole groups
    (so whole antithetic pairs) and, with --num_perturbations, whole blocks of distinct noises: what
    check_args asks of every device's members."""
    p, n = args.parallel_generations_per_gpu, args.num_perturbations
    share, g = p // shards, args.group_size
    return p > 0 and g > 0 and p % shards == 0 and share % g == 0 and (n <= 0 or share % n == 0)


def split_cpu(args: Args) -> Args:
    """Args with --cpu_devices as used (1: not split), the host split into that many JAX devices
    before JAX starts. XLA spreads each product of a single CPU device over the cores, which for
    this model's small int8 products costs more than it gains (README, "Benchmark": 64D-2L,
    population 256 on a 2-core Intel Xeon trains about twice as fast as 2 devices of 128 members).
    Not split: off the CPU; where XLA_FLAGS or JAX_NUM_CPU_DEVICES set the device count; in a
    multi-process run unless --cpu_devices is given (every process must split alike); with
    --rank 0 unless given (every device builds the whole full-rank noise of the update: memory
    times the devices). Once JAX runs (main() called again in one process) its CPU devices stay
    as the first call split them."""
    given, p, g = args.cpu_devices, args.parallel_generations_per_gpu, args.group_size
    forced = "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
    forced = forced or "JAX_NUM_CPU_DEVICES" in os.environ
    if given < 0:
        raise UserError(f"--cpu_devices must be >= 0 (0: one per core), got {given}")
    if jax.config.jax_platforms != "cpu" or forced:
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
        running = jax.local_device_count()
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


def main(argv: list[str] | None = None) -> None:
    select_platform()
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = split_cpu(parse_args(argv))
        enable_compilation_cache(args.dir_path)
        if args.benchmark:
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
