"""The ``vertical`` transformation (from O2): one-relies-on-one TEs inlined into their consumers.

A TE that computes each element from the elements at fixed places of its inputs (a reshape, a
transpose, a bias add, an activation) is recomputed inside each consumer instead of being
stored, so it is never materialized: fewer stages, fewer barriers, less memory traffic.
"""

from __future__ import annotations

import tvm
from tvm import te

from analysis.affine import Rewriter, recompute
from analysis.dependence import IF_THEN_ELSE, TENSOR_LOAD, is_call_to
from codegen.cpu_math import MAX_NESTED_EXPANDED_CALLS, MAX_NESTED_SELECTS, nested_expanded_calls, nested_selects
from souffle.lower import LoopRegion, Region, TEProgram
from souffle.passes import Outcome


def inline_one_relies_on_one(program: TEProgram) -> Outcome:
    """``vertical``, saying how many TEs it inlined."""
    inlined = vertical(program)
    return Outcome(inlined, [f"{program.te_count() - inlined.te_count()} one-relies-on-one TEs inlined, "
                             f"{inlined.te_count()} TEs left"])


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
    nested, selects = nested_expanded_calls(op.body[0]), nested_selects(op.body[0])
    if any(nested + _nested(c, nested_expanded_calls) > MAX_NESTED_EXPANDED_CALLS
           or selects + _nested(c, nested_selects) > MAX_NESTED_SELECTS for c in consumers):
        return False
    return selects_elements(op.body[0]) or all(not c.op.reduce_axis for c in consumers)


def _nested(consumer: te.Tensor, depth) -> int:
    body = getattr(consumer.op, "body", ())
    return max((depth(b) for b in body), default=0)


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
