"""Lesson 01 proven equal: data-parallel training on real gloo ranks against one device.

Every rank trains on its slice of the same global batches; the reference trains one GPT on the
whole global batch in one piece. Tolerances: float32 sums of the same numbers in a different
order (per-rank means then an average, instead of one mean) differ by a few ulp of each
gradient; 1e-6 absolute on values of order 1e-2..1e0 leaves room for that and nothing else.
A wrongly scaled gradient (sum instead of mean, or the last micro-batch only) is off by 50 % or
more and fails by orders of magnitude.

Parameters after AdamW get a tolerance in units of the learning rate. Adam's step lr * m / sqrt(v)
is normalised per element, so it does not shrink with the gradient: an element whose gradient is
itself rounding noise (|g| ~ 1e-9, known to ~1e-3 relative) moves by lr * 1e-3 more or less than
on one device. A real error (a rank that skipped a step, a gradient from the wrong batch) moves
parameters by order lr. 1e-2 * lr sits between the two; the gradient check above is the one that
catches scaling bugs, which Adam's normalisation would hide.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from picotron_like import comm
from picotron_like.data import BatchShape, TokenBatches, builtin_corpus_paths
from picotron_like.model import GPT, get_config
from picotron_like.testing import run_ranks, train_reference
from picotron_like.topology import REPO_ROOT, GridShape, ProcessGrid, load_lesson
from picotron_like.train import build_optimizer, clip_grad_norm_

CFG = replace(get_config("tiny"), n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=128)
SEQ, MICRO, GLOBAL_SEQUENCES, STEPS, LR, SEED = 32, 2, 8, 3, 3e-3, 7
TOLERANCE = dict(rtol=0, atol=1e-6)
PARAM_TOLERANCE = dict(rtol=0, atol=1e-2 * LR)


def batches(dp: int) -> TokenBatches:
    shape = BatchShape(MICRO, SEQ, GLOBAL_SEQUENCES // (MICRO * dp), dp)
    return TokenBatches(builtin_corpus_paths()[0], shape, seed=SEED, vocab_size=CFG.vocab_size)


def reference_run():
    """One device, the whole global batch as one batch: losses, step-0 gradients, final parameters."""
    reference = train_reference(CFG, SEED, batches(1), STEPS, LR)
    return reference["losses"], reference["grads"], reference["params"]


def data_parallel_run(mode: str, bucket_bytes: int):
    """On every rank: step-0 gradients after synchronisation, per-step losses, final parameters."""
    lesson = load_lesson("01_data_parallel")
    dp = dist.get_world_size()
    grid = ProcessGrid(GridShape(dp=dp))
    model = lesson.wrap_data_parallel(GPT(CFG, seed=SEED), grid.dp_group, mode, bucket_bytes)
    optimizer = build_optimizer(model.module, LR)
    data = batches(dp)

    # Gradients of one full accumulation cycle, exactly as train_step computes them.
    micro = data.micro_batches(0, grid.dp_rank)
    for index, (inputs, targets) in enumerate(micro):
        model.require_backward_grad_sync = index == len(micro) - 1
        (model(inputs, targets) / len(micro)).backward()
    model.finish_gradient_synchronization()
    grads = {name: p.grad.clone() for name, p in model.module.named_parameters()}
    model.zero_grad(set_to_none=False)

    comm.meter.reset()
    losses = [lesson.train_step(model, optimizer, data.micro_batches(step, grid.dp_rank), 1.0,
                                torch.device("cpu"), torch.float32) for step in range(STEPS)]
    traffic = comm.meter.get("all_reduce", "dp")
    n_buckets = len(model.buckets) if mode == "bucketed" else sum(1 for _ in model.parameters())
    params = {name: p.detach().clone() for name, p in model.module.state_dict().items()}
    return {"grads": grads, "losses": losses, "params": params, "traffic": traffic, "n_buckets": n_buckets,
            "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}


def several_modes():
    """One spawn, several data-parallel variants, each from the same initial weights."""
    variants = [("naive", 0), ("bucketed", 1), ("bucketed", 64 * 1024), ("bucketed", 2**30)]
    return {f"{mode}:{size}": data_parallel_run(mode, size) for mode, size in variants}


def torch_ddp_run():
    """The same training with PyTorch's DistributedDataParallel, no_sync for accumulation."""
    from torch.nn.parallel import DistributedDataParallel

    lesson = load_lesson("01_data_parallel")
    dp = dist.get_world_size()
    model = DistributedDataParallel(GPT(CFG, seed=SEED))
    optimizer = build_optimizer(model.module, LR)
    data = batches(dp)
    for step in range(STEPS):
        micro = data.micro_batches(step, dist.get_rank())
        for index, (inputs, targets) in enumerate(micro):
            if index < len(micro) - 1:
                with model.no_sync():
                    (model(inputs, targets) / len(micro)).backward()
            else:
                (model(inputs, targets) / len(micro)).backward()
        clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    ours = lesson.wrap_data_parallel(GPT(CFG, seed=SEED), dist.group.WORLD, "bucketed", 64 * 1024)
    ours_optimizer = build_optimizer(ours.module, LR)
    for step in range(STEPS):
        lesson.train_step(ours, ours_optimizer, data.micro_batches(step, dist.get_rank()), 1.0,
                          torch.device("cpu"), torch.float32)
    return ({n: p.detach().clone() for n, p in model.module.state_dict().items()},
            {n: p.detach().clone() for n, p in ours.module.state_dict().items()})


@pytest.fixture(scope="module")
def reference():
    return reference_run()


@pytest.mark.parametrize("dp", [2, 4])
def test_data_parallel_equals_one_device(dp, reference):
    ref_losses, ref_grads, ref_params = reference
    per_rank = run_ranks(dp, several_modes, timeout_s=240)
    for rank, variants in enumerate(per_rank):
        for variant, result in variants.items():
            where = f"dp={dp} rank={rank} {variant}"
            for name, grad in result["grads"].items():
                torch.testing.assert_close(grad, ref_grads[name], **TOLERANCE, msg=f"{where} grad {name}")
            torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses),
                                       rtol=0, atol=1e-5, msg=f"{where} losses")
            for name, param in result["params"].items():
                torch.testing.assert_close(param, ref_params[name], **PARAM_TOLERANCE, msg=f"{where} param {name}")

            # The meter's count equals the formula: every gradient byte once per step, in one
            # call per bucket (or per tensor when naive), plus the 4-byte loss average.
            traffic = result["traffic"]
            assert traffic.payload_bytes == STEPS * (result["grad_bytes"] + 4), where
            assert traffic.calls == STEPS * (result["n_buckets"] + 1), where
            assert traffic.sent_bytes == pytest.approx(2 * (dp - 1) / dp * traffic.payload_bytes), where
    buckets = {variant: result["n_buckets"] for variant, result in per_rank[0].items()}
    assert buckets["bucketed:1"] == buckets["naive:0"] > buckets["bucketed:65536"] > buckets["bucketed:1073741824"] == 1


def test_equals_pytorch_ddp():
    for torch_params, our_params in run_ranks(2, torch_ddp_run, timeout_s=180):
        for name, param in our_params.items():
            torch.testing.assert_close(param, torch_params[name], **PARAM_TOLERANCE, msg=name)


def test_torchrun_script_trains():
    """The lesson as a user runs it: exit code 0, one line per step, loss falling, a report."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(REPO_ROOT / "01_data_parallel.py"), "--steps", "12", "--seq-len", "64"],
        capture_output=True, text=True, timeout=240, env=env, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert len(losses) == 12, result.stdout
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
    for section in ("== memory", "== communication", "== compute", "tokens/s"):
        assert section in result.stdout


def test_bad_world_size_fails_before_any_collective():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(REPO_ROOT / "01_data_parallel.py"), "--dp", "3"],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO_ROOT)
    assert result.returncode != 0
    assert "dp*pp*cp*tp = 3*1*1*1 = 3 but the world size is 2" in result.stderr
    assert result.stderr.count("error: bad parallel configuration") == 1
