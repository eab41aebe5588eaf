"""
The device check's table: for each run of lesson 07 that benchmarks/gpu_check.sh made, its
tokens/s and MFU (medians over the steps after the first two) and its peak allocated and reserved
memory (the largest over its steps), read from the run's --metrics file, next to the plan's
predictions for the same flags: the
allocated peak (its --plan output's "total" less its "allocator's reserve (estimated)"), the
reserved memory (the "total"), and the step-time model's tokens/s per GPU for the run's
own layout ("meas/plan": measured over estimated), and where the check calibrated the GPU
(NAME.calibrated.plan.txt, --plan --device-profile) the same estimate from the measured profile
("meas/calib"). An FP8 run, NAME-fp8-RECIPE-REST, also shows
its tokens/s over its bf16 twin's, NAME-REST ("vs twin"); its MFU, like every run's, is of the
bf16 peak, so the two compare. An offload run, NAME-offload-WHAT, shows its tokens/s over its
twin's without offload, NAME, and a second table sets its every step's loss against the twin's:
the largest relative difference, within the tolerance OFFLOAD_LOSS_RTOL states or not.

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


def planned_gib(path: Path, row: str) -> float | None:
    """A row of the --plan output's memory table ("total", "allocator's reserve (estimated)"), in GiB."""
    if not path.exists():
        return None
    match = re.search(rf"^\s+{re.escape(row)}\s+([\d.]+)$", path.read_text(), re.MULTILINE)
    return float(match.group(1)) if match else None


def gib(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "-"


def planned_tokens_per_s(path: Path) -> float | None:
    """The step-time model's tokens/s per GPU for the run's own layout, from its --plan output."""
    if not path.exists():
        return None
    match = re.search(r"^step time of this layout, estimated: [\d.]+ s, ([\d,]+) tokens/s per GPU", path.read_text(),
                      re.MULTILINE)
    return float(match.group(1).replace(",", "")) if match else None


def twin_of(name: str) -> str | None:
    """The run a variant is compared with: an FP8 run's bf16 twin, its name without "-fp8-RECIPE"
    (and "-all", every linear in FP8: --no-fp8-shape-rule); an offload run's twin without it, its
    name without "-offload-WHAT"."""
    twin = re.sub(r"-fp8-[a-z0-9]+(-all)?|-offload-[a-z]+", "", name)
    return twin if twin != name else None


# How far an offload run's losses may lie from its twin's, relative, at every step. ZeRO-Offload steps
# with the host's fused CPU AdamW where the twin uses the fused CUDA one: the same float32 arithmetic in
# another order, whose last-bit differences flip a few bf16 roundings of the weights each step (the CPU
# proofs, one implementation on both sides, are bit-equal). Activation offload copies the kept tensors
# exactly; only the GPU's own nondeterministic kernels (attention's backward) move its losses.
OFFLOAD_LOSS_RTOL = {"optimizer": 5e-3, "activations": 1e-3}


def offload_losses(runs: dict[str, list[dict]]) -> list[str]:
    """One line per offload run: every step's loss against its twin's, the worst relative gap, and
    whether it is within OFFLOAD_LOSS_RTOL."""
    lines = []
    for name, steps in runs.items():
        match, twin = re.search(r"-offload-([a-z]+)$", name), twin_of(name)
        if match is None or not steps or not runs.get(twin):
            continue
        pairs = list(zip(steps, runs[twin]))
        worst = max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in pairs)
        rtol = OFFLOAD_LOSS_RTOL[match.group(1)]
        verdict = "pass" if worst <= rtol and len(steps) == len(runs[twin]) else "FAIL"
        lines.append(f"{name:<34}{twin:<22}{len(pairs):>6}{worst:>14.2e}{rtol:>10.0e}  {verdict}")
    return lines


def main(out_dir: str) -> None:
    out = Path(out_dir)
    runs = {metrics.name.removesuffix(".metrics.jsonl"): step_records(metrics)
            for metrics in sorted(out.glob("*.metrics.jsonl"))}
    tokens = {name: statistics.median(r["tokens_per_s"] for r in (steps[2:] or steps))
              for name, steps in runs.items() if steps}
    print(f"{'run':<28}{'tok/s':>10}{'vs twin':>9}{'MFU %':>8}{'peak GiB':>10}{'plan GiB':>10}{'res. GiB':>10}"
          f"{'plan GiB':>10}{'steps':>7}{'last loss':>11}{'plan tok/s':>12}{'meas/plan':>10}{'meas/calib':>11}")
    for name, steps in runs.items():
        if not steps:
            print(f"{name:<28}{'no steps':>10}")
            continue
        mfu = [r["mfu"] for r in (steps[2:] or steps) if r.get("mfu") is not None]
        peak = max(r.get("max_memory_allocated_bytes", 0) for r in steps) / 2**30
        reserved = max((r["max_memory_reserved_bytes"] for r in steps if "max_memory_reserved_bytes" in r),
                       default=None)
        # the plan's total is the reserved memory it expects; less its reserve row, the allocated peak
        total = planned_gib(out / f"{name}.plan.txt", "total")
        reserve = planned_gib(out / f"{name}.plan.txt", "allocator's reserve (estimated)") or 0.0
        allocated = total - reserve if total is not None else None
        twin, planned = twin_of(name), planned_tokens_per_s(out / f"{name}.plan.txt")
        calibrated = planned_tokens_per_s(out / f"{name}.calibrated.plan.txt")
        ratio = f"{tokens[name] / tokens[twin]:.2f}x" if twin in tokens else "-"
        print(f"{name:<28}{tokens[name]:>10,.0f}{ratio:>9}"
              f"{(100 * statistics.median(mfu) if mfu else float('nan')):>8.1f}"
              f"{peak:>10.2f}{gib(allocated):>10}{gib(reserved / 2**30 if reserved else None):>10}{gib(total):>10}"
              f"{len(steps):>7}{steps[-1]['loss']:>11.4f}"
              f"{f'{planned:,.0f}' if planned else '-':>12}{f'{tokens[name] / planned:.2f}' if planned else '-':>10}"
              f"{f'{tokens[name] / calibrated:.2f}' if calibrated else '-':>11}")
    offloaded = offload_losses(runs)
    if offloaded:
        print(f"\noffload against its twin, every step's loss:\n{'run':<34}{'twin':<22}{'steps':>6}"
              f"{'worst rel.':>14}{'rtol':>10}")
        print("\n".join(offloaded))


if __name__ == "__main__":
    main(sys.argv[1])
