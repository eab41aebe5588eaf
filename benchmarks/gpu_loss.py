"""
The LM head's loss on one GPU, each way the project can run it: forward and backward time and
peak memory at T = 8192 tokens, V = 128,256 words, h = 2048 (Llama 3's vocabulary, the 1b
preset's width, micro-batch 4 x 2048), bf16. One line per row:

    full logits            F.cross_entropy on the whole logits (loss.cross_entropy_loss)
    chunked, before #37    the chunked loss as it ran before issue 37: eager bodies, backward by
                           chunks of tokens adding into dW, the CPU's 256 MiB budget
    chunked eager          eager bodies, the device's budget, backward as LossSettings() chooses
    chunked compiled       the bodies through TorchInductor (what 07's --compile runs)

Time: CUDA events around forward and backward, the median of 10 after 3 untimed (which compile;
--tiny: of 3 after 1).
Peak: torch.cuda.max_memory_allocated during one forward and backward, less what was allocated
before it (the inputs, the weight). Each row's loss is printed beside, as a check that they agree.

    PYTHONPATH=. python benchmarks/gpu_loss.py          # a GPU: about 20 s on an H100, most of it compiling
    PYTHONPATH=. python benchmarks/gpu_loss.py --tiny   # any machine (a CPU without a GPU runs this):
                                                        # seconds; T = 128, V = 1024, h = 32, float32, the
                                                        # compiled row traced by Dynamo's "eager" backend
"""

from __future__ import annotations

import argparse

import torch

from picotron_like.loss import LOSS_CHUNK_BYTES, LossSettings, cross_entropy_loss, linear_cross_entropy
from picotron_like.metrics import median_milliseconds


def rows(tiny: bool) -> dict[str, LossSettings | None]:
    """Each row's name and the settings of its chunked loss (None: the whole logits)."""
    return {"full logits (F.cross_entropy)": None,
            "chunked, before issue 37 (eager, by tokens, 256 MiB)":
                LossSettings(backward="tokens", chunk_bytes=LOSS_CHUNK_BYTES),
            "chunked eager": LossSettings(),
            "chunked compiled": LossSettings(compile_backend="eager" if tiny else "inductor")}


def peak_gib(step, device: torch.device) -> str:
    if device.type != "cuda":
        return "peak n/a on a CPU"
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return f"peak {(torch.cuda.max_memory_allocated() - before) / 2**30:.2f} GiB above the inputs"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="small shapes in float32 (the default without a GPU)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    tiny = device.type == "cpu"
    tokens, words, hidden, dtype = (128, 1024, 32, torch.float32) if tiny else (8192, 128256, 2048, torch.bfloat16)
    warmup, timed = (1, 3) if tiny else (3, 10)
    generator = torch.Generator(device).manual_seed(0)
    inputs = (torch.randn(tokens, hidden, device=device, generator=generator) / 4).to(dtype).requires_grad_()
    weight = (torch.randn(words, hidden, device=device, generator=generator) / 16).to(dtype).requires_grad_()
    targets = torch.randint(words, (tokens,), device=device, generator=generator)
    print(f"loss: T={tokens} V={words} h={hidden} {str(dtype).removeprefix('torch.')} on {device.type}"
          + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else " (tiny)")
          + f"; forward + backward, median of {timed}", flush=True)
    for name, settings in rows(tiny).items():
        def step():
            inputs.grad = weight.grad = None
            loss = (cross_entropy_loss(inputs @ weight.t(), targets) if settings is None else
                    linear_cross_entropy(inputs, weight, targets, "mean", settings))
            loss.backward()
            return loss

        ms = median_milliseconds(step, device, warmup, timed)
        peak = peak_gib(step, device)
        print(f"  {name:<55} {ms:9.2f} ms  {peak}  loss {step().item():.6f}", flush=True)


if __name__ == "__main__":
    main()
