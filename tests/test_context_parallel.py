"""Lesson 04 proven equal: ring and Ulysses attention, and whole training runs, against one device.

Attention. Every rank draws the same full-sequence q, k, v and output gradient, runs its shard
through ring or Ulysses attention, and compares output and dQ/dK/dV with the slice of
F.scaled_dot_product_attention(is_causal=True) on the full sequence with repeated K/V. Ulysses runs
that very kernel on whole heads, so it matches to the bit. The ring computes the same softmax in
another order: per block, then merged through exp(lse differences). On values of order 1 (randn
inputs) that moves float32 results by a few ulp per block merged; with up to 8 blocks per row
errors stay near 1e-6. 1e-5 absolute is ten times that and still far below any real bug: a
missing block, a wrong mask or a K/V block from the wrong rank changes outputs by 0.1 or more.

Training. As in lesson 01's tests: gradients after one accumulation cycle to 1e-6 absolute (float32
sums in another order: per-rank means then an average; the ring's reordered softmax adds a few
ulp more), losses to 1e-5, parameters after AdamW to 1e-2 * lr, because Adam's normalised step
turns the rounding noise of a ~0 gradient into a step of that order; a real error moves a
parameter by order lr.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from picotron_like import comm
from picotron_like.data import BatchShape, TokenBatches, builtin_corpus_paths
from picotron_like.model import get_config
from picotron_like.testing import run_ranks, train_reference
from picotron_like.topology import REPO_ROOT, ConfigError, GridShape, ProcessGrid, load_lesson
from picotron_like.train import SavedActivations, build_optimizer

lesson = load_lesson("04_context_parallel")

# 8 heads over 4 kv-heads: grouped-query attention, and both counts divisible by cp = 4 for Ulysses.
CFG = replace(get_config("tiny"), n_layers=2, hidden=64, n_heads=8, n_kv_heads=4, ffn_hidden=128)
SEQ, MICRO, GLOBAL_SEQUENCES, STEPS, LR, SEED = 32, 2, 8, 3, 3e-3, 7
TOLERANCE = dict(rtol=0, atol=1e-6)
PARAM_TOLERANCE = dict(rtol=0, atol=1e-2 * LR)
ATTENTION_TOLERANCE = 1e-5
# The attention test's shapes, as a config so the lesson's formulas apply to them.
ATTN = replace(get_config("tiny"), n_layers=1, hidden=8 * 16, n_heads=8, n_kv_heads=4)
ATTN_BATCH, ATTN_SEQ = 2, 32

ATTENTION_VARIANTS = [(mode, zigzag) for mode in ("ring", "ulysses") for zigzag in (False, True)]
ATTENTION_GRIDS = [GridShape(cp=4), GridShape(dp=2, cp=2)]


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


@pytest.mark.parametrize("grid, cfg, seq_len, zigzag, mode, sequence_parallel, message", [
    (GridShape(cp=4), CFG, 36, True, "ring", False,
     "--seq-len 36 is not divisible by 8 (2*cp for the zigzag split)"),
    (GridShape(cp=4), get_config("tiny"), 64, True, "ulysses", False,
     "n_kv_heads=2 gives 2 heads per tp rank, not divisible by --cp 4"),
    (GridShape(cp=2, tp=2), replace(CFG, n_heads=4, n_kv_heads=2, hidden=32), 64, False, "ulysses", False,
     "n_kv_heads=2 gives 1 heads per tp rank, not divisible by --cp 2"),
    (GridShape(cp=2, tp=4), CFG, 20, True, "ring", True,
     "--seq-len 20 leaves 10 tokens per cp rank, not divisible by --tp 4"),
])
def test_bad_configurations_name_value_rule_and_fix(grid, cfg, seq_len, zigzag, mode, sequence_parallel, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        lesson.validate_context_parallel(grid, grid.world_size, cfg, seq_len, zigzag, mode, sequence_parallel)
    # The ring has no rule on heads.
    if mode == "ulysses":
        lesson.validate_context_parallel(grid, grid.world_size, cfg, seq_len, zigzag, "ring")


def test_bad_configuration_stops_the_script_before_any_collective():
    """One line on stderr, exit code 2, no process group: validation reads only flags and WORLD_SIZE,
    so one process with torchrun's variables set stands for every rank (and cannot hang)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="4", RANK="0")
    result = subprocess.run([sys.executable, str(REPO_ROOT / "04_context_parallel.py"), "--cp", "4",
                             "--cp-mode", "ulysses", "--seq-len", "60"],
                            capture_output=True, text=True, timeout=120, env=env, cwd=REPO_ROOT)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("error: bad parallel configuration") == 1
    assert "--seq-len 60 is not divisible by 8" in result.stderr


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
            comm.meter.reset()
            out = lesson.CP_MODES[mode](*local, cp)
            out.backward(d_out.index_select(2, mine))
            errors = {"out": (out - reference.index_select(2, mine)).abs().max().item()}
            for name, ours, theirs in zip(("dq", "dk", "dv"), local, full):
                errors[name] = (ours.grad - theirs.grad.index_select(2, mine)).abs().max().item()
            results[(shape.cp, mode, zigzag)] = {
                "errors": errors, "work": cp.attention_work, "cp_rank": cp.rank,
                "traffic": {key: value for key, value in comm.meter.traffic.items()}}
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


def batches(dp: int) -> TokenBatches:
    shape = BatchShape(MICRO, SEQ, GLOBAL_SEQUENCES // (MICRO * dp), dp)
    return TokenBatches(builtin_corpus_paths()[0], shape, seed=SEED, vocab_size=CFG.vocab_size)


def reference_run():
    """One device, the whole global batch in one piece: losses, step-0 gradients, final parameters."""
    reference = train_reference(CFG, SEED, batches(1), STEPS, LR)
    # Clipping must act at every step, or the tensor-parallel variants' norm (summed over tp
    # shards, norm gains counted once) would go untested.
    assert min(reference["norms"]) > 1.0
    return reference["losses"], reference["grads"], reference["params"]


def gradients_of_one_cycle(parts, pipeline, micro_batches):
    """Gradients after one accumulation cycle and the dp x cp reduction, as train_step computes
    them before clipping; and the saved activations of the first micro-batch (pp = 1 only)."""
    if pipeline is None:
        model, activations = parts[0], SavedActivations(parts[0], torch.device("cpu"))
        for index, batch in enumerate(micro_batches):
            model.require_backward_grad_sync = index == len(micro_batches) - 1
            with activations if index == 0 else torch.enable_grad():
                loss = model(*batch)
            (loss / len(micro_batches)).backward()
        activation_bytes = activations.nbytes
    else:
        pipeline.forward_backward(micro_batches)
        activation_bytes = None
    for part in parts:
        part.finish_gradient_synchronization()
    grads = {name: p.grad.clone() for part in parts for name, p in part.module.named_parameters()}
    for part in parts:
        part.zero_grad(set_to_none=False)
    return grads, activation_bytes


def context_parallel_run(shape: GridShape, mode: str, zigzag: bool, sequence_parallel: bool = False):
    """On every rank, with the lesson's own builder and step: step-0 gradients, activations of one
    micro-batch, per-step losses, the run's traffic, final parameters (as this rank holds them)."""
    cpu = torch.device("cpu")
    grid = ProcessGrid(shape)
    cp = lesson.ContextParallel.from_grid(grid, zigzag)
    parts = lesson.build_model(CFG, SEED, grid, cp, mode, cpu, sequence_parallel, bucket_bytes=64 * 1024)
    data = batches(shape.dp)
    pipeline = lesson.build_pipeline(parts, grid, "1f1b", data.shape, CFG, cpu, torch.float32, sequence_parallel)
    modules = torch.nn.ModuleList(part.module for part in parts)
    optimizer = build_optimizer(modules, LR)

    def micro_batches(step):
        return lesson.context_parallel_micro_batches(data, step, grid.dp_rank, cp.split, cp.rank)

    grads, activation_bytes = gradients_of_one_cycle(parts, pipeline, micro_batches(0))
    comm.meter.reset()
    losses = [lesson.train_step(parts, pipeline, optimizer, micro_batches(step), 1.0, grid, cpu, torch.float32)
              for step in range(STEPS)]
    # A pipeline stage names its parameters as the whole GPT does (layers.2.attn...), so the
    # parts' names, without the list's index, are the reference's names.
    named = {name: p for part in parts for name, p in part.module.named_parameters()}
    return {"grads": grads, "losses": losses, "activations": activation_bytes, "n_micro": data.shape.grad_accum,
            "tp_rank": grid.tp_rank, "n_layers": sum(len(part.module.layers) for part in parts),
            "n_params": sum(p.numel() for p in named.values()),
            "traffic": {key: traffic.payload_bytes for key, traffic in comm.meter.traffic.items()},
            "split_dims": {name: getattr(p, "tp_split_dim", None) for name, p in named.items()},
            "params": {name: p.detach().clone() for name, p in named.items()}}


CP_VARIANTS = [(GridShape(cp=4), "ring", True), (GridShape(cp=4), "ulysses", False),
               (GridShape(dp=2, cp=2), "ring", False), (GridShape(dp=2, cp=2), "ulysses", True)]
PP_CP_VARIANTS = [(GridShape(pp=2, cp=2), "ring", True)]
# 8 ranks: one spawn for both; Ulysses with sequence parallelism needs heads/tp = 4 and kv/tp = 2
# divisible by cp = 2.
DP_CP_TP_VARIANTS = [(GridShape(dp=2, cp=2, tp=2), "ring", True, False),
                     (GridShape(dp=2, cp=2, tp=2), "ulysses", False, True)]


def several_training_variants(variants):
    """One spawn, every variant, each from the same initial weights."""
    return {variant: context_parallel_run(*variant) for variant in variants}


@pytest.fixture(scope="module")
def reference():
    return reference_run()


@pytest.fixture(scope="module")
def four_rank_training():
    """cp alone, dp x cp and pp x cp: one spawn of 4 ranks."""
    return run_ranks(4, several_training_variants, CP_VARIANTS + PP_CP_VARIANTS, timeout_s=240)


def assert_equals_reference(result, reference, shape: GridShape, where: str):
    """Losses, step-0 gradients and final parameters against one device; a tensor-parallel rank
    holds a slice of some parameters (tp_split_dim), compared with that slice of the reference."""
    ref_losses, ref_grads, ref_params = reference

    def local(full, name):
        split_dim = result["split_dims"][name]
        return full if split_dim is None else full.chunk(shape.tp, dim=split_dim)[result["tp_rank"]]

    for name, grad in result["grads"].items():
        torch.testing.assert_close(grad, local(ref_grads[name], name), **TOLERANCE, msg=f"{where} grad {name}")
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=0, atol=1e-5,
                               msg=f"{where} losses")
    for name, param in result["params"].items():
        torch.testing.assert_close(param, local(ref_params[name], name), **PARAM_TOLERANCE,
                                   msg=f"{where} param {name}")


def check_variants(per_rank, variants, reference):
    for rank, results in enumerate(per_rank):
        for variant in variants:
            shape, mode, zigzag, *sequence_parallel = variant
            sequence_parallel = bool(sequence_parallel and sequence_parallel[0])
            result = results[variant]
            where = f"rank {rank} {shape} {mode} zigzag={zigzag} sp={sequence_parallel}"
            assert_equals_reference(result, reference, shape, where)
            if shape.pp == 1:
                # Activation memory per rank is that of seq/cp tokens, to the byte.
                assert result["activations"] == lesson.predicted_cp_activation_bytes(
                    CFG, MICRO, SEQ, shape.cp, mode, tp=shape.tp, sequence_parallel=sequence_parallel), where
            # The cp traffic of the run equals the formula for this rank's layers and heads; the
            # gradients are reduced over dp x cp once per step, with the 4-byte loss average.
            predicted = lesson.predicted_cp_traffic(CFG, MICRO, SEQ, shape.cp, mode, result["n_micro"],
                                                    tp=shape.tp, n_layers=result["n_layers"])
            predicted[("all_reduce", "dp_cp")] = 4 * result["n_params"] + 4
            measured = {key: value for key, value in result["traffic"].items() if key in predicted}
            assert measured == {key: STEPS * value for key, value in predicted.items()}, where


def test_training_equals_one_device(reference, four_rank_training):
    check_variants(four_rank_training, CP_VARIANTS, reference)


def test_pipeline_x_context_parallel_equals_one_device(reference, four_rank_training):
    check_variants(four_rank_training, PP_CP_VARIANTS, reference)


def test_dp_x_cp_x_tp_equals_one_device(reference):
    per_rank = run_ranks(8, several_training_variants, DP_CP_TP_VARIANTS, timeout_s=300)
    check_variants(per_rank, DP_CP_TP_VARIANTS, reference)


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
