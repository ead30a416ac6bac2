"""Semantic-preserving transformations of the global program, and the ablation levels.

Each transformation is a pure function that returns a new program and says what it did:

- ``horizontal`` (``codegen.horizontal``): independent GEMMs with the same shape reading the
  same activation become one, their weights concatenated at compile time;
- ``wavefront`` (``codegen.wavefront``): the stacked LSTM's cells run by wavefront (cell
  (l, t) in step l + t), all layers of a step batched into one cell;
- ``vertical`` (here): one-relies-on-one TEs are inlined into their consumers, so reshapes,
  transposes, bias adds and activations are never materialized.

The first two rewrite the graph (they create concatenated weights and a new scan, which live
there) before it is lowered; ``vertical`` rewrites the TE program. ``optimize`` applies what
an opt level asks for; the staging of the persistent kernel (``codegen.staging``) adds the
levels' barrier and kernel decisions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tvm
from tvm import te

from analysis.affine import Rewriter, recompute
from analysis.dependence import IF_THEN_ELSE, TENSOR_LOAD, is_call_to
from souffle.errors import SouffleError
from souffle.graph import Graph
from souffle.lower import LoopRegion, Region, TEProgram, lower_graph

OPT_LEVELS = (0, 1, 2, 3, 4)
DEFAULT_OPT_LEVEL = 4
LEVEL_NAMES = {
    0: "one kernel per TE",
    1: "+ horizontal (and the LSTM wavefront)",
    2: "+ vertical (one-relies-on-one TEs inlined)",
    3: "+ global sync (one kernel per subprogram, a grid barrier between stages)",
    4: "+ post-optimizations (barriers only where data crosses blocks)",
}


@dataclass
class Optimized:
    """The program an opt level produced, and what each transformation did."""

    level: int
    program: TEProgram
    log: list[str] = field(default_factory=list)


def check_level(level) -> int:
    if not isinstance(level, int) or isinstance(level, bool) or level not in OPT_LEVELS:
        raise SouffleError(f"opt level must be one of {', '.join(map(str, OPT_LEVELS))}, got {level!r}")
    return level


def optimize(graph: Graph, level: int = DEFAULT_OPT_LEVEL) -> Optimized:
    """Lower ``graph`` with the transformations of ``level``: from O1 the graph rewrites
    (wavefront, horizontal), from O2 vertical inlining of the lowered program."""
    from codegen.horizontal import horizontal
    from codegen.wavefront import wavefront

    check_level(level)
    log: list[str] = []
    if level >= 1:
        graph, done = wavefront(graph)
        log += [f"wavefront: {line}" for line in done]
        graph, done = horizontal(graph)
        log += [f"horizontal: {line}" for line in done]
    program = lower_graph(graph)
    if level >= 2:
        before = program.te_count()
        program = vertical(program)
        log.append(f"vertical: {before - program.te_count()} one-relies-on-one TEs inlined, "
                   f"{program.te_count()} TEs left")
    return Optimized(level, program, log)


# -- vertical: inlining one-relies-on-one TEs ---------------------------------------------------
def inlinable(stage: te.Tensor, consumers: list[te.Tensor]) -> bool:
    """Whether ``stage`` can be recomputed inside each consumer instead of being stored.

    It must compute each element from the elements at fixed places of its inputs (no
    reduction), and the recomputation must stay cheap: into element-wise consumers anything
    element-wise goes; into a reduction (a GEMM reading a transposed operand) only a TE whose
    every value is an element of an input or a constant (reshape, transpose, slice, concat,
    padding), since arithmetic there would be redone for every reduction step.
    """
    op = stage.op
    if not isinstance(op, te.ComputeOp) or op.reduce_axis or len(op.body) != 1 or not consumers:
        return False
    return selects_elements(op.body[0]) or all(not c.op.reduce_axis for c in consumers)


def selects_elements(expr) -> bool:
    """Whether every value of ``expr`` is a tensor element or a constant, chosen by conditions."""
    if is_call_to(expr, TENSOR_LOAD) or isinstance(expr, (tvm.tirx.IntImm, tvm.tirx.FloatImm)):
        return True
    if isinstance(expr, tvm.tirx.Select):
        return selects_elements(expr.true_value) and selects_elements(expr.false_value)
    if is_call_to(expr, IF_THEN_ELSE):
        return selects_elements(expr.args[1]) and selects_elements(expr.args[2])
    return False


def vertical(program: TEProgram) -> TEProgram:
    """``program`` with every inlinable TE (see ``inlinable``) folded into its consumers.

    TEs a later region, a loop or the graph's outputs read keep their own buffer; the rest of
    each region is rebuilt in topological order, a load of an inlined TE replaced by its body
    at the load's indices (simplified with the axes' ranges).
    """
    renamed: dict = {}
    return _vertical(program, renamed)


def _vertical(program: TEProgram, renamed: dict) -> TEProgram:
    regions = []
    for region in program.regions:
        if isinstance(region, LoopRegion):
            regions.append(LoopRegion(region.name, region.scan, _vertical(region.body, renamed)))
        else:
            regions.append(_inline_region(region, renamed))
    links = {holder: renamed.get(producer.op, producer) for holder, producer in program.links.items()}
    return TEProgram(program.graph, regions, links)


def _inline_region(region: Region, renamed: dict) -> Region:
    stages = region.stages()
    kept = {t.op for t in region.output_tensors}
    readers: dict = {}
    for stage in stages:
        for producer in stage.op.input_tensors:
            readers.setdefault(producer.op, []).append(stage)
    inlined: dict = {}  # old op -> its rebuilt TE, to be substituted at every load
    new: dict = {}  # old op -> its rebuilt TE, stored
    for stage in stages:
        rebuilt = _rebuild(stage, inlined, new)
        if stage.op not in kept and inlinable(rebuilt, readers.get(stage.op, [])):
            inlined[stage.op] = rebuilt
        else:
            new[stage.op] = rebuilt
            renamed[stage.op] = rebuilt
    tensors = {name: new.get(t.op, t) for name, t in region.tensors.items() if t.op not in inlined}
    op_of = {new[op].op: origin for op, origin in region.op_of.items() if op in new}
    return Region(region.name, region.ops, region.inputs, region.outputs, tensors, op_of)


def _rebuild(stage: te.Tensor, inlined: dict, new: dict) -> te.Tensor:
    """``stage`` over the rebuilt TEs, with the inlined ones substituted."""
    if not any(t.op in inlined or t.op in new for t in stage.op.input_tensors):
        return stage

    def load(tensor, indices, simplify):
        indices = [simplify(i) for i in indices]
        if tensor.op in inlined:
            return _substitute(inlined[tensor.op], indices)
        return new.get(tensor.op, tensor)(*indices)

    return recompute(stage, load, f"inlining into {stage.op.name}")


def _substitute(producer: te.Tensor, indices: list) -> tvm.tirx.PrimExpr:
    """The producer's value at ``indices``: its body with its axes bound to them."""
    variables = {ax.var: index for ax, index in zip(producer.op.axis, indices)}
    return Rewriter(variables, f"inlining {producer.op.name}")(producer.op.body[0])
