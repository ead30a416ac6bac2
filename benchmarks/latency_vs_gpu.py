"""The static latency model against a GPU's measurements of the same kernels.

Recompiles here (TVM and nvcc, no GPU) every kernel a GPU run measured (``gpu_kernels.py run``'s
JSON, or a report made of it: ``benchmarks/results/gpu_h200.json``), on the device model of
the GPU it ran on, and sets the model's estimate beside the measured median. Where the bundles
that ran are at hand (``--bundles``), a kernel whose source no longer matches the one that ran
is left out, with the reason: an estimate of another kernel says nothing about the model.

It reports what correcting the model needs: measured over estimated (median, spread), whether
the model orders each model's opt levels as the GPU did, and a least-squares split of the
measured times into the model's parts (stage time, grid barriers, launches), which says which
part is off and by how much. The fit is a diagnostic printed beside the model's own figures;
the model's constants are not fitted to it.

    python benchmarks/latency_vs_gpu.py benchmarks/results/gpu_h200.json --bundles .gpu/k \\
        --name latency_vs_h200
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import re
import statistics
import sys
import time
from itertools import combinations
from pathlib import Path
from unittest import mock

import numpy as np
from scipy.optimize import nnls

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import command, machine, versions, write  # noqa: E402
from gpu_report import BUNDLE  # noqa: E402
from gpu_variants import applied, split  # noqa: E402


def bundle_fields(bundle: str) -> dict:
    """``bert_paper_O4_fp16`` -> model bert, config paper, level 4, precision fp16."""
    match = BUNDLE.match(bundle)
    if match is None:
        raise ValueError(f"not a bundle name of gpu_kernels.py export: {bundle!r}")
    return {"model": match["model"], "config": match["config"], "level": int(match["level"]),
            "precision": match["precision"] or "fp32"}


def device_model(gpu_name: str) -> str:
    """The device model of a GPU as ``nvidia-smi`` names it ("NVIDIA H200" -> h200)."""
    from analysis.device import DEVICES

    for name in DEVICES:
        if name != "cpu" and name in gpu_name.lower():
            return name
    raise ValueError(f"no device model for GPU {gpu_name!r} (known: {', '.join(DEVICES)})")


def estimate_row(measured: dict, bundles: Path | None, warps_to_saturate: int | None = None,
                 stages: bool = False, segments: bool = False) -> dict:
    """One measured kernel recompiled here and estimated on its GPU's device model; with
    ``warps_to_saturate``, estimated with ``analysis.latency``'s occupancy term at that value
    (the kernel compiled as it was, so that it is still the one that ran); with ``stages``, each
    stage's five times too (a megabyte or two for the 59 kernels of the H200 run); with
    ``segments``, each timed segment of its timeline beside its stages' estimate. A compiler
    variant's bundle (``BASE+VARIANT``, ``gpu_variants``) is compiled and estimated with it."""
    from analysis import latency
    from souffle import compile, models

    base, variant = split(measured["bundle"])
    fields = {**bundle_fields(base), "variant": variant}
    device = device_model(measured["device"])
    started = time.perf_counter()
    with applied(variant) if variant else contextlib.nullcontext():
        model = compile(models.build(fields["model"], fields["config"]), target="cuda", device=device,
                        opt_level=fields["level"], precision=fields["precision"], validate=False)
    row = {"bundle": measured["bundle"], **fields, "device": device, "measured_ms": measured["median_ms"],
           "compile_s": round(time.perf_counter() - started, 1)}
    if bundles is not None:
        ran = bundles / measured["bundle"] / "kernel.cu"
        if not ran.exists():
            return {**row, "skipped": f"{ran} not found"}
        if ran.read_text() != model.source:
            return {**row, "skipped": "the kernel compiled here is not the one that ran (its source differs)"}
    with applied(variant) if variant else contextlib.nullcontext(), \
            mock.patch.object(latency, "WARPS_TO_SATURATE", warps_to_saturate or latency.WARPS_TO_SATURATE):
        estimate = model.latency
    bounds: dict[str, float] = {}
    for stage in estimate.stages:
        bounds[stage.bound] = bounds.get(stage.bound, 0.0) + stage.total_seconds * 1e3
    row.update({"estimate_ms": estimate.seconds * 1e3,
                "parts_ms": {"stages": estimate.stage_seconds * 1e3, "grid barriers": estimate.barrier_seconds * 1e3,
                             "launches": estimate.launch_seconds * 1e3},
                "counts": {"grid barriers": estimate.grid_barriers, "launches": estimate.launches},
                "stage_ms_by_bound": bounds})
    if segments and measured.get("timeline", {}).get("segments"):
        row["segments"] = segment_rows(measured["timeline"]["segments"], estimate)
    if stages:
        row["stages"] = [{"name": s.work.name, "template": s.work.template, "executions": s.work.executions,
                          "blocks_per_sm": s.work.blocks_per_sm, "waves": s.work.waves,
                          "times_us": {k: v * 1e6 for k, v in s.times.items()}} for s in estimate.stages]
    return row


def segment_rows(timed: list[dict], estimate) -> list[dict]:
    """Each timed segment (the stages between two grid barriers, ``gpu_kernels.py``'s timeline)
    beside the sum of its stages' estimates for one execution, and its stages' templates. A
    segment of a stage the estimate does not name (an on-chip load) is left out."""
    per_execution = {s.work.name: (s.seconds * 1e6, s.work.template) for s in estimate.stages}
    rows = []
    for segment in timed:
        names = [re.sub(r"@\d+$", "", name) for name in segment["stages"]]
        if segment.get("measured_us") is None or not all(name in per_execution for name in names):
            continue
        rows.append({"stages": segment["stages"], "measured_us": segment["measured_us"],
                     "estimate_us": sum(per_execution[name][0] for name in names),
                     "templates": sorted({per_execution[name][1] for name in names})})
    return rows


def segment_summary(rows: list[dict]) -> dict:
    """The timed segments of every compared kernel: measured over estimated by template (segments
    of one template), and a least-squares split of the measured times into a factor on the
    estimate and a fixed cost per segment (the grid barrier that ends it, the blocks' ramp after
    it: what the model's ``DeviceModel.grid_sync_seconds`` stands for)."""
    segments = [s for r in rows for s in r.get("segments", [])]
    if not segments:
        return {}
    by_template: dict[str, list[float]] = {}
    for s in segments:
        if len(s["templates"]) == 1 and s["estimate_us"] > 0:
            by_template.setdefault(s["templates"][0], []).append(s["measured_us"] / s["estimate_us"])
    a = np.array([[s["estimate_us"], 1.0] for s in segments])
    y = np.array([s["measured_us"] for s in segments])
    (factor, fixed_us), _ = nnls(a, y)
    return {"segments": len(segments),
            "by_template": {t: {"segments": len(v), **spread(v)} for t, v in sorted(by_template.items())},
            "fit": {"estimate_factor": float(factor), "fixed_us_per_segment": float(fixed_us)}}


def segment_table(stats: dict) -> list[str]:
    if not stats:
        return []
    fit = stats["fit"]
    lines = ["", f"Timed segments (the stages between grid barriers) of the kernels above: {stats['segments']}. "
             f"Least squares: measured = {fit['estimate_factor']:.2f} x the stages' estimate + "
             f"{fit['fixed_us_per_segment']:.2f} us per segment.", "",
             "| template (segments of one) | segments | measured / estimated, median | 10% | 90% |",
             "|---|---|---|---|---|"]
    for template, t in stats["by_template"].items():
        lines.append(f"| {template} | {t['segments']} | {t['median']:.2f} | {t['p10']:.2f} | {t['p90']:.2f} |")
    return lines


def order_agreement(rows: list[dict]) -> dict:
    """For each model, config, precision (and compiler variant) measured at several opt levels:
    the pairs of levels the estimate orders as the GPU did, and those it orders the other way."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["config"], row["precision"], row.get("variant")), []).append(row)
    agree, disagree = 0, []
    for group in groups.values():
        for a, b in combinations(sorted(group, key=lambda r: r["level"]), 2):
            if (a["measured_ms"] < b["measured_ms"]) == (a["estimate_ms"] < b["estimate_ms"]):
                agree += 1
            else:
                disagree.append(f"{a['bundle']} vs O{b['level']}: measured {a['measured_ms']:.3f} vs "
                                f"{b['measured_ms']:.3f} ms, estimated {a['estimate_ms']:.3f} vs {b['estimate_ms']:.3f}")
    return {"pairs": agree + len(disagree), "agree": agree, "disagree": disagree}


def fit_parts(rows: list[dict]) -> dict:
    """Nonnegative least squares of measured = a x stage time + b x grid barriers + c x launches,
    each kernel weighted by 1 / measured (relative errors): the per-barrier and per-launch costs
    the GPU showed, and the factor the stage times are off by."""
    a = np.array([[r["parts_ms"]["stages"], r["counts"]["grid barriers"], r["counts"]["launches"]] for r in rows])
    y = np.array([r["measured_ms"] for r in rows])
    (scale, barrier_ms, launch_ms), _ = nnls(a / y[:, None], np.ones_like(y))
    ratios = y / (a @ [scale, barrier_ms, launch_ms])
    return {"stage_time_factor": scale, "grid_barrier_us": barrier_ms * 1e3, "launch_us": launch_ms * 1e3,
            "fitted_ratio_median": statistics.median(ratios), "fitted_ratio_min": float(ratios.min()),
            "fitted_ratio_max": float(ratios.max())}


def spread(values: list[float]) -> dict:
    """Median and the 10th and 90th percentiles (the nearest ranks) of ``values``."""
    ordered = sorted(values)
    return {"median": statistics.median(ordered), "p10": ordered[len(ordered) // 10],
            "p90": ordered[-1 - len(ordered) // 10]}


def summary(rows: list[dict]) -> dict:
    ratios = sorted(r["measured_ms"] / r["estimate_ms"] for r in rows)
    ratio = spread(ratios)
    return {"kernels": len(rows), "ratio_median": ratio["median"], "ratio_min": ratios[0],
            "ratio_max": ratios[-1], "ratio_p10": ratio["p10"], "ratio_p90": ratio["p90"],
            "order": order_agreement(rows), "fit": fit_parts(rows), "segments": segment_summary(rows)}


def table(rows: list[dict], skipped: list[dict], stats: dict) -> str:
    fit, order = stats["fit"], stats["order"]
    lines = [f"{stats['kernels']} kernels: measured / estimated median {stats['ratio_median']:.2f} "
             f"(10% {stats['ratio_p10']:.2f}, 90% {stats['ratio_p90']:.2f}, range {stats['ratio_min']:.2f}-"
             f"{stats['ratio_max']:.2f}); opt levels ordered as measured in {order['agree']} of {order['pairs']} pairs.",
             "",
             f"Least-squares split of the measured times (a diagnostic, not applied): stage times x "
             f"{fit['stage_time_factor']:.2f}, {fit['grid_barrier_us']:.2f} us per grid barrier, "
             f"{fit['launch_us']:.2f} us per launch (measured / fitted median {fit['fitted_ratio_median']:.2f}, "
             f"range {fit['fitted_ratio_min']:.2f}-{fit['fitted_ratio_max']:.2f}).", ""]
    if order["disagree"]:
        lines += ["Opt levels the estimate orders the other way:", ""] + [f"- {d}" for d in order["disagree"]] + [""]
    lines += ["| bundle | measured ms | estimate ms | measured / estimate | stages ms | grid barriers (ms) "
              "| launches (ms) | stage ms by bound |", "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["measured_ms"] / r["estimate_ms"]):
        parts, counts = r["parts_ms"], r["counts"]
        bounds = ", ".join(f"{k} {v:.3g}" for k, v in sorted(r["stage_ms_by_bound"].items(), key=lambda kv: -kv[1]))
        lines.append(f"| {r['bundle']} | {r['measured_ms']:.3f} | {r['estimate_ms']:.3f} | "
                     f"{r['measured_ms'] / r['estimate_ms']:.2f} | {parts['stages']:.3f} | "
                     f"{counts['grid barriers']} ({parts['grid barriers']:.3f}) | {counts['launches']} "
                     f"({parts['launches']:.3f}) | {bounds} |")
    lines += segment_table(stats.get("segments", {}))
    if skipped:
        lines += ["", "Left out:", ""] + [f"- {r['bundle']}: {r['skipped']}" for r in skipped]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("measured", type=Path, help="gpu_kernels.py run's JSON, or a gpu_report.py JSON")
    parser.add_argument("--bundles", type=Path, help="the bundles that ran: kernels whose source differs are left out")
    parser.add_argument("--only", default="*", help="bundles to compare (a glob, default all)")
    parser.add_argument("--name", default="latency_vs_gpu", help="results file name (benchmarks/results/NAME.json, .md)")
    parser.add_argument("--stages", action="store_true", help="also write each stage's estimated times")
    parser.add_argument("--segments", action="store_true", help="also set each timed segment (a timeline's "
                        "stages between grid barriers) beside its stages' estimate, summed up by template")
    parser.add_argument("--warps-to-saturate", type=int, help="estimate with analysis.latency's occupancy term at "
                        "this value (WARPS_TO_SATURATE; the kernels compiled as the default compiles them)")
    args = parser.parse_args()
    payload = json.loads(args.measured.read_text())
    measured = [k for k in payload["kernels"] if fnmatch.fnmatch(k["bundle"], args.only)
                and k.get("check") == "PASS" and k.get("median_ms")]
    rows = []
    for kernel in measured:
        row = estimate_row(kernel, args.bundles, args.warps_to_saturate, args.stages, args.segments)
        rows.append(row)
        print(f"{row['bundle']}: " + (row["skipped"] if "skipped" in row else f"estimate {row['estimate_ms']:.3f} ms"),
              flush=True)
    compared = [r for r in rows if "skipped" not in r]
    skipped = [r for r in rows if "skipped" in r]
    if not compared:
        raise SystemExit("no kernel to compare: every one was left out")
    stats = summary(compared)
    md = table(compared, skipped, stats)
    json_path, md_path = write(args.name, {"command": command(), "machine": machine(),
                                           "versions": versions("apache-tvm", "numpy"), "measured": str(args.measured),
                                           "measured_on": payload.get("machine"),
                                           "warps_to_saturate": args.warps_to_saturate, "summary": stats, "kernels": rows},
                               f"# The latency model against {args.measured.name}\n\nCommand: `{command()}`\n\n{md}\n")
    print(md)
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
