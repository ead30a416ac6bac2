"""Checks every model module shares: PyTorch agreement and state_dict compatibility."""

import time

import numpy as np

import souffle


def check_against_torch(model, cfg, tolerance, weights=None, seed=1):
    """Compile ``model``'s graph for LLVM, run it and the model's PyTorch reference on the same
    weights and inputs, compare every output; returns the compile time in seconds."""
    weights = model.init_weights(cfg, seed=0) if weights is None else weights
    graph = model.build_graph(cfg, weights)
    inputs = model.make_inputs(cfg, seed=seed)
    start = time.perf_counter()
    compiled = souffle.compile(graph, target="llvm")
    compile_seconds = time.perf_counter() - start
    got = compiled.run(inputs)
    expected = model.torch_reference(cfg, weights)(inputs)
    assert len(got) == len(expected) == len(graph.outputs)
    rtol, atol = tolerance
    for name, value, want in zip(graph.outputs, got, expected):
        np.testing.assert_allclose(value, want, rtol=rtol, atol=atol, err_msg=name)
    return compile_seconds


def torch_state_dict_weights(model, cfg):
    """The PyTorch reference module's own initialization, exported as a user would export
    real weights (its non-weight buffers left out)."""
    state = model.torch_module(cfg).state_dict()
    return {k: v.numpy() for k, v in state.items() if not k.endswith(model.IGNORED_SUFFIXES)}


def check_init_weights_match_torch(model, cfg):
    """``init_weights`` gives exactly the reference module's weights (names, shapes, float32),
    loads into it strictly, and is deterministic in its seed. Returns the weights."""
    weights = model.init_weights(cfg, seed=0)
    state = model.torch_module(cfg, weights).state_dict()
    assert set(weights) == {k for k in state if not k.endswith(model.IGNORED_SUFFIXES)}
    assert all(tuple(state[k].shape) == v.shape and v.dtype == np.float32 for k, v in weights.items())
    again = model.init_weights(cfg, seed=0)
    assert all(np.array_equal(weights[k], again[k]) for k in weights)
    return weights


def run_poisoned(model, inputs):
    """Run a compiled model with its scratch arena full of NaN, so a read before its write shows up."""
    for arena in model._arenas:
        arena.copyfrom(np.full(arena.shape, np.nan, dtype=arena.dtype))
    return model.run(inputs)
