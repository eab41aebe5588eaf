"""Lesson 04 proven equal: ring and Ulysses attention, and whole training runs, against one device.

Attention. Every rank draws the same full-sequence q, k, v and output gradient, runs its shard
through ring or Ulysses attention, and compares output and dQ/dK/dV with the slice of
F.scaled_dot_product_attention(is_causal=True) on the full sequence with repeated K/V. Ulysses runs
that very kernel on whole heads, so it matches to the bit. The ring runs twice, its blocks in the
plain block functions and in the fused flash kernel (the default), and computes the same softmax in
another order: per block, then merged through exp(lse differences). On values of order 1 (randn
inputs) that moves float32 results by a few ulp per block merged; with up to 8 blocks per row
errors stay near 1e-6. 1e-5 absolute is ten times that and still far below any real bug: a
missing block, a wrong mask or a K/V block from the wrong rank changes outputs by 0.1 or more.

Training. As in lesson 01's tests: gradients after one accumulation cycle, before and after
clipping, to 1e-6 absolute (float32 sums in another order: per-rank token sums, then a sum over
dp x cp; the ring's reordered softmax adds a few ulp more), losses and gradient norms to 1e-5,
parameters after AdamW to 1e-2 * lr, because Adam's normalised step turns the rounding noise of a
~0 gradient into a step of that order; a real error moves a parameter by order lr.

Context parallelism with tensor and pipeline parallelism (Ulysses over a tp rank's heads, with
sequence parallelism, inside pipeline stages) is lesson 07's composition, proven there
(tests/test_full_5d_context_composition.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from picotron_like import comm
from picotron_like.data import BatchShape, StepBatch, TokenBatches, builtin_corpus_paths
from picotron_like.lessons import REPO_ROOT, load_lesson
from picotron_like.loss import IGNORE_INDEX
from picotron_like.metrics import ActivationMeter, data_parallel_traffic, predicted_activation_bytes, step_traffic
from picotron_like.model import get_config
from picotron_like.testing import ignore_targets, masked_step_batch, run_ranks, train_reference
from picotron_like.topology import ConfigError, GridShape, ProcessGrid
from picotron_like.train import StepSettings, build_optimizer

lesson = load_lesson("04_context_parallel")
data_parallel = load_lesson("01_data_parallel")

# 8 heads over 4 kv-heads: grouped-query attention, and both counts divisible by cp = 4 for Ulysses.
CFG = replace(get_config("tiny"), n_layers=2, hidden=64, n_heads=8, n_kv_heads=4, ffn_hidden=128)
SEQ, MICRO, GLOBAL_SEQUENCES, STEPS, LR, SEED = 32, 2, 8, 3, 3e-3, 7
ODD_SEQ = 33                # cp = 1 must train on every token of an odd-length sequence
CP3_SEQ = 48                # cp = 3: 6 zigzag chunks of 8 tokens
MAX_GRAD_NORM = 1.0         # under every step's reference norm (asserted): clipping acts on every step
TOLERANCE = dict(rtol=0, atol=1e-6)
PARAM_TOLERANCE = dict(rtol=0, atol=1e-2 * LR)
ATTENTION_TOLERANCE = 1e-5
CPU = torch.device("cpu")
# The attention test's shapes, as a config so the lesson's formulas apply to them.
ATTN = replace(get_config("tiny"), n_layers=1, hidden=8 * 16, n_heads=8, n_kv_heads=4)
ATTN_BATCH, ATTN_SEQ = 2, 32

ATTENTION_VARIANTS = [(mode, zigzag) for mode in ("ring", "ulysses") for zigzag in (False, True)]
ATTENTION_GRIDS = [GridShape(cp=4), GridShape(dp=2, cp=2)]


def mask_targets(step: int, targets: torch.Tensor) -> torch.Tensor:
    """The masked global batch (8 sequences; with dp = 2, dp rank 0 holds rows 0-3 as two
    micro-batches of two, dp rank 1 rows 4-7): a prompt of a different length in every row
    (testing.ignore_targets), dp rank 1's second micro-batch all padding, and in dp rank 0's first
    micro-batch every target of cp rank 1's half of each sequence (zigzag, cp = 2) ignored, so that
    cp rank holds no valid target at all there: a mean over its own tokens would be NaN."""
    ignore_targets(step, targets, ignored_rows=(6, 7))
    targets[0:2, lesson.SequenceSplit(2, zigzag=True).positions(1, targets.shape[1])] = IGNORE_INDEX
    return targets


# ----------------------------------------------------------------------------- the split, on one process


def test_zigzag_split_holds_chunks_i_and_2cp_minus_1_minus_i():
    split = lesson.SequenceSplit(cp=4, zigzag=True)
    assert split.positions(0, 16).tolist() == [0, 1, 14, 15]
    assert split.positions(3, 16).tolist() == [6, 7, 8, 9]
    assert split.rank_order() == [0, 7, 1, 6, 2, 5, 3, 4]
    contiguous = lesson.SequenceSplit(cp=4, zigzag=False)
    assert contiguous.positions(2, 16).tolist() == [8, 9, 10, 11]
    tokens = torch.arange(32).view(2, 16)
    assert split.shard(tokens, 1).tolist() == [[2, 3, 12, 13], [18, 19, 28, 29]]
    # Every token on exactly one rank.
    for s in (split, contiguous):
        assert sorted(torch.cat([s.positions(r, 16) for r in range(4)]).tolist()) == list(range(16))


def test_cp_1_keeps_every_token_of_an_odd_sequence():
    """At cp = 1 the zigzag split has nothing to balance: the one rank holds the whole sequence
    (cut in two chunks, an odd sequence would lose its last token)."""
    inputs = torch.arange(2 * ODD_SEQ).view(2, ODD_SEQ)
    for zigzag in (True, False):
        split = lesson.SequenceSplit(cp=1, zigzag=zigzag)
        assert split.positions(0, ODD_SEQ).tolist() == list(range(ODD_SEQ))
        cut = lesson.context_parallel_batch(StepBatch([(inputs, inputs + 1)], 2 * ODD_SEQ), split, cp_rank=0)
        (mine, targets, positions), = cut.micro_batches
        assert torch.equal(mine, inputs) and torch.equal(targets, inputs + 1)
        assert positions.tolist() == list(range(ODD_SEQ)) and cut.n_targets == 2 * ODD_SEQ


@pytest.mark.parametrize("grid, cfg, seq_len, zigzag, mode, message", [
    (GridShape(cp=4), CFG, 36, True, "ring", "--seq-len 36 is not divisible by 8 (2*cp for the zigzag split)"),
    (GridShape(cp=3), CFG, 32, False, "ring", "--seq-len 32 is not divisible by 3"),
    (GridShape(cp=4), get_config("tiny"), 64, True, "ulysses", "n_kv_heads=2 is not divisible by --cp 4"),
])
def test_bad_configurations_name_value_rule_and_fix(grid, cfg, seq_len, zigzag, mode, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        lesson.validate_context_parallel(grid, grid.world_size, cfg, seq_len, zigzag, mode)
    # The ring has no rule on heads.
    if mode == "ulysses":
        lesson.validate_context_parallel(grid, grid.world_size, cfg, seq_len, zigzag, "ring")


def test_bad_configuration_stops_the_script_before_any_collective():
    """One line on stderr, exit code 2, no process group: validation reads only flags and WORLD_SIZE,
    so one process with torchrun's variables set stands for every rank (and cannot hang). --tp and
    --pp are lesson 07's composition: refused with a pointer there."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="4", RANK="0")
    for flags, message in ((["--cp", "4", "--cp-mode", "ulysses", "--seq-len", "60"],
                            "--seq-len 60 is not divisible by 8"),
                           (["--cp", "2", "--tp", "2"], "lesson 07"), (["--cp", "2", "--pp", "2"], "lesson 07")):
        result = subprocess.run([sys.executable, str(REPO_ROOT / "04_context_parallel.py"), *flags],
                                capture_output=True, text=True, timeout=120, env=env, cwd=REPO_ROOT)
        assert result.returncode == 2, result.stdout + result.stderr
        assert result.stderr.count("error: ") == 1 and message in result.stderr, result.stderr


# ----------------------------------------------------------------------------- attention on real ranks


def check_attention():
    """Every grid x variant: errors against SDPA, attention work, and the cp traffic of one call."""
    results = {}
    for shape in ATTENTION_GRIDS:
        grid = ProcessGrid(shape)
        for mode, zigzag in ATTENTION_VARIANTS:
            generator = torch.Generator().manual_seed(1)
            b, s, d = ATTN_BATCH, ATTN_SEQ, ATTN.head_dim
            q, d_out = (torch.randn(b, ATTN.n_heads, s, d, generator=generator) for _ in range(2))
            k, v = (torch.randn(b, ATTN.n_kv_heads, s, d, generator=generator) for _ in range(2))

            full = [t.clone().requires_grad_() for t in (q, k, v)]
            group = ATTN.n_heads // ATTN.n_kv_heads
            reference = F.scaled_dot_product_attention(full[0], full[1].repeat_interleave(group, 1),
                                                       full[2].repeat_interleave(group, 1), is_causal=True)
            reference.backward(d_out)

            cp = lesson.ContextParallel.from_grid(grid, zigzag)
            mine = cp.split.positions(cp.rank, s)
            local = [t.index_select(2, mine).clone().requires_grad_() for t in (q, k, v)]
            if mode == "ring":
                # The ring below computes its blocks with the fused kernel (the default); first the
                # plain block functions, the reference the fused kernel is proven against.
                plain = [t.clone().detach().requires_grad_() for t in local]
                plain_out = lesson.ring_attention(*plain, replace(cp, ring_kernel="plain"))
                plain_out.backward(d_out.index_select(2, mine))
                plain_errors = {"out": (plain_out - reference.index_select(2, mine)).abs().max().item()}
                for name, ours, theirs in zip(("dq", "dk", "dv"), plain, full):
                    plain_errors[name] = (ours.grad - theirs.grad.index_select(2, mine)).abs().max().item()
            comm.meter.reset()
            with lesson.AttentionWork() as work:
                out = lesson.CP_MODES[mode](*local, cp)
                out.backward(d_out.index_select(2, mine))
            errors = {"out": (out - reference.index_select(2, mine)).abs().max().item()}
            for name, ours, theirs in zip(("dq", "dk", "dv"), local, full):
                errors[name] = (ours.grad - theirs.grad.index_select(2, mine)).abs().max().item()
            results[(shape.cp, mode, zigzag)] = {
                "errors": errors, "work": work.scores, "cp_rank": cp.rank,
                # copies: the meter counts on in the same entries until its next reset
                "traffic": {key: replace(value) for key, value in comm.meter.traffic.items()}}
            if mode == "ring":
                results[(shape.cp, mode, zigzag)].update(kernel=cp.ring_kernel, plain_errors=plain_errors)
    return results


@pytest.fixture(scope="module")
def attention_results():
    return run_ranks(4, check_attention, timeout_s=150)


def test_ring_and_ulysses_attention_equal_sdpa(attention_results):
    for rank, results in enumerate(attention_results):
        for (cp, mode, zigzag), result in results.items():
            for name, error in result["errors"].items():
                assert error < ATTENTION_TOLERANCE, f"rank {rank} cp={cp} {mode} zigzag={zigzag} {name}: {error}"
            if mode == "ulysses":
                assert max(result["errors"].values()) == 0.0, "Ulysses runs the reference kernel itself"


def test_ring_equals_sdpa_with_fused_and_with_plain_blocks(attention_results):
    """The default ring (fused kernel per block) is checked above; the plain block functions give
    the same ring to the same tolerance."""
    for rank, results in enumerate(attention_results):
        for (cp, mode, zigzag), result in results.items():
            if mode == "ring":
                assert result["kernel"] == "fused"
                for name, error in result["plain_errors"].items():
                    assert error < ATTENTION_TOLERANCE, f"rank {rank} cp={cp} plain zigzag={zigzag} {name}: {error}"


def test_zigzag_balances_attention_work_where_contiguous_does_not(attention_results):
    for cp in (4, 2):
        for mode, zigzag in ATTENTION_VARIANTS:
            work = [results[(cp, mode, zigzag)]["work"] for results in attention_results]
            ranks = [results[(cp, mode, zigzag)]["cp_rank"] for results in attention_results]
            predicted = [lesson.predicted_attention_work(ATTN, ATTN_BATCH, ATTN_SEQ, cp, zigzag, r, 1, mode)
                         for r in ranks]
            assert work == predicted, (cp, mode, zigzag)
            imbalance = max(work) / min(work)
            if mode == "ring" and not zigzag:
                assert imbalance == cp, f"contiguous: the last rank does cp = {cp} times the first's work"
            else:
                assert imbalance == 1.0, (cp, mode, zigzag, work)


def test_cp_traffic_equals_the_formula(attention_results):
    for results in attention_results:
        for (cp, mode, zigzag), result in results.items():
            predicted = lesson.predicted_cp_traffic(ATTN, ATTN_BATCH, ATTN_SEQ, cp, mode, n_micro=1)
            measured = {key: traffic.payload_bytes for key, traffic in result["traffic"].items()}
            assert measured == predicted, (cp, mode, zigzag)
            if mode == "ring":
                # cp-1 K/V blocks forward, cp-1 again and cp dK/dV blocks backward, one message each.
                assert result["traffic"][("isend", "cp")].calls == 3 * cp - 2


# ----------------------------------------------------------------------------- training on real ranks


@dataclass(frozen=True)
class Variant:
    shape: GridShape
    mode: str
    zigzag: bool
    seq_len: int = SEQ
    masked: bool = False      # train on the global batch mask_targets masks


def batches(dp: int, seq_len: int = SEQ) -> TokenBatches:
    shape = BatchShape(MICRO, seq_len, GLOBAL_SEQUENCES // (MICRO * dp), dp)
    return TokenBatches(builtin_corpus_paths()[0], shape, seed=SEED, vocab_size=CFG.vocab_size)


def gradients(module) -> dict:
    return {name: p.grad.clone() for name, p in module.named_parameters()}


def observe_gradients(model, optimizer) -> dict:
    """Snapshot step 0's gradients from outside train_step: once summed over dp x cp (before
    clipping), by wrapping the wrapper's finish_gradient_synchronization, and as the optimizer
    steps (after clipping), by a step pre-hook."""
    seen = {}
    finish = model.finish_gradient_synchronization

    def finish_then_snapshot():
        finish()
        seen.setdefault("before", gradients(model.module))

    def snapshot_before_step(*_):       # a step pre-hook must return None
        seen.setdefault("after", gradients(model.module))

    model.finish_gradient_synchronization = finish_then_snapshot
    optimizer.register_step_pre_hook(snapshot_before_step)
    return seen


def context_parallel_run(variant: Variant):
    """On every rank, with the lesson's own builder and step: step-0 gradients before and after
    clipping, per-step losses and norms, the activations of step 0 and their prediction, the traffic
    and the devices of every collective during training, the predicted traffic, final parameters."""
    grid = ProcessGrid(variant.shape)
    cp = lesson.ContextParallel.from_grid(grid, variant.zigzag)
    model = lesson.build_model(CFG, SEED, grid, cp, variant.mode, CPU, bucket_bytes=64 * 1024)
    data = batches(variant.shape.dp, variant.seq_len)
    optimizer = build_optimizer(model.module, LR)
    settings = StepSettings(CPU, torch.float32, MAX_GRAD_NORM)
    seen = observe_gradients(model, optimizer)
    step_batch = partial(masked_step_batch, data, mask_targets=mask_targets) if variant.masked else data.step_batch

    activations, results = ActivationMeter(model), []
    for step in range(STEPS):
        batch = lesson.context_parallel_batch(step_batch(step, grid.dp_rank), cp.split, cp.rank)
        with activations if step == 0 else nullcontext():
            results.append(data_parallel.train_step(model, optimizer, batch, settings))   # lesson 01's step
    # The report's traffic rows: the cp collectives, lesson 01's gradient all-reduce over dp x cp, the loss.
    n_params = sum(p.numel() for p in model.module.parameters())
    predicted = step_traffic(lesson.predicted_cp_traffic(CFG, MICRO, variant.seq_len, grid.cp_size, variant.mode,
                                                         data.shape.grad_accum),
                             data_parallel_traffic(n_params, group="dp_cp"), loss_groups=("dp_cp",))
    return {"grads": seen["before"], "clipped_grads": seen["after"], "activations": activations.peak_bytes,
            # either mode keeps what the reference keeps for S/cp tokens
            "predicted_activations": predicted_activation_bytes(CFG, MICRO, variant.seq_len // grid.cp_size),
            "losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
            "traffic": {key: t.payload_bytes for key, t in comm.meter.traffic.items()},
            "predicted": {key: STEPS * value for key, value in predicted.items()},
            "devices": dict(comm.meter.devices),
            "params": {name: p.detach().clone() for name, p in model.module.named_parameters()}}


CP_VARIANTS = [Variant(GridShape(cp=4), "ring", True), Variant(GridShape(cp=4), "ulysses", False),
               Variant(GridShape(dp=2, cp=2), "ring", False), Variant(GridShape(dp=2, cp=2), "ulysses", True)]
# cp rank 1 of dp rank 0 holds no valid target in its first micro-batch (mask_targets).
MASKED_VARIANTS = [Variant(GridShape(dp=2, cp=2), "ring", True, masked=True)]
# cp = 1 with the default zigzag split on an odd sequence (this crashed on a shape mismatch when
# the split dropped the last token).
ODD_SEQ_VARIANTS = [Variant(GridShape(dp=4), "ring", True, seq_len=ODD_SEQ)]
# An odd degree on 3 ranks: 6 zigzag chunks, and the contiguous split.
CP3_VARIANTS = [Variant(GridShape(cp=3), "ring", True, seq_len=CP3_SEQ),
                Variant(GridShape(cp=3), "ring", False, seq_len=CP3_SEQ)]


def several_training_variants(variants):
    """One spawn, every variant, each from the same initial weights."""
    return {variant: context_parallel_run(variant) for variant in variants}


@pytest.fixture(scope="module")
def references():
    """One device, the whole global batch in one piece, for each data the variants train on."""
    runs = {(SEQ, False): train_reference(CFG, SEED, batches(1), STEPS, LR, MAX_GRAD_NORM),
            (SEQ, True): train_reference(CFG, SEED, batches(1), STEPS, LR, MAX_GRAD_NORM, mask_targets=mask_targets),
            (ODD_SEQ, False): train_reference(CFG, SEED, batches(1, ODD_SEQ), STEPS, LR, MAX_GRAD_NORM),
            (CP3_SEQ, False): train_reference(CFG, SEED, batches(1, CP3_SEQ), STEPS, LR, MAX_GRAD_NORM)}
    for run in runs.values():
        # Clipping must act at every step, or the clipping rule would go untested.
        assert min(run["norms"]) > MAX_GRAD_NORM
    return runs


@pytest.fixture(scope="module")
def four_rank_training():
    """cp alone, dp x cp (also masked), and cp = 1 on an odd sequence: one spawn of 4 ranks."""
    variants = CP_VARIANTS + MASKED_VARIANTS + ODD_SEQ_VARIANTS
    return run_ranks(4, several_training_variants, variants, timeout_s=300)


def assert_equals_reference(result, reference, where: str):
    """Losses, gradient norms, step-0 gradients before and after clipping, and final parameters
    against one device."""
    for key in ("grads", "clipped_grads"):
        for name, grad in result[key].items():
            torch.testing.assert_close(grad, reference[key][name], **TOLERANCE, msg=f"{where} {key} {name}")
    for key in ("losses", "norms"):
        torch.testing.assert_close(torch.tensor(result[key]), torch.tensor(reference[key]), rtol=0, atol=1e-5,
                                   msg=f"{where} {key}")
    for name, param in result["params"].items():
        torch.testing.assert_close(param, reference["params"][name], **PARAM_TOLERANCE, msg=f"{where} param {name}")


def check_variants(per_rank, variants, references):
    for rank, results in enumerate(per_rank):
        for variant in variants:
            result, where = results[variant], f"rank {rank} {variant}"
            assert_equals_reference(result, references[(variant.seq_len, variant.masked)], where)
            # Activation memory per rank is that of seq/cp tokens, to the byte (one micro-batch).
            assert result["activations"] == result["predicted_activations"], where
            # Every collective of the run equals the formulas (cp, the dp x cp gradient sum, the
            # loss scalar), and moved tensors on the rank's device.
            assert result["traffic"] == result["predicted"], where
            assert all(devices == {"cpu"} for devices in result["devices"].values()), (where, result["devices"])


def test_training_equals_one_device(references, four_rank_training):
    check_variants(four_rank_training, CP_VARIANTS, references)


def test_masked_targets_weigh_every_token_once(references, four_rank_training):
    """Token-weighted loss: ranks and micro-batches holding different numbers of valid targets,
    one cp rank none at all in a micro-batch, equal one device on the same masked batch."""
    (variant,) = MASKED_VARIANTS
    data, split = batches(variant.shape.dp), lesson.SequenceSplit(variant.shape.cp, variant.zigzag)
    valid = {(dp_rank, cp_rank, index): int((targets != IGNORE_INDEX).sum())
             for dp_rank in range(variant.shape.dp) for cp_rank in range(variant.shape.cp)
             for index, (_, targets, _) in enumerate(lesson.context_parallel_batch(
                 masked_step_batch(data, 0, dp_rank, mask_targets), split, cp_rank).micro_batches)}
    assert valid[(0, 1, 0)] == 0 and valid[(0, 0, 0)] > 0, valid
    assert len(set(valid.values())) >= 4, valid
    check_variants(four_rank_training, MASKED_VARIANTS, references)


def test_cp_1_trains_on_every_token_of_an_odd_sequence(references, four_rank_training):
    """Equal to one device on the 33-token sequences: a dropped token would change every loss."""
    check_variants(four_rank_training, ODD_SEQ_VARIANTS, references)


def test_odd_degree_cp_3_equals_one_device(references):
    """cp = 3 on 3 ranks, zigzag (6 chunks) and contiguous."""
    per_rank = run_ranks(3, several_training_variants, CP3_VARIANTS, timeout_s=300)
    check_variants(per_rank, CP3_VARIANTS, references)


# ----------------------------------------------------------------------------- the script


def test_torchrun_script_trains():
    """The lesson as a user runs it: exit code 0, one line per step, loss falling, the report."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
         str(REPO_ROOT / "04_context_parallel.py"), "--cp", "4", "--steps", "12", "--seq-len", "128"],
        capture_output=True, text=True, timeout=240, env=env, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == 12, result.stdout
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
    for section in ("== memory", "== communication", "== attention work", "max/min = 1.00", "tokens/s"):
        assert section in result.stdout, section
