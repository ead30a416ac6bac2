"""The global analysis as one function: dependences -> reuse -> chains -> characterization.

``analyze(program, device)`` is what ``souffle analyze`` prints and what the
partitioner and the transforms read: one row per TE with its classified inputs,
reuse, FLOPs, bytes and roofline bound, and a summary of the whole model.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from analysis.affine import Chain, find_chains
from analysis.characterize import StageCost, dtype_bytes, stage_cost
from analysis.dependence import (
    MANY_TO_MANY,
    MAPPING_TYPES,
    ONE_TO_MANY,
    ONE_TO_ONE,
    REORGANIZE,
    SHUFFLE,
    Dependences,
    StageDependence,
    count_points,
    dependences,
    iteration_domain,
)
from analysis.device import DeviceModel, get_device
from analysis.reuse import Reuse, find_reuse
from souffle.graph import Graph
from souffle.lower import TEProgram, lower_graph


@dataclass(frozen=True)
class StageAnalysis:
    """Everything the analysis knows about one TE."""

    dependence: StageDependence
    cost: StageCost  # one execution
    fan_out: tuple[int, ...]  # spatial reuse per input, in the order of dependence.edges

    @property
    def name(self) -> str:
        return self.dependence.name

    @property
    def trips(self) -> int:
        return self.dependence.trips

    def row(self) -> dict:
        d = self.dependence
        return {
            "name": d.name,
            "op": d.op.kind if d.op is not None else None,
            "trips": d.trips,
            "one_relies_on_one": d.one_relies_on_one,
            "inputs": [
                {"tensor": e.name, "role": e.role, "mapping": e.mapping, "one_relies_on_one": e.one_relies_on_one,
                 "exact": e.access.exact, "fan_in": e.fan_in, "fan_out": n, "reason": e.reason}
                for e, n in zip(d.edges, self.fan_out)
            ],
            "flops": self.cost.flops,
            "bytes_read": self.cost.bytes_read,
            "bytes_written": self.cost.bytes_written,
            "intensity": self.cost.intensity,
            "bound": self.cost.bound,
            "time_s": self.cost.time_s,
            "reason": d.reason,
        }


@dataclass(frozen=True)
class ProgramAnalysis:
    model: str
    device: DeviceModel
    stages: list[StageAnalysis]
    dependences: Dependences
    reuse: Reuse
    chains: list[Chain]  # data-movement chains and the one map each composes to
    compulsory_bytes: int  # weights, inputs and outputs: what any implementation moves once
    dtype: str  # of the model's outputs, for the peak the lower bound uses
    seconds: float  # how long the analysis took

    @property
    def composed_chains(self) -> list[Chain]:
        return [c for c in self.chains if c.composed is not None]

    @property
    def lower_bound_s(self) -> float:
        """max(all FLOPs at peak, compulsory bytes at full bandwidth): no kernel can beat it."""
        flops = sum(s.cost.flops * s.trips for s in self.stages)
        return max(flops / self.device.peak(self.dtype), self.compulsory_bytes / self.device.mem_bandwidth)

    def summary(self) -> dict:
        executed = sum(s.trips for s in self.stages)
        counts = {m: 0 for m in MAPPING_TYPES}
        for s in self.stages:
            for e in s.dependence.edges:
                counts[e.mapping] += 1
        return {
            "model": self.model,
            "device": self.device.name,
            "tes": len(self.stages),
            "tes_executed": executed,
            "one_relies_on_one": sum(s.dependence.one_relies_on_one for s in self.stages),
            "one_relies_on_many": sum(not s.dependence.one_relies_on_one for s in self.stages),
            "edges_by_mapping": counts,
            "inexact_edges": sum(not e.access.exact for s in self.stages for e in s.dependence.edges),
            "flops": sum(s.cost.flops * s.trips for s in self.stages),
            "bytes_unfused": sum((s.cost.bytes_read + s.cost.bytes_written) * s.trips for s in self.stages),
            "compute_bound": sum(s.cost.bound == "compute" for s in self.stages),
            "memory_bound": sum(s.cost.bound == "memory" for s in self.stages),
            "roofline_time_unfused_s": sum(s.cost.time_s * s.trips for s in self.stages),
            "compulsory_bytes": self.compulsory_bytes,
            "lower_bound_s": self.lower_bound_s,
            "temporally_reused_tensors": len(self.reuse.temporal),
            "data_movement_chains": len(self.composed_chains),
            "data_movement_tes": len({n for c in self.composed_chains for n in c.names}),
            "chains_left": len(self.chains) - len(self.composed_chains),
            "analysis_seconds": round(self.seconds, 3),
        }

    def to_json(self) -> dict:
        return {"summary": self.summary(), "stages": [s.row() for s in self.stages],
                "temporal_reuse": [{"tensor": t.tensor, "bytes": t.bytes, "readers": list(t.readers),
                                    "iterations": t.iterations} for t in self.reuse.temporal],
                "data_movement_chains": [{"tes": list(c.names), "source": c.source, "map": str(c.composed.map),
                                          "source_indices": [str(e) for e in c.composed.source_indices]}
                                         for c in self.composed_chains],
                "chains_left": [{"tes": list(c.names), "source": c.source, "because": c.left_because}
                                for c in self.chains if c.composed is None]}

    def table(self) -> str:
        header = ("TE", "op", "runs", "deps", "inputs (mapping)", "reuse", "FLOPs", "bytes", "FLOP/B", "bound")
        readers: dict = {}
        for s in self.stages:
            for e in s.dependence.edges:
                if e.producer is not None:
                    readers[e.producer.op] = readers.get(e.producer.op, 0) + 1
        rows = [header]
        for s in self.stages:
            d = s.dependence
            inputs = ", ".join(f"{e.name.rsplit('/', 1)[-1]}:{_SHORT[e.mapping]}" for e in d.edges)
            reuse = [f"x{max(s.fan_out)}"] if s.fan_out and max(s.fan_out) > 1 else []
            if readers.get(d.stage.op, 0) > 1:
                reuse.append(f"{readers[d.stage.op]} readers")
            rows.append((d.name, d.op.kind if d.op else "-", str(d.trips), "1:1" if d.one_relies_on_one else "1:many",
                         inputs or "-", ", ".join(reuse) or "-", _si(s.cost.flops),
                         _si(s.cost.bytes_read + s.cost.bytes_written), f"{s.cost.intensity:.2f}", s.cost.bound))
        widths = [max(len(r[k]) for r in rows) for k in range(len(header))]
        legend = ("mapping: 1-1 one-to-one, shuf shuffle, reorg reorganize, 1-n one-to-many (broadcast), "
                  "n-n many-to-many (reduction); reuse: xN = N output elements read one input element")
        return "\n".join(["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows] + [legend])

    def __str__(self):
        s = self.summary()
        mappings = ", ".join(f"{k} {v}" for k, v in s["edges_by_mapping"].items())
        return "\n".join([
            self.table(),
            "",
            (f"{s['model']} on {s['device']}: {s['tes']} TEs ({s['tes_executed']} executed per inference), "
             f"{s['one_relies_on_one']} one-relies-on-one, {s['one_relies_on_many']} one-relies-on-many"),
            f"edges: {mappings}; {s['inexact_edges']} over-approximated",
            (f"{_si(s['flops'])}FLOP, {_si(s['bytes_unfused'])}B moved if every TE were its own kernel, "
             f"{s['compute_bound']} compute-bound / {s['memory_bound']} memory-bound TEs, "
             f"unfused roofline {_si(s['roofline_time_unfused_s'])}s"),
            (f"lower bound {_si(s['lower_bound_s'])}s: all FLOPs at peak, or {_si(s['compulsory_bytes'])}B of "
             f"weights, inputs and outputs moved once at full bandwidth"),
            f"{s['temporally_reused_tensors']} tensors reused across TEs or loop iterations",
            (f"{s['data_movement_chains']} data-movement chains ({s['data_movement_tes']} TEs) compose into direct "
             f"reads; those of several TEs:"),
            *[f"  {c}" for c in self.composed_chains if len(c.names) > 1],
            *([f"{s['chains_left']} chains left as they are:"] if s["chains_left"] else []),
            *[f"  {c}" for c in self.chains if c.composed is None],
            f"analysed in {s['analysis_seconds']:.2f} s",
        ])


def analyze(program: TEProgram | Graph, device: DeviceModel | str = "h200") -> ProgramAnalysis:
    """Dependences, reuse, chains and cost of every TE of a model (a Graph is lowered first)."""
    start = time.perf_counter()
    if isinstance(program, Graph):
        program = lower_graph(program)
    if isinstance(device, str):
        device = get_device(device)
    deps = dependences(program)
    reuse = find_reuse(deps)
    chains = find_chains(deps)
    stages = [
        StageAnalysis(d, stage_cost(d.stage, _bytes_read(d), device),
                      tuple(reuse.fan_out(d.name, e.name) for e in d.edges))
        for d in deps.stages
    ]
    graph = program.graph
    compulsory = [*graph.params.values(), *graph.inputs, *(graph.tensors[n] for n in graph.outputs)]
    return ProgramAnalysis(graph.name, device, stages, deps, reuse, chains,
                           sum(math.prod(t.shape) * dtype_bytes(t.dtype) for t in compulsory),
                           graph.tensors[graph.outputs[0]].dtype, time.perf_counter() - start)


def _bytes_read(d: StageDependence) -> int:
    """Distinct bytes the TE reads, bounded by its load count where the relation is over-approximated."""
    points = count_points(iteration_domain(d.stage))
    return sum(min(e.elements_read, points * e.access.sites) * dtype_bytes(e.tensor.dtype) for e in d.edges)


_SHORT = {ONE_TO_ONE: "1-1", SHUFFLE: "shuf", REORGANIZE: "reorg", ONE_TO_MANY: "1-n", MANY_TO_MANY: "n-n"}


def _si(value: float) -> str:
    """3 significant digits with an SI prefix: 71 G, 2.05 k, 4.57 m."""
    if value == 0:
        return "0 "
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3), ("", 1.0), ("m", 1e-3), ("u", 1e-6)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value / 1e-9:.3g} n"
