"""Print the paper-style tables from a ``benchmarks/compare.py`` result.

    python scripts/paper_tables.py [RESULT.json ...] [--table latency|kernels|tuning|all]

Table 3 of the paper (``latency``): median latency per system and model, and Souffle's speedup
over each system with the geometric mean. Table 5 (``kernels``): kernel launches per inference and
bytes moved per system. ``tuning``: compile seconds of every system and MetaSchedule's budget.
Without a file it reads every ``benchmarks/results/compare_*.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import compare  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="*", type=Path, help="compare.py JSON files (default: benchmarks/results/compare_*.json)")
    parser.add_argument("--table", choices=("latency", "kernels", "tuning", "all"), default="all")
    args = parser.parse_args(argv)
    paths = args.results or sorted((ROOT / "benchmarks" / "results").glob("compare_*.json"))
    if not paths:
        parser.error("no compare results found; run benchmarks/compare.py first")
    for path in paths:
        try:
            payload = json.loads(path.read_text())
            rows = payload["results"]
        except (OSError, ValueError, KeyError) as error:
            parser.error(f"{path} is not a compare.py result: {error}")
        print(f"# {path.name}: `{payload['command']}` on {payload['machine']['cpu']} ({payload['machine']['cores']} cores)\n")
        if args.table in ("latency", "all"):
            print(f"## Latency, ms (Table 3 style)\n\n{compare.latency_table(rows)}\n")
        if args.table in ("kernels", "all"):
            print(f"## Kernel launches per inference / bytes moved (Table 5 style)\n\n{compare.kernel_table(rows)}\n")
        if args.table in ("tuning", "all"):
            print(f"## Compile and tuning time\n\n{compare.tuning_table(rows)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
