"""Per-stage templates: which template a block gets, its tiles, and the loops it binds."""

import pytest
import tvm
from tvm import s_tir, te

from codegen.schedule import ScheduleError, choose_template, schedule_stage, warp_outputs


def _func(shape, reduce=None):
    a = te.placeholder(tuple(shape) + ((reduce,) if reduce else ()), name="a")
    if reduce is None:
        out = te.compute(shape, lambda *i: te.max(a(*i), 0.0), name="relu")
    else:
        k = te.reduce_axis((0, reduce), "k")
        out = te.compute(shape, lambda *i: te.sum(a(*i, k), axis=k), name="rsum")
    return te.create_prim_func([a, out])


def _bindings(func) -> list[tuple[str, int]]:
    sch = s_tir.Schedule(func)
    block = sch.get_child_blocks(sch.get_sblock("root"))[0]
    found = []
    for loop in sch.get_loops(block):
        node = sch.get(loop)
        tag = node.thread_binding.thread_tag if node.thread_binding is not None else "serial"
        found.append((tag, int(node.extent)))
    return found


@pytest.mark.parametrize("spatial,reduction,template", [
    (1000, 1, "elementwise"),
    (1024, 256, "warp_reduce"),  # a GEMV: few outputs, long reductions
    (4608, 384, "warp_reduce"),  # softmax rows
    (294912, 768, "thread_reduce"),  # a GEMM: an output for every thread of the grid
    (1024, 32, "warp_reduce"),  # one reduction step per lane
    (1024, 16, "thread_reduce"),  # shorter reductions would leave a warp's lanes idle
])
def test_template_choice(spatial, reduction, template):
    assert choose_template(spatial, reduction) == template


def test_elementwise_tiles_the_flat_output():
    func, schedule = schedule_stage(_func((64, 300)), gpu=True)
    assert (schedule.template, schedule.n_tiles, schedule.per_tile, schedule.threads) == ("elementwise", 75, 256, 256)
    assert _bindings(func) == [("blockIdx.x", 75), ("serial", 1), ("threadIdx.y", 8), ("threadIdx.x", 32)]
    assert schedule.shared_bytes == 0


def test_warp_reduce_gives_each_warp_an_output():
    func, schedule = schedule_stage(_func((64,), reduce=300), gpu=True)
    assert (schedule.template, schedule.n_tiles, schedule.per_tile) == ("warp_reduce", 8, 8)
    assert _bindings(func) == [("blockIdx.x", 8), ("threadIdx.y", 8), ("serial", 10), ("threadIdx.x", 32)]


def _two_sums(shared_row: bool):
    """Two sums a row, of x and of x^2 (a row's moments), or over two rows of a weight (a GEMV)."""
    x = te.placeholder((64, 300), name="x")
    w = te.placeholder((2, 300), name="w")
    k = te.reduce_axis((0, 300), "k")
    if shared_row:
        return te.compute((64, 2), lambda r, c: te.sum(tvm.tirx.Select(c == 0, x[r, k], x[r, k] * x[r, k]), axis=k),
                          name="moments")
    return te.compute((64, 2), lambda r, c: te.sum(x[r, k] * w[c, k], axis=k), name="gemv")


def test_a_warp_takes_the_outputs_that_read_the_same_row():
    """A row's two moments read the same elements: one warp takes both, one after the other, so
    that a tile holds whole rows (8, like the row sums' tiles) and the second pass reads L1. A
    GEMV's two outputs a row read two rows of the weight: a warp each, as before."""
    moments, gemv = _two_sums(True), _two_sums(False)
    assert (warp_outputs(moments), warp_outputs(gemv)) == (2, 1)
    x = moments.op.input_tensors[0]
    _, schedule = schedule_stage(te.create_prim_func([x, moments]), gpu=True, per_warp=warp_outputs(moments))
    assert (schedule.template, schedule.n_tiles, schedule.per_tile) == ("warp_reduce", 8, 16)
    k = te.reduce_axis((0, 300), "k")
    assert warp_outputs(te.compute((), lambda: te.sum(x[0, k], axis=k), name="total")) == 1
    wide = te.compute((64, 5), lambda r, c: te.sum(x[r, k], axis=k), name="wide")
    assert warp_outputs(wide) == 1  # longer than SAME_ELEMENTS_AXIS_MAX


def test_thread_reduce_gives_each_thread_an_output():
    func, schedule = schedule_stage(_func((64, 64), reduce=16), gpu=True)
    assert (schedule.template, schedule.n_tiles, schedule.per_tile) == ("thread_reduce", 16, 256)
    assert _bindings(func) == [("blockIdx.x", 16), ("threadIdx.y", 8), ("threadIdx.x", 32), ("serial", 16)]


def test_the_cpu_gets_the_same_tiles_without_threads():
    gpu_func, gpu = schedule_stage(_func((64,), reduce=300), gpu=True)
    cpu_func, cpu = schedule_stage(_func((64,), reduce=300), gpu=False)
    assert gpu == cpu
    assert [extent for _, extent in _bindings(cpu_func)] == [extent for _, extent in _bindings(gpu_func)]
    assert {tag for tag, _ in _bindings(cpu_func)} == {"serial"}


def test_smaller_blocks_make_more_tiles():
    _, schedule = schedule_stage(_func((64, 300)), gpu=True, threads=64)
    assert (schedule.n_tiles, schedule.per_tile, schedule.threads) == (300, 64, 64)


def test_a_function_of_several_blocks_is_refused():
    a = te.placeholder((8,), name="a")
    b = te.compute((8,), lambda i: a[i] + 1.0, name="b")
    c = te.compute((8,), lambda i: b[i] * 2.0, name="c")
    with pytest.raises(ScheduleError, match="a stage must be one TE block, got 2"):
        schedule_stage(te.create_prim_func([a, c]), gpu=True)
