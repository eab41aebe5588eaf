"""
What lesson 07's trainer costs at degree 1, and what each recompute mode costs and saves.

    torchrun --standalone --nproc_per_node=1 benchmarks/trainer_overhead.py [--preset tiny --seq-len 256 --steps 8]

Part 1 trains the same model on the same batches twice on one rank: with a plain PyTorch loop
(GPT, AdamW, clip, step: nothing of this project but the model) and with lesson 07's trainer at
dp = pp = cp = tp = 1 (parallelize(), ZeRO-0's flat buffers, the shared step with its
all-reduces over groups of one rank). The runs alternate in rounds so that both see the same
machine noise; the ratio of median step times is the trainer's overhead (goal: <= 1.05).

Part 2 runs the trainer with each --recompute mode: median step time against none's, and the
activations one micro-batch keeps for backward (measured by the saved-tensors meter; on CUDA also
the step's peak allocated memory).
"""

import statistics
import sys
import time
from functools import partial

import torch

from picotron_like.data import TokenBatches
from picotron_like.lessons import load_lesson
from picotron_like.metrics import ActivationMeter, log0
from picotron_like.model import GPT
from picotron_like.topology import ProcessGrid, init_distributed, shutdown
from picotron_like.train import autocast_dtype, plan_run

full_5d = load_lesson("07_full_5d")
zero = full_5d.zero


def timed(step_fn, steps: int, device) -> list[float]:
    seconds = []
    for step in range(steps):
        start = time.perf_counter()
        step_fn(step)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds


def plain_loop(cfg, args, batches: TokenBatches, device):
    """The baseline: what anyone would write for one device."""
    model = GPT(cfg, seed=args.seed).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                                  fused=device.type == "cuda")
    dtype = autocast_dtype(args.dtype, device)

    def step(index: int) -> None:
        micro_batches = batches.step_batch(index, 0).micro_batches
        for inputs, targets in micro_batches:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                loss = model(inputs.to(device), targets.to(device)) / len(micro_batches)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
    return step


def trainer(argv: list[str], recompute: str, plan, grid, device):
    """Lesson 07's step at degree 1, built from its own flags."""
    args = full_5d.parse_args([*argv, "--recompute", recompute, "--zero-stage", "0"])
    model, _ = full_5d.parallelize(plan.cfg, grid, args, device)
    optimizer = zero.build_sharded_optimizer(model, args.lr)
    settings = full_5d.step_settings(grid, device, model.precision, args.max_grad_norm)
    step = partial(full_5d.train_step, model, optimizer, settings=settings)
    return model, (lambda index: step(plan.batches.step_batch(index, 0)))


def kept_bytes(model, step_fn, device) -> tuple[int, int]:
    meter = ActivationMeter(model.module)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with meter:
        step_fn(0)
    return meter.peak_bytes, torch.cuda.max_memory_allocated() if device.type == "cuda" else 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = full_5d.parse_args(argv)
    plan = plan_run(args, full_5d.validate, full_5d.expert_parallel.moe_config)
    device = init_distributed()
    grid = ProcessGrid(plan.grid)
    rounds, per_round = 3, max(args.steps // 3, 2)
    log0(f"preset {args.preset}, {plan.shape.tokens_per_step:,} tokens per step, device {device}, "
         f"{rounds} rounds of {per_round} steps each after one warm-up step")

    plain = plain_loop(plan.cfg, args, plan.batches, device)
    _, ours = trainer(argv, "none", plan, grid, device)
    times = {"plain": [], "trainer": []}
    plain(0), ours(0)
    for _ in range(rounds):
        times["plain"] += timed(plain, per_round, device)
        times["trainer"] += timed(ours, per_round, device)
    median = {name: statistics.median(values) for name, values in times.items()}
    log0(f"plain PyTorch loop  {median['plain'] * 1e3:8.1f} ms/step")
    log0(f"lesson 07, degree 1 {median['trainer'] * 1e3:8.1f} ms/step   overhead ratio "
         f"{median['trainer'] / median['plain']:.3f}")

    log0("\nrecompute   ms/step  vs none   kept for backward (one micro-batch)   peak allocated (CUDA)")
    baseline = None
    for mode in load_lesson("07_report").RECOMPUTE_MODES:
        model, step = trainer(argv, mode, plan, grid, device)
        kept, peak = kept_bytes(model, step, device)
        seconds = statistics.median(timed(step, rounds * per_round, device))
        baseline = baseline or seconds
        peak_text = f"{peak / 1e6:10.1f} MB" if device.type == "cuda" else "-"
        log0(f"{mode:<10} {seconds * 1e3:8.1f}  {seconds / baseline:7.2f}x   {kept / 1e6:10.2f} MB{'':25}{peak_text}")
        del model
    shutdown()


if __name__ == "__main__":
    main()
