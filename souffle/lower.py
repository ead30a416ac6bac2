"""Graph -> the global TE program.

Every op becomes TE tensors (through the op registry) in one dependency graph.
Ops between scans form a ``Region``: one TE graph, later one PrimFunc. A scan
becomes a ``LoopRegion`` whose body is itself a ``TEProgram``, lowered once and
looped. ``TEProgram.producers`` / ``consumers`` walk the whole program, across
regions and into loop bodies, which is what the global analysis needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tvm import te

from souffle.graph import Graph, Op, Scan, TensorSpec
from souffle.naming import c_name
from souffle.ops import lower_op


@dataclass
class Region:
    """A maximal run of ops with no scan between them, as one TE graph."""

    name: str
    ops: list[Op]
    inputs: list[str]  # tensors read from outside (graph inputs, parameters, earlier regions)
    outputs: list[str]  # tensors read after the region or returned by the graph
    tensors: dict[str, te.Tensor]  # every graph tensor of the region -> its TE tensor
    op_of: dict = field(default_factory=dict)  # TE operation -> the graph Op that created it
    # consumer TE operation -> (the reduction it alone reads, 'register' or 'shared'): the pairs
    # that run as one stage of the persistent kernel (marked by codegen.epilogues)
    epilogues: dict = field(default_factory=dict)
    # consumer TE operation -> the reductions before its epilogue's producer ('row' mode: a
    # row-resident stage, codegen.row_resident), producers first
    statistics: dict = field(default_factory=dict)

    @property
    def placeholders(self) -> list[te.Tensor]:
        return [self.tensors[n] for n in self.inputs]

    @property
    def output_tensors(self) -> list[te.Tensor]:
        return [self.tensors[n] for n in self.outputs]

    def stages(self) -> list[te.Tensor]:
        """The region's compute TEs in topological order (producers first)."""
        order: list[te.Tensor] = []
        seen: set = set()

        def visit(t: te.Tensor):
            if t.op in seen or not isinstance(t.op, te.ComputeOp):
                return
            seen.add(t.op)
            for producer in t.op.input_tensors:
                visit(producer)
            order.append(t.op.output(0))

        for t in self.output_tensors:
            visit(t)
        return order

    def prim_func(self):
        """The region as one PrimFunc; parameters in the order inputs, outputs."""
        return te.create_prim_func(self.placeholders + self.output_tensors)


@dataclass
class LoopRegion:
    """A scan: its body's program, run ``scan.length`` times."""

    name: str
    scan: Scan
    body: "TEProgram"


@dataclass
class TEProgram:
    """The whole model as TE: regions in execution order, loops holding nested programs."""

    graph: Graph
    regions: list[Region | LoopRegion]
    links: dict = field(default_factory=dict, repr=False)  # placeholder op -> TE that produced it
    _consumers: dict = field(default_factory=dict, repr=False)

    def stages(self) -> list[te.Tensor]:
        """Every compute TE, loop bodies included (once each), in execution order."""
        out = []
        for region in self.regions:
            out.extend(region.body.stages() if isinstance(region, LoopRegion) else region.stages())
        return out

    def te_count(self) -> int:
        return len(self.stages())

    def region_count(self) -> int:
        """Regions, loop bodies' included (each once)."""
        return sum(r.body.region_count() if isinstance(r, LoopRegion) else 1 for r in self.regions)

    def loop_count(self) -> int:
        """Loops, nested ones included."""
        return sum(1 + r.body.loop_count() for r in self.regions if isinstance(r, LoopRegion))

    def op_of(self, tensor: te.Tensor) -> Op | None:
        """The graph op whose lowering created this TE."""
        for region in self.regions:
            found = region.body.op_of(tensor) if isinstance(region, LoopRegion) else region.op_of.get(tensor.op)
            if found is not None:
                return found
        return None

    def producers(self, tensor: te.Tensor) -> list[te.Tensor]:
        """The TEs whose values ``tensor`` reads, across region and loop boundaries."""
        if not isinstance(tensor.op, te.ComputeOp):
            return []
        return [self.links.get(t.op, t) for t in tensor.op.input_tensors]

    def consumers(self, tensor: te.Tensor) -> list[te.Tensor]:
        """The TEs that read ``tensor``, across region boundaries."""
        if not self._consumers:
            for stage in self.stages():
                for producer in self.producers(stage):
                    self._consumers.setdefault(producer.op, []).append(stage)
        return list(self._consumers.get(tensor.op, []))

    def __str__(self):
        lines = [f"TE program {self.graph.name}: {len(self.regions)} regions, {self.te_count()} TEs"]
        for region in self.regions:
            if isinstance(region, LoopRegion):
                lines.append(f"  loop {region.name} x{region.scan.length}:")
                lines += ["    " + line for line in str(region.body).splitlines()]
            else:
                lines.append(f"  region {region.name}: {', '.join(region.inputs)} -> {', '.join(region.outputs)}")
                for stage in region.stages():
                    axes = ", ".join(str(ax.var) for ax in stage.op.axis)
                    red = ", ".join(str(ax.var) for ax in stage.op.reduce_axis)
                    lines.append(f"    {stage.op.name}[{axes}]" + (f" reduce[{red}]" if red else "") + f" {list(stage.shape)}")
                lines += [f"    epilogue ({mode}): "
                          + " + ".join(t.op.name for t in [*region.statistics.get(consumer, ()), producer])
                          + f" + {consumer.name}" for consumer, (producer, mode) in region.epilogues.items()]
        return "\n".join(lines)


def _placeholder(spec: TensorSpec) -> te.Tensor:
    return te.placeholder(spec.shape, spec.dtype, name=c_name(spec.name))


def _needed_later(graph: Graph, ops: list[Op | Scan], start: int) -> set[str]:
    needed = set(graph.outputs)
    for op in ops[start:]:
        needed.update(op.inputs)
    return needed


def lower_graph(graph: Graph) -> TEProgram:
    """Lower every op of ``graph`` to TE; scans become loops over a lowered body."""
    regions: list[Region | LoopRegion] = []
    links: dict = {}
    producer_of: dict[str, te.Tensor] = {}  # graph tensor name -> the TE that computes it
    run: list[Op] = []

    def close_run(next_index: int):
        if not run:
            return
        region = _lower_region(graph, f"{c_name(graph.name)}_r{len(regions)}", list(run),
                               _needed_later(graph, list(graph.ops), next_index))
        for name in region.inputs:
            if name in producer_of:
                links[region.tensors[name].op] = producer_of[name]
        producer_of.update({n: region.tensors[n] for n in region.outputs})
        regions.append(region)
        run.clear()

    for index, op in enumerate(graph.ops):
        if isinstance(op, Scan):
            close_run(index)
            body = lower_graph(op.body)
            body_producer = {n: t for r in body.regions if isinstance(r, Region) for n, t in r.tensors.items()}
            for _, body_out, _, final in op.carry:
                if body_out in body_producer:
                    producer_of[final] = body_producer[body_out]
            for body_out, stacked in op.ys:
                if body_out in body_producer:
                    producer_of[stacked] = body_producer[body_out]
            regions.append(LoopRegion(c_name(op.name), op, body))
        else:
            run.append(op)
    close_run(len(graph.ops))
    return TEProgram(graph, regions, links)


def _lower_region(graph: Graph, name: str, ops: list[Op], needed_after: set[str]) -> Region:
    tensors: dict[str, te.Tensor] = {}
    inputs: list[str] = []
    produced: list[str] = []
    op_of: dict = {}
    for op in ops:
        te_inputs = []
        for tensor_name in op.inputs:
            if tensor_name not in tensors:
                tensors[tensor_name] = _placeholder(graph.tensors[tensor_name])
                inputs.append(tensor_name)
            te_inputs.append(tensors[tensor_name])
        results = lower_op(op.kind, te_inputs, op.attrs)
        for tensor_name, result in zip(op.outputs, results):
            if not isinstance(result.op, te.ComputeOp) or any(result.same_as(t) for t in te_inputs):
                result = te.compute(result.shape, lambda *i, r=result: r(*i), name=c_name(tensor_name))
            tensors[tensor_name] = result
            produced.append(tensor_name)
            _claim_stages(result, op, op_of)
    outputs = [n for n in produced if n in needed_after]
    return Region(name, ops, inputs, outputs, tensors, op_of)


def _claim_stages(tensor: te.Tensor, op: Op, op_of: dict):
    """Record ``op`` as the origin of every compute TE its lowering created."""
    if not isinstance(tensor.op, te.ComputeOp) or tensor.op in op_of:
        return
    op_of[tensor.op] = op
    for producer in tensor.op.input_tensors:
        _claim_stages(producer, op, op_of)
