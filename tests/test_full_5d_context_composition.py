"""Context parallelism with the other axes, through lesson 07's composition: ring attention inside
pipeline stages (1F1B, and interleaved over two chunks per rank), ring and Ulysses attention over a
tensor-parallel rank's heads (Ulysses with sequence parallelism), on masked targets; each equal to
one device, its kept activations and every row of its traffic table equal to their formulas.

These proofs lived in lesson 04's tests while lesson 04 composed tp and pp; lesson 07 is now the
only lesson that composes. They run 07's parallelize() and step (tests/test_full_5d.py's run) on
lesson 04's test model, 8 heads over 4 kv-heads, so that Ulysses over cp = 2 still finds whole
heads on each of tp = 2 ranks. Tolerances are lesson 04's (tests/test_context_parallel.py).
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from picotron_like.data import BatchShape, TokenBatches, builtin_corpus_paths
from picotron_like.lessons import load_lesson
from picotron_like.testing import SEQUENCES_CHECKED, run_ranks, train_reference
from picotron_like.topology import ConfigError, GridShape, ProcessGrid
from test_context_parallel import CFG, GLOBAL_SEQUENCES, LR, MAX_GRAD_NORM, MICRO, ODD_SEQ, SEED, SEQ, STEPS, mask_targets
from test_full_5d import INTERLEAVED, MUON, muon_optimizer, run
from test_full_5d_composition import assert_equal_to_one_device, tp_shard
from test_zero import ADAM_EPS

CFG4 = replace(CFG, n_layers=4)         # pp 2 x 2 virtual stages: one layer per chunk
# name: (grid, ZeRO stage, model, extra flags, sequence length, masked)
LAYOUTS = {
    "pp2 x cp2 1F1B": (GridShape(pp=2, cp=2), 1, CFG, (), SEQ, False),
    "pp2 x cp2 interleaved": (GridShape(pp=2, cp=2), 1, CFG4, INTERLEAVED, SEQ, False),
    # cp = 1 with lesson 04's default zigzag split, an odd sequence, through a pipeline (this crashed
    # on a shape mismatch when the split dropped the last token)
    "dp2 x pp2 odd sequence": (GridShape(dp=2, pp=2), 1, CFG, (), ODD_SEQ, False),
    # Muon (06_zero_muon) in each interleaved pipeline rank's chunks: one optimizer per stage, ZeRO-1
    "pp2 x cp2 interleaved muon": (GridShape(pp=2, cp=2), 1, CFG4, (*INTERLEAVED, *MUON), SEQ, False),
}
# 8 ranks. Clipping acts at every step, so the norm summed over tp shards, with the tp-replicated
# norm gains counted once, is proven by the clipped gradients; the ring layout trains on the masked
# batch (a cp rank holds no valid target in a micro-batch), through the vocab-parallel loss.
EIGHT_RANK_LAYOUTS = {
    "dp2 x cp2 x tp2 ring masked": (GridShape(dp=2, cp=2, tp=2), 0, CFG, (), SEQ, True),
    "dp2 x cp2 x tp2 ulysses SP": (GridShape(dp=2, cp=2, tp=2), 1, CFG,
                                   ("--cp-mode", "ulysses", "--sequence-parallel", "--no-zigzag"), SEQ, False),
    # Muon with each matrix joined over tp (07's TensorParallelMuon), sequence parallel, ZeRO over dp x cp
    "dp2 x cp2 x tp2 ring SP muon": (GridShape(dp=2, cp=2, tp=2), 1, CFG, ("--sequence-parallel", *MUON), SEQ, False),
}
REFERENCES: dict = {}


def optimizer_in(extra) -> str:
    return "muon" if "muon" in extra else "adamw"


def every_layout(layouts: dict, replays: dict | None = None) -> dict:
    """Each layout's run; under Muon stepped with the one-device run's gradients (`replays`, by name)."""
    return {name: run(ProcessGrid(shape), stage, "none", cfg, extra, seq_len, mask_targets if masked else None,
                      (replays or {}).get(name))
            for name, (shape, stage, cfg, extra, seq_len, masked) in layouts.items()}


def reference(cfg, seq_len: int, masked: bool, optimizer: str = "adamw") -> dict:
    key = (cfg, seq_len, masked, optimizer)
    if key not in REFERENCES:
        data = TokenBatches(builtin_corpus_paths()[0], BatchShape(MICRO, seq_len, GLOBAL_SEQUENCES // MICRO, 1),
                            seed=SEED, vocab_size=cfg.vocab_size)
        REFERENCES[key] = train_reference(cfg, SEED, data, STEPS, LR, MAX_GRAD_NORM, adam_eps=ADAM_EPS,
                                          mask_targets=mask_targets if masked else None,
                                          make_optimizer=muon_optimizer if optimizer == "muon" else None)
        assert min(REFERENCES[key]["norms"]) > MAX_GRAD_NORM, "clipping must act, or clipped gradients prove nothing"
    return REFERENCES[key]


def muon_replays(layouts: dict) -> dict:
    """The one-device Muon run's clipped gradients of every step, for each layout under Muon."""
    return {name: reference(cfg, seq_len, masked, "muon")["every_clipped_grads"]
            for name, (_, _, cfg, extra, seq_len, masked) in layouts.items() if optimizer_in(extra) == "muon"}


def check(per_rank: list, layouts: dict) -> None:
    """Each rank's losses, norms, gradients before and after clipping and parameters after 3 AdamW
    (or Muon) steps (its stage's, its tp shard of them) equal one device's; its kept activations and
    every row of the report's traffic table equal their formulas."""
    for rank, runs in enumerate(per_rank):
        for name, (shape, _, cfg, extra, seq_len, masked) in layouts.items():
            result, where = runs[name], f"rank={rank} {name}"
            expected = reference(cfg, seq_len, masked, optimizer_in(extra))
            assert_equal_to_one_device(result, expected, tp_shard(result, shape.tp), where)
            assert result["kept"] == result["predicted_kept"]["none"], f"{where}: {result['kept']} measured"
            table = result["predicted_traffic"]
            assert {key: result["traffic"].get(key, 0) for key in table} == table, where
            assert not set(result["traffic"]) - set(table), where


def test_context_parallel_in_pipeline_stages_equals_one_device():
    check(run_ranks(4, every_layout, LAYOUTS, muon_replays(LAYOUTS), timeout_s=300, checks=SEQUENCES_CHECKED),
          LAYOUTS)


def test_context_parallel_over_tensor_parallel_heads_equals_one_device():
    check(run_ranks(8, every_layout, EIGHT_RANK_LAYOUTS, muon_replays(EIGHT_RANK_LAYOUTS), timeout_s=300,
                    checks=SEQUENCES_CHECKED), EIGHT_RANK_LAYOUTS)


@pytest.mark.parametrize("grid, cfg, extra, message", [
    (GridShape(cp=2, tp=2), replace(CFG, n_heads=4, n_kv_heads=2, hidden=32), ("--cp-mode", "ulysses"),
     "n_kv_heads=2 gives 1 heads per tp rank, not divisible by --cp 2"),
    (GridShape(cp=2, tp=4), CFG, ("--sequence-parallel", "--seq-len", "20", "--no-zigzag"),
     "--seq-len 20 leaves 10 tokens per cp rank, not divisible by --tp 4"),
    (GridShape(cp=4), CFG, ("--seq-len", "36"), "--seq-len 36 is not divisible by 8 (2*cp for the zigzag split)"),
])
def test_composed_context_parallel_rules_refused_in_one_line(grid, cfg, extra, message):
    """The rules context parallelism gains with tp (Ulysses over a tp rank's heads; sequence
    parallelism over a cp rank's tokens), and lesson 04's own, in lesson 07's checks before any
    process group."""
    full_5d = load_lesson("07_full_5d")
    args = full_5d.parse_args(["--tp", str(grid.tp), "--cp", str(grid.cp), "--zero-stage", "1",
                               "--micro-batch-size", "1", "--grad-accum", "1", *extra])
    shape = full_5d.batch_shape(args, grid.dp)
    with pytest.raises(ConfigError, match=re.escape(message)):
        full_5d.validate(cfg, grid, shape, args, grid.world_size)
