"""The GPU program, compiled here for an H100 without one (--target h100: XLA's whole GPU
pipeline, deviceless): integer only, every product an s8 x s8 -> s32 dot, its inputs donated, its
temporaries bounded, one all-gather of the scores a generation over 8 GPUs; and the kernel
count, bytes and cost model of --benchmark --target against programs whose answer is known."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import TINY, tiny_args

import run

FLOAT_TYPES = ("f16", "bf16", "f32", "f64")
SMALL = ["--n_embd", "16", "--parallel_generations_per_gpu", "64", "--segments", "2"]


def compile_step(args, part="train", devices=1):
    mesh = run.target_mesh("h100", devices)
    cfg = run.mesh_config(args, mesh)
    step = run.make_generation_step(cfg, mesh, part)
    with run.without_compilation_cache():
        return step.lower(*run.abstract_inputs(args, cfg, mesh)).compile(), cfg, mesh


def dots(hlo: str) -> list[tuple[list, list]]:
    """(operand shapes, result shapes) of every dot in a compiled program."""
    computations, _ = run.hlo_computations(hlo)
    found = []
    for body in computations.values():
        shapes = {x.name: x.shapes for x in body}
        found += [([shapes[o][0] for o in x.operands], x.shapes) for x in body if x.opcode == "dot"]
    return found


def integer_only(hlo: str) -> None:
    """No floating-point type; every product an s8 x s8 -> s32 dot of XLA's or the product kernel
    (whose own dots test_kernels.py checks in its jaxpr)."""
    assert not [t for t in FLOAT_TYPES if re.search(rf"\b{t}\[", hlo)]
    products = dots(hlo)
    assert products or f'name = "{run.PRODUCT_KERNEL}_' in hlo
    assert all(
        [t for t, _ in operands] == ["s8", "s8"] and [t for t, _ in result] == ["s32"]
        for operands, result in products
    ), products


@pytest.mark.parametrize(
    "flags", [[], ["--algorithm", "upstream"], ["--replicas", "2", "--replica_sigma_shift", "3", "5"]]
)
def test_the_h100_step_is_integer_only_with_donated_inputs_and_bounded_temporaries(flags):
    args = tiny_args(*SMALL, "--segments", "6", *flags)
    compiled, cfg, _ = compile_step(args)
    hlo = compiled.as_text()
    integer_only(hlo)
    assert (
        cfg.kernels == "pallas" and f'name = "{run.PRODUCT_KERNEL}_' in hlo
    )  # the products are the kernel's
    # parameters, update rule state and hidden states are donated: every one aliases an output
    carried = len(jax.tree.leaves(run.abstract_inputs(args, cfg, run.target_mesh("h100", 1))[:3]))
    aliased = re.search(r"input_output_alias=\{(.*?)\}, entry", hlo).group(1)
    assert sorted(int(i) for i in re.findall(r"\((\d+), \{\}, may-alias\)", aliased)) == list(range(carried))
    # temporaries: one segment's noise at a time (built where it is used: 6 segments' at once would
    # be 16 times this noise), in words, entries and the layouts the kernels read, and the members'
    # activations, int32, a few times over
    pieces = sum(np.prod(shape) for _, shape, _ in run.noise_pieces(cfg))
    noise = run.noise_pairs(cfg) // cfg.segments * cfg.replicas * pieces
    activations = cfg.population * cfg.replicas * cfg.n_layer * 4 * cfg.n_embd * 4
    temporaries = compiled.memory_analysis().temp_size_in_bytes
    print(f"temporaries {temporaries:,} B; a segment's noise {noise:,} B, activations {activations:,} B")
    assert temporaries <= 4 * noise + 4 * activations


def test_validation_and_inference_compile_for_the_h100_integer_only():
    args = tiny_args(*SMALL)
    compiled, cfg, mesh = compile_step(args, "inference")
    integer_only(compiled.as_text())
    params = run.abstract_inputs(args, cfg, mesh)[0]
    rows = jax.ShapeDtypeStruct(
        (8, 17), jnp.uint8, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("pop"))
    )
    with run.without_compilation_cache():
        integer_only(run.make_evaluate(cfg, mesh).lower(params, rows).compile().as_text())


@pytest.mark.parametrize("fast", [True, False])
def test_over_8_h100s_the_one_gather_a_generation_is_every_pairs_int8_score(fast):
    """docs/design.org: one all-gather of an int8 score per pair and segment (half a byte per
    member and segment), with normalised scores also the two int32 sums of the mean |difference|."""
    args = tiny_args(
        *SMALL, "--fast_fitness" if fast else "--no-fast_fitness", "--parallel_generations_per_gpu", "16"
    )
    compiled, cfg, _ = compile_step(args, devices=8)
    traffic = run.collective_traffic(compiled.as_text())
    gathers = [size for op, size in traffic if op == "all-gather"]
    assert cfg.population == 128 and gathers == [cfg.segments * cfg.population // 2], traffic
    others = [(op, size) for op, size in traffic if op != "all-gather"]
    assert {op for op, _ in others} <= {"all-reduce"} and sum(size for _, size in others) == 12 * (not fast)
    integer_only(compiled.as_text())


def test_kernels_are_counted_through_loops_with_their_bytes_and_macs():
    """A scan of 5 steps around one int8 product (64 x 32 by 32 x 16) and an elementwise step: the
    product runs 5 times, reads both operands and writes its int32 result, and costs 64 x 32 x 16
    multiply-accumulates; the cost model charges each kernel its larger term plus a launch."""
    sharding = jax.sharding.SingleDeviceSharding(run.target_mesh("h100", 1).devices.flat[0])

    def program(x, w):
        def step(h, _):
            product = jnp.dot(h, w, preferred_element_type=jnp.int32)
            return jnp.clip(product >> 3, -127, 127).astype(jnp.int8)[:, :32] + h[:, :32] * 0, None

        with jax.named_scope("tokens"):
            return jax.lax.scan(step, x, None, length=5)[0]

    x = jax.ShapeDtypeStruct((64, 32), jnp.int8, sharding=sharding)
    w = jax.ShapeDtypeStruct((32, 64), jnp.int8, sharding=sharding)
    with run.without_compilation_cache():
        kernels = run.gpu_kernels(jax.jit(program).lower(x, w).compile().as_text())
    (gemm,) = [k for k in kernels if k.kind == "gemm"]
    assert (gemm.runs, gemm.loop, gemm.macs) == (5, "tokens", 64 * 32 * 64)
    assert gemm.bytes == 64 * 32 + 32 * 64 + 64 * 64 * 4
    assert gemm.shapes.endswith("-> s32[64,64]")
    roofline = run.Roofline("test", hbm=1e9, int8_macs=1e10, launch=1e-6)
    want = sum(k.runs * (max(k.bytes / 1e9, k.macs / 1e10) + 1e-6) for k in kernels)
    assert run.modeled_seconds(kernels, roofline) == pytest.approx(want)


def test_the_roofline_bytes_are_the_design_documents_at_the_default_model():
    cfg = run.make_config(run.parse_args(["--parallel_generations_per_gpu", "32768"]))
    training, inference = run.roofline_bytes(cfg)
    assert (round(training), round(inference)) == (55_573, 34_964)


def test_target_report_gives_the_compiled_program_and_a_modeled_speed(capsys):
    figures = run.target_report(tiny_args(*SMALL, "--target", "h100"))
    out = capsys.readouterr().out
    for line in (
        "kernels per token:",
        "bytes per token and member:",
        "temporaries:",
        "modeled training tokens/s:",
    ):
        assert re.search(rf"^{re.escape(line)} [0-9,.]+", out, re.M), line
    assert "modeled" in out.split("modeled training tokens/s:")[1].splitlines()[0]
    train = figures["training"]
    assert train["per_token"] > train["per_layer"] * run.parse_args(TINY).n_layer > 0
    assert 0 < train["tokens_per_s"] < figures["inference"]["tokens_per_s"] * 1.5


def test_a_product_kernel_is_costed_by_the_layer_it_reads():
    """The kernel compiled for the H100 (Triton): counted as one kernel a call, its bytes the x, the
    one layer of the weights and factors it reads and the int8 output it writes (not the stacked
    operands whole), its MACs those of its products."""
    sharding = jax.sharding.SingleDeviceSharding(run.target_mesh("h100", 1).devices.flat[0])
    layers, pairs, m, n = 3, 64, 128, 64

    def shaped(*shape, dtype=jnp.int8):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def program(x, w, a, b, shifts):
        return run.product_kernel(x, w, a, b, shifts, jnp.int32(1), None, None, False, False)

    operands = (
        shaped(1, 1, pairs, 2 * n),
        shaped(2, layers, 1, m, n),
        shaped(2, layers, 1, pairs, m),
        shaped(2, layers, 1, pairs, n),
        shaped(1, dtype=jnp.int32),
    )
    with run.without_compilation_cache():
        kernels = run.gpu_kernels(jax.jit(program).lower(*operands).compile().as_text())
    (product,) = [k for k in kernels if k.kind == "product"]
    read = pairs * 2 * n + 2 * m * n + 2 * pairs * (m + n)  # x; a layer of w, a and b for both matrices
    assert (product.runs, product.bytes, product.macs) == (1, read + 2 * pairs * 2 * m, 2 * pairs * 2 * m * n)
