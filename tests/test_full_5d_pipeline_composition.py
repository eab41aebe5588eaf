"""Pipeline parallelism with tensor parallelism, through lesson 07's composition: dp x pp x tp on 8
ranks, each pipeline stage's layers split over tp, with and without sequence parallelism (then the
boundary between stages carries S/tp tokens, and the masked batch goes through lesson 02's
vocabulary-parallel loss); each equal to one device, its kept activations and every row of its
traffic table equal to their formulas.

These proofs lived in lesson 03's tests while lesson 03 composed tp; lesson 07 is now the only
lesson that composes. Three layers over two stages (2 + 1) keep the split uneven. Clipping acts at
every step (asserted), so the gradient norm summed over stages and tp shards, with the
tp-replicated norm gains counted once, is proven by the clipped gradients. The runs, the reference
and the tolerances are those of tests/test_full_5d_context_composition.py (lesson 04's model).
"""

from __future__ import annotations

from dataclasses import replace

from picotron_like.testing import SEQUENCES_CHECKED, run_ranks
from picotron_like.topology import GridShape
from test_context_parallel import CFG, SEQ
from test_full_5d_context_composition import check, every_layout

CFG3 = replace(CFG, n_layers=3)
# name: (grid, ZeRO stage, model, extra flags, sequence length, masked)
LAYOUTS = {
    "dp2 x pp2 x tp2 ZeRO-0": (GridShape(dp=2, pp=2, tp=2), 0, CFG3, (), SEQ, False),
    "dp2 x pp2 x tp2 SP masked ZeRO-1": (GridShape(dp=2, pp=2, tp=2), 1, CFG3, ("--sequence-parallel",), SEQ, True),
}


def test_tensor_parallel_pipeline_stages_equal_one_device():
    check(run_ranks(8, every_layout, LAYOUTS, timeout_s=300, checks=SEQUENCES_CHECKED), LAYOUTS)
