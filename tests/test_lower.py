import numpy as np

from souffle.graph import GraphBuilder
from souffle.lower import LoopRegion, Region, lower_graph


def _graph():
    body = GraphBuilder("layer")
    h = body.input("h", (1, 4))
    w = body.param("w", (4, 4))
    body_graph = body.build(body.op("relu", body.op("dense", h, w, name="mm"), name="h_next"))

    b = GraphBuilder("net")
    x = b.input("x", (1, 4))
    pre = b.op("relu", x, name="pre")
    ws = [b.param(f"layer.{i}.w", np.eye(4, dtype="float32")) for i in range(2)]
    (final,), _ = b.scan(body_graph, 2, name="layers", carry=[("h", "h_next", pre)], params={"w": ws})
    return b.build(b.op("add", final, pre, name="out"))


def test_regions_split_at_scans():
    program = lower_graph(_graph())
    kinds = [type(r) for r in program.regions]
    assert kinds == [Region, LoopRegion, Region]
    first, loop, last = program.regions
    assert first.inputs == ["x"] and first.outputs == ["pre"]
    assert loop.scan.length == 2 and isinstance(loop.body.regions[0], Region)
    assert last.inputs == ["layers.h", "pre"] and last.outputs == ["out"]


def test_te_count_and_stage_order():
    program = lower_graph(_graph())
    origins = [program.op_of(t).outputs[0] for t in program.stages()]
    # relu(x); loop body: dense, relu; add
    assert origins == ["pre", "mm", "h_next", "out"]
    assert program.te_count() == 4


def test_producers_and_consumers_cross_regions_and_loops():
    program = lower_graph(_graph())
    first, loop, last = program.regions
    pre, out = first.tensors["pre"], last.tensors["out"]
    body_out = loop.body.regions[0].tensors["h_next"]
    producers = program.producers(out)
    assert producers[0].op.same_as(body_out.op) and producers[1].op.same_as(pre.op)
    assert [c.op.name for c in program.consumers(pre)] == [out.op.name]
    assert program.consumers(out) == []


def test_program_prints_every_region():
    text = str(lower_graph(_graph()))
    assert "loop layers x2:" in text
    assert "region net_r0: x -> pre" in text
    assert "T_matmul_NT[i0, i1] reduce[k] [1, 4]" in text
