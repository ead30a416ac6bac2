import re

import numpy as np
import pytest

import souffle
from souffle.errors import InputError, SouffleError, TargetError
from souffle.graph import GraphBuilder


@pytest.fixture(scope="module")
def mlp():
    rng = np.random.default_rng(1)
    b = GraphBuilder("mlp")
    x = b.input("x", (2, 8))
    w = b.param("fc.weight", rng.standard_normal((16, 8)).astype("float32"))
    bias = b.param("fc.bias", rng.standard_normal(16).astype("float32"))
    graph = b.build(b.op("relu", b.op("dense", x, w, bias)))
    return graph, souffle.compile(graph, target="llvm")


def test_numpy_in_numpy_out(mlp):
    graph, model = mlp
    x = np.random.default_rng(2).standard_normal((2, 8)).astype("float32")
    want = np.maximum(x @ graph.weights["fc.weight"].T + graph.weights["fc.bias"], 0)
    np.testing.assert_allclose(model(x), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(model(x=x), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(model.run({"x": x})[0], want, rtol=1e-5, atol=1e-5)
    assert model.kernel_count == 1


def test_report_counts(mlp):
    _, model = mlp
    model(np.zeros((2, 8), "float32"))
    report = model.report()
    assert (report.ops, report.kernels, report.regions, report.loops) == (2, 1, 1, 0)
    assert report.tes == 3  # packed matmul, bias add, relu (the program as compiled)
    assert report.weight_bytes == (16 * 8 + 16) * 4
    assert report.run_seconds is not None and report.run_seconds > 0
    text = str(report)
    assert "kernels        1" in text and "compile" in text
    assert set(report.to_dict()) >= {"ops", "tes", "kernels", "compile_seconds", "run_seconds"}


def test_bad_inputs_are_named(mlp):
    _, model = mlp
    with pytest.raises(InputError, match=r"input 'x' has shape \(3, 8\), expected \(2, 8\)"):
        model(np.zeros((3, 8), "float32"))
    with pytest.raises(InputError, match="input 'x' has dtype float64, expected float32"):
        model(np.zeros((2, 8)))
    with pytest.raises(InputError, match="missing \\['x'\\]; unexpected \\['y'\\]"):
        model(y=np.zeros((2, 8), "float32"))
    with pytest.raises(InputError, match="takes 1 inputs"):
        model(np.zeros((2, 8), "float32"), np.zeros((2, 8), "float32"))


def test_run_takes_a_dict_of_named_inputs(mlp):
    _, model = mlp
    x = np.zeros((2, 8), "float32")
    for given, kind in (([x], "list"), (x, "ndarray")):
        with pytest.raises(InputError, match=re.escape(
                f"mlp: run takes a dict of the named inputs ['x'], not a {kind}; "
                "m(x) takes the inputs as positional arrays")):
            model.run(given)


@pytest.mark.parametrize("counts, message", [
    ({"repeat": 0}, "repeat must be an integer >= 1, got 0"),
    ({"number": 0}, "number must be an integer >= 1, got 0"),
    ({"repeat": 2.5}, "repeat must be an integer >= 1, got 2.5"),
])
def test_benchmark_needs_a_whole_positive_number_of_runs(mlp, counts, message):
    _, model = mlp
    with pytest.raises(InputError, match=re.escape(message)):
        model.benchmark({"x": np.zeros((2, 8), "float32")}, **counts)


def test_bad_targets_and_graphs(mlp):
    graph, _ = mlp
    with pytest.raises(TargetError, match="unknown target 'metal'"):
        souffle.compile(graph, target="metal")
    with pytest.raises(SouffleError, match="takes a souffle Graph"):
        souffle.compile("bert")
    body = GraphBuilder("body")
    x = body.input("x", (1, 4))
    no_weights = body.build(body.op("dense", x, body.param("w", (4, 4))))
    with pytest.raises(SouffleError, match="has no weights"):
        souffle.compile(no_weights)


@pytest.mark.parametrize("options, message", [
    ({"threads": 64}, "threads per block are the persistent kernel's (targets cuda and llvm-persistent)"),
    ({"opt_level": 2}, "opt levels are the persistent kernel's"),
    ({"device": "h200"}, "target 'llvm' needs a CPU device model, not 'h200'; use 'cpu'"),
])
def test_options_of_the_persistent_targets_are_refused_for_llvm(mlp, options, message):
    graph, _ = mlp
    with pytest.raises(TargetError, match=re.escape(message)):
        souffle.compile(graph, target="llvm", **options)
