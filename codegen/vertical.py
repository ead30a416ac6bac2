"""The ``vertical`` transformation (from O2): one-relies-on-one TEs inlined into their consumers.

A TE that computes each element from the elements at fixed places of its inputs (a reshape, a
transpose, a bias add, an activation) is recomputed inside each consumer instead of being
stored, so it is never materialized: fewer stages, fewer barriers, less memory traffic.

Arithmetic is stored where it is computed, not where a chain of layout TEs ends: a GEMM's bias
add and cast followed by the slices, reshapes and transposes that lead to another GEMM
(BERT's query, key and value) would otherwise be carried down the chain into each layout TE
(arithmetic cannot go into a reduction), one stored TE per chain and a grid barrier after the
GEMM. Stored before the chain, it is one TE in the GEMM's own layout, which ``fuse_epilogues``
runs in the GEMM's tiles, and the layout TEs are pure index maps the next GEMM reads through.
Where it reads the GEMM through a reshape (Swin's GELU over [1, 56, 56, 512] of a [3136, 512]
product), it is stored in the GEMM's shape and its readers read it through the reshape. So is an
element-wise TE stored for another reason (a reduction reads it) that reads a reduction through a
reshape, each result at its own position: Swin's relative position bias added to the [256, 49, 49]
scores read as [64, 4, 49, 49], which the softmax reads. In the scores' shape it is their epilogue
(``codegen.epilogues``), not a stage of its own behind a grid barrier. The same goes for one that
reads it through a permutation TVM can invert (``_in_permuted_order``: Swin's residual sum reading
the attention projection through the window reverse), stored in the reduction's order.

A value stored narrow for a reader that widens it (``_before_widening``) is what the value's
other readers read: an element-wise TE inlined into that cast is not computed again elsewhere.
"""

from __future__ import annotations

import islpy as isl
import numpy as np
import tvm
from tvm import te, tirx
from tvm_ffi import structural_equal

from analysis.affine import Rewriter, reads_tensor, recompute, row_major, unravel
from analysis.characterize import is_gemm, same_elements_axis
from analysis.dependence import (IF_THEN_ELSE, TENSOR_LOAD, access_relations, is_call_to, iteration_domain,
                                 tensor_loads)
from codegen.cpu_math import MAX_NESTED_EXPANDED_CALLS, MAX_NESTED_SELECTS, nested_expanded_calls, nested_selects
from codegen.schedule import SAME_ELEMENTS_AXIS_MAX, scaled_factors
from souffle.lower import LoopRegion, Region, TEProgram
from souffle.passes import Outcome


def inline_one_relies_on_one(program: TEProgram) -> Outcome:
    """``vertical``, saying how many TEs it inlined."""
    inlined = vertical(program)
    return Outcome(inlined, [f"{program.te_count() - inlined.te_count()} one-relies-on-one TEs inlined, "
                             f"{inlined.te_count()} TEs left"])


def inlinable(stage: te.Tensor, consumers: list[te.Tensor], read: te.Operation | None = None) -> bool:
    """Whether ``stage`` can be recomputed inside each consumer instead of being stored
    (``read``: the operation the consumers read, where ``stage`` is a rebuilt form of it).

    It must compute each element from the elements at fixed places of its inputs (no
    reduction), and the recomputation must stay cheap: into element-wise consumers anything
    element-wise goes; into a reduction only a TE whose every value is an element of an input
    or a constant (reshape, transpose, slice, concat, padding), or one that the reduction reads
    each element of once (``_read_once``), since arithmetic read more often (a GEMM's operand)
    would be redone for every output that reads it.
    """
    op = stage.op
    if not _element_wise(stage) or not consumers:
        return False
    nested, selects = nested_expanded_calls(op.body[0]), nested_selects(op.body[0])
    if any(nested + _nested(c, nested_expanded_calls) > MAX_NESTED_EXPANDED_CALLS
           or selects + _nested(c, nested_selects) > MAX_NESTED_SELECTS for c in consumers):
        return False
    if selects_elements(op.body[0]) or all(not c.op.reduce_axis for c in consumers):
        return True
    return not _epilogue_of_its_size(stage) and \
        all(not c.op.reduce_axis or _read_once(read or op, c) for c in consumers)


def _read_once(op: te.Operation, reduction: te.Tensor) -> bool:
    """Whether ``reduction`` reads each element of ``op`` once over all its outputs and terms
    (softmax's sum of exp(x - max) over its row), exactly as far as isl can tell: recomputed
    there, ``op`` costs what storing it and loading it back would, less the memory traffic.
    Stored, softmax's exponentials were a float32 copy of the scores written in the max's tiles
    and read twice, by the sum and by the normalization (paper BERT: 7 MB a layer).

    Once for each output of a short last axis that indexes no load counts as once
    (``same_elements_axis``): the warp_reduce template gives those outputs to one warp, which
    reads the row again from L1 (LayerNorm's moments, d and d^2 side by side). So the sum of a
    split GEMM's parts, its bias and the residual is recomputed in the LayerNorm that reads it,
    not stored behind a grid barrier of its own (paper BERT fp16 on the H100: 4.2 us a layer)."""
    access = access_relations(reduction).get(op)
    if access is None or not access.exact:
        return False
    relation = access.relation
    if not relation.is_injective() and \
            same_elements_axis(reduction, SAME_ELEMENTS_AXIS_MAX) is not None:
        relation = relation.project_out(isl.dim_type.in_, len(reduction.op.axis) - 1, 1)
    return relation.is_injective()


def _epilogue_of_its_size(stage: te.Tensor) -> bool:
    """Whether ``stage`` reads a reduction of its own size (a convolution's activation): stored,
    it is that reduction's epilogue (``codegen.epilogues``), computed once in the reduction's
    tiles; inlined, it would leave the reduction to be stored in its place, and be computed
    again by every reader."""
    size = _size(stage.shape)
    return any(_is_reduction(t) and _size(t.shape) == size for t in stage.op.input_tensors)


def _nested(consumer: te.Tensor, depth) -> int:
    body = getattr(consumer.op, "body", ())
    return max((depth(b) for b in body), default=0)


def pads(expr) -> bool:
    """Whether ``expr`` is a padding: one load of a tensor or a constant, chosen by conditions on
    indices alone. Not a ReLU (its condition is a value), a concatenation (two tensors: the
    horizontal transformation's stacked inputs stay one stored TE) or a roll (two places)."""
    return len(tensor_loads(expr)) == 1 and selects_elements(expr, by_index=True)


def rolls(expr) -> bool:
    """Whether ``expr`` is a roll: loads of one tensor at several places, chosen by conditions on
    indices alone (``souffle.ops.shape.roll``: two places an axis)."""
    loads = tensor_loads(expr)
    return len(loads) > 1 and len({load.tensor.op for load in loads}) == 1 and selects_elements(expr, by_index=True)


def selects_elements(expr, by_index: bool = False) -> bool:
    """Whether every value of ``expr`` is a tensor element or a constant, chosen by conditions
    (``by_index``: conditions that read no tensor)."""
    if is_call_to(expr, TENSOR_LOAD) or isinstance(expr, (tvm.tirx.IntImm, tvm.tirx.FloatImm)):
        return True
    if isinstance(expr, tvm.tirx.Select):
        condition, values = expr.condition, (expr.true_value, expr.false_value)
    elif is_call_to(expr, IF_THEN_ELSE):
        condition, values = expr.args[0], expr.args[1:]
    else:
        return False
    return not (by_index and reads_tensor(condition)) and all(selects_elements(v, by_index) for v in values)


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
    leads_to_reduction, through_rolls = _layout_chains_to_reductions(stages, readers, kept)
    rolled_to_reduction = through_rolls - leads_to_reduction
    scaled, scales = _scaled_operands(stages, readers, kept)
    for stage in stages:
        rebuilt = _rebuild(stage, inlined, new)
        users = readers.get(stage.op, [])
        relaid = None
        if stage.op in scaled:
            inlined[stage.op] = rebuilt
            continue
        if stage.op not in kept and stage.op not in scales and inlinable(rebuilt, users, stage.op):
            if not (_anchored(stage, rebuilt, users, leads_to_reduction) or
                    (_reads_a_result_each(rebuilt) and _anchored(stage, rebuilt, users, rolled_to_reduction))):
                inlined[stage.op] = rebuilt
                continue
            relaid = _in_producer_shape(rebuilt)
        elif stage.op not in kept and _element_wise(rebuilt):
            # stored in its reduction's shape, it is that reduction's epilogue (``codegen.epilogues``)
            relaid = _in_producer_shape(rebuilt, reshaped_only=True)
        stored, view = relaid if relaid is not None else (rebuilt, None)
        narrow = None if stage.op in kept else _before_widening(stored)
        if narrow is not None:
            widened = _widened(view, stored, narrow)
            cast_of = _widening_of_inlined(stage, inlined)
            if cast_of is not None:
                inlined[cast_of] = _widened(view, stored, narrow, widen=False)
            stored, view = narrow, widened
        if view is not None:
            inlined[stage.op] = view
        new[stage.op] = renamed[stage.op] = stored
    tensors = {name: new.get(t.op, t) for name, t in region.tensors.items() if t.op not in inlined}
    op_of = {new[op].op: origin for op, origin in region.op_of.items() if op in new}
    return Region(region.name, region.ops, region.inputs, region.outputs, tensors, op_of)


def _scaled_operands(stages: list[te.Tensor], readers: dict, kept: set) -> tuple[set, set]:
    """(the ops that scale a tensor by a smaller one, ``x[i] * s[j]``, read by GEMM-shaped
    reductions alone: inlined into them as an operand the tensor cores compute as they copy it
    (``codegen.schedule.gathered_operands``); the ops of their scales ``s``, stored). EfficientNet's
    squeeze-and-excitation scales the depthwise convolution's output by a channel's gate before
    the projection: stored, the product was a stage of its own behind a grid barrier, in 12 of
    paper EfficientNet's 16 blocks. The gate (a sigmoid of the excitation's output) is stored as
    that output's epilogue, once per channel, not recomputed for every element the GEMM copies."""
    copies = _copies(stages, kept)

    def read_by(stage: te.Tensor, through: set) -> list[te.Tensor]:
        """The TEs that read ``stage``, through copies (a 1 x 1 convolution's padding of none),
        which are added to ``through``."""
        found = []
        for reader in readers.get(stage.op, []):
            if reader.op in copies:
                through.add(reader.op)
                found.extend(read_by(reader, through))
            else:
                found.append(reader)
        return found

    scaled, scales = set(), set()
    for stage in stages:
        through: set = set()
        users = read_by(stage, through)
        if stage.op in kept or not users or not _element_wise(stage) or \
                not all(_is_reduction(u) and is_gemm(u) and not is_gemm(u, batched=True) for u in users):
            continue
        factors = scaled_factors(stage.op.body[0])
        if factors is None:
            continue
        size = _size(stage.shape)
        whole = [f for f in factors if _size(f.tensor.shape) == size and
                 all(_at_axis(index, axis) for index, axis in zip(f.indices, stage.op.axis))]
        scale = [f for f in factors if _size(f.tensor.shape) < size]
        if len(whole) == 1 and len(scale) == 1:
            scaled |= {stage.op} | through
            scales.add(scale[0].tensor.op)
    return scaled, scales


def _copies(stages: list[te.Tensor], kept: set) -> set:
    """The ops, not kept, each of whose elements is one load of its input (a reshape, a
    transpose, a slice, a padding of none)."""
    return {s.op for s in stages if _element_wise(s) and is_call_to(s.op.body[0], TENSOR_LOAD) and s.op not in kept}


def _layout_chains_to_reductions(stages: list[te.Tensor], readers: dict, kept: set) -> tuple[set, set]:
    """The ops one of whose readers is a layout TE not kept that is read by a reduction, or by a
    layout TE that leads to one, as (without rolls, through rolls). A layout TE, as written in the
    program, is one load at an index of its axes (a reshape, transpose or slice), or, on a chain
    that leads to no GEMM-shaped reduction (``is_gemm``), a padding (``pads``: read by a grouped or
    depthwise convolution or a pooling). A padding on the way to a GEMM is none, since the GEMM rules take no condition
    inside an operand: there the arithmetic before it is stored with it, and the GEMM reads it
    unconditionally. Not on the way to a batched one (a grouped convolution, its group an axis):
    a group's GEMM is small (paper ResNeXt: 196 x 16 x 144), so that the stored copy would cost
    about what the GEMM does, and the tensor cores take the padding inside the operand
    (``codegen.schedule.gathered_operands``). Elsewhere the arithmetic is stored in its
    producer's tiles (paper ResNeXt's batch norm and ReLU, its convolution's epilogue) and the
    padding is read through: a stage and a grid barrier fewer in most blocks (the H100 timed each
    stored padding of paper ResNeXt at fp32 at 6-15 us, EfficientNet's at 7). Through rolls, a
    roll is a layout TE too, on a chain that leads to no GEMM at all (``codegen.commute_rolls``:
    a LayerNorm's rows read through it); on the way to one it is stored, as a padding is."""
    pure = _copies(stages, kept)
    # a padding of no condition is a plain load: ``paddings`` holds ``pure``
    paddings = {s.op for s in stages if _element_wise(s) and s.op not in kept and pads(s.op.body[0])}
    rolled = {s.op for s in stages if _element_wise(s) and s.op not in kept and rolls(s.op.body[0])}
    # and a roll widened for a LayerNorm (the precision pass's cast of its input, exact)
    rolled |= {s.op for s in stages if _element_wise(s) and s.op not in kept and _widens_a_load(s.op.body[0])
               and s.op.body[0].value.args[0].op in rolled}
    layout = pure | (paddings - _led_to_gemm(stages, readers, paddings, batched=False))

    def chains(layout: set) -> set:
        leads: set = set()  # the ops with a reader that is a reduction or a layout TE in ``leads``
        for stage in reversed(stages):
            if any(r.op.reduce_axis or (r.op in layout and r.op in leads) for r in readers.get(stage.op, [])):
                leads.add(stage.op)
        return {s.op for s in stages if any(r.op in layout and r.op in leads for r in readers.get(s.op, []))}

    return chains(layout), chains(layout | (rolled - _led_to_gemm(stages, readers, rolled, batched=True)))


def _widens_a_load(expr) -> bool:
    """Whether ``expr`` is one float16 or bfloat16 load cast to float32 (exact): the precision
    pass's widening of a LayerNorm's or softmax's input."""
    return isinstance(expr, tvm.tirx.Cast) and str(expr.ty.dtype) == "float32" and \
        is_call_to(expr.value, TENSOR_LOAD) and str(expr.value.ty.dtype) in ("float16", "bfloat16")


def _led_to_gemm(stages: list[te.Tensor], readers: dict, through: set, batched: bool) -> set:
    """The ops read by a GEMM-shaped reduction (unbatched only, unless ``batched``), or by an op
    of ``through`` that is."""
    found: set = set()
    for stage in reversed(stages):  # readers come after their producers
        if any((r.op.reduce_axis and is_gemm(r) and (batched or not is_gemm(r, batched=True))) or
               (r.op in through and r.op in found)
               for r in readers.get(stage.op, [])):
            found.add(stage.op)
    return found


def _reads_a_result_each(tensor: te.Tensor) -> bool:
    """Whether ``tensor`` reads a reduction of its own size: stored, it is the reduction's
    epilogue (in its order, ``_in_producer_shape``). Read through a roll, the sum of a rolled
    Swin block's projection and its input is stored so, its LayerNorm reading it through the
    roll; the sum of split-K partials is not (stored, it would be a stage of its own), and its
    LayerNorm adds the partials as it reads them."""
    size = _size(tensor.shape)
    return any(_is_reduction(t) and _size(t.shape) == size for t in tensor.op.input_tensors)


def _anchored(stage: te.Tensor, rebuilt: te.Tensor, users: list[te.Tensor], leads_to_reduction: set) -> bool:
    """Whether ``stage`` (``rebuilt``, inlinable) is stored instead: its arithmetic would otherwise
    be carried down layout TEs to the one a reduction reads, and its readers read all of it. (A
    reduction that reads it directly reads each element once, or it would not be inlinable.)"""
    return (stage.op in leads_to_reduction and not selects_elements(rebuilt.op.body[0])
            and _read_whole(stage, users))


def _in_producer_shape(tensor: te.Tensor, reshaped_only: bool = False) -> tuple[te.Tensor, te.Tensor] | None:
    """``tensor`` as (the same values stored in the shape of the one reduction it reads through a
    reshape, that stored TE read back through the reshape), or None: it reads no reduction of
    another shape and its own size. Where reading it in that shape is not reading each result at
    its own index (once simplified), stored in the reduction's order if it reads it through a
    bijective affine map (``_in_permuted_order``), else None. With ``reshaped_only``, also None
    where the shapes differ only by axes of extent 1, which ``codegen.epilogues`` reads as the
    same index already (a batched product (heads, S, S) read as (1, heads, S, S))."""
    size = _size(tensor.shape)
    shapes = {tuple(int(d) for d in t.shape) for t in tensor.op.input_tensors
              if _is_reduction(t) and _size(t.shape) == size}
    shapes.discard(tuple(int(d) for d in tensor.shape))
    if reshaped_only:
        shapes = {shape for shape in shapes if _squeezed(shape) != _squeezed(tensor.shape)}
    if len(shapes) != 1:
        return None
    (shape,) = shapes
    stored = te.compute(shape, lambda *j: _reshaped(tensor, j, shape), name=tensor.op.name, tag=tensor.op.tag)
    for load in tensor_loads(stored.op.body[0]):
        if _is_reduction(load.tensor) and _size(load.tensor.shape) == size and \
                not all(_at_axis(index, axis) for index, axis in zip(load.indices, stored.op.axis)):
            return _in_permuted_order(tensor)
    view = te.compute(tensor.shape, lambda *a: stored(*_reshape_index(a, tensor.shape, shape)),
                      name=f"{tensor.op.name}_view")
    return stored, view


def _in_permuted_order(tensor: te.Tensor) -> tuple[te.Tensor, te.Tensor] | None:
    """``tensor`` as (the same values stored in the order of the one reduction of its size that
    it reads, at one place, through a bijective affine map of its indices (TVM's
    ``detect_iter_map``), that stored TE read back through the map), or None where it reads no
    such reduction. Swin adds each attention block's projection, computed window by window, back
    to the residual through the window reverse: stored in the projection's order, the sum is the
    projection's epilogue, and its readers (the LayerNorm, the next residual sum) read it through
    the reverse, a stage and a grid barrier fewer a block. (isl inverts the same map, but writes
    the inverse of a flattening as dozens of pieces; ``inverse_affine_iter_map`` as the
    flattening's own floor divisions. A roll is two places, and is left as it is.)"""
    size = _size(tensor.shape)
    producers = {t.op: t for t in tensor.op.input_tensors if _is_reduction(t) and _size(t.shape) == size}
    if len(producers) != 1:
        return None
    (producer,) = producers.values()
    loads = [load for load in tensor_loads(tensor.op.body[0]) if load.tensor.op.same_as(producer.op)]
    if len(loads) != 1 or loads[0].conditions:
        return None
    domain = {ax.var: tvm.ir.Range(0, int(ax.dom.extent)) for ax in tensor.op.axis}
    forward = tvm.sym.detect_iter_map(list(loads[0].indices), domain, check_level="bijective")
    shape = [int(d) for d in producer.shape]
    bounds = tvm.sym.Analyzer()
    for var, extent in domain.items():
        bounds.bind(var, extent)
    # one-to-one, and within the producer's shape, which has as many elements: onto it. TVM 0.27's
    # iter maps drop a constant inside a floormod (``(h + 3) % 8`` is detected as ``h``), so the
    # map detected must also be the index as written.
    if not forward.indices or any(bound.min_value != 0 or bound.max_value != extent - 1 for bound, extent in
                                  zip(map(bounds.const_int_bound, loads[0].indices), shape)) or \
            not all(bounds.can_prove_equal(tvm.sym.normalize_iter_map_to_expr(detected), index)
                    for detected, index in zip(forward.indices, loads[0].indices)):
        return None
    name = tensor.op.name

    def stored_body(*j):
        inverse = tvm.sym.inverse_affine_iter_map(forward.indices, list(j))
        return _body_at(tensor, j, shape, [inverse.get(ax.var, tirx.const(0, ax.var.ty)) for ax in tensor.op.axis],
                        f"storing {name} in {producer.op.name}'s order", producer)

    stored = te.compute(shape, stored_body, name=name, tag=tensor.op.tag)

    def read_back(*i):
        variables = dict(zip((ax.var for ax in tensor.op.axis), i))
        return stored(*(Rewriter(variables, f"reading {name} back")(index) for index in loads[0].indices))

    return stored, te.compute(tensor.shape, read_back, name=f"{name}_view")


def _at_axis(index, axis) -> bool:
    """Whether ``index`` is ``axis``'s variable, or 0 on an axis of extent 1."""
    if int(axis.dom.extent) == 1 and isinstance(index, tvm.tirx.IntImm):
        return index.value == 0
    return structural_equal(index, axis.var)


def _before_widening(tensor: te.Tensor) -> te.Tensor | None:
    """``tensor``'s values as the float16 or bfloat16 TE they are cast to float32 from, where its
    body is that cast (else None): stored narrow and widened where it is read, the same values
    take half the bytes. At fp16, paper BERT's attention scores (7 MB a layer, read by both
    softmax stages) and LayerNorms' inputs were float32 copies of float16 values: the precision
    pass rounds every op's result to float16 and widens the inputs of softmax and the norms. (On
    the CPU, TVM's ``BF16ComputeLegalize`` drops a round trip ``float32(bfloat16(x))``, so a
    float32 copy there held the unrounded x; stored as bfloat16 it is rounded, as on the GPU.)"""
    body = tensor.op.body[0]
    if not isinstance(body, tvm.tirx.Cast) or str(body.ty.dtype) != "float32" or \
            str(body.value.ty.dtype) not in ("float16", "bfloat16"):
        return None
    return te.compute(tensor.shape, lambda *i: _substitute(tensor, list(i)).value, name=tensor.op.name,
                      tag=tensor.op.tag)


def _widened(view: te.Tensor | None, wide: te.Tensor, narrow: te.Tensor, widen: bool = True) -> te.Tensor:
    """What readers of ``wide`` read once it is stored as ``narrow``: ``view`` (a reshape of
    ``wide``, or None for ``wide`` itself) with each load of ``wide`` a cast of ``narrow``'s
    (``widen``; else ``narrow``'s own values, what a reader of the narrow TE cast to ``wide`` reads)."""
    def load(*index):
        return narrow(*index).astype(wide.dtype) if widen else narrow(*index)

    if view is None:
        return te.compute(wide.shape, load, name=f"{wide.op.name}_{'widened' if widen else 'narrow'}")
    return recompute(view, lambda t, idx, _: load(*idx) if t.op.same_as(wide.op) else t(*idx),
                     f"widening {wide.op.name}")


def _widening_of_inlined(stage: te.Tensor, inlined: dict) -> te.Operation | None:
    """The inlined TE that ``stage`` (as written, before inlining) widens element by element: its
    body a cast of that TE at its own index, in its shape; else None. Stored narrow, ``stage``
    holds that TE's values, which its other readers then read instead of computing them again:
    Swin's residual sum, cast to float32 for a LayerNorm, was recomputed by the next residual sum
    from every GEMM result since the block's first (its fourth read twelve tensors), and each GEMM,
    read twice, had no epilogue (``codegen.epilogues``)."""
    body = stage.op.body[0]
    if not isinstance(body, tvm.tirx.Cast) or not is_call_to(body.value, TENSOR_LOAD):
        return None
    source, *indices = body.value.args
    if source.op not in inlined or [int(d) for d in source.shape] != [int(d) for d in stage.shape]:
        return None
    own = len(indices) == len(stage.op.axis) and all(structural_equal(i, ax.var) for i, ax in zip(indices, stage.op.axis))
    return source.op if own else None


def _squeezed(shape) -> list[int]:
    return [int(d) for d in shape if int(d) != 1]


def _element_wise(tensor: te.Tensor) -> bool:
    """One value per element, no reduction."""
    return isinstance(tensor.op, te.ComputeOp) and not tensor.op.reduce_axis and len(tensor.op.body) == 1


def _is_reduction(tensor: te.Tensor) -> bool:
    return isinstance(tensor.op, te.ComputeOp) and bool(tensor.op.reduce_axis)


def _size(shape) -> int:
    return int(np.prod([int(d) for d in shape]))


def _reshape_index(index, from_shape, to_shape) -> list:
    """The index into ``to_shape`` of the element at ``index`` of ``from_shape`` (row-major)."""
    return unravel(row_major(index, from_shape), to_shape)


def _reshaped(tensor: te.Tensor, j, shape):
    """``tensor``'s body at the element of it that index ``j`` of ``shape`` is, loads simplified."""
    return _body_at(tensor, j, shape, _reshape_index(j, shape, tensor.shape),
                    f"storing {tensor.op.name} in its producer's shape")


def _body_at(tensor: te.Tensor, j, shape, indices: list, where: str, producer: te.Tensor | None = None):
    """``tensor``'s body at ``indices`` (expressions of ``j``, an index of ``shape``), indices and
    loads simplified knowing ``j``'s ranges; ``producer``, where given, read at ``j`` itself (the
    tensor it reads through the map ``indices`` inverts)."""
    analyzer = tvm.sym.Analyzer()
    for var, d in zip(j, shape):
        analyzer.bind(var, tvm.ir.Range(0, d))

    def simplify(index):
        return index if reads_tensor(index) else analyzer.simplify(index)

    def load(read, loaded):
        return read(*j) if producer is not None and read.op.same_as(producer.op) else read(*map(simplify, loaded))

    variables = {ax.var: simplify(i) for ax, i in zip(tensor.op.axis, indices)}
    return Rewriter(variables, where, load)(tensor.op.body[0])


def _read_whole(stage: te.Tensor, users: list[te.Tensor]) -> bool:
    """Whether ``users`` together read every element of ``stage``, exactly as far as isl can tell:
    storing it then computes nothing no one reads (a slice of one row would)."""
    if not users or not isinstance(stage.op, te.ComputeOp):
        return False
    read = None
    for user in users:
        access = access_relations(user)[stage.op]
        if not access.exact:
            return False
        read = access.spatial.range() if read is None else read.union(access.spatial.range())
    return iteration_domain(stage).is_subset(read)


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
