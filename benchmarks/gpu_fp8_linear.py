"""
Lesson 07's FP8 linear layer against bf16, one linear of the 1b and 8b presets per line.

    python benchmarks/gpu_fp8_linear.py          # a row of benchmarks/gpu_check.sh: ~40 s on an H100
    python benchmarks/gpu_fp8_linear.py --tiny   # the CPU: the tiny preset's shapes, a few seconds

For each distinct linear of a block (q; k and v; o; gate and up; down) and the LM head, at 8,192
tokens: forward and backward of nn.Linear in bf16, and of 07_fp8's FP8 layer with tensorwise and
rowwise scales, each with the recipe's fast accumulation (tensorwise: the forward's GEMM; rowwise:
all three) and without it (--no-fp8-fast-accum), the quantisation compiled as --compile runs it
(--eager-quantise: as without --compile). Milliseconds from CUDA events, the median of 10 after 3
warm-ups; each FP8 time with its speed-up over bf16; and the shape rule's choice for the linear's
group on a GPU (07_fp8.groups_in_fp8: whether FP8 pays there), to hold the rule against the
measurement. The head never goes to FP8 in lesson 07 (its logits feed the softmax): measured to show
what it would gain. --tiny: the tiny preset at 256 tokens, timed with the CPU's clock, quantisation
eager, one run each (a check that the script runs, not a measurement).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from picotron_like.lessons import load_lesson
from picotron_like.model import get_config

TOKENS, WARMUP, REPEATS = 8192, 3, 10
VARIANTS = ("tensorwise", "rowwise")


def linear_shapes(cfg) -> list[tuple[str, str | None, int, int]]:
    """(name, 07_fp8 group, in-features, out-features) of each distinct linear of a block, and the head."""
    h, attention = cfg.hidden, cfg.n_heads * cfg.head_dim
    return [("q", "qkv", h, attention), ("k, v", "qkv", h, cfg.n_kv_heads * cfg.head_dim), ("o", "o", attention, h),
            ("gate, up", "gate_up", h, cfg.ffn_hidden), ("down", "down", cfg.ffn_hidden, h),
            ("head", None, h, cfg.vocab_size)]


def forward_backward_ms(layer, x: torch.Tensor, grad_y: torch.Tensor, warmup: int, repeats: int) -> float:
    """The median milliseconds of one forward and backward of `layer` (CUDA events on a GPU)."""

    def once():
        x.grad = layer.weight.grad = None
        layer(x).backward(grad_y)

    for _ in range(warmup):
        once()
    if x.device.type != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            once()
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        once()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def measure_row(fp8, cfg, name: str, group: str | None, shape: tuple[int, int, int], settings) -> str:
    """One linear: bf16, then each recipe with and without fast accumulation, and the rule's choice."""
    tokens, in_features, out_features = shape
    device, dtype = settings.device, torch.bfloat16
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, in_features, device=device, dtype=dtype, generator=generator).requires_grad_()
    grad_y = 1e-3 * torch.randn(tokens, out_features, device=device, dtype=dtype, generator=generator)

    def timed(recipe) -> float:
        layer = torch.nn.Linear(in_features, out_features, bias=False, device=device, dtype=dtype)
        if recipe is not None:
            fp8.to_fp8([layer], recipe, None)
        return forward_backward_ms(layer, x, grad_y, settings.warmup, settings.repeats)

    bf16 = timed(None)
    parts = [f"bf16 {bf16:.3f} ms"]
    for recipe_name in VARIANTS:
        recipe = replace(fp8.RECIPES[recipe_name], compiled=settings.compiled)
        fast, accurate = timed(recipe), timed(replace(recipe, fast_accum=frozenset()))
        rule = ("never (the head)" if group is None else
                "fp8" if fp8.groups_in_fp8(cfg, recipe_name, tokens, 1, on_cuda=True)[group] else "bf16")
        parts.append(f"{recipe_name} {fast:.3f} ms {bf16 / fast:.2f}x, without fast accumulation {accurate:.3f} ms "
                     f"{bf16 / accurate:.2f}x, shape rule: {rule}")
    return f"{settings.preset} {name} ({tokens} x {in_features} -> {out_features}): " + " | ".join(parts)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    parser.add_argument("--tiny", action="store_true", help="the tiny preset at 256 tokens on the CPU, in seconds")
    parser.add_argument("--eager-quantise", action="store_true",
                        help="the quantisation as eager kernels (lesson 07 without --compile, or with "
                             "--no-fp8-fused-quantise)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    fp8 = load_lesson("07_fp8")
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    presets, tokens = (("1b", "8b"), TOKENS) if not args.tiny else (("tiny",), 256)
    warmup, repeats = (WARMUP, REPEATS) if cuda else (0, 1)
    where = f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}" if cuda else "CPU"
    compiled = cuda and not args.eager_quantise
    print(f"FP8 linear vs bf16 on {where}: forward + backward, median of {repeats}, quantisation "
          f"{'compiled' if compiled else 'eager'}")
    for preset in presets:
        cfg = get_config(preset)
        settings = argparse.Namespace(device=device, warmup=warmup, repeats=repeats, compiled=compiled, preset=preset)
        for name, group, in_features, out_features in linear_shapes(cfg):
            print(measure_row(fp8, cfg, name, group, (tokens, in_features, out_features), settings), flush=True)


if __name__ == "__main__":
    main()
