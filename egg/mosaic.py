"""The GPU product kernel on Pallas's Mosaic GPU backend, JAX's supported path for Hopper (Pallas's
Triton backend, which egg/kernel.py's kernel uses, is deprecated since JAX 0.11).

It computes what egg/kernel.py's kernel computes with its products alone (Options(normalises=False,
sums_noise=False)): its caller layer-normalises the inputs and sums each row's x B before it. A
program (CTA, one warpgroup) computes a tile of 64 pairs by `columns` outputs of one side of one
matrix: a software pipeline (emit_pipeline) stages each chunk of `depth` inputs of x and W into
shared memory by TMA, `stages` chunks ahead, and issues the chunk's wgmmas (s8 x s8 -> s32, the
accumulator in registers) without waiting for them: one group stays in flight while the next
chunk's operands arrive (wgmma.wait_group 1). The epilogue's operands (the tile's A factors, the
rows' x B, the residual) are staged by TMA before the loop, so they arrive while the tensor cores
multiply; the epilogue (the noise's rank-1 term, the rescale to int8, the residual's saturating
add) is the caller's Arithmetic, as in egg/kernel.py, in the accumulator's registers.

Operands as egg/kernel.py's product() takes them (its docstring): views of the caller's arrays;
the layer and the replica's sigma_shift are read inside the kernel (a slice taken outside would
be a copy). Pallas's Mosaic GPU interpreter (JAX >= 0.12: InterpretGPUParams) runs it on a CPU,
which the tests compare with XLA's products bit for bit.
"""

from __future__ import annotations

import inspect
from functools import partial

import jax
import jax.numpy as jnp

i32 = jnp.int32
ROWS = 64  # pairs a tile: a warpgroup's wgmma is 64 rows tall
# the tiles of outputs it may take: a wgmma is up to 256 wide, but 64 x 256 int32 accumulators and
# a residual's epilogue took 255 registers a thread, spilled (ptxas, 256D-6L's W_2)
COLUMNS = (64, 128)
DEPTHS = (128, 64)  # the chunks of inputs a stage may hold, longest first (a 64- or 128-byte row)
STAGES = 2  # chunks of x and W in shared memory at once: one multiplied while the next arrives
SCALARS = 32  # int32s of the scalars' block (layer, sigma_shift): TMA moves 128 bytes at least


def takes(pairs: int, distinct: int, m: int, n: int) -> bool:
    """Whether the kernel takes a product of these shapes: whole tiles of 64 pairs within the
    distinct ones, of 64 outputs and of 64 inputs."""
    return distinct % ROWS == 0 and pairs % distinct == 0 and m % 64 == 0 and n % 64 == 0


def interpreter():
    """Pallas's Mosaic GPU interpreter, or None where this JAX has none that runs the kernel (its
    int8 wgmma reads W's chunk transposed, which the interpreter takes from JAX 0.12)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    params = getattr(plgpu, "InterpretGPUParams", None)
    return params() if params is not None else None


def load(ref, layout):
    """A shared-memory ref's whole block into registers in `layout` (JAX 0.12 dropped load's
    index)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    if "idx" in inspect.signature(plgpu.load).parameters:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def program(*refs, shape: tuple, tile: tuple, noisy: bool, added: bool, arithmetic):
    """One program of product()'s grid (pairs tile i, outputs tile j, matrix and side gs): refs
    x, w, the scalars, [a, xb,] [residual,] and the output, all in device memory; shape (sides, m,
    n, pair tiles of the distinct pairs); tile (columns, depth, stages)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    sides, m, n, pair_tiles = shape
    columns, depth, stages = tile
    x_ref, w_ref, scalars_ref, *rest = refs
    a_ref, xb_ref = (rest.pop(0), rest.pop(0)) if noisy else (None, None)
    residual_ref = rest.pop(0) if added else None
    out_ref = rest.pop(0)
    i, j, gs = (jax.lax.axis_index(name) for name in ("pairs", "outputs", "matrix_side"))
    g, s = gs // sides, gs % sides
    rows_at, outputs_at = pl.ds(i * ROWS, ROWS), pl.ds(s * m + j * columns, columns)

    def swizzled(width: int):  # a shared-memory tile of int8 rows `width` wide, as TMA and wgmma
        swizzle = plgpu.find_swizzle(width * 8)  # read it without bank conflicts
        return (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))

    tile_of = partial(plgpu.SMEM, (ROWS, columns), jnp.int8, transforms=swizzled(columns))
    scratch = dict(
        scalars=plgpu.SMEM((SCALARS,), i32),
        out=tile_of(),
        arrived=plgpu.Barrier(num_arrivals=1, num_barriers=4),
    )
    if noisy:
        scratch |= dict(a=tile_of(), xb=plgpu.SMEM((ROWS,), i32))
    if added:
        scratch |= dict(residual=tile_of())

    @partial(pl.run_scoped, **scratch)
    def staged(scalars, out, arrived, a=None, xb=None, residual=None):
        plgpu.copy_gmem_to_smem(scalars_ref, scalars, arrived.at[0])
        plgpu.barrier_wait(arrived.at[0])
        layer, shift = scalars[0], scalars[1]
        if noisy:  # the epilogue's operands, arriving while the tensor cores multiply
            pair_rows = pl.ds((i % pair_tiles) * ROWS, ROWS)
            a_block = a_ref.at[g, layer, pair_rows, pl.ds(j * columns, columns)]
            plgpu.copy_gmem_to_smem(a_block, a, arrived.at[1])
            plgpu.copy_gmem_to_smem(xb_ref.at[g, s, rows_at], xb, arrived.at[2])
        if added:
            plgpu.copy_gmem_to_smem(residual_ref.at[rows_at, outputs_at], residual, arrived.at[3])

        @partial(pl.run_scoped, acc=plgpu.ACC((ROWS, columns), i32))
        def multiplied(acc):
            def chunk(_, x_chunk, w_chunk):  # issued, not waited for: one group stays in flight
                plgpu.wgmma(acc, x_chunk, w_chunk.T)
                plgpu.wgmma_wait(1)

            # a chunk's buffers are refilled a step late: its wgmma may still be reading them
            chunk_of = partial(plgpu.BlockSpec, transforms=swizzled(depth), delay_release=1)
            in_specs = [
                chunk_of((ROWS, depth), lambda k: (i, k)),
                chunk_of((columns, depth), lambda k: (j, k)),
            ]
            pipeline = plgpu.emit_pipeline(
                chunk, grid=(n // depth,), in_specs=in_specs, max_concurrent_steps=stages
            )
            pipeline(x_ref.at[:, pl.ds(s * n, n)], w_ref.at[g, layer])
            plgpu.wgmma_wait(0)
            total = acc[...]
            if noisy:  # this side's rank-1 term
                plgpu.barrier_wait(arrived.at[1])
                plgpu.barrier_wait(arrived.at[2])
                rows_xb = load(xb, plgpu.Layout.WGMMA.reduce(1))  # (ROWS,), along the rows
                xb_tile = jax.lax.broadcast_in_dim(rows_xb, (ROWS, columns), (0,))
                factors = load(a, plgpu.Layout.WGMMA)
                total = total + arithmetic.noise_term(xb_tile, factors, 1 - 2 * s, shift)
            result = arithmetic.rescale(total, n)
            if added:
                plgpu.barrier_wait(arrived.at[3])
                result = arithmetic.add(result, load(residual, plgpu.Layout.WGMMA))
            out[...] = result
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out, out_ref.at[g, rows_at, outputs_at])
            plgpu.wait_smem_to_gmem(0)


def tiles(programs_wanted: int, groups: int, pairs: int, m: int, n: int, sides: int):
    """(columns, depth) of a product's tiles: the widest tile of outputs whose grid gives at least
    `programs_wanted` programs (else the narrowest), the longest chunk of inputs."""
    options = [c for c in COLUMNS if m % c == 0]
    enough = [c for c in options if groups * sides * (pairs // ROWS) * (m // c) >= programs_wanted]
    columns = max(enough) if enough else min(options)
    return columns, next(d for d in DEPTHS if n % d == 0)


def product(x, w, a, xb, shift, layer, residual, *, interpret: bool, arithmetic, tile: tuple):
    """egg/kernel.py's product() with its products alone, on Mosaic GPU: x (Q, S n) int8; w (G, L,
    m, n); a (G, L, D, m) and xb (G, S, Q) int32, each row's x B of this layer, or both None
    (noise-free); shift, layer () int32; residual (Q, S m) or None; tile (columns, depth). Returns
    (G, Q, S m) int8."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    pairs = x.shape[0]
    groups, _, m, n = w.shape
    sides = x.shape[1] // n
    noisy, added = a is not None, residual is not None
    distinct = a.shape[2] if noisy else pairs
    columns, depth = tile
    scalars = jnp.zeros((SCALARS,), i32).at[0].set(layer).at[1].set(shift)
    operands = [x, w, scalars] + ([a, xb] if noisy else []) + ([residual] if added else [])
    body = partial(
        program,
        shape=(sides, m, n, distinct // ROWS),
        tile=(columns, depth, STAGES),
        noisy=noisy,
        added=added,
        arithmetic=arithmetic,
    )
    mode = None
    if interpret:
        mode = interpreter()
        if mode is None:
            raise RuntimeError(
                f"the Mosaic GPU kernel has no interpreter under JAX {jax.__version__} (0.12 on)"
            )
    call = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((groups, pairs, sides * m), jnp.int8),
        grid=(pairs // ROWS, m // columns, groups * sides),
        grid_names=("pairs", "outputs", "matrix_side"),
        interpret=mode,
        kernel_name="int8_product_mosaic",
    )
    return call(*operands)
