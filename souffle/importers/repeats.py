"""Repeated blocks of an imported graph folded into scans, as the hand-built models write them.

An exporter unrolls a model's repeated layers (ResNeXt's Bottlenecks, BERT's encoder layers,
Swin's blocks) into one long op list. Left so, each layer is lowered, scheduled and compiled
on its own (paper Swin-B: 1,608 TEs), and the layers are not the loop the hand-built models
are. ``fold_repeated_blocks`` finds runs of consecutive blocks that are the same computation
and makes each run one ``Scan``, the per-block weights bound iteration by iteration (stacked at
compile time), so the model keeps its state_dict's weight names and loads real weights as
before.

A block is a contiguous stretch of the op list (constants aside) that reads one tensor the
block before it made (the carry), tensors made before the whole run (invariants, such as an
attention mask), weights and constants, and of whose tensors only its carry is read after it.
Blocks are the same computation when, op by op, kinds, attributes, shapes and dtypes agree,
each input is the same role (an earlier op of the block, the carry, a weight of the same shape
at the same place in first-use order, an equal constant, the same invariant), and the carry
comes from the same op. A run needs at least two blocks, and a block at least two ops, one of
them reading a weight: a repeat without weights (two transposes) or of a single op (BERT's
embeddings, each added to the sum of the one before) is an accident of the op list, not a
layer, and looping it would only keep it from being fused with its neighbours. A block
holding a scan (an imported LSTM layer) is left alone: the LSTM wavefront reads layers chained
as the importers write them.
"""

from __future__ import annotations

from dataclasses import dataclass

from souffle.graph import Graph, Op, Scan
from souffle.importers.prune import without_dead_ops
from souffle.naming import UniqueNames
from souffle.tensor import TensorSpec

__all__ = ["fold_repeated_blocks"]


def fold_repeated_blocks(graph: Graph) -> Graph:
    """``graph`` with every run of two or more identical consecutive blocks as one scan (the
    graph itself when there is none)."""
    chain = _Chain(graph)
    runs = []
    start = 0
    while start < len(chain.ops):
        run = chain.best_run(start)
        if run is None:
            start += 1
        else:
            runs.append(run)
            start = run.end
    if not runs:
        return graph
    return _rebuilt(graph, chain, runs)


@dataclass(frozen=True)
class _Run:
    """Blocks ``start + j * period`` .. ``start + (j + 1) * period`` of the chain, j < length."""

    start: int
    period: int
    length: int
    carries: tuple[str, ...]  # the tensor block 0 reads as its carry, then each block's carry out

    @property
    def end(self) -> int:
        return self.start + self.period * self.length


class _Chain:
    """The graph's ops without its constants (ops that read nothing), and at each boundary
    between two of them which tensor made before it is still to be read and was made last, and
    where the one made last but one was made."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.constants = {name: op for op in graph.ops if not op.inputs and not isinstance(op, Scan)
                          for name in op.outputs}
        self.ops = [op for op in graph.ops if isinstance(op, Scan) or op.inputs]
        self.position = {spec.name: -1 for spec in graph.inputs}
        for i, op in enumerate(self.ops):
            self.position.update((name, i) for name in op.outputs)
        last_read = {name: i for i, op in enumerate(self.ops) for name in op.inputs if name in self.position}
        last_read.update((name, len(self.ops)) for name in graph.outputs)
        kinds: dict[tuple, int] = {}  # local signatures as small ints, compared many times
        self.local = [None if isinstance(op, Scan) else kinds.setdefault(self._local_signature(op), len(kinds))
                      for op in self.ops]
        # at boundary p (before ops[p]): the live tensor made last, and where the one before it was made
        self.recent: list[str | None] = []
        self.older: list[int] = []
        live: dict[str, int] = {name: -1 for name in self.position if self.position[name] == -1 and name in last_read}
        for p in range(len(self.ops) + 1):
            if p > 0:
                live.update((name, p - 1) for name in self.ops[p - 1].outputs if name in last_read)
                for name in [name for name in live if last_read[name] < p]:
                    del live[name]
            ranked = sorted(live, key=live.get, reverse=True)
            self.recent.append(ranked[0] if ranked else None)
            self.older.append(live[ranked[1]] if len(ranked) > 1 else -2)

    def _local_signature(self, op: Op) -> tuple:
        """What must agree between two ops wherever their inputs come from."""
        tensors = self.graph.tensors
        return (op.kind, _attrs_key(op.attrs), tuple((tensors[n].shape, tensors[n].dtype) for n in op.inputs),
                tuple((tensors[n].shape, tensors[n].dtype) for n in op.outputs))

    # -- runs ---------------------------------------------------------------------------------
    def best_run(self, start: int) -> _Run | None:
        """The run of blocks that starts at ``start`` and covers the most ops (the shortest
        period among equals), moved as late as its coverage allows: a block's last ops can
        equal the ops just before the run (ResNeXt's first Bottleneck ends in the add and relu
        every Bottleneck ends in), and the block then ends where the module does."""
        if self.local[start] is None:
            return None
        best = None
        for period in range(2, (len(self.ops) - start) // 2 + 1):  # a block has two ops or more
            if self.local[start + period] != self.local[start] or not self._closes(start, period, start + period):
                continue
            run = self._run(start, period)
            if run is not None and (best is None or run.end > best.end):
                best = run
        if best is None:
            return None
        for shift in range(1, best.period):
            later = self._run(start + shift, best.period)
            if later is not None and later.end - later.start >= best.end - best.start:
                best = later
        return best

    def _closes(self, start: int, period: int, end: int) -> bool:
        """Whether the block ending at ``end`` of a run from ``start`` leaves one tensor of its
        own to be read after it (its carry out) and none made inside the run before it."""
        carry_out = self.recent[end]
        return carry_out is not None and self.older[end] < start and self.position[carry_out] >= end - period

    def _run(self, start: int, period: int) -> _Run | None:
        """The blocks of ``period`` ops from ``start`` that are the same computation, if two or
        more are."""
        carries = []  # each block's carry out
        pattern = self.local[start:start + period]
        while start + (len(carries) + 1) * period <= len(self.ops):
            begin, end = start + len(carries) * period, start + (len(carries) + 1) * period
            if self.local[begin:end] != pattern or not self._closes(start, period, end):
                break
            carries.append(self.recent[end])
        if len(carries) < 2:
            return None
        carry_in = self._carry_in(start, period, carries[0])
        if carry_in is None:
            return None
        first = self.signature(start, period, carry_in)
        if not any(role[0] == "param" for _, _, roles in first[0] for role in roles):
            return None
        length = 1
        while length < len(carries) and self.signature(start + length * period, period, carries[length - 1]) == first:
            length += 1
        if length < 2:
            return None
        return _Run(start, period, length, (carry_in, *carries[:length]))

    def _carry_in(self, start: int, period: int, carry: str) -> str | None:
        """The tensor block 0 reads where block 1 reads block 0's carry out (one made before the
        run, or a graph input)."""
        for k in range(period):
            for slot, name in enumerate(self.ops[start + period + k].inputs):
                if name == carry:
                    found = self.ops[start + k].inputs[slot]
                    return found if self.position.get(found, start) < start else None
        return None

    def signature(self, begin: int, period: int, carry: str) -> tuple:
        """Block ``begin``'s ops with each input named by its role, and where its carry out is
        made. Any tensor it reads from outside that is not ``carry``, a weight or a constant was
        made before the run (the run's boundaries let no other through): an invariant, equal
        only to itself."""
        params: dict[str, int] = {}
        ops = []
        for op in self.ops[begin:begin + period]:
            roles = []
            for name in op.inputs:
                made = self.position.get(name, -1)
                if made >= begin:
                    roles.append(("op", made - begin, self.ops[made].outputs.index(name)))
                elif name == carry:
                    roles.append(("carry",))
                elif name in self.graph.params:
                    roles.append(("param", params.setdefault(name, len(params))))
                elif name in self.constants:
                    constant = self.constants[name]
                    roles.append(("constant", constant.kind, _attrs_key(constant.attrs)))
                else:
                    roles.append(("invariant", name))
            ops.append((op.kind, _attrs_key(op.attrs), tuple(roles)))
        carry_out = self.recent[begin + period]
        made = self.position[carry_out]
        return tuple(ops), (made - begin, self.ops[made].outputs.index(carry_out))

    def block_params(self, begin: int, period: int) -> list[str]:
        """Block ``begin``'s weights in first-use order (the order ``signature`` numbers them)."""
        names: dict[str, None] = {}
        for op in self.ops[begin:begin + period]:
            names.update((name, None) for name in op.inputs if name in self.graph.params)
        return list(names)


def _attrs_key(attrs) -> str:
    return repr(sorted(attrs.items()))


def _rebuilt(graph: Graph, chain: _Chain, runs: list[_Run]) -> Graph:
    """``graph`` with each run replaced by its scan, where the run began."""
    names = UniqueNames(graph.tensors, separator=".")
    scans = {run.start: _scan(graph, chain, run, names) for run in runs}
    folded = {i for run in runs for i in range(run.start, run.end)}
    index = {id(op): i for i, op in enumerate(chain.ops)}
    ops = []
    for op in graph.ops:
        i = index.get(id(op))
        if i in scans:
            ops.append(scans[i])
        elif i not in folded:
            ops.append(op)
    rebuilt = Graph(graph.name, graph.inputs, graph.params.values(), ops, graph.outputs, graph.weights)
    return without_dead_ops(rebuilt)  # the constants only the folded blocks read now live in the bodies


def _scan(graph: Graph, chain: _Chain, run: _Run, names: UniqueNames) -> Scan:
    """The run's first block as a scan body, applied ``run.length`` times: its weights bound to
    each block's, the constants it reads copied in, what the run reads from before it invariant."""
    block = chain.ops[run.start:run.start + run.period]
    carry_in, carry_out, final = run.carries[0], run.carries[1], run.carries[-1]
    weights_of_block = [chain.block_params(run.start + j * run.period, run.period) for j in range(run.length)]
    bound = list(zip(*weights_of_block))  # per body weight, its outer weight in each block
    read = dict.fromkeys(name for op in block for name in op.inputs)
    constants = list({id(chain.constants[n]): chain.constants[n] for n in read if n in chain.constants}.values())
    made_before = [name for name in read if name not in graph.params and name not in chain.constants
                   and chain.position.get(name, -1) < run.start]
    invariants = [name for name in made_before if name != carry_in]
    taken = {*made_before, *(n for op in (*constants, *block) for n in op.outputs)}
    body_names, stem = _body_param_names(bound, taken)
    rename = dict(zip((outer[0] for outer in bound), body_names))
    body_ops = [*constants, *(Op(op.kind, tuple(rename.get(n, n) for n in op.inputs), op.outputs, dict(op.attrs))
                              for op in block)]
    tensors = graph.tensors
    body_params = [TensorSpec(name, tensors[outer[0]].shape, tensors[outer[0]].dtype)
                   for name, outer in zip(body_names, bound)]
    body = Graph(stem, [tensors[carry_in], *(tensors[n] for n in invariants)], body_params, body_ops, [carry_out])
    return Scan(names(stem), body, run.length, carry=((carry_in, carry_out, carry_in, final),),
                invariants=tuple((n, n) for n in invariants), params=tuple(zip(body_names, bound)))


def _body_param_names(bound: list[tuple[str, ...]], taken: set[str]) -> tuple[list[str], str]:
    """Each body weight's name and the scan's. Per-block names that differ in one dotted part
    give the part after it (``layer3.1.conv1.weight``, ``layer3.2.conv1.weight``: ``conv1.weight``,
    as the hand-built ResNeXt names its body's weights), or from it where a block holds several
    modules (Swin's pairs of blocks: ``0.norm1.weight``, ``1.norm1.weight``), and the scan the
    part before it (``layer3``); other weights keep block 0's name (a weight every block shares,
    ONNX's ``onnx::Conv_260``), as does every weight where those names would clash."""
    short, long, stems = [], [], []
    for outer in bound:
        parts = [name.split(".") for name in outer]
        differ = [k for k, column in enumerate(zip(*parts)) if len(set(column)) > 1]
        if len({len(p) for p in parts}) == 1 and len(differ) == 1 and differ[0] < len(parts[0]) - 1:
            short.append(".".join(parts[0][differ[0] + 1:]))
            long.append(".".join(parts[0][differ[0]:]))
            stems.append(".".join(parts[0][:differ[0]]))
        else:
            short.append(outer[0])
            long.append(outer[0])
    stem = next((stem for stem in stems if stem), "blocks")
    for names in (short, long):
        if len(set(names)) == len(names) and not taken & set(names):
            return names, stem
    return [outer[0] for outer in bound], stem
