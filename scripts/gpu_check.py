"""What a machine with an NVIDIA GPU can tell that no other can, in one call of under 10 minutes.
In order of what matters most, each table printed as soon as it is measured (a call cut short keeps
what it measured), each part skipped with one line where --budget has too little left for it:

(a) nano-egg beside egg-jax: upstream's own run.py, from the clone --nano_egg names (never copied
    into this repository), and this run.py, one after the other on the same GPU, the same bytes (a
    corpus of this Python's own source files, made here: nothing to download) and the same flags
    (scripts/side_by_side.py runs each): at nano-egg's README command (population 32768 of its
    256D-6L) and at populations 4096 and 1024 of 64D-2L: training tokens/s, peak GPU memory and
    validation bits/byte after the same generations. Without --nano_egg, egg-jax's side alone;
(b) egg-jax at population 32768: (a)'s first configuration, its egg-jax side;
(c) the generation step of each configuration, in one process, compiled seven ways and timed
    beside what bench.py's cost model says of the same compiled program (its launches read from
    XLA's dump): the product kernel with its tiles as before (the largest, 64 pairs by 64 outputs)
    and as now (two programs, CTAs, for each SM at least), with each row layer-normalised once
    before it instead of in it, with XLA's default command buffers (CUDA graphs), with none and
    with loops recorded too (WHILE); XLA's own products with and without command buffers; then one
    generation of today's program profiled kernel by kernel (JAX's profiler) beside the model's
    time for each kernel;
(p) --kernels auto's candidates (run.PRODUCT_CANDIDATES) at (a)'s first configuration (256D-6L,
    population 32768) and at population 1024 of it: each one's probe (one device's members reading
    one segment, as --kernels auto times it): ms, its int8 MACs (the compiled probe's products, as
    bench.py counts them), T MAC/s and share of an H100's dense int8 peak; then what --kernels auto
    picks there, and in how long;
(m) each model of run.py's MODELS at (a)'s first configuration (population 32768 of 256D-6L): its
    generation step with the product kernel and with XLA's products, timed as (c) times them;
(d) full-rank ES (--rank 0), the same 20 generations (--quick: 4) on the GPU and the CPU: same bits;
(e) the rest: the product kernel as compiled against the same kernel in Pallas's interpreter;
    XLA's int8 products against numpy's; the same low-rank training on the GPU (the kernel's
    products, then XLA's) and on the CPU: the same bits; then the tests whose arithmetic runs on the
    device, for what the budget has left;
(t) the product kernel's tiles: each product of a configuration's generation step (read as the step
    is traced) timed with every tile the kernel may take (64 pairs in 4 and 8 warps), beside the
    rule's choice, the same kernel without its noise, gain and residual, and XLA's int8 GEMM of the
    same shapes: what a measured tile choice would gain, and what the integer work costs.

Parts run in the order --parts gives (default a p m c d e t), each with what the budget has left.

    python scripts/gpu_check.py --nano_egg NANO_EGG     # on the GPU machine, from the repository
    python scripts/gpu_check.py --platform cpu --quick  # its CPU part (what the tests run)
    python scripts/gpu_check.py --parts t d e           # some parts only, in this order

NANO_EGG is a clone of github ESHyperscale/nano-egg (a bare one will do). A GPU machine without
internet needs them beside the repository, and run.py's command-line packages its image may lack,
carried as wheels; made where there is internet:

    git clone --bare https://github.com/ESHyperscale/nano-egg .nano-egg
    pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \\
        tyro docstring-parser shtab typeguard

and there: `pip install --no-index .whl/*`. Upstream also imports `datasets` and `wandb`, which it
does not use here (side_by_side.py gives it stand-ins where they are missing), and needs about 17
GiB of host memory (its 2**28-entry log table is built in float64).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# side_by_side.py beside this script; run.py, bench.py and egg at the repository's root
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT)]
import side_by_side  # noqa: E402

PARTS = ("a", "p", "m", "c", "d", "e", "t")  # (b) is part of (a)
TESTS = [
    "tests/test_model_reference.py",
    "tests/test_step.py",
    "tests/test_update.py",
    "tests/test_noise.py",
]
SMALL_RUN = (
    "--data tests/data/words.txt --n_embd 16 --n_layer 2 --parallel_generations_per_gpu 64 "
    "--group_size 4 --tokens_per_update 16 --validation_batch_size 8 --validation_tokens 32 "
    "--save_every 0"
).split()
SAME_GENERATIONS = 20  # of each side of (d) and (e)'s comparisons; --quick's: 4


@dataclass(frozen=True)
class Configuration:
    name: str
    flags: tuple[str, ...]  # flags both scripts know
    generations: int  # of each side in (a), validated once, after the last
    side_seconds: float  # the longest (a) waits for one side of it


# nano-egg's README command first (its other defaults, 256D-6L, are ours too); a member's tokens
# given (side_by_side.py asks for them: the scripts' defaults may differ)
CONFIGURATIONS = (
    Configuration(
        "nano-egg's README command: 256D-6L, population 32768",
        ("--parallel_generations_per_gpu", "32768", "--tokens_per_update", "100"),
        30,
        150,
    ),
    Configuration(
        "64D-2L, population 4096",
        ("--n_embd", "64", "--n_layer", "2", "--parallel_generations_per_gpu", "4096")
        + ("--tokens_per_update", "100"),
        100,
        75,
    ),
    Configuration(
        "64D-2L, population 1024",
        ("--n_embd", "64", "--n_layer", "2", "--parallel_generations_per_gpu", "1024")
        + ("--tokens_per_update", "100"),
        100,
        75,
    ),
)
# (p): the README command's model at its population and at 1024 members
PROBED = (
    CONFIGURATIONS[0],
    Configuration(
        "256D-6L, population 1024",
        ("--parallel_generations_per_gpu", "1024", "--tokens_per_update", "100"),
        30,
        150,
    ),
)
QUICK_CONFIGURATIONS = (
    Configuration(
        "32D-1L, population 64",
        tuple(
            "--n_embd 32 --n_layer 1 --parallel_generations_per_gpu 64 --group_size 4 "
            "--tokens_per_update 8".split()
        ),
        20,
        120,
    ),
)
VALID_BYTES = 1 << 18  # (a)'s validation bytes, the corpus's last: 256 a stream of 1,024
TRAIN_BYTES = 1 << 25  # (a)'s training bytes at most, those before them
SEED = ("--seed", "0")
# (c): the product kernel's tile rule as it was (the largest tiles, at most 64 outputs) and as it
# is; XLA's command buffers as it records them by default, none, and loops recorded too (WHILE)
NO_GRAPHS = {"xla_gpu_enable_command_buffer": ""}
WHILE = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUSTOM_CALL,CUDNN,WHILE"}
# the kernel's options (egg/kernel.py's Options) each variant changes: "tiles before", the tile rule
# as it was (the largest tiles, at most 64 outputs, whatever the grid they give); layer norms
# before the kernel, by XLA once a row
TILES_BEFORE = {"programs_per_sm": 0, "columns": 64}
NORMS_BEFORE = {"normalises": False}
VARIANTS = {  # name: (--kernels, the kernel's options changed, XLA's options)
    "kernel, tiles before, graphs": ("pallas", TILES_BEFORE, {}),
    "kernel, tiles now, graphs": ("pallas", {}, {}),
    "kernel, layer norms before it, graphs": ("pallas", NORMS_BEFORE, {}),
    "kernel, tiles now, no graphs": ("pallas", {}, NO_GRAPHS),
    "kernel, tiles now, loops in graphs": ("pallas", {}, WHILE),
    "XLA's products, graphs": ("xla", {}, {}),
    "XLA's products, no graphs": ("xla", {}, NO_GRAPHS),
}
PROFILED = "kernel, tiles now, graphs"  # the variant whose one generation (c) profiles
GRAPH_LAUNCHES = "(CUDA graph launches)"  # the model's cost of launching the graphs themselves


@dataclass(frozen=True)
class Args:
    platform: str = "cuda"
    """the platform under test (cpu: this script's own check, on any machine)"""
    nano_egg: str = ""
    """a clone of github ESHyperscale/nano-egg, for (a) ('': egg-jax's side alone)"""
    parts: tuple[str, ...] = PARTS
    """the parts to run, in this order, of a m c d e t ((b) is part of (a))"""
    budget: float = 540.0
    """seconds for all parts: each is skipped with a line where too little is left"""
    quick: bool = False
    """tiny configurations and checks (for the tests)"""
    out: str = ""
    """folder for the logs, runs and traces (default: a new temporary folder)"""


@dataclass
class Clock:
    """The seconds left of the budget, from its start."""

    budget: float
    started: float = field(default_factory=time.time)

    def left(self) -> float:
        return self.budget - (time.time() - self.started)


def run_module():
    """run.py, imported (importing it does nothing)."""
    import run  # noqa: PLC0415

    return run


def bench_module():
    """bench.py, imported (it imports run.py)."""
    import bench  # noqa: PLC0415

    return bench


def run_py(*flags: str, platform: str, script: str = "run.py") -> subprocess.CompletedProcess:
    """python run.py (or bench.py) FLAGS on `platform`, from the repository root."""
    environment = {**os.environ, "JAX_PLATFORMS": platform}
    command = [sys.executable, str(ROOT / script), "--platform", platform, *flags]
    return subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True)


# ------------------------------------------------------------------------------------------------
# (a) and (b): nano-egg beside egg-jax, each side a run of its own run.py.


def side_corpus(out: Path, quick: bool) -> tuple[Path, Path]:
    """(train, valid) files of (a): this Python's own source files (run.py's --data stdlib), the
    last VALID_BYTES held out, at most TRAIN_BYTES before them (a sixteenth in --quick)."""
    from egg import corpus  # noqa: PLC0415

    data = corpus.load_corpus("stdlib", str(out / "cache"))
    valid, size = VALID_BYTES >> 4 * quick, TRAIN_BYTES >> 4 * quick
    train_file, valid_file = out / "side-train.bin", out / "side-valid.bin"
    train_file.write_bytes(bytes(data[max(0, len(data) - valid - size) : len(data) - valid]))
    valid_file.write_bytes(bytes(data[len(data) - valid :]))
    return train_file, valid_file


def side_lines(name: str, sides: dict, flags: str, generations: int) -> list[str]:
    """(a)'s table of one configuration: a row a side (FAILED with why where it failed), and the
    ratios where both ran."""
    lines = [
        f"== (a) {name}: {flags}; {generations} generations, validated after the last",
        f"{'side':9} {'tokens/s':>13} {'s/generation':>13} {'peak GPU GiB':>13} "
        f"{'val bits/byte':>14} {'wall s':>7}",
    ]
    for label, side in sides.items():
        if isinstance(side, str):
            lines.append(f"{label:9} FAILED: {side}")
            continue
        device = "-" if side.peak_device_gib is None else f"{side.peak_device_gib:.2f}"
        last = side.validation.get(generations, math.nan)
        lines.append(
            f"{label:9} {side.tokens_per_second:13,.0f} {side.seconds_per_generation:13.4f} "
            f"{device:>13} {last:14.4f} {side.wall_seconds:7.0f}"
        )
    ours, theirs = sides.get("egg-jax"), sides.get("nano-egg")
    if isinstance(ours, side_by_side.Side) and isinstance(theirs, side_by_side.Side):
        memory = ""
        if ours.peak_device_gib and theirs.peak_device_gib:
            memory = f", {ours.peak_device_gib / theirs.peak_device_gib:.3f}x the peak GPU memory"
        gap = ours.validation.get(generations, math.nan) - theirs.validation.get(
            generations, math.nan
        )
        lines.append(
            f"egg-jax / nano-egg: {ours.tokens_per_second / theirs.tokens_per_second:.2f}x the "
            f"tokens/s{memory}, {gap:+.4f} bits/byte (nano-egg's validation truncates: it reads "
            "about 0.03 low)"
        )
    return lines


def beside_nano_egg(args: Args, out: Path, clock: Clock) -> list[str]:
    """(a), configuration by configuration, each side given at most its Configuration's seconds
    and what the budget has left."""
    train, valid = side_corpus(out, args.quick)
    lines = []
    for config in QUICK_CONFIGURATIONS if args.quick else CONFIGURATIONS:
        flags = " ".join([*config.flags, *SEED])
        given = side_by_side.Args(
            args.nano_egg or "-",
            str(train),
            str(valid),
            flags=flags,
            num_epochs=config.generations,
            validate_every=config.generations,
        )
        common = side_by_side.common_flags(given, validation_batch=1024)
        runners = {"nano-egg": side_by_side.run_upstream, "egg-jax": side_by_side.run_ours}
        sides = {}
        for label, runner in runners.items():
            if label == "nano-egg" and not args.nano_egg:
                continue
            timeout = min(config.side_seconds, clock.left())
            if timeout < config.side_seconds / 3:
                sides[label] = f"skipped: {clock.left():.0f} s of the budget left"
                continue
            work = Path(tempfile.mkdtemp(prefix=f"side-{label}-", dir=out))
            try:
                sides[label] = runner(given, work, common, timeout)
            except side_by_side.Failed as failed:
                sides[label] = str(failed)
        section = side_lines(config.name, sides, flags, config.generations)
        print(*section, sep="\n", flush=True)
        lines += section
    return lines


# ------------------------------------------------------------------------------------------------
# (c): the generation step compiled seven ways, timed beside the cost model; one generation
# profiled.


def compiled_step(flags: list[str], options: dict, dump: Path, changes: dict | None = None):
    """run.py's generation step for these flags (and these changes of the kernel's options),
    compiled with these XLA options (its thunks dumped into `dump`), and its first arguments:
    (compiled, traced, cfg, carry, batch, inputs)."""
    import numpy as np  # noqa: PLC0415

    run = run_module()
    args, mesh, cfg = run.start_devices(run.parse_args(flags))
    cfg = cfg._replace(kernel_options=cfg.kernel_options._replace(**(changes or {})))
    replicas = run.replicas_of(args)
    carry = run.on_mesh(*run.init_run(cfg, replicas), mesh)
    batch = np.zeros((cfg.population // cfg.group_size, cfg.tokens + 1), np.uint8)
    batch = run.cluster.global_array(batch, mesh, run.REPLICATED)
    inputs = run.replica_inputs(cfg, replicas, 0)
    traced = run.make_generation_step(cfg, mesh).trace(*carry, batch, np.int32(0), *inputs)
    compiled = traced.lower().compile({"xla_dump_to": str(dump), **options})
    return compiled, traced, cfg, carry, batch, inputs


def timed(compiled, carry, batch, inputs, least: float = 1.5) -> tuple[float, tuple]:
    """(seconds a generation, the carry after them): one untimed, then back to back for at least
    `least` seconds and 3 generations, the carry threaded through as training does (its arrays
    donated: the carry given is spent)."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    carry = jax.block_until_ready(compiled(*carry, batch, np.int32(0), *inputs))[:3]
    count, tick = 0, time.time()
    while count < 3 or time.time() - tick < least:
        carry = compiled(*carry, batch, np.int32(count + 1), *inputs)[:3]
        count += 1
        if count % 4 == 0:
            jax.block_until_ready(carry)  # a sync point: the clock reads finished generations
    jax.block_until_ready(carry)
    return (time.time() - tick) / count, carry


def modeled_times(hlo: str, pallas_costs: dict, launched=None) -> dict[str, float]:
    """{kernel: modeled us a generation} of a compiled program (bench.py's cost model for an H100,
    its launches as `launched` says), by the names a trace gives: the product kernel's name (its
    calls summed), else the HLO's; the graphs' own launches under GRAPH_LAUNCHES. The values sum
    to the model's time of the whole generation."""
    run, bench = run_module(), bench_module()
    roofline, modeled = bench.ROOFLINES["h100"], {}
    kernels_only = launched._replace(graphs=0) if launched else None
    for k in bench.hlo.gpu_kernels(hlo, pallas_costs):
        seconds = bench.hlo.modeled_seconds([k], roofline, kernels_only)
        name = run.kernel.int8_product.__name__ if k.kind == "pallas" else k.name.replace(".", "_")
        modeled[name] = modeled.get(name, 0.0) + seconds * 1e6
    if launched and launched.graphs:
        modeled[GRAPH_LAUNCHES] = launched.graphs * roofline.launch * 1e6
    return modeled


def kernel_times(trace: Path) -> dict[str, float]:
    """{kernel: microseconds} summed over a Perfetto trace's device events (JAX's profiler): the
    complete events of every process named /device:..., by name (the product kernel's compiled
    variants, NAME__1, NAME__2, ..., under NAME)."""
    events = json.load(gzip.open(trace))
    events = events["traceEvents"] if isinstance(events, dict) else events
    devices = {
        e["pid"]
        for e in events
        if e.get("name") == "process_name" and e["args"]["name"].startswith("/device:")
    }
    product, totals = run_module().kernel.int8_product.__name__, {}
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in devices:
            name = re.sub(r"__\d+$", "", e["name"]) if e["name"].startswith(product) else e["name"]
            totals[name] = totals.get(name, 0.0) + float(e.get("dur", 0.0))
    return totals


def profile_generation(compiled, carry, batch, inputs, out: Path) -> dict[str, float]:
    """One generation of a compiled step traced by JAX's profiler, after one untraced:
    {kernel: measured us}. The carry given is spent."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    carry = jax.block_until_ready(compiled(*carry, batch, np.int32(0), *inputs))[:3]
    folder = out / f"trace-{len(list(out.glob('trace-*')))}"
    with jax.profiler.trace(str(folder), create_perfetto_trace=True):
        jax.block_until_ready(compiled(*carry, batch, np.int32(1), *inputs))
    (trace,) = folder.glob("**/perfetto_trace.json.gz")
    return kernel_times(trace)


def compare_kernels(
    measured: dict[str, float], modeled: dict[str, float], top: int = 12
) -> list[str]:
    """The longest kernels measured, each beside its modeled time (names as XLA gives them)."""
    lines = [f"{'kernel':44} {'measured us':>12} {'modeled us':>11}"]
    for name, us in sorted(measured.items(), key=lambda item: -item[1])[:top]:
        model = next((v for k, v in modeled.items() if name.startswith(k)), float("nan"))
        lines.append(f"{name[:44]:44} {us:12,.1f} {model:11,.1f}")
    total_model = sum(modeled.values())
    lines.append(f"{'all kernels':44} {sum(measured.values()):12,.1f} {total_model:11,.1f}")
    return lines


def step_variants(
    config: Configuration, out: Path, clock: Clock, least: float, variants: dict = VARIANTS
) -> list[str]:
    """(c) for one configuration: a row a variant (compile seconds, measured ms a generation and
    tokens/s, modeled ms, CUDA graphs launched a generation, kernels launched on their own), then
    the profiled generation's kernels beside the model."""
    bench = bench_module()
    roofline = bench.ROOFLINES["h100"]
    lines = [
        f"== (c) {config.name}: the generation step compiled {len(variants)} ways",
        f"{'variant':36} {'compile s':>9} {'ms/gen':>9} {'tokens/s':>13} {'modeled ms':>10} "
        f"{'graphs':>7} {'alone':>7}",
    ]
    print(*lines, sep="\n", flush=True)
    profiled = []
    for name, (kernels, changes, options) in variants.items():
        if clock.left() < 20:
            lines.append(f"{name:36} skipped: {clock.left():.0f} s of the budget left")
            print(lines[-1], flush=True)
            continue
        dump = Path(tempfile.mkdtemp(prefix="dump-", dir=out))
        flags = [*config.flags, "--kernels", kernels]
        try:
            tick = time.time()
            compiled, traced, cfg, carry, batch, inputs = compiled_step(
                flags, options, dump, changes
            )
            compile_seconds = time.time() - tick
            seconds, carry = timed(compiled, carry, batch, inputs, least)
        except Exception as error:  # a variant that fails is a finding: its line says how
            lines.append(f"{name:36} FAILED: {type(error).__name__}: {str(error)[:200]}")
            print(lines[-1], flush=True)
            continue
        text = compiled.as_text()
        launched = bench.dumped_launches(dump, text)
        costs = bench.pallas_costs(traced.jaxpr)
        kernels_found = bench.hlo.gpu_kernels(text, costs)
        modeled = bench.hlo.modeled_seconds(kernels_found, roofline, launched)
        figures = bench.describe_program(kernels_found, cfg, 1, launched)
        tokens = cfg.population * cfg.tokens * cfg.replicas
        graphs = "?" if figures["graphs"] is None else f"{figures['graphs']:,}"
        lines.append(
            f"{name:36} {compile_seconds:9.1f} {seconds * 1e3:9.2f} {tokens / seconds:13,.0f} "
            f"{modeled * 1e3:10.2f} {graphs:>7} {figures['alone']:7,}"
        )
        print(lines[-1], flush=True)
        if name == PROFILED and clock.left() > 20:
            measured = profile_generation(compiled, carry, batch, inputs, out)
            profiled = [
                f"-- {name}: one generation, kernel by kernel",
                *compare_kernels(measured, modeled_times(text, costs, launched)),
            ]
    print(*profiled, sep="\n", flush=True)
    return lines + profiled


def product_candidates(config: Configuration, clock: Clock, least: float) -> list[str]:
    """(p) for one configuration: a row for each of --kernels auto's candidates (ms a probe, its
    int8 MACs, T MAC/s, share of the H100's dense int8 peak), then --kernels auto's own line and
    how long it took to choose."""
    import jax  # noqa: PLC0415

    from egg import autotune, hlo  # noqa: PLC0415

    run, bench = run_module(), bench_module()
    peak = bench.ROOFLINES["h100"].int8_macs
    args, _, cfg = run.start_devices(run.parse_args([*config.flags, "--kernels", "pallas"]))
    device, replicas = jax.local_devices()[0], run.replicas_of(args)
    probe = run.product_probe(cfg)
    inputs = run.probe_inputs(probe, replicas, device)
    lines = [
        f"== (p) {config.name}: --kernels auto's candidates, each timed on a probe of "
        f"{probe.population:,} members x {probe.tokens} bytes",
        f"{'candidate':36} {'ms':>9} {'int8 MACs':>15} {'T MAC/s':>8} {'of peak':>8}",
    ]
    print(*lines, sep="\n", flush=True)
    for name in run.PRODUCT_CANDIDATES:
        if clock.left() < 20:
            lines.append(f"{name:36} skipped: {clock.left():.0f} s of the budget left")
            print(lines[-1], flush=True)
            continue
        try:
            traced = run.make_probe(run.as_candidate(probe, name, device.platform)).trace(*inputs)
            compiled = traced.lower().compile()
            found = hlo.gpu_kernels(compiled.as_text(), bench.pallas_costs(traced.jaxpr))
            macs = sum(k.runs * k.macs for k in found)

            def call(compiled=compiled):
                return jax.block_until_ready(compiled(*inputs))

            seconds = autotune.seconds_a_call(call, time.perf_counter, least)
        except Exception as error:  # a candidate that fails is a finding: its line says how
            lines.append(f"{name:36} FAILED: {type(error).__name__}: {str(error)[:200]}")
            print(lines[-1], flush=True)
            continue
        rate = macs / seconds
        lines.append(
            f"{name:36} {seconds * 1e3:9.2f} {macs:15,} {rate / 1e12:8.1f} {rate / peak:8.1%}"
        )
        print(lines[-1], flush=True)
    if clock.left() >= 20:
        tick, said = time.time(), []
        run.fastest_products(cfg, device, replicas, None, log=said.append)
        lines += [f"--kernels auto: {line}" for line in said]
        lines.append(f"--kernels auto chose in {time.time() - tick:.1f} s")
        print(*lines[-len(said) - 1 :], sep="\n", flush=True)
    return lines


def models_steps(
    config: Configuration, out: Path, clock: Clock, least: float, models=None
) -> list[str]:
    """(m) each model of run.py's MODELS (or those named) at this configuration: its generation
    step with the product kernel and with XLA's products, as (c) times them (the kernel's profiled
    kernel by kernel)."""
    names = models or list(run_module().MODELS)
    chosen = {name: VARIANTS[name] for name in (PROFILED, "XLA's products, graphs")}
    return [
        line
        for name in names
        for line in step_variants(
            Configuration(
                f"{config.name}, --model {name}",
                (*config.flags, "--model", name),
                config.generations,
                config.side_seconds,
            ),
            out,
            clock,
            least,
            chosen,
        )
    ]


# ------------------------------------------------------------------------------------------------
# (t): the product kernel's tiles, each of a configuration's products timed with every tile.


def product_calls(flags: list[str]):
    """(cfg, {operand shapes: calls a generation}) of the product kernel's calls in run.py's
    generation step for these flags, read as the step is traced (each call traced once a token:
    a generation makes it once for each of its tokens), a call one replica's operands."""
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    run = run_module()
    args, mesh, cfg = run.start_devices(run.parse_args([*flags, "--kernels", "pallas"]))
    replicas = run.replicas_of(args)
    carry = run.on_mesh(*run.init_run(cfg, replicas), mesh)
    batch = np.zeros((cfg.population // cfg.group_size, cfg.tokens + 1), np.uint8)
    inputs = run.replica_inputs(cfg, replicas, 0)
    calls, real = {}, run.kernel.product

    def recording(*operands, **options):
        key = tuple(None if o is None else (tuple(o.shape), str(o.dtype)) for o in operands)
        calls[key] = calls.get(key, 0) + cfg.tokens
        return real(*operands, **options)

    jax.clear_caches()
    run.kernel.product = recording  # run.py calls it through the module, as this reads it
    try:
        run.make_generation_step(cfg, mesh).trace(*carry, batch, np.int32(0), *inputs)
    finally:
        run.kernel.product = real
    return cfg, calls


def seconds_a_call(function, operands, least: float) -> float:
    """A jitted function's seconds a call on these operands: one untimed, then back to back for at
    least `least` seconds and 3 calls."""
    import jax  # noqa: PLC0415

    jax.block_until_ready(function(*operands))
    count, tick = 0, time.time()
    while count < 3 or time.time() - tick < least:
        out = function(*operands)
        count += 1
    jax.block_until_ready(out)  # a sync point: the clock reads finished calls
    return (time.time() - tick) / count


def tile_text(tile: tuple[int, int, int]) -> str:
    """(rows, columns, warps) as the sweep's table writes it: 64x128, 4."""
    return f"{tile[0]}x{tile[1]}, {tile[2]}"


def tile_sweep(config: Configuration, clock: Clock, least: float, warps=(4, 8)) -> list[str]:
    """(t) for one configuration: each distinct product of its generation step timed with every
    tile the kernel may take (kernel.tile_options), in warps[0] warps and, for tiles of 64 pairs
    (Hopper's wgmma: docs/gpu.org), in the others too; beside the tile rule's choice, the same
    kernel at the rule's tile without its noise, gain and residual ("bare": what the integer work
    around the product costs) and XLA's int8 GEMM of the same shapes alone (x W^T to int32); then
    the generation's products at the rule's tiles and at the best measured. warps[0] is the
    kernel's own (kernel.WARPS)."""
    import itertools  # noqa: PLC0415

    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    run = run_module()
    from egg import kernel  # noqa: PLC0415

    cfg, calls = product_calls(list(config.flags))
    interpret = cfg.kernels == "interpret"
    rng = np.random.default_rng(0)
    lines = [
        f"== (t) {config.name}: the product kernel's tiles (rows of pairs x columns, warps)",
        f"{'x, w (Q Sn; G L m n), noise gain residual':52} {'calls':>7} {'rule':>15} "
        f"{'us':>8} {'best':>15} {'us':>8} {'bare us':>8} {'XLA GEMM us':>11}",
    ]
    print(*lines, sep="\n", flush=True)
    rule_total = best_total = 0.0
    for key, count in calls.items():
        x_shape, w_shape = key[0][0], key[1][0]
        (pairs, width), (groups, _, m, n) = x_shape, w_shape
        distinct = key[2][0][2] if key[2] else pairs
        operands = []
        for i, spec in enumerate(key):
            if spec is None:
                operands.append(None)
            elif spec[1] == "int8":
                operands.append(jnp.asarray(rng.integers(-127, 128, spec[0]).astype(np.int8)))
            else:  # the replica's sigma shift (4), the layer (5)
                operands.append(jnp.full(spec[0], 3 if i == 4 else 0, jnp.int32))
        rule = kernel.tiles(cfg.replicas, groups, pairs, distinct, m, n, width // n)
        times = {}
        for (rows, columns), w in itertools.product(kernel.tile_options(distinct, m), warps):
            if clock.left() < 10:
                break
            if w != warps[0] and rows < 64:  # more warps only where a tile is a wgmma's 64 rows
                continue
            chosen = kernel.Options(warps=w)
            options = dict(interpret=interpret, arithmetic=run.ARITHMETIC, options=chosen)
            tile = (rows, columns, rule[2])
            function = jax.jit(partial(kernel.product, tile=tile, **options))
            times[(rows, columns, w)] = seconds_a_call(function, operands, least)
        kinds = " ".join(str(int(key[i] is not None)) for i in (2, 6, 7))
        shapes = f"{'x'.join(map(str, x_shape))}; {'x'.join(map(str, w_shape))} {kinds}"
        rule_key = (rule[0], rule[1], kernel.WARPS)
        if rule_key not in times:
            lines.append(f"{shapes:52} {count:7,} skipped: {clock.left():.0f} s of the budget left")
            print(lines[-1], flush=True)
            continue
        options = dict(interpret=interpret, arithmetic=run.ARITHMETIC)
        bare = jax.jit(partial(kernel.product, tile=rule, **options))
        plain = seconds_a_call(
            bare, [*operands[:2], None, None, None, operands[5], None, None], least
        )
        x2, w2 = operands[0].reshape(-1, n), operands[1][0, 0]
        gemm = jax.jit(lambda x, w: jnp.einsum("rn,mn->rm", x, w, preferred_element_type=jnp.int32))
        xla = seconds_a_call(gemm, (x2, w2), least) * groups
        best = min(times, key=times.get)
        rule_total += count * times[rule_key]
        best_total += count * times[best]
        lines.append(
            f"{shapes:52} {count:7,} {tile_text(rule_key):>15} {times[rule_key] * 1e6:8.1f} "
            f"{tile_text(best):>15} {times[best] * 1e6:8.1f} {plain * 1e6:8.1f} {xla * 1e6:11.1f}"
        )
        print(lines[-1], flush=True)
    lines.append(
        f"a generation's products: {rule_total * 1e3:.2f} ms at the rule's tiles, "
        f"{best_total * 1e3:.2f} ms at the best measured"
    )
    print(lines[-1], flush=True)
    return lines


# ------------------------------------------------------------------------------------------------
# (d) and (e): the same bits as the CPU's, and what else runs on the device.


def same_generations(args) -> int:
    """The generations of each side of (d) and (e)'s comparisons."""
    return 4 if args.quick else SAME_GENERATIONS


def same_training(
    platform: str, out: Path, flags=(), kernels=True, generations=SAME_GENERATIONS
) -> list[str]:
    """The digests of the same generations on `platform` (its default products, then XLA's,
    unless not `kernels`) and on the CPU, with these flags besides SMALL_RUN's."""
    digests = []
    sides = [("device", platform, []), ("device-xla", platform, ["--kernels", "xla"])]
    sides = sides if kernels else sides[:1]
    for side, where, engine in [*sides, ("reference", "cpu", [])]:
        runs = out / f"runs-{side}{'-'.join(['', *flags])}"
        split = ["--cpu_devices", "1"] if where == "cpu" else []
        folders = ["--runs_dir", str(runs), "--dir_path", str(out / "cache")]
        length = ["--num_epochs", str(generations)]
        done = run_py(*SMALL_RUN, *length, *flags, *split, *engine, *folders, platform=where)
        if done.returncode:
            raise SystemExit(f"training on {where} failed:\n{done.stderr[-3000:]}")
        (folder,) = runs.glob(f"*/checkpoints/gen-{generations:08d}")
        digests.append(run_module().checkpoints.checkpoint_digest(folder))
    return digests


def same_bits(what: str, digests: list[str]) -> str:
    verdict = "identical" if len(set(digests)) == 1 else "DIFFERENT: a bug"
    return f"{what}: {' / '.join(digests)}, {verdict}"


# n, m, pairs
KERNEL_SHAPES = (
    (32, 16, 16),
    (64, 64, 64),
    (64, 256, 16),
    (256, 64, 16),
    (1024, 256, 16),
)


def kernel_against_interpreter(platform: str, kernel=None, shapes=KERNEL_SHAPES) -> list[str]:
    """run.py's product kernel compiled for `platform` against the same kernel in Pallas's
    interpreter on the same device (on the CPU both interpret), on random int8 operands: every
    shape (inputs n, outputs m, pairs) with and without noise, gain and residual
    (a residual where m = n). A line per case that differs, then one line for all of them.
    `kernel`: egg/kernel.py's, with run.py's arithmetic, unless given (the tests give a faulty
    one)."""
    import itertools  # noqa: PLC0415

    os.environ["JAX_PLATFORMS"] = platform
    import jax  # noqa: PLC0415 (after the platform is set)
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    run = run_module()
    from egg import kernel as products  # noqa: PLC0415

    kernel = kernel or partial(products.product, arithmetic=run.ARITHMETIC)
    rng = np.random.default_rng(0)

    def r8(*shape, low=-127, high=128):
        return jnp.asarray(rng.integers(low, high, shape).astype(np.int8))

    lines, cases = [], 0
    for (n, m, pairs), noisy, gained, added in itertools.product(shapes, *[(False, True)] * 3):
        if added and m != n:
            continue
        sides = 2 if noisy else 1
        x, w = r8(pairs, sides * n), r8(1, 2, m, n)
        a, b = (r8(1, 2, pairs, k, low=-8, high=9) for k in (m, n)) if noisy else (None, None)
        gain = r8(2, pairs if noisy else 1, sides * n, low=1) if gained else None  # a row each
        residual = r8(pairs, sides * m) if added else None
        operands = (x, w, a, b, jnp.int32(2), jnp.int32(1), gain, residual)
        outs = [
            np.asarray(jax.jit(partial(kernel, interpret=interpret))(*operands)).astype(int)
            for interpret in (True, platform == "cpu")
        ]
        differ, cases = np.count_nonzero(outs[0] != outs[1]), cases + 1
        if differ:
            worst = int(np.abs(outs[0] - outs[1]).max())
            what = (
                f"n {n}, m {m}, {pairs} pairs, noise {noisy:d}, gain {gained:d}, residual {added:d}"
            )
            lines.append(f"  {what}: {differ} of {outs[0].size} outputs differ, by up to {worst}")
    verdict = f"{len(lines)} DIFFER" if lines else "all equal"
    return [
        *lines,
        f"the product kernel on {platform} against its interpreter: {cases} cases, {verdict}",
    ]


# (pairs, outputs m, depth, members) of an s8 x s8 -> s32 product as XLA holds them in a small
# model's program: --rank 0's noise term (a noise matrix per pair times the pair's two members'
# inputs) and the shared product (one batch), 16 deep (a 16D model), 32 and 64 deep
DOT_SHAPES = tuple(
    (pairs, m, depth, members)
    for pairs in (1, 4)
    for m in (16, 32, 256)
    for depth in (16, 32, 64)
    for members in (1, 2, 8)
)


def xla_dots_against_numpy(platform: str, product=None, shapes=DOT_SHAPES) -> list[str]:
    """XLA's int8 products on `platform` against numpy's exact ones, on random operands: for each
    shape a batched s8 x s8 -> s32 dot whose second operand the program itself clips from int32 to
    +-127 and converts to int8, as run.py makes its states' (XLA fuses both into the product's
    kernel; on a GPU its own Triton GEMMs). A line per shape that differs, then one line for all.
    `product`: the jitted function under test unless given (the tests give a faulty one)."""
    os.environ["JAX_PLATFORMS"] = platform
    import jax  # noqa: PLC0415 (after the platform is set)
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    def xla_product(w, x):  # w (pairs, m, depth) int8, x (pairs, depth, members) int32
        states = jnp.clip(x, -127, 127).astype(jnp.int8)
        return jnp.einsum("pmk,pkn->pmn", w, states, preferred_element_type=jnp.int32)

    product = product or jax.jit(xla_product)
    rng = np.random.default_rng(0)
    lines = []
    for pairs, m, depth, members in shapes:
        w = rng.integers(-127, 128, (pairs, m, depth)).astype(np.int8)
        # some beyond the clip
        x = rng.integers(-300, 301, (pairs, depth, members)).astype(np.int32)
        want = np.einsum("pmk,pkn->pmn", w.astype(np.int64), np.clip(x, -127, 127).astype(np.int64))
        got = np.asarray(product(jnp.asarray(w), jnp.asarray(x))).astype(np.int64)
        if differ := np.count_nonzero(got != want):
            worst = int(np.abs(got - want).max())
            what = f"{pairs} x ({m}, {depth}) x ({depth}, {members})"
            lines.append(f"  {what}: {differ} of {want.size} outputs differ, by up to {worst}")
    verdict = f"{len(lines)} DIFFER" if lines else "all equal"
    return [
        *lines,
        f"XLA's int8 products on {platform} against numpy: {len(shapes)} shapes, {verdict}",
    ]


def the_rest(args: Args, out: Path, clock: Clock) -> list[str]:
    """(e), each line printed as it is found: the kernel against its interpreter, XLA's products
    against numpy's, the same low-rank training on the device and the CPU, then the tests on the
    device in what the budget has left (stopped there, with a line)."""
    lines = kernel_against_interpreter(
        args.platform, shapes=KERNEL_SHAPES[:1] if args.quick else KERNEL_SHAPES
    )
    lines += xla_dots_against_numpy(
        args.platform, shapes=DOT_SHAPES[:4] if args.quick else DOT_SHAPES
    )
    print(*lines, sep="\n", flush=True)
    generations = same_generations(args)
    where = f"{generations} generations on {args.platform} (its kernels; XLA's products), the CPU"
    lines.append(same_bits(where, same_training(args.platform, out, generations=generations)))
    print(lines[-1], flush=True)
    if not args.quick:
        env = {**os.environ, "JAX_PLATFORMS": args.platform}
        command = [sys.executable, "-m", "pytest", "-q", "-rf", "--maxfail=10", *TESTS]
        try:
            done = subprocess.run(
                [*command, "-k", "not benchmark"], cwd=ROOT, env=env, timeout=clock.left()
            )
            verdict = "passed" if done.returncode == 0 else "FAILED"
        except subprocess.TimeoutExpired:
            verdict = f"stopped unfinished at the budget's end ({args.budget:.0f} s)"
        lines.append(f"tests on {args.platform}: {verdict}")
        print(lines[-1], flush=True)
    return lines


def versions() -> str:
    """The device, JAX and the code this call measures."""
    import jax  # noqa: PLC0415

    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    code = commit.stdout.strip() if commit.returncode == 0 else "unknown (no git here)"
    device = jax.devices()[0]
    return (
        f"device: {getattr(device, 'device_kind', device.platform)}; JAX {jax.__version__}; "
        f"code {code}"
    )


def main(args: Args) -> int:
    os.environ["JAX_PLATFORMS"] = args.platform  # before run.py brings JAX in
    clock = Clock(args.budget)
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"error: --parts {' '.join(sorted(unknown))}: parts are {PARTS}")
    tables = [versions()]
    print(tables[0], flush=True)
    configurations = QUICK_CONFIGURATIONS if args.quick else CONFIGURATIONS
    least = 0.2 if args.quick else 1.5
    generations = same_generations(args)

    def full_rank() -> list[str]:
        line = f"(d) skipped: {clock.left():.0f} s of the budget left"
        if clock.left() >= 30:
            full = ["--rank", "0"]
            digests = same_training(args.platform, out, full, False, generations)
            where = (
                f"--rank 0 (full rank): {generations} generations on {args.platform} and the CPU"
            )
            line = same_bits(f"(d) {where}", digests)
        print(line, flush=True)
        return [line]

    def rest() -> list[str]:
        if clock.left() >= 60:
            return the_rest(args, out, clock)
        line = f"(e) skipped: {clock.left():.0f} s of the budget left"
        print(line, flush=True)
        return [line]

    parts = {
        "a": lambda: beside_nano_egg(args, out, clock),
        "c": lambda: [line for c in configurations for line in step_variants(c, out, clock, least)],
        "m": lambda: models_steps(configurations[0], out, clock, least),
        "p": lambda: [
            line
            for c in (configurations if args.quick else PROBED)
            for line in product_candidates(c, clock, least)
        ],
        "d": full_rank,
        "e": rest,
        # the two larger configurations: each takes minutes on a GPU (a compile a tile)
        "t": lambda: [
            line for c in configurations[:2] for line in tile_sweep(c, clock, least / 10)
        ],
    }
    for part in args.parts:  # in the order given, each printing its lines as it finds them
        tables += parts[part]()
    print("\n".join([*tables, f"(gpu_check: {time.time() - clock.started:.0f} s, logs in {out})"]))
    return 0 if not [line for line in tables if "FAILED" in line or "DIFFER" in line] else 1


if __name__ == "__main__":
    import tyro

    sys.exit(main(tyro.cli(Args, use_underscores=True)))
