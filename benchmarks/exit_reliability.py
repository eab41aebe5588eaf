"""
Every successful run must exit 0, every time.

gloo's background thread can abort a process during interpreter teardown ("terminate called
without an active exception", SIGABRT) after a perfectly good run; picotron_like.topology.shutdown
leaves through os._exit to avoid it. This benchmark launches a lesson under torchrun N times in a
row and counts exit codes: the claim holds only if all N are 0.

    python benchmarks/exit_reliability.py                      # 20 runs of lesson 01 on 2 ranks
    python benchmarks/exit_reliability.py --runs 50 --script 02_tensor_parallel.py --nproc 4
"""

import argparse
import collections
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--script", default="01_data_parallel.py")
    parser.add_argument("extra", nargs="*", default=["--steps", "2", "--seq-len", "32"],
                        help="flags passed to the script (default: --steps 2 --seq-len 32)")
    args = parser.parse_args()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               str(ROOT / args.script), *args.extra]
    exit_codes = collections.Counter()
    start = time.monotonic()
    for run in range(args.runs):
        result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
        exit_codes[result.returncode] += 1
        if result.returncode != 0:
            # What the ranks printed (torchrun's own warnings left out) and how far training got.
            rank_lines = [line for line in result.stderr.splitlines() if not line.startswith(("W", "E", "I"))]
            print(f"run {run}: exit {result.returncode}\n--- last stdout lines:\n"
                  + "\n".join(result.stdout.splitlines()[-5:])
                  + "\n--- stderr of the ranks:\n" + "\n".join(rank_lines[:60]), flush=True)
    elapsed = time.monotonic() - start
    print(f"{args.runs} runs of `torchrun --nproc_per_node={args.nproc} {args.script} {' '.join(args.extra)}`: "
          f"exit codes {dict(exit_codes)} in {elapsed:.0f} s")
    sys.exit(0 if set(exit_codes) == {0} else 1)


if __name__ == "__main__":
    main()
