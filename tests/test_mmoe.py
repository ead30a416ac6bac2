"""MMoE: separate expert ops (for horizontal fusion to merge), numerically the torch module."""

import numpy as np
import pytest

from souffle import models


def test_experts_are_separate_dense_ops():
    cfg = models.config("mmoe", "paper")
    graph = models.build("mmoe", "paper")
    dense_inputs = [op.inputs[1] for op in graph.ops if op.kind == "dense"]
    assert [w for w in dense_inputs if w.startswith("experts.")] == [f"experts.{e}.weight" for e in range(cfg["experts"])]
    assert len(dense_inputs) == cfg["experts"] + 3 * cfg["tasks"]


def test_one_probability_per_task():
    graph = models.build("mmoe", "paper")
    assert [spec.shape for spec in graph.output_specs()] == [(1, 1), (1, 1)]


def _check_against_torch(config):
    pytest.importorskip("torch")
    import souffle

    graph = models.build("mmoe", config, seed=0)
    inputs = models.make_inputs("mmoe", config, seed=1)
    expected = models.reference("mmoe", config, graph.weights)(inputs)
    rtol, atol = models.tolerance("mmoe", config)
    got = souffle.compile(graph, target="llvm").run(inputs)
    for name, value, want in zip(graph.outputs, got, expected):
        np.testing.assert_allclose(value, want, rtol=rtol, atol=atol, err_msg=name)


def test_tiny_matches_torch():
    _check_against_torch("tiny")


@pytest.mark.slow
def test_paper_matches_torch():
    _check_against_torch("paper")
