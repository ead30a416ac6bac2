"""benchmarks/gpu_variants.py: each compiler variant changes what it says and nothing else, and
its bundles are named after their base so that a GPU run times both."""

import contextlib
import shutil
import sys
from pathlib import Path

import pytest

import souffle
from codegen.tensor_core import ASYNC_STAGES
from souffle import models
from souffle.compiler import run_passes
from souffle.runtime.emulated import kernel_signature

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import gpu_kernels  # noqa: E402
import gpu_variants  # noqa: E402
from test_split_k import _narrow_gemm  # noqa: E402


def _on_chip_loads(staged) -> int:
    from codegen.staged import loops_in

    return sum(len(loop.loads) for loop in loops_in(staged.items))


def test_no_on_chip_keeps_every_weight_in_global_memory_and_only_while_applied():
    graph = models.build("lstm", "tiny")
    assert _on_chip_loads(run_passes(graph, "cuda", stop="plan_arena", opt_level=4).ir) > 0
    with gpu_variants.applied("no-on-chip"):
        assert _on_chip_loads(run_passes(graph, "cuda", stop="plan_arena", opt_level=4).ir) == 0
    assert _on_chip_loads(run_passes(graph, "cuda", stop="plan_arena", opt_level=4).ir) > 0


def test_two_blocks_bounds_the_kernel_for_two_blocks_per_sm():
    """ptxas gets __launch_bounds__(threads, 2); the runtime still finds the kernel's parameters."""
    graph = models.build("mmoe", "tiny")
    plain = run_passes(graph, "cuda", stop="cuda_source", opt_level=4).ir.text
    with gpu_variants.applied("two-blocks"):
        bounded = run_passes(graph, "cuda", stop="cuda_source", opt_level=4).ir.text
    assert "__launch_bounds__(256)" in plain and "__launch_bounds__(256, 2)" not in plain
    assert bounded == plain.replace("__launch_bounds__(256)", "__launch_bounds__(256, 2)")
    assert kernel_signature(bounded) == kernel_signature(plain)


def test_no_split_k_keeps_every_gemm_whole_and_only_while_applied():
    graph = _narrow_gemm()[0]

    def parts(staged) -> int:
        return sum("T_matmul_NT_part" in stage.name for stage in staged.stages())

    assert parts(run_passes(graph, "cuda", stop="plan_arena", opt_level=4).ir) == 1
    with gpu_variants.applied("no-split-k"):
        run = run_passes(graph, "cuda", stop="plan_arena", opt_level=4)
        assert parts(run.ir) == 0 and "variant no-split-k" in " ".join(run.notes("transform"))
    assert parts(run_passes(graph, "cuda", stop="plan_arena", opt_level=4).ir) == 1


def test_split_k_256_cuts_k_into_slices_of_256_and_only_while_applied():
    """The narrow GEMM's K of 1024 in 4 slices of 256 (2 of 512 by default): 16 tiles, still one
    round of a 132-SM grid, each a quarter of K."""
    graph = _narrow_gemm()[0]

    def slices(staged) -> list:
        return [int(stage.tensor.shape[0]) for stage in staged.stages() if "T_matmul_NT_part" in stage.name]

    assert slices(run_passes(graph, "cuda", stop="plan_arena", opt_level=4).ir) == [2]
    with gpu_variants.applied("split-k-256"):
        assert slices(run_passes(graph, "cuda", stop="plan_arena", opt_level=4).ir) == [4]
    assert slices(run_passes(graph, "cuda", stop="plan_arena", opt_level=4).ir) == [2]


def _gemm_stage(precision: str, variant: str | None = None):
    """The one GEMM stage of relu(x @ W.T), 256 x 512 over K = 512: dlight's SIMT matmul at fp32,
    64 x 64 tensor-core tiles at fp16."""
    import numpy as np

    from souffle.graph import GraphBuilder

    b = GraphBuilder("gemm")
    x = b.input("x", (256, 512))
    b.param("w", np.zeros((512, 512), np.float32))
    graph = b.build(b.op("relu", b.op("dense", x, "w", name="y")))
    with gpu_variants.applied(variant) if variant else contextlib.nullcontext():
        run = run_passes(graph, "cuda", stop="plan_arena", opt_level=4, precision=precision)
    (stage,) = [s for s in run.ir.stages() if s.schedule.template in ("matmul", "tensor_core")]
    return stage.schedule


def test_k_chunk_32_stages_twice_the_terms_of_each_operand_slice():
    base, longer = _gemm_stage("fp32"), _gemm_stage("fp32", "k-chunk-32")
    assert (base.template, longer.template) == ("matmul", "matmul")
    # both operands' slices of 64 rows hold 16 more float32 terms each
    assert longer.shared_bytes - base.shared_bytes == 2 * 64 * 16 * 4
    assert _gemm_stage("fp32").shared_bytes == base.shared_bytes  # only while applied


def test_tc_depth_128_stages_128_terms_per_tensor_core_chunk():
    base, deeper = _gemm_stage("fp16"), _gemm_stage("fp16", "tc-depth-128")
    assert (base.tensor_core_tile.depth, deeper.tensor_core_tile.depth) == (64, 128)
    assert (base.tensor_core_tile.async_stages, deeper.tensor_core_tile.async_stages) == (ASYNC_STAGES, 2)
    assert _gemm_stage("fp16").tensor_core_tile.depth == 64


def test_no_pipeline_gives_the_gemm_stages_no_software_pipeline():
    base, plain = _gemm_stage("fp16"), _gemm_stage("fp16", "no-pipeline")
    assert base.tensor_core_tile.copies_async and not plain.tensor_core_tile.pipelined
    # one copy of each 64 x 64 slice (rows padded to 72 halves) without the pipeline, the cp.async ring's three with it
    assert base.box == plain.box and base.shared_bytes - plain.shared_bytes == (ASYNC_STAGES - 1) * 2 * 64 * 72 * 2
    assert _gemm_stage("fp16").tensor_core_tile.pipelined


def test_8_byte_copies_copy_the_16_bit_slices_4_elements_at_a_time():
    base, narrower = _gemm_stage("fp16"), _gemm_stage("fp16", "8-byte-copies")
    assert (base.tensor_core_tile.copy_vector, narrower.tensor_core_tile.copy_vector) == (8, 4)
    assert base.box == narrower.box and narrower.tensor_core_tile.copies_async


def test_no_96_row_tiles_leaves_the_other_wide_tiles():
    from codegen import schedule

    from test_tensor_core import _dense

    def tiles():
        return [(s.box, s.tensor_core_tile.warps) for _, s in schedule.tensor_core_stages(_dense(256, 256, 128))]

    default = [((128, 128), 8), ((96, 128), 8), ((64, 128), 8), ((64, 64), 8), ((128, 128), 4), ((96, 96), 4),
               ((64, 64), 4)]
    assert tiles() == default
    with gpu_variants.applied("no-96-row-tiles"):
        assert tiles() == [t for t in default if t[0][0] != 96]
        assert all(tile.rows != 96 for tile in schedule.TF32_TILES)
    with gpu_variants.applied("eight-warp-tiles"):
        assert tiles() == [t for t in default if t[1] == 8]
        assert all(tile.warps == 8 for tile in schedule.TF32_TILES)
    assert tiles() == default


@pytest.mark.usefixtures("tensor_cores_wherever_they_apply")
def test_dlight_order_keeps_a_pointwise_convolution_as_dlight_orders_it():
    """As the transposed GEMM both operands are copied by cp.async; in dlight's order the input,
    each vector four channels apart, goes through registers."""
    import numpy as np

    from souffle.graph import GraphBuilder

    b = GraphBuilder("pointwise")
    x = b.input("x", (1, 64, 14, 14))
    b.param("w", np.zeros((48, 64, 1, 1), np.float32))
    graph = b.build(b.op("conv2d", x, "w", stride=1, padding=0, groups=1))

    def tile(variant=None):
        with gpu_variants.applied(variant) if variant else contextlib.nullcontext():
            run = run_passes(graph, "cuda", stop="plan_arena", opt_level=4, precision="fp16")
        return [s.schedule.tensor_core_tile for s in run.ir.stages() if s.schedule.template == "tensor_core"]

    assert [t.copies_async for t in tile()] == [True]
    assert [t.copies_async for t in tile("dlight-order")] == [False]
    from codegen import tensor_core

    assert tensor_core.TRANSPOSE_ROW_OPERANDS


def test_register_pipeline_stages_the_next_chunk_in_registers_in_one_copy_of_the_slices():
    base, registers = _gemm_stage("fp16"), _gemm_stage("fp16", "register-pipeline")
    assert registers.tensor_core_tile.pipelined and not registers.tensor_core_tile.copies_async
    assert base.box == registers.box and base.shared_bytes - registers.shared_bytes == (ASYNC_STAGES - 1) * 2 * 64 * 72 * 2
    from codegen import schedule

    with gpu_variants.applied("no-pipeline"):
        assert not schedule.MATMUL_PIPELINED
    assert schedule.MATMUL_PIPELINED


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs the host C++ compiler g++")
def test_two_rows_per_warp_halves_the_lstm_steps_tiles_and_keeps_its_outputs():
    """Tiny LSTM's wavefront step: 24 tiles of 8 gates (4 cell updates) by default, 12 of 16 with
    the variant, each warp reducing two gates one after the other; the emulated threads still
    match PyTorch."""
    import numpy as np

    def step(staged):
        (stage,) = [s for s in staged.stages() if s.schedule.template == "warp_reduce"]
        return stage.schedule.n_tiles, stage.schedule.per_tile

    graph = models.build("lstm", "tiny")
    assert step(run_passes(graph, "cuda", stop="plan_arena", opt_level=4).ir) == (24, 4)
    with gpu_variants.applied("two-rows-per-warp"):
        assert step(run_passes(graph, "cuda", stop="plan_arena", opt_level=4).ir) == (12, 8)
        model = souffle.compile(graph, target="cuda-emulated", opt_level=4)
    inputs = models.make_inputs("lstm", "tiny")
    expected = models.reference("lstm", "tiny", graph.weights)(inputs)
    for output, reference in zip(model.schedule("descending", None, seed=4).run(inputs), expected):
        np.testing.assert_allclose(output, reference, rtol=1e-5, atol=1e-5)
    assert step(run_passes(graph, "cuda", stop="plan_arena", opt_level=4).ir) == (24, 4)


def test_no_staged_vector_reads_paper_lstm_s_vector_from_global_memory():
    def gates(staged):
        (stage,) = [s for s in staged.stages() if s.schedule.template == "warp_reduce" and "state_next" in s.name]
        return stage.schedule.rows_together, stage.schedule.staged_vector

    graph = models.build("lstm", "paper")
    assert gates(run_passes(graph, "cuda", stop="stage", device="h100", precision="fp16").ir) == (4, True)
    with gpu_variants.applied("no-staged-vector"):
        assert gates(run_passes(graph, "cuda", stop="stage", device="h100", precision="fp16").ir) == (4, False)


def test_occupancy_turns_the_latency_models_occupancy_term_on_for_the_compile():
    from analysis import latency

    assert latency.WARPS_TO_SATURATE is None
    with gpu_variants.applied("occupancy"):
        assert latency.WARPS_TO_SATURATE == 32
    assert latency.WARPS_TO_SATURATE is None


def test_variant_bundles_are_named_after_their_base_and_unknown_ones_refused():
    name = gpu_kernels.bundle_name("lstm", "paper", 4, "fp32", "no-on-chip")
    assert name == "lstm_paper_O4+no-on-chip"
    assert gpu_variants.split(name) == ("lstm_paper_O4", "no-on-chip")
    assert gpu_variants.split("lstm_paper_O4") == ("lstm_paper_O4", None)
    with pytest.raises(ValueError, match="unknown variant 'fast'; known: no-on-chip"):
        with gpu_variants.applied("fast"):
            pass
