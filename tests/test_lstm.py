"""The LSTM: one cell looped by nested scans, numerically torch.nn.LSTM."""

import pytest
from model_checks import check_against_torch

from souffle import models
from souffle.graph import Scan
from souffle.models import lstm


def _scans(graph):
    return [op for op in graph.ops if isinstance(op, Scan)]


def test_cells_are_scanned_not_unrolled():
    tiny, paper = models.build("lstm", "tiny"), models.build("lstm", "paper")
    assert tiny.op_count() == paper.op_count()
    layer0, layers = _scans(paper)
    assert (layer0.length, layers.length) == (100, 9)
    (time_scan,) = _scans(layers.body)
    assert time_scan.length == 100
    cell_ops = layer0.body.op_count()
    # 1,000 cells, plus 10 zero states, 2 reshapes and 2 concats
    assert paper.op_count(executed=True) == 1000 * cell_ops + 14


def test_layers_bind_their_own_weights():
    (_, layers) = _scans(models.build("lstm", "tiny"))
    assert dict(layers.params)["weight_ih"] == ("weight_ih_l1", "weight_ih_l2")


def test_outputs_have_torch_shapes():
    graph = models.build("lstm", "paper")
    assert [spec.shape for spec in graph.output_specs()] == [(100, 1, 256), (10, 1, 256), (10, 1, 256)]


def test_single_layer_has_no_layer_scan_and_matches_torch():
    cfg = dict(lstm.CONFIGS["tiny"], num_layers=1)
    graph = lstm.build_graph(cfg, lstm.init_weights(cfg, 0))
    assert len(_scans(graph)) == 1
    assert [spec.shape for spec in graph.output_specs()] == [(5, 1, 16), (1, 1, 16), (1, 1, 16)]
    check_against_torch(lstm, cfg, lstm.TOLERANCE["tiny"])


def test_tiny_matches_torch():
    check_against_torch(lstm, lstm.CONFIGS["tiny"], lstm.TOLERANCE["tiny"])


@pytest.mark.slow
def test_paper_matches_torch_and_compiles_in_time():
    assert check_against_torch(lstm, lstm.CONFIGS["paper"], lstm.TOLERANCE["paper"]) < 120
