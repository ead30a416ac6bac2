"""BERT: graph structure, torch-reference agreement, and state_dict round trip."""

import pytest
from model_checks import (
    check_against_torch,
    check_init_weights_match_torch,
    torch_state_dict_weights,
)

from souffle.graph import Scan
from souffle.models import bert


def test_tiny_graph_is_one_scan_over_layers():
    cfg = bert.CONFIGS["tiny"]
    graph = bert.build_graph(cfg, bert.init_weights(cfg, seed=0))
    scans = [op for op in graph.ops if isinstance(op, Scan)]
    assert len(scans) == 1 and scans[0].length == cfg["layers"]
    bound = dict(scans[0].params)["attention.self.query.weight"]
    assert bound == tuple(f"encoder.layer.{i}.attention.self.query.weight" for i in range(cfg["layers"]))
    assert [(s.name, s.shape, s.dtype) for s in graph.inputs] == [("input_ids", (1, cfg["seq"]), "int64")]
    assert [s.shape for s in graph.output_specs()] == [(1, cfg["seq"], cfg["hidden"]), (1, cfg["hidden"])]


def test_init_weights_match_torch_state_dict_and_are_deterministic():
    check_init_weights_match_torch(bert, bert.CONFIGS["tiny"])


def test_tiny_matches_torch():
    cfg = bert.CONFIGS["tiny"]
    check_against_torch(bert, cfg, bert.TOLERANCE["tiny"], bert.init_weights(cfg, seed=0))


def test_tiny_torch_state_dict_round_trip():
    cfg = bert.CONFIGS["tiny"]
    check_against_torch(bert, cfg, bert.TOLERANCE["tiny"], torch_state_dict_weights(bert, cfg))


@pytest.mark.slow
def test_paper_matches_torch_and_compiles_fast():
    cfg = bert.CONFIGS["paper"]
    compile_s = check_against_torch(bert, cfg, bert.TOLERANCE["paper"], bert.init_weights(cfg, seed=0))
    assert compile_s < 120, f"paper BERT took {compile_s:.1f} s to compile"


@pytest.mark.slow
def test_paper_torch_state_dict_round_trip():
    cfg = bert.CONFIGS["paper"]
    check_against_torch(bert, cfg, bert.TOLERANCE["paper"], torch_state_dict_weights(bert, cfg))
