"""Global-memory traffic of one inference of each model's persistent CUDA kernel.

The static columns come from ``codegen.traffic.memory_traffic`` on the ``cuda`` build's
staged program (compiling needs nvcc, not a GPU): the bytes every stage reads and writes,
an upper bound on DRAM traffic, next to the compulsory bytes (weights, inputs, outputs).
With ``--ncu`` (needs a GPU and Nsight Compute) one inference runs under ``ncu`` and the
measured ``dram__bytes_read.sum`` and ``dram__bytes_write.sum`` are summed over its kernel
launches; ncu flushes the caches before each launch by default, so they start cold.

    python scripts/profile_dram.py [MODEL...] [--config tiny|paper] [--ncu] [--json PATH]

Sizes are MB (10^6 bytes) to the byte; the JSON rows hold exact bytes.
"""

from __future__ import annotations

import sys

import profile_kernels as pk

from codegen.traffic import memory_traffic

METRICS = ["dram__bytes_read.sum", "dram__bytes_write.sum"]
COLUMNS = [("model", "model"), ("config", "config"), ("stages_executed", "stages executed"),
           ("read_mb", "read MB (static)"), ("write_mb", "write MB (static)"), ("compulsory_mb", "compulsory MB")]
NCU_COLUMNS = [("ncu_launches", "launches (ncu)"), ("dram_read_mb", "DRAM read MB (ncu)"),
               ("dram_write_mb", "DRAM write MB (ncu)")]


def profile(name: str, config: str, ncu: str | None) -> dict:
    model, seconds = pk.compile_model(name, config, "cuda")
    traffic = memory_traffic(model.plan)
    row = {"model": name, "config": config, "stages_executed": traffic.stages_executed,
           "read_bytes": traffic.read_bytes, "write_bytes": traffic.write_bytes,
           "compulsory_bytes": traffic.compulsory_bytes, "exact": all(s.exact for s in traffic.stages),
           "compile_s": seconds}
    if ncu is not None:
        launches = pk.ncu_launches(ncu, __file__, name, config, METRICS)
        row["ncu_launches"] = len(launches)
        row["dram_read_bytes"] = round(sum(launch["dram__bytes_read.sum"] for launch in launches))
        row["dram_write_bytes"] = round(sum(launch["dram__bytes_write.sum"] for launch in launches))
    return row


def _in_mb(row: dict) -> dict:
    """The row for printing: every ``*_bytes`` also as ``*_mb``, to the byte."""
    return {**row, **{k[:-len("bytes")] + "mb": f"{v / 1e6:.6f}" for k, v in row.items() if k.endswith("_bytes")}}


def run(argv=None) -> int:
    args = pk.parse_args(pk.parser(__doc__, targets=False), argv)
    if args.run_once:
        pk.run_once(args.models[0], args.config)
        return 0
    ncu = pk.require_ncu() if args.ncu else None
    rows = [profile(name, args.config, ncu) for name in args.models]
    print(pk.format_table(COLUMNS + (NCU_COLUMNS if ncu else []), [_in_mb(r) for r in rows]))
    gathers = [r["model"] for r in rows if not r["exact"]]
    if gathers:
        print(f"{', '.join(gathers)}: some reads are gathers, counted over all the elements they may touch")
    if args.json:
        pk.write_json(args.json, rows, ncu)
    return 0


if __name__ == "__main__":
    sys.exit(pk.main_guard(run, None))
