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
    """The records of one metrics file, in step order (a JSON null, a non-finite value, reads as NaN)."""
    records = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    for record in records:
        for key, value in record.items():
            if value is None:
                record[key] = math.nan
    return sorted(records, key=lambda record: record["step"])


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
    plot_losses(args.metrics, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
