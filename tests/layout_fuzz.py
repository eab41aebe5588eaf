"""The layout fuzzer: random command lines of lesson 07, each proven equal to one device or refused cleanly.

Composed parallelisms are where training code ships silent numerical bugs: every technique is
right on its own, and a pair of them meets at a seam nobody tested (a gradient summed over the
wrong group, a shard cut on the wrong axis). The fixed layouts of the other tests cover the seams
someone thought of; this draws the rest at random from everything 07's flags can say on at most
8 CPU ranks:

    degrees      dp, pp, cp, tp (odd ones: 3), the world size, ep with a mixture of experts
    per axis     ZeRO stage 0-3, schedule afab / 1f1b / interleaved and its virtual stages / zero-bubble,
                 ring (fused or plain blocks) or Ulysses, zigzag or not, sequence parallelism
    model        dense or MoE (softmax or sigmoid router, shared expert, aux / z losses,
                 capacity, bias balancing, grouped or looped experts), 2-6 layers (uneven stages)
    data         every target, or targets masked as fine-tuning data is (a row all padding)
    everywhere   recompute none / selective / full, micro-batch size and count, a batch-size ramp,
                 AdamW or Muon

Each draw is one command line. 07's own checks (train.checked_plan with 07's validate, exactly
what plan_run runs before any process group) sort it:

- accepted: the layout trains STEPS steps on real gloo ranks through 07's parallelize() and
  lesson 06's step, as main() does, and every step's loss and gradient norm, the last step's
  gradients before and after clipping, the final parameters and router biases equal those of the
  one-device reference (picotron_like.testing.train_reference) on the same data; under Muon (at
  the draw's lr) the ranks step with the reference's gradients (tests/test_full_5d.py's replay:
  Newton-Schulz in bf16 would grow a float32 rounding into 0.06 lr in three steps). With experts
  the reference is teacher-forced to the distributed run's routing, and every place where its own
  choice differs must be a float32 tie (lesson 05's tests explain why). Tolerances are lesson
  06's: gradients 1e-6, losses and norms 1e-5, parameters 1e-2 lr with AdamW eps 1e-4. And every
  member of every group issued the same collectives in the same order, all-to-all splits and
  point-to-point transfers matching (picotron_like.testing.collective_sequences_checked): what
  NCCL needs and, unlike gloo, does not check.
- refused: `python 07_full_5d.py <flags>` with the world size in WORLD_SIZE, and no other rank
  anywhere, must print exactly one `error:` line (the one checked_plan raised), nothing else,
  and exit with code 2. A refusal that came after the process group would wait for ranks that
  never come, and the subprocess's timeout fails the draw.

A failing draw prints its seed and its command line, so `python tools/fuzz_layouts.py --seed S
--n 1` replays it. Draws of the same world size share one spawn of ranks (a spawn costs seconds).
"""

from __future__ import annotations

import math
import os
import random
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import partial

import torch

import picotron_like.moe as moe_module
from picotron_like.data import BatchRamp, BatchShape, TokenBatches, builtin_corpus_paths
from picotron_like.lessons import REPO_ROOT, load_lesson
from picotron_like.model import get_config
from picotron_like.testing import (CollectiveMismatch, RankChecks, collective_sequences_checked, ignore_targets,
                                   masked_step_batch, run_ranks, train_reference)
from picotron_like.topology import ConfigError, ProcessGrid
from picotron_like.train import checked_plan
from test_full_5d import muon_optimizer, optimizer_of
from test_zero import gathered

SEQUENCES, SEQ, STEPS, LR, SEED, MAX_GRAD_NORM = 12, 48, 3, 3e-3, 3, 0.5
ADAM_EPS = 1e-4
GRAD_TOLERANCE = dict(rtol=0, atol=1e-6)
LOSS_TOLERANCE = dict(rtol=0, atol=1e-5)
PARAM_TOLERANCE = dict(rtol=0, atol=1e-2 * LR)
# After the first AdamW step the two sides' parameters differ by float32 rounding (~1e-7, measured),
# and a gradient moves with them by the loss's curvature: on these runs the last step's gradients
# are ~20 times larger than the first's and differ by up to ~1e-5 relative (measured), the norm by
# ~6e-6. Later steps are therefore compared relative to each tensor's largest element: a bug that
# shows only after a step (a stale shard, a missed reduction, a bias not moved) changes them by order 1.
LATER_STEP_RTOL = 1e-4
FLIP_MARGIN = 1e-5      # lesson 05's: a top-k margin below this is a float32 tie between layouts
MAX_WORLD = 8
CPU = torch.device("cpu")


def mask_targets(step: int, targets: torch.Tensor) -> torch.Tensor:
    """Fine-tuning's masks (ignore_targets), row 7 all padding: in a batch-size ramp's step of
    fewer sequences its last row, unless it has only one (a step needs a target)."""
    return ignore_targets(step, targets, ignored_rows=(min(7, len(targets) - 1),) if len(targets) > 1 else ())


@dataclass(frozen=True)
class Draw:
    """One command line of lesson 07 and the world it is launched in."""

    seed: int
    argv: tuple[str, ...]
    world_size: int
    masked: bool = False          # targets masked (test data only: no flag says it)

    @property
    def command(self) -> str:
        masked = "   # targets masked" if self.masked else ""
        return f"torchrun --nproc_per_node={self.world_size} 07_full_5d.py {' '.join(self.argv)}{masked}"

    def __str__(self) -> str:
        return f"draw seed {self.seed}: {self.command}"


# ----------------------------------------------------------------------------- drawing layouts


def draw(seed: int) -> Draw:
    """One command line from everything 07's flags can say; some of them 07 refuses (tp = 3 with two
    KV heads, an ep that does not divide, zero-bubble with recomputation, ...), which is the point."""
    rng = random.Random(seed)
    degrees = {"tp": rng.choice((1, 1, 2, 2, 3)), "cp": rng.choice((1, 1, 2, 3, 4)), "pp": rng.choice((1, 1, 2, 3)),
               "dp": rng.choice((1, 2, 2, 3, 4, 6))}
    for axis in rng.sample(list(degrees), len(degrees)):       # shrink, in random order, to the machine
        while degrees[axis] > 1 and _product(degrees) > MAX_WORLD:
            degrees[axis] = 1
    dp, pp, cp, tp = degrees["dp"], degrees["pp"], degrees["cp"], degrees["tp"]
    moe = rng.random() < 0.4
    argv = ["--preset", "tiny-moe" if moe else "tiny", "--dp", str(dp), "--pp", str(pp), "--cp", str(cp),
            "--tp", str(tp), "--zero-stage", str(rng.choice((0, 1, 2, 3) if pp == 1 else (0, 1, 1, 2, 3)))]
    virtual = 1
    if pp > 1:
        schedule = rng.choice(("afab", "1f1b", "interleaved"))
        # Half of the 1F1B draws become zero-bubble, decided by a stream of their own: every other
        # choice of every seed stays what it was before zero-bubble was drawn.
        if schedule == "1f1b" and random.Random(f"zero-bubble {seed}").random() < 0.5:
            schedule = "zero-bubble"
        argv += ["--schedule", schedule]
        if schedule == "interleaved":
            virtual = rng.choice((2, 2, 3))
            argv += ["--virtual-stages", str(virtual)]
    argv += ["--n-layers", str(rng.choice([n for n in (2, 3, 4, 5, 6) if n >= pp * virtual] or [pp * virtual]))]
    if cp > 1:
        mode = rng.choice(("ring", "ring", "ulysses"))
        argv += ["--cp-mode", mode, "--zigzag" if rng.random() < 0.7 else "--no-zigzag"]
        if mode == "ring":
            argv += ["--ring-kernel", rng.choice(("fused", "plain"))]
    if tp > 1 and rng.random() < 0.5:
        argv += ["--sequence-parallel"]
    if moe:
        argv += _moe_flags(rng, dp * cp)
    # Half of the ZeRO-3 draws keep their units gathered from forward to backward (under a pipeline:
    # through the step), decided by a stream of their own, as zero-bubble is.
    if argv[argv.index("--zero-stage") + 1] == "3" and random.Random(f"kept gathered {seed}").random() < 0.5:
        argv += ["--no-reshard-after-forward"]
    # A third of the draws step with Muon, decided by a stream of their own, as zero-bubble is.
    if random.Random(f"muon {seed}").random() < 1 / 3:
        argv += ["--optimizer", "muon", "--muon-lr", str(LR)]
    # A fifth of the AdamW draws offload it to the host, decided by a stream of their own (07 refuses Muon's).
    elif random.Random(f"offload optimizer {seed}").random() < 1 / 5:
        argv += ["--offload", "optimizer"]
    # A fifth of the draws offload activations too, from a stream of their own (07 refuses zero-bubble's), half of
    # them choosing how many of each chunk's first blocks (all of a chunk's included).
    activations = random.Random(f"offload activations {seed}")
    if "zero-bubble" not in argv and activations.random() < 1 / 5:
        argv += ["activations"] if argv[-2:] == ["--offload", "optimizer"] else ["--offload", "activations"]
        if activations.random() < 0.5:
            argv += ["--offload-blocks", str(activations.choice((1, 2, 3)))]
    micro = rng.choice([m for m in (1, 2, 3) if SEQUENCES % (m * dp) == 0] or [1])
    grad_accum = max(1, SEQUENCES // (micro * dp))
    argv += ["--recompute", rng.choice(("none", "selective", "full")), "--seq-len", str(SEQ),
             "--micro-batch-size", str(micro), "--grad-accum", str(grad_accum), "--seed", str(SEED),
             "--lr", str(LR), "--max-grad-norm", str(MAX_GRAD_NORM), "--steps", str(STEPS)]
    # A batch-size ramp in some draws, drawn from a generator of its own, so that every other
    # choice of a seed stays what it was: a first step between the least a layout allows (a
    # micro-batch per dp rank, pp of them under a pipeline) and the full batch, often rounded up.
    ramp = random.Random(f"batch ramp {seed}")
    least, full = micro * SEQ * dp * (pp if pp > 1 else 1), micro * SEQ * dp * grad_accum
    if least < full and ramp.random() < 0.2:
        argv += ["--batch-ramp", str(ramp.randrange(least, full)), str(ramp.choice((600, 1200)))]
    world = dp * pp * cp * tp
    if rng.random() < 0.05:
        world += 1                  # a launch that does not match the degrees
    return Draw(seed, tuple(argv), world, masked=rng.random() < 0.3)


def _product(degrees: dict) -> int:
    return degrees["dp"] * degrees["pp"] * degrees["cp"] * degrees["tp"]


def _moe_flags(rng: random.Random, dp_cp: int) -> list[str]:
    """tiny-moe has 4 experts, top-2: --ep among the degrees that may or may not divide both."""
    flags = []
    ep = rng.choice((None, None, 1, 2, 4, 3))
    if ep is not None:
        flags += ["--ep", str(ep)]
    router = rng.choice(("softmax", "sigmoid"))
    flags += ["--router", router]
    if rng.random() < 0.3:
        flags += ["--shared-experts", "1"]
    if rng.random() < 0.5:
        flags += ["--aux-loss-coef", "0.01"]
    if router == "softmax" and rng.random() < 0.3:
        flags += ["--z-loss-coef", "0.001"]
    if rng.random() < 0.15:
        flags += ["--capacity-factor", "1.0"]
    if rng.random() < 0.3:
        flags += ["--bias-update-rate", "0.001"]
    if rng.random() < 0.3:
        flags += ["--no-grouped-mm"]
    return flags


def verdict(layout: Draw) -> ConfigError | ValueError | None:
    """07's own checks on the draw, as plan_run runs them before any process group: None if 07
    accepts it, else the error whose one line it prints."""
    full_5d = load_lesson("07_full_5d")
    try:
        checked_plan(full_5d.parse_args(list(layout.argv)), full_5d.validate, full_5d.expert_parallel.moe_config,
                     layout.world_size)
    except (ConfigError, ValueError) as error:
        return error
    return None


def draws(first_seed: int, n_accepted: int, n_refused: int) -> tuple[list[Draw], list[tuple[Draw, Exception]]]:
    """The first `n_accepted` accepted and `n_refused` refused draws from seed `first_seed` on."""
    accepted, refused, seed = [], [], first_seed
    while len(accepted) < n_accepted or len(refused) < n_refused:
        layout = draw(seed)
        error = verdict(layout)
        if error is None and len(accepted) < n_accepted:
            accepted.append(layout)
        elif error is not None and len(refused) < n_refused:
            refused.append((layout, error))
        seed += 1
    return accepted, refused


def features(layout: Draw) -> set[str]:
    """What a draw exercises, in words (the fixed set of CI's draws must cover every one)."""
    argv = list(layout.argv)

    def flag(name: str):
        return argv[argv.index(name) + 1] if name in argv else None

    dp, pp, cp, tp = (int(flag(axis)) for axis in ("--dp", "--pp", "--cp", "--tp"))
    moe, virtual = flag("--preset") == "tiny-moe", int(flag("--virtual-stages") or 1)
    # without --ep, 07's default (expert_degree): the gcd of the experts and the dp x cp ranks
    ep = int(flag("--ep")) if flag("--ep") else (math.gcd(dp * cp, get_config("tiny-moe").n_experts) if moe else 1)
    words = {f"dp{dp}" if dp % 2 else "", f"pp{pp}", f"cp{cp}", f"tp{tp}", f"ZeRO-{flag('--zero-stage')}",
             flag("--schedule") or "", flag("--ring-kernel") or "", flag("--cp-mode") or "",
             f"recompute {flag('--recompute')}", "masked" if layout.masked else "",
             "batch ramp" if "--batch-ramp" in argv else "", "muon" if flag("--optimizer") == "muon" else "",
             "offload optimizer" if flag("--offload") == "optimizer" else "",
             "offload activations" if "activations" in argv else ""}
    words |= {word for word, present in (("sequence parallel", "--sequence-parallel" in argv),
                                         ("zigzag", "--zigzag" in argv), ("no zigzag", "--no-zigzag" in argv),
                                         ("uneven stages", pp > 1 and int(flag("--n-layers")) % (pp * virtual)),
                                         ("3 virtual stages", virtual == 3),
                                         ("ZeRO-2/3 under a pipeline", pp > 1 and flag("--zero-stage") in ("2", "3")),
                                         ("units kept gathered", "--no-reshard-after-forward" in argv)) if present}
    if moe:
        words |= {"experts", f"ep{ep}", f"{flag('--router')} router", f"experts at ZeRO-{flag('--zero-stage')}",
                  "looped experts" if "--no-grouped-mm" in argv else "grouped experts", *(f"experts with {axis}" for axis, degree in
                                                                         (("pp", pp), ("tp", tp), ("cp", cp)) if degree > 1)}
        words |= {word for word, option in (("shared expert", "--shared-experts"), ("aux loss", "--aux-loss-coef"),
                                            ("z loss", "--z-loss-coef"), ("capacity", "--capacity-factor"),
                                            ("bias balancing", "--bias-update-rate"),
                                            ("experts with a batch ramp", "--batch-ramp")) if option in argv}
    return words - {"", "dp1", "pp1", "cp1", "tp1", "ep1"}


# ----------------------------------------------------------------------------- an accepted draw on its ranks


def reference_batches(micro: int = 1) -> TokenBatches:
    return TokenBatches(builtin_corpus_paths()[0], BatchShape(micro, SEQ, SEQUENCES // micro, 1), seed=SEED,
                        vocab_size=256)


def record_routing(module, data, grid, split, choices: dict, step_of: list) -> None:
    """Record, per (step, layer), the experts each token of the global batch chose in a training
    forward: (rows, positions, expert ids [rows, positions, k]), the rows as `data` (TokenBatches,
    a ramp's steps each of their own count) cuts them. The recomputed forward of --recompute full
    runs inside backward, where autograd has a current graph task: not recorded."""
    M = data.shape.micro_batch_size
    for name, layer in module.named_modules():
        if not isinstance(layer, moe_module.MixtureOfExperts):
            continue
        layer_id, compute, calls = int(re.search(r"layers\.(\d+)", name).group(1)), layer.expert_compute, {}

        def recorded(tokens, routing, experts, compute=compute, layer_id=layer_id, calls=calls):
            if torch._C._current_graph_task_id() == -1:
                micro = calls.get(step_of[0], 0)
                calls[step_of[0]] = micro + 1
                rows = torch.arange(M) + grid.dp_rank * M * data.grad_accum_at(step_of[0]) + micro * M
                positions = split.positions(grid.cp_rank, SEQ) if split is not None else torch.arange(SEQ)
                choices.setdefault((step_of[0], layer_id), []).append(
                    (rows, positions, routing.expert_ids.view(M, len(positions), -1).clone()))
            return compute(tokens, routing, experts)
        layer.expert_compute = recorded


def observe_gradients(model, optimizer) -> dict:
    """The whole gradients this rank holds, once synchronised (before clipping) and as the
    optimizer steps (after clipping), of the first step ("grads", "clipped_grads") and of the
    last ("last_grads", "last_clipped_grads")."""
    seen, finish = {}, model.finish_gradient_synchronization

    def snapshot(first: str, last: str, shard_of=lambda unit: unit.grad_shard) -> None:
        seen[last] = gathered(model, shard_of)
        seen.setdefault(first, seen[last])

    def finish_then_snapshot():
        finish()
        snapshot("grads", "last_grads")

    model.finish_gradient_synchronization = finish_then_snapshot
    # --offload optimizer: clipping scales the host's copy of the shard, which the master's gradients view
    optimizer.register_step_pre_hook(lambda *_: snapshot("clipped_grads", "last_clipped_grads",
                                                         lambda unit: getattr(unit, "host_grad", unit.grad_shard)))
    return seen


def train_draw(layout: Draw, replayed: list[dict] | None = None) -> dict:
    """The draw's STEPS steps on this rank, built and stepped as 07's main() builds and steps them;
    under Muon stepped with the one-device run's gradients `replayed` (test_full_5d.replay says why)."""
    full_5d = load_lesson("07_full_5d")
    context_parallel = full_5d.context_parallel
    args = full_5d.parse_args(list(layout.argv))
    plan = checked_plan(args, full_5d.validate, full_5d.expert_parallel.moe_config, layout.world_size)
    grid = ProcessGrid(plan.grid, ep=full_5d.expert_degree(args.ep, plan.cfg, plan.grid))
    model, pipeline = full_5d.parallelize(plan.cfg, grid, args, CPU)
    optimizer = optimizer_of(model, grid, args, replayed)
    seen = observe_gradients(model, optimizer)
    choices, step_of = {}, [0]
    split = context_parallel.SequenceSplit(grid.cp_size, args.zigzag) if grid.cp_size > 1 else None
    data = plan.batches.with_ramp(full_5d.ramp_of_layout(args, plan.grid, plan.shape))
    if plan.cfg.n_experts:
        record_routing(model.module, data, grid, split, choices, step_of)
    settings = full_5d.step_settings(grid, CPU, model.precision, args.max_grad_norm)
    step = partial(full_5d.train_step, model if pipeline is None else pipeline, optimizer, settings=settings,
                   bias_update_rate=args.bias_update_rate, balancing_log=full_5d.balancing_log(model, pipeline, grid))
    cut = context_parallel.sequence_cut(grid, args.zigzag) or (lambda batch: batch)
    step_batch = partial(masked_step_batch, data, mask_targets=mask_targets) if layout.masked else data.step_batch
    results = []
    for index in range(STEPS):
        step_of[0] = index
        results.append(step(cut(step_batch(index, grid.dp_rank))))
    return {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
            "aux": [r.extra.get("aux", 0.0) for r in results], "z": [r.extra.get("z", 0.0) for r in results],
            **seen, "params": gathered(model, lambda u: u.master),
            "biases": {_reference_name(n): b.clone() for n, b in model.module.named_buffers()
                       if n.endswith("router_bias")},
            "choices": choices, "ep": grid.ep_size, "ep_rank": grid.ep_rank, "tp": grid.tp_size,
            "ramp_history": data.ramp.realised_history(STEPS) if data.ramp is not None else None,
            "tp_rank": grid.tp_rank,
            "split_dims": {_reference_name(n): getattr(p, "tp_split_dim", None)
                           for n, p in model.module.named_parameters()}}


def _reference_name(name: str) -> str:
    """A parameter's or buffer's name in the reference GPT (a pipeline rank's chunks add a prefix)."""
    match = re.search(r"(layers\.\d+\..*|tok_embeddings\..*|norm\..*|lm_head\..*)$", name)
    return match.group(1) if match else name


def train_draws(layouts: list[Draw], replays: list) -> list[dict]:
    """Each draw's run, its collectives checked: every member of every group issued the same
    sequence (what NCCL would need and not check), from the grid's start-up to the last step."""
    runs = []
    for layout, replayed in zip(layouts, replays):
        try:
            with collective_sequences_checked():
                runs.append(train_draw(layout, replayed))
        except CollectiveMismatch as error:
            raise CollectiveMismatch(f"{layout}\n{error}") from None
    return runs


# ----------------------------------------------------------------------------- the one-device side


def reference_options(layout: Draw) -> tuple:
    """(the draw's flags, its plan, train_reference's options for it: AdamW's eps, the masked
    targets, the router bias's rate, Muon's optimizer under --optimizer muon)."""
    full_5d = load_lesson("07_full_5d")
    args = full_5d.parse_args(list(layout.argv))
    plan = checked_plan(args, full_5d.validate, full_5d.expert_parallel.moe_config, layout.world_size)
    return args, plan, dict(adam_eps=ADAM_EPS, mask_targets=mask_targets if layout.masked else None,
                            bias_update_rate=args.bias_update_rate,
                            make_optimizer=muon_optimizer if args.optimizer == "muon" else None)


def one_device_batches(args, ramp_history) -> TokenBatches:
    """The reference's batches: with a ramp, one device fed the steps the draw's layout sized."""
    batches = reference_batches()
    if args.batch_ramp is None:
        return batches
    return batches.with_ramp(BatchRamp(*args.batch_ramp, SEQUENCES, SEQ, history=ramp_history))


def replay_for(layout: Draw) -> list[dict] | None:
    """Under Muon, the one-device run's clipped gradients of every step, which the ranks step with
    (not teacher-forced: the forcing needs the ranks' routing, and without a routing choice at a
    tie the forced run is the same run; a ramp as the layout realises it); None under AdamW."""
    args, plan, options = reference_options(layout)
    if options["make_optimizer"] is None:
        return None
    ramp = load_lesson("07_full_5d").ramp_of_layout(args, plan.grid, plan.shape)
    batches = one_device_batches(args, ramp.realised_history(STEPS) if ramp is not None else None)
    return train_reference(plan.cfg, SEED, batches, STEPS, LR, MAX_GRAD_NORM, **options)["every_clipped_grads"]


def reference_for(layout: Draw, per_rank: list[dict]) -> dict:
    """train_reference on the draw's model and data; with experts teacher-forced to the routing the
    ranks recorded, asserting that every choice it would have made otherwise was a float32 tie."""
    args, plan, options = reference_options(layout)
    cfg, batches = plan.cfg, one_device_batches(args, per_rank[0]["ramp_history"])
    if not cfg.n_experts:
        return train_reference(cfg, SEED, batches, STEPS, LR, MAX_GRAD_NORM, **options)
    k = cfg.experts_per_token
    forced = {}
    for results in per_rank:
        for key, calls in results["choices"].items():
            sequences = batches.step_tokens(key[0]) // SEQ       # a ramp's steps differ
            whole = forced.setdefault(key, torch.full((sequences, SEQ, k), -1, dtype=torch.int64))
            for rows, positions, ids in calls:
                whole[rows[:, None], positions[None, :]] = ids
    queue = [forced[(step, layer)].view(-1, k) for step in range(STEPS) for layer in range(cfg.n_layers)]
    assert all((choice >= 0).all() for choice in queue), f"{layout}: every token routed exactly once"
    flips, original = [], moe_module.top_k_experts

    def teacher_forced(selection, top_k):
        choice, own = queue.pop(0), original(selection, top_k)
        differs = (own.sort(dim=-1).values != choice.sort(dim=-1).values).any(dim=-1)
        ordered = selection.sort(dim=-1, descending=True).values
        flips.extend((ordered[differs, top_k - 1] - ordered[differs, top_k]).tolist())
        return choice

    moe_module.top_k_experts = teacher_forced
    try:
        reference = train_reference(cfg, SEED, batches, STEPS, LR, MAX_GRAD_NORM, **options)
    finally:
        moe_module.top_k_experts = original
    assert not queue, f"{layout}: the reference routed fewer layers than the ranks"
    assert all(margin < FLIP_MARGIN for margin in flips), f"{layout}: a routing choice differs at margins {flips}"
    return reference


def assert_equals_reference(layout: Draw, per_rank: list[dict], reference: dict) -> None:
    """Every rank's losses, norms, balancing losses, last gradients, parameters and biases equal its
    slice of the reference's (its stage's tensors, its tp shard, its experts)."""
    assert min(reference["norms"]) > MAX_GRAD_NORM, f"{layout}: clipping must act at every step"
    held = set()
    for rank, result in enumerate(per_rank):
        where = f"{layout}\n  rank {rank}"

        def local(full: torch.Tensor, name: str) -> torch.Tensor:
            mine = full.chunk(result["ep"], dim=0)[result["ep_rank"]] if ".mlp.experts." in name else full
            split_dim = result["split_dims"][name]
            return mine if split_dim is None else mine.chunk(result["tp"], dim=split_dim)[result["tp_rank"]]

        for key, theirs in (("losses", "losses"), ("aux", "aux_losses"), ("z", "z_losses")):
            torch.testing.assert_close(torch.tensor(result[key]), torch.tensor(reference[theirs]), **LOSS_TOLERANCE,
                                       msg=lambda m, key=key: f"{where}: {key}\n{m}")
        norms, reference_norms = torch.tensor(result["norms"]), torch.tensor(reference["norms"])
        torch.testing.assert_close(norms[0], reference_norms[0], **LOSS_TOLERANCE, msg=f"{where}: step 0's norm")
        torch.testing.assert_close(norms, reference_norms, rtol=LATER_STEP_RTOL, atol=0, msg=f"{where}: norms")
        for key in ("grads", "clipped_grads"):
            for name, grad in result[key].items():
                torch.testing.assert_close(grad, local(reference[key][name], name), **GRAD_TOLERANCE,
                                           msg=lambda m, key=key, name=name: f"{where}: {key} {name}\n{m}")
        for key in ("last_grads", "last_clipped_grads"):
            for name, grad in result[key].items():
                theirs = local(reference[key][name], name)
                scale = LATER_STEP_RTOL * float(theirs.abs().max())
                torch.testing.assert_close(grad, theirs, rtol=0, atol=GRAD_TOLERANCE["atol"] + scale,
                                           msg=lambda m, key=key, name=name: f"{where}: {key} {name}\n{m}")
        for name, param in result["params"].items():
            torch.testing.assert_close(param, local(reference["params"][name], name), **PARAM_TOLERANCE,
                                       msg=lambda m, name=name: f"{where}: param {name}\n{m}")
        for name, bias in result["biases"].items():
            assert torch.equal(bias, reference["router_biases"][-1][name]), f"{where}: router bias {name}"
        held.update(result["params"])
    assert held == set(reference["params"]), f"{layout}: every reference parameter is held by some rank"


def run_accepted(layouts: list[Draw], timeout_s: float = 600.0,
                 checks: RankChecks = RankChecks()) -> list[tuple[Draw, list[dict], dict]]:
    """Train the draws, one spawn per world size: (draw, what each rank saw, the reference)."""
    by_world: dict[int, list[Draw]] = {}
    for layout in layouts:
        by_world.setdefault(layout.world_size, []).append(layout)
    outcomes = []
    for world, group in sorted(by_world.items()):
        try:
            per_rank = run_ranks(world, train_draws, group, [replay_for(layout) for layout in group],
                                 timeout_s=timeout_s, checks=checks)
        except AssertionError as failure:
            raise AssertionError(f"a draw of world size {world} failed on its ranks; the draws:\n  "
                                 + "\n  ".join(map(str, group)) + f"\n{failure}") from None
        for index, layout in enumerate(group):
            runs = [results[index] for results in per_rank]
            outcomes.append((layout, runs, reference_for(layout, runs)))
    return outcomes


def check_accepted(layouts: list[Draw], timeout_s: float = 600.0, checks: RankChecks = RankChecks()) -> None:
    for layout, runs, reference in run_accepted(layouts, timeout_s, checks):
        assert_equals_reference(layout, runs, reference)


# ----------------------------------------------------------------------------- a refused draw


def check_refused(layout: Draw, error: Exception, timeout_s: float = 120.0) -> None:
    """07 launched as rank 0 of the draw's world with no other rank: its one error line and exit 2.
    Had it passed its checks, init_distributed would wait for the missing ranks until the timeout."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE=str(layout.world_size), RANK="0", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="29599")
    try:
        result = subprocess.run([sys.executable, str(REPO_ROOT / "07_full_5d.py"), *layout.argv], env=env,
                                cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{layout}\n  refused by checked_plan ({error}) but the script did not stop") from None
    where = f"{layout}\n  exit {result.returncode}\n  stdout: {result.stdout!r}\n  stderr: {result.stderr!r}"
    assert result.returncode == 2, where
    assert result.stdout == "" and result.stderr == f"error: {error}\n", where

