"""
The step's tail, part by part: the path main had before the tail was fused against the one it has.

    python benchmarks/gpu_tail.py                       # CUDA: the 1b preset on one GPU (~30 s); CPU: tiny, seconds
    python benchmarks/gpu_tail.py --preset 1b --repeats 10 --grad-accum 2

What a step does besides forward and backward, on lesson 06's ZeRO-0 wrapper (lesson 07 at degree 1:
bf16 weights, float32 gradient buffers, float32 master and AdamW), each part timed on its own (CUDA
events; on a CPU the host's clock), the median of --repeats after one warm-up. No process group: at
ZeRO-0 on one device there is nothing to reduce or gather. The gradients are random bf16 tensors of
the parameters' shapes, large enough that clipping acts.

    part                          before                                     now
    accumulate, first micro-batch a zeroed flat float32 copy, added to the    one cast-and-copy into the buffer
                                  zeroed buffer
    accumulate, later micro-batch the same                                    _foreach_add_ into the buffer's views
    norm                          per-tensor pow(2).sum()                    _foreach_norm
    clip                          _foreach_mul_ of every gradient            1 / factor, for AdamW's grad_scale
    optimizer                     fused AdamW (found_inf)                    fused AdamW dividing by grad_scale
    publish cast                  float32 master -> bf16 weights             unchanged
    zero                          every buffer zeroed                        a flag per unit

Each line gives both times, the bytes per parameter each path moves (reads + writes, counted from
the dtypes: ``BYTES``) and the bandwidth that makes. The last line adds the parts up for a step of
--grad-accum micro-batches. The old accumulation and zeroing are written out here (as main had them
until the tail was fused); every other part calls the code the lessons run (train.global_grad_norm,
clip_factor, optimizer_step; the wrapper's own accumulation, publish and zero_grad), the old path
with StepSettings.tail "exact"'s choices, the new with "fused"'s.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from anywhere, as the other benchmarks

from picotron_like.lessons import load_lesson  # noqa: E402
from picotron_like.metrics import median_milliseconds  # noqa: E402
from picotron_like.model import GPT, count_parameters, get_config  # noqa: E402
from picotron_like.train import clip_factor, global_grad_norm, optimizer_step  # noqa: E402

zero = load_lesson("06_zero")

MAX_GRAD_NORM = 1.0
# Bytes per parameter, bf16 gradients (2) into float32 buffers, master and moments (4):
BYTES = {
    "accumulate, first micro-batch": (4 + (2 + 4) + (4 + 4 + 4), 2 + 4),   # zeros, cat, += | cat into the buffer
    "accumulate, later micro-batch": (4 + (2 + 4) + (4 + 4 + 4), 2 + 4 + 4),  # the same | add: grad, buffer r/w
    "norm": (4 + 4 + 4, 4),                     # pow(2) reads and writes, sum reads | one read
    "clip": (4 + 4, 0),                         # the gradients scaled in place | nothing
    "optimizer": (8 + 4 + 8 + 8, 8 + 8 + 8 + 8),   # weight, grad, m, v (new: the grad written back too)
    "publish cast": (4 + 2, 4 + 2),
    "zero": (4, 0),
}


def build(preset: str, device: torch.device):
    """Lesson 06's ZeRO-0 wrapper on the preset (built on the meta device, materialised on `device`
    with small random weights), fused AdamW over its master, and one micro-batch's gradients."""
    cfg = get_config(preset)
    with torch.device("meta"):
        module = GPT(cfg)
    module.to_empty(device=device)
    with torch.no_grad():
        for param in module.parameters():
            param.normal_(0.0, 0.02)
    model = zero.wrap_zero(module, None, 0, zero.Precision(torch.bfloat16, torch.float32))
    model.require_backward_grad_sync = False        # accumulate only: one device reduces nothing
    # The lesson's decay split, in the fused AdamW every lesson builds on CUDA (the CPU has one too).
    groups = zero.build_sharded_optimizer(model, 1e-4).param_groups
    optimizer = torch.optim.AdamW([{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups],
                                  lr=1e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    generator = torch.Generator(device).manual_seed(0)
    grads = [[torch.randn(p.shape, generator=generator, device=device, dtype=torch.bfloat16) for p in unit.params]
             for unit in model.units]
    return cfg, model, optimizer, grads


def accumulate_as_before(unit, grads: list[torch.Tensor]) -> None:
    """main's accumulation until the tail was fused: a zeroed flat float32 copy, then added."""
    flat = torch.zeros(unit.padded_numel, dtype=unit.grad_buffer.dtype, device=unit.grad_buffer.device)
    torch.cat([grad.reshape(-1) for grad in grads], out=flat[: unit.numel])
    unit.grad_buffer += flat


def measure(model, optimizer, grads, repeats: int, device: torch.device) -> dict[str, tuple[float, float]]:
    """{part: (old ms, new ms)}."""
    units = model.units

    def accumulate_new(first: bool):
        def run():
            for unit, unit_grads in zip(units, grads):
                unit.has_grad = not first
                model._reduce(unit, unit_grads)     # what the wrapper's gradient hooks call
        return run

    def accumulate_old():
        for unit, unit_grads in zip(units, grads):
            accumulate_as_before(unit, unit_grads)

    ms = partial(median_milliseconds, device=device, warmup=1, timed=repeats)
    times = {"accumulate, first micro-batch": (ms(accumulate_old), ms(accumulate_new(True)))}
    times["accumulate, later micro-batch"] = (times["accumulate, first micro-batch"][0], ms(accumulate_new(False)))
    model.gradients_to_master()
    master_grads = [piece.master.grad for unit in units for piece in unit.pieces]
    norm = global_grad_norm(master_grads, device)
    times["norm"] = (ms(lambda: global_grad_norm(master_grads, device)),
                     ms(lambda: global_grad_norm(master_grads, device, foreach=True)))
    times["clip"] = (ms(lambda: torch._foreach_mul_(master_grads, clip_factor(norm, MAX_GRAD_NORM))),
                     ms(lambda: clip_factor(norm, MAX_GRAD_NORM).reciprocal()))
    grad_scale = clip_factor(norm, MAX_GRAD_NORM).reciprocal()
    times["optimizer"] = (ms(lambda: optimizer_step(optimizer, norm)),
                          ms(lambda: optimizer_step(optimizer, norm, grad_scale)))
    publish = ms(model.publish_master)
    times["publish cast"] = (publish, publish)

    def zero_as_before():
        for unit in units:
            unit.grad_buffer.zero_()

    times["zero"] = (ms(zero_as_before), ms(model.zero_grad))
    return times


def report(times: dict, n_params: int, grad_accum: int) -> list[str]:
    """One line per part, then the step's total for `grad_accum` micro-batches."""
    lines = [f"{'part':<31}{'ms: old':>10}{'new':>9}{'B/param: old':>14}{'new':>5}{'GB/s: old':>11}{'new':>7}"]
    for part, (old, new) in times.items():
        old_bytes, new_bytes = BYTES[part]
        rate = [f"{b * n_params / (ms * 1e6):7.0f}" if b else "      -" for b, ms in ((old_bytes, old), (new_bytes, new))]
        lines.append(f"{part:<31}{old:10.3f}{new:9.3f}{old_bytes:14d}{new_bytes:5d}    {rate[0]}{rate[1]}")
    weight = {"accumulate, later micro-batch": grad_accum - 1}
    total = [sum(weight.get(part, 1) * ms[i] for part, ms in times.items()) for i in (0, 1)]
    total_bytes = [sum(weight.get(part, 1) * b[i] for part, b in BYTES.items()) for i in (0, 1)]
    lines.append(f"{f'tail of a step, {grad_accum} micro-batches':<31}{total[0]:10.3f}{total[1]:9.3f}"
                 f"{total_bytes[0]:14d}{total_bytes[1]:5d}    {total[0] / total[1]:6.2f}x faster")
    return lines


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", default=None, help="model shape (default: 1b on CUDA, tiny on a CPU)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per part (default: 10 on CUDA, 3 on a CPU)")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches in the step the total adds up")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    preset = args.preset or ("1b" if device.type == "cuda" else "tiny")
    repeats = args.repeats or (10 if device.type == "cuda" else 3)
    if args.grad_accum < 1 or repeats < 1:
        sys.exit("error: --grad-accum and --repeats must be at least 1")
    cfg, model, optimizer, grads = build(preset, device)
    n_params = count_parameters(cfg)["total"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"step tail, {preset} ({n_params:,} parameters, bf16 weights, float32 gradients and master, ZeRO-0) "
          f"on {name}, torch {torch.__version__}: median of {repeats}")
    for line in report(measure(model, optimizer, grads, repeats, device), n_params, args.grad_accum):
        print(line, flush=True)


if __name__ == "__main__":
    main()
