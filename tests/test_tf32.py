"""precision="tf32": float32 GEMMs on tensor cores in TF32 (m16n16k8 wmma fragments,
``codegen.tensor_core``), printed as CUDA declares them (``codegen.tf32``), run by the emulator's
``mma.h`` and read by the thread-level validator."""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from tvm import te, topi

import souffle
from codegen.schedule import tensor_core_stages
from codegen.tensor_core import TF32_TILES
from codegen.tf32 import tf32_source
from souffle.compiler import run_passes
from souffle.graph import GraphBuilder

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
mutants = importlib.import_module("scripts.validate_mutants")

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs the host C++ compiler g++")


def tf32(array: np.ndarray) -> np.ndarray:
    """float32 rounded to TF32 as ``__float_to_tf32`` does (to nearest, ties away from zero)."""
    bits = np.asarray(array, np.float32).view(np.uint32)
    return ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def truncated(array: np.ndarray) -> np.ndarray:
    """float32 with the 13 bits TF32 lacks dropped, as the tensor cores read an unrounded operand."""
    return (np.asarray(array, np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


def _relu_dense(m: int, n: int, k: int):
    rng = np.random.default_rng(0)
    builder = GraphBuilder("tc")
    x = builder.input("x", (m, k))
    w = builder.param("w", (rng.standard_normal((n, k)) * 0.1).astype(np.float32))
    graph = builder.build(builder.op("relu", builder.op("dense", x, w)))
    return graph, {"x": rng.standard_normal((m, k)).astype(np.float32)}


def test_the_source_declares_tf32_fragments_and_rounds_every_load_into_one():
    printed = """\
  nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 8, half, nvcuda::wmma::row_major> a_frag[2];
  nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 8, half, nvcuda::wmma::col_major> b_frag[1];
  nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, half, nvcuda::wmma::row_major> h_frag[1];
    nvcuda::wmma::load_matrix_sync(a_frag[1], (&(a_shared[((int)threadIdx.y) * 640])), 40);
    nvcuda::wmma::load_matrix_sync(h_frag[0], (&(h_shared[0])), 72);
"""
    rewritten = tf32_source(printed)
    assert rewritten.count("nvcuda::wmma::precision::tf32") == 2
    assert "16, 16, 16, half, nvcuda::wmma::row_major> h_frag[1]" in rewritten  # float16's shape is left alone
    assert "for (int t = 0; t < a_frag[1].num_elements; ++t) a_frag[1].x[t] = " \
           "nvcuda::wmma::__float_to_tf32(a_frag[1].x[t]);" in rewritten
    assert rewritten.count("__float_to_tf32") == 1  # not after the float16 fragment's load
    assert tf32_source(printed.replace("16, 16, 8,", "16, 16, 16,")) == printed.replace("16, 16, 8,", "16, 16, 16,")


def test_float32_gemms_take_tensor_cores_only_at_tf32():
    a, w = te.placeholder((256, 128), "float32", name="A"), te.placeholder((256, 128), "float32", name="W")
    func = te.create_prim_func([a, w, topi.nn.dense(a, w)])
    assert tensor_core_stages(func) == []
    stages = tensor_core_stages(func, tf32=True)
    assert [s.tensor_core_tile for _, s in stages] == list(TF32_TILES)
    assert all(tile.depth == 32 and tile.fragment_k == 8 for tile in TF32_TILES)
    assert "16, 16, 8" in stages[0][0].script()


@needs_gxx
@pytest.mark.usefixtures("tensor_cores_wherever_they_apply")
def test_a_tf32_dense_on_emulated_threads_rounds_its_operands_to_tf32():
    """Rows, columns and terms padded (100 x 132 x 72, 3 chunks of 32 terms): the outputs are the
    product of the operands rounded to TF32, in float32; not the float32 product, nor the product
    of truncated operands (the loads' ``__float_to_tf32`` left out)."""
    graph, inputs = _relu_dense(100, 132, 72)
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4, precision="tf32")
    assert "nvcuda::wmma::precision::tf32" in model.source and "__float_to_tf32" in model.source
    assert [s.schedule.template for s in model.kernel_plan.staged.stages()] == ["tensor_core"]
    x, w = inputs["x"].astype(np.float64), graph.weights["w"].astype(np.float64)
    rounded = np.maximum(tf32(x) @ tf32(w).T, 0)
    for order in ("ascending", "descending"):
        (output,) = model.schedule(order, model.emulator.sms, seed=5).run(inputs)
        np.testing.assert_allclose(output, rounded, rtol=1e-5, atol=1e-5, err_msg=order)
    assert np.abs(output - np.maximum(x @ w.T, 0)).max() > 1e-4
    assert np.abs(output - np.maximum(truncated(x) @ truncated(w).T, 0)).max() > 1e-4


@pytest.mark.usefixtures("tensor_cores_wherever_they_apply", "register_pipeline")
def test_the_validator_reads_tf32_tiles_and_catches_a_missing_syncthreads():
    """The m16n16k8 tiles: 16 x 8 of the first operand, 8 x 16 of the second (column-major), read
    from float32 slices. As at float16 (``test_tensor_core``), the pipeline's three barriers and
    the accumulators' two are needed; here so is the first, which orders the zeroing of the
    kernel's shared pool (``codegen.cuda``) before the first chunk's stores into the slices."""
    graph, _ = _relu_dense(128, 128, 128)
    plan = run_passes(graph, "cuda", stop="kernel_plan", opt_level=4, precision="tf32").ir
    assert [s.schedule.template for s in plan.staged.stages()] == ["tensor_core"]
    (kernel,) = [mutants.Kernel("tf32", name, func, {}, 1, plan.staged.threads)
                 for name, func in mutants.device_functions(mutants.device_module(plan.funcs, "sm_90")).items()]
    assert mutants.validate(kernel).violations == ()
    dropped = mutants.sites(kernel)["drop_syncthreads"]
    violations = [mutants.validate(kernel, make()).violations for _, make in dropped]
    assert [bool(v) for v in violations] == [True, True, True, True, True, True], dropped
    assert "on_chip" in violations[0][0] and "x_in_reindex_shared.dyn" in violations[0][0]
    assert any("T_matmul_NT_reindex_shared.dyn" in v for v in violations[-1])  # the accumulators
