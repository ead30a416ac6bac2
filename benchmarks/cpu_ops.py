"""Single ops of the paper models through the real pipeline, next to PyTorch eager on the CPU.

Each case is a one-op (or one-cell) souffle Graph built with GraphBuilder, compiled with
``souffle.compile(g, "llvm")`` and timed with ``CompiledModel.benchmark`` (TVM's
time_evaluator); PyTorch runs the same computation on the same inputs with
``torch.set_num_threads(<cores>)``. The two are timed in alternating rounds and the
minimum of each is kept: on a small machine a burst of load from another process stalls
every parallel region (a worker thread waits for a core), and the minimum is the round
that ran undisturbed. If another process keeps a core busy for the whole run, both
columns are inflated (PyTorch's fork-join more so): rerun when the machine is idle.
Every case first checks Souffle's output against PyTorch (rtol 1e-4, atol 1e-4).
Writes benchmarks/results/cpu_ops.{json,md}.

    python benchmarks/cpu_ops.py [--cases dense_768 softmax ...] [--rounds 5] [--list]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

import souffle  # noqa: E402
from souffle.graph import GraphBuilder  # noqa: E402


ROUND_S = 0.03  # seconds per timing round and system
POOL_IDLE_S = 0.01  # pause between systems, so neither starts while the other's pool is still spinning


@dataclass
class Case:
    name: str
    what: str
    build: Callable[[np.random.Generator], tuple]  # rng -> (graph, inputs, torch_fn)


def _dense(m: int, k: int, n: int):
    def build(rng):
        import torch

        x = rng.standard_normal((m, k), dtype=np.float32)
        w = (rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k)).astype(np.float32)
        bias = rng.standard_normal(n, dtype=np.float32)
        b = GraphBuilder("dense")
        y = b.op("dense", b.input("x", x.shape), b.param("w", w), b.param("b", bias))
        tx, tw, tb = map(torch.from_numpy, (x, w, bias))
        return b.build(y), {"x": x}, lambda: torch.nn.functional.linear(tx, tw, tb)

    return Case(f"dense_{m}x{k}x{n}", f"dense {m}x{k} @ ({n}x{k}).T + bias", build)


def _batch_matmul(batch: int, m: int, k: int, n: int, transpose_b: bool):
    def build(rng):
        import torch

        a = rng.standard_normal((batch, m, k), dtype=np.float32)
        b_shape = (batch, n, k) if transpose_b else (batch, k, n)
        bm = rng.standard_normal(b_shape, dtype=np.float32)
        b = GraphBuilder("bmm")
        y = b.op("batch_matmul", b.input("a", a.shape), b.input("b", bm.shape), transpose_b=transpose_b)
        ta, tb = torch.from_numpy(a), torch.from_numpy(bm)
        fn = (lambda: torch.bmm(ta, tb.transpose(1, 2))) if transpose_b else (lambda: torch.bmm(ta, tb))
        return b.build(y), {"a": a, "b": bm}, fn

    layout = f"({batch}x{n}x{k}).T" if transpose_b else f"{batch}x{k}x{n}"
    name = f"bmm_{batch}x{m}x{k}x{n}{'_nt' if transpose_b else ''}"
    return Case(name, f"batch_matmul {batch}x{m}x{k} @ {layout}", build)


def _lstm_cell(hidden: int):
    def build(rng):
        import torch

        bound = 1 / np.sqrt(hidden)
        w_ih, w_hh = (rng.uniform(-bound, bound, (4 * hidden, hidden)).astype(np.float32) for _ in range(2))
        b_ih, b_hh = (rng.uniform(-bound, bound, 4 * hidden).astype(np.float32) for _ in range(2))
        x, h, c = (rng.standard_normal((1, hidden), dtype=np.float32) for _ in range(3))
        b = GraphBuilder("lstm_cell")
        xs, hs, cs = (b.input(n, (1, hidden)) for n in ("x", "h", "c"))
        gates = b.op("add", b.op("dense", xs, b.param("w_ih", w_ih), b.param("b_ih", b_ih)),
                     b.op("dense", hs, b.param("w_hh", w_hh), b.param("b_hh", b_hh)))
        i, f, g, o = (b.op("slice", gates, begin=k * hidden, end=(k + 1) * hidden, axis=1) for k in range(4))
        c_next = b.op("add", b.op("mul", b.op("sigmoid", f), cs), b.op("mul", b.op("sigmoid", i), b.op("tanh", g)))
        h_next = b.op("mul", b.op("sigmoid", o), b.op("tanh", c_next))
        cell = torch.nn.LSTMCell(hidden, hidden)
        cell.load_state_dict({k: torch.from_numpy(v) for k, v in
                              {"weight_ih": w_ih, "weight_hh": w_hh, "bias_ih": b_ih, "bias_hh": b_hh}.items()})
        tx, th, tc = map(torch.from_numpy, (x, h, c))
        return b.build(h_next, c_next), {"x": x, "h": h, "c": c}, lambda: cell(tx, (th, tc))

    what = f"LSTM cell, batch 1, hidden {hidden} (two 1x{hidden} @ {4 * hidden}x{hidden} GEMVs + gates)"
    return Case(f"lstm_cell_{hidden}", what, build)


def _conv(channels: int, out_channels: int, size: int, kernel: int, stride: int, groups: int):
    padding = kernel // 2

    def build(rng):
        import torch

        x = rng.standard_normal((1, channels, size, size), dtype=np.float32)
        fan_in = channels // groups * kernel * kernel
        w = (rng.standard_normal((out_channels, channels // groups, kernel, kernel), dtype=np.float32)
             / np.sqrt(fan_in)).astype(np.float32)
        b = GraphBuilder("conv")
        y = b.op("conv2d", b.input("x", x.shape), b.param("w", w), stride=stride, padding=padding, groups=groups)
        tx, tw = torch.from_numpy(x), torch.from_numpy(w)
        fn = lambda: torch.nn.functional.conv2d(tx, tw, stride=stride, padding=padding, groups=groups)  # noqa: E731
        return b.build(y), {"x": x}, fn

    grouped = groups > 1
    name = f"conv{kernel}x{kernel}_{channels}to{out_channels}_{size}px_s{stride}" + (f"_g{groups}" if grouped else "")
    what = f"conv2d {channels}->{out_channels}, {kernel}x{kernel}/{stride}, {size}x{size}" + (f", {groups} groups" if grouped else "")
    return Case(name, what, build)


def _rows(kind: str, shape: tuple[int, ...]):
    def build(rng):
        import torch

        x = rng.standard_normal(shape, dtype=np.float32)
        b = GraphBuilder(kind)
        xi = b.input("x", shape)
        tx = torch.from_numpy(x)
        if kind == "softmax":
            y, fn = b.op("softmax", xi, axis=-1), (lambda: torch.softmax(tx, -1))
        elif kind == "layer_norm":
            gamma = rng.standard_normal(shape[-1:], dtype=np.float32)
            beta = rng.standard_normal(shape[-1:], dtype=np.float32)
            y = b.op("layer_norm", xi, b.param("gamma", gamma), b.param("beta", beta), eps=1e-12)
            tg, tb = torch.from_numpy(gamma), torch.from_numpy(beta)
            fn = lambda: torch.nn.functional.layer_norm(tx, shape[-1:], tg, tb, eps=1e-12)  # noqa: E731
        else:
            y, fn = b.op("gelu", xi), (lambda: torch.nn.functional.gelu(tx))
        return b.build(y), {"x": x}, fn

    return Case(f"{kind}_{'x'.join(map(str, shape))}", f"{kind} over the last axis of {list(shape)}", build)


CASES = [
    _dense(384, 768, 768), _dense(384, 768, 3072), _dense(384, 3072, 768),
    _batch_matmul(12, 384, 64, 384, transpose_b=True), _batch_matmul(12, 384, 384, 64, transpose_b=False),
    _lstm_cell(256),
    _conv(3, 64, 224, 7, 2, 1),  # ResNeXt-101 64x4d: stem, then each stage's convolutions
    _conv(256, 256, 56, 1, 1, 1), _conv(256, 256, 56, 3, 1, 64),
    _conv(512, 512, 56, 3, 2, 64), _conv(512, 512, 28, 1, 1, 1), _conv(512, 512, 28, 3, 1, 64),
    _conv(1024, 1024, 14, 1, 1, 1), _conv(1024, 1024, 14, 3, 1, 64), _conv(1024, 2048, 14, 1, 1, 1),
    _conv(2048, 2048, 7, 1, 1, 1), _conv(2048, 2048, 7, 3, 1, 64),
    _rows("softmax", (12, 384, 384)), _rows("layer_norm", (384, 768)), _rows("gelu", (384, 3072)),
]


def _torch_seconds(fn, number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number


def measure(case: Case, rounds: int, seed: int) -> dict:
    """Check the output, then alternate Souffle and PyTorch rounds; keep each one's minimum."""
    import torch

    graph, inputs, torch_fn = case.build(np.random.default_rng(seed))
    start = time.perf_counter()
    compiled = souffle.compile(graph, "llvm")
    compile_s = time.perf_counter() - start
    ours = compiled.run(inputs)
    with torch.no_grad():
        expected = torch_fn()
        expected = [t.numpy() for t in (expected if isinstance(expected, tuple) else (expected,))]
        for got, want in zip(ours, expected):
            np.testing.assert_allclose(got, want.reshape(got.shape), rtol=1e-4, atol=1e-4, err_msg=case.name)
        once = _torch_seconds(torch_fn, 1)
        number = max(1, min(200, int(ROUND_S / max(once, 1e-7))))
        souffle_s, torch_s = [], []
        for _ in range(rounds):
            time.sleep(POOL_IDLE_S)
            souffle_s.append(min(compiled.benchmark(inputs, repeat=1, number=number)))
            time.sleep(POOL_IDLE_S)
            torch_s.append(_torch_seconds(torch_fn, number))
    return {"case": case.name, "what": case.what, "compile_s": compile_s, "souffle_ms": min(souffle_s) * 1e3,
            "torch_ms": min(torch_s) * 1e3, "ratio": min(souffle_s) / min(torch_s), "calls_per_round": number}


def table(rows: list[dict]) -> str:
    lines = ["| op | souffle ms | torch ms | souffle / torch | compile s |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['what']} | {r['souffle_ms']:.3f} | {r['torch_ms']:.3f} | {r['ratio']:.2f}x | {r['compile_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="+", help="case names (default: all; see --list)")
    parser.add_argument("--rounds", type=int, default=15, help="alternating timing rounds per system")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--output", default="cpu_ops", help="file stem under benchmarks/results/")
    args = parser.parse_args()
    if args.list:
        print("\n".join(f"{c.name:40s} {c.what}" for c in CASES))
        return
    cores = len(os.sched_getaffinity(0))
    torch.set_num_threads(cores)
    selected = [c for c in CASES if not args.cases or c.name in args.cases]
    rows = []
    for case in selected:
        rows.append(measure(case, args.rounds, args.seed))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    common.publish(args.output, rows, table(rows), ("apache-tvm", "apache-tvm-ffi", "torch", "numpy"),
                   f"minimum over {args.rounds} alternating rounds of about {ROUND_S * 1e3:.0f} ms each; "
                   f"souffle by TVM's time_evaluator, torch by wall clock with torch.set_num_threads({cores})")


if __name__ == "__main__":
    main()
