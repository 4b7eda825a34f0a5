"""egg-jax's benchmark and GPU report: run.py's generation step timed, or compiled for a GPU here.

    python bench.py --n_embd 64 --n_layer 2 --parallel_generations_per_gpu 256 --num_epochs 20
    python bench.py --target h100 --parallel_generations_per_gpu 1024     # no GPU needed

It takes run.py's flags. Without --target it times, on random bytes and side by side, (a) training,
(b) fitness only, (c) noise-free inference of the same members and tokens and (d) naive full-rank
ES, with peak memory and the compiled programs' temporaries (and with --replicas, (e) one run of as
many members); with --objective reward beside them, on the task's prompts, (r) training on its
reward scored in the step, (s) scored on the host, and (w) the members' writing alone, in bytes
written a second, with the host reward's share of a generation. With --target h100 it compiles the
same steps for that GPU on any machine ("deviceless": XLA's whole GPU pipeline on the topology in
targets/, no autotuning, nothing timed), reads every kernel of the compiled programs (egg/hlo.py)
and costs them by a stated roofline model; with --objective reward also the reward's generation
(its scorer in the step) and the writing.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compilation_cache import compilation_cache

import run
from egg import UserError, cluster, hlo, kernel, tasks
from egg.command import EX_DATAERR
from egg.flags import flag, flag_given, replace


@dataclass(frozen=True)
class Args(run.Args):
    target: Literal["", "h100"] = ""
    """compile for this GPU here, without one, and report its program and a modeled speed instead of
    timing (targets/ holds its description)"""
    target_devices: Annotated[int, *flag("[1, inf)")] = 1
    """with --target: GPUs the population is spread over (the sharded program of one of them)"""
    products: Literal[("", *run.PRODUCT_CANDIDATES)] = ""
    """with --target: the products as this candidate of --kernels auto computes them (what a GPU
    would time: run.PRODUCT_CANDIDATES); "" the kernel as it computes unless told"""


# ------------------------------------------------------------------------------------------------
# Benchmark: generations of each kind timed side by side on random bytes, one table.

# A bare JAX process: import jax, one jitted int8 dot. Its peak RSS is the floor under any JAX
# program's on the same machine (0.3 GiB to 0.6 GiB seen, by CPU and JAX build). On Linux its own
# image's peak (VmHWM, KiB): ru_maxrss would also count the resident memory of the process that
# started it (6.9 GiB once, under a test process that held that much)
BARE_JAX = """
import resource, jax, jax.numpy as jnp
x = jnp.ones((64, 64), jnp.int8)
jax.jit(lambda a: jnp.dot(a, a, preferred_element_type=jnp.int32))(x).block_until_ready()
try:
    print(
        next(
            int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")
        )
    )
except (OSError, StopIteration):
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""
BENCHMARK_SECONDS = 240.0  # what the benchmark without --num_epochs aims to take, start-up aside
# members per device of two short full-rank runs that estimate (d)'s cost: it grows faster than
# the population (at 256D-6L: 0.05 s a member at 16, 0.08 at 64, 0.11 at 256), so it is extrapolated
# with the growth measured between the two
FULL_RANK_PROBES = (16, 64)


@functools.cache
def bare_jax_rss() -> float:
    """Peak RSS (GiB) of a bare JAX process on this machine and platform (nan if it fails),
    measured once a process: the platform cannot change once JAX has started."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")  # beside us on a GPU
    if jax.config.jax_platforms:
        env["JAX_PLATFORMS"] = jax.config.jax_platforms
    result = subprocess.run(
        [sys.executable, "-c", BARE_JAX], env=env, capture_output=True, text=True
    )
    words = result.stdout.split()
    return int(words[-1]) / 2**20 if result.returncode == 0 and words else math.nan


@dataclass
class Kind:
    """One kind of generation the benchmark times: its compiled step and what it measured."""

    label: str  # "a training", ...: its letter names it in the ratios
    cfg: run.Config
    compiled: hlo.Compiled
    batch: jax.Array
    inputs: tuple  # the step's per-replica arguments
    carry: tuple  # (params, opt, states), donated and returned by every generation
    seconds: list[float]  # the timed generations'
    first: float = 0.0  # seconds of its first generation, after compiling
    memory: float = 0.0  # peak memory after its first generation, GiB


def time_generation(kind: Kind, generation: int) -> float:
    tick = time.time()
    step = kind.compiled.step(*kind.carry, kind.batch, np.int32(generation), *kind.inputs)
    *carry, _, _ = jax.block_until_ready(step)
    kind.carry = tuple(carry)
    kind.seconds.append(time.time() - tick)
    return kind.seconds[-1]


def make_step(cfg: run.Config, mesh, part: str):
    """The jitted program of one kind of generation, with run.py's step's arguments and results:
    "train" (run.py's generation step), "fitness" (its population fitness alone) or "inference"
    (the same members and bytes, noise-free)."""
    if part == "train":
        return run.make_generation_step(cfg, mesh)

    def of_one(params, rule_state, states, tokens, start, generation, thresholds, seed, shift):
        noise_of = run.noise_sources(cfg, seed, generation, start)[0]
        if part == "inference":
            noise_of = lambda segment: None  # noqa: E731
        fitness, states = run.population_fitness(cfg, params, noise_of, states, tokens, shift)
        return params, rule_state, states, jnp.sum(fitness, axis=0), jnp.zeros((), jnp.int32)

    def local(params, rule_state, states, batch, generation, thresholds, seeds, sigma_shifts):
        start, tokens = run.device_members(cfg, batch)
        every = run.every_replica(of_one, shared=(3, 4, 5))
        return every(
            params, rule_state, states, tokens, start, generation, thresholds, seeds, sigma_shifts
        )

    return run.on_population(local, mesh, cfg)


def prepare_kind(
    label: str, args: Args, part: str, mesh, rng, notes: list, check_room=False
) -> Kind | None:
    """Compile one kind ahead of time and run its first generation. With `check_room`: None (and a
    note) where its temporaries would not fit in the memory left (cluster.memory_left; full-rank ES
    at the default model: every device builds all of its noise)."""
    cfg = run.mesh_config(args, mesh)
    replicas = run.replicas_of(args)
    carry = run.on_mesh(*run.init_run(cfg, replicas), mesh)
    batch = rng.integers(0, 256, (cfg.population // cfg.group_size, cfg.tokens + 1), dtype=np.uint8)
    batch = cluster.global_array(batch, mesh, run.REPLICATED)
    inputs = run.replica_inputs(cfg, replicas, 0)
    step = make_step(cfg, mesh, part)
    compiled = hlo.compile_now(step.lower(*carry, batch, np.int32(0), *inputs))
    left, sharing = cluster.memory_left(mesh) if check_room else (math.inf, 1)
    if (need := compiled.temporaries * 2**20 * sharing) > left:
        notes.append(
            f"{label} skipped: its compiled program needs {need / 2**30:.1f} GiB of temporaries on "
            f"{sharing} device(s), more than the {left / 2**30:.1f} GiB free"
        )
        return None
    kind = Kind(label, cfg, compiled, batch, inputs, carry, [])
    kind.first = time_generation(kind, 0)
    kind.seconds.clear()
    kind.memory = cluster.peak_memory()[0]
    return kind


def full_rank_cost(args: Args, cfg: run.Config, mesh, rng, notes: list) -> tuple[float, dict]:
    """Seconds one full-rank ES generation is estimated to take at cfg's population, from two short
    runs (FULL_RANK_PROBES) and the growth measured between them; and {population: seconds}."""
    probed = {}
    # a probe's members split over the CPU's devices like the run's
    unit = 2 * max(args.cluster.cpu_devices, 1)
    probes = {
        min(-(-m // unit) * unit, args.parallel_generations_per_gpu) for m in FULL_RANK_PROBES
    }
    for members in sorted(probes):
        changes = dict(
            rank=0, parallel_generations_per_gpu=members, group_size=2, num_perturbations=0
        )
        probe = prepare_kind(
            "probe", dataclasses.replace(args, **changes), "train", mesh, rng, notes
        )
        probed[probe.cfg.population] = time_generation(probe, 1)
        del probe  # its buffers
    (small, t_small), (large, t_large) = list(probed.items())[0], list(probed.items())[-1]
    growth = (
        max(1.0, math.log(t_large / t_small) / math.log(large / small)) if large > small else 1.0
    )
    return t_large * (cfg.population / large) ** growth * cfg.replicas, probed


def plan_rounds(args: Args, kinds: list[Kind], mesh, rng, budget: float, left: float, notes: list):
    """(timed generations of a, b, c (and e), of d) that fit in `left` of `budget` seconds: d given
    at most half of the time."""
    tick = time.time()
    estimate, probed = full_rank_cost(args, kinds[0].cfg, mesh, rng, notes)
    left -= time.time() - tick
    full_rank_rounds = min(args.num_epochs, int(left / 2 / estimate) - 1)
    if full_rank_rounds < 1:
        notes.append(
            f"d full-rank ES skipped: one generation is estimated at {estimate:,.0f} s (measured "
            f"at population {' and '.join(map(str, probed))}, extrapolated to "
            f"{kinds[0].cfg.population}); it needs a first and a timed one, more than half of the "
            f"{left:.0f} s left; give --num_epochs to run it"
        )
    left -= max(full_rank_rounds + 1, 0) * estimate
    rounds = max(3, min(args.num_epochs, int(left / sum(kind.first for kind in kinds))))
    notes.append(
        f"no --num_epochs: timed {rounds} generation(s) of {', '.join(k.label[0] for k in kinds)}"
        + (f" and {full_rank_rounds} of d" if full_rank_rounds >= 1 else "")
        + f", what fits in about {budget:.0f} s; give --num_epochs N to time N of each"
    )
    return rounds, full_rank_rounds


def print_table(args: Args, kinds: list[Kind], rounds: int, mesh) -> dict[str, float]:
    """The benchmark's table; returns the tokens/s of each kind timed, by letter."""
    device, memory_kind = jax.devices()[0], cluster.peak_memory()[1]
    cfg = kinds[0].cfg
    shape = f"{args.model.n_embd}D-{args.model.n_layer}L"
    model = f"model {shape} ({run.num_parameters(cfg):,} parameters)"
    members = (
        f"population {cfg.population}, {args.tokens_per_update} tokens per member, rank {args.rank}"
    )
    members = f"{cfg.replicas} replicas, each {members}" if cfg.replicas > 1 else members
    turns = [k.label[0] for k in kinds if not k.label.startswith("d")]
    timed = f"median of {rounds} generations each ({', '.join(turns)} taking turns)"
    cpus = args.cluster.cpu_devices
    split = f" (one CPU split into {cpus})" if cpus > 1 else ""
    print(
        f"device: {mesh.size} x {device.platform} ({device.device_kind}){split}; {model}; "
        f"{members}; {timed}"
    )
    memory_header = f"peak {memory_kind} GiB"
    print(
        f"{'':18} {'tokens/s':>12} {'s/generation':>13} {'compile s':>10} "
        f"{memory_header:>18} {'temp MiB':>9}"
    )
    rate = {}
    for kind in kinds:
        seconds = float(np.median(kind.seconds))
        rate[kind.label[0]] = kind.cfg.population * kind.cfg.replicas * kind.cfg.tokens / seconds
        print(
            f"{kind.label:18} {rate[kind.label[0]]:12,.0f} {seconds:13.4f} "
            f"{kind.compiled.seconds:10.1f} {kind.memory:18.2f} {kind.compiled.temporaries:9,.1f}"
        )
    return rate


def print_ratios(kinds: list[Kind], rate: dict[str, float], bare: float, notes: list) -> None:
    """The benchmark's ratios and notes under its table."""
    cfg, memory_kind = kinds[0].cfg, cluster.peak_memory()[1]
    versus = f"low-rank / full-rank ES (a/d): {rate['a'] / rate['d']:.1f}x; " if "d" in rate else ""
    print(
        f"training / inference (a/c): {rate['a'] / rate['c']:.1%}; {versus}update share of a "
        f"generation: {1 - rate['a'] / rate['b']:.1%}; peak {memory_kind} of training "
        f"{kinds[0].memory:.2f} GiB (memory column: the process's peak so far; temp: the compiled "
        "program's own temporaries)"
    )
    print(
        f"peak RSS: this process {cluster.peak_rss():.2f} GiB, a bare JAX process on this machine "
        f"(import, one jitted int8 dot) {bare:.2f} GiB"
    )
    if "e" in rate:
        print(
            f"{cfg.replicas} replicas of population {cfg.population} / one run of "
            f"{cfg.replicas * cfg.population} (a/e): {rate['a'] / rate['e']:.1%}"
        )
    for note in notes:
        print(f"note: {note}")


def benchmark(args: Args, budget: float | None = None) -> dict[str, float]:
    """Time generations of each kind on random bytes and print one table. Each kind is compiled and
    run once first; then a, b, c (and e) take turns, one generation each, so that a slow spell of
    the machine hits them alike, and d runs alone, last (its large buffers, allocated and freed,
    slow whatever follows). Without `budget`: --num_epochs timed generations of every kind. With
    `budget` (seconds; main gives BENCHMARK_SECONDS when --num_epochs is not on the command line):
    as many as fit, at least 3, and d only if its cost fits (plan_rounds); what is shortened or
    skipped is printed with the reason. Returns the tokens/s of each kind timed, by letter."""
    run.check_args(args)
    started = time.time()
    args, mesh, _ = run.start_devices(args)
    rng, bare, notes = np.random.default_rng(args.seed), bare_jax_rss(), []
    reward, args = args, replace(args, objective="likelihood")  # a to e read bytes
    parts = (("a training", "train"), ("b fitness only", "fitness"), ("c inference", "inference"))
    kinds = [prepare_kind(label, args, part, mesh, rng, notes) for label, part in parts]
    replicas = args.pbt.replicas
    if replicas > 1:  # the same members as one run: K x P, beside the K replicas of P
        members = args.parallel_generations_per_gpu * replicas
        whole = run.single_run(args, parallel_generations_per_gpu=members)
        label = f"e one run of {run.make_config(whole, mesh.size).population}"
        kinds.append(prepare_kind(label, whole, "train", mesh, rng, notes))
    rounds, full_rank_rounds = args.num_epochs, args.num_epochs
    if budget is not None:
        left = budget - (time.time() - started)
        rounds, full_rank_rounds = plan_rounds(args, kinds, mesh, rng, budget, left, notes)
    turns = list(kinds)
    if full_rank_rounds >= 1:
        full_rank = dataclasses.replace(args, rank=0)
        full = prepare_kind("d full-rank ES", full_rank, "train", mesh, rng, notes, check_room=True)
        kinds += [full] if full else []
    for group, count in ((turns, rounds), (kinds[len(turns) :], full_rank_rounds)):
        for generation in range(1, 1 + count):
            for kind in group:
                time_generation(kind, generation)
    rate = print_table(args, kinds, rounds, mesh)
    print_ratios(kinds, rate, bare, notes)
    if run.OBJECTIVES[reward.objective].reads == "prompts":
        rate |= reward_benchmark(reward, mesh, rounds, rate["a"])
    return rate


# ------------------------------------------------------------------------------------------------
# The reward objective beside: generations on a task's prompts timed side by side, the reward
# scored in the step (the task's scorer in JAX) and on the host (its Python reward, between two
# compiled calls), and the members' writing alone; in bytes written a second.


def writing_alone(cfg: run.Config, mesh):
    """A step of make_generation_step's signature that only writes (make_writing_step): what the
    members wrote stands in for their fitness."""
    writing = run.make_writing_step(cfg, mesh)

    def step(params, rule_state, states, batch, generation, thresholds, seeds, sigma_shifts):
        written = writing(params, batch, generation, seeds, sigma_shifts)
        return params, rule_state, states, written, written

    return step


def reward_kind(label: str, cfg: run.Config, mesh, data, replicas, alone: bool = False) -> Kind:
    """One kind of reward generation compiled ahead of time (run.compile_generation: one program,
    or two and the host's scoring between) and its first generation run; alone: the writing."""
    carry = run.on_mesh(*run.init_run(cfg, replicas), mesh)
    batch, inputs = run.batch_on_mesh(data, cfg, mesh, 0), run.replica_inputs(cfg, replicas, 0)
    tick = time.time()
    if alone:
        _, seeds, shifts = inputs
        writing = run.make_writing_step(cfg, mesh).lower(
            carry[0], batch, np.int32(0), seeds, shifts
        )
        temporaries = hlo.compile_now(writing).temporaries
        compiled = run.Compiled(writing_alone(cfg, mesh), [], temporaries)
    else:
        compiled = run.compile_generation(cfg, mesh, carry, batch, 0, inputs, data)
    timed = hlo.Compiled(compiled.step, time.time() - tick, compiled.temporaries, 0)
    kind = Kind(label, cfg, timed, batch, inputs, carry, [])
    kind.first = time_generation(kind, 0)
    kind.seconds.clear()
    kind.memory = cluster.peak_memory()[0]
    return kind


def reward_benchmark(args: Args, mesh, rounds: int, likelihood: float) -> dict[str, float]:
    """The reward objective's generations timed side by side on the task's prompts, `rounds` of
    each, printed as a table of bytes written a second; the host reward's share of a generation
    (its scoring of what the members wrote, timed alone) and r's bytes against `likelihood`'s
    tokens a second (a's). Returns the rates by letter."""
    cfg, replicas = run.mesh_config(args, mesh), run.replicas_of(args)
    data, notes = run.read_prompts(args, mesh), []
    kinds = []
    if cfg.scorer is not None:
        kinds.append(reward_kind("r scored in the step", cfg, mesh, data, replicas))
    else:
        notes.append(f"r skipped: the task {data.task.name} has no scorer in JAX")
    host = cfg._replace(scorer=None)
    kinds.append(reward_kind("s scored on the host", host, mesh, data, replicas))
    alone = reward_kind("w writing alone", host, mesh, data, replicas, alone=True)
    kinds.append(alone)
    scoring = []  # the host's scoring alone, of what w wrote
    for generation in range(1, 1 + rounds):
        for kind in kinds:
            time_generation(kind, generation)
        step = alone.compiled.step(*alone.carry, alone.batch, np.int32(generation), *alone.inputs)
        written = jax.block_until_ready(step[3])
        tick = time.time()
        run.written_fitness(written, generation, data, host, mesh)
        scoring.append(time.time() - tick)
    own = cfg.objective_flags
    bytes_written = cfg.population * cfg.replicas * cfg.segments * own.completion_bytes
    print(
        f"reward objective: task {data.task.name}, {len(data.order):,} prompts of up to "
        f"{data.valid_rows.shape[1] - 1} bytes, up to {own.completion_bytes} bytes written by each "
        f"member ({cfg.segments} segment(s)); median of {rounds} generations each"
    )
    print(f"{'':22} {'written/s':>12} {'s/generation':>13} {'compile s':>10} {'temp MiB':>9}")
    rate = {}
    for kind in kinds:
        seconds = float(np.median(kind.seconds))
        rate[kind.label[0]] = bytes_written / seconds
        print(
            f"{kind.label:22} {rate[kind.label[0]]:12,.0f} {seconds:13.4f} "
            f"{kind.compiled.seconds:10.1f} {kind.compiled.temporaries:9,.1f}"
        )
    host_seconds, scored = bytes_written / rate["s"], float(np.median(scoring))
    versus = ""
    if "r" in rate:
        versus = f"; bytes written by r / read by a, a second: {rate['r'] / likelihood:.1%}"
    print(
        f"the host reward's share of a generation (s): {scored / host_seconds:.1%} "
        f"({scored * 1e3:,.2f} ms of {host_seconds * 1e3:,.2f}){versus}"
    )
    for note in notes:
        print(f"note: {note}")
    return rate


# ------------------------------------------------------------------------------------------------
# GPU target: the program a GPU would run, compiled here without one, its kernels read from the
# compiled HLO (egg/hlo.py) and costed by a stated model. The generation step scans a member's
# segments, each segment's bytes (run.forward) and, where XLA runs the products, the layers
# (run.token_logits): a kernel as deep as the bytes' scan runs for every byte, one as deep as the
# layers' for every byte and layer.

TARGET_FILES = {"h100": "targets/h100_sxm.txtpb"}  # GpuTargetConfigProto text, beside run.py
# the H100 SXM's datasheet: 3.35 TB/s of HBM3, 1,979 dense int8 tera-operations/s (2 per MAC). The
# launch costs are assumptions: 3 us a launch (a kernel's on its own, or a CUDA graph's), the order
# of back-to-back small kernels on any recent GPU; 1 us a kernel recorded in a graph, the order of
# the gap between a graph's dependent kernels (scripts/gpu_check.py measures what graphs save)
ROOFLINES = {"h100": hlo.Roofline("H100 SXM", 3.35e12, 1979e12 / 2, 3e-6, 1e-6)}
# XLA's command buffers (CUDA graphs): as it records them by default (each loop's body a graph of
# its own, launched every trip), and with the loops recorded too (WHILE: the graph's conditional
# nodes; XLA's default commands, FUSION, CUBLAS, CUSTOM_CALL and CUDNN, with it)
COMMAND_BUFFERS = {
    "XLA's default": {},
    "loops recorded (WHILE)": {
        "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUSTOM_CALL,CUDNN,WHILE"
    },
}
LOOPS = ("once", "per segment", "per byte", "per byte and layer")  # loop_of's answers, in words


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
    return cluster.population_mesh(run.POP, topology.devices)


def abstract_inputs(args: Args, cfg: run.Config, mesh, batch=None) -> tuple:
    """The generation step's arguments as shapes with their shardings on the mesh (no arrays):
    a batch of data sequences, or the `batch` given (shapes)."""
    replicas = run.replicas_of(args)
    params, rule_state, states = jax.eval_shape(lambda: run.init_run(cfg, replicas))
    everywhere, spread = (
        jax.sharding.NamedSharding(mesh, spec) for spec in (run.REPLICATED, run.SPREAD)
    )

    def shaped(x, sharding=everywhere):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    if batch is None:
        batch = jax.ShapeDtypeStruct((cfg.population // cfg.group_size, cfg.tokens + 1), jnp.uint8)
    batch = jax.tree.map(partial(shaped, sharding=everywhere), batch)
    generation = jax.ShapeDtypeStruct((), jnp.int32, sharding=everywhere)
    inputs = run.replica_inputs(cfg, replicas, 0)
    return (
        *jax.tree.map(shaped, (params, rule_state)),
        shaped(states, spread),
        batch,
        generation,
        *map(shaped, inputs),
    )


def pallas_calls(jaxpr):
    """Every Pallas kernel call (its jaxpr equation) in a traced program, inner jaxprs included."""

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                yield eqn
                continue
            for value in eqn.params.values():
                for sub in value if isinstance(value, tuple | list) else (value,):
                    inner = getattr(sub, "jaxpr", sub)  # a closed jaxpr's, or a jaxpr itself
                    if hasattr(inner, "eqns"):
                        yield from walk(inner)

    yield from walk(jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr)


def call_signature(eqn) -> tuple:
    """egg/hlo.py's signature of a Pallas call: its operands' and results' dims."""
    return hlo.signature([v.aval.shape for v in eqn.invars], [v.aval.shape for v in eqn.outvars])


def pallas_costs(jaxpr) -> dict:
    """{egg/hlo.py's signature: (bytes, MACs)} of every Pallas kernel in a traced program, as each
    declares its cost (Pallas's CostEstimate: 2 operations a MAC)."""
    found = {}
    for eqn in pallas_calls(jaxpr):
        cost = eqn.params["cost_estimate"]
        if cost is None:  # Mosaic GPU's plgpu.kernel declares none: costed as 0
            continue
        found[call_signature(eqn)] = (cost.bytes_accessed, cost.flops // 2)
    return found


@contextmanager
def without_compilation_cache():
    """JAX's persistent cache cannot load a program compiled without its device back: keep such
    programs out of it (a minimum compile time no compilation reaches keeps the entries from being
    written, where JAX had decided to use the cache before). JAX decides once a process whether it
    uses the cache, at its first compilation: where that is one of these, it would decide against
    it for every program after; its decision is reset on the way out, to be made at the next."""
    before = (
        jax.config.jax_enable_compilation_cache,
        jax.config.jax_persistent_cache_min_compile_time_secs,
    )
    jax.config.update("jax_enable_compilation_cache", False)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", math.inf)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
        compilation_cache.reset_cache()


class Target(NamedTuple):
    """A step compiled for --target, and what its program shows."""

    compiled: Any
    kernels: list[hlo.Kernel]
    cfg: run.Config
    seconds: float  # compile time
    launched: hlo.Launches | None  # None where XLA dumped no thunk sequence
    mma_code: dict[str, hlo.MmaCode]  # each kernel with MMAs in its PTX, by name (dumped_mma_code)


def dumped_launches(dump: Path, text: str) -> hlo.Launches | None:
    """The Launches of the program XLA compiled with --xla_dump_to `dump` (its compiled HLO
    `text`): its thunk sequence after the thunk passes, or before them where no pass changed it."""
    sequences = sorted(dump.glob("*.thunk_sequence_after_thunk_passes.txt"))
    sequences = sequences or sorted(dump.glob("*.thunk_sequence.txt"))
    metadata = sorted(dump.glob("*.thunk_metadata.txt"))
    if not (sequences and metadata):
        return None
    return hlo.launches(sequences[-1].read_text(), metadata[-1].read_text(), text)


def target_config(args: Args, mesh) -> run.Config:
    """The run's configuration on the target's mesh (each GPU counts as one device), its products
    as --products says."""
    cfg = run.mesh_config(replace(args, cpu_devices=1), mesh)
    if args.products:
        cfg = run.as_candidate(cfg, args.products, mesh.devices.flat[0].platform)
    return cfg


def compile_target(args: Args, part: str, options: dict | None = None) -> Target:
    """A step compiled for --target with these XLA options (COMMAND_BUFFERS' entries)."""
    mesh = target_mesh(args.target, args.target_devices)
    cfg = target_config(args, mesh)
    run.check_bounds(cfg)
    tick = time.time()
    with without_compilation_cache(), tempfile.TemporaryDirectory() as dump:
        traced = make_step(cfg, mesh, part).trace(*abstract_inputs(args, cfg, mesh))
        with mosaic_dumps_to(dump):
            compiled = traced.lower().compile({"xla_dump_to": dump, **(options or {})})
        launched = dumped_launches(Path(dump), compiled.as_text())
        code = dumped_mma_code(Path(dump))
    kernels = hlo.gpu_kernels(compiled.as_text(), pallas_costs(traced.jaxpr))
    return Target(compiled, kernels, cfg, time.time() - tick, launched, code)


@contextmanager
def mosaic_dumps_to(dump: str):
    """Mosaic GPU's compiler writes each kernel's PTX into `dump` (beside XLA's) while in this
    context: its environment variables, read as it compiles, restored after."""
    wanted = {"MOSAIC_GPU_DUMP_TO": dump, "MOSAIC_GPU_DUMP_PTX": "1"}
    before = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def dumped_mma_code(dump: Path) -> dict[str, hlo.MmaCode]:
    """Each kernel whose PTX (as XLA dumps it) holds MMA instructions, by name (numbered where two
    modules name theirs alike): its MMA loop's figures, each distinct loop once."""
    found = {}
    for path in sorted(dump.glob("*.ptx")):
        for name, lines in hlo.ptx_entries(path.read_text()).items():
            code = hlo.mma_code(lines)
            if code.mmas and code not in found.values():
                found[name if name not in found else f"{name} #{len(found)}"] = code
    return found


def mma_text(code: dict[str, hlo.MmaCode]) -> str:
    """The product kernels' MMA loops in words (print_target_report)."""
    if not code:
        return "none (no MMA in the dumped PTX)"
    said = []
    for name, c in code.items():
        waits = (
            f"{c.waited_at_once} of {c.groups} wgmma groups waited for at once, "
            f"{c.in_flight} left in flight"
            if c.kind == "wgmma"
            else "each synchronous"
        )
        said.append(
            f"{name}: {c.mmas} {c.kind} {c.shape}, {c.integer:,} integer instructions "
            f"({c.integer / c.mmas:,.0f} an MMA), {waits}"
        )
    return "; ".join(said)


def roofline_bytes(cfg: run.Config) -> tuple[float, float]:
    """(training, inference) bytes a token costs each member at the least (docs/design.org's
    roofline): the weights once per device's members, the activations the model reads and writes
    (its entry's traffic: EGG's every product's int8 input and output, the state and the residual
    stream); in training also half its pair's rank-r factors (A and B of every matrix; of the
    embedding's A, the row of the byte read) and its own perturbed vectors."""
    members = cfg.population // cfg.devices
    weights = run.num_parameters(cfg) / members
    activations = run.MODELS[cfg.model].traffic(cfg)
    factors = vectors = 0
    for name, p in run.parameters_of(cfg).items():
        layers = cfg.n_layer if p.layered else 1
        if p.matrix:
            rows = 1 if name == "emb" else p.shape[0]
            factors += layers * cfg.rank * (rows + p.shape[1])
        else:
            vectors += layers * math.prod(p.shape)
    return weights + activations + factors / 2 + vectors, weights + activations


def loop_of(k: hlo.Kernel, cfg: run.Config) -> int:
    """The loop a kernel runs in, an index of LOOPS, by how often it runs a generation: a member
    reads cfg.tokens bytes in cfg.segments segments, so a kernel that runs every byte runs more
    often than there are segments (XLA may split a loop of bytes in two: their runs add up to the
    bytes), one that runs every byte and layer (the layers scanned, as XLA's products have them)
    more often than there are bytes. (JAX's name stack would say which scans hold a kernel, but
    XLA restructures loops: over 8 GPUs it leaves no loop of segments.)"""
    if k.runs > cfg.tokens:
        return 3
    return 2 if k.runs > cfg.segments else int(k.runs > 1)


def describe_program(
    kernels: list[hlo.Kernel], cfg: run.Config, tokens_per_call: int, launched=None
) -> dict:
    """What a compiled generation's kernels add up to (the figures target_report prints), with
    their launches where known."""
    members = cfg.population // cfg.devices * cfg.replicas
    every_byte = [k for k in kernels if loop_of(k, cfg) >= 2]
    if run.MODELS[cfg.model].window is not None:  # no loop of bytes: the whole generation's
        every_byte = kernels
    kinds = {}
    for k in kernels:
        kinds[k.kind] = kinds.get(k.kind, 0) + k.runs
    captured = launched.captured if launched else frozenset()
    return {
        "kernels": sum(k.runs for k in kernels),
        "alone": sum(k.runs for k in kernels if k.name not in captured),
        "graphs": launched.graphs if launched else None,
        "kinds": kinds,
        "per_token": sum(k.runs for k in every_byte) / cfg.tokens,
        "per_layer": sum(k.runs for k in kernels if loop_of(k, cfg) == 3)
        / (cfg.tokens * cfg.n_layer),
        "bytes_per_token_member": sum(k.runs * k.bytes for k in every_byte)
        / (cfg.tokens * members),
        "tokens_per_call": tokens_per_call,
    }


def launches_text(figures: dict) -> str:
    """How a compiled generation launches its kernels, in words."""
    if figures["graphs"] is None:
        return "unknown (XLA dumped no thunk sequence)"
    plural = "s" if figures["graphs"] != 1 else ""
    return (
        f"{figures['graphs']:,} command buffer{plural} (CUDA graphs) launched, "
        f"{figures['kernels'] - figures['alone']:,} kernel launches recorded in them, "
        f"{figures['alone']:,} on their own"
    )


def gemms_text(kernels: list[hlo.Kernel], cfg: run.Config, launched: hlo.Launches | None) -> str:
    """Every distinct product (XLA's GEMMs, the product kernel's calls): its shapes, the loop it
    runs in and, where the launches are known, the blocks (CTAs) of its grid and their number for
    each of the GPU's SMs."""
    grids = launched.grids if launched else {}
    found = {}
    for k in kernels:
        if k.kind in ("gemm", "pallas"):
            ctas = math.prod(grids[k.name]) if k.name in grids else None
            found[(k.shapes, LOOPS[loop_of(k, cfg)])] = ctas
    return "; ".join(
        f"{shapes} ({loop}"
        + ("" if ctas is None else f"; {ctas:,} CTAs, {ctas / kernel.SMS:.1f} an SM")
        + ")"
        for (shapes, loop), ctas in sorted(found.items())
    )


def print_target_report(
    args: Args, cfg: run.Config, roofline, seconds: float, kernels, figures
) -> None:
    t, i = figures["training"], figures["inference"]
    least = roofline_bytes(cfg)
    best = [roofline.hbm / b * cfg.devices for b in least]  # tokens/s where bytes alone bound
    largest = sorted(kernels, key=lambda k: -k.bytes)[:3]
    kinds = ", ".join(f"{kind} {count:,}" for kind, count in sorted(t["kinds"].items()))
    in_layers = (
        f"({t['per_layer']:.0f} in each layer)" if t["per_layer"] else "(the layers unrolled)"
    )
    if run.MODELS[cfg.model].window is not None:
        in_layers = "(a window model: every kernel of the generation, its update's too)"
    graphs = "; ".join(f"{name}: {text}" for name, text in figures["command buffers"].items())
    lines = [
        f"target: {args.target_devices} x {roofline.name}, compiled here without a device (XLA's "
        f"GPU pipeline, untuned GEMM tiles); model {run.model_name(cfg)}; population "
        f"{cfg.population}, {cfg.tokens} tokens, {cfg.segments} segment(s); compiled in "
        f"{seconds:.1f} s",
        f"temporaries: {figures['temporaries']:,.1f} MiB on each GPU",
        "largest kernels by bytes: "
        + "; ".join(f"{k.name} {k.bytes / 2**20:,.1f} MiB" for k in largest),
        f"kernels per generation: {kinds} ({t['kernels']:,} in all)",
        f"kernels per token: {t['per_token']:.0f} {in_layers}",
        f"launches per generation: {graphs}",
        f"products (XLA's GEMMs and the product kernel's; an H100 has {kernel.SMS} SMs): "
        + gemms_text(kernels, cfg, figures["launched"]),
        "MMA loops (PTX, each instruction once): " + mma_text(figures["mma code"]),
        "collectives per generation: "
        + (
            ", ".join(f"{op} {size:,} B" for op, size in figures["collectives"]) or "none (one GPU)"
        ),
        f"bytes per token and member: {t['bytes_per_token_member']:,.0f} B (roofline "
        f"{least[0]:,.0f} B); inference {i['bytes_per_token_member']:,.0f} B (roofline "
        f"{least[1]:,.0f} B)",
        f"modeled training tokens/s: {t['tokens_per_s']:,.0f} ({t['seconds'] * 1e3:,.2f} ms a "
        f"generation, modeled; {t['tokens_per_s'] / best[0]:.0%} of the roofline's "
        f"{best[0]:,.0f})",
        f"modeled inference tokens/s: {i['tokens_per_s']:,.0f} ({i['seconds'] * 1e3:,.2f} ms, "
        f"modeled; roofline {best[1]:,.0f}); training / inference: "
        f"{t['tokens_per_s'] / i['tokens_per_s']:.0%}",
        f"cost model: each kernel max(bytes / {roofline.hbm / 1e12:.2f} TB/s, MACs / "
        f"{roofline.int8_macs / 1e12:.0f} T MAC/s) + {roofline.launch * 1e6:.0f} us launched on "
        f"its own, {roofline.in_graph * 1e6:.0f} us recorded in a command buffer, and "
        f"{roofline.launch * 1e6:.0f} us a command buffer's launch (launch costs assumed; XLA's "
        "default command buffers)",
    ]
    print("\n".join(lines))


def target_reward(args: Args) -> dict:
    """--target with --objective reward: the reward's generation compiled for the target GPU(s)
    (the task's scorer in the step; where it has none, the members' writing alone, what the GPU
    runs of it), its kernels, and the bytes written a second the cost model gives. Printed;
    returns the figures."""
    mesh = target_mesh(args.target, args.target_devices)
    cfg, roofline = target_config(args, mesh), ROOFLINES[args.target]
    task = tasks.open_task(args.tasks)
    length = 1 + max(map(tasks.longest, (task.train.prompts, task.valid.prompts)))
    answers = tasks.scored_against(task).shape[1]
    groups = (cfg.population // cfg.group_size, cfg.segments)
    batch = run.Prompts(*(jax.ShapeDtypeStruct((*groups, n), jnp.uint8) for n in (length, answers)))
    params, rule_state, states, batch, generation, *inputs = abstract_inputs(args, cfg, mesh, batch)
    if cfg.scorer is not None:
        step = run.make_generation_step(cfg, mesh)
        given, what = (params, rule_state, states, batch, generation, *inputs), "scored in the step"
    else:
        step = run.make_writing_step(cfg, mesh)
        given, what = (params, batch, generation, *inputs[1:]), "the writing alone"
    tick = time.time()
    with without_compilation_cache(), tempfile.TemporaryDirectory() as dump:
        traced = step.trace(*given)
        compiled = traced.lower().compile({"xla_dump_to": dump})
        launched = dumped_launches(Path(dump), compiled.as_text())
    seconds = time.time() - tick
    kernels = hlo.gpu_kernels(compiled.as_text(), pallas_costs(traced.jaxpr))
    modeled = hlo.modeled_seconds(kernels, roofline, launched)
    written = cfg.population * cfg.replicas * cfg.segments * cfg.objective_flags.completion_bytes
    temporaries = getattr(compiled.memory_analysis(), "temp_size_in_bytes", 0) / 2**20
    figures = {"kernels": sum(k.runs for k in kernels), "seconds": modeled}
    figures["written_per_s"] = written / modeled
    print(
        f"reward objective ({what}): task {task.name}, prompts of {length} bytes (byte 0 "
        f"before), up to {cfg.objective_flags.completion_bytes} bytes written; compiled in "
        f"{seconds:.1f} s; {figures['kernels']:,} kernels a generation; {temporaries:,.1f} MiB of "
        f"temporaries; modeled bytes written a second: {figures['written_per_s']:,.0f} "
        f"({modeled * 1e3:,.2f} ms a generation)"
    )
    return figures


def target_report(args: Args) -> dict:
    """--target: compile the training and inference steps for the target GPU(s) and print what the
    compiled programs show and what the cost model says they take (with --objective reward, also
    the reward's: target_reward). Returns the figures."""
    run.check_args(args)
    reward, args = args, replace(args, objective="likelihood")  # the steps that read bytes first
    roofline = ROOFLINES[args.target]
    train = compile_target(args, "train")
    inference = compile_target(args, "inference")
    cfg = train.cfg
    tokens = cfg.population * cfg.tokens * cfg.replicas  # per call, over every device
    figures = {}
    for part, target in (("training", train), ("inference", inference)):
        figures[part] = describe_program(target.kernels, cfg, tokens, target.launched)
        figures[part]["seconds"] = hlo.modeled_seconds(target.kernels, roofline, target.launched)
        figures[part]["tokens_per_s"] = tokens / figures[part]["seconds"]
    figures["command buffers"] = {}
    for name, options in COMMAND_BUFFERS.items():
        target = compile_target(args, "train", options) if options else train
        described = describe_program(target.kernels, cfg, tokens, target.launched)
        figures["command buffers"][name] = launches_text(described)
    figures["temporaries"] = getattr(train.compiled.memory_analysis(), "temp_size_in_bytes", 0)
    figures["temporaries"] /= 2**20
    figures["collectives"] = hlo.collective_traffic(train.compiled.as_text())
    figures["launched"] = train.launched
    figures["mma code"] = train.mma_code
    print_target_report(args, cfg, roofline, train.seconds, train.kernels, figures)
    if run.OBJECTIVES[reward.objective].reads == "prompts":
        figures["reward"] = target_reward(reward)
    return figures | {
        "cfg": cfg,
        "kernels": {"training": train.kernels, "inference": inference.kernels},
        "compiled": {"training": train.compiled, "inference": inference.compiled},
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = run.parse_args(argv, Args)
        args = run.prepare_jax(args, "cpu" if args.target else "")  # --target: nothing runs on it
        if args.target:
            target_report(args)
        else:
            benchmark(args, None if flag_given(argv, "num_epochs") else BENCHMARK_SECONDS)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    except tasks.RewardFailed as error:  # the task's reward, on what the members wrote
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(EX_DATAERR) from None


if __name__ == "__main__":
    main()
