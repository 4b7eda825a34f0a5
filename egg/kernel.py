"""The GPU product kernel: on a GPU each of a layer's int8 products is one Pallas (Triton) kernel
that reads its int8 operands once and writes int8: the shared GEMM x W^T, each member's rank-1
noise term, the rescale to int8 and, where the model has them, the layer norm before it and the
residual add after it, all in registers (XLA leaves the int32 GEMM output to a second kernel,
which reads it back).

The kernel only tiles the work: what a product computes is its caller's (run.py), given as an
Arithmetic of integer functions, so that the kernel and XLA's products compute the very same
integers (the tests compare them bit for bit, the kernel in Pallas's interpreter on the CPU).

A call computes one replica's products (the caller maps it over its replicas: Pallas adds them to
the grid). Its operands are views of the caller's arrays, never copies: the members as rows of
pairs (Q, S n), side s of pair q in the columns [s n, (s + 1) n); layered parameters whole (L,
...), the layer read inside the kernel (a slice taken outside would be a copy); matrices that read
the same input stacked on a leading axis G. Axes: Q pairs (repeats x distinct), D distinct pairs,
S sides, L layers, G stacked matrices, m outputs, n inputs; K replicas, where they are counted.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from egg import mosaic

i32 = jnp.int32
TILE_ROWS, TILE_COLUMNS, TILE_DEPTH = 64, 128, 64  # at most: pairs, outputs and inputs of a tile
SMS = 132  # an H100 SXM's streaming multiprocessors
PROGRAMS_PER_SM = 2  # the least programs a product's grid gives each SM, where its tiles allow
WARPS = 4  # a program's warps (one warpgroup), unless a caller asks for others
# at least 32 inputs deep: 16 deep, the kernel as JAX 0.11.2's Triton compiled it for an H200
# summed every product about twice (docs/gpu.org); the interpreter, which the tests run, cannot
# show it
TILE_DEPTH_MIN = 32


class Options(NamedTuple):
    """How the kernel computes, none of which changes an integer (each is a candidate of run.py's
    --kernels auto): whether it layer-normalises its inputs itself, in every tile of outputs (else
    its caller gives them normalised, once a row, before it); whether it sums x B, the rank-1
    noise's inner product, itself, chunk by chunk beside its MMAs (else its caller gives each row's,
    summed once a row and matrix before it, and the kernel's loop holds its MMAs alone); the tile
    rule's least programs a streaming multiprocessor (SM) and widest tile of outputs (tiles); a
    program's warps; the Pallas backend that compiles it: "triton", this file's kernel, or
    "mosaic", egg/mosaic.py's (Mosaic GPU, which computes the products alone: it takes neither
    normalises nor sums_noise)."""

    normalises: bool = True
    sums_noise: bool = True
    programs_per_sm: int = PROGRAMS_PER_SM
    columns: int = TILE_COLUMNS
    warps: int = WARPS
    backend: str = "triton"


BACKENDS = ("triton", "mosaic")


DEFAULT = Options()  # the options the kernel computes with unless its caller says others


class Arithmetic(NamedTuple):
    """What a product computes, given by the caller; each takes and returns int32 or int8 arrays."""

    rescale: Callable  # (acc (rows, m) int32, n) -> int8: x W^T and the noise term, to int8
    norm_scale: Callable  # (sum |x| (rows,) int32, n) -> (rows,) int32: a layer norm's multiplier
    normalise: (
        Callable  # (x int8, gain int8, scale (rows, 1) int32) -> the layer norm's int8 output
    )
    # the rank-1 noise term of a tile: (x B (rows, 1) or (rows, m) int32, A (rows, m) int8, sign,
    # shift) -> (rows, m) int32
    noise_term: Callable
    add: Callable  # (out int8, residual int8) -> int8: how out joins the residual, saturating


def takes(pairs: int, distinct: int, m: int, n: int, backend: str = "triton") -> bool:
    """Whether the kernel takes a product of these shapes: tiles of powers of two >= 16 (Triton's
    int8 dots), at least TILE_DEPTH_MIN inputs deep, whole tiles of pairs within the distinct
    ones; on Mosaic GPU, egg/mosaic.py's."""
    if backend == "mosaic":
        return mosaic.takes(pairs, distinct, m, n)
    shaped = all(x >= 16 and x & (x - 1) == 0 for x in (m, n)) and n >= TILE_DEPTH_MIN
    return shaped and distinct % 16 == 0 and pairs % distinct == 0


def tiles(
    replicas: int,
    groups: int,
    pairs: int,
    distinct: int,
    m: int,
    n: int,
    sides: int,
    rule: Options = DEFAULT,
):
    """(rows, columns, depth) of a product's tiles: of the tiles of powers of two from 16 (rows of
    pairs, at most TILE_ROWS, within the distinct ones; outputs, at most the rule's columns) whose
    grid gives each SM of an H100 the rule's programs_per_sm programs at least, the largest (each
    re-reads the fewest weights and inputs); where none does (few members, few outputs), the
    smallest; and the longest chunk of the inputs, at most TILE_DEPTH. Any tiles compute the same
    integers."""
    options = tile_options(distinct, m, rule.columns)
    least = rule.programs_per_sm * SMS
    enough = [t for t in options if programs(replicas, groups, pairs, m, sides, *t) >= least]
    if enough:
        rows, columns = max(enough, key=lambda t: (t[0] * t[1], t[1]))
    else:
        rows, columns = min(options, key=lambda t: (t[0] * t[1], t[1]))
    depth = max(t for t in (16, 32, 64) if t <= TILE_DEPTH and n % t == 0)
    return rows, columns, depth


def tile_options(distinct: int, m: int, widest: int = TILE_COLUMNS) -> list[tuple[int, int]]:
    """The (rows of pairs, columns of outputs) a product's tiles may take: powers of two from 16,
    at most TILE_ROWS within the distinct pairs and `widest` within the outputs."""
    return [
        (rows, columns)
        for rows in (16, 32, 64)
        if rows <= TILE_ROWS and distinct % rows == 0
        for columns in (16, 32, 64, 128)
        if columns <= widest and m % columns == 0
    ]


def grid(groups: int, pairs: int, m: int, sides: int, rows: int, columns: int):
    """One replica's product's grid: (matrix, tile of pairs, tile of outputs, side)."""
    return groups, pairs // rows, m // columns, sides


def programs(replicas: int, groups: int, pairs: int, m: int, sides: int, rows: int, columns: int):
    """The programs (CTAs) a product's grid launches for `replicas` replicas."""
    return replicas * math.prod(grid(groups, pairs, m, sides, rows, columns))


def int8_product(
    *refs,
    noisy: bool,
    summed: bool,
    gained: bool,
    added: bool,
    tile: tuple,
    arithmetic: Arithmetic,
):
    """One program of product()'s grid: the refs of its operands' blocks (specs) and its output's
    block; noisy: with rank-1 factors; summed: their x B given (else b, summed here); gained: with
    a layer norm's gain; added: with a residual; tile (rows, columns, depth, n)."""
    from jax.experimental import pallas as pl

    rows, columns, depth, n = tile
    refs = list(refs)
    layer_ref, x_ref, w_ref, out_ref = refs[0], refs[1], refs[2], refs[-1]
    a_ref, b_ref, shift_ref = refs[3:6] if noisy else (None, None, None)
    extra = refs[6 if noisy else 3 : -1]
    gain_ref = extra.pop(0) if gained else None
    residual_ref = extra.pop(0) if added else None
    at = layer_ref[0]
    sign = 1 - 2 * pl.program_id(3)

    def columns_of(k):
        return pl.ds(k * depth, depth)

    if gained:  # the layer norm's per-row multiplier, from sum |x| over the whole row

        def absolute(k, total):
            return total + jnp.sum(jnp.abs(x_ref[:, columns_of(k)].astype(i32)), 1)

        total = jax.lax.fori_loop(0, n // depth, absolute, jnp.zeros((rows,), i32))
        scale = arithmetic.norm_scale(total, n)[:, None]

    def inputs(k):  # the k-th (rows, depth) chunk of x, layer-normed where there is a gain
        chunk = x_ref[:, columns_of(k)]
        if not gained:
            return chunk
        return arithmetic.normalise(chunk, gain_ref[at, :, columns_of(k)], scale)

    def accumulate(k, carry):
        acc, xb = carry
        chunk = inputs(k)
        weights = w_ref[0, at, :, columns_of(k)]
        contract = (((1,), (1,)), ((), ()))
        acc = acc + jax.lax.dot_general(chunk, weights, contract, preferred_element_type=i32)
        if noisy and not summed:
            factors = b_ref[0, at, :, columns_of(k)].astype(i32)
            xb = xb + jnp.sum(chunk.astype(i32) * factors, 1)
        return acc, xb

    zeros = (jnp.zeros((rows, columns), i32), jnp.zeros((rows,), i32))
    acc, xb = jax.lax.fori_loop(0, n // depth, accumulate, zeros)
    if summed:  # its rows' x B, summed before the kernel
        xb = b_ref[0, 0, :]
    if noisy:  # this side's rank-1 term
        acc = acc + arithmetic.noise_term(xb[:, None], a_ref[0, at], sign, shift_ref[0])
    out = arithmetic.rescale(acc, n)
    out_ref[0] = out if not added else arithmetic.add(out, residual_ref[...])


def specs(x, w, a, b, shift, layer, gain, residual, tile: tuple[int, int, int], summed: bool):
    """product()'s operands and the block of each that a program of its grid (matrix g, pair tile
    i, column tile j, side s) reads, for tiles of (rows, columns) outputs over n inputs; b the
    rows' x B (G, S, Q) where summed."""
    from jax.experimental import pallas as pl

    rows, columns, n = tile
    layers = w.shape[1]
    pair_tiles = (a.shape[2] if a is not None else x.shape[0]) // rows
    column_tiles = w.shape[2] // columns

    def pair(i):
        return i % pair_tiles

    spec = pl.BlockSpec
    in_specs = [
        spec((1,), lambda g, i, j, s: (0,)),
        spec((rows, n), lambda g, i, j, s: (i, s)),
        spec((1, layers, columns, n), lambda g, i, j, s: (g, 0, j, 0)),
    ]
    operands = [jnp.reshape(layer, (1,)).astype(i32), x, w]
    if a is not None:
        in_specs += [
            spec((1, layers, rows, columns), lambda g, i, j, s: (g, 0, pair(i), j)),
            spec((1, 1, rows), lambda g, i, j, s: (g, s, i))
            if summed
            else spec((1, layers, rows, n), lambda g, i, j, s: (g, 0, pair(i), 0)),
            spec((1,), lambda g, i, j, s: (0,)),
        ]
        operands += [a, b, jnp.reshape(shift, (1,)).astype(i32)]
    if gain is not None and gain.shape[1] == 1:  # noise-free: one gain for every row
        in_specs.append(spec((layers, 1, n), lambda g, i, j, s: (0, 0, 0)))
        operands.append(gain)
    elif gain is not None:
        in_specs.append(spec((layers, rows, n), lambda g, i, j, s: (0, pair(i), s)))
        operands.append(gain)
    if residual is not None:
        place = lambda g, i, j, s: (i, s * column_tiles + j)  # noqa: E731
        in_specs.append(spec((rows, columns), place))
        operands.append(residual)
    return in_specs, operands


def cost(x, w, a, b, gain, residual, out, summed: bool):
    """The cost one product() call declares (Pallas's CostEstimate: 2 operations a MAC): the bytes
    of one layer of each stacked operand (the call reads only `layer`'s), the rows' x B (summed),
    the residual and the output whole."""
    from jax.experimental import pallas as pl

    layers = w.shape[1]
    stacked = sum(o.nbytes // layers for o in (w, a, gain) if o is not None)  # one layer of each
    stacked += 0 if b is None else b.nbytes if summed else b.nbytes // layers
    outputs = math.prod(out.shape)  # int8, written whole, as the residual is read whole
    residual_bytes = residual.nbytes if residual is not None else 0
    moved = x.nbytes + stacked + residual_bytes + outputs
    macs = outputs * w.shape[-1]
    return pl.CostEstimate(flops=2 * macs, transcendentals=0, bytes_accessed=moved)


def product(
    x,
    w,
    a,
    b,
    shift,
    layer,
    gain,
    residual,
    *,
    interpret: bool,
    arithmetic,
    replicas: int = 1,
    tile=None,
    options: Options = DEFAULT,
    xb=None,
):
    """One replica's members' int8 products with G matrices: out[g] = rescale(x' W_g^T + noise
    term), x' the layer norm of x (with a gain) or x, plus the residual (with one), each as
    `arithmetic` says.

    x (Q, S n) int8; w (G, L, m, n); a (G, L, D, m) and b (G, L, D, n): the pairs' rank-1 factors
    (None: noise-free), or in b's place xb (G, S, Q) int32, each row's x' B of this layer summed
    before (Options.sums_noise false); shift () int32, the replica's sigma_shift; layer () int32;
    gain (L, D, S n), (L, 1, n) (every row's) or None; residual (Q, S m) or None. Returns
    (G, Q, S m). A program (int8_product) computes a tile of pairs and outputs of one side of one
    matrix: `tile`'s (rows, columns, depth), or the rule's (tiles, for `replicas` replicas mapped
    over the call) where None, in the options' warps; the same integers any way
    (scripts/gpu_check.py times them). The options' `normalises` is the caller's to honour: a gain
    here is always applied."""
    from jax.experimental import pallas as pl

    pairs = x.shape[0]
    groups, _, m, n = w.shape
    sides = x.shape[1] // n
    noisy = a is not None
    if options.backend == "mosaic":
        if gain is not None or (noisy and xb is None):
            raise ValueError(
                "the Mosaic GPU kernel computes the products alone: no gain, x B given"
            )
        least = -(-options.programs_per_sm * SMS // replicas)  # one replica's share
        chosen = tile or mosaic.tiles(least, groups, pairs, m, n, sides)
        arguments = (x, w, a, xb, shift, layer, residual)
        return mosaic.product(*arguments, interpret=interpret, arithmetic=arithmetic, tile=chosen)
    distinct = a.shape[2] if noisy else pairs
    rows, columns, depth = tile or tiles(replicas, groups, pairs, distinct, m, n, sides, options)
    column_tiles = m // columns
    summed = xb is not None
    b = xb if summed else b
    kinds = dict(noisy=noisy, summed=summed, gained=gain is not None, added=residual is not None)
    program = partial(
        int8_product,
        **kinds,
        tile=(rows, columns, depth, n),
        arithmetic=arithmetic,
    )
    tile_shape = (rows, columns, n)
    in_specs, operands = specs(x, w, a, b, shift, layer, gain, residual, tile_shape, summed)
    out = jax.ShapeDtypeStruct((groups, pairs, sides * m), jnp.int8)
    compiler = None
    if not interpret:
        from jax.experimental.pallas import triton as pallas_triton

        compiler = pallas_triton.CompilerParams(num_warps=options.warps, num_stages=2)
    place = lambda g, i, j, s: (g, i, s * column_tiles + j)  # noqa: E731
    return pl.pallas_call(
        program,
        out_shape=out,
        grid=grid(groups, pairs, m, sides, rows, columns),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((1, rows, columns), place),
        interpret=interpret,
        compiler_params=compiler,
        cost_estimate=cost(x, w, a, b, gain, residual, out, summed),
    )(*operands)


def fault(device, arithmetic: Arithmetic, backend: str = "triton") -> str:
    """Why the kernel of this Pallas backend cannot run on this GPU under this JAX ("" where it
    can), from one tile's program compiled (Pallas's Triton backend is deprecated since JAX 0.11;
    Mosaic GPU is its successor)."""
    from egg.hlo import compile_fault

    def one_tile(x, w):
        options = dict(interpret=False, arithmetic=arithmetic, options=Options(backend=backend))
        return product(x, w, None, None, 0, 0, None, None, **options)

    side = 64 if backend == "mosaic" else 16
    shapes = (((side, side), jnp.int8), ((1, 1, side, side), jnp.int8))
    found = compile_fault(one_tile, device, *shapes)
    which = "Mosaic GPU" if backend == "mosaic" else "Triton"
    return found and f"the {which} product kernel cannot run under JAX {jax.__version__} ({found})"
