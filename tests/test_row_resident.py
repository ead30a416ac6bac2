"""Row-resident stages (codegen.row_resident): a softmax's or LayerNorm's statistics and output in
one stage, a warp a row, the row loaded once into registers.

Checked three ways: the staged program has one such stage where there were two (and the
``no-row-resident`` variant keeps the two); the CUDA kernel runs on the emulator (every GPU thread
a fiber, scratch poisoned) and matches PyTorch, rows straddling tiles, widths a multiple of a warp
and not (the last lanes' last column idle); and the check that decides what may be cached is
tested by the reads it must refuse.
"""

import re

import numpy as np
import pytest
import torch
from tvm import s_tir, te

import souffle
from codegen.epilogues import _row_statistic
from codegen.row_resident import _reads_along_row
from codegen.schedule import THREADS, WARP
from souffle.compiler import run_passes
from souffle.graph import GraphBuilder

WARPS = THREADS // WARP


def _graph(kind: str, shape):
    """``kind`` (softmax or layer_norm) over the last axis of an input of ``shape``; the graph and
    its PyTorch reference."""
    rng = np.random.default_rng(0)
    b = GraphBuilder(kind)
    x = b.input("x", shape)
    n = shape[-1]
    if kind == "softmax":
        y = b.op("softmax", x)
    else:
        y = b.op("layer_norm", x, b.param("g", rng.standard_normal(n).astype("float32")),
                 b.param("beta", rng.standard_normal(n).astype("float32")))
    graph = b.build(y)
    weights = {k: torch.from_numpy(v.copy()) for k, v in graph.weights.items()}

    def reference(t):
        if kind == "softmax":
            return torch.softmax(t, -1)
        return torch.nn.functional.layer_norm(t, (n,), weights["g"], weights["beta"])

    return graph, reference


FUSED = {"softmax": "T_softmax_maxelem+T_softmax_expsum+softmax_1",
         "layer_norm": "layer_norm_sum+layer_norm_moments+layer_norm_1"}


@pytest.mark.parametrize("kind", ["softmax", "layer_norm"])
@pytest.mark.parametrize("shape", [(3, 10, 64), (5, 33), (64, 128), (2, 8, 7, 49)], ids=str)
def test_a_row_s_statistics_and_output_are_one_stage(kind, shape):
    """One stage, a warp a row: tiles of 8 rows (the last one partial where the rows are not a
    multiple of 8), no shared memory; at O4 no barrier inside the stage's program at all."""
    staged = run_passes(_graph(kind, shape)[0], "cuda", stop="plan_arena", opt_level=4).ir
    rows, width = int(np.prod(shape[:-1])), shape[-1]
    assert [(s.name.split("/")[-1], s.epilogue, s.schedule.template, s.schedule.n_tiles, s.schedule.per_tile,
             s.schedule.shared_bytes) for s in staged.stages()] == \
        [(FUSED[kind], "row", "warp_reduce", -(-rows // WARPS), WARPS * width, 0)]
    assert staged.barrier_count() == 0


def test_without_the_variant_the_statistics_are_stages_of_their_own(pair_epilogues):
    staged = run_passes(_graph("layer_norm", (64, 128))[0], "cuda", stop="plan_arena", opt_level=4).ir
    assert [(s.name.split("/")[-1], s.epilogue) for s in staged.stages()] == \
        [("layer_norm_sum", None), ("layer_norm_moments+layer_norm_1", "shared")]


@pytest.mark.parametrize("kind", ["softmax", "layer_norm"])
@pytest.mark.parametrize("width", [128, 49])
def test_each_thread_loads_its_columns_of_the_row_once(kind, width):
    """The row cache is the thread's own width / 32 columns, rounded up (TVM alone would size it
    by the warp's whole row: 128 floats a thread for 4 used; a Swin window's 49 take two, the
    second in 17 lanes); x is read by the cache's load alone, 4 floats at a time where the row
    is whole vectors of 4 for every lane (128); the stage has no __syncthreads."""
    model = souffle.compile(_graph(kind, (64, width))[0], target="cuda", opt_level=4)
    kernel = model.source[model.source.rindex("main_kernel("):]  # the definition, after its declaration
    assert re.findall(r"float (x_in_local_ptr)\[(\d+)\];", kernel) == [("x_in_local_ptr", str(-(-width // WARP)))]
    loads = re.findall(r"\bx_in\[|\*\(float4\*\)\(x_in \+", kernel)
    assert loads == (["*(float4*)(x_in +"] if width == 128 else ["x_in["])
    assert "__syncthreads" not in kernel


@pytest.mark.parametrize("order", ["ascending", "descending"])
@pytest.mark.parametrize("kind", ["softmax", "layer_norm"])
@pytest.mark.parametrize("shape", [(3, 10, 64), (5, 33), (2, 7, 96), (8, 96), (3, 40), (2, 8, 7, 49), (2, 8, 7, 64)],
                         ids=str)
def test_the_emulated_kernel_matches_torch(kind, shape, order):
    """Rows straddling a tile and a leading dimension, a partial last tile, a width of 33 (two
    columns a lane, the second in lane 0 alone) and one of 96 (three columns a lane), single tiles,
    whose stage is simplified once its lanes' reductions are lowered, and rows of several axes
    whose last is no multiple of the warps (Swin's windows x heads x 49 rows), flattened first;
    rows of 64, two consecutive columns a lane (``row_vector``)."""
    graph, reference = _graph(kind, shape)
    x = np.random.default_rng(1).standard_normal(shape).astype("float32") * 3
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4)
    assert [(s.epilogue, s.schedule.row_vector) for s in model.plan.stages()] == \
        [("row", 2 if shape[-1] == 64 else 1)]
    (got,) = model.schedule(order).run({"x": x})
    np.testing.assert_allclose(got, reference(torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-5)


def _between_gemms(kind: str, rows: int, width: int):
    """``kind`` over the ``width`` columns of a dense layer's output, read by another dense layer:
    at fp16 and bf16 its rows are read and written narrow. The graph and PyTorch's answer at a
    precision (each stored result rounded to it, the products accumulated in float32)."""
    rng = np.random.default_rng(4)
    graph, reference = _graph(kind, (rows, width))
    b = GraphBuilder(kind)
    before = b.param("before", rng.standard_normal((width, 64)).astype("float32") / 8)
    after = b.param("after", rng.standard_normal((32, width)).astype("float32") / 8)
    weights = [b.param(name, value) for name, value in graph.weights.items()]
    x = b.input("x", (rows, 64))
    y = b.op(kind, b.op("dense", x, before), *weights)
    built = b.build(b.op("dense", y, after))

    def answer(x: np.ndarray, narrow) -> np.ndarray:
        def rounded(t):
            return t.to(narrow).float()
        w = {k: rounded(torch.from_numpy(v.copy())) for k, v in built.weights.items()}
        rows_in = rounded(rounded(torch.from_numpy(x)) @ w["before"].T)
        return rounded(rounded(reference(rows_in)) @ w["after"].T).numpy()

    return built, answer


@pytest.mark.parametrize("width,precision,vector", [
    (768, "fp16", 8), (384, "fp16", 4), (256, "bf16", 8), (64, "fp16", 2), (768, "fp32", 4), (64, "fp32", 2),
    (96, "fp32", 1), (49, "fp16", 1), (33, "fp32", 1)])
def test_each_lane_moves_its_row_in_vectors_of_16_bytes_at_most(width, precision, vector):
    """A lane takes ``vector`` consecutive columns in each run of 32 x ``vector`` (``row_vector``),
    the most whose elements of the widest tensor moved along the row fit in 16 bytes, where the
    row is whole such runs: a LayerNorm over 768 halves loads 8 at a time (3 loads a row where it
    took 24); over 96 floats, 3 a lane, one at a time. The latency model counts a warp's loads of
    the row as vectors."""
    from analysis.device import get_device
    from codegen.latency import stage_works

    staged = run_passes(_between_gemms("layer_norm", 64, width)[0], "cuda", stop="plan_arena", opt_level=4,
                        precision=precision).ir
    (row,) = [k for k, s in enumerate(staged.stages()) if s.epilogue == "row"]
    stage = staged.stages()[row]
    assert stage.schedule.row_vector == vector
    itemsize = 4 if precision == "fp32" else 2
    work = stage_works(staged, get_device("h100"))[row]
    rows = stage.schedule.per_tile // width
    assert [(a.per_tile, a.sectors) for a in work.accesses if a.kind == "load" and a.space == "global"][0] == \
        (rows * -(-width // (WARP * vector)), max(1, min(width, WARP * vector) * itemsize // 32))


def test_a_half_row_is_loaded_16_bytes_a_lane_and_computed_a_float4_at_a_time():
    """At fp16 a LayerNorm over 768 halves loads its row as ``uint4`` (8 halves a lane) into the
    cache and computes and stores its output 4 at a time: a float32 vector of 8 is printed as a
    ``make_ulonglong4`` of eight values, which nvcc refuses."""
    model = souffle.compile(_between_gemms("layer_norm", 64, 768)[0], target="cuda", opt_level=4, precision="fp16")
    kernel = model.source[model.source.rindex("main_kernel("):]
    assert re.search(r"\*\(uint4\*\)\(\w+_local_ptr \+ \(\w+ \* 8\)\) = \*\(uint4\*\)", kernel), kernel
    assert "float4" in kernel and "ulonglong4" not in kernel
    assert model.resources.spill_bytes == 0 and model.resources.stack_bytes == 0


@pytest.mark.parametrize("kind,precision,rows,width", [
    (kind, *case) for kind in ("softmax", "layer_norm") for case in (("fp16", 9, 256), ("fp16", 10, 128),
                                                                     ("bf16", 12, 256))] + [("layer_norm", "fp32", 9, 128)],
    ids=str)
def test_rows_moved_in_vectors_match_torch_on_emulated_threads(kind, precision, rows, width):
    """Rows between two GEMMs loaded and stored in vectors of 8 (fp16 and bf16 over 256) and 4
    (fp16 over 128, fp32), a partial last tile, in both thread orders, against PyTorch at the same
    precision. (This softmax at fp32 is two reductions with shared-memory epilogues, no row-resident
    stage.)"""
    graph, answer = _between_gemms(kind, rows, width)
    x = np.random.default_rng(5).standard_normal((rows, 64)).astype("float32")
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4, precision=precision)
    assert [s.schedule.row_vector for s in model.plan.stages() if s.epilogue == "row"] == \
        [8 if width == 256 and precision != "fp32" else 4]
    narrow = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    expected = answer(x, narrow)
    tolerance = {"fp16": 1e-2, "bf16": 6e-2, "fp32": 1e-5}[precision]
    for order in ("ascending", "descending"):
        (got,) = model.schedule(order).run({"x": x})
        np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance, err_msg=order)


def test_a_cache_indexed_one_column_a_lane_under_vectors_is_caught(monkeypatch):
    """A mutant: the row cache indexed as when each lane took one column in each run of 32
    (``_thread_private`` without the vector) while the lanes load vectors of 4. Every access
    stays in bounds and race-free, so the validator has nothing to refuse; the emulated run
    reads other lanes' columns and is far off PyTorch, as the emulated tests above would find."""
    import codegen.row_resident as row_resident

    thread_private = row_resident._thread_private
    monkeypatch.setattr(row_resident, "_thread_private", lambda func, caches, vector=1: thread_private(func, caches))
    graph, reference = _graph("layer_norm", (9, 128))
    x = np.random.default_rng(1).standard_normal((9, 128)).astype("float32")
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4)
    assert [s.schedule.row_vector for s in model.plan.stages()] == [4]
    (got,) = model.schedule("ascending").run({"x": x})
    assert np.abs(got - reference(torch.from_numpy(x)).numpy()).max() > 1


@pytest.mark.parametrize("read,vector", [
    (lambda r, c: (r, c), 2),
    (lambda r, c: (r, 63 - c), 1),  # a vector reversed
    (lambda r, c: (r, (c + 1) % 64), 1),  # a vector off its alignment
    (lambda r, c: (c % 4, r), 1),  # along the column of another axis
    (lambda r, c: (0, c), 2),  # one row for every row: whole vectors still
])
def test_only_loads_of_whole_vectors_at_the_column_are_vectorized(read, vector):
    """``row_vector`` vectorizes a row of 64 floats 2 a lane only where every load along the row
    reads each vector consecutively from a multiple of its width."""
    from codegen.row_resident import row_vector

    block, _ = _block(read)
    assert row_vector(64, [block]) == vector


@pytest.mark.parametrize("kind", ["softmax", "layer_norm"])
def test_the_cpu_runs_the_same_stage(kind):
    """The CPU run of the staged program (``llvm-persistent``, scratch poisoned) runs the
    row-resident stage's tiles, without threads or the row cache."""
    from model_checks import run_poisoned

    graph, reference = _graph(kind, (3, 10, 64))
    x = np.random.default_rng(2).standard_normal((3, 10, 64)).astype("float32")
    model = souffle.compile(graph, target="llvm-persistent", opt_level=4)
    assert [s.epilogue for s in model.plan.stages()] == ["row"]
    (got,) = run_poisoned(model, {"x": x})
    np.testing.assert_allclose(got, reference(torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-5)


def _block(read):
    """The block of ``out[r, c] = x[<read(r, c)>]`` over x of (4, 64)."""
    x = te.placeholder((4, 64), name="x")
    out = te.compute((4, 64), lambda r, c: x[read(r, c)] * 2, name="out")
    sch = s_tir.Schedule(te.create_prim_func([x, out]))
    return sch.get(sch.get_sblock("out")), x


@pytest.mark.parametrize("read,along", [
    (lambda r, c: (r, c), True),
    (lambda r, c: (r, 63 - c), False),  # another lane's column
    (lambda r, c: (r, (c + 1) % 64), False),
    (lambda r, c: ((r + 1) % 4, c), False),  # another warp's row
    (lambda r, c: (0, c), False),  # row 0 for every row: a row of extent 4, not 1
])
def test_only_reads_at_the_thread_s_own_row_and_column_are_cached(read, along):
    """The cache drops its row and lane dimensions, which is exact only where each thread reads
    what it loaded: every read of the cached tensor at the block's own row and column."""
    block, _ = _block(read)
    source = block.reads[0].source
    assert _reads_along_row(block, source) is along


def test_a_batch_axis_of_one_is_read_at_its_one_index():
    x = te.placeholder((1, 4, 64), name="x")
    out = te.compute((1, 4, 64), lambda b, r, c: x[0, r, c] * 2, name="out")
    sch = s_tir.Schedule(te.create_prim_func([x, out]))
    block = sch.get(sch.get_sblock("out"))
    assert _reads_along_row(block, block.reads[0].source)


def test_a_statistic_is_a_few_results_a_row():
    """A LayerNorm's row sum and moments are statistics of its rows; a split GEMM's partial
    products that only the LayerNorm reads (paper BERT's FFN2, ``codegen.split_k``) are not,
    though they too are reductions of row length that nothing else reads."""
    output = te.placeholder((1, 384, 768), name="out")
    assert _row_statistic(te.placeholder((1, 384), name="sum"), output)
    assert _row_statistic(te.placeholder((1, 384, 2), name="moments"), output)
    assert not _row_statistic(te.placeholder((4, 384, 768), name="parts"), output)
    assert not _row_statistic(te.placeholder((1, 384, 768), name="whole"), output)


@pytest.mark.parametrize("shape", [(64, 128), (5, 33)], ids=str)
def test_a_layer_norm_s_two_moments_stay_in_registers(shape):
    """The moments (two results a row) are computed in a loop nvcc unrolls (``#pragma unroll``):
    indexed by a loop, nvcc put their array in local memory (a stack frame in ptxas' report)."""
    model = souffle.compile(_graph("layer_norm", shape)[0], target="cuda", opt_level=4)
    assert re.search(r"#pragma unroll\s+for \(int ax0 = 0; ax0 < 2; \+\+ax0\)", model.source), model.source
    assert model.resources.stack_bytes == 0 and model.resources.spill_bytes == 0


def _split_gemm_then_layer_norm(width: int = 128):
    """layer_norm(x @ W.T + bias + r) over 96 rows, K = 1024: at O4 the GEMM's 4 tiles are split
    over K (``codegen.split_k``) and the LayerNorm reads the two partial products, the bias and
    the residual, as paper BERT's FFN2 LayerNorm reads its four. The graph and PyTorch's answer
    at a precision (each stored result rounded to it, products accumulated in float32)."""
    rng = np.random.default_rng(7)
    b = GraphBuilder("split_ln")
    x, r = b.input("x", (96, 1024)), b.input("r", (96, width))
    weights = {"w": rng.standard_normal((width, 1024)).astype("float32") / 32,
               **{name: rng.standard_normal(width).astype("float32") for name in ("bias", "g", "beta")}}
    w, bias, g, beta = (b.param(name, value) for name, value in weights.items())
    graph = b.build(b.op("layer_norm", b.op("add", b.op("dense", x, w, bias), r), g, beta))

    def answer(inputs: dict, narrow) -> np.ndarray:
        def rounded(t):
            return t.to(narrow).float()
        t = {k: rounded(torch.from_numpy(v.copy())) for k, v in {**inputs, **weights}.items()}
        y = rounded(rounded(t["x"] @ t["w"].T + t["bias"]) + t["r"])
        return rounded(torch.nn.functional.layer_norm(y, (width,), t["g"], t["beta"])).numpy()

    return graph, answer


def test_a_row_of_split_k_partials_is_summed_once_into_registers():
    """The LayerNorm after a split GEMM computes its row's value (the parts' sum, the bias and the
    residual) once into registers (``with_row_value``): each part is loaded once, 4 floats at a
    time, where the sum, the two moments and the output each loaded every part again."""
    model = souffle.compile(_split_gemm_then_layer_norm()[0], target="cuda", opt_level=4, precision="fp16")
    (row,) = [s for s in model.plan.stages() if s.epilogue == "row"]
    assert [p.op.name for p in row.placeholders][0] == "T_matmul_NT_part_in"
    kernel = model.source[model.source.rindex("main_kernel("):]
    assert re.findall(r"float (row_value_local_ptr)\[(\d+)\];", kernel) == [("row_value_local_ptr", "4")]
    assert re.findall(r"\*\(float4\*\)\(T_matmul_NT_part_in \+|T_matmul_NT_part_in\[", kernel) == \
        ["*(float4*)(T_matmul_NT_part_in +"] * 2
    assert model.resources.spill_bytes == 0 and model.resources.stack_bytes == 0


def test_the_model_counts_each_partial_s_row_once():
    """The latency model loads a row of each part, as the stage now does: two loads of the parts'
    tensor a row (where it counted one), each 4 floats a lane, 16 sectors a warp."""
    from analysis.device import get_device
    from codegen.latency import stage_works

    staged = run_passes(_split_gemm_then_layer_norm()[0], "cuda", stop="plan_arena", opt_level=4,
                        precision="fp16").ir
    (row,) = [k for k, s in enumerate(staged.stages()) if s.epilogue == "row"]
    work = stage_works(staged, get_device("h100"))[row]
    rows = staged.stages()[row].schedule.per_tile // 128
    assert [(a.per_tile, a.sectors) for a in work.accesses if a.tensor == "T_matmul_NT_part_in"] == [(rows, 16)] * 2


@pytest.mark.parametrize("precision,tolerance", [("fp16", 1e-2), ("fp32", 1e-4)])
def test_a_layer_norm_of_split_k_partials_matches_torch_on_emulated_threads(precision, tolerance):
    graph, answer = _split_gemm_then_layer_norm()
    rng = np.random.default_rng(8)
    inputs = {"x": rng.standard_normal((96, 1024)).astype("float32"),
              "r": rng.standard_normal((96, 128)).astype("float32")}
    model = souffle.compile(graph, target="cuda-emulated", opt_level=4, precision=precision)
    assert [s.epilogue for s in model.plan.stages() if "T_matmul_NT_part_in" in [p.op.name for p in s.placeholders]] \
        == ["row"]
    narrow = {"fp16": torch.float16, "fp32": torch.float32}[precision]
    for order in ("ascending", "descending"):
        (got,) = model.schedule(order).run(inputs)
        np.testing.assert_allclose(got, answer(inputs, narrow), rtol=tolerance, atol=tolerance, err_msg=order)


def _parts_layer(shifted: bool = False):
    """A statistic of rows that are two parts' sum, and an output that reads the same sum at its
    own column (or, ``shifted``, at the next one)."""
    parts = te.placeholder((2, 8, 64), name="parts")

    def value(r, c):
        return parts[0, r, c] + parts[1, r, c]

    k = te.reduce_axis((0, 64), "k")
    total = te.compute((8,), lambda r: te.sum(value(r, k), axis=k), name="total")
    return te.compute((8, 64), lambda r, c: value(r, (c + 1) % 64 if shifted else c) - total[r] / 64, name="out")


def _loads(tensor) -> set:
    return {t.op.name for t in tensor.op.input_tensors}


@pytest.mark.parametrize("shifted", [False, True])
def test_the_row_s_value_is_read_only_where_a_body_computes_it_at_its_own_place(shifted):
    """The statistic reads ``row_value``; so does the output where it computes the same sum at its
    own row and column, and not where it computes it at another column, which keeps its loads."""
    from codegen.row_resident import ROW_VALUE, with_row_value

    out = with_row_value(_parts_layer(shifted))
    (total,) = [t for t in out.op.input_tensors if t.op.name == "total"]
    assert _loads(total) == {ROW_VALUE}
    assert _loads(out) == ({"parts", "total"} if shifted else {ROW_VALUE, "total"})


def test_rows_a_cache_holds_get_no_value_of_their_own():
    """A row read at its own place (one tensor's row, a vector every row reads) is cached as it is."""
    from codegen.row_resident import with_row_value

    x, scale = te.placeholder((8, 64), name="x"), te.placeholder((64,), name="scale")
    k = te.reduce_axis((0, 64), "k")
    total = te.compute((8,), lambda r: te.sum(x[r, k] * scale[k], axis=k), name="total")
    out = te.compute((8, 64), lambda r, c: x[r, c] * scale[c] - total[r], name="out")
    assert with_row_value(out) is out
