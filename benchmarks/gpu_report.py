"""One report of a GPU run from the files it brought back (``scripts/gpu_run.sh``, or its steps
run one by one), with the static model's figures beside the measurements.

    python benchmarks/gpu_report.py NAME --bundles DIR --kernels A.json [B.json ...] \\
        --torch C.json[:MODE,MODE] [D.json ...] [--results DIR]

``--kernels``: ``benchmarks/gpu_kernels.py run`` results; a bundle's row is the first file's,
with the fields only a later file has (a later run's ncu columns) added. ``--torch``:
``benchmarks/gpu_torch.py`` results, each optionally restricted to some modes; a later file's
row for the same bundle and mode replaces an earlier one. ``--bundles``: the exported bundles,
whose ``static.json`` (``souffle.compiler.static_figures``) gives the estimate and static bytes.
Writes ``NAME.json`` and ``NAME.md``: every kernel's check, Souffle against each PyTorch mode,
the opt levels' ablation, the compiler variants beside their base, and DRAM bytes measured against
counted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common
from gpu_kernels import outside_cell, timeline_table
from gpu_variants import VARIANTS, split

TORCH_MODES = ("eager", "cuda-graph", "reduce-overhead", "compile", "max-autotune")
BUNDLE = re.compile(r"(?P<model>[a-z]+)_(?P<config>tiny|paper)_O(?P<level>\d)(?:_(?P<precision>fp16|bf16|tf32))?$")


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _not_run(value) -> bool:
    """A field a run left unmeasured: "not run (time budget)", or a check's "NOT RUN (...)"."""
    return isinstance(value, str) and value.lower().startswith("not run")


def merge_kernels(paths: list[Path]) -> dict[str, dict]:
    """Each bundle's row from the first file that has it; a later file adds the fields the earlier
    ones lack and fills those they did not run (a sanitizer cut off by the time budget)."""
    rows: dict[str, dict] = {}
    for path in paths:
        for row in _load(path)["results"]:
            row = {k: v for k, v in row.items() if k != "path"}  # where the bundle lay on the GPU machine
            earlier = rows.get(row["bundle"], {})
            rows[row["bundle"]] = {**row, **{k: v for k, v in earlier.items() if not (_not_run(v) and k in row)}}
    return rows


def merge_torch(specs: list[str]) -> dict[tuple[str, str], dict]:
    rows: dict[tuple[str, str], dict] = {}
    for spec in specs:
        path, _, modes = spec.partition(":")
        for row in _load(Path(path))["results"]:
            if row.get("status") == "ok" and (not modes or row["mode"] in modes.split(",")):
                rows[row["bundle"], row["mode"]] = row
    return rows


def _ms(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def kernels_table(kernels: dict[str, dict], static: dict[str, dict]) -> str:
    lines = ["| bundle | check (max abs error) | unwritten | repeatable | launches | grid (blocks/SM) "
             "| median ms | estimate ms | racecheck | synccheck |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in sorted(kernels.items()):
        est = static.get(name, {})
        err = (f" ({r['max_abs_error']:.2g})" if "max_abs_error" in r else "") + outside_cell(r)
        lines.append(f"| {name} | {r['check']}{err} | {r.get('unwritten', '-')} | {r.get('repeatable', '-')} "
                     f"| {r.get('launches', '-')} | {r.get('grid', '-')} ({r.get('blocks_per_sm', '-')}) "
                     f"| {_ms(r.get('median_ms'))} | {_ms(est.get('estimate_ms'))} ({est.get('device', '-')}) "
                     f"| {r.get('racecheck', '-')} | {r.get('synccheck', '-')} |")
    return "\n".join(lines)


def comparison_rows(kernels: dict[str, dict], torch: dict[tuple[str, str], dict]) -> list[dict]:
    rows = []
    for name, r in sorted(kernels.items()):
        match = BUNDLE.match(name)
        modes = {mode: torch[name, mode] for mode in TORCH_MODES if (name, mode) in torch}
        if not match or match["level"] != "4" or not modes or "median_ms" not in r:
            continue
        best_mode = min(modes, key=lambda m: modes[m]["median_ms"])
        rows.append({"bundle": name, "model": match["model"], "config": match["config"],
                     "precision": match["precision"] or "fp32", "souffle_ms": r["median_ms"],
                     **({"souffle_graph_ms": r["graph_median_ms"]} if "graph_median_ms" in r else {}),
                     **({"souffle_ncu_ms": r["ncu_gpu_time_ms"]} if "ncu_gpu_time_ms" in r else {}),
                     "souffle_launches": r["launches"],
                     **{f"{mode}_ms": modes[mode]["median_ms"] for mode in modes},
                     **{f"{mode}_kernels": modes[mode]["kernels"] for mode in modes},
                     "best_pytorch": best_mode, "speedup_over_best": modes[best_mode]["median_ms"] / r["median_ms"]})
    return rows


def comparison_table(rows: list[dict]) -> str:
    lines = ["| model | config | precision | Souffle ms (launches) | Souffle in a CUDA graph, ms "
             "| Souffle's kernels alone, ms (ncu) | " + " | ".join(
                 f"{mode} ms (kernels)" for mode in TORCH_MODES) + " | Souffle vs best PyTorch |",
             "|---|---|---|---|---|---|" + "---|" * len(TORCH_MODES) + "---|"]
    for r in sorted(rows, key=lambda r: (r["config"] != "paper", r["model"], r["precision"])):
        cells = [f"{r[f'{m}_ms']:.3f} ({r[f'{m}_kernels']})" if f"{m}_ms" in r else "not measured"
                 for m in TORCH_MODES]
        lines.append(f"| {r['model']} | {r['config']} | {r['precision']} | {r['souffle_ms']:.3f} "
                     f"({r['souffle_launches']}) | {_ms(r.get('souffle_graph_ms'))} | {_ms(r.get('souffle_ncu_ms'))} | "
                     + " | ".join(cells)
                     + f" | {r['speedup_over_best']:.2f}x ({r['best_pytorch']}) |")
    return "\n".join(lines)


def ablation_table(kernels: dict[str, dict], static: dict[str, dict]) -> str:
    levels: dict[tuple[str, str, str], dict[str, dict]] = {}
    for name, r in kernels.items():
        match = BUNDLE.match(name)
        if match and "median_ms" in r:
            levels.setdefault((match["model"], match["config"], match["precision"] or "fp32"), {})[match["level"]] = name
    header = "| model | config | precision | " + " | ".join(f"O{level} ms (launches; estimate)" for level in range(5))
    lines = [header + " |", "|---|---|---|" + "---|" * 5]
    for (model, config, precision), names in sorted(levels.items(), key=lambda kv: (kv[0][1] != "paper", kv[0])):
        if len(names) < 2:
            continue
        cells = []
        for level in map(str, range(5)):
            name = names.get(level)
            if name is None:
                cells.append("not run")
                continue
            r, est = kernels[name], static.get(name, {})
            cells.append(f"{r['median_ms']:.3f} ({r['launches']}; {_ms(est.get('estimate_ms'))})")
        lines.append(f"| {model} | {config} | {precision} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _timed(row: dict | None) -> str:
    """A bundle's median and grid (blocks per SM), or that it did not run."""
    return f"{_ms(row.get('median_ms'))} ({row.get('grid', '-')}, {row.get('blocks_per_sm', '-')})" if row else "not run"


def variants_table(kernels: dict[str, dict], static: dict[str, dict]) -> str:
    """Each compiler variant's bundle (``gpu_variants``) beside its base: the question it asks,
    both times and estimates, and the variant's speedup (over 1: the variant is faster)."""
    lines = ["| bundle | variant | check | base ms (grid, blocks/SM) | variant ms (grid, blocks/SM) "
             "| variant speedup | base estimate ms | variant estimate ms |", "|---|---|---|---|---|---|---|---|"]
    questions: dict[str, str] = {}
    for name, r in sorted(kernels.items()):
        base, variant = split(name)
        if variant is None:
            continue
        questions[variant] = VARIANTS[variant].question if variant in VARIANTS else "(not a known variant)"
        mine, theirs = r.get("median_ms"), kernels.get(base, {}).get("median_ms")
        speedup = f"{theirs / mine:.2f}x" if mine and theirs else "-"
        estimates = [_ms(static.get(bundle, {}).get("estimate_ms")) for bundle in (base, name)]
        lines.append(f"| {base} | {variant} | {r['check']} | {_timed(kernels.get(base))} | {_timed(r)} | {speedup} "
                     f"| {estimates[0]} | {estimates[1]} |")
    if not questions:
        return "No variant was run."
    return "\n".join([f"- {variant}: {question}" for variant, question in questions.items()] + [""] + lines)


def dram_table(kernels: dict[str, dict], static: dict[str, dict]) -> str:
    lines = ["| bundle | DRAM read MB (ncu) | read MB (L2 model) | read MB (counted) | DRAM write MB (ncu) "
             "| write MB (L2 model) | write MB (counted) | compulsory MB |", "|---|---|---|---|---|---|---|---|"]
    for name, r in sorted(kernels.items()):
        if "dram_read_mb" not in r:
            continue
        est = static.get(name, {})

        def mb(key):
            return f"{est[key] / 1e6:.2f}" if key in est else "-"

        lines.append(f"| {name} | {r['dram_read_mb']:.2f} | {mb('l2_model_read_bytes')} | {mb('read_bytes')} "
                     f"| {r['dram_write_mb']:.2f} | {mb('l2_model_write_bytes')} | {mb('write_bytes')} "
                     f"| {mb('compulsory_bytes')} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", help="results name, e.g. gpu_h200")
    parser.add_argument("--bundles", type=Path, required=True)
    parser.add_argument("--kernels", type=Path, nargs="+", required=True)
    parser.add_argument("--torch", nargs="+", default=[])
    parser.add_argument("--results", type=Path, default=None)
    parser.add_argument("--note", action="append", default=[], help="a sentence the report carries (repeatable)")
    args = parser.parse_args()
    kernels = merge_kernels(args.kernels)
    torch = merge_torch(args.torch)
    static = {name: _load(args.bundles / name / "static.json") for name in kernels
              if (args.bundles / name / "static.json").exists()}
    comparison = comparison_rows(kernels, torch)
    first = _load(args.kernels[0])
    commands = [_load(p)["command"] for p in args.kernels] + [_load(Path(s.partition(":")[0]))["command"]
                                                             for s in args.torch]
    md = "\n\n".join([
        f"Report: `{common.command()}`",
        "Commands on the GPU machine: " + "; ".join(f"`{c}`" for c in commands),
        f"GPU machine: {first['machine']}. Versions: {first['versions']}. Timing: {first['timing']}.",
        *args.note,
        "## Souffle against PyTorch on the same GPU, weights and inputs (median ms, CUDA events)",
        "CUDA events bracket the host's launch calls, so a short kernel's time includes the gap while "
        "the host (Python, for Souffle) issues it; ncu's gpu__time_duration is the kernels alone, from cold caches.",
        comparison_table(comparison),
        "## Every exported kernel: outputs against PyTorch's (poisoned first), time, estimate, sanitizers",
        kernels_table(kernels, static),
        "## The opt levels on the GPU",
        ablation_table(kernels, static),
        "## Compiler variants beside their base (benchmarks/gpu_variants.py)",
        variants_table(kernels, static),
        "## DRAM bytes: ncu against the static counts",
        "Counted: every stage's operands and output at their distinct bytes, an upper bound. L2 model "
        "(codegen.traffic.l2_traffic): the same accesses replayed in order through an LRU L2 of the device "
        "model's size, each stacked weight's slice its own entry.",
        dram_table(kernels, static),
        "## Where the persistent kernels' time goes: segments between grid barriers, measured and estimated",
        *[timeline_table(name, r["timeline"]) for name, r in sorted(kernels.items()) if "timeline" in r]])
    payload = {"sources": {"kernels": [str(p) for p in args.kernels], "torch": args.torch},
               "command": common.command(), "machine": first["machine"], "versions": first["versions"],
               "notes": args.note, "kernels": list(kernels.values()), "static": static, "comparison": comparison,
               "torch": list(torch.values())}
    json_path, md_path = common.write(args.name, payload, md, args.results)
    print(md)
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
