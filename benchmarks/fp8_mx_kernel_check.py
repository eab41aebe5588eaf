"""
Lesson 07's mxfp8 through the GPU's block-scaled kernel, against its exact emulation: one line.

    python benchmarks/fp8_mx_kernel_check.py          # a row of benchmarks/gpu_check.sh

Where 07_fp8.mx_kernel_runs says the kernel runs (Blackwell, sm_100+, with torch 2.7+ built against
CUDA 12.8+), the three matmuls of an FP8 linear layer (forward X W^T, input gradient dY W, weight
gradient dY^T X, each operand quantised as 07_fp8 quantises it) go through 07_fp8.mx_scaled_mm and
through the emulation (the dequantised values multiplied in float32), and every element must lie
within the bound below: "pass", or "FAIL" and a non-zero exit. Elsewhere (an H100, a CPU) it says
"not available" and exits 0: lesson 07 emulates mxfp8 there.

The bound, derived: the FP8 products times power-of-two scales are exact in float32, so the two
differ only by their float32 sums (K terms in some order: at most K 2^-24 of the sum of |terms|
each, so twice that between them) and the kernel's bf16 output (8 significant bits: half a
spacing is 2^-8 relative): |kernel - emulated| <= 2^-8 |emulated| + 3 K 2^-24 (|A| @ |B|).
"""

from __future__ import annotations

import sys

import torch

from picotron_like.lessons import load_lesson

# A layer of the 1b preset at 2,048 tokens: hidden 2048, its MLP's width 5632.
TOKENS, IN_FEATURES, OUT_FEATURES = 2048, 2048, 5632


def layer_operands(fp8, device) -> dict:
    """The three matmuls of one layer, as 07_fp8's FP8 linear layer quantises their operands:
    tokens of magnitudes 2^-8..2^8, weights ~0.02, output gradients ~1e-4 (mxfp8, e4m3 throughout)."""
    generator = torch.Generator(device=device).manual_seed(0)
    magnitudes = torch.exp2(torch.randint(-8, 9, (TOKENS, 1), generator=generator, device=device).float())
    x = torch.randn(TOKENS, IN_FEATURES, generator=generator, device=device) * magnitudes
    weight = 0.02 * torch.randn(OUT_FEATURES, IN_FEATURES, generator=generator, device=device)
    grad_y = 1e-4 * torch.randn(TOKENS, OUT_FEATURES, generator=generator, device=device) * magnitudes
    recipe, e4m3 = fp8.RECIPES["mxfp8"], fp8.E4M3

    def q(t, axis):
        return fp8.quantise(t, axis, e4m3, recipe)

    return {"forward": (q(x, 1), q(weight, 1).t()),
            "input gradient": (q(grad_y, 1), q(weight, 0)),
            "weight gradient": (q(grad_y, 0).t(), q(x, 0))}


def worst_share_of_bound(fp8, a, b) -> float:
    """The largest |kernel - emulated| over its bound (<= 1: within it)."""
    kernel = fp8.mx_scaled_mm(a, b, torch.float32)
    a_values, b_values = a.dequantise(), b.dequantise()
    emulated = a_values @ b_values
    bound = 2.0 ** -8 * emulated.abs() + 3 * a_values.shape[1] * 2.0 ** -24 * (a_values.abs() @ b_values.abs())
    return ((kernel - emulated).abs() / bound.clamp(min=torch.finfo(torch.float32).tiny)).max().item()


def main() -> int:
    fp8 = load_lesson("07_fp8")
    build = f"torch {torch.__version__}, CUDA {torch.version.cuda}"
    if not torch.cuda.is_available():
        print(f"mxfp8 kernel: not available (no CUDA device; {build}): lesson 07 emulates mxfp8 here")
        return 0
    device = torch.device("cuda")
    capability = torch.cuda.get_device_capability(device)
    where = f"{torch.cuda.get_device_name(device)} (sm_{capability[0]}{capability[1]}), {build}"
    if not fp8.mx_kernel_runs(capability, str(torch.__version__), torch.version.cuda):
        print(f"mxfp8 kernel: not available on {where}: lesson 07 emulates mxfp8 here")
        return 0
    worst = {name: worst_share_of_bound(fp8, a, b) for name, (a, b) in layer_operands(fp8, device).items()}
    verdict = "pass" if all(share <= 1 for share in worst.values()) else "FAIL"
    print(f"mxfp8 kernel vs emulation on {where}: {verdict} ("
          + ", ".join(f"{name} {share:.3f}" for name, share in worst.items()) + " of the bound)")
    return 0 if verdict == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
