"""``from_torch``: a torch.nn.Module as a souffle Graph, through torch.export.

The module is exported in eval mode (batch norm reads its running statistics, dropout is the
identity), decomposed to the core ATen op set except for the ops the op registry computes
whole (``aten.KEPT``: linear stays one ``dense`` that reads the state_dict's weight, an LSTM
stays one recurrence instead of its unrolled steps), and walked node by node:

- a user input becomes a graph input named after forward's parameter (``x``, ``input_ids``);
- a parameter or buffer becomes a weight named as in the module's state_dict, a lifted
  constant a weight under its own name;
- a node that reads no graph input and no weight (``arange``, a mask built from constants) is
  computed by torch at import time and becomes a constant;
- any other node goes to its conversion rule (``souffle.importers.aten``). A node with no rule
  is refused with the ATen op's name, the node and the user's source line.

A bool tensor (an attention mask) is an int32 mask of 0s and 1s (``souffle.ops.logical``); the
importer remembers which tensors are bools, so ``ctx.dtype`` says "bool" for them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from souffle.errors import GraphError, ModelImportError, SouffleError, UnsupportedOpError
from souffle.graph import Graph, GraphBuilder
from souffle.importers import aten
from souffle.importers.prune import without_dead_ops
from souffle.importers.repeats import fold_repeated_blocks
from souffle.naming import UniqueNames
from souffle.ops.logical import MASK_DTYPE
from souffle.tensor import IMPORTED_DTYPES

__all__ = ["from_torch"]


@dataclass(frozen=True)
class Tensor:
    """A tensor of the graph being built, by name."""

    name: str


@dataclass(frozen=True)
class Constant:
    """A tensor known at import time (a lifted constant, or a node computed from constants);
    it becomes a weight, or a ``full`` op when every element is the same, only where an op reads it."""

    value: object  # torch.Tensor
    name: str


def from_torch(module, example_inputs, dynamic_shapes=None) -> Graph:
    """``module`` (a torch.nn.Module) as a Graph for inputs shaped like ``example_inputs`` (a
    tuple of positional arguments, a dict of keyword arguments, or one tensor).

    The graph's shapes are static: ``dynamic_shapes`` is passed to torch.export, and a dimension
    it makes symbolic is refused with the reason (compile one graph per shape instead)."""
    import torch

    if not isinstance(module, torch.nn.Module):
        raise ModelImportError(f"from_torch takes a torch.nn.Module, got {type(module).__name__}")
    args, kwargs = _arguments(example_inputs)
    program = _export(module, args, kwargs, dynamic_shapes)
    return _Importer(program, type(module).__name__).run()


def _arguments(example_inputs) -> tuple[tuple, dict]:
    import torch

    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, Sequence):
        return tuple(example_inputs), {}
    raise ModelImportError(
        f"example_inputs must be a tensor, a tuple of positional inputs or a dict of keyword inputs, "
        f"got {type(example_inputs).__name__}")


def _export(module, args: tuple, kwargs: dict, dynamic_shapes):
    """The module's ExportedProgram in eval mode, decomposed to the core ATen set but for
    ``aten.KEPT``; the module's own training flags are restored afterwards."""
    import torch

    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        program = torch.export.export(module, args, kwargs, dynamic_shapes=dynamic_shapes)
    except SouffleError:
        raise
    except Exception as err:  # torch.export's many error types all mean: this module does not trace
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        hint = (" (data-dependent control flow: a Python branch on a tensor's value cannot be one static graph)"
                if "data-dependent" in str(err) or "data dependent" in str(err) else "")
        raise ModelImportError(f"torch.export could not trace {type(module).__name__}: {reason}{hint}") from None
    finally:
        for m, training in modes:
            m.train(training)
    table = torch.export.default_decompositions()
    for name in aten.KEPT:
        packet, overload = name.split(".")
        table.pop(getattr(getattr(torch.ops.aten, packet), overload), None)
    return program.run_decompositions(table)


def _dtype(tensor, what: str) -> str:
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in IMPORTED_DTYPES:
        raise ModelImportError(
            f"{what} is {dtype}; souffle imports {', '.join(IMPORTED_DTYPES)} (convert the module first, e.g. "
            f"module.float(), and compile it with precision='fp16' or 'bf16' to compute in a narrow type)")
    return dtype


def source_line(node) -> str:
    """The user's source line that made ``node``: the last frame of its stack trace."""
    trace = (node.meta.get("stack_trace") or "").strip().splitlines()
    frames = [i for i, line in enumerate(trace) if line.lstrip().startswith("File ")]
    if not frames:
        return "source line unknown"
    last = frames[-1]
    where = trace[last].strip()
    code = trace[last + 1].strip() if last + 1 < len(trace) else ""
    return f"{where}: {code}" if code else where


class _Importer:
    """One walk over an ExportedProgram's graph; the context every conversion rule gets."""

    def __init__(self, program, name: str):
        self.program = program
        self.builder = GraphBuilder(name)
        self.values: dict[object, object] = {}
        self.node = None
        self._names = UniqueNames(separator=".")
        self._materialized: dict[str, str] = {}
        self._sources: set[str] = set()  # graph inputs and weights: an output that is one gets a copy
        self._bools: set[str] = set()  # int32 masks that stand for torch bool tensors

    # -- the walk ---------------------------------------------------------------------------
    def run(self) -> Graph:
        import torch

        signature = self.program.graph_signature
        # A buffer left out of the state_dict (persistent=False: Hugging Face's position and
        # token type ids) is no weight a user loads: a constant, folded like a lifted one.
        transient = {spec.arg.name: spec.target for spec in signature.input_specs
                     if spec.kind == spec.kind.BUFFER and spec.persistent is False}
        params = {name: target for name, target in {**signature.inputs_to_parameters,
                                                     **signature.inputs_to_buffers}.items() if name not in transient}
        lifted = {**signature.inputs_to_lifted_tensor_constants, **transient}
        state = {**self.program.state_dict, **self.program.constants}
        for spec in signature.input_specs:
            self._names.reserve(spec.target or spec.arg.name)
        outputs = None
        for node in self.program.graph.nodes:
            self.node = node
            if node.op == "placeholder":
                self.values[node] = self._placeholder(node, params, lifted, state)
            elif node.op == "call_function":
                self.values[node] = self._call(node, torch)
            elif node.op == "output":
                outputs = node.args[0]
            else:
                self.fail(f"{node.op} nodes are not supported")
        self.node = None
        try:
            return fold_repeated_blocks(without_dead_ops(self.builder.build(*self._outputs(outputs))))
        except GraphError as err:
            raise ModelImportError(f"the imported graph is not valid: {err}") from None

    def _placeholder(self, node, params: dict, lifted: dict, state: dict):
        name = node.name
        if name in params or name in lifted:
            target = params.get(name) or lifted[name]
            tensor = state[target]
            if name in lifted:
                return Constant(tensor.detach(), target)
            if not node.users:
                return None  # an unused buffer (num_batches_tracked): no weight of the graph
            self._sources.add(target)
            return Tensor(self.builder.param(target, tensor.detach(), _dtype(tensor, f"weight {target!r}")))
        value = node.meta.get("val")
        if value is None or not hasattr(value, "shape"):
            self.fail(f"input {name!r} is not a tensor; souffle graphs take tensors only")
        shape = []
        for axis, dim in enumerate(value.shape):
            if not isinstance(dim, int):
                raise ModelImportError(
                    f"input {name!r} has a symbolic dimension {axis} ({dim}): souffle compiles static shapes, "
                    f"so export with concrete shapes (no dynamic_shapes) and compile one graph per shape")
            shape.append(dim)
        if str(value.dtype) == "torch.bool":
            raise ModelImportError(
                f"input {name!r} is bool; souffle's graph inputs are numbers: pass the mask as int64 0s and 1s "
                f"(as Hugging Face tokenizers give attention_mask), the model's .bool() then reads it as torch does")
        self._sources.add(name)
        return Tensor(self.builder.input(name, tuple(shape), _dtype(value, f"input {name!r}")))

    def _call(self, node, torch):
        args = self._map(node.args)
        kwargs = self._map(node.kwargs)
        if self._is_constant(args) and self._is_constant(kwargs) and node.target is not aten.getitem:
            result = node.target(*self._unwrap(args), **self._unwrap(kwargs))
            return self._wrap(result, node.name, torch)
        if node.target is aten.getitem:
            items, index = args
            item = items[index]
            if item is None:
                self.fail("reads an output that souffle does not compute")
            return item
        rule = aten.RULES.get(str(node.target))
        if rule is None:
            raise UnsupportedOpError(
                f"unsupported op {node.target} (node {node.name!r}) at {source_line(node)}: souffle has no "
                f"conversion rule for it (the {len(aten.RULES)} it has are in souffle.importers.aten)")
        try:
            result = rule(self, *args, **kwargs)
        except GraphError as err:
            self.fail(str(err))
        self._check_shape(node, result)
        return result

    def _map(self, value):
        import torch.fx

        if isinstance(value, torch.fx.Node):
            return self.values[value]
        if isinstance(value, (list, tuple)):
            return type(value)(self._map(v) for v in value)
        if isinstance(value, dict):
            return {k: self._map(v) for k, v in value.items()}
        return value

    def _is_constant(self, value) -> bool:
        if isinstance(value, Tensor):
            return False
        if isinstance(value, (list, tuple)):
            return all(self._is_constant(v) for v in value)
        if isinstance(value, dict):
            return all(self._is_constant(v) for v in value.values())
        return True

    def _unwrap(self, value):
        if isinstance(value, Constant):
            return value.value
        if isinstance(value, (list, tuple)):
            return type(value)(self._unwrap(v) for v in value)
        if isinstance(value, dict):
            return {k: self._unwrap(v) for k, v in value.items()}
        return value

    def _wrap(self, value, name: str, torch):
        if isinstance(value, torch.Tensor):
            return Constant(value, name)
        if isinstance(value, (list, tuple)):
            return type(value)(self._wrap(v, f"{name}.{i}", torch) for i, v in enumerate(value))
        return value

    def _check_shape(self, node, result):
        """Every rule's output has the shape and dtype torch gave the node: a rule that got
        them wrong is stopped here, not in the numbers."""
        expected = node.meta.get("val")
        if isinstance(result, Tensor) and expected is not None and hasattr(expected, "shape"):
            spec = self.builder.spec(result.name)
            dtype = str(expected.dtype).removeprefix("torch.")
            if dtype == "bool" and spec.dtype == MASK_DTYPE:
                self._bools.add(result.name)
                dtype = MASK_DTYPE
            if spec.shape != tuple(expected.shape) or spec.dtype != dtype:
                self.fail(f"converted to {spec.dtype}{list(spec.shape)}, but torch computes "
                          f"{str(expected.dtype).removeprefix('torch.')}{list(expected.shape)}")

    def _outputs(self, outputs) -> list[str]:
        flat, names = [], []
        stack = [outputs]
        while stack:
            item = stack.pop(0)
            if isinstance(item, (list, tuple)):
                stack[:0] = list(item)
            else:
                flat.append(item)
        for item in flat:
            value = self._map(item)
            name = self.tensor(value)
            if name in names or name in self._sources or name in self._materialized.values():
                name = self.builder.op("copy", name, name=self._names(f"{name}.out"))
            names.append(name)
        return names

    # -- what the rules call ----------------------------------------------------------------
    def fail(self, reason: str):
        """Refuse the current node: its ATen op, its name and the user's source line."""
        node = self.node
        raise UnsupportedOpError(f"cannot convert {node.target} (node {node.name!r}) at {source_line(node)}: {reason}")

    def op(self, kind: str, *inputs, **attrs) -> Tensor:
        """Add op ``kind`` on ``inputs`` (tensors or constants), named after the current node."""
        names = [self.tensor(v) for v in inputs]
        result = self.builder.op(kind, *names, name=self._names(self.node.name), **attrs)
        return tuple(map(Tensor, result)) if isinstance(result, tuple) else Tensor(result)

    def value(self, name: str) -> Tensor:
        """The graph tensor ``name`` (one a rule added through ``ctx.builder``)."""
        return Tensor(name)

    def is_constant(self, value) -> bool:
        return isinstance(value, Constant)

    def constant(self, tensor, name: str) -> Constant:
        return Constant(tensor, name)

    def tensor(self, value) -> str:
        """The graph tensor of ``value``: a constant becomes a ``full`` op if all its elements are
        equal, else a weight named after the node that made it."""
        if isinstance(value, Tensor):
            return value.name
        if not isinstance(value, Constant):
            self.fail(f"expected a tensor, got {value!r}")
        if value.name in self._materialized:
            return self._materialized[value.name]
        tensor = value.value
        if str(tensor.dtype) == "torch.bool":
            name = self._materialize(value, tensor.int(), MASK_DTYPE)
            self._bools.add(name)
            return name
        dtype = _dtype(tensor, f"constant {value.name!r}") if tensor.dtype.is_floating_point or \
            str(tensor.dtype) in ("torch.int32", "torch.int64") else self.fail(
                f"constant {value.name!r} is {str(tensor.dtype).removeprefix('torch.')}, which souffle does not compute")
        return self._materialize(value, tensor, dtype)

    def _materialize(self, value: Constant, tensor, dtype: str) -> str:
        shape = tuple(tensor.shape) or (1,)
        flat = tensor.reshape(-1)
        if bool((flat == flat[0]).all()):
            name = self.builder.op("full", name=self._names(value.name), shape=shape, value=flat[0].item(), dtype=dtype)
        else:
            name = self.builder.param(self._names(value.name), tensor.reshape(shape).contiguous(), dtype)
            self._sources.add(name)
        self._materialized[value.name] = name
        return name

    def spec(self, value):
        return self.builder.spec(self.tensor(value))

    def shape(self, value) -> tuple[int, ...]:
        if isinstance(value, Constant):
            return tuple(value.value.shape)
        return self.builder.spec(self.tensor(value)).shape

    def dtype(self, value) -> str:
        """The value's torch dtype: "bool" for a mask that stands for a bool tensor."""
        if isinstance(value, Constant):
            return str(value.value.dtype).removeprefix("torch.")
        name = self.tensor(value)
        return "bool" if name in self._bools else self.builder.spec(name).dtype

    def mark_bool(self, value: Tensor) -> Tensor:
        """Record that ``value`` (an int32 mask a rule made) stands for a torch bool tensor."""
        self._bools.add(value.name)
        return value

    def out_shape(self) -> tuple[int, ...]:
        """The shape torch gives the current node's (first) output."""
        value = self.node.meta["val"]
        value = value[0] if isinstance(value, (list, tuple)) else value
        return tuple(int(d) for d in value.shape)

    def out_dtype(self) -> str:
        value = self.node.meta["val"]
        value = value[0] if isinstance(value, (list, tuple)) else value
        return str(value.dtype).removeprefix("torch.")

    def fresh(self, base: str) -> str:
        return self._names(base)
