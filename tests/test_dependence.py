"""Element-level dependences: access relations and the classification of every op's TEs."""

import islpy as isl
import numpy as np
import pytest
import tvm
from tvm import te, topi

from analysis.dependence import (
    MANY_TO_MANY,
    ONE_TO_MANY,
    ONE_TO_ONE,
    REORGANIZE,
    SHUFFLE,
    access_relations,
    classify,
    count_points,
    count_points_at_most,
    dependences,
    element_dependences,
    iteration_domain,
)
from souffle import models
from souffle.lower import lower_graph
from souffle.ops import lower_op
from souffle.ops.registry import REGISTRY

O, M, N, R, S = ONE_TO_ONE, ONE_TO_MANY, MANY_TO_MANY, REORGANIZE, SHUFFLE

# op -> (input shapes, attrs, expected: per TE in topological order, (TE name, [(input, mapping), ...]))
OPS = {
    "relu": ([(4, 8)], {}, [("compute", [("in0", O)])]),
    "sigmoid": ([(4, 8)], {}, [("compute", [("in0", O)])]),
    "tanh": ([(4, 8)], {}, [("compute", [("in0", O)])]),
    "gelu": ([(4, 8)], {}, [("gelu", [("in0", O)])]),
    "silu": ([(4, 8)], {}, [("silu", [("in0", O)])]),
    "add": ([(4, 8), (8,)], {}, [("T_add", [("in0", O), ("in1", M)])]),
    "sub": ([(4, 8), (4, 1)], {}, [("T_subtract", [("in0", O), ("in1", M)])]),
    "mul": ([(4, 8), (4, 8)], {}, [("T_multiply", [("in0", O), ("in1", O)])]),
    "div": ([(4, 8), ()], {}, [("T_divide", [("in0", O), ("in1", M)])]),
    "scale": ([(4, 8)], {"factor": 2.0}, [("T_multiply", [("in0", O)])]),
    "copy": ([(4, 8)], {}, [("compute", [("in0", O)])]),
    "full": ([], {"shape": (2, 3)}, [("T_full", [])]),
    "dense": ([(4, 8), (6, 8), (6,)], {}, [
        ("T_matmul_NT", [("in0", N), ("in1", N)]), ("compute", [("in2", O)]),
        ("T_add", [("T_matmul_NT", O), ("compute", M)])]),
    "matmul": ([(2, 4, 8), (8, 6)], {}, [
        ("T_reshape", [("in0", R)]), ("T_matmul_NN", [("T_reshape", N), ("in1", N)]),
        ("T_reshape", [("T_matmul_NN", R)])]),
    "batch_matmul": ([(2, 4, 8), (2, 8, 6)], {}, [("T_batch_matmul_NN", [("in0", N), ("in1", N)])]),
    "conv2d": ([(1, 8, 6, 6), (8, 4, 3, 3)], {"padding": 1, "groups": 2}, [
        ("group_conv2d_pad", [("in0", O)]), ("group_conv2d_nchw", [("group_conv2d_pad", N), ("in1", N)]),
        ("group_conv2d_channels", [("group_conv2d_nchw", R)])]),  # [N, groups, O / groups, H, W] read as NCHW
    "conv2d_packed": ([(1, 4, 6, 6), (2, 4, 3, 3, 4)], {"padding": 1}, [
        ("conv2d_packed_pad", [("in0", O)]), ("conv2d_packed", [("conv2d_packed_pad", N), ("in1", N)])]),
    "dense_packed": ([(4, 8), (2, 8, 4)], {}, [("dense_packed", [("in0", N), ("in1", N)])]),
    "batch_norm": ([(1, 4, 3, 3), (4,), (4,), (4,), (4,)], {}, [
        ("T_reshape", [("in3", O)]), ("T_subtract", [("in0", O), ("T_reshape", M)]),
        ("T_reshape", [("in4", O)]), ("T_add", [("T_reshape", O)]), ("compute", [("T_add", O)]),
        ("T_divide", [("T_subtract", O), ("compute", M)]), ("T_reshape", [("in1", O)]),
        ("T_multiply", [("T_divide", O), ("T_reshape", M)]), ("T_reshape", [("in2", O)]),
        ("T_add", [("T_multiply", O), ("T_reshape", M)])]),
    "layer_norm": ([(4, 8), (8,), (8,)], {}, [
        ("layer_norm_sum", [("in0", N)]),
        ("layer_norm_moments", [("in0", N), ("layer_norm_sum", M)]),
        ("layer_norm", [("in0", O), ("layer_norm_sum", M), ("layer_norm_moments", N), ("in1", M), ("in2", M)])]),
    "softmax": ([(4, 8)], {}, [
        ("T_softmax_maxelem", [("in0", N)]), ("T_softmax_exp", [("in0", O), ("T_softmax_maxelem", M)]),
        ("T_softmax_expsum", [("T_softmax_exp", N)]), ("T_softmax_norm", [("T_softmax_exp", O), ("T_softmax_expsum", M)])]),
    "max_pool2d": ([(1, 4, 6, 6)], {"kernel": 3, "stride": 2, "padding": 1}, [
        ("pad_temp", [("in0", O)]), ("pool_max", [("pad_temp", N)])]),
    "avg_pool2d": ([(1, 4, 6, 6)], {"kernel": 2, "stride": 2}, [
        ("pool_sum", [("in0", N)]), ("pool_avg", [("pool_sum", O)])]),
    "global_avg_pool2d": ([(1, 4, 3, 3)], {}, [("in0_red", [("in0", N)]), ("T_divide", [("in0_red", O)])]),
    "mean": ([(4, 8)], {"axes": (1,)}, [("in0_red", [("in0", N)]), ("T_divide", [("in0_red", O)])]),
    "embedding": ([(10, 4), (3,)], {}, [("T_take", [("in1", M), ("in0", N)])]),
    "reshape": ([(2, 6, 8)], {"shape": (2, 6, 2, 4)}, [("T_reshape", [("in0", R)])]),
    "flatten": ([(2, 3, 4)], {}, [("T_reshape", [("in0", R)])]),
    "transpose": ([(2, 3, 4)], {"axes": (2, 0, 1)}, [("T_transpose", [("in0", S)])]),
    "concat": ([(4, 8), (2, 8)], {"axis": 0}, [("T_concat", [("in1", O), ("in0", O)])]),
    "slice": ([(4, 8)], {"begin": 1, "end": 3, "axis": 0}, [("T_strided_slice_with_axes", [("in0", O)])]),
    "split": ([(4, 8)], {"sections": 2, "axis": 1}, [("T_split", [("in0", O)]), ("T_split", [("in0", O)])]),
    # the ops imported models need (souffle.ops.math, expand, sum)
    "exp": ([(4, 8)], {}, [("compute", [("in0", O)])]),
    "log": ([(4, 8)], {}, [("compute", [("in0", O)])]),
    "sqrt": ([(4, 8)], {}, [("compute", [("in0", O)])]),
    "erf": ([(4, 8)], {}, [("compute", [("in0", O)])]),
    "neg": ([(4, 8)], {}, [("compute", [("in0", O)])]),
    "abs": ([(4, 8)], {}, [("compute", [("in0", O)])]),
    "rsqrt": ([(4, 8)], {}, [("compute", [("in0", O)])]),
    "pow": ([(4, 8)], {"exponent": 3.0}, [("pow", [("in0", O)])]),
    "clamp": ([(4, 8)], {"min": -10.0, "max": 10.0}, [("clamp", [("in0", O)])]),
    "hardsigmoid": ([(4, 8)], {}, [("hardsigmoid", [("in0", O)])]),
    "hardswish": ([(4, 8)], {}, [("hardswish", [("in0", O)])]),
    "gelu_tanh": ([(4, 8)], {}, [("gelu_tanh", [("in0", O)])]),
    "cast": ([(4, 8)], {"dtype": "float16"}, [("compute", [("in0", O)])]),
    "expand": ([(4, 1)], {"shape": (2, 4, 8)}, [("T_broadcast_to", [("in0", M)])]),
    "sum": ([(4, 8)], {"axes": (1,)}, [("in0_red", [("in0", N)])]),
    **{kind: ([(4, 8), (8,)], {}, [(f"T_{kind}", [("in0", O), ("in1", M)])]) for kind in ("eq", "ne", "lt", "le", "gt", "ge")},
    "logical_and": ([(4, 8), (4, 1)], {}, [("T_logical_and", [("in0", O), ("in1", M)])]),
    "logical_or": ([(4, 8), (4, 8)], {}, [("T_logical_or", [("in0", O), ("in1", O)])]),
    "logical_not": ([(4, 8)], {}, [("T_logical_not", [("in0", O)])]),
    "where": ([(4, 1), (4, 8), ()], {}, [("T_where", [("in0", M), ("in1", O), ("in2", M)])]),
    "pad": ([(4, 8)], {"before": (1, 0), "after": (0, 2)}, [("PadInput", [("in0", O)])]),
    "roll": ([(4, 8)], {"shifts": (1, -3), "axes": (0, 1)}, [("T_roll", [("in0", R)])]),
    "take": ([(10, 4), (3,)], {"axis": 0}, [("T_take", [("in1", M), ("in0", N)])]),
}


def lowered(kind, shapes, attrs):
    """The op's compute TEs in topological order, on float32 placeholders (int64 ids for embedding
    and take)."""
    indices = (("embedding", 1), ("take", 1))
    inputs = [te.placeholder(s, "int64" if (kind, i) in indices else "float32", name=f"in{i}")
              for i, s in enumerate(shapes)]
    order, seen = [], set()

    def visit(t):
        if t.op in seen or not isinstance(t.op, te.ComputeOp):
            return
        seen.add(t.op)
        for producer in t.op.input_tensors:
            visit(producer)
        order.append(t)

    for out in lower_op(kind, inputs, attrs):
        visit(out)
    return order


def stage_named(kind, shapes, attrs, name):
    return next(t for t in lowered(kind, shapes, attrs) if t.op.name == name)


def test_every_registered_op_is_pinned():
    assert set(OPS) == set(REGISTRY)


@pytest.mark.parametrize("kind", sorted(OPS))
def test_op_classification(kind):
    shapes, attrs, expected = OPS[kind]
    got = [(t.op.name, [(a.tensor.op.name, classify(a)[0]) for a in access_relations(t).values()])
           for t in lowered(kind, shapes, attrs)]
    assert got == expected


@pytest.mark.parametrize("kind", sorted(OPS))
def test_one_relies_on_one_iff_no_edge_reads_many(kind):
    shapes, attrs, _ = OPS[kind]
    for t in lowered(kind, shapes, attrs):
        for access in access_relations(t).values():
            mapping, one, _, _ = classify(access)
            assert one == (mapping != MANY_TO_MANY)


def spatial_of(kind, shapes, attrs, stage, tensor):
    t = stage_named(kind, shapes, attrs, stage)
    return next(a for a in access_relations(t).values() if a.tensor.op.name == tensor)


def test_relu_reads_its_own_element():
    access = spatial_of("relu", [(4, 8)], {}, "compute", "in0")
    assert access.exact and access.spatial.is_equal(
        isl.Map("{ compute[i0, i1] -> in0[i0, i1] : 0 <= i0 < 4 and 0 <= i1 < 8 }"))
    assert classify(access)[2] == 1


def test_broadcast_bias_is_one_to_many():
    access = spatial_of("add", [(4, 8), (8,)], {}, "T_add", "in1")
    assert access.spatial.is_equal(isl.Map("{ T_add[i0, i1] -> in1[i1] : 0 <= i0 < 4 and 0 <= i1 < 8 }"))
    mapping, one, fan_in, reason = classify(access)
    assert (mapping, one, fan_in) == (ONE_TO_MANY, True, 1) and "broadcast" in reason


def test_reshape_is_a_quasi_affine_reorganize():
    split = spatial_of("reshape", [(2, 6, 8)], {"shape": (2, 6, 2, 4)}, "T_reshape", "in0")
    assert split.spatial.is_equal(isl.Map(
        "{ T_reshape[i0, i1, i2, i3] -> in0[i0, i1, 4i2 + i3] : 0 <= i0 < 2 and 0 <= i1 < 6 and 0 <= i2 < 2 and 0 <= i3 < 4 }"))
    merge = spatial_of("reshape", [(2, 6, 2, 4)], {"shape": (2, 6, 8)}, "T_reshape", "in0")
    assert merge.spatial.is_equal(isl.Map(
        "{ T_reshape[i0, i1, i2] -> in0[i0, i1, floor(i2/4), i2 mod 4] : 0 <= i0 < 2 and 0 <= i1 < 6 and 0 <= i2 < 8 }"))
    assert classify(merge)[:2] == (REORGANIZE, True)


def test_transpose_is_a_shuffle():
    access = spatial_of("transpose", [(2, 3, 4)], {"axes": (2, 0, 1)}, "T_transpose", "in0")
    assert access.spatial.is_equal(isl.Map(
        "{ T_transpose[i0, i1, i2] -> in0[i1, i2, i0] : 0 <= i0 < 4 and 0 <= i1 < 2 and 0 <= i2 < 3 }"))


def test_padding_keeps_its_condition_exactly():
    access = spatial_of("conv2d", [(1, 8, 6, 6), (8, 4, 3, 3)], {"padding": 1, "groups": 2}, "group_conv2d_pad", "in0")
    assert access.exact
    assert access.spatial.is_equal(isl.Map(
        "{ group_conv2d_pad[i0, i1, i2, i3] -> in0[i0, i1, i2 - 1, i3 - 1] : "
        "i0 = 0 and 0 <= i1 < 8 and 1 <= i2 < 7 and 1 <= i3 < 7 }"))
    assert classify(access)[0] == ONE_TO_ONE


def test_grouped_conv_reads_its_group_window():
    access = spatial_of("conv2d", [(1, 8, 6, 6), (8, 4, 3, 3)], {"padding": 1, "groups": 2}, "group_conv2d_nchw",
                        "group_conv2d_pad")
    assert access.relation.is_equal(isl.Map(  # the group an axis of its own: [N, groups, O / groups, H, W]
        "{ group_conv2d_nchw[n, g, j, y, x, rc, ry, rx] -> group_conv2d_pad[n, 4 * g + rc, y + ry, x + rx] : "
        "n = 0 and 0 <= g < 2 and 0 <= j < 4 and 0 <= y < 6 and 0 <= x < 6 and 0 <= rc < 4 and 0 <= ry < 3 "
        "and 0 <= rx < 3 }"))
    mapping, one, fan_in, reason = classify(access)
    assert (mapping, one, fan_in) == (MANY_TO_MANY, False, 4 * 3 * 3)
    assert access.reduce_axes_used == ("r0", "r1", "r2") and "reduction axes r0, r1, r2" in reason


@pytest.mark.parametrize("kind, shapes, attrs, stage, tensor, fan_in", [
    ("dense", [(4, 8), (6, 8), (6,)], {}, "T_matmul_NT", "in1", 8),
    ("batch_matmul", [(2, 4, 8), (2, 8, 6)], {}, "T_batch_matmul_NN", "in0", 8),
    ("softmax", [(4, 8)], {}, "T_softmax_maxelem", "in0", 8),
    ("layer_norm", [(4, 8), (8,), (8,)], {}, "layer_norm_moments", "in0", 8),
    ("max_pool2d", [(1, 4, 6, 6)], {"kernel": 3, "stride": 2, "padding": 1}, "pool_max", "pad_temp", 9),
    ("global_avg_pool2d", [(1, 4, 3, 3)], {}, "in0_red", "in0", 9),
])
def test_reductions_rely_on_many(kind, shapes, attrs, stage, tensor, fan_in):
    mapping, one, got_fan_in, _ = classify(spatial_of(kind, shapes, attrs, stage, tensor))
    assert (mapping, one, got_fan_in) == (MANY_TO_MANY, False, fan_in)


def test_gather_is_over_approximated_with_its_reason():
    access = spatial_of("embedding", [(10, 4), (3,)], {}, "T_take", "in0")
    assert not access.exact
    assert "data-dependent gather" in access.reasons[0] and "index 0 of in0" in access.reasons[0]
    assert access.spatial.is_equal(isl.Map("{ T_take[i0, i1] -> in0[o0, i1] : 0 <= i0 < 3 and 0 <= i1 < 4 and 0 <= o0 < 10 }"))
    assert classify(access)[:2] == (MANY_TO_MANY, False)


def test_non_affine_index_and_guard_are_over_approximated():
    x = te.placeholder((16,), "float32", name="x")
    product = te.compute((4, 4), lambda i, j: x[i * j], name="product")
    access = access_relations(product)[x.op]
    assert not access.exact and "multiplies two axes" in access.reasons[0]
    guarded = te.compute((4,), lambda i: tvm.tirx.if_then_else(i * i < 4, x[i], 0.0), name="guarded")
    access = access_relations(guarded)[x.op]
    assert not access.exact and "guard of x is dropped" in access.reasons[0]
    assert access.spatial.is_equal(isl.Map("{ guarded[i0] -> x[i0] : 0 <= i0 < 4 }"))


def test_a_test_of_loaded_values_is_no_guard():
    """A select on data (relu's NaN test) may take either branch: the union of both is exact.
    A condition that also tests an axis still restricts the elements, and is over-approximated."""
    x = te.placeholder((9,), "float32", name="x")
    on_values = te.compute((8,), lambda i: tvm.tirx.Select(tvm.tirx.isnan(x[i]), x[i], x[i + 1]), name="on_values")
    access = access_relations(on_values)[x.op]
    assert access.exact
    assert access.spatial.is_equal(isl.Map("{ on_values[i0] -> x[o0] : 0 <= i0 < 8 and i0 <= o0 <= i0 + 1 }"))
    mixed = te.compute((8,), lambda i: tvm.tirx.Select(tvm.tirx.all(i < 4, x[i] > 0), x[i], 0.0), name="mixed")
    access = access_relations(mixed)[x.op]
    assert not access.exact and "guard of x is dropped" in access.reasons[0]


def test_two_reads_of_one_tensor_are_one_relation():
    x = te.placeholder((8,), "float32", name="x")
    stencil = te.compute((7,), lambda i: x[i] + x[i + 1], name="stencil")
    access = access_relations(stencil)[x.op]
    assert access.sites == 2
    assert classify(access)[:3] == (MANY_TO_MANY, False, 2)


def test_iteration_domain_spans_spatial_and_reduction_axes():
    stage = stage_named("dense", [(4, 8), (6, 8), (6,)], {}, "T_matmul_NT")
    assert iteration_domain(stage).is_equal(isl.Set("{ T_matmul_NT[i0, i1, r0] : 0 <= i0 < 4 and 0 <= i1 < 6 and 0 <= r0 < 8 }"))


@pytest.mark.parametrize("text, points", [
    ("{ A[i, j] : 0 <= i < 4 and 0 <= j < 8 }", 32),
    ("{ A[i, j] : 0 <= i < 6 and 0 <= j < 9 and i mod 2 = 0 and j mod 3 = 0 }", 9),
    ("{ A[i, j] : 0 <= i < 4 and 0 <= j <= i }", 10),
    ("{ A[] }", 1),
    ("{ A[i] : 0 <= i < 0 }", 0),
])
def test_count_points(text, points):
    assert count_points(isl.Set(text)) == points


def test_a_count_isl_gives_up_on_is_its_bounding_box_and_says_so():
    triangle = isl.Set("{ A[i, j] : 0 <= i < 4 and 0 <= j <= i }")
    assert count_points_at_most(triangle) == (10, True)
    assert count_points_at_most(triangle, operations=1) == (16, False)  # 4 x 4, an upper bound
    assert count_points(triangle) == 10  # the bound is lifted afterwards


def test_program_edges_name_tensors_and_roles():
    program = lower_graph(models.build("lstm", config="tiny"))
    deps = dependences(program)
    assert len(deps.stages) == program.te_count()
    assert len({s.name for s in deps.stages}) == len(deps.stages)
    projection = next(s for s in deps.stages if s.name == "layers/time/dense_1.T_matmul_NT")
    roles = {e.name: e.role for e in projection.edges}
    assert roles == {"layers/time/x_t": "slice", "layers/time/w_ih": "invariant"}
    assert projection.loops == (("layers", 2), ("time", 5)) and projection.trips == 10
    recurrent = next(s for s in deps.stages if s.name == "layers/time/dense_2.T_matmul_NT")
    carry = next(e for e in recurrent.edges if e.name == "layers/time/h")
    assert carry.role == "carry"
    assert carry.producer.op.same_as(deps["layers/time/h_next"].stage.op)  # the previous step's output
    gates = next(s for s in deps.stages if s.name == "layers/time/gates")
    assert all(e.role == "intermediate" and e.producer is not None for e in gates.edges)
    assert gates.one_relies_on_one and not projection.one_relies_on_one


def test_bert_has_one_inexact_edge_the_word_embedding_gather():
    deps = dependences(lower_graph(models.build("bert", config="tiny")))
    inexact = [(s.name, e.name) for s in deps.stages for e in s.edges if not e.access.exact]
    assert inexact == [("embedding_1", "embeddings.word_embeddings.weight")]
    mappings = {s.name: [e.mapping for e in s.edges] for s in deps.stages}
    assert mappings["encoder/transpose_3"] == [SHUFFLE] and mappings["encoder/reshape_2"] == [REORGANIZE]
    assert mappings["encoder/batch_matmul_10"] == [MANY_TO_MANY, MANY_TO_MANY]
    assert "one-relies-on-many" in str(deps) and "encoder/softmax_12.T_softmax_maxelem" in str(deps)


def test_edges_across_regions_resolve_to_the_producing_te():
    program = lower_graph(models.build("bert", config="tiny"))
    deps = dependences(program)
    pooler_slice = deps["slice_7"]  # reads the encoder loop's final hidden state
    (edge,) = pooler_slice.edges
    assert edge.name == "encoder.hidden_states" and edge.role == "intermediate"
    assert edge.producer.op.same_as(deps["encoder/layer_output"].stage.op)
    assert deps[pooler_slice.stage] is pooler_slice


def test_window_bounds_isl_cannot_hold_are_widened_with_a_reason():
    x = te.placeholder((1, 2, 7, 5), name="x")
    pool_sum = topi.nn.adaptive_pool(x, (3, 2), "avg").op.input_tensors[0]
    access = access_relations(pool_sum)[x.op]
    assert not access.exact and "the range of axis rv0 is widened" in access.reasons[0]
    assert classify(access)[:2] == (MANY_TO_MANY, False)


def _pairs(relation: isl.Map) -> set[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every (output index, input index) pair of a bounded relation."""
    n_out = relation.dim(isl.dim_type.in_)
    pairs = set()

    def add(point):
        coords = tuple(point.get_coordinate_val(isl.dim_type.set, k).to_python()
                       for k in range(relation.dim(isl.dim_type.in_) + relation.dim(isl.dim_type.out)))
        pairs.add((coords[:n_out], coords[n_out:]))

    relation.wrap().foreach_point(add)
    return pairs


# Inputs under which moving one element can change a comparison's or a mask's output: equal
# operands (eq, ne: every element flips), zeros (logical_not), or 0s and 1s (the others).
PREDICATE_ARRAYS = {
    **{kind: lambda rng, s: np.ones(s, "float32") for kind in ("eq", "ne")},
    "logical_not": lambda rng, s: np.zeros(s, "float32"),
    **{kind: lambda rng, s: rng.integers(0, 2, s).astype("float32") for kind in ("logical_and", "logical_or", "where")},
}
# Ops whose output depends on an input element only for some values of the others (x < y flips
# when x moves up only where x < y held; where reads a branch where the condition picks it):
# the element pairs observed are a subset of the relation, not all of it.
VALUE_DEPENDENT = {"lt", "le", "gt", "ge", "logical_and", "logical_or", "where"}


def _perturbation_pairs(kind, shapes, attrs, rng) -> dict:
    """Per (output, input): the pairs (output element, input element) such that changing that input
    element changes that output element, found by running the op once per input element."""
    inputs = [te.placeholder(s, "int64" if (kind, i) in (("embedding", 1), ("take", 1)) else "float32", name=f"in{i}")
              for i, s in enumerate(shapes)]
    outputs = lower_op(kind, inputs, attrs)
    executable = tvm.compile(tvm.IRModule({"main": te.create_prim_func(inputs + outputs)}),
                             target={"kind": "llvm", "opt-level": 0})
    shapes = [tuple(int(d) for d in t.shape) for t in inputs]
    # positive values keep batch_norm's variance valid; ids index the 10-row embedding table
    arrays = [rng.integers(0, 10, s) if str(t.dtype) == "int64" else rng.uniform(0.5, 1.5, s).astype("float32")
              for t, s in zip(inputs, shapes)]
    if kind in PREDICATE_ARRAYS:
        arrays = [PREDICATE_ARRAYS[kind](rng, s) for s in shapes]

    def run(values):
        args = [tvm.runtime.tensor(np.asarray(v), tvm.cpu()) for v in values]
        args += [tvm.runtime.tensor(np.empty([int(d) for d in o.shape], str(o.dtype)), tvm.cpu()) for o in outputs]
        executable["main"](*args)
        return [a.numpy() for a in args[len(values):]]

    baseline = run(arrays)
    found = {(o, i): set() for o in range(len(outputs)) for i in range(len(inputs))}
    for i, array in enumerate(arrays):
        for index in np.ndindex(array.shape):
            changed = [a.copy() for a in arrays]
            changed[i][index] = (array[index] + 1) % 10 if array.dtype == np.int64 else array[index] + 1000.0
            for o, (before, after) in enumerate(zip(baseline, run(changed))):
                found[(o, i)] |= {(tuple(int(c) for c in out), index) for out in zip(*np.nonzero(before != after))}
    return inputs, outputs, found


# A padded convolution's border outputs load weight taps that multiply padding zeros: the
# access is real, but those taps cannot change the value, so running the op sees fewer pairs.
TIMES_PADDING_ZERO = {("conv2d", 1), ("conv2d_packed", 1)}


@pytest.mark.parametrize("kind", sorted(set(OPS) - {"full"}))
def test_element_dependences_match_what_running_the_op_shows(kind, rng):
    """Perturb each input element and see which outputs change: the isl relation, composed across the
    op's TEs, must be exactly that set (a superset where an access was over-approximated)."""
    shapes, attrs, _ = OPS[kind]
    inputs, outputs, found = _perturbation_pairs(kind, shapes, attrs, rng)
    for (o, i), observed in found.items():
        dependence = element_dependences(outputs[o], inputs[i])
        predicted = _pairs(dependence.relation)
        assert observed  # every input of every op is read
        assert observed <= predicted
        if dependence.exact and (kind, i) not in TIMES_PADDING_ZERO and kind not in VALUE_DEPENDENT:
            assert observed == predicted


def test_element_dependences_compose_through_every_path():
    x = te.placeholder((4, 8), "float32", name="x")
    y = lower_op("softmax", [x], {})[0]  # max -> exp -> sum -> divide: every path reaches the whole row
    dependence = element_dependences(y, x)
    assert dependence.exact and dependence.relation.is_equal(
        isl.Map("{ T_softmax_norm[i0, i1] -> x[i0, o1] : 0 <= i0 < 4 and 0 <= i1 < 8 and 0 <= o1 < 8 }"))
    other = te.placeholder((8,), "float32", name="other")
    unrelated = element_dependences(y, other)
    assert unrelated.exact and unrelated.relation.is_empty()
    assert unrelated.relation.get_tuple_name(isl.dim_type.out) == "other"


@pytest.mark.parametrize("name", models.MODELS)
def test_te_names_are_unique_in_the_program(name):
    deps = dependences(lower_graph(models.structure(name, "tiny")))
    names = [s.name for s in deps.stages]
    assert len(set(names)) == len(names)


def test_repeated_te_names_of_one_op_are_numbered():
    deps = dependences(lower_graph(models.structure("resnext", "tiny")))
    reshapes = [s.name for s in deps.stages if s.name.startswith("batch_norm_2.T_reshape")]
    assert reshapes == ["batch_norm_2.T_reshape", "batch_norm_2.T_reshape:2", "batch_norm_2.T_reshape:3",
                        "batch_norm_2.T_reshape:4"]  # running mean, running var, weight, bias
    subtract = deps["batch_norm_2.T_subtract"]
    assert [e.name for e in subtract.edges] == ["conv2d_1", "batch_norm_2.T_reshape"]
