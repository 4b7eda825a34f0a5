"""A compiled program's HLO text, read in one place: its computations and instructions; the
collectives and the bytes each device receives through them; and for a GPU program every kernel it
launches, how often (through the loops' known trip counts), the bytes it moves and the int8
multiply-accumulates it does, costed by a stated roofline model."""

from __future__ import annotations

import math
import re
import time
from typing import Any, NamedTuple

DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "s32": 4,
    "u32": 4,
    "s64": 8,
    "u64": 8,
}
DTYPE_BYTES |= {"f16": 2, "bf16": 2, "f32": 4, "f64": 8}
COLLECTIVE_OPS = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
# opcodes that launch nothing on a GPU (bookkeeping, aliases, loop control, the second half of async
# pairs)
NO_KERNEL = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional",
    "call", "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "copy-done",
    "all-gather-done", "all-reduce-done", "collective-permute-done", "async-done", "async-update",
}  # fmt: skip
INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
TRITON = 'custom_call_target="__gpu$xla.gpu.triton"'  # a Pallas kernel compiled for a GPU
MOSAIC = 'custom_call_target="mosaic_gpu'  # one compiled by Pallas's Mosaic GPU backend
CUBLAS = 'custom_call_target="__cublas'  # a product XLA leaves to cuBLAS (full rank's: run.py)


class Instruction(NamedTuple):
    name: str
    shapes: list  # [(dtype, dims)] of its result (several for a tuple)
    opcode: str
    operands: list  # names
    attributes: str  # everything after the operands


def hlo_shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [
        (t, tuple(int(d) for d in dims.split(",") if d))
        for t, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", text)
    ]


def shape_text(shape: tuple[str, tuple[int, ...]]) -> str:
    """An HLO shape as HLO writes it: s8[1024,256]."""
    return f"{shape[0]}[{','.join(map(str, shape[1]))}]"


def hlo_bytes(shapes) -> int:
    return sum(DTYPE_BYTES.get(dtype, 4) * math.prod(dims) for dtype, dims in shapes)


def computations(hlo: str) -> tuple[dict[str, list[Instruction]], str]:
    """{computation: its instructions} of a compiled module's text, and the entry computation's
    name."""
    found, current, entry = {}, None, ""
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY )?%([\w.\-]+) \(.*\{$", line)
        if head:
            current, found[head.group(2)] = head.group(2), []
            entry = head.group(2) if head.group(1) else entry
        elif current and (match := INSTRUCTION.match(line)):
            rest, depth, end = match.group(4), 1, 0
            while depth and end < len(rest):  # the operands end at the matching parenthesis
                depth += {"(": 1, ")": -1}.get(rest[end], 0)
                end += 1
            operands = re.findall(r"%([\w.\-]+)", rest[: end - 1])
            shapes = hlo_shapes(match.group(2))
            found[current].append(
                Instruction(match.group(1), shapes, match.group(3), operands, rest[end:])
            )
    return found, entry


def collective_traffic(hlo: str) -> list[tuple[str, int]]:
    """(operation, bytes each device receives) of every collective in a compiled program: its
    result (an async start returns (operand, result): the result). Only the lines that name a
    collective are parsed: a large program's text runs to megabytes."""
    found = []
    for line in hlo.splitlines():
        if any(op in line for op in COLLECTIVE_OPS) and (match := INSTRUCTION.match(line)):
            opcode, shapes = match.group(3), hlo_shapes(match.group(2))
            if opcode.removesuffix("-start") in COLLECTIVE_OPS:
                found.append(
                    (
                        opcode.removesuffix("-start"),
                        hlo_bytes(shapes[-1:] if opcode.endswith("-start") else shapes),
                    )
                )
    return found


class Compiled(NamedTuple):
    """A program compiled ahead of time, and what it shows before it runs."""

    step: Any  # the compiled program
    seconds: float  # compile time
    temporaries: float  # MiB of the program's own temporaries on a device
    traffic: int  # bytes each device receives through collectives per call

    def describe(self, what: str, call: str) -> str:
        return (
            f"{what} compiled in {self.seconds:.1f} s: {self.traffic:,} bytes of cross-device "
            f"traffic per {call} and device, {self.temporaries:,.1f} MiB of temporaries"
        )


def compile_fault(fn, device, *shapes) -> str:
    """Why fn cannot be compiled for this device with arguments of these shapes and dtypes, in one
    line; "" where it can."""
    import jax

    placed = [
        jax.ShapeDtypeStruct(*s, sharding=jax.sharding.SingleDeviceSharding(device)) for s in shapes
    ]
    try:
        jax.jit(fn).lower(*placed).compile()
    except Exception as error:  # whatever a missing backend or a failing compiler raises
        return f"{type(error).__name__}: {(str(error).strip() or '?').splitlines()[0]}"
    return ""


def compile_now(lowered) -> Compiled:
    """A lowered program compiled now, with its compile time, temporaries and collectives."""
    tick = time.time()
    step = lowered.compile()
    seconds, memory = time.time() - tick, step.memory_analysis()
    traffic = sum(size for _, size in collective_traffic(step.as_text()))
    return Compiled(step, seconds, getattr(memory, "temp_size_in_bytes", 0) / 2**20, traffic)


# ------------------------------------------------------------------------------------------------
# The kernels of a GPU program and their modeled cost.


class Kernel(NamedTuple):
    """One kernel of a compiled GPU program, as its HLO shows it."""

    name: str
    # "gemm" (a dot, or a call of cuBLAS), "fusion", "pallas" (a Pallas kernel), "copy",
    # "collective" or an opcode
    kind: str
    runs: int  # times it runs per call: the trip counts of the loops around it
    # read and written per run, from its operands' and results' shapes (a Pallas kernel: declared)
    bytes: int
    macs: int  # multiply-accumulates per run (a gemm's dot; a Pallas kernel's declared flops / 2)
    # a product's operands and result, e.g. "s8[1024,256] x s8[256,256] -> s32[1024,256]"
    shapes: str


class Roofline(NamedTuple):
    """The cost model's device. A kernel costs max(its bytes / hbm, its MACs / int8_macs) plus what
    launching it costs: `launch` launched on its own, `in_graph` recorded in a command buffer (a
    CUDA graph), whose every launch costs `launch`. HBM and tensor cores overlap; caches and
    on-chip reuse are ignored."""

    name: str
    hbm: float  # bytes/s of device memory
    int8_macs: float  # dense int8 multiply-accumulates/s on the tensor cores
    launch: float  # seconds a launch costs beyond the work (a kernel's or a graph's), assumed
    in_graph: float = 0.0  # seconds a kernel in a graph costs beyond its work, assumed


# ops a fusion may apply before slicing a parameter
ELEMENTWISE_VIEWS = ("convert", "bitcast", "copy")


def fusion_cost(body: list[Instruction], result) -> tuple[str, int, int, str]:
    """(kind, bytes, MACs, gemm shapes) of a fused kernel: each parameter read whole, except one
    that is only sliced, maybe after a conversion (the slices' entries are read), or updated in
    place (not read); the result written, less what an in-place update leaves untouched."""
    named = {x.name: x for x in body}
    users_of = {x.name: [u for u in body if x.name in u.operands] for x in body}

    def sliced_entries(name: str) -> int | None:
        """Entries of `name` that its users read through slices, or None where one reads it
        whole."""
        entries = 0
        for u in users_of[name]:
            if u.operands[0] != name:
                return None
            if u.opcode in ("dynamic-slice", "slice", "gather"):
                entries += sum(math.prod(dims) for _, dims in u.shapes)
            elif u.opcode in ELEMENTWISE_VIEWS and (inner := sliced_entries(u.name)) is not None:
                entries += inner
            elif u.opcode != "dynamic-update-slice":  # an in-place update reads nothing
                return None
        return entries

    total = hlo_bytes(result)
    for parameter in (x for x in body if x.opcode == "parameter"):
        entries = sliced_entries(parameter.name) if users_of[parameter.name] else None
        if entries is None:
            total += hlo_bytes(parameter.shapes)
        else:
            total += entries * DTYPE_BYTES.get(parameter.shapes[0][0], 4)
        for u in users_of[parameter.name]:  # in place: only the update is written
            if u.opcode == "dynamic-update-slice" and entries is not None:
                total -= hlo_bytes(u.shapes) - hlo_bytes(named[u.operands[1]].shapes)
    macs, shapes = 0, ""
    for dot in (x for x in body if x.opcode == "dot"):
        lhs, rhs = (named[o].shapes[0] for o in dot.operands[:2])
        macs += math.prod(dot.shapes[0][1]) * math.prod(product_depths(dot, lhs))
        shapes = f"{shape_text(lhs)} x {shape_text(rhs)} -> {shape_text(dot.shapes[0])}"
    return ("gemm" if macs else "fusion"), total, macs, shapes


def is_product(x: Instruction) -> bool:
    """An XLA product: a dot (alone, or in a fusion: a Triton GEMM), or a call of cuBLAS."""
    return x.opcode == "dot" or (x.opcode == "custom-call" and CUBLAS in x.attributes)


def product_depths(x: Instruction, lhs: tuple[str, tuple[int, ...]]) -> list[int]:
    """The contracted dims of a product (is_product) whose left operand's shape is `lhs`: a dot
    states them as lhs_contracting_dims, a cuBLAS call in its backend config."""
    if x.opcode == "dot":
        contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", x.attributes).group(1)
        dims = [int(d) for d in contracting.split(",") if d]
    else:
        found = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', x.attributes).group(1)
        dims = [int(d) for d in re.findall(r"\d+", found)]
    return [lhs[1][d] for d in dims]


def signature(operands, results) -> tuple:
    """A kernel call's operand and result dims, the key by which a Pallas kernel's declared cost is
    found (pallas_costs)."""
    return tuple(tuple(dims) for dims in operands), tuple(tuple(dims) for dims in results)


def trip_count(x: Instruction) -> int | None:
    """A while loop's known trip count (None where XLA does not know it: then it runs the loop's
    condition every trip and its host reads the answer)."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', x.attributes)
    return int(known[1]) if known else None


def gpu_kernels(hlo: str, pallas_costs: dict | None = None) -> list[Kernel]:
    """Every kernel a compiled GPU program launches, with how often per call (while loops multiply
    by their known trip counts). A Pallas kernel's bytes and MACs are its declared cost, from
    `pallas_costs` ({signature: (bytes, MACs)}; 0 where none is known)."""
    found, entry = computations(hlo)
    kernels = []

    def called(x: Instruction, key: str) -> str:
        return re.search(key + r"=%([\w.\-]+)", x.attributes).group(1)

    def walk(computation: str, runs: int) -> None:
        shapes = {x.name: x.shapes for x in found[computation]}
        for x in found[computation]:
            if x.opcode == "while":  # with a known trip count XLA runs no condition
                trips = trip_count(x)
                walk(called(x, "body"), runs * (trips or 1))
                if trips is None:
                    walk(called(x, "condition"), runs)
            elif x.opcode == "call":
                walk(called(x, "to_apply"), runs)
            elif x.opcode == "fusion":
                kind, size, macs, gemm = fusion_cost(found[called(x, "calls")], x.shapes)
                kernels.append(Kernel(x.name, kind, runs, size, macs, gemm))
            elif x.opcode == "custom-call" and (TRITON in x.attributes or MOSAIC in x.attributes):
                ins = [shapes[o][0] for o in x.operands]
                key = signature([dims for _, dims in ins], [dims for _, dims in x.shapes])
                size, macs = (pallas_costs or {}).get(key, (0, 0))
                pair = ins[1:3] if TRITON in x.attributes else ins[:2]  # x, W after any scalars
                gemm = f"{' x '.join(map(shape_text, pair))} -> {shape_text(x.shapes[0])}"
                kernels.append(Kernel(x.name, "pallas", runs, size, macs, gemm))
            elif is_product(x):
                lhs, rhs = (shapes[o][0] for o in x.operands[:2])
                macs = math.prod(x.shapes[0][1]) * math.prod(product_depths(x, lhs))
                size = hlo_bytes([lhs, rhs, x.shapes[0]])
                gemm = f"{shape_text(lhs)} x {shape_text(rhs)} -> {shape_text(x.shapes[0])}"
                kernels.append(Kernel(x.name, "gemm", runs, size, macs, gemm))
            elif x.opcode not in NO_KERNEL:
                collective = x.opcode.removesuffix("-start") in COLLECTIVE_OPS
                kind = "collective" if collective else "copy" if "copy" in x.opcode else x.opcode
                size = hlo_bytes(x.shapes) + sum(hlo_bytes(shapes.get(o, [])) for o in x.operands)
                kernels.append(Kernel(x.name, kind, runs, size, 0, ""))

    walk(entry, 1)
    return kernels


# ------------------------------------------------------------------------------------------------
# Command buffers: the kernels XLA's GPU runtime records into CUDA graphs, and the graphs it
# launches. The compiled HLO does not show them; the thunk sequence that XLA dumps after its thunk
# passes does (`--xla_dump_to`): a line a thunk, `NNN: kKind [...] name grid: [x, y, z] ...`,
# indented under the command buffer or loop that holds it, NNN the thunk's id, which the dumped
# thunk metadata maps to its HLO instruction ("profile_annotation").

THUNK = re.compile(r"^(\s*)(\d+): (k\w+)\s+\[[^\]]*\]\s*(.*)$")
ANNOTATION = re.compile(r'profile_annotation: "([^"]*)"\s*thunk_id: (\d+)')


class Launches(NamedTuple):
    """How a compiled GPU program launches its kernels, per call."""

    graphs: int  # command buffers (CUDA graphs) launched, each loop's counted by its trips
    captured: frozenset  # the HLO names of the kernels recorded in a command buffer
    grids: dict  # {HLO name: its launch's grid of blocks (CTAs), (x, y, z)}


def launches(sequence: str, metadata: str, hlo: str) -> Launches:
    """The Launches of a program from XLA's dumps: its thunk sequence after the thunk passes, its
    thunk metadata and its compiled HLO (for the loops' trip counts)."""
    names = {int(i): name for name, i in ANNOTATION.findall(metadata)}
    trips = {x.name: trip_count(x) or 1 for body in computations(hlo)[0].values() for x in body}
    graphs, captured, grids = 0, set(), {}
    around = []  # (indent, kind, runs) of the thunks that hold this line's
    for line in sequence.splitlines():
        if not (match := THUNK.match(line)):
            continue  # a loop's "condition:" or "body:"
        indent, name, kind = len(match[1]), names.get(int(match[2]), ""), match[3]
        while around and around[-1][0] >= indent:
            around.pop()
        runs = around[-1][2] if around else 1
        recorded = any(k == "kCommandBuffer" for _, k, _ in around)
        if kind == "kCommandBuffer" and not recorded:
            graphs += runs
        if recorded and name:
            captured.add(name)
        if grid := re.search(r"grid: \[(\d+), (\d+), (\d+)\]", match[4]):
            grids[name] = tuple(int(g) for g in grid.groups())
        around.append((indent, kind, runs * trips.get(name, 1) if kind == "kWhile" else runs))
    return Launches(graphs, frozenset(captured), grids)


def modeled_seconds(
    kernels: list[Kernel], roofline: Roofline, launched: Launches | None = None
) -> float:
    """The cost model's time of one call of the program (Roofline): every kernel launched on its
    own, unless `launched` says which are in graphs and how many graphs are launched."""
    captured = launched.captured if launched else frozenset()
    work = sum(
        k.runs
        * (
            max(k.bytes / roofline.hbm, k.macs / roofline.int8_macs)
            + (roofline.in_graph if k.name in captured else roofline.launch)
        )
        for k in kernels
    )
    return work + (launched.graphs * roofline.launch if launched else 0.0)


# ------------------------------------------------------------------------------------------------
# A GPU kernel's machine code as PTX (XLA's dump of a compiled program): its MMA instructions, the
# integer work beside them, and whether the tensor cores' asynchronous MMAs overlap that work.

PTX_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\(")
PTX_LABEL = re.compile(r"^(\$\w+):")
PTX_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$\w+);")
PTX_MMA = ("wgmma.mma_async", "mma.")  # how an MMA instruction starts
# integer arithmetic, comparisons, selections, conversions and byte permutations: CUDA-core work
PTX_INTEGER = {
    "add", "sub", "mul", "mad", "mul24", "mad24", "sad", "div", "rem", "abs", "neg", "min", "max",
    "shl", "shr", "and", "or", "xor", "not", "cvt", "selp", "setp", "slct", "prmt", "bfe", "bfi",
    "popc", "clz",
}  # fmt: skip


class MmaCode(NamedTuple):
    """A kernel's MMA loop as its PTX states it (each instruction counted once, however often it
    runs: the loop around its MMAs where it has one, else the kernel): its MMA instructions (kind:
    "wgmma", Hopper's asynchronous warpgroup MMA, or "mma.sync"; "" where it has none), the integer
    instructions beside them, and of the wgmma groups committed, those waited for (wait_group 0)
    before any instruction but register moves: the tensor cores then overlap none of the integer
    work (ptxas may add waits of its own; it says so with -v); and the most wgmma groups a wait
    leaves in flight (wgmma.wait_group N: N, 0 where each is waited for)."""

    kind: str
    shape: str  # the MMA's shape, e.g. m64n128k32
    mmas: int
    integer: int
    groups: int
    waited_at_once: int
    in_flight: int = 0


def ptx_entries(ptx: str) -> dict[str, list[str]]:
    """{kernel name: its instructions, one a line (comments, braces and declarations left out; a
    line of several, as Mosaic GPU writes its inline assembly, split)} of a PTX module."""
    entries, name = {}, None
    for line in ptx.splitlines():
        found = PTX_ENTRY.search(line)
        if found:
            name = found.group(1)
            entries[name] = []
            continue
        code = line.split("//")[0].strip()
        if name is None or not code:
            continue
        end = ";" if ";" in code else ""
        for statement in code.split(";"):
            statement = " ".join(statement.split()).removeprefix("{").strip()
            if statement not in ("", "}") and not statement.startswith(".reg"):
                entries[name].append(statement + end)
    return entries


def mma_loop(lines: list[str]) -> list[str]:
    """The innermost loop (a label and a later branch back to it) holding an MMA, else all."""
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := PTX_LABEL.match(line))}
    mmas = [i for i, line in enumerate(lines) if line.startswith(PTX_MMA)]
    loops = [
        (labels[m.group(1)], i)
        for i, line in enumerate(lines)
        if (m := PTX_BRANCH.search(line)) and labels.get(m.group(1), i) < i
    ]
    around = [(a, b) for a, b in loops if mmas and any(a < i < b for i in mmas)]
    if not around:
        return lines
    start, end = min(around, key=lambda loop: loop[1] - loop[0])
    return lines[start : end + 1]


def mma_code(lines: list[str]) -> MmaCode:
    """MmaCode of one kernel's instructions (ptx_entries)."""
    instructions = [line for line in mma_loop(lines) if not PTX_LABEL.match(line)]
    mmas = [line.split()[0] for line in instructions if line.startswith(PTX_MMA)]
    kind = "" if not mmas else "wgmma" if mmas[0].startswith("wgmma") else "mma.sync"
    shape = re.search(r"\.(m\d+n\d+k\d+)", mmas[0]).group(1) if mmas else ""
    commits = [i for i, line in enumerate(instructions) if line.startswith("wgmma.commit_group")]

    def at_once(i: int) -> bool:  # the wait comes before any work but register moves
        for line in instructions[i + 1 :]:
            if line.startswith("wgmma.wait_group.sync.aligned 0"):
                return True
            if not line.startswith("mov."):
                return False
        return False

    waited = sum(at_once(i) for i in commits)
    integer = sum(line.split()[0].split(".")[0] in PTX_INTEGER for line in instructions)
    waits = [re.search(r"wait_group\S*\s+(\d+)", x) for x in instructions if "wgmma.wait" in x]
    in_flight = max((int(w.group(1)) for w in waits if w), default=0)
    return MmaCode(kind, shape, len(mmas), integer, len(commits), waited, in_flight)
