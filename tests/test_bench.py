"""bench.py: the benchmark's table of training, fitness, inference and full-rank ES; and the GPU
program, compiled here for an H100 without one (--target h100: XLA's whole GPU pipeline,
deviceless): integer only, every product an s8 x s8 -> s32 dot, its inputs donated, its temporaries
bounded, one all-gather of the scores a generation over 8 GPUs; and the kernel count, bytes and cost
model of the report against programs whose answer is known."""

import re
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CACHE, TINY
from jax.experimental.compilation_cache import compilation_cache

import bench
import run
from egg import cluster, flags, hlo, kernel
from egg.flags import flag_given

FLOAT_TYPES = ("f16", "bf16", "f32", "f64")
SMALL = ["--n_embd", "16", "--parallel_generations_per_gpu", "64", "--segments", "2"]
PRODUCTS_ALONE = "the kernel, its products alone"  # layer norms and x B by XLA before the kernel


def target_args(*given, **changes) -> bench.Args:
    """bench.py's Args of the tiny run (TINY), with more flags and changed fields."""
    return flags.replace(run.parse_args([*TINY, *given], bench.Args), **changes)


def compile_step(args, part="train", devices=1):
    mesh = bench.target_mesh("h100", devices)
    cfg = bench.target_config(args, mesh)
    step = bench.make_step(cfg, mesh, part)
    with bench.without_compilation_cache():
        return step.lower(*bench.abstract_inputs(args, cfg, mesh)).compile(), cfg, mesh


def dots(text: str) -> list[tuple[list, list]]:
    """(operand shapes, result shape) of every product in a compiled program: XLA's dots and its
    calls of cuBLAS (whose second result is its workspace)."""
    computations, _ = hlo.computations(text)
    found = []
    for body in computations.values():
        shapes = {x.name: x.shapes for x in body}
        found += [
            ([shapes[o][0] for o in x.operands], x.shapes[:1]) for x in body if hlo.is_product(x)
        ]
    return found


def integer_only(text: str) -> None:
    """No floating-point type; every product an s8 x s8 -> s32 dot of XLA's or the product kernel
    (whose own dots test_kernels.py checks in its jaxpr)."""
    assert not [t for t in FLOAT_TYPES if re.search(rf"\b{t}\[", text)]
    products = dots(text)
    assert products or hlo.TRITON in text
    assert all(
        [t for t, _ in operands] == ["s8", "s8"] and [t for t, _ in result] == ["s32"]
        for operands, result in products
    ), products


@pytest.mark.parametrize(
    "flags",
    [
        ["--algorithm", "upstream", "--model", "mingru", "--products", PRODUCTS_ALONE],
        ["--replicas", "2", "--replica_sigma_shift", "3", "5", "--model", "transformer"]
        + ["--head_width", "8"],
    ],
)
def test_the_h100_step_is_integer_only_with_donated_inputs_and_bounded_temporaries(flags):
    """Upstream's algorithm, replicas and the two other models (two at a time: each compile takes
    seconds), the first with the products of --kernels auto's candidate whose kernel computes
    products alone; the defaults' step: in the target report's test, which compiles it."""
    # 6 segments of 2 bytes: segments of one length compile one loop of bytes (8 bytes in 6
    # segments would be two loops, of 2 and of 1 byte, and twice the compile time)
    args = target_args(*SMALL, "--segments", "6", "--tokens_per_update", "12", *flags)
    compiled, cfg, _ = compile_step(args)
    assert cfg.kernel_options.sums_noise == (PRODUCTS_ALONE not in flags)
    integer_only_donated_and_bounded(compiled, args, cfg)


def integer_only_donated_and_bounded(compiled, args, cfg):
    text = compiled.as_text()
    integer_only(text)
    assert cfg.kernels == "pallas" and hlo.TRITON in text  # the products are the kernel's
    # parameters, update rule state and hidden states are donated: every one aliases an output
    carried = len(
        jax.tree.leaves(bench.abstract_inputs(args, cfg, bench.target_mesh("h100", 1))[:3])
    )
    aliased = re.search(r"input_output_alias=\{(.*?)\}, entry", text).group(1)
    assert sorted(int(i) for i in re.findall(r"\((\d+), \{\}, may-alias\)", aliased)) == list(
        range(carried)
    )
    # temporaries: one segment's noise at a time (built where it is used: 6 segments' at once would
    # be 16 times this noise), in words, entries and the layouts the kernels read, the members'
    # activations, int32, and their carried states (the transformer's keys and values, joined to
    # the window's and deepened to DOT_DEPTH), a few times over
    pieces = sum(np.prod(shape) for _, shape, _ in run.noise_pieces(cfg))
    noise = run.noise_pairs(cfg) // cfg.segments * cfg.replicas * pieces
    activations = cfg.population * cfg.replicas * cfg.n_layer * 4 * cfg.n_embd * 4
    states = cfg.population * cfg.replicas * np.prod(run.carried_state(cfg))
    temporaries = compiled.memory_analysis().temp_size_in_bytes
    print(
        f"temporaries {temporaries:,} B; a segment's noise {noise:,} B, "
        f"activations {activations:,} B, states {states:,} B"
    )
    assert temporaries <= 4 * noise + 4 * activations + 4 * states


@pytest.mark.parametrize("rank", ["0", "1"])
def test_h100_products_are_32_deep_and_full_ranks_go_to_cublas(rank):
    """Hopper's int8 dot is 32 deep, and 16-deep ones were wrong on an H200: a 16D model's products
    (the shared GEMM, --rank 0's noise matrices) and Z of 8 pairs are padded with zeros to 32.
    XLA's Triton GEMMs summed some of full rank's fused int8 products wrongly on an H200 and
    cuBLAS's gave the CPU's bits: --rank 0 compiles without them; rank 1, whose Triton GEMMs were
    right, keeps them (XLA's products here: the kernel takes none of rank 0's)."""
    flags = ("--n_embd", "16", "--parallel_generations_per_gpu", "16", "--segments", "1")
    compiled, _, _ = compile_step(target_args(*flags, "--rank", rank, "--kernels", "xla"))
    text = compiled.as_text()
    integer_only(text)
    found = []
    for body in hlo.computations(text)[0].values():
        shapes = {x.name: x.shapes for x in body}
        for x in (x for x in body if hlo.is_product(x)):  # at --rank 0 cuBLAS's (run.py)
            found.append(np.prod(hlo.product_depths(x, shapes[x.operands[0]][0])))
    assert found and min(found) >= run.DOT_DEPTH == 32, found
    triton_gemm = re.compile(r'"kind":"__triton\w*gemm\w*"')
    assert bool(triton_gemm.search(text)) == (rank == "1") and ("__cublas" in text) == (rank == "0")


@pytest.fixture(scope="module")
def eight_h100s() -> bench.Target:
    """The training step over 8 H100s of a 32D-1L model, 32 members on each, the sign shaping, 100
    bytes a member in 8 segments (of 13 and 12 bytes: two loops of bytes), compiled once for the
    tests that read it."""
    flags = [*TINY, "--n_embd", "32", "--n_layer", "1", "--target", "h100", "--target_devices", "8"]
    flags += ["--parallel_generations_per_gpu", "32", "--tokens_per_update", "100"]
    flags += ["--segments", "8", "--shaping", "sign"]
    return bench.compile_target(run.parse_args(flags, bench.Args), "train")


def one_gather_a_generation(compiled, cfg, fast: bool):
    """docs/design.org: one all-gather of an int8 score per pair and segment (half a byte per
    member and segment), with normalised scores also the two int32 sums of the mean |difference|."""
    traffic = hlo.collective_traffic(compiled.as_text())
    gathers = [size for op, size in traffic if op == "all-gather"]
    assert cfg.devices == 8 and gathers == [cfg.segments * cfg.population // 2], traffic
    others = [(op, size) for op, size in traffic if op != "all-gather"]
    assert {op for op, _ in others} <= {"all-reduce"} and sum(size for _, size in others) == 12 * (
        not fast
    )
    integer_only(compiled.as_text())


def test_over_8_h100s_the_one_gather_a_generation_is_every_pairs_int8_score(eight_h100s):
    one_gather_a_generation(eight_h100s.compiled, eight_h100s.cfg, fast=True)


def test_over_8_h100s_normalised_scores_add_the_two_sums_of_the_mean_difference():
    # one layer: its program compiles in less time, and its collectives are the same
    args = target_args(
        *SMALL, "--shaping", "normalised", "--parallel_generations_per_gpu", "16", n_layer=1
    )
    compiled, cfg, _ = compile_step(args, devices=8)
    one_gather_a_generation(compiled, cfg, fast=False)


def test_a_program_compiled_for_a_target_leaves_the_cache_to_the_programs_after_it():
    """JAX decides at a process's first compilation whether it uses its persistent cache: where that
    is a program compiled for an H100 without one (kept out of the cache), the CPU's programs
    compiled after it are cached all the same."""
    cache = Path(jax.config.jax_compilation_cache_dir)
    compilation_cache.reset_cache()  # as in a new process: the next compilation is its first
    sharding = jax.sharding.SingleDeviceSharding(bench.target_mesh("h100", 1).devices.flat[0])
    with bench.without_compilation_cache():
        x = jax.ShapeDtypeStruct((8,), jnp.int32, sharding=sharding)
        jax.jit(lambda x: x + 1).lower(x).compile()

    def left_to_the_cache(x):  # a program no other test compiles: its entry is its own
        return x * 3 + 11

    jax.jit(left_to_the_cache)(np.arange(7))
    assert list(cache.glob("jit_left_to_the_cache-*"))


def test_kernels_are_counted_through_loops_with_their_bytes_and_macs():
    """A scan of 5 steps around one int8 product (64 x 32 by 32 x 16) and an elementwise step: the
    product runs 5 times, reads both operands and writes its int32 result, and costs 64 x 32 x 16
    multiply-accumulates; the cost model charges each kernel its larger term plus a launch."""
    sharding = jax.sharding.SingleDeviceSharding(bench.target_mesh("h100", 1).devices.flat[0])

    def program(x, w):
        def step(h, _):
            product = jnp.dot(h, w, preferred_element_type=jnp.int32)
            return jnp.clip(product >> 3, -127, 127).astype(jnp.int8)[:, :32] + h[:, :32] * 0, None

        return jax.lax.scan(step, x, None, length=5)[0]

    x = jax.ShapeDtypeStruct((64, 32), jnp.int8, sharding=sharding)
    w = jax.ShapeDtypeStruct((32, 64), jnp.int8, sharding=sharding)
    with bench.without_compilation_cache():
        kernels = hlo.gpu_kernels(jax.jit(program).lower(x, w).compile().as_text())
    (gemm,) = [k for k in kernels if k.kind == "gemm"]
    assert (gemm.runs, gemm.macs) == (5, 64 * 32 * 64)
    assert gemm.bytes == 64 * 32 + 32 * 64 + 64 * 64 * 4
    assert gemm.shapes.endswith("-> s32[64,64]")
    roofline = hlo.Roofline("test", hbm=1e9, int8_macs=1e10, launch=1e-6)
    want = sum(k.runs * (max(k.bytes / 1e9, k.macs / 1e10) + 1e-6) for k in kernels)
    assert hlo.modeled_seconds(kernels, roofline) == pytest.approx(want)


THUNKS = """\
000: kCommandBuffer [source       | next=002 (1)]
    001: kCustomKernel [source | sink] loop_fusion_1 grid: [4, 1, 1] threads: [128, 1, 1]
002: kWhile         [prev=000 (1) | sink        ]
condition:
    003: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1] threads: [1, 1, 1]
  body:
    000: kCommandBuffer [source       | next=005 (1)]
        004: kCustomKernel [source | sink] int8_product grid: [8, 2, 2] threads: [128, 1, 1]
    005: kDynamicSliceFusion [prev=000 (1) | sink] params=1, results=1
        006: kCopy [source | sink] kCopy
"""
THUNK_NAMES = {1: "loop_fusion.1", 2: "while.7", 3: "compare.2", 4: "pallas_call.3", 6: "copy.9"}
LOOP = """\
ENTRY %main (p: s32[]) -> s32[] {
  %p = s32[] parameter(0)
  ROOT %while.7 = s32[] while(%p), backend_config={"known_trip_count":{"n":"5"}}
}
"""


def test_launches_are_read_from_xlas_thunk_sequence():
    """A graph before a loop of 5 trips whose body is a graph and an in-place copy that no graph
    holds: 6 graphs launched, the kernels inside them recorded (by their HLO names, through the
    thunk ids), the loop's condition and the copy on their own; each kernel's grid. The cost model
    charges a recorded kernel in_graph, one on its own a launch, and a launch a graph."""
    metadata = "".join(
        f'thunk_metadata {{\n  thunk_info {{\n    profile_annotation: "{name}"\n    thunk_id: {i}\n'
        "  }\n}\n"
        for i, name in THUNK_NAMES.items()
    )
    launched = hlo.launches(THUNKS, metadata, LOOP)
    assert launched.graphs == 1 + 5
    assert launched.captured == {"loop_fusion.1", "pallas_call.3"}
    assert launched.grids["pallas_call.3"] == (8, 2, 2) and launched.grids["loop_fusion.1"][0] == 4
    kernels = [
        hlo.Kernel("loop_fusion.1", "fusion", 1, 2000, 0, ""),
        hlo.Kernel("pallas_call.3", "pallas", 5, 1000, 10**6, ""),
        hlo.Kernel("copy.9", "copy", 5, 100, 0, ""),
    ]
    roofline = hlo.Roofline("test", hbm=1e9, int8_macs=1e10, launch=3e-6, in_graph=1e-6)
    want = (2e-6 + 1e-6) + 5 * (1e-4 + 1e-6) + 5 * (1e-7 + 3e-6) + 6 * 3e-6
    assert hlo.modeled_seconds(kernels, roofline, launched) == pytest.approx(want)


PTX = """\
.visible .entry kernel_a(
  .param .u64 p
)
{
\tmov.u32 \t%r1, 0;
$L__BB0_1:
\tadd.s32 \t%r2, %r2, 1;
\twgmma.fence.sync.aligned;
\t// begin inline asm
\twgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 {%r5,%r6}, %rd1, %rd2, %p1;
\twgmma.mma_async.sync.aligned.m64n64k32.s32.s8.s8 {%r5,%r6}, %rd3, %rd4, %p1;
\twgmma.commit_group.sync.aligned;
\tWAIT
\tshr.s32 \t%r3, %r5, 1;
\tmin.s32 \t%r3, %r3, 127;
\tsetp.lt.s32 \t%p2, %r2, 4;
\t@%p2 bra.uni \t$L__BB0_1;
\tmax.s32 \t%r4, %r4, 1;
\tret;
}
.visible .entry kernel_b()
{
\tmma.sync.aligned.m16n8k32.row.col.satfinite.s32.s8.s8.s32 {%r1}, {%r2}, {%r3}, {%r4};
\tcvt.s8.s32 \t%rs1, %r1;
\tret;
}
"""


def test_a_kernels_mma_loop_is_read_from_its_ptx_with_its_integer_work_and_waits():
    """A loop of 2 wgmmas in one group, beside 4 integer instructions (add, shr, min, setp; the max
    after the loop is not in it): the group waited for at once (a register move before the wait is
    no work), or with a shift first not; a kernel without a loop is read whole."""
    at_once = PTX.replace("WAIT", "mov.b32 \t%r8, %r9;\n\twgmma.wait_group.sync.aligned 0;")
    entries = hlo.ptx_entries(at_once)
    assert list(entries) == ["kernel_a", "kernel_b"]
    assert hlo.mma_code(entries["kernel_a"]) == hlo.MmaCode("wgmma", "m64n64k32", 2, 4, 1, 1)
    assert hlo.mma_code(entries["kernel_b"]) == hlo.MmaCode("mma.sync", "m16n8k32", 1, 1, 0, 0)
    later = PTX.replace("WAIT", "shl.b32 \t%r7, %r7, 1;\n\twgmma.wait_group.sync.aligned 0;")
    assert hlo.mma_code(hlo.ptx_entries(later)["kernel_a"]) == hlo.MmaCode(
        "wgmma", "m64n64k32", 2, 5, 1, 0
    )


def test_the_roofline_bytes_are_the_design_documents_at_the_default_model():
    cfg = run.make_config(run.parse_args(["--parallel_generations_per_gpu", "32768"]))
    training, inference = bench.roofline_bytes(cfg)
    assert (round(training), round(inference)) == (55_573, 34_964)


def test_target_report_gives_the_compiled_program_its_launches_and_a_modeled_speed(capsys):
    """The report of a small model's program for an H100: its figures, the product kernel's calls
    costed as they declare, and its launches as XLA's dumped thunk sequence says. Its training and
    inference, and validation, compile for the H100 integer only; the training step with donated
    inputs and bounded temporaries."""
    six = ["--segments", "6", "--tokens_per_update", "24"]  # 6 segments of 4 bytes
    args = run.parse_args([*TINY, *SMALL, *six, "--target", "h100"], bench.Args)
    figures = bench.target_report(args)
    out = capsys.readouterr().out
    integer_only_donated_and_bounded(figures["compiled"]["training"], args, figures["cfg"])
    integer_only(figures["compiled"]["inference"].as_text())
    mesh = bench.target_mesh("h100", 1)
    params = bench.abstract_inputs(args, figures["cfg"], mesh)[0]
    rows = jax.ShapeDtypeStruct(
        (8, 17),
        jnp.uint8,
        sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("pop")),
    )
    with bench.without_compilation_cache():
        evaluate = run.make_evaluate(figures["cfg"], mesh).lower(params, rows).compile()
    integer_only(evaluate.as_text())
    # the product kernel's MMA loop, read from its PTX
    assert re.search(
        r"^MMA loops \(PTX, each instruction once\): .*\bint8_product\w*: \d+ (wgmma|mma\.sync) "
        r"m\d+n\d+k\d+, [\d,]+ integer instructions \([\d,]+ an MMA\)",
        out,
        re.M,
    )
    for line in (
        "kernels per token:",
        "bytes per token and member:",
        "temporaries:",
        "modeled training tokens/s:",
    ):
        assert re.search(rf"^{re.escape(line)} [0-9,.]+", out, re.M), line
    assert "modeled" in out.split("modeled training tokens/s:")[1].splitlines()[0]
    # the layers unrolled, the products Pallas kernels of a declared cost
    train = figures["training"]
    assert train["per_token"] > 0 == train["per_layer"] and "(the layers unrolled)" in out
    assert [k for k in figures["kernels"]["training"] if k.kind == "pallas" and k.bytes and k.macs]
    assert 0 < train["tokens_per_s"] < figures["inference"]["tokens_per_s"] * 1.5
    # each layer's state carried in its own buffer: no copy cuts a byte's kernels apart, so XLA
    # records every kernel that runs every byte in one command buffer a byte (a loop of a known
    # trip count runs no condition); with its loops recorded too (WHILE) the whole step is one
    cfg = figures["cfg"]
    every_byte = [k for k in figures["kernels"]["training"] if bench.loop_of(k, cfg) >= 2]
    assert every_byte and all(k.name in figures["launched"].captured for k in every_byte)
    assert cfg.tokens <= train["graphs"] <= cfg.tokens + 3 * cfg.segments + 3
    graphs = figures["command buffers"]
    assert graphs["loops recorded (WHILE)"].startswith("1 command buffer (CUDA graphs) launched, ")
    assert graphs["loops recorded (WHILE)"].endswith(", 0 on their own")
    assert re.search(r"^launches per generation: XLA's default: [\d,]+ command buffers", out, re.M)


def test_kernels_are_placed_in_their_loops_by_how_often_they_run(eight_h100s):
    """A kernel that runs more often than there are segments runs every byte; more often than there
    are bytes, every byte and layer (the layers scanned, where XLA runs the products): read on the
    CPU's own compiled step, and on the program of 8 H100s, where XLA splits the loop of bytes and
    leaves none of segments (each layer's 5 products still run every byte)."""
    # the products XLA's, as on every CPU; 2 segments of 8 bytes
    args = run.parse_args([*TINY, "--tokens_per_update", "16", "--segments", "2"])
    mesh = cluster.population_mesh(run.POP)
    cfg, replicas = run.mesh_config(args, mesh), run.replicas_of(args)
    batch = np.zeros((cfg.population // cfg.group_size, cfg.tokens + 1), np.uint8)
    inputs = (
        *run.init_run(cfg, replicas),
        batch,
        np.int32(0),
        *run.replica_inputs(cfg, replicas, 0),
    )
    text = run.make_generation_step(cfg, mesh).lower(*inputs).compile().as_text()
    figures = bench.describe_program(hlo.gpu_kernels(text), cfg, 1)
    assert figures["per_token"] > figures["per_layer"] * cfg.n_layer > 0
    # segments of 13 and 12 bytes, four of each: two loops of bytes, 52 and 48 trips a generation
    target = eight_h100s
    assert {k.runs for k in target.kernels if k.kind == "pallas"} == {48, 52}
    figures = bench.describe_program(target.kernels, target.cfg, 1)
    assert figures["per_layer"] == 0 and figures["per_token"] >= 6  # 6 product kernel calls


def test_a_product_kernel_is_costed_by_the_layer_it_reads():
    """The kernel compiled for the H100 (Triton): counted as one kernel a call, its bytes the x, the
    one layer of the weights and factors it reads and the int8 output it writes (not the stacked
    operands whole), its MACs those of its products."""
    sharding = jax.sharding.SingleDeviceSharding(bench.target_mesh("h100", 1).devices.flat[0])
    layers, pairs, m, n = 3, 64, 128, 64

    def shaped(*shape, dtype=jnp.int8):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def program(x, w, a, b, shift):
        options = dict(interpret=False, arithmetic=run.ARITHMETIC)
        return kernel.product(x, w, a, b, shift, jnp.int32(1), None, None, **options)

    operands = (
        shaped(pairs, 2 * n),
        shaped(2, layers, m, n),
        shaped(2, layers, pairs, m),
        shaped(2, layers, pairs, n),
        shaped(dtype=jnp.int32),
    )
    with bench.without_compilation_cache():
        traced = jax.jit(program).trace(*operands)
        kernels = hlo.gpu_kernels(
            traced.lower().compile().as_text(), bench.pallas_costs(traced.jaxpr)
        )
    (product,) = [k for k in kernels if k.kind == "pallas"]
    # x; a layer of w, a and b for both matrices
    read = pairs * 2 * n + 2 * m * n + 2 * pairs * (m + n)
    assert (product.runs, product.bytes, product.macs) == (
        1,
        read + 2 * pairs * 2 * m,
        2 * pairs * 2 * m * n,
    )


def benchmark_args(**overrides):
    args = dict(
        n_embd=8, n_layer=1, parallel_generations_per_gpu=16, group_size=4, tokens_per_update=8
    )
    return flags.replace(bench.Args(), **{**args, **overrides})


def test_benchmark_prints_one_table_with_every_mode(capsys):
    rate = bench.benchmark(benchmark_args(num_epochs=2))  # --num_epochs given: exactly 2 of each
    assert set(rate) == {"a", "b", "c", "d"} and all(v > 0 for v in rate.values())
    out = capsys.readouterr().out
    for label in (
        "a training",
        "b fitness only",
        "c inference",
        "d full-rank ES",
        "training / inference (a/c)",
        "peak RSS",
        "temp MiB",
        "median of 2 generations",
        "a bare JAX process on this machine",
    ):
        assert label in out
    assert "note:" not in out
    bare = float(re.search(r"jitted int8 dot\) ([0-9.]+) GiB", out).group(1))
    assert 0.05 < bare < 4


def test_benchmark_skips_full_rank_es_whose_temporaries_the_host_cannot_hold(capsys, monkeypatch):
    # nothing left: any temporaries are too many
    monkeypatch.setattr(cluster, "host_memory_left", lambda: 0)
    rate = bench.benchmark(benchmark_args(num_epochs=1))
    assert set(rate) == {"a", "b", "c"}
    out = capsys.readouterr().out
    assert re.search(
        r"note: d full-rank ES skipped: its compiled program needs [0-9.]+ GiB of temporaries", out
    )
    assert "on 1 device(s), more than the 0.0 GiB free" in out


def test_memory_left_is_one_accelerators_or_the_hosts_for_every_cpu_device(monkeypatch):
    def mesh(stats, devices):
        device = SimpleNamespace(memory_stats=lambda: stats)
        return SimpleNamespace(
            devices=np.array([device] * devices), local_devices=[device] * devices
        )

    gpu = {"bytes_limit": 80 * 2**30, "bytes_in_use": 2**30, "peak_bytes_in_use": 2**31}
    assert cluster.memory_left(mesh(gpu, 2)) == (79 * 2**30, 1)  # each device's own memory
    monkeypatch.setattr(cluster, "host_memory_left", lambda: 5 * 2**30)
    # the CPU's devices share the host's
    assert cluster.memory_left(mesh(None, 3)) == (
        5 * 2**30,
        3,
    )


def test_benchmark_without_num_epochs_fits_its_budget_and_says_what_it_skipped(capsys):
    rate = bench.benchmark(benchmark_args(), budget=0.0)  # no time at all: the least it does
    assert set(rate) == {"a", "b", "c"}
    out = capsys.readouterr().out
    assert "median of 3 generations" in out and "note: d full-rank ES skipped" in out
    assert "note: no --num_epochs: timed 3 generation(s) of a, b, c, what fits" in out
    assert flag_given(["--rank", "2", "--num-epochs=3"], "num_epochs")
    assert flag_given(["--num_epochs", "3"], "num_epochs")
    assert not flag_given(["--rank", "2", "--n_embd", "8"], "num_epochs")


def test_benchmark_of_replicas_times_one_run_of_as_many_members_beside_them(capsys):
    rate = bench.benchmark(benchmark_args(replicas=2, replica_sigma_shift=(3, 5)), budget=0.0)
    assert set(rate) == {"a", "b", "c", "e"} and all(v > 0 for v in rate.values())
    out = capsys.readouterr().out
    assert "2 replicas, each population 16" in out and "(a, b, c, e taking turns)" in out
    assert "e one run of 32" in out and "timed 3 generation(s) of a, b, c, e" in out
    ratio = float(
        re.search(r"2 replicas of population 16 / one run of 32 \(a/e\): ([0-9.]+)%", out).group(1)
    )
    assert abs(ratio - 100 * rate["a"] / rate["e"]) < 0.1


def test_the_benchmark_is_its_own_script_and_takes_run_pys_flags(capsys):
    with pytest.raises(SystemExit) as stop:
        bench.main(["--target", "h100", "--n_embd", "6"])
    assert (
        stop.value.code == 2
        and "--n_embd must be a multiple of 4, got 6" in capsys.readouterr().err
    )


def test_benchmark_of_the_reward_objective_times_its_writing_beside_likelihood(capsys):
    """--objective reward: a to c on bytes as ever, then r (the task's scorer in the step), s (its
    reward on the host) and w (the writing alone) on the task's prompts, in bytes written a
    second, with the host reward's share of a generation."""
    given = dict(objective="reward", task="addition", completion_bytes=3, dir_path=CACHE)
    rate = bench.benchmark(benchmark_args(num_epochs=1, **given), budget=0.0)
    assert {"a", "r", "s", "w"} <= set(rate) and all(v > 0 for v in rate.values())
    out = capsys.readouterr().out
    assert "reward objective: task addition, 990 prompts of up to 6 bytes" in out
    for label in ("r scored in the step", "s scored on the host", "w writing alone", "written/s"):
        assert label in out
    share = re.search(r"the host reward's share of a generation \(s\): ([0-9.]+)%", out)
    assert share and 0 < float(share.group(1)) < 100


def test_the_h100_report_covers_the_reward_objective(capsys):
    """The reward's generation (the addition task's scorer in the step) compiled for an H100 here:
    its kernels and modeled bytes written a second (the report's part that target_report adds
    with --objective reward)."""
    args = run.parse_args(
        [*TINY, "--objective", "reward", "--task", "addition", "--target", "h100"], bench.Args
    )
    figures = bench.target_reward(args)
    assert figures["kernels"] > 0 and figures["written_per_s"] > 0
    out = capsys.readouterr().out
    assert "reward objective (scored in the step): task addition, prompts of 7 bytes" in out
