"""Run the layout fuzzer (tests/layout_fuzz.py) on as many draws as asked.

    python tools/fuzz_layouts.py --n 50                 # 50 accepted draws and 10 refused ones
    python tools/fuzz_layouts.py --seed 1234 --n 1      # replay the draw a failure printed

Each accepted draw trains lesson 07 on real gloo ranks and is compared with one device; each
refused draw must stop with one error line before any process group. The first failure stops the
run with its seed and command line. CI runs a fixed set and a few drawn ones (tests/test_layout_fuzzer.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import layout_fuzz  # noqa: E402  (after the paths above)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--n", type=int, default=10, help="accepted draws to train and compare with one device")
    parser.add_argument("--refused", type=int, default=None, help="refused draws to launch (default: n / 5, at least 1)")
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100_000, help="the first draw's seed")
    parser.add_argument("--batch", type=int, default=6, help="accepted draws checked per spawn of ranks")
    args = parser.parse_args(argv)
    n_refused = args.refused if args.refused is not None else max(1, args.n // 5)
    accepted, refused = layout_fuzz.draws(args.seed, args.n, n_refused)
    print(f"seed {args.seed}: {len(accepted)} accepted and {len(refused)} refused draws", flush=True)
    start = time.perf_counter()
    for layout, error in refused:
        layout_fuzz.check_refused(layout, error)
        print(f"refused cleanly  {layout}", flush=True)
    for first in range(0, len(accepted), args.batch):
        batch = accepted[first: first + args.batch]
        layout_fuzz.check_accepted(batch)
        for layout in batch:
            print(f"equal to 1 device  {layout}", flush=True)
    print(f"all {len(accepted) + len(refused)} draws passed in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
