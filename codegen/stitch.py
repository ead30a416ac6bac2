"""The global TE program -> ONE PrimFunc.

Each region is scheduled on its own (a plain PrimFunc from ``te.create_prim_func``),
then its body is placed in the global function with its parameters re-declared
as views (``DeclBuffer`` with ``data=address_of(...)``) into flat global buffers:
model inputs, weights, outputs, and one scratch arena per dtype for tensors that
cross regions. A scan becomes a serial ``For`` around its body's statements;
weights that differ per iteration are stacked at compile time and viewed at
``offset = i * size``, and carried state ping-pongs between two arena slots.
The result is one function per model, whatever its depth, compiled once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import tvm
from tvm import tirx

from souffle import recipe
from souffle.errors import GraphError
from souffle.graph import Graph, TensorSpec
from souffle.lower import LoopRegion, Region, TEProgram
from souffle.naming import c_name

Scheduler = Callable[[tvm.tirx.PrimFunc], tvm.tirx.PrimFunc]


@dataclass
class BufferRef:
    """A tensor's place: ``base`` (a flat global buffer) at element ``offset``."""

    base: tirx.Buffer
    offset: object  # int or PrimExpr in loop variables
    spec: TensorSpec

    def pointer(self):
        return tirx.address_of(tirx.BufferLoad(self.base, [tirx.const(0, "int64") + self.offset]))

    def element(self, i):
        return tirx.BufferLoad(self.base, [self.offset + i])


@dataclass
class Arena:
    """Scratch memory, one flat buffer per dtype; offsets handed out in order."""

    sizes: dict[str, int] = field(default_factory=dict)
    buffers: dict[str, tirx.Buffer] = field(default_factory=dict)

    def alloc(self, spec: TensorSpec, count: int = 1) -> BufferRef:
        dtype = spec.dtype
        if dtype not in self.buffers:
            self.buffers[dtype] = tirx.decl_buffer((tirx.Var(f"arena_{dtype}_n", "int64"),), dtype, name=f"arena_{dtype}")
            self.sizes[dtype] = 0
        offset = align(self.sizes[dtype])
        self.sizes[dtype] = offset + spec.size * count
        return BufferRef(self.buffers[dtype], offset, spec)


ARENA_ALIGN = 16  # elements; 64 bytes of float32, one cache line


def seq(stmts: list[tirx.Stmt]) -> tirx.Stmt:
    """Statements in order (TVM refuses a sequence of one: a model whose only statement is
    one copy, as when its output is one of its inputs)."""
    return stmts[0] if len(stmts) == 1 else tirx.SeqStmt(stmts)


def align(n: int, elements: int = ARENA_ALIGN) -> int:
    """``n`` rounded up to a whole number of ``elements`` (where an arena tensor may start)."""
    return (n + elements - 1) // elements * elements


@dataclass
class StitchedProgram:
    """The one PrimFunc and what the runtime must pass it, in parameter order."""

    func: tirx.PrimFunc
    inputs: list[TensorSpec]
    weights: list[tuple[TensorSpec, np.ndarray]]  # includes per-scan stacked weights
    outputs: list[TensorSpec]
    arena_sizes: dict[str, int]

    def kernel_count(self, executed: bool = False) -> int:
        """One function, whatever the model (the same count run per inference)."""
        return 1

    def summary(self) -> dict[str, str]:
        """Report lines beyond the common ones: none."""
        return {}

    def __str__(self):
        return self.func.script()


class Stitcher:
    """Binds every tensor of the program to a place in memory and emits each region's code.

    The placement (inputs, weights, outputs, arena slots, a scan's ping-pong carries, sliced
    sequences and stacked per-iteration weights) is shared by the LLVM function built here and
    the persistent kernel's staged program (``codegen.stage``), which overrides what a
    region, a copy and a loop become.
    """

    def __init__(self, graph: Graph, scheduler: Scheduler | None, arena=None):
        self.graph = graph
        self.scheduler = scheduler
        self.arena = arena if arena is not None else Arena()
        self.weight_values: dict[str, np.ndarray] = dict(graph.weights or {})
        self.recipes: dict[str, list] = {}  # a weight -> how it is made from the model's (souffle.recipe)
        self.weight_buffers: dict[str, tirx.Buffer] = {}
        self.carry_slots: dict[tuple[str, str], BufferRef] = {}  # (loop, carry) -> slots its init is computed into

    def flat(self, spec: TensorSpec, name: str) -> tirx.Buffer:
        return tirx.decl_buffer((spec.size,), spec.dtype, name=name)

    def weight_ref(self, name: str, spec: TensorSpec) -> BufferRef:
        if name not in self.weight_buffers:
            self.weight_buffers[name] = self.flat(TensorSpec(name, self.weight_values[name].shape, spec.dtype), c_name(name))
        return BufferRef(self.weight_buffers[name], 0, spec)

    def resolve(self, refs: dict[str, BufferRef], name: str) -> BufferRef:
        """A tensor's place; top-level weights get a global buffer on first use."""
        if name in refs:
            return refs[name]
        return self.weight_ref(name, self.graph.params[name])

    def copy(self, src: BufferRef, dst: BufferRef):
        i = tirx.Var("i", "int64")
        store = tirx.BufferStore(dst.base, src.element(i), [dst.offset + i])
        return tirx.For(i, 0, src.spec.size, tirx.ForKind.SERIAL, store)

    def region(self, region: Region, refs: dict[str, BufferRef]) -> list:
        func = self.scheduler(region.prim_func())
        names = region.inputs + region.outputs
        decls = [tirx.DeclBuffer(param, data=self.resolve(refs, name).pointer()) for param, name in zip(func.params, names)]
        return [tirx.SeqStmt(decls + [func.body])]

    def make_loop(self, var: tirx.Var, trips: int, body: list, name: str):
        return tirx.For(var, 0, trips, tirx.ForKind.SERIAL, seq(body))

    def program(self, program: TEProgram, refs: dict[str, BufferRef]) -> list:
        self.place_carry_inits(program, refs)
        stmts: list = []
        for region in program.regions:
            if isinstance(region, LoopRegion):
                stmts.extend(self.loop(region, program.graph, refs))
                continue
            for name in region.outputs:
                if name not in refs:
                    refs[name] = self.arena.alloc(program.graph.tensors[name])
            stmts.extend(self.region(region, refs))
        return stmts

    def place_carry_inits(self, program: TEProgram, refs: dict[str, BufferRef]):
        """A carry's initial value that the program computes only for that carry is written
        straight into the carry's first slot, saving the copy into it."""
        graph = program.graph
        computed = {name for region in program.regions if isinstance(region, Region) for name in region.outputs}
        uses: dict[str, int] = {name: graph.outputs.count(name) for name in computed}
        for op in graph.ops:
            for name in op.inputs:
                if name in uses:
                    uses[name] += 1
        for region in program.regions:
            if not isinstance(region, LoopRegion):
                continue
            for body_in, _, init, _ in region.scan.carry:
                if init in computed and init not in refs and uses[init] == 1:
                    spec = region.body.graph.tensors[body_in]
                    slots = self.arena.alloc(spec, count=2)
                    self.carry_slots[(region.name, body_in)] = slots
                    refs[init] = BufferRef(slots.base, slots.offset, graph.tensors[init])

    def loop(self, region: LoopRegion, graph: Graph, refs: dict[str, BufferRef]) -> list:
        """A scan as a serial loop; carried state ping-pongs between two arena slots."""
        scan, body = region.scan, region.body.graph
        i = tirx.Var(f"{region.name}_i", "int64")
        before: list[tirx.Stmt] = []
        after_body: list[tirx.Stmt] = []
        after_loop: list[tirx.Stmt] = []
        body_refs: dict[str, BufferRef] = {}
        for body_in, body_out, init, final in scan.carry:
            spec = body.tensors[body_in]
            placed = self.carry_slots.get((region.name, body_in))
            slots = placed or self.arena.alloc(spec, count=2)
            slot_at = lambda k, s=slots, sp=spec: BufferRef(s.base, s.offset + (k % 2) * sp.size, sp)
            if placed is None:
                before.append(self.copy(self.resolve(refs, init), slot_at(0)))
            body_refs[body_in] = BufferRef(slots.base, slots.offset + tirx.floormod(i, 2) * spec.size, spec)
            next_slot = BufferRef(slots.base, slots.offset + tirx.floormod(i + 1, 2) * spec.size, spec)
            if body_out in body_refs:
                after_body.append(self.copy(body_refs[body_out], next_slot))
            else:
                body_refs[body_out] = next_slot
            if final in refs:  # bound to a graph output buffer
                after_loop.append(self.copy(slot_at(scan.length), refs[final]))
            else:
                refs[final] = slot_at(scan.length)
        for body_in, seq in scan.xs:
            spec = body.tensors[body_in]
            source = self.resolve(refs, seq)
            body_refs[body_in] = BufferRef(source.base, source.offset + i * spec.size, spec)
        for body_in, name in scan.invariants:
            source = self.resolve(refs, name)
            body_refs[body_in] = BufferRef(source.base, source.offset, body.tensors[body_in])
        for body_param, names in scan.params:
            spec = body.params[body_param]
            if len(set(names)) == 1:
                source = self.resolve(refs, names[0])
                body_refs[body_param] = BufferRef(source.base, source.offset, spec)
                continue
            stacked_name = f"{scan.name}/{body_param}"
            unknown = [n for n in names if n not in self.weight_values]
            if unknown:
                raise GraphError(
                    f"scan {scan.name!r}: parameter {body_param!r} varies per iteration, so each binding "
                    f"must be a model weight; {unknown[0]!r} is not"
                )
            if stacked_name not in self.weight_values:
                self.weight_values[stacked_name] = np.stack([self.weight_values[n] for n in names])
                self.recipes[stacked_name] = recipe.stack([self.graph.recipe(n) for n in names])
            stacked = self.weight_ref(stacked_name, spec)
            body_refs[body_param] = BufferRef(stacked.base, i * spec.size, spec)
        for body_out, seq in scan.ys:
            spec = body.tensors[body_out]
            if seq not in refs:
                refs[seq] = self.arena.alloc(graph.tensors[seq])
            target = BufferRef(refs[seq].base, refs[seq].offset + i * spec.size, spec)
            if body_out in body_refs:
                after_body.append(self.copy(body_refs[body_out], target))
            else:
                body_refs[body_out] = target
        body_stmts = self.program(region.body, body_refs) + after_body
        return before + [self.make_loop(i, scan.length, body_stmts, region.name)] + after_loop


    def whole(self, program: TEProgram) -> tuple[list, list[tirx.Buffer], list[tirx.Buffer]]:
        """The program's code, with its input and output buffers (in the graph's order)."""
        graph = program.graph
        refs: dict[str, BufferRef] = {}
        input_buffers = [self.flat(spec, c_name(spec.name)) for spec in graph.inputs]
        for spec, buf in zip(graph.inputs, input_buffers):
            refs[spec.name] = BufferRef(buf, 0, spec)
        output_buffers = [self.flat(spec, f"out{k}_{c_name(spec.name)}") for k, spec in enumerate(graph.output_specs())]
        copies_at_end = []
        for spec, buf in zip(graph.output_specs(), output_buffers):
            ref = BufferRef(buf, 0, spec)
            if spec.name in refs or spec.name in graph.params:  # an input, a weight, or listed twice
                copies_at_end.append((spec.name, ref))
            else:
                refs[spec.name] = ref
        stmts = self.program(program, refs)
        stmts += [self.copy(self.resolve(refs, name), dst) for name, dst in copies_at_end]
        return stmts, input_buffers, output_buffers

    def weight_recipe(self, name: str) -> list:
        return self.recipes.get(name) or self.graph.recipe(name)

    def weights(self) -> tuple[list[tuple[TensorSpec, np.ndarray]], list[tirx.Buffer]]:
        """The weights the code reads (per-scan stacks included) and their buffers, in parameter order."""
        values = [(TensorSpec(n, self.weight_values[n].shape, str(self.weight_values[n].dtype)), self.weight_values[n])
                  for n in self.weight_buffers]
        return values, list(self.weight_buffers.values())


def stitch(program: TEProgram, scheduler: Scheduler) -> StitchedProgram:
    """One PrimFunc for the whole program, each region scheduled by ``scheduler``."""
    st = Stitcher(program.graph, scheduler)
    stmts, input_buffers, output_buffers = st.whole(program)
    weights, weight_buffers = st.weights()
    arenas = list(st.arena.buffers.values())
    params = input_buffers + weight_buffers + output_buffers + arenas
    # No "tirx.noalias": with it TVM gives every view (a let-bound pointer into the arena or
    # an output) its own alias tag, and LLVM then moves a consumer's load above the store
    # that a producer made through another view of the same memory (stale results;
    # tests/test_stitch.py's poisoned-arena runs catch it).
    func = tirx.PrimFunc(params, seq(stmts)).with_attr("global_symbol", "main")
    return StitchedProgram(func, list(program.graph.inputs), weights, program.graph.output_specs(),
                           dict(st.arena.sizes))
