"""NaN and the infinities propagate as in PyTorch.

Every registered op, on inputs (and weights, where it takes them) holding NaN, +inf and -inf,
compiled for the CPU targets and compared with torch in float64 position by position: NaN
exactly where torch has NaN, the same infinities, finite values within 1e-4. Then MMoE end to
end with one non-finite input element or one NaN weight, the embedding's deliberate difference
from torch, and the refusal of non-finite attributes.
"""

import re
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import souffle
from souffle import models
from souffle.errors import GraphError
from souffle.graph import GraphBuilder
from souffle.ops import REGISTRY
from souffle.ops.packed import pack_rows

NAN, INF = float("nan"), float("inf")
CPU_TARGETS = [("llvm", None), ("llvm-persistent", 0), ("llvm-persistent", 4)]


@dataclass
class Case:
    """One op on its arrays: ``inputs`` are graph inputs, ``params`` weights, both in the op's
    input order (``order``); ``reference`` computes torch's outputs from float64 tensors."""

    kind: str
    inputs: dict
    reference: Callable
    params: dict = field(default_factory=dict)
    attrs: dict = field(default_factory=dict)
    order: tuple = ()

    def arguments(self) -> list[str]:
        return list(self.order or [*self.inputs, *self.params])


def values(shape, seed, at=()):
    """Random float32 values in [-2, 2] of ``shape``, with ``at``'s (index, value) pairs set."""
    array = np.random.default_rng(seed).uniform(-2, 2, shape).astype(np.float32)
    for index, value in at:
        array[index] = value
    return array


SPECIALS = ((0, NAN), (1, INF), (2, -INF))  # the first three elements of a flat array


def flat_specials(shape, seed):
    array = values(int(np.prod(shape)), seed, SPECIALS)
    return array.reshape(shape)


def unary(kind, reference):
    x = values((3, 4), 0, [((0, 0), NAN), ((0, 1), INF), ((0, 2), -INF), ((1, 0), 0.0), ((1, 1), -0.0)])
    return Case(kind, {"x": x}, reference)


def binary(kind, reference):
    """Row 0 of ``a`` against ``b`` gives inf - inf, 0 * inf, inf / inf, NaN op x; b's zeros give x / 0."""
    a = values((3, 6), 1, [((0, 0), INF), ((0, 1), 0.0), ((0, 2), -INF), ((0, 3), NAN), ((0, 4), INF), ((1, 5), 0.0)])
    b = np.array([INF, INF, -INF, 1.0, 0.0, 0.0], np.float32)
    return Case(kind, {"a": a, "b": b}, reference)


def image(seed, channels=4, size=6):
    x = values((1, channels, size, size), seed)
    x[0, 0, 1, 1], x[0, 1, 4, 2], x[0, 2, 0, 5] = NAN, INF, -INF
    return x


def pool_input():
    """NaN in one window, +inf and -inf in others, and a corner of -inf that padding must not beat."""
    x = values((1, 2, 7, 7), 7)
    x[0, 0, 1, 1], x[0, 0, 4, 4], x[0, 1, 3, 3] = NAN, INF, -INF
    x[0, 1, :2, :2] = -INF
    x[0, 1, 5:, 5:] = -INF
    return x


def conv_weight(seed, shape):
    w = values(shape, seed) * 0.5
    w.flat[5] = NAN
    return w


def _cases() -> list[Case]:
    dense_w = conv_weight(10, (8, 6))
    dense_b = values(8, 11, [(1, INF)])
    conv_w = conv_weight(12, (8, 2, 3, 3))
    conv_b = values(8, 13, [(3, -INF)])
    gamma, beta = values(4, 14, [(1, NAN)]), values(4, 15)
    mean, var = values(4, 16, [(2, INF)]), np.abs(values(4, 17)) + 0.5
    ln_gamma, ln_beta = values(8, 18, [(3, NAN)]), values(8, 19, [(5, INF)])
    softmax_rows = values((6, 8), 20)
    softmax_rows[0, 3], softmax_rows[1, 2], softmax_rows[2, 6] = NAN, INF, -INF
    softmax_rows[3, :] = -INF
    softmax_rows[4, [1, 5]] = INF
    table = values((10, 4), 21, [((2, 1), NAN), ((5, 0), INF), ((7, 3), -INF)])
    pooled = pool_input()
    return [
        unary("relu", torch.relu),
        unary("sigmoid", torch.sigmoid),
        unary("tanh", torch.tanh),
        unary("gelu", F.gelu),
        unary("silu", F.silu),
        binary("add", torch.add),
        binary("sub", torch.sub),
        binary("mul", torch.mul),
        binary("div", torch.div),
        Case("scale", {"x": flat_specials((3, 4), 2)}, lambda x: x * -0.5, attrs={"factor": -0.5}),
        Case("copy", {"x": flat_specials((3, 4), 3)}, lambda x: x.clone()),
        Case("full", {}, lambda: torch.full((2, 3), NAN, dtype=torch.float64), attrs={"shape": (2, 3), "value": NAN}),
        Case("dense", {"x": flat_specials((3, 6), 4)}, F.linear, params={"w": dense_w, "b": dense_b}),
        Case("dense_packed", {"x": flat_specials((3, 6), 5)}, lambda x, w: F.linear(x, torch.from_numpy(dense_w).double()),
             params={"wp": pack_rows(dense_w, 4)}),
        Case("matmul", {"a": flat_specials((2, 3, 6), 6)}, torch.matmul, params={"b": dense_w.T.copy()}),
        Case("batch_matmul", {"a": flat_specials((2, 3, 6), 8), "b": values((2, 6, 5), 9, [((1, 2, 3), NAN)])}, torch.bmm),
        Case("conv2d", {"x": image(22)}, lambda x, w, b: F.conv2d(x, w, b, padding=1, groups=2),
             params={"w": conv_w, "b": conv_b}, attrs={"padding": 1, "groups": 2}),
        Case("conv2d_packed", {"x": image(23)},
             lambda x, wp: F.conv2d(x, torch.from_numpy(conv_w).double(), stride=2, padding=1, groups=2),
             params={"wp": pack_rows(conv_w, 4)}, attrs={"stride": 2, "padding": 1, "groups": 2}),
        Case("batch_norm", {"x": image(24)},
             lambda x, g, b, m, v: F.batch_norm(x, m, v, g, b, training=False, eps=1e-5),
             params={"gamma": gamma, "beta": beta, "mean": mean, "var": var}),
        Case("layer_norm", {"x": values((4, 8), 25, [((0, 2), NAN), ((1, 4), INF), ((2, 0), -INF)])},
             lambda x, g, b: F.layer_norm(x, (8,), g, b, eps=1e-5), params={"gamma": ln_gamma, "beta": ln_beta}),
        Case("softmax", {"x": softmax_rows}, lambda x: torch.softmax(x, -1)),
        Case("max_pool2d", {"x": pooled}, lambda x: F.max_pool2d(x, 3, 2, padding=1),
             attrs={"kernel": 3, "stride": 2, "padding": 1}),
        Case("max_pool2d", {"x": pooled}, lambda x: F.max_pool2d(x, 2, ceil_mode=True),
             attrs={"kernel": 2, "ceil_mode": True}),
        Case("max_pool2d", {"x": pooled}, lambda x: F.max_pool2d(x, 2, 1, padding=1, dilation=2),
             attrs={"kernel": 2, "stride": 1, "padding": 1, "dilation": 2}),
        Case("avg_pool2d", {"x": pooled}, lambda x: F.avg_pool2d(x, 2, 2, padding=1),
             attrs={"kernel": 2, "stride": 2, "padding": 1}),
        Case("global_avg_pool2d", {"x": image(26)}, lambda x: F.adaptive_avg_pool2d(x, 1)),
        Case("mean", {"x": values((3, 5), 27, [((0, 1), NAN), ((1, 2), INF), ((2, 3), -INF)])},
             lambda x: torch.mean(x, 1), attrs={"axes": 1}),
        Case("embedding", {"ids": np.array([[2, 5], [7, 0]], np.int64)}, lambda t, ids: F.embedding(ids, t),
             params={"table": table}, order=("table", "ids")),
        Case("reshape", {"x": flat_specials((3, 4), 28)}, lambda x: x.reshape(4, 3), attrs={"shape": (4, 3)}),
        Case("transpose", {"x": flat_specials((3, 4), 29)}, lambda x: x.T, attrs={"axes": (1, 0)}),
        Case("concat", {"a": flat_specials((2, 4), 30), "b": flat_specials((1, 4), 31)},
             lambda a, b: torch.cat([a, b], 0)),
        Case("slice", {"x": flat_specials((3, 4), 32)}, lambda x: x[0:2, 1:4],
             attrs={"begin": (0, 1), "end": (2, 4)}),
        Case("split", {"x": flat_specials((2, 4), 33)}, lambda x: list(torch.split(x, 2, 1)),
             attrs={"sections": 2, "axis": 1}),
        Case("flatten", {"x": flat_specials((2, 2, 3), 34)}, lambda x: x.flatten(1)),
        unary("exp", torch.exp),
        unary("log", torch.log),
        unary("sqrt", torch.sqrt),
        unary("rsqrt", torch.rsqrt),
        unary("erf", torch.erf),
        unary("neg", torch.neg),
        unary("abs", torch.abs),
        unary("hardsigmoid", F.hardsigmoid),
        unary("hardswish", F.hardswish),
        unary("gelu_tanh", lambda x: F.gelu(x, approximate="tanh")),
        Case("pow", {"x": flat_specials((3, 4), 35)}, lambda x: torch.pow(x, 3.0), attrs={"exponent": 3.0}),
        Case("clamp", {"x": flat_specials((3, 4), 36)}, lambda x: torch.clamp(x, -1.0, 1.5),
             attrs={"min": -1.0, "max": 1.5}),
        Case("cast", {"x": flat_specials((3, 4), 37)}, lambda x: x.to(torch.float16), attrs={"dtype": "float16"}),
        Case("expand", {"x": flat_specials((3, 1), 38)}, lambda x: x.expand(2, 3, 4), attrs={"shape": (2, 3, 4)}),
        Case("sum", {"x": values((3, 5), 39, [((0, 1), NAN), ((1, 2), INF), ((2, 3), -INF)])},
             lambda x: torch.sum(x, 1), attrs={"axes": 1}),
        *(binary(kind, lambda a, b, kind=kind: getattr(torch, kind)(a, b).int())
          for kind in ("eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or")),
        unary("logical_not", lambda x: torch.logical_not(x).int()),
        Case("where", {"c": flat_specials((3, 4), 40), "a": flat_specials((3, 4), 41), "b": flat_specials((1, 4), 42)},
             lambda c, a, b: torch.where(c != 0, a, b)),
        Case("pad", {"x": flat_specials((3, 4), 43)}, lambda x: F.pad(x, (0, 2, 1, 0), value=-1.5),
             attrs={"before": (1, 0), "after": (0, 2), "value": -1.5}),
        Case("roll", {"x": flat_specials((3, 4), 44)}, lambda x: torch.roll(x, (-1, 2), (0, 1)),
             attrs={"shifts": (-1, 2), "axes": (0, 1)}),
        Case("take", {"ids": np.array([[2, -1], [0, 1]], np.int64)}, lambda t, ids: t[:, ids],
             params={"table": table}, order=("table", "ids"), attrs={"axis": 1}),
    ]


CASES = _cases()


def case_graph(cases: list[Case]):
    """All ``cases`` side by side in one graph (one compile per target); each case's tensors
    are prefixed with its number. Returns the graph, its inputs and each case's output names."""
    b = GraphBuilder("nonfinite")
    inputs, outputs = {}, []
    for number, case in enumerate(cases):
        names = {}
        for name, array in case.inputs.items():
            names[name] = b.input(f"c{number}.{name}", array.shape, str(array.dtype))
            inputs[names[name]] = array
        for name, array in case.params.items():
            names[name] = b.param(f"c{number}.{name}", array)
        args = [names[name] for name in case.arguments()]
        result = b.op(case.kind, *args, name=f"c{number}.{case.kind}", **case.attrs)
        outputs.append(list(result) if isinstance(result, (list, tuple)) else [result])
    return b.build(*(name for names in outputs for name in names)), inputs, outputs


def torch_outputs(case: Case) -> list[np.ndarray]:
    arrays = {**case.inputs, **case.params}
    tensors = [torch.from_numpy(arrays[n].astype(np.float64) if arrays[n].dtype.kind == "f" else arrays[n])
               for n in case.arguments()]
    with torch.no_grad():
        result = case.reference(*tensors)
    return [t.numpy() for t in (result if isinstance(result, list) else [result])]


def mismatch(got: np.ndarray, want: np.ndarray) -> str | None:
    """Where ``got`` differs from torch's ``want``: NaN, +inf, -inf positions, then finite values."""
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    for what, test in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        differ = np.argwhere(test(got) != test(want))
        if len(differ):
            index = tuple(differ[0])
            return f"{what} positions differ, first at {index}: got {got[index]}, torch {want[index]}"
    finite = np.isfinite(want)
    close = np.isclose(got[finite], want[finite], rtol=1e-4, atol=1e-4)
    if not close.all():
        index = tuple(np.argwhere(finite)[np.argmin(close)])
        return f"values differ, first at {index}: got {got[index]}, torch {want[index]}"
    return None


def test_every_registered_op_has_a_case():
    assert {case.kind for case in CASES} == set(REGISTRY)


def test_the_cases_hold_nan_and_both_infinities():
    for case in CASES:
        arrays = [a for a in [*case.inputs.values(), *case.params.values()] if a.dtype.kind == "f"]
        if arrays:
            flat = np.concatenate([a.ravel() for a in arrays])
            assert np.isnan(flat).any() and np.isposinf(flat).any() and np.isneginf(flat).any(), case.kind


@pytest.mark.parametrize("target, opt_level", CPU_TARGETS)
def test_every_op_propagates_nan_and_inf_as_torch(target, opt_level):
    graph, inputs, outputs = case_graph(CASES)
    compiled = souffle.compile(graph, target=target, opt_level=opt_level)
    got = dict(zip(graph.outputs, compiled.run(inputs)))
    failures = []
    for number, (case, names) in enumerate(zip(CASES, outputs)):
        for name, want in zip(names, torch_outputs(case)):
            why = mismatch(got[name], want)
            if why:
                failures.append(f"case {number} {case.kind} {case.attrs}: {why}")
    assert not failures, "\n".join(failures)


MMOE_X = ("x", (0, 3))  # the input element the MMoE cases change


@pytest.fixture(scope="module")
def mmoe_weights():
    return models.get("mmoe").init_weights(models.config("mmoe", "tiny"), seed=0)


@pytest.mark.parametrize("target, opt_level", CPU_TARGETS)
def test_mmoe_propagates_a_nonfinite_input_element(target, opt_level, mmoe_weights):
    compiled = souffle.compile(models.build("mmoe", "tiny", weights=mmoe_weights), target=target, opt_level=opt_level)
    reference = models.reference("mmoe", "tiny", mmoe_weights)
    clean = models.make_inputs("mmoe", "tiny", seed=1)
    name, index = MMOE_X
    for value in (NAN, INF, -INF):
        inputs = {name: clean[name].copy()}
        inputs[name][index] = value
        got, want = compiled.run(inputs), reference(inputs)
        assert not all(np.array_equal(g, c) for g, c in zip(got, compiled.run(clean))), value
        for g, w in zip(got, want):
            assert mismatch(g, np.asarray(w, np.float64)) is None, (value, g, w)


@pytest.mark.parametrize("target, opt_level", CPU_TARGETS)
def test_mmoe_propagates_a_nan_weight(target, opt_level, mmoe_weights):
    weights = {k: v.copy() for k, v in mmoe_weights.items()}
    weights["experts.1.weight"][2, 4] = NAN
    compiled = souffle.compile(models.build("mmoe", "tiny", weights=weights), target=target, opt_level=opt_level)
    inputs = models.make_inputs("mmoe", "tiny", seed=1)
    got, want = compiled.run(inputs), models.reference("mmoe", "tiny", weights)(inputs)
    assert all(np.isnan(g).all() for g in got)  # expert 1 feeds every task's mixture
    for g, w in zip(got, want):
        assert mismatch(g, np.asarray(w, np.float64)) is None


def test_embedding_clamps_out_of_range_ids_where_torch_raises(run_op):
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    ids = np.array([-5, 0, 3, 9], np.int64)
    np.testing.assert_array_equal(run_op("embedding", [table, ids]), table[[0, 0, 3, 3]])
    with pytest.raises(IndexError):
        F.embedding(torch.from_numpy(ids), torch.from_numpy(table))


@pytest.mark.parametrize("kind, shapes, attr", [
    ("scale", [(2, 3)], "factor"),
    ("layer_norm", [(2, 3), (3,), (3,)], "eps"),
    ("batch_norm", [(1, 2, 3), (2,), (2,), (2,), (2,)], "eps"),
])
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_nonfinite_attributes_are_refused(kind, shapes, attr, value):
    b = GraphBuilder("g")
    names = [b.input(f"in{i}", shape) for i, shape in enumerate(shapes)]
    with pytest.raises(GraphError, match=rf"op 'bad' \({kind}\): {attr} must be a finite number, got -?(nan|inf)"):
        b.op(kind, *names, name="bad", **{attr: value})


@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_full_takes_a_nonfinite_value_as_torch_full(run_op, value):
    out = run_op("full", [], shape=(2,), value=value)
    np.testing.assert_array_equal(out, torch.full((2,), value).numpy())


@pytest.mark.parametrize("opt_level", [0, 4])
def test_cuda_kernel_of_relu_and_max_pool_builds_without_a_float_max(opt_level):
    """nvcc builds the kernel, and relu and max pooling compare instead of calling CUDA's max,
    which is fmaxf for floats and returns the operand that is not NaN."""
    graph, _, _ = case_graph([c for c in CASES if c.kind in ("relu", "max_pool2d")])
    model = souffle.compile(graph, target="cuda", opt_level=opt_level)  # nvcc builds it, or this raises
    assert not re.search(r"\bf?max[f]?\(", model.source)
    assert " != " in model.source  # the running maximum's NaN test on each window element


def _folding_graph():
    """The patterns TVM's simplifier folds as if floats were reals (e - e to 0, (x + y) - x to
    y, x * 0 and 0 / x to 0), each reached as the fuzzer reached them: one tensor on both sides,
    a constant tensor or factor inlined into its consumer."""
    b = GraphBuilder("folds")
    b.input("x", (4, 5))
    b.input("y", (1, 5))
    b.op("full", name="zeros", shape=[4, 5], value=0.0)
    b.op("full", name="negative_zeros", shape=[5], value=-0.0)
    b.op("relu", "x", name="r")
    b.op("sub", "r", "r", name="same_minus_same")
    b.op("sub", b.op("add", "x", "y", name="x_plus_y"), "x", name="sum_minus_x")
    b.op("mul", "x", "zeros", name="times_zeros")
    b.op("mul", "negative_zeros", "x", name="negative_zeros_times")
    b.op("div", "zeros", "x", name="zeros_over")
    b.op("scale", "x", name="scaled_by_zero", factor=0.0)
    outputs = ["same_minus_same", "sum_minus_x", "times_zeros", "negative_zeros_times", "zeros_over", "scaled_by_zero"]
    return b.build(*outputs)


def _folding_reference(x, y):
    r = torch.relu(x)
    zeros = torch.zeros(4, 5, dtype=x.dtype)
    return [r - r, (x + y) - x, x * zeros, torch.full((5,), -0.0, dtype=x.dtype) * x, zeros / x, x * 0.0]


@pytest.mark.parametrize("target, opt_level", [*CPU_TARGETS, ("llvm-persistent", 2)])
def test_tvm_real_number_folds_do_not_drop_nan_or_inf(target, opt_level):
    graph = _folding_graph()
    x = flat_specials((4, 5), seed=3)
    x[1, 0] = 0.0  # 0 / 0
    y = values((1, 5), seed=4)
    compiled = souffle.compile(graph, target=target, opt_level=opt_level)
    want = _folding_reference(torch.from_numpy(x.astype(np.float64)), torch.from_numpy(y.astype(np.float64)))
    for name, g, w in zip(graph.outputs, compiled.run({"x": x, "y": y}), want):
        assert mismatch(g, w.numpy()) is None, (name, mismatch(g, w.numpy()))
        assert np.isnan(g).any(), name  # each pattern meets a NaN or infinity here
