"""ResNeXt: graph structure, torch-reference agreement, and state_dict round trip."""

import numpy as np
import pytest
from model_checks import (
    check_against_torch,
    check_init_weights_match_torch,
    torch_state_dict_weights,
)

from souffle.graph import Scan
from souffle.models import resnext


@pytest.mark.parametrize("config", ["tiny", "paper"])
def test_repeated_blocks_are_one_scan_per_stage(config):
    cfg = resnext.CONFIGS[config]
    weights = {k: np.zeros(v.shape, np.float32) for k, v in resnext.torch_module(cfg).state_dict().items()
               if not k.endswith(resnext.IGNORED_SUFFIXES)}
    graph = resnext.build_graph(cfg, weights)
    scans = {op.name: op for op in graph.ops if isinstance(op, Scan)}
    expected = {f"layer{k + 1}": n - 1 for k, n in enumerate(cfg["blocks"]) if n > 1}
    assert {name: scan.length for name, scan in scans.items()} == expected
    if "layer3" in scans:
        bound = dict(scans["layer3"].params)["conv2.weight"]
        assert bound == tuple(f"layer3.{j}.conv2.weight" for j in range(1, cfg["blocks"][2]))
    assert [s.shape for s in graph.output_specs()] == [(1, cfg["classes"])]


def test_init_weights_match_torch_state_dict_and_are_deterministic():
    weights = check_init_weights_match_torch(resnext, resnext.CONFIGS["tiny"])
    assert all(v.min() > 0 for k, v in weights.items() if k.endswith("running_var"))


def test_tiny_matches_torch():
    cfg = resnext.CONFIGS["tiny"]
    check_against_torch(resnext, cfg, resnext.TOLERANCE["tiny"], resnext.init_weights(cfg, seed=0))


def test_tiny_torch_state_dict_round_trip():
    cfg = resnext.CONFIGS["tiny"]
    check_against_torch(resnext, cfg, resnext.TOLERANCE["tiny"], torch_state_dict_weights(resnext, cfg))


@pytest.mark.slow
def test_paper_matches_torch():
    cfg = resnext.CONFIGS["paper"]
    check_against_torch(resnext, cfg, resnext.TOLERANCE["paper"], resnext.init_weights(cfg, seed=0))


@pytest.mark.slow
def test_paper_torch_state_dict_round_trip():
    cfg = resnext.CONFIGS["paper"]
    check_against_torch(resnext, cfg, resnext.TOLERANCE["paper"], torch_state_dict_weights(resnext, cfg))
