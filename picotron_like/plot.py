"""
A loss-curve picture from the JSON lines that ``--metrics FILE`` writes, one curve per file:

    python -m picotron_like.plot run_a.jsonl run_b.jsonl -o loss.png

The training loss of every step is a line, the validation loss (``--val-every``) a marker of the
same colour, each file named in the legend by its file name: two runs side by side (a
distributed one and a one-device one, bf16 and float32) are one command.

matplotlib is an optional extra (``pip install -e ".[plot]"``): nothing else in the package
imports it, so the lessons and their tests run without it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
from pathlib import Path

INSTALL_HINT = 'pip install -e ".[plot]"'


def read_metrics(path) -> list[dict]:
    """The records of one metrics file, one per step, in step order (a JSON null, a non-finite
    value, reads as NaN). A resumed run appends the steps after its checkpoint once more: a step's
    last record is the one kept. A line that is no step's record (half a line, from a run killed
    while writing it) is skipped with a note; a file with no record at all raises ValueError."""
    by_step = {}
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not (isinstance(record, dict) and "step" in record and "loss" in record):
            print(f"note: {path}: line {number} is not a step's record (a run killed while writing it?); skipped",
                  file=sys.stderr)
            continue
        by_step[record["step"]] = {key: math.nan if value is None else value for key, value in record.items()}
    if not by_step:
        raise ValueError(f"{path}: no step's record in it: not a file that --metrics wrote")
    return [by_step[step] for step in sorted(by_step)]


def plot_losses(paths, output) -> None:
    """Draw every file's training (line) and validation (markers) losses against the step into `output`."""
    import matplotlib
    matplotlib.use("Agg")       # a file, not a window: works on a headless node
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axes = plt.subplots(figsize=(8, 5))
    for path in paths:
        records = read_metrics(path)
        line, = axes.plot([r["step"] for r in records], [r["loss"] for r in records], label=f"{Path(path).name} train")
        validated = [r for r in records if "val_loss" in r]
        if validated:
            axes.plot([r["step"] for r in validated], [r["val_loss"] for r in validated], "o--", color=line.get_color(),
                      label=f"{Path(path).name} val")
    axes.set_xlabel("step")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_ylabel("loss (mean over target tokens)")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(output, dpi=120)
    plt.close(figure)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m picotron_like.plot",
                                     description="Loss curves from --metrics files (needs matplotlib).")
    parser.add_argument("metrics", nargs="+", help="metrics files (JSON lines) written with --metrics")
    parser.add_argument("-o", "--output", default="loss.png", help="the picture to write (.png, .svg, .pdf)")
    args = parser.parse_args(argv)
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        print(f"error: the loss plot needs matplotlib, an optional extra: {INSTALL_HINT}", file=sys.stderr)
        sys.exit(2)
    missing = [path for path in args.metrics if not Path(path).is_file()]
    if missing:
        print(f"error: no metrics file {', '.join(missing)}: write one with --metrics FILE", file=sys.stderr)
        sys.exit(2)
    try:
        plot_losses(args.metrics, args.output)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
