"""What a machine with an NVIDIA GPU can tell that no other can, in one run of under 10 minutes:

1. the tests whose arithmetic runs on the device (the forward pass against the integer reference,
   the step, the update, the noise), on the GPU; the product kernel as compiled against the same
   kernel in Pallas's interpreter, on the GPU too (the tests can only interpret it); and XLA's own
   int8 products of a small model's shapes against numpy's exact ones;
2. the same small training run on the GPU (its products in run.py's Pallas kernel, then left to XLA
   with --kernels xla) and on the CPU: their checkpoints must be bit-identical (all arithmetic is
   integer; any difference is a bug);
3. bench.py at 64D-2L population 4096 and 256D-6L populations 1024 and 32768, each beside what
   bench.py --target h100 models for it;
4. one generation of each of those configurations profiled kernel by kernel (JAX's profiler),
   beside the cost model's time for the same kernels of the same compiled program;
and prints each table as it is measured, then all of them again, last.

    python scripts/gpu_check.py                       # on the GPU machine, from the repository root
    python scripts/gpu_check.py --platform cpu --quick   # its CPU part (what the tests run)

A GPU image may lack run.py's command-line packages: carry them as wheels, e.g.
`pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl tyro
docstring-parser shtab typeguard` here, installed there with `pip install --no-index .whl/*`.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = [
    "tests/test_model_reference.py",
    "tests/test_step.py",
    "tests/test_update.py",
    "tests/test_noise.py",
]
SMALL_RUN = (
    "--data tests/data/words.txt --n_embd 16 --n_layer 2 --parallel_generations_per_gpu 64 "
    "--group_size 4 --tokens_per_update 16 --validation_batch_size 8 --validation_tokens 32 "
    "--num_epochs 20 --save_every 20"
).split()
BENCHMARKS = {  # name: (flags, timed generations)
    "64D-2L, population 4096": (
        "--n_embd 64 --n_layer 2 --parallel_generations_per_gpu 4096".split(),
        10,
    ),
    "256D-6L, population 1024": ("--parallel_generations_per_gpu 1024".split(), 5),
    "256D-6L, population 32768": (
        "--parallel_generations_per_gpu 32768 --group_size 512".split(),
        3,
    ),
}
QUICK_BENCHMARKS = {
    "16D-1L, population 64": (
        "--n_embd 16 --n_layer 1 --parallel_generations_per_gpu 64".split(),
        2,
    )
}


@dataclass(frozen=True)
class Args:
    platform: str = "cuda"
    """the platform under test (cpu: this script's own check, on any machine)"""
    quick: bool = False
    """a tiny benchmark and profile instead of the three configurations (for the tests)"""
    skip_tests: bool = False
    """leave out step 1"""
    out: str = ""
    """folder for the logs and traces (default: a new temporary folder)"""


def run_module():
    """run.py, imported (importing it does nothing)."""
    sys.path.insert(0, str(ROOT))
    import run  # noqa: PLC0415

    return run


def bench_module():
    """bench.py, imported (it imports run.py)."""
    sys.path.insert(0, str(ROOT))
    import bench  # noqa: PLC0415

    return bench


def run_py(*flags: str, platform: str, script: str = "run.py") -> subprocess.CompletedProcess:
    """python run.py (or bench.py) FLAGS on `platform`, from the repository root."""
    environment = {**os.environ, "JAX_PLATFORMS": platform}
    command = [sys.executable, str(ROOT / script), "--platform", platform, *flags]
    return subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True)


def same_training(platform: str, out: Path) -> list[str]:
    """The digests of the same 20 generations on `platform` (its default products, then XLA's) and
    on the CPU."""
    digests = []
    sides = (
        ("device", platform, []),
        ("device-xla", platform, ["--kernels", "xla"]),
        ("reference", "cpu", []),
    )
    for side, where, flags in sides:
        runs = out / f"runs-{side}"
        split = ["--cpu_devices", "1"] if where == "cpu" else []
        done = run_py(
            *SMALL_RUN,
            *split,
            *flags,
            "--runs_dir",
            str(runs),
            "--dir_path",
            str(out / "cache"),
            platform=where,
        )
        if done.returncode:
            raise SystemExit(f"training on {where} failed:\n{done.stderr[-3000:]}")
        (folder,) = runs.glob("*/checkpoints/gen-00000020")
        digests.append(run_module().checkpoints.checkpoint_digest(folder))
    return digests


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
        x, w = r8(2, 1, pairs, sides * n), r8(1, 2, 1, m, n)
        a, b = (r8(1, 2, 1, pairs, k, low=-8, high=9) for k in (m, n)) if noisy else (None, None)
        gain = r8(2, 1, pairs if noisy else 1, sides * n, low=1) if gained else None  # a row each
        residual = r8(1, pairs, sides * m) if added else None
        operands = (x, w, a, b, jnp.asarray([2], jnp.int32), jnp.int32(1), gain, residual)
        outs = [
            np.asarray(
                jax.jit(partial(kernel, x_layered=True, interpret=interpret))(*operands)
            ).astype(int)
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


def benchmark_lines(
    flags: list[str], generations: int, platform: str
) -> tuple[list[str], list[str]]:
    """(measured table lines, modeled report lines) of one configuration; a run that fails gives one
    FAILED line with its last error line instead (the other configurations still run)."""
    measured = run_py(
        *flags, "--num_epochs", str(generations), platform=platform, script="bench.py"
    )
    modeled = run_py("--target", "h100", *flags, platform="cpu", script="bench.py")
    for done in (measured, modeled):
        if done.returncode:
            print(done.stderr[-3000:], file=sys.stderr, flush=True)
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return [f"FAILED: {shlex.join(done.args[2:])}: {last}"], []
    keep = ("device:", "a training", "b fitness", "c inference", "training / inference")
    table = [line for line in measured.stdout.splitlines() if line.startswith(keep)]
    report = [
        line
        for line in modeled.stdout.splitlines()
        if line.startswith(("kernels per", "bytes per", "modeled"))
    ]
    return table, report


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


def profile_generation(
    flags: list[str], platform: str, out: Path
) -> tuple[dict[str, float], dict[str, float]]:
    """One training generation profiled: ({kernel: measured us}, {kernel: modeled us}), the modeled
    times from the cost model of the same compiled program's kernels (bench.py --target's)."""
    os.environ["JAX_PLATFORMS"] = platform
    import jax  # noqa: PLC0415 (after the platform is set)
    import numpy as np  # noqa: PLC0415

    run, bench = run_module(), bench_module()
    args, mesh, cfg = run.start_devices(run.parse_args(flags))
    replicas = run.replicas_of(args)
    carry = run.on_mesh(*run.init_run(cfg, replicas), mesh)
    batch = np.zeros((cfg.population // cfg.group_size, cfg.tokens + 1), np.uint8)
    batch = run.cluster.global_array(batch, mesh, run.REPLICATED)
    inputs = run.replica_inputs(cfg, replicas, 0)
    traced = run.make_generation_step(cfg, mesh).trace(*carry, batch, np.int32(0), *inputs)
    step = traced.lower().compile()
    carry = jax.block_until_ready(step(*carry, batch, np.int32(0), *inputs))[:3]
    folder = out / f"trace-{len(list(out.glob('trace-*')))}"
    with jax.profiler.trace(str(folder), create_perfetto_trace=True):
        jax.block_until_ready(step(*carry, batch, np.int32(1), *inputs))
    (trace,) = folder.glob("**/perfetto_trace.json.gz")
    return kernel_times(trace), modeled_times(step.as_text(), bench.pallas_costs(traced.jaxpr))


def modeled_times(hlo: str, pallas_costs: dict) -> dict[str, float]:
    """{kernel: modeled us a generation} of a compiled program (bench.py's cost model for an H100),
    by the names a trace gives: the product kernel's name (its calls summed), else the HLO's."""
    run, bench = run_module(), bench_module()
    roofline, modeled = bench.ROOFLINES["h100"], {}
    for k in bench.hlo.gpu_kernels(hlo, pallas_costs):
        seconds = k.runs * (
            max(k.bytes / roofline.hbm, k.macs / roofline.int8_macs) + roofline.launch
        )
        name = run.kernel.int8_product.__name__ if k.kind == "pallas" else k.name.replace(".", "_")
        modeled[name] = modeled.get(name, 0.0) + seconds * 1e6
    return modeled


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


def main(args: Args) -> int:
    os.environ["JAX_PLATFORMS"] = args.platform  # before run.py brings JAX in
    started = time.time()
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    results = []
    if not args.skip_tests:
        env = {**os.environ, "JAX_PLATFORMS": args.platform}
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "--maxfail=10", *TESTS, "-k", "not benchmark"],
            cwd=ROOT,
            env=env,
        )
        results.append(
            f"tests on {args.platform}: {'passed' if done.returncode == 0 else 'FAILED'}"
        )
    results += kernel_against_interpreter(
        args.platform, shapes=KERNEL_SHAPES[:1] if args.quick else KERNEL_SHAPES
    )
    results += xla_dots_against_numpy(
        args.platform, shapes=DOT_SHAPES[:4] if args.quick else DOT_SHAPES
    )
    digests = same_training(args.platform, out)
    same = len(set(digests)) == 1
    verdict = "identical" if same else "DIFFERENT: a bug"
    where = f"20 generations on {args.platform} (its kernels; XLA's products) and on the CPU"
    results.append(f"{where}: {' / '.join(digests)}, {verdict}")
    print(*results, sep="\n", flush=True)
    tables = []
    for name, (flags, generations) in (QUICK_BENCHMARKS if args.quick else BENCHMARKS).items():
        table, report = benchmark_lines(flags, generations, args.platform)
        measured, modeled = profile_generation(flags, args.platform, out)
        section = [
            f"== {name}: bench.py (measured)",
            *table,
            "-- bench.py --target h100 (modeled)",
            *report,
        ]
        section += [
            "-- one training generation, kernel by kernel",
            *compare_kernels(measured, modeled),
        ]
        print(*section, sep="\n", flush=True)  # as it comes: a run cut short keeps what it measured
        tables += section
    print(
        "\n".join([*tables, *results, f"(gpu_check: {time.time() - started:.0f} s, logs in {out})"])
    )
    return 0 if same and all("FAILED" not in line for line in results + tables) else 1


if __name__ == "__main__":
    import tyro

    sys.exit(main(tyro.cli(Args, use_underscores=True)))
