"""
The step-time model against this machine: a calibrated profile's estimates next to measured step times.

    python benchmarks/step_time_vs_cpu.py [--repeats 5] [--steps 10] [--out step_time_vs_cpu.json]
    python benchmarks/step_time_vs_cpu.py --measured step_time_vs_cpu.json     # estimates again, no run

1. Calibrates this machine on 4 ranks and on 2 (torchrun ... 07_full_5d.py --calibrate FILE), so
   that each world size is priced as its ranks share the cores.
2. Runs each layout of LAYOUTS (lesson 07 on 2 and 4 CPU ranks: dp at ZeRO stages 0, 1, 3, tp,
   pp, cp, ep with tiny-moe) `--repeats` times as `torchrun ... 07_full_5d.py <layout> --steps N
   --metrics FILE`, the runs of all layouts interleaved round by round so that the machine's load
   falls on all alike. A run's step time is the median of its steps after the first `--skip` (the
   first steps pay warm-up); a layout's, the median over its runs.
3. Prices each layout with lesson 07's plan (07_memory_plan.slowest_stage_seconds, the same
   estimate --plan --device-profile prints) from the profile of its world size.
4. Prints estimate / measured per layout, how many are within 30%, and the Spearman rank
   correlation of estimated against measured order; writes all of it, the profiles' key figures
   and the machine's load to --out (a JSON file), which --measured reads back to price again.

The figures depend on the machine and its load: run it alone (uptime's load under ~1.5).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from picotron_like.calibrate import commit
from picotron_like.device_profile import load_profile
from picotron_like.lessons import REPO_ROOT, load_lesson

full_5d = load_lesson("07_full_5d")
memory_plan = full_5d.memory_plan

# (name, ranks, flags): the default tiny model (steps of about 0.1-1 s on 2 cores), float32.
LAYOUTS = [
    ("dp2 ZeRO-0", 2, ["--dp", "2", "--zero-stage", "0"]),
    ("tp2", 2, ["--tp", "2", "--zero-stage", "0"]),
    ("pp2", 2, ["--pp", "2"]),
    ("cp2", 2, ["--cp", "2", "--zero-stage", "1"]),
    ("dp4 ZeRO-1", 4, ["--dp", "4", "--zero-stage", "1"]),
    ("dp4 ZeRO-3", 4, ["--dp", "4", "--zero-stage", "3"]),
    ("dp2 tp2", 4, ["--dp", "2", "--tp", "2", "--zero-stage", "1"]),
    ("dp2 pp2", 4, ["--dp", "2", "--pp", "2"]),
    ("dp2 cp2", 4, ["--dp", "2", "--cp", "2", "--zero-stage", "3"]),
    ("tp2 pp2", 4, ["--tp", "2", "--pp", "2"]),
    ("pp4", 4, ["--pp", "4", "--grad-accum", "4"]),
    ("tiny-moe dp4 ep4", 4, ["--preset", "tiny-moe", "--dp", "4", "--ep", "4", "--zero-stage", "1"]),
]
WITHIN = 0.30


def torchrun(ranks: int, *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               str(REPO_ROOT / "07_full_5d.py"), *flags]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", PICOTRON_LIKE_DEVICE="cpu"))
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return done


def load() -> float:
    return os.getloadavg()[0]


def run_seconds(metrics: Path, skip: int) -> float:
    """A run's step time: the median of its steps after the first `skip` (read as --autotune reads them)."""
    records = full_5d.autotune.read_metrics(metrics)
    return statistics.median(record["seconds"] for record in records if record["step"] >= skip)


def measure(args, workdir: Path) -> dict:
    """Calibrate on 2 and 4 ranks, then run every layout `args.repeats` times, round by round."""
    for _, ranks, flags in LAYOUTS:     # lesson 07's rules first: a layout it refuses is one line, now
        memory_plan.checked_plan_flags(full_5d.parse_args([*flags, "--gpus", str(ranks)]), full_5d.validate,
                                       full_5d.expert_degree)
    profiles, loads = {}, {"start": load()}
    for ranks in sorted({ranks for _, ranks, _ in LAYOUTS}):
        path = workdir / f"cpu{ranks}.json"
        torchrun(ranks, "--calibrate", str(path))
        profiles[ranks] = str(path)
        print(f"calibrated {ranks} ranks: {path} (load {load():.2f})", flush=True)
    runs = {name: [] for name, _, _ in LAYOUTS}
    for repeat in range(args.repeats):
        for name, ranks, flags in LAYOUTS:
            metrics = workdir / f"{name.replace(' ', '_')}.{repeat}.jsonl"
            torchrun(ranks, *flags, "--steps", str(args.steps), "--metrics", str(metrics))
            runs[name].append(run_seconds(metrics, args.skip))
        print(f"round {repeat + 1} of {args.repeats} done (load {load():.2f})", flush=True)
    loads["end"] = load()
    return {"commit": commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "loads": loads,
            "steps": args.steps, "skip": args.skip, "repeats": args.repeats,
            "profiles": {ranks: json.loads(Path(path).read_text()) for ranks, path in profiles.items()},
            "runs": runs}


def estimated_parts(flags: list[str], ranks: int, profile) -> dict:
    """The plan's step time for a layout by part: 07's flags as --plan reads them, on `ranks` CPU ranks."""
    args = full_5d.parse_args([*flags, "--gpus", str(ranks)])
    cfg, grid, ep, shape = memory_plan.checked_plan_flags(args, full_5d.validate, full_5d.expert_degree)
    precision = full_5d.zero.precision_from_flags(args.dtype, args.reduce_dtype, torch.device("cpu"))
    return memory_plan.slowest_stage_seconds(cfg, args, grid, ep, shape, precision, profile)


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation: Pearson's of the ranks (tied values share their mean rank)."""
    def ranks(values):
        ordered = sorted(values)
        return [statistics.mean(i for i, other in enumerate(ordered) if other == value) for value in values]
    return statistics.correlation(ranks(xs), ranks(ys))


def report(measured: dict) -> dict:
    """Each layout's measured and estimated step time, their ratio, and the summary figures."""
    profiles = {}
    with tempfile.TemporaryDirectory() as folder:
        for ranks, raw in measured["profiles"].items():
            path = Path(folder) / f"cpu{ranks}.json"
            path.write_text(json.dumps(raw))
            profiles[int(ranks)] = load_profile(str(path))
    rows = []
    for name, ranks, flags in LAYOUTS:
        seconds = statistics.median(measured["runs"][name])
        parts = estimated_parts(flags, ranks, profiles[ranks])
        estimate = sum(parts.values())
        rows.append({"layout": name, "ranks": ranks, "flags": " ".join(flags), "measured_s": seconds,
                     "runs_s": measured["runs"][name], "estimated_s": estimate, "ratio": estimate / seconds,
                     "parts": {part: value for part, value in parts.items() if value}})
    within = sum(abs(row["ratio"] - 1) <= WITHIN for row in rows)
    rho = spearman([row["estimated_s"] for row in rows], [row["measured_s"] for row in rows])
    return {"rows": rows, "within": within, "spearman": rho,
            "span": max(row["measured_s"] for row in rows) / min(row["measured_s"] for row in rows)}


def print_report(measured: dict, result: dict) -> None:
    print(f"commit {measured['commit']}, {measured['date']}, load {measured['loads']['start']:.2f} at the start and "
          f"{measured['loads']['end']:.2f} at the end; steps {measured['steps']}, the first {measured['skip']} "
          f"skipped, median of {measured['repeats']} runs; estimates at commit {commit()}")
    for ranks, raw in sorted(measured["profiles"].items()):
        intra = raw["links"]["intra"]
        print(f"profile {raw['name']}: peak float32 {raw['peak_flops']['float32'] / 1e9:.1f} GFLOP/s per rank, "
              f"memory {raw['memory_bandwidth'] / 1e9:.1f} GB/s, per-op {raw['kernel_overhead_s'] * 1e6:.1f} us, "
              f"overlap {raw['overlap']:.2f}, all_reduce {intra['all_reduce'][0] * 1e6:.0f} us + "
              f"bytes / {intra['all_reduce'][1] / 1e9:.2f} GB/s")
    print("| layout | ranks | flags | measured s (runs) | estimated s | estimate / measured | the estimate's parts |")
    print("|---|---|---|---|---|---|---|")
    for row in result["rows"]:
        runs = ", ".join(f"{seconds:.3f}" for seconds in row["runs_s"])
        print(f"| {row['layout']} | {row['ranks']} | `{row['flags']}` | {row['measured_s']:.3f} ({runs}) | "
              f"{row['estimated_s']:.3f} | {row['ratio']:.2f} | "
              + ", ".join(f"{part} {value:.3f}" for part, value in row["parts"].items()) + " |")
    print(f"within {WITHIN:.0%}: {result['within']} of {len(result['rows'])}; Spearman rank correlation "
          f"{result['spearman']:.2f}; measured step times span {result['span']:.1f}x")


def main() -> None:
    class Formatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
        pass

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=Formatter)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each layout")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    parser.add_argument("--skip", type=int, default=3, help="first steps of a run left out of its time")
    parser.add_argument("--out", default="step_time_vs_cpu.json", help="the measurements and the comparison")
    parser.add_argument("--measured", default=None, help="a previous --out: price its measurements again, no run")
    args = parser.parse_args()
    if args.measured:
        measured = json.loads(Path(args.measured).read_text())["measured"]
    else:
        with tempfile.TemporaryDirectory() as workdir:
            measured = measure(args, Path(workdir))
    result = report(measured)
    print_report(measured, result)
    if not args.measured:
        Path(args.out).write_text(json.dumps({"measured": measured, "result": result}, indent=1) + "\n")


if __name__ == "__main__":
    main()
