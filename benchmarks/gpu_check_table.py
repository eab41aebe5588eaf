"""
The device check's table: for each run of lesson 07 that benchmarks/gpu_check.sh made, its
tokens/s, MFU and peak allocated memory (medians over the steps after the first two, read from
the run's --metrics file) next to the memory plan's prediction for the same flags (the "total"
line of its --plan output).

    python benchmarks/gpu_check_table.py OUT_DIR      # OUT_DIR holds NAME.metrics.jsonl, NAME.plan.txt
"""

import json
import re
import statistics
import sys
from pathlib import Path


def step_records(path: Path) -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if "tokens_per_s" in r]


def planned_gib(path: Path) -> str:
    if not path.exists():
        return "-"
    match = re.search(r"^\s+total\s+([\d.]+)", path.read_text(), re.MULTILINE)
    return match.group(1) if match else "-"


def main(out_dir: str) -> None:
    out = Path(out_dir)
    print(f"{'run':<24}{'tok/s':>10}{'MFU %':>8}{'peak GiB':>10}{'plan GiB':>10}{'steps':>7}{'last loss':>11}")
    for metrics in sorted(out.glob("*.metrics.jsonl")):
        name = metrics.name.removesuffix(".metrics.jsonl")
        steps = step_records(metrics)
        timed = steps[2:] or steps
        if not timed:
            print(f"{name:<24}{'no steps':>10}")
            continue
        tokens = statistics.median(r["tokens_per_s"] for r in timed)
        mfu = [r["mfu"] for r in timed if r.get("mfu") is not None]
        peak = max(r.get("max_memory_allocated_bytes", 0) for r in steps) / 2**30
        print(f"{name:<24}{tokens:>10,.0f}{(100 * statistics.median(mfu) if mfu else float('nan')):>8.1f}"
              f"{peak:>10.2f}{planned_gib(out / f'{name}.plan.txt'):>10}{len(steps):>7}{steps[-1]['loss']:>11.4f}")


if __name__ == "__main__":
    main(sys.argv[1])
