"""
Causal attention at the 1b preset's shapes on one GPU, through each of SDPA's backends and then
through the priority the training loop enters (model.attention_backends: cuDNN, flash, efficient,
math): forward and backward time, bf16, batch 4 x 2048 tokens, 32 query heads over 8 K/V heads of
64, called as the model calls it (K and V not repeated: enable_gqa). One line per backend, "not
available" with torch's reason for one that refuses the shape; then each --attention-priority
(cudnn: the model's default, torch: torch's own order), its time and the backend whose kernels it
ran (the same CUDA kernel names, from the profiler).

Time: CUDA events around forward and backward, the median of 10 after 3 untimed.

    PYTHONPATH=. python benchmarks/gpu_attention.py          # a GPU: about 10 s on an H100
    PYTHONPATH=. python benchmarks/gpu_attention.py --tiny   # any machine (a CPU without a GPU runs
                                                             # this): seconds; 1 x 64 tokens, 4 heads
                                                             # over 2 of 16, float32
"""

from __future__ import annotations

import argparse
import warnings

import torch
from torch.nn.attention import sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from picotron_like.metrics import median_milliseconds
from picotron_like.model import CUDA_ATTENTION_PRIORITY, attention_backends, causal_attention, get_config


def kernel_names(step, device: torch.device) -> frozenset[str]:
    """The device kernels one step() launches (empty on a CPU)."""
    if device.type != "cuda":
        return frozenset()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return frozenset(event.name for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="small shapes in float32 (the default without a GPU)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    cfg = get_config("1b")
    if device.type == "cuda":
        batch, seq, dtype = 4, 2048, torch.bfloat16
        heads, kv_heads, head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        warmup, timed = 3, 10
    else:
        batch, seq, dtype = 1, 64, torch.float32
        heads, kv_heads, head_dim = 4, 2, 16
        warmup, timed = 1, 3
    generator = torch.Generator(device).manual_seed(0)
    q, k, v = (torch.randn(batch, n, seq, head_dim, device=device, generator=generator, dtype=dtype).requires_grad_()
               for n in (heads, kv_heads, kv_heads))
    grad = torch.randn(batch, heads, seq, head_dim, device=device, generator=generator, dtype=dtype)
    print(f"attention: batch {batch} x seq {seq}, {heads} heads over {kv_heads} K/V heads of {head_dim}, causal, "
          f"{str(dtype).removeprefix('torch.')} on {device.type}"
          + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else " (tiny)")
          + f"; forward + backward, median of {timed}", flush=True)

    def step_in(context):
        def step():
            q.grad = k.grad = v.grad = None
            with context():
                causal_attention(q, k, v).backward(grad)
        return step

    kernels = {}
    for backend in CUDA_ATTENTION_PRIORITY:
        step = step_in(lambda backend=backend: sdpa_kernel(backend))
        try:
            with warnings.catch_warnings(record=True) as refusals:     # torch warns why, then raises
                warnings.simplefilter("always")
                ms = median_milliseconds(step, device, warmup, timed)
        except RuntimeError as error:
            reasons = [str(refusal.message) for refusal in refusals] + [str(error)]
            print(f"  {backend.name:<22} not available ({reasons[0].strip().splitlines()[0][:200]})", flush=True)
            continue
        kernels[backend.name] = kernel_names(step, device)
        print(f"  {backend.name:<22} {ms:9.3f} ms", flush=True)
    for priority, label in (("cudnn", "priority cudnn"), ("torch", "priority torch")):
        step = step_in(lambda priority=priority: attention_backends(device.type, priority))
        ms = median_milliseconds(step, device, warmup, timed)
        ran = kernel_names(step, device)
        same = [name for name, names in kernels.items() if names and names == ran]
        print(f"  {label:<22} {ms:9.3f} ms  "
              + (f"ran {same[0]}'s kernels" if same else "its kernels match no backend's alone" if ran
                 else "torch's CPU choice (no priority on a CPU)"), flush=True)


if __name__ == "__main__":
    main()
