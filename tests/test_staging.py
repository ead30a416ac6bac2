"""The staged program: per-TE stages, barriers from access relations, arena reuse, and the CPU
run of the very stages the CUDA kernel runs, checked against PyTorch and hand-built numbers."""

import dataclasses

import numpy as np
import pytest
from model_checks import run_poisoned
from tvm import te, tirx

import souffle
from codegen import llvm
from codegen.arena import _live_ranges, plan_arena
from codegen.barriers import _Access, _same_memory, _Scope, place_barriers, same_block
from codegen.stage import isolate, stage_program
from codegen.staged import Loop, copy_items, stages_in
from codegen.stitch import BufferRef
from souffle.compiled import CpuModel
from souffle.compiler import run_passes
from souffle import models
from souffle.graph import GraphBuilder, TensorSpec
from souffle.lower import lower_graph

RNG = np.random.default_rng(3)


def _rand(*shape):
    return (RNG.standard_normal(shape) * 0.3).astype("float32")


def _staged(graph, threads=32, gpu=False):
    return plan_arena(place_barriers(stage_program(lower_graph(graph), gpu, threads)))


def _by_name(staged):
    return {s.name.split("/")[-1]: s for s in staged.stages()}


def _mlp():
    """y = relu(x W.T + b) . V.T — elementwise stages after a short reduction (one output per
    thread, 32 per tile, like theirs), then a long reduction (one output per tile)."""
    b = GraphBuilder("mlp")
    x = b.input("x", (4, 16))
    h = b.op("relu", b.op("add", b.op("dense", x, b.param("w", _rand(64, 16)), name="xw"), b.param("b", _rand(64)),
                          name="xwb"), name="h")
    return b.build(b.op("dense", h, b.param("v", _rand(64, 64)), name="y"))


def test_barriers_only_where_another_block_wrote_the_data():
    staged = _staged(_mlp())
    stages = _by_name(staged)
    # dense -> add -> relu: each tile reads exactly the elements its own tile wrote.
    assert [name for name, s in stages.items() if s.barrier is None] == ["xw", "xwb", "h"]
    # the second GEMM reads whole rows of h, written by other tiles: a barrier, with its reason.
    assert stages["y"].barrier == "reads h written by mlp_r0/h in other blocks"
    assert staged.barrier_count() == 1


def test_same_block_from_the_access_relation():
    staged = _staged(_mlp())
    stages = _by_name(staged)
    add, relu, second = stages["xwb"], stages["h"], stages["y"]
    assert same_block(relu, relu.placeholders[0], add)
    assert not same_block(second, second.placeholders[0], relu)


def test_a_transpose_with_different_tiles_needs_a_barrier():
    b = GraphBuilder("t")
    x = b.input("x", (32, 32))
    y = b.op("transpose", b.op("relu", x, name="r"), axes=(1, 0), name="y")
    staged = _staged(b.build(y))
    assert _by_name(staged)["y"].barrier == "reads r written by t_r0/r in other blocks"


def test_loop_carried_dependence_is_guarded_by_a_barrier():
    """h of step t feeds every output of step t+1's GEMV: some barrier must separate the stage
    writing h from the GEMV reading it one iteration later; c's update is element-wise, so it
    needs none of its own. The loop's entry barrier runs once, not every step."""
    staged = _staged(models.build("lstm", "tiny"))
    loop = next(item for item in staged.items if isinstance(item, Loop))
    names = [s.name.split("/")[-1] for s in loop.items]
    writes_h = max(k for k, s in enumerate(loop.items) if s.write.spec.name in ("h_next", "h"))
    reads_h = min(k for k, s in enumerate(loop.items) if any(r.spec.name == "h" for r in s.reads))
    between = loop.items[writes_h + 1:] + loop.items[:reads_h + 1]
    assert any(s.barrier for s in between), names
    assert loop.barrier == "reads h written by copy layer0.zeros -> h in other blocks"
    assert not any(s.barrier and "c_next" in s.name for s in loop.items)
    assert staged.barrier_count(executed=True) > staged.barrier_count()


def test_arena_reuses_memory_only_across_barriers():
    staged = _staged(models.build("bert", "tiny"))
    total = sum(size for _, size in staged.slots.values())
    assert staged.arena_sizes["float32"] < total  # offsets are reused
    ranges = _live_ranges(staged)
    slots = list(staged.slot_offsets)
    for i, a in enumerate(slots):
        for b in slots[i + 1:]:
            a_lo, a_hi = staged.slot_offsets[a], staged.slot_offsets[a] + staged.slots[a][1]
            b_lo, b_hi = staged.slot_offsets[b], staged.slot_offsets[b] + staged.slots[b][1]
            if a_lo < b_hi and b_lo < a_hi:  # the same memory: one must be dead before the other lives
                assert ranges[a][1] < ranges[b][0] or ranges[b][1] < ranges[a][0], (a.name, b.name)


def _check_on_cpu(name, config, threads):
    """The staged program run on the CPU, its arena full of NaN, against PyTorch."""
    graph = models.build(name, config)
    compiled = souffle.compile(graph, target="llvm-persistent", threads=threads)
    inputs = models.make_inputs(name, config, seed=1)
    expected = models.reference(name, config, graph.weights)(inputs)
    rtol, atol = models.tolerance(name, config)
    for got, want, out in zip(run_poisoned(compiled, inputs), expected, graph.outputs):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=out)


# Swin at 256 threads (20 s) runs with -m slow: at 32 threads its stages, tiles and barriers are
# checked by default, and the suite is at its 20-minute budget (a fresh clone took 18:28).
@pytest.mark.parametrize("name, threads", [
    *((name, threads) for threads in (32, 256) for name in models.MODELS if (name, threads) != ("swin", 256)),
    pytest.param("swin", 256, marks=pytest.mark.slow)])
def test_staged_program_on_cpu_matches_pytorch(name, threads):
    _check_on_cpu(name, "tiny", threads)


@pytest.mark.slow
@pytest.mark.parametrize("name", models.MODELS)
def test_paper_staged_program_on_cpu_matches_pytorch(name):
    _check_on_cpu(name, "paper", 256)


def _without_barrier_before(compiled, suffix: str) -> CpuModel:
    """``compiled`` (llvm-persistent) rebuilt with no grid barrier before the stage named ``.../suffix``."""
    items = copy_items(compiled.plan.items)
    (stage,) = [s for s in stages_in(items) if s.name.endswith("/" + suffix)]
    assert stage.barrier is not None
    stage.barrier = None
    staged = compiled.plan.with_items(items)
    module = llvm.CpuModule(staged, llvm.build(llvm.staged_function(staged, compiled.grid)), compiled.grid)
    return CpuModel(compiled.graph, dataclasses.replace(compiled.passes, ir=module))


def test_removing_a_needed_barrier_gives_wrong_results():
    """The CPU run is faithful enough to catch a missing barrier: blocks run in order, so a
    stage reading a later block's tile reads memory that tile has not written yet."""
    graph = _mlp()
    compiled = souffle.compile(graph, target="llvm-persistent", threads=32)
    inputs = {"x": _rand(4, 16)}
    w, bias, v = (graph.weights[k] for k in ("w", "b", "v"))
    expected = np.maximum(inputs["x"] @ w.T + bias, 0) @ v.T
    np.testing.assert_allclose(run_poisoned(compiled, inputs)[0], expected, rtol=1e-5, atol=1e-5)
    assert np.isnan(run_poisoned(_without_barrier_before(compiled, "y"), inputs)[0]).any()


def test_table_lists_stages_and_barrier_reasons():
    text = str(_staged(_mlp()))
    assert text.splitlines()[0].startswith("staged program mlp: 4 stages, 1 kernel (1 launched), 1 grid barriers (1 executed)")
    assert "-- grid barrier: reads h written by mlp_r0/h in other blocks" in text
    assert "mlp_r0/xw: thread_reduce 8 tiles x 32 elements, 32 threads" in text
    assert "mlp_r0/y: warp_reduce 256 tiles x 1 elements, 32 threads" in text


def _ref(base, offset, size):
    return BufferRef(base, offset, TensorSpec("t", (size,), "float32"))


@pytest.mark.parametrize("earlier,later,stale,expected", [
    ((0, 16), (16, 16), False, "disjoint"),  # neighbours in one buffer
    ((0, 16), (8, 16), False, "unknown"),  # partly overlapping
    ((0, 16), (0, 16), True, "same"),  # a fixed offset is the same memory in every iteration
    (("slot", 1), ("slot", 0), False, "disjoint"),  # ping-pong: next slot vs this iteration's slot
    (("slot", 1), ("slot", 0), True, "same"),  # last iteration's next slot is this one's current slot
    (("slice", 0), ("slice", 0), False, "same"),  # step i's slice of a sequence, twice in one step
    (("slice", 0), ("slice", 0), True, "disjoint"),  # an earlier step's slice is elsewhere
    ((0, 1600), ("slice", 0), False, "unknown"),  # the whole sequence vs one step's slice
])
def test_same_memory_over_loop_iterations(earlier, later, stale, expected):
    base = tirx.decl_buffer((4096,), "float32", name="arena")
    i = tirx.Var("i", "int64")
    scope = _Scope()
    scope.trips, scope.open = {i: 100}, [i]

    def ref(spec):
        kind, k = spec
        if kind == "slot":
            return _ref(base, 32 + tirx.floormod(i + k, 2) * 16, 16)
        if kind == "slice":
            return _ref(base, i * 16, 16)
        return _ref(base, kind, k)

    access = _Access(None, ref(earlier), None, frozenset({i}) if stale else frozenset())
    assert _same_memory(access, ref(later), scope) == expected


def test_a_reduction_reading_one_tensor_as_both_operands_gets_a_placeholder_for_each():
    """Q.K^T of one projection: two places of ``qk``, each an operand of its own placeholder (the
    GEMM rules need two). A concatenation read under conditions, or a square, keeps one."""
    qk = te.placeholder((8, 32), name="qk")
    w = te.placeholder((32,), name="w")
    k = te.reduce_axis((0, 16), "k")
    scores = te.compute((8, 8), lambda i, j: te.sum(qk[i, k] * qk[j, 16 + k], axis=k), name="scores")
    staged, placeholders, tensors = isolate(scores)
    assert [p.op.name for p in placeholders] == ["qk_in", "qk_in2"] and [t.op for t in tensors] == [qk.op, qk.op]
    assert sorted(t.op.name for t in staged.op.input_tensors) == ["qk_in", "qk_in2"]
    c = te.reduce_axis((0, 32), "c")
    halves = te.compute((8,), lambda i: te.sum(tirx.if_then_else(c < 16, qk[i, c], qk[i, 31 - c]) * w[c], axis=c),
                        name="halves")
    squares = te.compute((8,), lambda i: te.sum(qk[i, c] * qk[i, c], axis=c), name="squares")
    for single in (halves, squares):
        assert [t.op for t in isolate(single)[2]] == [qk.op, w.op][:len(single.op.input_tensors)]


def test_a_loop_whose_iterations_open_with_a_grid_barrier_has_none_before_it():
    """Tiny BERT's encoder loop: each iteration's first stage reads the hidden states the last
    one wrote, in other blocks, so every iteration opens with a grid barrier; the first one also
    orders the loop after the embeddings' LayerNorm, and a barrier before the loop would follow
    that LayerNorm with nothing between the two."""
    plan = run_passes(models.build("bert", "tiny"), "cuda", stop="plan_arena").ir
    (loop,) = [item for item in plan.items if isinstance(item, Loop)]
    assert not loop.loads and loop.barrier is None
    assert loop.items[0].barrier.startswith("reads hidden_states written by ")
    assert plan.barrier_count(executed=True) == 15
