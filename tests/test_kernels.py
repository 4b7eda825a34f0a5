"""The GPU program on the CPU: the product kernel (egg/kernel.py), interpreted by Pallas, against
the layer norm, products and residual add that XLA computes, and a whole generation as a GPU runs it
(the kernel, each segment's noise built where it is used) against the CPU's, bit for bit."""

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import init_params, one_model_step, z_thresholds

import run
from egg import cluster, kernel, mosaic

SIDES, REPEATS, PAIRS, N, M, LAYERS = 2, 2, 32, 32, 64, 3


def operands(rng, groups):
    """Two replicas' operands: each one's x (R, D, S, n), w (G, L, m, n), a, b (G, L, D, m | n)."""
    tables = run.make_tables(1)
    return (
        rng.integers(-127, 128, (2, REPEATS, PAIRS, SIDES, N)).astype(np.int8),  # x (K, R, D, S, n)
        rng.integers(-60, 61, (2, groups, LAYERS, M, N)).astype(np.int8),  # w (K, G, L, m, n)
        tables.gauss[rng.integers(0, 256, (2, groups, LAYERS, PAIRS, M))],  # a
        tables.gauss_rank[rng.integers(0, 256, (2, groups, LAYERS, PAIRS, N))],  # b
    )


@pytest.mark.parametrize(
    "gain, residual, noisy",
    [(False, False, True), (True, False, True), (False, True, True), (True, False, False)],
)
def test_the_product_kernel_computes_what_layer_norm_matmul_and_clipped_add_compute(
    gain, residual, noisy
):
    """Two replicas (sigma_shift 3 and 1) mapped over the kernel as the method maps them
    (every_replica), two repeats of 32 pairs, two matrices of one layer of three: every member's
    output equal to XLA's, with a layer norm before and a residual after."""
    rng = np.random.default_rng(3)
    x, w, a, b = operands(rng, groups=2)
    layer = 1
    shifts = np.array([3, 1], np.int32)
    if not noisy:  # noise-free: the rows are one side's distinct pairs, one gain for all
        x = x[:, :, :, :1].reshape(2, 1, REPEATS * PAIRS, 1, N)
    gains = rng.integers(
        -40, 41, (2, LAYERS, 1, PAIRS, SIDES, N) if noisy else (2, LAYERS, 1, 1, 1, N)
    )
    gains = gains.astype(np.int8)
    add = rng.integers(-127, 128, x.shape[:-1] + (M,)).astype(np.int8)

    def one_replica(x, w, a, b, shift, gains, add):
        return kernel.product(
            x.reshape(-1, x.shape[2] * N),
            w,
            a if noisy else None,
            b if noisy else None,
            shift,
            jnp.int32(layer),
            gains.reshape(LAYERS, gains.shape[2], -1) if gain else None,
            add.reshape(-1, x.shape[2] * M) if residual else None,
            interpret=True,
            arithmetic=run.ARITHMETIC,
            replicas=2,
        )

    got = run.every_replica(one_replica)(x, w, a, b, shifts, gains, add)
    for k in range(2):
        sides = run.make_sides(jnp.int32(shifts[k]), SIDES if noisy else 1)
        for g in range(2):
            v = run.layer_norm(x[k], gains[k, layer]) if gain else x[k]
            nz = (a[k, g, layer][..., None], b[k, g, layer][..., None]) if noisy else None
            want = run.matmul(v, w[k, g, layer], nz, sides)
            want = run.clipped_add(want, add[k]) if residual else want
            np.testing.assert_array_equal(np.asarray(got[k, g]).reshape(want.shape), want)


def test_every_product_in_the_kernel_is_an_int8_dot_with_an_int32_sum():
    rng = np.random.default_rng(0)
    x, w, a, b = operands(rng, groups=1)

    def call(x):
        gain = jnp.ones((LAYERS, PAIRS, SIDES * N), jnp.int8)
        options = dict(interpret=True, arithmetic=run.ARITHMETIC)
        return kernel.product(
            x, w[0], a[0], b[0], jnp.int32(2), jnp.int32(0), gain, None, **options
        )

    jaxpr = jax.make_jaxpr(call)(x[0].reshape(-1, SIDES * N))
    (call,) = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    body = call.params["jaxpr"]

    def equations(j):
        for e in j.eqns:
            yield e
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                yield from equations(sub)

    found = list(equations(body))
    dots = [e for e in found if e.primitive.name == "dot_general"]
    assert dots and all(
        [v.aval.dtype for v in e.invars] == [jnp.int8, jnp.int8]
        and e.outvars[0].aval.dtype == jnp.int32
        for e in dots
    )
    dtypes = {v.aval.dtype for e in found for v in e.outvars if hasattr(v.aval, "dtype")}
    assert not [t for t in dtypes if jnp.issubdtype(t, jnp.floating)], dtypes


# what make_config gives a GPU, interpreted
GPU_LIKE = dict(kernels="interpret", unrolled=True, noise_per_segment=True)


def counting_kernel_calls(monkeypatch) -> list:
    """A list that grows by one each time a product is traced through the kernel: whether that
    product layer-normalises its inputs (has a gain)."""
    calls, product = [], kernel.product

    def counted(*operands, **options):
        calls.append(operands[6] is not None)
        return product(*operands, **options)

    monkeypatch.setattr(kernel, "product", counted)
    return calls


# each of --kernels auto's candidates that runs the kernel (run.PRODUCT_CANDIDATES), with flags
# (the Mosaic kernel's tiles are 64 pairs by 64 outputs at least: 64D, 64 pairs; its interpreter
# needs JAX 0.12, whose Mosaic GPU interpreter reads a transposed wgmma operand)
MOSAIC_SIZE = ["--n_embd", "64", "--n_layer", "1", "--parallel_generations_per_gpu", "128"]
NO_MOSAIC_INTERPRETER = f"no Mosaic GPU interpreter for its kernel under JAX {jax.__version__}"
AS_A_GPU = [
    ([], "the kernel"),
    (["--algorithm", "upstream"], "the kernel, its products alone"),
    (["--residual_shift", "1"], "the kernel, layer norms before it"),
    pytest.param(
        [*MOSAIC_SIZE, "--residual_shift", "1"],
        run.MOSAIC,
        marks=pytest.mark.skipif(mosaic.interpreter() is None, reason=NO_MOSAIC_INTERPRETER),
    ),
]


def test_every_kernel_candidate_of_kernels_auto_is_compared_with_xlas_products():
    kernels = {n for n, (engine, _) in run.PRODUCT_CANDIDATES.items() if engine == "pallas"}
    assert kernels == {(case.values if hasattr(case, "values") else case)[1] for case in AS_A_GPU}


@pytest.mark.parametrize("flags, candidate", AS_A_GPU)
def test_a_generation_as_a_gpu_runs_it_equals_the_cpus_bit_for_bit(flags, candidate, monkeypatch):
    """32D-2L, population 64 in 3 segments, two generations:
    the kernel for every product and each segment's noise built twice (for the fitness, then for Z
    summed segment by segment) give the parameters, update rule state, states, fitness and moved
    counts of XLA's products and every segment's noise built at once; with the layer norms in the
    kernel or before it (--kernels auto's candidates); the blocks' outputs halved where they join
    the residual stream (the kernel's add)."""
    args = run.parse_args(
        [
            "--n_embd",
            "32",
            "--n_layer",
            "2",
            "--parallel_generations_per_gpu",
            "64",
            "--tokens_per_update",
            "6",
            "--segments",
            "3",
            "--alpha",
            "0.3",
            *flags,
        ]
    )
    cpu = run.make_config(args)
    gpu = run.as_candidate(cpu._replace(**GPU_LIKE), candidate, "cpu")
    assert gpu.kernels == "interpret" and gpu.unrolled
    mesh = cluster.population_mesh(run.POP, jax.devices()[:1])
    rng = np.random.default_rng(5)
    params = jax.tree.map(np.asarray, init_params(cpu, 1))
    states = rng.integers(-127, 128, (cpu.population, cpu.n_layer, cpu.n_embd)).astype(np.int8)
    opt = jax.tree.map(np.asarray, run.init_state(cpu))
    batches = rng.integers(1, 256, (2, cpu.population // 2, cpu.tokens + 1)).astype(np.uint8)
    thresholds = z_thresholds(args, cpu)
    results, calls = [], counting_kernel_calls(monkeypatch)
    for cfg in (cpu, gpu):
        step = run.make_generation_step(cfg, mesh)
        carry, out = (params, opt, states), []
        for generation, batch in enumerate(batches):
            *carry, fitness, moved = one_model_step(
                step, carry, batch, generation, thresholds[generation], 7, args.sigma_shift
            )
            out.append((carry, fitness, moved))
        results.append(out)
        assert bool(calls) == (cfg is gpu)  # XLA's products on the CPU, the kernel's on the GPU
    # every product of every traced forward is the kernel's: each layer's (Wf and Wh together, Uf,
    # Uh, W1, W2; the layers unrolled, as on a GPU) and the head's
    assert calls and len(calls) % (5 * cpu.n_layer + 1) == 0
    # each layer's gates, W1 and the head have a gain: the kernel's to apply where it normalises
    assert any(calls) == gpu.kernel_options.normalises
    for left, right in zip(*results, strict=True):
        jax.tree.map(np.testing.assert_array_equal, left, right)
    assert sum(int(np.sum(m)) for _, _, m in results[0]) > 0


def test_validation_as_a_gpu_runs_it_equals_the_cpus(monkeypatch):
    args = run.parse_args(["--n_embd", "32", "--n_layer", "2", "--replicas", "2"])
    cfg = run.make_config(args)
    mesh = cluster.population_mesh(run.POP, jax.devices()[:1])
    params = jax.vmap(lambda seed: run.init_params(cfg, seed))(jnp.array([0, 1]))
    rows = np.random.default_rng(2).integers(0, 256, (32, 9)).astype(np.uint8)
    calls = counting_kernel_calls(monkeypatch)
    got = [
        np.asarray(run.make_evaluate(c, mesh)(params, rows))
        for c in (cfg, cfg._replace(**GPU_LIKE))
    ]
    assert calls  # the GPU-like evaluation's products are the kernel's
    np.testing.assert_array_equal(*got)


@pytest.mark.parametrize("n_embd", [64, 256])
def test_every_product_gives_each_sm_two_programs_wherever_tiles_of_16_can(n_embd):
    """At every population from 256 to 32768, each of a model's products (Wf and Wh together, Uf,
    Uh, W1, W2 and the head, with noise: two sides) launches at least two programs for each of an
    H100's SMs, with the largest tiles that do; where even tiles of 16 pairs by 16 outputs give
    fewer (few members, few outputs), it takes those, the most programs it can."""
    products = [(2, n_embd, n_embd), (1, n_embd, n_embd), (1, 4 * n_embd, n_embd)]
    products += [(1, n_embd, 4 * n_embd), (1, 256, n_embd)]
    for population in [256 * 2**k for k in range(8)]:
        pairs = population // 2
        for groups, m, n in products:
            rows, columns, depth = kernel.tiles(1, groups, pairs, pairs, m, n, 2)
            made = kernel.programs(1, groups, pairs, m, 2, rows, columns)
            finest = kernel.programs(1, groups, pairs, m, 2, 16, 16)
            assert made >= 2 * kernel.SMS or (rows, columns) == (16, 16), (population, m, n)
            if rows * columns > 16 * 16:  # no larger tiles than the rule needs
                assert finest >= made >= 2 * kernel.SMS
            assert depth == 64 and pairs % rows == 0 and m % columns == 0


def test_kernel_tiles_are_powers_of_two_over_whole_tiles_of_pairs():
    assert kernel.takes(pairs=64, distinct=32, m=64, n=256)
    assert not kernel.takes(pairs=64, distinct=32, m=48, n=256)  # 48: not a power of two
    assert not kernel.takes(pairs=8, distinct=8, m=64, n=64)  # fewer pairs than a tile
    assert not kernel.takes(pairs=64, distinct=32, m=8, n=64)  # Triton's dots: 16 at least
    assert kernel.takes(pairs=64, distinct=32, m=16, n=32)
    assert not kernel.takes(pairs=64, distinct=32, m=64, n=16)  # 16 deep: wrong on an H200


def test_a_gpu_without_pallas_triton_backend_takes_the_mosaic_kernel_or_xlas_products(
    monkeypatch, capsys
):
    """Both kernels compile for an H100 here (deviceless). With Pallas's Triton backend gone, as a
    later JAX will have it, a GPU run with --kernels pallas takes the Mosaic GPU kernel (the same
    bits: test_a_generation_as_a_gpu_runs_it...), said in one line; with Mosaic GPU gone too,
    XLA's products, said in one line, and --kernels pallas is refused."""
    import sys

    import jax.experimental.pallas as pallas

    import bench
    from egg import UserError

    mesh = bench.target_mesh("h100", 1)
    device = mesh.devices.flat[0]
    assert (
        kernel.fault(device, run.ARITHMETIC) == "" == kernel.fault(device, run.ARITHMETIC, "mosaic")
    )
    monkeypatch.delattr(pallas, "triton", raising=False)
    monkeypatch.setitem(sys.modules, "jax.experimental.pallas.triton", None)  # import fails
    triton = kernel.fault(device, run.ARITHMETIC)
    assert triton.startswith(
        f"the Triton product kernel cannot run under JAX {jax.__version__} (ModuleNotFoundError"
    )
    monkeypatch.setattr(cluster, "population_mesh", lambda axis, devices=None: mesh)  # a GPU's mesh
    small = ["--n_embd", "64", "--n_layer", "1", "--parallel_generations_per_gpu", "128"]
    args, _, cfg = run.start_devices(run.parse_args([*small, "--kernels", "pallas"]))
    assert cfg.kernels == "pallas" and cfg.kernel_options == run.PRODUCT_CANDIDATES[run.MOSAIC][1]
    assert (
        capsys.readouterr().out == f"products by the Mosaic GPU kernel, the same bits: {triton}\n"
    )
    monkeypatch.delattr(pallas, "mosaic_gpu", raising=False)
    monkeypatch.setitem(sys.modules, "jax.experimental.pallas.mosaic_gpu", None)
    mosaic_fault = kernel.fault(device, run.ARITHMETIC, "mosaic")
    assert mosaic_fault.startswith("the Mosaic GPU product kernel cannot run under JAX")
    args, _, cfg = run.start_devices(run.parse_args(small))
    assert args.model.kernels == "xla" and args.cluster.cpu_devices == 1
    assert cfg.kernels == "xla" == run.mesh_config(args, mesh).kernels
    said = f"products by XLA, the same bits: {triton}; {mosaic_fault}\n"
    assert capsys.readouterr().out == said
    with pytest.raises(UserError, match=r"^--kernels pallas: the Triton .*; use --kernels xla"):
        run.start_devices(run.parse_args([*small, "--kernels", "pallas"]))


def test_the_mosaic_kernel_compiles_for_an_h100_to_wgmmas_left_in_flight():
    """The Mosaic GPU kernel of a noisy product with a residual, compiled here for an H100
    (deviceless), its PTX as Mosaic GPU writes it: s8 wgmmas 64 rows tall, each group left in
    flight while the next chunk's operands arrive by TMA (never waited for at once)."""
    import tempfile
    from pathlib import Path

    import bench
    from egg import hlo

    device = bench.target_mesh("h100", 1).devices.flat[0]
    options = kernel.Options(normalises=False, sums_noise=False, backend="mosaic")

    def one(x, w, a, xb, residual):
        args = (x, w, a, None, 2, 1, None, residual)
        return kernel.product(
            *args, interpret=False, arithmetic=run.ARITHMETIC, options=options, xb=xb
        )

    shapes = [((128, 512), "int8"), ((1, 2, 128, 256), "int8"), ((1, 2, 64, 128), "int8")]
    shapes += [((1, 2, 128), "int32"), ((128, 256), "int8")]
    placed = jax.sharding.SingleDeviceSharding(device)
    specs = [jax.ShapeDtypeStruct(s, d, sharding=placed) for s, d in shapes]
    with tempfile.TemporaryDirectory() as dump, bench.mosaic_dumps_to(dump):
        jax.jit(one).lower(*specs).compile()
        ptx = "".join(p.read_text() for p in Path(dump).glob("*.ptx"))
    assert "cp.async.bulk.tensor" in ptx  # TMA
    (code,) = [hlo.mma_code(lines) for lines in hlo.ptx_entries(ptx).values()]
    assert code.kind == "wgmma" and code.shape == "m64n64k32" and code.mmas == 256 // 32
    assert code.waited_at_once == 0 and code.in_flight == 1


def test_mosaic_tiles_are_64_pairs_by_64_outputs_and_inputs_at_least():
    assert mosaic.takes(pairs=128, distinct=64, m=64, n=64)
    assert not mosaic.takes(pairs=64, distinct=32, m=64, n=64)  # a wgmma is 64 rows tall
    assert not mosaic.takes(pairs=128, distinct=64, m=32, n=64)
    assert not mosaic.takes(pairs=128, distinct=64, m=64, n=32)
    assert mosaic.tiles(132, groups=1, pairs=8192, m=256, n=1024, sides=2) == (128, 128)
    assert mosaic.tiles(132, groups=1, pairs=1024, m=256, n=1024, sides=2) == (64, 128)
    assert mosaic.tiles(264, groups=1, pairs=1024, m=256, n=192, sides=2) == (64, 64)
