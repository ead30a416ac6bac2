"""The ``align_tiles`` pass (codegen.align_tiles): a softmax tiled like the batched product that
reads it, so that the two run in the same block with no grid barrier between them.

Built on attention's core at fp16, softmax(S) . V over 2 heads of 128 x 128 scores and 64 values:
the product is 4 tensor-core tiles of 64 x 64, one head's 64 rows each, and the softmax, a warp
a row, 32 tiles of 8 rows. Checked: where the latency model finds a grid barrier dearer than
the longer softmax, the softmax becomes 4 tiles of 64 rows (8 a warp) and the product follows it
after a ``__syncthreads``, not a grid barrier; where it does not, nothing changes and the note
says why; the aligned kernel matches PyTorch on emulated threads in both thread orders; and the
validator refuses it without that ``__syncthreads``.
"""

import dataclasses
import importlib
import re

import numpy as np
import pytest
import torch
from tvm import tirx

import souffle
from analysis import device as devices
from analysis import threads
from codegen.row_resident import row_resident_stage, rows_together
from codegen.schedule import ScheduleError, THREADS, WARP
from codegen.tensor_core import whole_row_tile
from souffle.compiler import run_passes
from souffle.graph import GraphBuilder

mutants = importlib.import_module("scripts.validate_mutants")

HEADS, ROWS, VALUES = 2, 128, 64
SOFTMAX, PRODUCT = "T_softmax_maxelem+T_softmax_expsum+softmax_1", "T_batch_matmul_NN+batch_matmul_2"


def _scored_attention():
    """softmax(q . k^T) . values over inputs q and k, the values a weight; the graph, inputs and
    PyTorch's fp16 answer."""
    rng = np.random.default_rng(3)
    b = GraphBuilder("attention")
    q, k = (b.input(name, (HEADS, ROWS, VALUES)) for name in ("q", "k"))
    values = b.param("values", rng.standard_normal((HEADS, ROWS, VALUES)).astype("float32"))
    scores = b.op("batch_matmul", q, k, transpose_b=True)
    graph = b.build(b.op("batch_matmul", b.op("softmax", scores), values))
    inputs = {name: rng.standard_normal((HEADS, ROWS, VALUES)).astype("float32") for name in ("q", "k")}
    half = {name: torch.from_numpy(v).half().float() for name, v in inputs.items()}
    products = torch.bmm(half["q"], half["k"].transpose(1, 2)).half().float()
    half_values = torch.from_numpy(graph.weights["values"].copy()).half().float()
    expected = torch.bmm(torch.softmax(products, -1).half().float(), half_values)
    return graph, inputs, expected.numpy()


def _attention(rows: int = ROWS):
    """softmax(scores) . values, the values a weight (converted to fp16 at compile time: as an
    input, its cast would be a stage between the two, with a grid barrier of its own before the
    product); the graph, inputs, and PyTorch's answers at fp16 and fp32."""
    rng = np.random.default_rng(0)
    b = GraphBuilder("attention")
    scores = b.input("scores", (HEADS, rows, rows))
    values = b.param("values", rng.standard_normal((HEADS, rows, VALUES)).astype("float32"))
    graph = b.build(b.op("batch_matmul", b.op("softmax", scores), values))
    inputs = {"scores": rng.standard_normal((HEADS, rows, rows)).astype("float32") * 2}
    half_scores = torch.from_numpy(inputs["scores"]).half().float()
    half_values = torch.from_numpy(graph.weights["values"].copy()).half().float()
    expected = torch.bmm(torch.softmax(half_scores, -1).half().float(), half_values)
    full = torch.bmm(torch.softmax(torch.from_numpy(inputs["scores"]), -1),
                     torch.from_numpy(graph.weights["values"].copy()))
    return graph, inputs, expected.numpy(), full.numpy()


@pytest.fixture
def dear_barriers(monkeypatch):
    """The H200 model with a grid barrier of 20 us, which no softmax of these sizes costs, and a
    launch of 100 us, so that the partition does not trade the barriers for kernels."""
    monkeypatch.setitem(devices._GPUS, "h200", dataclasses.replace(devices.get_device("h200"),
                                                                    grid_sync_base_seconds=20e-6,
                                                                    launch_seconds=100e-6))


def _stages(staged) -> dict:
    return {s.name.split("/")[-1]: s for s in staged.stages()}


def _notes(result) -> list[str]:
    """What ``align_tiles`` said."""
    return [note.removeprefix("align_tiles: ") for note in result.notes("transform", prefixed=True)
            if note.startswith("align_tiles: ")]


def _aligned_plan():
    return run_passes(_attention()[0], "cuda", stop="plan_arena", opt_level=4, precision="fp16")


def test_a_softmax_takes_the_rows_of_the_product_s_tiles_where_a_barrier_costs_more(dear_barriers):
    result = _aligned_plan()
    stages = _stages(result.ir)
    softmax, product = stages[SOFTMAX], stages[PRODUCT]
    assert product.schedule.template == "tensor_core" and product.schedule.n_tiles == HEADS * ROWS // 64
    warps = THREADS // WARP
    assert (softmax.schedule.n_tiles, softmax.schedule.per_tile) == (product.schedule.n_tiles, warps * 8 * ROWS)
    assert product.barrier is None and product.block_barrier is not None
    (note,) = _notes(result)
    assert note.startswith(f"attention_r0/{SOFTMAX}: 8 rows a warp, 4 tiles of 64 rows, each the rows tile t of "
                           f"attention_r0/{PRODUCT} reads: 1 grid barrier fewer (h200: ")


def test_where_the_softmax_would_cost_more_than_the_barrier_nothing_changes():
    result = _aligned_plan()
    stages = _stages(result.ir)
    assert stages[SOFTMAX].schedule.n_tiles == HEADS * ROWS // (THREADS // WARP)
    assert stages[PRODUCT].barrier is not None
    (note,) = _notes(result)
    assert re.search(r", not taken: [\d.]+ us against [\d.]+ us as it is \(1 run\), more than the 1 grid barrier "
                     r"it would save \([\d.]+ us each on h200\)$", note), note


@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_the_aligned_kernel_matches_torch_on_emulated_threads(dear_barriers, order):
    graph, inputs, expected, _ = _attention()
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4, precision="fp16")
    assert _stages(model.plan)[PRODUCT].barrier is None
    (got,) = model.schedule(order).run(inputs)
    np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2)


def test_rows_of_384_floats_are_loaded_four_at_a_time_and_match_torch(dear_barriers):
    """At fp32, 8 rows of 384 a warp would be 96 floats a lane: the warp loads them 4 at a time
    (``ROW_CACHE_BYTES``), in two trips, and the kernel (P.V on dlight's SIMT matmul, tiles of 64
    x 64) matches PyTorch's float32 on emulated threads."""
    graph, inputs, _, expected = _attention(384)
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4)
    softmax = _stages(model.plan)[SOFTMAX]
    assert (softmax.schedule.n_tiles, softmax.schedule.rows_together) == (HEADS * 384 // 64, 4)
    assert _stages(model.plan)["batch_matmul_2"].barrier is None
    (got,) = model.schedule("descending").run(inputs)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_rows_together_fit_a_lane_s_registers():
    assert rows_together(8, 384, ["float16"]) == 8  # 96 halves a lane: 192 bytes
    assert rows_together(8, 384, ["float32"]) == 4
    assert rows_together(8, 384, ["float32", "float32"]) == 2  # two row tensors (a residual's sum)
    assert rows_together(8, 384, []) == 1  # nothing cached: a row at a time
    assert rows_together(6, 384, ["float32"]) == 3
    assert rows_together(8, 4096, ["float32"]) == 1


def test_the_validator_refuses_the_aligned_kernel_without_its_syncthreads(dear_barriers, monkeypatch):
    """The product's reads of P (its first slices' cp.async copies) are ordered after the
    softmax's writes by the ``__syncthreads`` between the stages and by the one that opens the
    product's tile (which also orders the tile's copies after the last tile's reads of the same
    shared memory): without the first the kernel is accepted, without both the validator finds
    the race on P between the block's warps (among the others: every violation reported)."""
    monkeypatch.setattr(threads, "REPORTED", 10_000)
    plan = run_passes(_attention()[0], "cuda", stop="kernel_plan", opt_level=4, precision="fp16").ir
    (kernel,) = [mutants.Kernel("aligned", name, func, {}, 1, plan.staged.threads)
                 for name, func in mutants.device_functions(mutants.device_module(plan.funcs, "sm_90")).items()]
    assert mutants.validate(kernel).violations == ()
    softmax, product = mutants.tile_loops(kernel.func)[:2]
    statements = list(mutants.statements(kernel.func.body))

    def place(statement) -> int:
        return next(k for k, s in enumerate(statements) if s.same_as(statement))

    syncs = [s for s in statements if mutants.is_barrier(s, "tirx.tvm_storage_sync")]
    (between,) = [s for s in syncs if place(softmax) < place(s) < place(product)]
    opening = min((s for s in syncs if place(s) > place(product)), key=place)

    def without(*dropped):
        nothing = tirx.Evaluate(tirx.const(0, "int32"))
        body = mutants.rewrite(kernel.func.body, lambda s: nothing if any(s.same_as(d) for d in dropped) else s)
        return mutants.validate(kernel, kernel.func.with_body(body)).violations

    assert without(between) == ()
    caught = without(between, opening)
    assert any(v.startswith("stage 0 (writes compute) / stage 1 (writes compute): ") and "(same block" in v
               and "write and read global compute[" in v and "/ compute_in[" in v and "with no __syncthreads" in v
               for v in caught), caught


def test_the_scores_are_tiled_in_whole_rows_with_the_softmax(dear_barriers):
    """q . k^T right before the softmax: 4 tiles of 64 whole rows of 128 (1 x 8 warps of 4 x 1
    fragments), tile t the softmax's tile t, so neither the softmax nor the product waits on a
    grid barrier."""
    result = run_passes(_scored_attention()[0], "cuda", stop="plan_arena", opt_level=4, precision="fp16")
    stages = {s.name.split("/")[-1]: s for s in result.ir.stages()}
    scores = stages["T_batch_matmul_NT+compute"]
    assert (scores.schedule.n_tiles, scores.schedule.box) == (4, (1, 64, 128))
    assert str(scores.schedule.tensor_core_tile) == "64x128x64 (1x8 warps of 4x1 fragments)"
    softmax = stages["T_softmax_maxelem+T_softmax_expsum+softmax_2"]
    product = stages["T_batch_matmul_NN+batch_matmul_3"]
    assert softmax.barrier is None and product.barrier is None
    assert softmax.block_barrier is not None and product.block_barrier is not None
    (note,) = _notes(result)
    assert "; attention_r0/T_batch_matmul_NT+compute in 4 tiles of 64 whole rows" in note
    assert ": 2 grid barriers fewer (h200: " in note


def test_the_validator_refuses_the_softmax_without_the_syncthreads_after_the_scores(dear_barriers, monkeypatch):
    """The softmax's warps load rows of the scores that other warps of the block stored (each
    warp of the scores' tile stores 64 x 16 columns of it): only the ``__syncthreads`` between
    the two orders them."""
    monkeypatch.setattr(threads, "REPORTED", 10_000)
    plan = run_passes(_scored_attention()[0], "cuda", stop="kernel_plan", opt_level=4, precision="fp16").ir
    (kernel,) = [mutants.Kernel("aligned", name, func, {}, 1, plan.staged.threads)
                 for name, func in mutants.device_functions(mutants.device_module(plan.funcs, "sm_90")).items()]
    assert mutants.validate(kernel).violations == ()
    scores, softmax = mutants.tile_loops(kernel.func)[2:4]
    statements = list(mutants.statements(kernel.func.body))

    def place(statement) -> int:
        return next(k for k, s in enumerate(statements) if s.same_as(statement))

    inside = list(mutants.statements(scores.body))
    (between,) = [s for s in statements if mutants.is_barrier(s, "tirx.tvm_storage_sync")
                  and place(scores) < place(s) < place(softmax) and not any(s.same_as(t) for t in inside)]
    nothing = tirx.Evaluate(tirx.const(0, "int32"))
    dropped = kernel.func.with_body(mutants.rewrite(kernel.func.body, lambda s: nothing if s.same_as(between) else s))
    caught = mutants.validate(kernel, dropped).violations
    assert any(v.startswith("stage 2 (writes compute) / stage 3 (writes compute): ") and "(same block" in v
               and "with no __syncthreads" in v for v in caught), caught


@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_scores_softmax_and_product_in_one_block_match_torch_on_emulated_threads(dear_barriers, order):
    graph, inputs, expected = _scored_attention()
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4, precision="fp16")
    (got,) = model.schedule(order).run(inputs)
    np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2)


def test_a_whole_row_tile_is_the_columns_over_the_warps():
    assert str(whole_row_tile(64, 384, 8)) == "64x384x64 (1x8 warps of 4x3 fragments)"
    assert not whole_row_tile(64, 384, 8).pipelined
    assert whole_row_tile(64, 200, 8) is None  # 25 columns a warp
    assert whole_row_tile(72, 384, 8) is None  # 4.5 fragments of rows
    assert whole_row_tile(128, 512, 8) is None  # 8 x 4 fragments a warp: more than 16


def _rows_over_their_sums(rows: int):
    """x / its row sums over 3 x ``rows`` rows of 64: a row-resident stage's function."""
    from tvm import te

    x = te.placeholder((3, rows, 64), name="x")
    r = te.reduce_axis((0, 64), "r")
    total = te.compute((3, rows), lambda i, j: te.sum(x[i, j, r], axis=r), name="total")
    y = te.compute((3, rows, 64), lambda i, j, k: x[i, j, k] / total[i, j], name="y")
    return te.create_prim_func([x, y])


def test_several_rows_a_warp_need_tiles_that_divide_the_last_row_axis():
    func = _rows_over_their_sums(40)
    _, schedule = row_resident_stage(func, True, THREADS, 5)  # 40 rows: one tile of 8 warps x 5
    assert (schedule.n_tiles, schedule.per_tile) == (3, 40 * 64)
    with pytest.raises(ScheduleError, match="tiles of 16 rows do not divide its last row axis \\(40\\)"):
        row_resident_stage(func, True, THREADS, 2)


def test_tiles_of_fewer_rows_than_their_warps_idle_the_last_warps_last_rows():
    func = _rows_over_their_sums(49)
    _, schedule = row_resident_stage(func, True, THREADS, 7, 49)  # a window: 8 warps of 7 rows, 7 idle
    assert (schedule.n_tiles, schedule.per_tile) == (3, 49 * 64)
    with pytest.raises(ScheduleError, match="tiles of 40 rows are not 7 rows for each of 8 warps"):
        row_resident_stage(func, True, THREADS, 7, 40)


def _windows(windows: int = 32):
    """Window attention as in paper Swin's first stage, at fp16: ``windows`` windows x heads of 49
    tokens, q.k^T, the softmax, and its product with the values (32 a head, a weight); the graph,
    inputs and PyTorch's answer."""
    rng = np.random.default_rng(5)
    b = GraphBuilder("windows")
    q, k = (b.input(name, (windows, 49, 32)) for name in ("q", "k"))
    values = b.param("values", rng.standard_normal((windows, 49, 32)).astype("float32"))
    scores = b.op("batch_matmul", q, k, transpose_b=True)
    graph = b.build(b.op("batch_matmul", b.op("softmax", scores), values))
    inputs = {name: rng.standard_normal((windows, 49, 32)).astype("float32") for name in ("q", "k")}
    half = {name: torch.from_numpy(v).half().float() for name, v in inputs.items()}
    products = torch.bmm(half["q"], half["k"].transpose(1, 2)).half().float()
    half_values = torch.from_numpy(graph.weights["values"].copy()).half().float()
    return graph, inputs, torch.bmm(torch.softmax(products, -1).half().float(), half_values).numpy()


@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_a_window_s_49_rows_are_one_tile_with_its_scores_and_product(dear_barriers, order):
    """Paper Swin's windows: the scores and P.V are a tile a window (tensor cores, dlight's
    matmul), and the softmax, 8 rows a tile, was a grid barrier from each. In tiles of 49 rows
    (7 a warp, the last warp idle) all three run in one block, and the kernel matches PyTorch
    on emulated threads."""
    graph, inputs, expected = _windows()
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4, precision="fp16")
    stages = _stages(model.plan)
    softmax = stages["T_softmax_maxelem+T_softmax_expsum+softmax_2"]
    product = stages["T_batch_matmul_NN+batch_matmul_3"]
    assert (softmax.schedule.n_tiles, softmax.schedule.per_tile) == (32, 49 * 49)
    assert product.schedule.n_tiles == 32 and stages["T_batch_matmul_NT+compute"].schedule.n_tiles == 32
    assert softmax.barrier is None and product.barrier is None
    assert softmax.block_barrier is not None and product.block_barrier is not None
    (got,) = model.schedule(order).run(inputs)
    np.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2)


def test_the_no_aligned_tiles_variant_keeps_the_softmax_a_warp_a_row(dear_barriers):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gpu_variants

    with gpu_variants.applied("no-aligned-tiles"):
        result = _aligned_plan()
    stages = _stages(result.ir)
    assert stages[SOFTMAX].schedule.n_tiles == HEADS * ROWS // (THREADS // WARP)
    assert stages[PRODUCT].barrier is not None and _notes(result) == []
    assert _stages(_aligned_plan().ir)[PRODUCT].barrier is None


def test_bert_with_its_softmax_aligned_matches_torch_on_emulated_threads(dear_barriers, capsys):
    """A BERT of two layers of 2 heads over 128 tokens at fp16: each layer's softmax goes with its
    P.V, its scores in whole rows with it (the attention mask, the scale and the casts around
    them), threads in descending order."""
    from souffle.cli import main

    config = '{"layers": 2, "hidden": 128, "heads": 2, "ffn": 128, "seq": 128, "max_positions": 128}'
    assert main(["compile", "bert", "--config", config, "--target", "cuda-emulated", "--precision", "fp16",
                 "--check", "--thread-order", "descending"]) == 0
    out = capsys.readouterr().out
    assert "tiles of 64 whole rows (64x128x64 (1x8 warps of 4x1 fragments)), tile t the rows tile t reads: " \
        "4 grid barriers fewer (h200: " in out and "check          PASS" in out, out


class _TorchAttention(torch.nn.Module):
    """Self-attention as a PyTorch user writes it: 4-D heads, a fused QKV projection."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(128, 384)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, s, 3, 2, 64).permute(2, 0, 3, 1, 4)
        p = torch.softmax(q @ k.transpose(-1, -2) / 8.0, dim=-1)
        return (p @ v).transpose(1, 2).reshape(b, s, 128)


def test_an_imported_pytorch_attention_is_aligned_and_matches_it_on_emulated_threads(dear_barriers):
    """torch.export's graph of 4-D heads ([1, 2, 128, 64]): the softmax's rows split along its
    last row axis, the scores in whole rows, all three in one block."""
    from souffle.importers.torch_export import from_torch

    torch.manual_seed(0)
    module = _TorchAttention().eval()
    x = torch.randn(1, 128, 128)
    graph = from_torch(module, (x,))
    model = souffle.compile(graph, target="cuda-emulated", precision="fp16")
    assert any("whole rows" in note and ": 2 grid barriers fewer" in note for note in model.transforms)
    (got,) = model.schedule("descending").run({graph.inputs[0].name: x.numpy()})
    np.testing.assert_allclose(got, module(x).detach().numpy(), rtol=1e-2, atol=1e-2)
