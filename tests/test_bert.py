"""BERT: graph structure, torch-reference agreement, and state_dict round trip."""


import numpy as np
import pytest

from souffle.graph import Scan
from souffle.models import bert


def _state_dict_weights(cfg):
    """A torch module's own initialization, exported as a user would export real weights."""
    state = bert.torch_module(cfg).state_dict()
    return {k: v.numpy() for k, v in state.items() if not k.endswith(bert.IGNORED_SUFFIXES)}


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
    cfg = bert.CONFIGS["tiny"]
    weights = bert.init_weights(cfg, seed=0)
    state = bert.torch_module(cfg, weights).state_dict()
    assert set(weights) == {k for k in state if not k.endswith(bert.IGNORED_SUFFIXES)}
    assert all(tuple(state[k].shape) == v.shape and v.dtype == np.float32 for k, v in weights.items())
    again = bert.init_weights(cfg, seed=0)
    assert all(np.array_equal(weights[k], again[k]) for k in weights)


def test_tiny_matches_torch(check_against_torch):
    cfg = bert.CONFIGS["tiny"]
    check_against_torch(bert, cfg, bert.TOLERANCE["tiny"], bert.init_weights(cfg, seed=0))


def test_tiny_torch_state_dict_round_trip(check_against_torch):
    cfg = bert.CONFIGS["tiny"]
    check_against_torch(bert, cfg, bert.TOLERANCE["tiny"], _state_dict_weights(cfg))


@pytest.mark.slow
def test_paper_matches_torch_and_compiles_fast(check_against_torch):
    cfg = bert.CONFIGS["paper"]
    compile_s = check_against_torch(bert, cfg, bert.TOLERANCE["paper"], bert.init_weights(cfg, seed=0))
    assert compile_s < 120, f"paper BERT took {compile_s:.1f} s to compile"


@pytest.mark.slow
def test_paper_torch_state_dict_round_trip(check_against_torch):
    cfg = bert.CONFIGS["paper"]
    check_against_torch(bert, cfg, bert.TOLERANCE["paper"], _state_dict_weights(cfg))
