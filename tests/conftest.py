"""Shared test helpers: run one registered op end to end on the CPU."""

import numpy as np
import pytest

from souffle.graph import TensorSpec


def run_op(kind, arrays, **attrs):
    """Lower ``kind`` on placeholders shaped like ``arrays``, compile for LLVM and run it.

    Returns the output array (a list of arrays for several outputs). The lowered tensors
    must have exactly the shapes and dtypes the op's infer rule promised.
    """
    import tvm  # here, not at the top: a GPU machine runs the gpu tests without TVM
    from tvm import te

    from souffle.ops import infer_outputs, lower_op

    arrays = [np.ascontiguousarray(a) for a in arrays]
    specs = [TensorSpec(f"in{i}", a.shape, str(a.dtype)) for i, a in enumerate(arrays)]
    expected = infer_outputs(kind, specs, attrs, kind)
    placeholders = [te.placeholder(a.shape, str(a.dtype), name=f"in{i}") for i, a in enumerate(arrays)]
    outputs = lower_op(kind, placeholders, attrs)
    assert [(tuple(int(d) for d in t.shape), t.dtype) for t in outputs] == expected
    module = tvm.IRModule({"main": te.create_prim_func(placeholders + outputs)})
    executable = tvm.compile(module, target="llvm")
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(a, dev) for a in arrays]
    args += [tvm.runtime.tensor(np.empty(shape, dtype), dev) for shape, dtype in expected]
    executable["main"](*args)
    results = [arg.numpy() for arg in args[len(arrays):]]
    return results[0] if len(results) == 1 else results


@pytest.fixture(name="run_op")
def run_op_fixture():
    return run_op


@pytest.fixture
def rng():
    """Seeded per test, so every test's inputs are reproducible on their own."""
    return np.random.default_rng(0)

