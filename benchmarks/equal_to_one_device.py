"""
Is a multi-GPU run equal to one device? Compares --metrics files step by step with a reference run.

The tests prove every lesson equal to one device on gloo ranks on the CPU. What they cannot show is
NCCL: it will not put two ranks on one GPU, so only a real node shows its collectives summing what
gloo's do. benchmarks/gpu_check.sh's 8-GPU section runs each lesson and some lesson 07 layouts on
the node in float32 (TF32 off), and lesson 07 on one GPU with the same global batch, seed and data,
then hands their --metrics files to this script:

    python benchmarks/equal_to_one_device.py REFERENCE.metrics.jsonl RUN.metrics.jsonl [RUN ...] [--rtol R]

For each run: the steps compared, the largest relative difference of the loss and of the gradient
norm (before clipping) over the steps, and pass or FAIL. Exits non-zero if any run fails.

The tolerance: float32 sums in another order (NCCL's ring or tree, per-rank partial sums, atomics
in some kernels) differ in the last bits, and a few AdamW steps carry that forward; on the CPU the
same comparison agrees to about 1e-6. The default 1e-4 is two orders above that and far below what a
wrong reduction gives (a gradient counted twice or missing one rank's share moves the second step's
loss by 1e-2 or more).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def step_records(path: Path) -> dict[int, dict]:
    """The run's training steps by number (a validation record has no grad_norm)."""
    records = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {record["step"]: record for record in records if "grad_norm" in record}


def relative_difference(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def compare(reference: dict[int, dict], run: dict[int, dict], rtol: float) -> tuple[int, float, float, bool]:
    """(steps compared, largest loss difference, largest norm difference, equal?). A run that
    shares no step with the reference, or is missing one of its steps, is not equal."""
    steps = sorted(set(reference) & set(run))
    loss = max((relative_difference(run[s]["loss"], reference[s]["loss"]) for s in steps), default=float("inf"))
    norm = max((relative_difference(run[s]["grad_norm"], reference[s]["grad_norm"]) for s in steps),
               default=float("inf"))
    return len(steps), loss, norm, bool(steps) and set(reference) <= set(run) and max(loss, norm) <= rtol


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reference", type=Path, help="the one-device run's --metrics file")
    parser.add_argument("runs", type=Path, nargs="+", help="the runs to compare with it")
    parser.add_argument("--rtol", type=float, default=1e-4, help="largest relative difference that passes")
    args = parser.parse_args(argv)
    reference = step_records(args.reference)
    print(f"reference: {args.reference.name} ({len(reference)} steps); rtol {args.rtol:g}")
    print(f"{'run':<40}{'steps':>6}{'loss rel diff':>15}{'norm rel diff':>15}  verdict")
    failed = 0
    for path in args.runs:
        run = step_records(path) if path.exists() else {}
        steps, loss, norm, equal = compare(reference, run, args.rtol)
        failed += not equal
        print(f"{path.name.removesuffix('.metrics.jsonl'):<40}{steps:>6}{loss:>15.2e}{norm:>15.2e}  "
              f"{'pass' if equal else 'FAIL'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
