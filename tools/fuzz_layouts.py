"""Run the layout fuzzer (tests/layout_fuzz.py) on as many draws as asked.

    python tools/fuzz_layouts.py --n 50                 # 50 accepted draws and 10 refused ones
    python tools/fuzz_layouts.py --seed 1234 --n 1      # replay the draw a failure printed
    python tools/fuzz_layouts.py --n 6 --detail         # torch's TORCH_DISTRIBUTED_DEBUG=DETAIL too

Each accepted draw trains lesson 07 on real gloo ranks and is compared with one device; each
refused draw must stop with one error line before any process group. Every accepted draw's
collectives are checked too: every member of every group issued the same sequence (what NCCL needs
and does not check). --detail adds torch's own check of each collective's op type and shapes
(picotron_like.testing.collective_sequences_checked says what it adds and costs). The first
failure stops the run with its seed and command line. CI runs a fixed set and a few drawn ones (tests/test_layout_fuzzer.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import layout_fuzz  # noqa: E402  (after the paths above)
from picotron_like.testing import RankChecks  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--n", type=int, default=10, help="accepted draws to train and compare with one device")
    parser.add_argument("--refused", type=int, default=None, help="refused draws to launch (default: n / 5, at least 1)")
    parser.add_argument("--seed", type=int, default=int(time.time()) % 100_000, help="the first draw's seed")
    parser.add_argument("--batch", type=int, default=6, help="accepted draws checked per spawn of ranks")
    parser.add_argument("--detail", action="store_true",
                        help="run the ranks under TORCH_DISTRIBUTED_DEBUG=DETAIL: torch compares each collective's "
                             "op type, dtypes and shapes across its group before running it (slower)")
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
        # DETAIL compares each group's call numbers too, and gloo numbers point-to-point transfers:
        # a middle pipeline stage posts more of them than the ends, so a correct pipeline of 3 or
        # more stages fails its next collective there. Those draws run without DETAIL.
        with_detail = [layout for layout in batch if args.detail and _pipeline_stages(layout) < 3]
        layout_fuzz.check_accepted(with_detail, checks=RankChecks(distributed_debug_detail=True))
        layout_fuzz.check_accepted([layout for layout in batch if layout not in with_detail])
        for layout in batch:
            print(f"equal to 1 device{' (DETAIL)' if layout in with_detail else ''}  {layout}", flush=True)
    print(f"all {len(accepted) + len(refused)} draws passed in {time.perf_counter() - start:.0f} s")


def _pipeline_stages(layout) -> int:
    return int(layout.argv[layout.argv.index("--pp") + 1])


if __name__ == "__main__":
    main()
