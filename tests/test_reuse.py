"""Temporal and spatial reuse, computed from the access relations."""

import pytest
from tvm import te, topi

from analysis.dependence import access_relations, classify, dependences
from analysis.reuse import find_reuse, spatial_fan_out
from souffle import models
from souffle.lower import lower_graph


def fan_out(stage, tensor) -> int:
    return spatial_fan_out(access_relations(stage)[tensor.op])


def test_broadcast_bias_is_read_by_every_row():
    x, b = te.placeholder((4, 8), name="x"), te.placeholder((8,), name="b")
    y = topi.add(x, b)
    assert fan_out(y, b) == 4 and fan_out(y, x) == 1


def test_matmul_operands_are_read_by_a_row_and_a_column_of_outputs():
    a, w = te.placeholder((4, 8), name="a"), te.placeholder((6, 8), name="w")
    y = topi.nn.dense(a, w)
    assert fan_out(y, a) == 6 and fan_out(y, w) == 4


@pytest.mark.parametrize("groups, expected", [(1, 8 * 9), (2, 4 * 9), (8, 9)])
def test_conv_input_element_is_read_by_its_groups_filters_at_every_window_position(groups, expected):
    x = te.placeholder((1, 8, 6, 6), name="x")
    w = te.placeholder((8, 8 // groups, 3, 3), name="w")
    y = topi.nn.group_conv2d_nchw(x, w, 1, 1, 1, groups)
    pad = y.op.input_tensors[0]
    assert classify(access_relations(y)[pad.op])[0] == "many-to-many"
    assert fan_out(y, pad) == expected  # an interior element: 3x3 windows x the filters of its group


def test_strided_pool_reuses_only_overlapping_windows():
    x = te.placeholder((1, 1, 8, 8), name="x")
    no_overlap = topi.nn.pool2d(x, (2, 2), (2, 2), (1, 1), (0, 0, 0, 0), "max")
    overlap = topi.nn.pool2d(x, (3, 3), (1, 1), (1, 1), (0, 0, 0, 0), "max")
    assert fan_out(no_overlap, x) == 1 and fan_out(overlap, x) == 9


def test_lstm_weights_are_reused_by_every_timestep():
    deps = dependences(lower_graph(models.build("lstm", config="tiny")))
    reuse = find_reuse(deps)
    by_name = {t.tensor: t for t in reuse.temporal}
    w_ih = by_name["layers/time/w_ih"]
    assert w_ih.iterations == 5 and w_ih.readers == ("layers/time/dense_1.T_matmul_NT",) and w_ih.reads == 5
    assert w_ih.bytes == 64 * 16 * 4
    gates = by_name["layers/time/gates"]
    assert gates.iterations == 1 and len(gates.readers) == 4  # the four gate slices
    assert reuse.fan_out("layers/time/dense_2.T_matmul_NT", "layers/time/h") == 64
    assert "every one of 5 iterations" in str(reuse)


def test_bert_layer_output_feeds_the_next_layers_q_k_v_and_residual_and_the_pooler():
    reuse = find_reuse(dependences(lower_graph(models.build("bert", config="tiny"))))
    hidden = next(t for t in reuse.temporal if t.tensor == "encoder/layer_output")
    assert sorted(hidden.readers) == ["encoder/add_17", "encoder/dense_1.T_reshape", "encoder/dense_4.T_reshape",
                                      "encoder/dense_7.T_reshape", "slice_7"]
    assert hidden.bytes == 8 * 32 * 4
