"""
A rank's share of the reference GPT, built on the meta device and given its values only once the
lessons have cut it.

A model built whole and then cut holds, for a moment, the whole model on every rank: the 8b
preset is 32 GB of float32 per rank, 8 ranks per node. Built on the meta device instead (shapes,
no values), the lessons cut it there, and each parameter then gets the values of the box of the
reference tensor it holds (checkpoint.reference_offsets, the rule checkpoints reshard by): the
run starts from exactly the parameters of a model built whole and then cut
(tests/test_full_5d_materialise.py), but no rank ever holds more than its share.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from picotron_like.checkpoint import reference_offsets, reference_shapes
from picotron_like.model import reference_init


@dataclass(frozen=True)
class ReferenceTensors:
    """The reference GPT's tensors as reference_init defines them: the config and seed that give
    their values, and each one's whole shape."""

    cfg: object
    seed: int
    shapes: dict

    @classmethod
    def of(cls, cfg, seed: int) -> "ReferenceTensors":
        return cls(cfg, seed, reference_shapes(cfg))

    def box(self, name: str, offsets: tuple, shape) -> torch.Tensor:
        """Elements [offsets, offsets + shape) of tensor `name`, on the CPU. The whole tensor is
        drawn and dropped: its generator's one stream defines every value, a slice cannot be drawn
        alone."""
        whole = reference_init(name, self.shapes[name], self.cfg, self.seed)
        held = whole[tuple(slice(start, start + size) for start, size in zip(offsets, shape))]
        # A copy of the slice alone lets the whole tensor go.
        return held.clone(memory_format=torch.contiguous_format) if held.numel() < whole.numel() else held


def materialise_held_parameters(chunks: list, reference: ReferenceTensors | None, grid, device) -> None:
    """Give the chunks, built on the meta device and cut there by the lessons, their values on
    `device`: each parameter those of the box of the reference tensor it holds, each buffer the
    reference's zeros (an MoE layer's router_bias and expert_load).

    Speed: reference_init draws a tensor on one CPU thread (1e8 normals ~0.75 s), each from a
    generator of its own, and torch releases the GIL while it draws: a pool draws as many
    tensors at once as this rank has cores (drawing_threads). The host holds the whole tensors
    being drawn, one per thread. With no `reference` (a run that resumes, or starts from a Hub
    folder, and so overwrites every value next) nothing is drawn: the parameters hold NaN until
    loaded, so that one the load missed would make the first loss NaN instead of training unnoticed.

    Identity: torch.utils.swap_tensors gives each parameter object its values and keeps the
    object, which the modules and the lessons' wrappers refer to, but it drops what the lessons
    attached to it: attributes (02's tp_split_dim and tp_replicated) and gradient hooks (02's sum
    over tp of a replicated gain's gradient under sequence parallelism) stay with the meta
    tensor. Both are put back (put_values_in). ZeRO (06) attaches its hooks after this."""
    if torch.device(device).type == "meta":
        return      # a model built to be counted (a memory plan's): shapes only, nothing to draw
    named = [(name, param) for chunk in chunks for name, param in chunk.named_parameters()]
    if reference is None:       # made on the device itself: nothing to draw, nothing to copy
        for _, param in named:
            put_values_in(param, torch.full_like(param, float("nan"), device=device))
    else:
        def held_values(name: str, param) -> torch.Tensor:
            return reference.box(name, reference_offsets(name, param, param.shape, grid), param.shape)

        # The pool only draws on the CPU; the copies to the device stay on this thread, whose current
        # CUDA device is the rank's (init_distributed set it), so no other thread touches CUDA.
        with ThreadPoolExecutor(drawing_threads()) as pool:
            for (_, param), values in zip(named, pool.map(held_values, *zip(*named))):
                put_values_in(param, values.to(device))
    for buffer in (buffer for chunk in chunks for buffer in chunk.buffers()):
        torch.utils.swap_tensors(buffer, torch.zeros_like(buffer, device=device))


def put_values_in(param: torch.nn.Parameter, values: torch.Tensor) -> None:
    """`param`, a meta tensor, holds `values` from now on, with its attributes and gradient hooks."""
    attributes, gradient_hooks = dict(param.__dict__), param._backward_hooks
    torch.utils.swap_tensors(param, torch.nn.Parameter(values, requires_grad=param.requires_grad))
    param.__dict__.update(attributes)
    if gradient_hooks:
        param._backward_hooks = gradient_hooks      # the setter registers them on the new tensor


def drawing_threads() -> int:
    """This rank's share of the cores it may run on: a node's ranks draw at the same time."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
