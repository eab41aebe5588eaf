"""Lesson 01 proven equal: data-parallel training on real gloo ranks against one device.

Every rank trains on its slice of the same global batches; the reference trains one GPT on the
whole global batch in one piece. Tolerances: float32 sums of the same numbers in a different
order (per-rank sums of token losses, then a sum over ranks, instead of one mean) differ by a few
ulp of each gradient; 1e-6 absolute on values of order 1e-2..1e0 leaves room for that and nothing
else. A wrongly scaled gradient (an average over ranks instead of a sum, a mean of per-rank means,
or the last micro-batch only) is off by 10 % or more and fails by orders of magnitude.

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
from functools import partial

import pytest
import torch
import torch.distributed as dist

from picotron_like import comm, train
from picotron_like.data import BatchShape, TokenBatches, builtin_corpus_paths
from picotron_like.lessons import REPO_ROOT, load_lesson
from picotron_like.loss import IGNORE_INDEX
from picotron_like.metrics import add_traffic, data_parallel_traffic, step_bookkeeping_traffic
from picotron_like.model import GPT, get_config
from picotron_like.testing import ignore_targets, masked_step_batch, run_ranks, train_reference
from picotron_like.topology import GridShape, ProcessGrid
from picotron_like.train import StepSettings, build_optimizer, clip_grad_norm_

CFG = replace(get_config("tiny"), n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=128)
SEQ, MICRO, GLOBAL_SEQUENCES, STEPS, LR, SEED = 32, 2, 8, 3, 3e-3, 7
MAX_GRAD_NORM = 1.0  # the reference's step-0 norm is about 2.4: clipping acts on every step
TOLERANCE = dict(rtol=0, atol=1e-6)
PARAM_TOLERANCE = dict(rtol=0, atol=1e-2 * LR)

# The odd layout with masked targets: dp = 3, two micro-batches of two sequences per rank. Rank 1's
# first micro-batch (global rows 4 and 5) ignores every target, the other rows a prompt of a
# different length each (testing.ignore_targets).
MASKED_DP, MASKED_SEQUENCES = 3, 12
MASK = partial(ignore_targets, ignored_rows=range(4, 6))
CPU = torch.device("cpu")


def batches(dp: int, global_sequences: int = GLOBAL_SEQUENCES) -> TokenBatches:
    shape = BatchShape(MICRO, SEQ, global_sequences // (MICRO * dp), dp)
    return TokenBatches(builtin_corpus_paths()[0], shape, seed=SEED, vocab_size=CFG.vocab_size)


def gradients(module) -> dict:
    return {name: p.grad.clone() for name, p in module.named_parameters()}


def observe_gradients(model, optimizer) -> dict:
    """Snapshot step 0's gradients from outside train_step: once synchronised (before clipping), by
    wrapping the wrapper's finish_gradient_synchronization, and as the optimizer steps (after
    clipping), by a step pre-hook."""
    seen = {}
    finish = model.finish_gradient_synchronization

    def finish_then_snapshot():
        finish()
        seen.setdefault("before", gradients(model.module))

    def snapshot_before_step(*_):
        seen.setdefault("after", gradients(model.module))

    model.finish_gradient_synchronization = finish_then_snapshot
    optimizer.register_step_pre_hook(snapshot_before_step)
    return seen


def data_parallel_run(mode: str, bucket_bytes: int, masked: bool = False):
    """On every rank: step-0 gradients before and after clipping, per-step losses and gradient
    norms, final parameters, and what the communication meter counted during training."""
    lesson = load_lesson("01_data_parallel")
    dp = dist.get_world_size()
    grid = ProcessGrid(GridShape(dp=dp))
    model = lesson.wrap_data_parallel(GPT(CFG, seed=SEED), grid.dp_group, mode, bucket_bytes)
    optimizer = build_optimizer(model.module, LR)
    seen = observe_gradients(model, optimizer)
    if masked:
        step_batch = partial(masked_step_batch, batches(dp, MASKED_SEQUENCES), mask_targets=MASK)
    else:
        step_batch = batches(dp).step_batch
    settings = StepSettings(CPU, max_grad_norm=MAX_GRAD_NORM)
    results = [lesson.train_step(model, optimizer, step_batch(step, grid.dp_rank), settings) for step in range(STEPS)]

    n_params = sum(p.numel() for p in model.parameters())
    grad_bytes = next(model.parameters()).element_size()
    predicted = add_traffic(data_parallel_traffic(n_params, grad_bytes),
                            step_bookkeeping_traffic(loss_groups=("dp",)))
    return {"grads": seen["before"], "clipped_grads": seen["after"],
            "losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
            "params": {name: p.detach().clone() for name, p in model.module.state_dict().items()},
            "traffic": dict(comm.meter.traffic), "devices": dict(comm.meter.devices),
            "predicted": {key: STEPS * value for key, value in predicted.items()},
            "n_buckets": len(model.buckets) if mode == "bucketed" else len(list(model.parameters()))}


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
        clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad()
    ours = lesson.wrap_data_parallel(GPT(CFG, seed=SEED), dist.group.WORLD, "bucketed", 64 * 1024)
    ours_optimizer = build_optimizer(ours.module, LR)
    settings = StepSettings(CPU, max_grad_norm=MAX_GRAD_NORM)
    for step in range(STEPS):
        lesson.train_step(ours, ours_optimizer, data.step_batch(step, dist.get_rank()), settings)
    return ({n: p.detach().clone() for n, p in model.module.state_dict().items()},
            {n: p.detach().clone() for n, p in ours.module.state_dict().items()})


def assert_equals_reference(result: dict, reference: dict, where: str) -> None:
    """Losses, gradients before and after clipping, gradient norms, parameters after AdamW."""
    for key in ("grads", "clipped_grads"):
        for name, grad in result[key].items():
            torch.testing.assert_close(grad, reference[key][name], **TOLERANCE, msg=f"{where} {key} {name}")
    for key in ("losses", "norms"):
        torch.testing.assert_close(torch.tensor(result[key]), torch.tensor(reference[key]),
                                   rtol=0, atol=1e-5, msg=f"{where} {key}")
    for name, param in result["params"].items():
        torch.testing.assert_close(param, reference["params"][name], **PARAM_TOLERANCE, msg=f"{where} param {name}")


@pytest.fixture(scope="module")
def reference():
    """One device, the whole global batch as one batch."""
    return train_reference(CFG, SEED, batches(1), STEPS, LR, MAX_GRAD_NORM)


@pytest.mark.parametrize("dp", [2, 4])
def test_data_parallel_equals_one_device(dp, reference):
    assert min(reference["norms"]) > MAX_GRAD_NORM, "clipping must act, or the clipped gradients prove nothing"
    per_rank = run_ranks(dp, several_modes, timeout_s=240)
    for rank, variants in enumerate(per_rank):
        for variant, result in variants.items():
            where = f"dp={dp} rank={rank} {variant}"
            assert_equals_reference(result, reference, where)

            # The meter's count equals the lesson's formula (every gradient byte once per step,
            # plus the 4-byte loss), in one call per bucket (or per tensor when naive) plus the loss's.
            traffic = result["traffic"]
            assert set(traffic) == {("all_reduce", "dp")}, where
            dp_traffic = traffic[("all_reduce", "dp")]
            assert dp_traffic.payload_bytes == result["predicted"][("all_reduce", "dp")], where
            assert dp_traffic.calls == STEPS * (result["n_buckets"] + 1), where
            assert dp_traffic.sent_bytes == pytest.approx(2 * (dp - 1) / dp * dp_traffic.payload_bytes), where
    buckets = {variant: result["n_buckets"] for variant, result in per_rank[0].items()}
    assert buckets["bucketed:1"] == buckets["naive:0"] > buckets["bucketed:65536"] > buckets["bucketed:1073741824"] == 1


def masked_odd_layout():
    return {mode: data_parallel_run(mode, 64 * 1024 if mode == "bucketed" else 0, masked=True)
            for mode in ("naive", "bucketed")}


def test_masked_targets_on_an_odd_layout_equal_one_device():
    """dp = 3, each rank and micro-batch ignoring a different number of targets, one micro-batch
    ignoring all of them: the loss is token-weighted over the global batch, as on one device.

    A mean of per-rank (or per-micro-batch) means would weight the targets of a rank holding few
    of them too heavily, and turn the fully ignored micro-batch into NaN.
    """
    data = batches(1, MASKED_SEQUENCES)
    reference = train_reference(CFG, SEED, data, STEPS, LR, MAX_GRAD_NORM, mask_targets=MASK)
    assert min(reference["norms"]) > MAX_GRAD_NORM, "clipping must act, or the clipped gradients prove nothing"
    layout = batches(MASKED_DP, MASKED_SEQUENCES)
    counts = [int((targets != IGNORE_INDEX).sum()) for rank in range(MASKED_DP)
              for _, targets in masked_step_batch(layout, 0, rank, MASK).micro_batches]
    # Rank 1's first micro-batch holds no target; no two micro-batches hold as many.
    assert counts[2] == 0 and len(set(counts)) == len(counts), counts

    for rank, modes in enumerate(run_ranks(MASKED_DP, masked_odd_layout, timeout_s=180)):
        for mode, result in modes.items():
            assert_equals_reference(result, reference, f"dp={MASKED_DP} rank={rank} {mode}")
            # Every collective of the training step moved tensors on the rank's device: NCCL,
            # the backend of a CUDA run, refuses anything else.
            assert result["devices"] and set(result["devices"]) == set(result["traffic"]), mode
            assert all(devices == {str(CPU)} for devices in result["devices"].values()), result["devices"]


def test_equals_pytorch_ddp():
    for torch_params, our_params in run_ranks(2, torch_ddp_run, timeout_s=180):
        for name, param in our_params.items():
            torch.testing.assert_close(param, torch_params[name], **PARAM_TOLERANCE, msg=name)


def launch_lesson(*flags: str) -> subprocess.Popen:
    """Lesson 01 under torchrun on 2 ranks, as a user starts it."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(REPO_ROOT / "01_data_parallel.py"), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
        cwd=REPO_ROOT)


def test_torchrun_script_trains():
    """The lesson as a user runs it: exit code 0, one line per step, loss falling, a report whose
    measured memory and communication equal the formulas."""
    run = launch_lesson("--steps", "12", "--seq-len", "64")
    stdout, stderr = run.communicate(timeout=240)
    assert run.returncode == 0, stdout + stderr
    losses = [float(x) for x in re.findall(r"^step +\d+ \| loss (\d+\.\d+) \| grad norm", stdout, re.M)]
    assert len(losses) == 12, stdout
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
    for section in ("== memory", "== communication", "== compute", "tokens/s"):
        assert section in stdout
    memory_rows = re.findall(r"^(?:weights|gradients|optimizer_states|activations|total) +(\S+) +(\S+)$", stdout, re.M)
    assert len(memory_rows) == 5 and all(measured == predicted for measured, predicted in memory_rows), stdout
    comm_rows = re.findall(r"^all_reduce +dp +\S+ +(\S+) +(\S+) +\S+$", stdout, re.M)
    assert len(comm_rows) == 1 and comm_rows[0][0] == comm_rows[0][1], stdout


def test_bad_configurations_fail_before_any_collective():
    """Degrees that do not match the world size, and a flag out of range: rank 0 prints one
    `error:` line, the ranks leave with exit code 2 before any process group exists, and no
    traceback of the lesson's reaches the user. Both runs at once: starting ranks is the slow part."""
    runs = {"world size": launch_lesson("--dp", "3"), "flag": launch_lesson("--lr", "-1")}
    outputs = {name: run.communicate(timeout=120) for name, run in runs.items()}
    for name, run in runs.items():
        stderr = outputs[name][1]
        assert run.returncode != 0, name
        assert stderr.count("error: ") == 1, stderr
        # torchrun reports each rank's exit code, and then a traceback of its own; a traceback from
        # the ranks would run through the lesson's or the package's files.
        assert re.search(r"exitcode\s*:\s*2\b", stderr), stderr
        for source in (REPO_ROOT / "01_data_parallel.py", REPO_ROOT / "picotron_like"):
            assert f'File "{source}' not in stderr, stderr
        assert "ConfigError" not in stderr, stderr
    assert "error: bad parallel configuration" in outputs["world size"][1]
    assert "dp*pp*cp*tp = 3*1*1*1 = 3 but the world size is 2" in outputs["world size"][1]
    assert "error: bad flags:\n  - --lr -1.0 must be a positive number" in outputs["flag"][1]


BUCKETED_LESSONS = ("01_data_parallel", "02_tensor_parallel", "03_pipeline_parallel", "03_zero_bubble",
                    "04_context_parallel", "05_expert_parallel")


def test_the_default_bucket_follows_the_device_and_every_lesson_takes_it_from_one_place():
    """25 MB on CUDA (DDP's), 1 MB on a CPU, decided by train.default_bucket_bytes alone: each
    bucketed lesson leaves --bucket-mb unset, turns it into bytes with bucket_bytes_from_flags and
    gives its builders no size of its own. The 125m preset's gradients (built on the meta device)
    make 14 buckets at CUDA's default, 86 at the CPU's (the figures default_bucket_bytes quotes)."""
    assert train.default_bucket_bytes(torch.device("cuda")) == 25 * 2**20
    assert train.default_bucket_bytes(CPU) == train.default_bucket_bytes("cpu") == 2**20
    for name in BUCKETED_LESSONS:
        lesson = load_lesson(name)
        args = lesson.parse_args([])
        assert args.bucket_mb is None, name
        assert train.bucket_bytes_from_flags(args, torch.device("cuda")) == 25 * 2**20, name
        assert train.bucket_bytes_from_flags(lesson.parse_args(["--bucket-mb", "0.5"]), CPU) == 2**19, name
        source = (REPO_ROOT / f"{name}.py").read_text()
        assert "bucket_bytes_from_flags(args, device)" in source and "2**20" not in source, name
    with torch.device("meta"):
        model = GPT(get_config("125m"))
    params = list(model.parameters())
    wrapper = load_lesson("01_data_parallel").BucketedDataParallel
    on_cuda = wrapper._fill_buckets(params, train.default_bucket_bytes(torch.device("cuda")))
    on_cpu = wrapper(model, None).buckets       # the meta device's default is the CPU's
    assert all(bucket.grads.numel() * 4 >= 25 * 2**20 for bucket in on_cuda[:-1])
    assert (len(on_cuda), len(on_cpu)) == (14, 86)
