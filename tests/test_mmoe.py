"""MMoE: separate expert ops (for horizontal fusion to merge), numerically the torch module."""

import pytest
from model_checks import check_against_torch

from souffle import models
from souffle.models import mmoe


def test_experts_are_separate_dense_ops():
    cfg = models.config("mmoe", "paper")
    graph = models.build("mmoe", "paper")
    dense_inputs = [op.inputs[1] for op in graph.ops if op.kind == "dense"]
    assert [w for w in dense_inputs if w.startswith("experts.")] == [f"experts.{e}.weight" for e in range(cfg["experts"])]
    assert len(dense_inputs) == cfg["experts"] + 3 * cfg["tasks"]


def test_one_probability_per_task():
    graph = models.build("mmoe", "paper")
    assert [spec.shape for spec in graph.output_specs()] == [(1, 1), (1, 1)]


def test_tiny_matches_torch():
    check_against_torch(mmoe, mmoe.CONFIGS["tiny"], mmoe.TOLERANCE["tiny"])


@pytest.mark.slow
def test_paper_matches_torch():
    check_against_torch(mmoe, mmoe.CONFIGS["paper"], mmoe.TOLERANCE["paper"])
