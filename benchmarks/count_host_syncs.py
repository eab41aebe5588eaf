"""
Count the host synchronisations a lesson's run makes on CUDA, by the line of this project's code
that makes them (issue 20's hot-path audit; the device check runs it).

    torchrun --standalone --nproc_per_node=1 benchmarks/count_host_syncs.py 07_full_5d.py \
        --preset tiny-moe --seq-len 1024 --steps 6 --dtype bfloat16

The first argument is the lesson's file, the rest its own flags. The run goes under
torch.cuda.set_sync_debug_mode("warn"): every CUDA operation that makes the host wait for the
GPU (.item(), .tolist(), nonzero, a copy to pageable host memory, ...) raises a warning, which
this script counts instead of printing, under the innermost frame of the repository's own code on
the stack (a torch function called by a lesson is charged to the lesson's line). At the end, rank
0 prints the count per line, most first, and the total per optimizer step (--steps; the first
step's one-off reads, and start-up, included). Nothing is counted on a CPU: there is no device to
wait for.
"""

import argparse
import collections
import os
import runpy
import sys
import traceback
import warnings

import torch

from picotron_like import topology

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
counts: collections.Counter = collections.Counter()
show_warning = warnings.showwarning


def count_syncs(message, category, filename, lineno, file=None, line=None):
    if "synchroniz" not in str(message):
        return show_warning(message, category, filename, lineno, file, line)
    ours = [frame for frame in traceback.extract_stack()[:-1]
            if frame.filename.startswith(ROOT) and not frame.filename.endswith("count_host_syncs.py")]
    site = (os.path.relpath(ours[-1].filename, ROOT), ours[-1].lineno, ours[-1].line) if ours else (filename, lineno, "")
    counts[site] += 1


def lesson_steps(argv) -> int:
    """The lesson's --steps, read as the lesson reads it (its default: 20)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--steps", type=int, default=20)
    return parser.parse_known_args(argv)[0].steps


def report_then(shutdown):
    """The lesson ends with topology.shutdown(), which leaves through os._exit: report before it."""
    def report_and_shut_down(*args, **kwargs):
        if os.environ.get("RANK", "0") == "0":
            steps = lesson_steps(sys.argv[1:])
            total = sum(counts.values())
            print(f"\nhost synchronisations: {total} in {steps} steps ({total / steps:.1f} per step), by line:")
            for (path, lineno, code), n in counts.most_common(25):
                print(f"  {n:>7}  {path}:{lineno}  {code}")
        return shutdown(*args, **kwargs)
    return report_and_shut_down


def main():
    script, sys.argv = sys.argv[1], sys.argv[1:]
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("warn")
    warnings.simplefilter("always")
    warnings.showwarning = count_syncs
    topology.shutdown = report_then(topology.shutdown)
    sys.path.insert(0, ROOT)
    runpy.run_path(os.path.join(ROOT, script), run_name="__main__")


if __name__ == "__main__":
    main()
