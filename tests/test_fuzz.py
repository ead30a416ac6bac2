"""The differential fuzzer (tests/fuzzing.py): a fixed range of seeds on every target and level,
and the fuzzer's own parts tested with mutants (a wrong reference, a crashing worker, a fake
failure to minimize)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from codegen.cpu_transforms import pack_weights
from souffle.graph import Op
from souffle.ops import REGISTRY
from tests.fuzzing import (
    TIE_TOLERANCE,
    CRASH,
    MAKERS,
    MISMATCH,
    PACKED_KINDS,
    REFERENCE,
    TIMEOUT,
    Case,
    Config,
    ConfigResult,
    Source,
    Task,
    WorkerPool,
    check_config,
    compare,
    configs,
    fuzz,
    generate,
    materialize,
    minimize,
    minimize_failures,
    repro,
    structure,
)

ROOT = Path(__file__).resolve().parents[1]

# Sized to take about 2-3 minutes on 2 cores (each graph is compiled for llvm and for
# llvm-persistent at O0-O4).
FIXED_SEEDS = range(0, 20)


def test_every_registered_op_has_a_maker_and_a_reference():
    assert set(MAKERS) == set(REFERENCE) == set(REGISTRY) - set(PACKED_KINDS)
    assert set(PACKED_KINDS.values()) <= set(MAKERS)


def test_generation_is_deterministic_and_valid():
    for seed in range(20):
        case = generate(seed)
        assert generate(seed) == case
        assert 3 <= len(case.ops) <= 10
        structure(case)


def test_generated_graphs_cover_every_op_and_the_edge_cases():
    """Over 200 seeds: every op kind (the packed ones through the CPU pipeline's weight packing),
    1-D inputs, rank-0 results, prime sizes, rows that tile unevenly, broadcasting, several
    outputs, NaN and infinities."""
    cases = [generate(seed) for seed in range(200)]
    graphs = [structure(case) for case in cases]
    assert {op.kind for case in cases for op in case.ops} == set(MAKERS)
    packed = {op.kind for case in cases for op in pack_weights(materialize(case)[0]).ops}
    assert set(PACKED_KINDS) <= packed
    rows = [int(np.prod(s.shape[:-1])) for g in graphs for s in g.tensors.values()]
    assert any(r > 32 and r % 32 for r in rows) and any(r > 256 and r % 256 for r in rows)
    assert any(len(s.shape) == 1 for case in cases for s in case.inputs)
    assert any(g.tensors[o].shape == () for g in graphs for o in g.outputs)
    assert any(d in (7, 13, 17) for g in graphs for s in g.tensors.values() for d in s.shape)
    assert any(len({g.tensors[n].shape for n in op.inputs}) > 1
               for g in graphs for op in g.ops if op.kind in ("add", "sub", "mul", "div"))
    assert any(len(case.outputs) > 1 for case in cases)
    assert {v for case in cases for s in case.inputs for _, v in s.specials} >= {np.inf, -np.inf}
    assert any(np.isnan(v) for case in cases for s in case.inputs for _, v in s.specials)


def test_fixed_seeds_compile_and_match_on_every_target_and_level():
    with WorkerPool(check_config, workers=2) as pool:
        result = fuzz(FIXED_SEEDS, configs(), pool)
        findings = minimize_failures(result, pool, budget=30)
    assert result.counts()["graphs"] == len(FIXED_SEEDS)
    assert result.counts()["compiles"] == len(FIXED_SEEDS) * len(configs())
    assert not findings, f"{len(findings)} failures:\n\n" + "\n\n".join(f.describe() for f in findings)


# -- the fuzzer's own parts ---------------------------------------------------------------------
def _relu_tanh_case() -> Case:
    x = Source("x0", (3, 10))
    ops = (Op("relu", ("x0",), ("t0",), {}), Op("tanh", ("t0",), ("t1",), {}))
    return Case(0, (x,), (), ops, ("t1",))


def relu_off_by_a_little(x):
    """A mutant reference: relu plus 1e-3, ten times the tolerance."""
    return torch.relu(x) + 1e-3


def test_a_wrong_reference_for_one_op_is_caught():
    task = Task(_relu_tanh_case(), Config("llvm"))
    assert check_config(task).failures == ()
    (failure,) = check_config(task, reference_overrides={"relu": relu_off_by_a_little}).failures
    assert (failure.kind, failure.cause, failure.output) == (MISMATCH, "values differ", "t1")
    assert 1e-4 < failure.max_abs_error < 1e-3


def crash_on_seed_1_hang_on_seed_2(task):
    """A mutant job: seed 1 dies as a heap corruption does (SIGABRT after glibc's message),
    seed 2 never finishes; the others pass without compiling."""
    if task.case.seed == 1:
        os.write(2, b"double free or corruption (out)\n")
        os.abort()
    if task.case.seed == 2:
        time.sleep(600)
    return ConfigResult(task.case.seed, task.config, True, True)


def test_a_crash_or_a_hang_in_a_worker_is_recorded_and_fuzzing_goes_on():
    with WorkerPool(crash_on_seed_1_hang_on_seed_2, workers=2, timeout=2) as pool:
        result = fuzz(range(4), [Config("llvm")], pool)
    assert result.counts()["graphs"] == 4 and result.counts()["runs"] == 2
    crash, hang = result.failures
    assert (crash.seed, crash.kind, crash.cause) == (1, CRASH, "SIGABRT")
    assert "double free or corruption (out)" in crash.detail
    assert (hang.seed, hang.kind) == (2, TIMEOUT)


def _softmax_case() -> Case:
    """A generated case of several ops, one of them a softmax."""
    return next(c for c in map(generate, range(100)) if len(c.ops) >= 6 and "softmax" in {op.kind for op in c.ops}
                and max(max(s.shape, default=1) for s in c.inputs) > 1)


def test_the_minimizer_shrinks_a_failing_graph():
    """A fake failure (any graph with a softmax) shrinks to one softmax on an input of ones."""
    case = _softmax_case()
    calls = []

    def fails(cases):
        calls.append(len(cases))
        return [any(op.kind == "softmax" for op in c.ops) for c in cases]

    small = minimize(case, fails, budget=1000)
    assert [op.kind for op in small.ops] == ["softmax"]
    assert [s.shape for s in small.inputs] == [(1,) * len(small.inputs[0].shape)] and small.params == ()
    assert max(calls) <= 2


def _rebuilt(code: str):
    """The graph and inputs a repro builds, run as a module (its compile is under __main__)."""
    namespace = {"__name__": "repro"}
    exec(compile(code, "repro.py", "exec"), namespace)
    return namespace["graph"], namespace["inputs"]


def test_a_repro_is_python_that_rebuilds_the_same_graph_weights_and_inputs():
    """Over 60 generated cases (split's several outputs, int ids, NaN and infinities among them)
    and a minimized one."""
    cases = [generate(seed) for seed in range(60)]
    assert any(len(op.outputs) > 1 for c in cases for op in c.ops)
    assert any(s.dtype != "float32" for c in cases for s in c.inputs)
    assert any(s.specials for c in cases for s in c.inputs)
    cases.append(minimize(_softmax_case(), lambda cs: [any(op.kind == "softmax" for op in c.ops) for c in cs]))
    for case in cases:
        graph, inputs = materialize(case)
        rebuilt, rebuilt_inputs = _rebuilt(repro(case, Config("llvm-persistent", 3)))
        assert str(rebuilt) == str(graph)
        assert rebuilt.weights.keys() == graph.weights.keys()
        assert all(np.array_equal(rebuilt.weights[k], v) for k, v in graph.weights.items())
        assert rebuilt_inputs.keys() == inputs.keys()
        assert all(np.array_equal(rebuilt_inputs[k], v, equal_nan=v.dtype.kind == "f") for k, v in inputs.items())


def test_compare_tells_unwritten_elements_from_lost_nan():
    want = np.array([1.0, np.nan, 3.0])
    assert compare("y", np.array([1.0, np.nan, 3.0], "float32"), want) is None
    assert compare("y", np.array([1.0, np.nan, 3.00001], "float32"), want) is None
    lost = compare("y", np.array([1.0, 0.0, 3.0], "float32"), want)
    assert lost.cause == "NaN or infinity not propagated"
    unwritten = compare("y", np.array([1.0, np.nan, np.nan], "float32"), want)
    assert unwritten.cause == "NaN or infinity where the reference is finite"
    off = compare("y", np.array([1.0, np.nan, 3.5], "float32"), want)
    assert (off.cause, off.max_abs_error) == ("values differ", 0.5)
    assert compare("y", np.zeros(2, "float32"), np.zeros(3)).cause == "shape differs"


def test_a_comparison_tie_may_go_either_way_and_nothing_else_may():
    """le(x, tanh(x)): float32 tanh rounds to x for tiny x (true), float64 keeps it below (false).
    Either answer is right there; a flip away from a tie is not."""
    from souffle.graph import GraphBuilder
    from tests.fuzzing import mismatches, reference_outputs, tie_references

    b = GraphBuilder("tie")
    b.input("x", (3,))
    b.op("tanh", "x", name="t")
    b.op("le", "x", "t", name="mask")
    graph = b.build("mask")
    x = np.array([1e-5, -0.5, 0.5], "float32")
    expected, ties = reference_outputs(graph, {"x": x}), tie_references(graph, {"x": x})
    assert expected[0].tolist() == [False, True, False] and len(ties) == 2
    assert not mismatches(graph.outputs, [np.array([True, True, False])], expected, ties)
    assert not mismatches(graph.outputs, [np.array([False, True, False])], expected, ties)
    flipped = mismatches(graph.outputs, [np.array([True, True, True])], expected, ties)
    assert [m.detail.split(";")[0] for m in flipped] == ["1 of 3 elements differ, max abs error 1"]
    assert mismatches(graph.outputs, [np.array([True, True, False])], expected)  # without the tie references
    assert 1e-5 - np.tanh(1e-5) < TIE_TOLERANCE


def test_the_fuzz_script_prints_a_summary_and_writes_its_results(tmp_path):
    path = tmp_path / "fuzz.json"
    done = subprocess.run([sys.executable, "scripts/fuzz.py", "--seconds", "1", "--seed-start", "5", "--targets", "llvm",
                           "--minimize-budget", "0", "--json", str(path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    record = json.loads(path.read_text())
    assert done.returncode == (1 if record["failures"] else 0), done.stderr
    assert "fuzzing for 1 s from seed 5 on llvm with 2 workers" in done.stdout
    assert record["command"].endswith(f"scripts/fuzz.py --seconds 1 --seed-start 5 --targets llvm "
                                      f"--minimize-budget 0 --json {path}")
    assert {"machine", "versions"} <= record.keys() and record["versions"]["apache-tvm"]
    assert record["configs"] == ["llvm"] and record["summary"]["graphs"] >= 1
    assert len(record["findings"]) == len({(f["seed"], f["kind"], f["cause"]) for f in record["failures"]})
    assert f"seeds 5 to {4 + record['summary']['graphs']}: {record['summary']['graphs']} graphs" in done.stdout
