"""
The device check's table: for each run of lesson 07 that benchmarks/gpu_check.sh made, its
tokens/s, MFU and peak allocated memory (medians over the steps after the first two, read from
the run's --metrics file) next to the plan's predictions for the same flags: the memory (the
"total" line of its --plan output) and the step-time model's tokens/s per GPU for the run's
own layout ("meas/plan": measured over estimated), and where the check calibrated the GPU
(NAME.calibrated.plan.txt, --plan --device-profile) the same estimate from the measured profile
("meas/calib"). An FP8 run, NAME-fp8-RECIPE-REST, also shows
its tokens/s over its bf16 twin's, NAME-REST ("vs bf16"); its MFU, like every run's, is of the
bf16 peak, so the two compare.

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


def planned_tokens_per_s(path: Path) -> float | None:
    """The step-time model's tokens/s per GPU for the run's own layout, from its --plan output."""
    if not path.exists():
        return None
    match = re.search(r"^step time of this layout, estimated: [\d.]+ s, ([\d,]+) tokens/s per GPU", path.read_text(),
                      re.MULTILINE)
    return float(match.group(1).replace(",", "")) if match else None


def bf16_twin(name: str) -> str | None:
    """The bf16 run an FP8 run is compared with: its name without "-fp8-RECIPE" (and "-all", every
    linear in FP8: --no-fp8-shape-rule)."""
    twin = re.sub(r"-fp8-[a-z0-9]+(-all)?", "", name)
    return twin if twin != name else None


def main(out_dir: str) -> None:
    out = Path(out_dir)
    runs = {metrics.name.removesuffix(".metrics.jsonl"): step_records(metrics)
            for metrics in sorted(out.glob("*.metrics.jsonl"))}
    tokens = {name: statistics.median(r["tokens_per_s"] for r in (steps[2:] or steps))
              for name, steps in runs.items() if steps}
    print(f"{'run':<28}{'tok/s':>10}{'vs bf16':>9}{'MFU %':>8}{'peak GiB':>10}{'plan GiB':>10}{'steps':>7}"
          f"{'last loss':>11}{'plan tok/s':>12}{'meas/plan':>10}{'meas/calib':>11}")
    for name, steps in runs.items():
        if not steps:
            print(f"{name:<28}{'no steps':>10}")
            continue
        mfu = [r["mfu"] for r in (steps[2:] or steps) if r.get("mfu") is not None]
        peak = max(r.get("max_memory_allocated_bytes", 0) for r in steps) / 2**30
        twin, planned = bf16_twin(name), planned_tokens_per_s(out / f"{name}.plan.txt")
        calibrated = planned_tokens_per_s(out / f"{name}.calibrated.plan.txt")
        ratio = f"{tokens[name] / tokens[twin]:.2f}x" if twin in tokens else "-"
        print(f"{name:<28}{tokens[name]:>10,.0f}{ratio:>9}"
              f"{(100 * statistics.median(mfu) if mfu else float('nan')):>8.1f}"
              f"{peak:>10.2f}{planned_gib(out / f'{name}.plan.txt'):>10}{len(steps):>7}{steps[-1]['loss']:>11.4f}"
              f"{f'{planned:,.0f}' if planned else '-':>12}{f'{tokens[name] / planned:.2f}' if planned else '-':>10}"
              f"{f'{tokens[name] / calibrated:.2f}' if calibrated else '-':>11}")


if __name__ == "__main__":
    main(sys.argv[1])
