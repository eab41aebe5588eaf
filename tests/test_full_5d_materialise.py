"""Lesson 07 builds each rank's model on the meta device, lets the lessons cut it there, and only then
gives each parameter its values (materialise_held_parameters): proven here to be exactly the
reference GPT's values, cut as lessons 05 and 02 cut them, bit for bit, with what the lessons
attached to the parameters kept.

One spawn of 4 gloo ranks builds three layouts with 07's own parallelize() from its own flags:
tensor parallelism with sequence parallelism (whose gradient hooks on the replicated norm gains
must survive the materialisation), experts cut over ep and then over tp under ZeRO-3, and a
pipeline of 3 layers over 2 stages (split 2 + 1) with tp-split experts. For every parameter the
rank holds, its weights (gathered from ZeRO's shards) must equal the reference tensor's slice,
every buffer the reference's, and nothing may be left on the meta device. That training from
these parameters equals one device is what tests/test_full_5d*.py prove.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from picotron_like.model import GPT
from picotron_like.testing import run_ranks
from picotron_like.topology import GridShape, ProcessGrid
from test_full_5d import CFG, CPU, MOE_CFG, SEED, flags, lesson
from test_zero import gathered

# name: (grid, ep, ZeRO stage, model, extra flags)
LAYOUTS = {"dp2 x tp2 SP ZeRO-1": (GridShape(dp=2, tp=2), 1, 1, CFG, ("--sequence-parallel",)),
           "dp2 x tp2 moe ep2 ZeRO-3": (GridShape(dp=2, tp=2), 2, 3, MOE_CFG, ()),
           "pp2 x tp2 moe, 3 layers as 2 + 1, ZeRO-1": (GridShape(pp=2, tp=2), 1, 1, replace(MOE_CFG, n_layers=3), ())}
# The cut lesson 02 records on each kind of parameter (tp_split_dim), lesson 07's for the experts.
SPLIT_DIMS = {"q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "o_proj.weight": 1,
              "gate_proj.weight": 0, "up_proj.weight": 0, "down_proj.weight": 1,
              "experts.gate_proj": 1, "experts.up_proj": 1, "experts.down_proj": 2, "tok_embeddings.weight": 0,
              "lm_head.weight": 0}


def reference_share(whole: torch.Tensor, name: str, split_dim, grid: ProcessGrid) -> torch.Tensor:
    """The reference tensor as this rank holds it: lesson 05's experts [r E/ep, (r+1) E/ep) of
    dim 0, then lesson 02's tp part r along the recorded dim."""
    if name.split(".")[-2] == "experts":
        whole = whole.chunk(grid.ep_size, dim=0)[grid.ep_rank]
    return whole if split_dim is None else whole.chunk(grid.tp_size, dim=split_dim)[grid.tp_rank]


def materialised_layouts() -> dict:
    full_5d = lesson()
    results = {}
    for layout, (shape, ep, stage, cfg, extra) in LAYOUTS.items():
        grid = ProcessGrid(shape, ep=ep)
        args = full_5d.parse_args(flags(shape, stage, "none", extra))
        model, _ = full_5d.parallelize(full_5d.expert_parallel.moe_config(cfg, args), grid, args, CPU)
        reference = GPT(cfg, seed=SEED)
        whole = dict(reference.named_parameters())
        params = dict(model.module.named_parameters())
        split_dims = {name: getattr(param, "tp_split_dim", None) for name, param in params.items()}
        weights = gathered(model, lambda unit: unit.master)
        reference_buffers = dict(reference.named_buffers())
        results[layout] = {
            "names": sorted(weights), "split_dims": split_dims,
            "replicated": sorted(name for name, param in params.items() if getattr(param, "tp_replicated", False)),
            "unequal": [name for name, weight in weights.items()
                        if not torch.equal(weight, reference_share(whole[name], name, split_dims[name], grid))],
            "buffers": {name: torch.equal(buffer, reference_buffers[name]) for name, buffer in model.module.named_buffers()},
            "devices": {str(tensor.device) for tensor in (*params.values(), *model.module.buffers())},
            # Sequence parallelism's hook sums a replicated gain's gradient over tp: 1 per rank, tp in all.
            "gain_gradients": {name: torch.autograd.grad(param.sum(), param)[0].unique().tolist()
                               for name, param in params.items() if name.endswith("norm.weight")}
            if args.sequence_parallel else {}}
    return results


def test_each_rank_holds_exactly_the_reference_values_of_its_share_with_the_lessons_attributes_and_hooks():
    runs = run_ranks(4, materialised_layouts, timeout_s=120)
    for layout, (shape, ep, stage, cfg, extra) in LAYOUTS.items():
        for rank, run in enumerate(runs):
            where = f"{layout}, rank {rank}"
            assert run[layout]["names"], where
            assert run[layout]["unequal"] == [], where
            assert all(run[layout]["buffers"].values()) and bool(run[layout]["buffers"]) == bool(cfg.n_experts), where
            assert run[layout]["devices"] == {"cpu"}, where
            for name, split_dim in run[layout]["split_dims"].items():
                assert split_dim == next((dim for suffix, dim in SPLIT_DIMS.items() if name.endswith(suffix)), None), \
                    f"{where}: {name}"
            assert all(name.endswith(("norm.weight", "router.weight")) for name in run[layout]["replicated"]), where
            assert any(name.endswith("norm.weight") for name in run[layout]["replicated"]), where
            if "--sequence-parallel" in extra:
                assert run[layout]["gain_gradients"], where
                assert all(values == [float(shape.tp)] for values in run[layout]["gain_gradients"].values()), where
