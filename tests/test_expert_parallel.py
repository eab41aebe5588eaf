"""Lesson 05 proven equal: local dispatch (loop and grouped matmuls) and expert-parallel training
over the dp ranks against one device. Experts with the other axes (ep drawn from dp x cp, experts
split over tp, MoE layers in pipeline stages) prove themselves through lesson 07, with this file's
teacher-forced reference: tests/test_full_5d_expert_composition.py.

Tolerances are lesson 04's: gradients 1e-6 absolute (float32 sums in another order: per rank,
then over dp or edp), losses, gradient norms and balancing losses 1e-5, parameters after
AdamW 1e-2 * lr (Adam's normalised step turns the rounding noise of a ~0 gradient into a step of
that order; a real error moves a parameter by order lr). Both runs use AdamW with eps = ADAM_EPS
(1e-4), as lessons 02 and 06's tests do: a gradient at float32's rounding floor has its sign decided
by the summation order (tp's row-parallel partial sums), and at eps = 1e-8 Adam turns that sign into
a step of up to lr; eps between the floor and the typical gradient damps only that noise. Router biases are compared exactly: they
move by +-rate from integer token counts.

Routing flips. A router chooses its top k by comparing scores, and two layouts of the same batch
compute those scores with float32 sums in different orders (micro-batches of other sizes, ring
attention under cp): a token whose k-th and (k+1)-th scores differ by less than that rounding
(~1e-7) may pick another expert, and from then on its loss differs by far more than any float32
tolerance. On this test's data such near-ties exist (the smallest margins are ~1e-6). So the
reference is teacher-forced: every distributed run records the experts each of its tokens chose,
the one-device reference routes every token to exactly those experts, and the test asserts that
wherever the reference's own choice would have differed, its top-k margin was below FLIP_MARGIN,
that is, a rounding-level tie. Everything else (weights, losses, aux and z losses, dropped
tokens, biases) the reference computes itself from the forced choices; a wrong dispatch, a wrong
gradient sum or a wrong balancing loss is still caught, and a real routing bug (a choice that
differs where the margin is large) fails the margin assertion.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from contextlib import ExitStack
from dataclasses import dataclass, replace

import pytest
import torch

import picotron_like.moe as moe_module
from picotron_like import comm
from picotron_like.data import BatchShape, TokenBatches, builtin_corpus_paths
from picotron_like.lessons import REPO_ROOT, load_lesson
from picotron_like.metrics import ActivationMeter, BalancingLog, RoutingMeter, step_traffic
from picotron_like.model import GPT, get_config
from picotron_like.moe import looped_expert_compute, moe_layers
from picotron_like.testing import HostReads, ignore_targets, masked_step_batch, run_ranks, train_reference
from picotron_like.topology import ConfigError, GridShape, ProcessGrid
from picotron_like.train import build_optimizer

lesson = load_lesson("05_expert_parallel")
context_parallel = load_lesson("04_context_parallel")

# ffn_hidden 64 and hidden 64: rows of 256 bytes, as torch._grouped_mm wants (multiples of 16).
CFG = replace(get_config("tiny-moe"), n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=64)
SEQ, MICRO, GLOBAL_SEQUENCES, STEPS, LR, SEED = 32, 2, 8, 3, 3e-3, 5
MAX_GRAD_NORM = 0.5
TOLERANCE = dict(rtol=0, atol=1e-6)
PARAM_TOLERANCE = dict(rtol=0, atol=1e-2 * LR)
ADAM_EPS = 1e-4
FLIP_MARGIN = 1e-5     # a top-k margin below this is a tie at float32 rounding between layouts
CPU = torch.device("cpu")


# ----------------------------------------------------------------------------- one process


@pytest.mark.parametrize("options", [dict(), dict(router="sigmoid", n_shared_experts=1),
                                     dict(capacity_factor=1.0, aux_loss_coef=1e-2, z_loss_coef=1e-3)])
def test_local_dispatch_loop_and_grouped_equal_the_reference(options):
    """Sorted by expert, run (looped or grouped), un-permuted and weighted: forward and every
    gradient equal the reference loop to the bit on this batch (same products, same order). The
    activations autograd keeps equal the MoE formula at ep = 1 on the routing counts of the batch."""
    cfg = replace(CFG, **options)
    tokens, targets = torch.randint(0, cfg.vocab_size, (2, 2, SEQ), generator=torch.Generator().manual_seed(0))
    results, activations = {}, {}
    for name, compute in (("reference", looped_expert_compute), ("loop", lesson.local_expert_compute),
                          ("grouped", functools.partial(lesson.local_expert_compute,
                                                        run_experts=lesson.grouped_experts))):
        model = GPT(cfg, seed=SEED)
        for layer in moe_layers(model):
            layer.expert_compute = compute
        meter, routing = ActivationMeter(model), RoutingMeter([model])
        with meter, routing:
            loss = model(tokens, targets)
        loss.backward()
        results[name] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
        predicted = lesson.predicted_peak_activation_bytes(cfg, BatchShape(2, SEQ, 1, 1), routing,
                                                           lesson.ExpertParallel(None, 1, 0), name == "grouped")
        activations[name] = (meter.peak_bytes, predicted)
    # The formula describes this file's dispatch at ep = 1 (the reference loop keeps other tensors).
    assert activations["loop"][0] == activations["loop"][1] and activations["grouped"][0] == activations["grouped"][1]
    assert lesson.grouped_mm_fits(cfg, torch.float32) and not lesson.grouped_mm_fits(replace(cfg, hidden=66, n_heads=3, n_kv_heads=3), torch.float32)
    # On CUDA only where the fast kernel is: bf16 on Hopper and newer (capability given: no GPU here).
    cuda = torch.device("cuda")
    assert lesson.grouped_mm_fits(cfg, torch.bfloat16, cuda, (9, 0)) and lesson.grouped_mm_fits(cfg, torch.bfloat16,
                                                                                                 cuda, (10, 3))
    assert not lesson.grouped_mm_fits(cfg, torch.float32, cuda, (9, 0))
    assert not lesson.grouped_mm_fits(cfg, torch.bfloat16, cuda, (8, 0))
    for name in ("loop", "grouped"):
        torch.testing.assert_close(results[name][0], results["reference"][0], rtol=0, atol=1e-6)
        for param, grad in results[name][1].items():
            torch.testing.assert_close(grad, results["reference"][1][param], **TOLERANCE, msg=f"{name} {param}")


def test_grouped_mm_forward_and_backward_on_cpu():
    """What the grouped version relies on: int32 cumulative offsets, empty groups, and gradients
    equal to per-group matmuls."""
    x = torch.randn(10, 8, requires_grad=True)
    w = torch.randn(3, 12, 8, requires_grad=True)
    counts = [3, 0, 7]
    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=torch.tensor(counts).cumsum(0).to(torch.int32))
    reference = torch.cat([rows @ w[e].T for e, rows in enumerate(x.split(counts))])
    d_y = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, w), d_y)
    expected = torch.autograd.grad(reference, (x, w), d_y)
    torch.testing.assert_close(y, reference, **TOLERANCE)
    for ours, theirs in zip(grads, expected):
        torch.testing.assert_close(ours, theirs, **TOLERANCE)
    assert grads[1][1].abs().sum() == 0      # the empty group's expert gets a zero gradient


@pytest.mark.parametrize("counts", [[3, 0, 7, 0], [0, 0, 0, 0], [5, 2, 1, 2]])
def test_grouped_experts_leave_empty_groups_out_of_every_call(counts, monkeypatch):
    """What the Blackwell reports (pytorch 172439, 193633) make necessary: no call of
    torch._grouped_mm carries an expert with no rows; the result and every gradient still equal
    the loop's, the idle experts' gradients exactly zero (and present, for ZeRO's hooks)."""
    torch.manual_seed(SEED)
    experts = moe_module.GroupedExperts(len(counts), CFG.hidden, CFG.ffn_hidden)
    groups_seen, original = [], torch._grouped_mm

    def checking(a, b, offs=None, **kwargs):
        sizes = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
        groups_seen.append(sizes)
        assert b.shape[0] == len(sizes) and all(size > 0 for size in sizes), sizes
        return original(a, b, offs=offs, **kwargs)

    x = torch.randn(sum(counts), CFG.hidden, generator=torch.Generator().manual_seed(1))
    d_out = torch.randn(sum(counts), CFG.hidden, generator=torch.Generator().manual_seed(2))   # dense, as the combine's
    results = {}
    for name, run in (("loop", lesson.looped_experts), ("grouped", lesson.grouped_experts)):
        for p in experts.parameters():
            p.grad = None
        rows = x.clone().requires_grad_()
        with monkeypatch.context() as patch:
            patch.setattr(torch, "_grouped_mm", checking)
            out = run(rows, counts, experts)
            out.backward(d_out)
        results[name] = (out.detach(), rows.grad, {n: p.grad.clone() for n, p in experts.named_parameters()})
    assert len(groups_seen) == (3 if sum(counts) else 0)
    torch.testing.assert_close(results["grouped"][0], results["loop"][0], **TOLERANCE)
    torch.testing.assert_close(results["grouped"][1], results["loop"][1], **TOLERANCE)
    for name, grad in results["grouped"][2].items():
        torch.testing.assert_close(grad, results["loop"][2][name], **TOLERANCE)
        idle = [e for e, count in enumerate(counts) if count == 0]
        assert grad[idle].abs().sum() == 0, name


@pytest.mark.parametrize("dp, ep, options, bias_update_rate, message", [
    (4, 3, {}, 0.0, "--ep 3 does not divide dp = 4"),
    (4, 4, dict(n_experts=6), 0.0, "n_experts=6 is not divisible by --ep 4"),
    (2, 2, dict(n_experts=0, experts_per_token=2), 0.0, "the model has no experts"),
    (2, 2, {}, -1e-3, "--bias-update-rate -0.001 must be 0 (off) or positive"),
])
def test_bad_configurations_name_value_rule_and_fix(dp, ep, options, bias_update_rate, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        lesson.validate_expert_parallel(replace(CFG, **options), ep, dp, bias_update_rate)


def test_moe_flags_change_only_what_is_given():
    """A preset keeps its router, shared expert and balancing losses unless a flag says otherwise
    (flags that defaulted to Mixtral's values would silently turn a sigmoid preset into softmax)."""
    preset = replace(CFG, router="sigmoid", n_shared_experts=1, aux_loss_coef=0.02, capacity_factor=1.5)
    assert lesson.moe_config(preset, lesson.parse_args([])) == preset
    changed = lesson.moe_config(preset, lesson.parse_args(["--router", "softmax", "--z-loss-coef", "1e-3"]))
    assert changed == replace(preset, router="softmax", z_loss_coef=1e-3)


def test_moe_flags_on_a_dense_preset_and_top_k_above_experts_stop_the_script():
    """One error line, exit code 2, no process group (one process stands for every rank)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE="2", RANK="0")
    for flags, message in ((["--preset", "tiny", "--router", "sigmoid"], "router='sigmoid' needs a mixture-of-experts"),
                           (["--ep", "3"], "--ep 3 does not divide dp = 2"),
                           (["--cp", "2"], "lesson 07")):
        result = subprocess.run([sys.executable, str(REPO_ROOT / "05_expert_parallel.py"), *flags],
                                capture_output=True, text=True, timeout=120, env=env, cwd=REPO_ROOT)
        assert result.returncode == 2, result.stdout + result.stderr
        assert result.stderr.count("error: ") == 1 and message in result.stderr, result.stderr


# ----------------------------------------------------------------------------- training on real ranks


@dataclass(frozen=True)
class Variant:
    shape: GridShape
    ep: int
    options: tuple = ()            # GPTConfig overrides, as (name, value) pairs
    bias_update_rate: float = 0.0
    grouped: bool = True
    masked: bool = False
    scale_expert_grads: float = 1.0  # the mutation: != 1 must fail the comparison

    @property
    def cfg(self):
        return replace(CFG, **dict(self.options))


def mask_targets(step, targets):
    return ignore_targets(step, targets, ignored_rows=(7,))


def batches(dp: int) -> TokenBatches:
    shape = BatchShape(MICRO, SEQ, GLOBAL_SEQUENCES // (MICRO * dp), dp)
    return TokenBatches(builtin_corpus_paths()[0], shape, seed=SEED, vocab_size=CFG.vocab_size)


def gradients(module) -> dict:
    return {name: p.grad.clone() for name, p in module.named_parameters()}


def record_choices(parts, grid, data, choices: dict, step_of: list):
    """Wrap every MoE layer's expert_compute to record, per (step, layer), the experts each token
    chose with its place in the global batch: (rows, positions, expert_ids [rows, positions, k])."""
    split = context_parallel.SequenceSplit(grid.cp_size, True)
    M = data.shape.micro_batch_size
    for part in parts:
        for name, layer in part.module.named_modules():
            if isinstance(layer, moe_module.MixtureOfExperts):
                layer_id = int(name.split(".")[1])
                compute, calls = layer.expert_compute, {}

                def recorded(tokens, routing, experts, compute=compute, layer_id=layer_id, calls=calls):
                    step = step_of[0]
                    micro = calls.setdefault(step, 0)
                    calls[step] += 1
                    # a batch-size ramp's step holds its own micro-batches per rank (07's --batch-ramp)
                    rows = torch.arange(M) + grid.dp_rank * M * data.grad_accum_at(step) + micro * M
                    positions = split.positions(grid.cp_rank, SEQ)
                    choices.setdefault((step, layer_id), []).append(
                        (rows, positions, routing.expert_ids.view(M, len(positions), -1).clone(),
                         int((~routing.kept).sum())))
                    return compute(tokens, routing, experts)
                layer.expert_compute = recorded


def expert_parallel_run(variant: Variant):
    """STEPS steps as lesson 05's main runs them, step 0 metered (activations, routing), every
    step's routing counted for the all-to-all's prediction."""
    grid = ProcessGrid(variant.shape, ep=variant.ep)
    data = batches(variant.shape.dp)
    model = lesson.build_model(variant.cfg, SEED, grid, CPU,
                               lesson.grouped_experts if variant.grouped else lesson.looped_experts,
                               data.shape.sequences_per_step, bucket_bytes=64 * 1024)
    optimizer = build_optimizer(model.module, LR)
    for group in optimizer.param_groups:
        group["eps"] = ADAM_EPS
    settings = lesson.step_settings(model, grid, CPU, torch.float32, MAX_GRAD_NORM)
    log = BalancingLog([model], (grid.dp_group,))
    choices, step_of = {}, [0]
    record_choices([model], grid, data, choices, step_of)

    seen, finish = {}, model.finish_gradient_synchronization

    def finish_then_snapshot():
        finish()
        if variant.scale_expert_grads != 1.0:
            for p in model.expert_parameters:
                p.grad.mul_(variant.scale_expert_grads)
        seen.setdefault("before", gradients(model.module))

    model.finish_gradient_synchronization = finish_then_snapshot
    optimizer.register_step_pre_hook(lambda *_: seen.setdefault("after", gradients(model.module)) and None)
    step_batch = functools.partial(masked_step_batch, data, mask_targets=mask_targets) if variant.masked \
        else data.step_batch
    results, biases = [], []
    # every_step folds by the step, as the lesson's main does: it must predict the same traffic
    activations, measured_step = ActivationMeter(model), RoutingMeter([model])
    every_step = RoutingMeter([model], period=data.shape.grad_accum)
    with every_step:
        for step in range(STEPS):
            step_of[0] = step
            with ExitStack() as metering:
                for meter in (activations, measured_step) if step == 0 else ():
                    metering.enter_context(meter)
                results.append(lesson.train_step(model, optimizer, step_batch(step, grid.dp_rank), settings,
                                                 variant.bias_update_rate, log))
            biases.append({n: b.clone() for n, b in model.module.named_buffers() if n.endswith("router_bias")})
    traffic = {key: t.payload_bytes for key, t in comm.meter.traffic.items()}   # before the gathers below
    n_slots = len(moe_layers(model.module)) * data.shape.grad_accum
    assert len(every_step.calls) == n_slots and sum(call.n_calls for call in every_step.calls) == STEPS * n_slots
    # The report's rows, added up as it adds them; the all-to-all's mean per step is exact (a Fraction).
    per_step = step_traffic(**lesson.predicted_traffic(model.module, grid, every_step, variant.bias_update_rate, STEPS))
    predicted = {key: STEPS * value for key, value in per_step.items()}
    ep = lesson.ExpertParallel.from_grid(grid)
    return {"activations": activations.peak_bytes, "traffic": traffic, "predicted_traffic": predicted,
            "predicted_activations": lesson.predicted_peak_activation_bytes(variant.cfg, data.shape, measured_step,
                                                                            ep, variant.grouped),
            "tp_rank": 0, "split_dims": {n: None for n, _ in model.module.named_parameters()},
            "grads": seen["before"], "clipped_grads": seen["after"], "losses": [r.loss for r in results],
            "norms": [r.grad_norm for r in results], "aux": [r.extra.get("aux", 0.0) for r in results],
            "z": [r.extra.get("z", 0.0) for r in results], "logged": set(results[0].extra), "biases": biases,
            "choices": choices, "ep_rank": grid.ep_rank,
            "params": {n: p.detach().clone() for n, p in model.module.named_parameters()}}


def several_variants(variants):
    return {variant: expert_parallel_run(variant) for variant in variants}


BALANCED = (("aux_loss_coef", 1e-2), ("z_loss_coef", 1e-3))
VARIANTS = [
    Variant(GridShape(dp=4), 4, BALANCED),
    Variant(GridShape(dp=4), 2, (("router", "sigmoid"), ("aux_loss_coef", 1e-2), ("n_shared_experts", 1)),
            bias_update_rate=1e-3, grouped=False),
    Variant(GridShape(dp=4), 4, BALANCED, bias_update_rate=1e-3, masked=True),
    Variant(GridShape(dp=4), 2, (("capacity_factor", 1.0), ("aux_loss_coef", 1e-2))),
    # ep = 1: every rank holds every expert (the local dispatch), edp = dp
    Variant(GridShape(dp=4), 1, (("router", "sigmoid"), ("aux_loss_coef", 1e-2)), bias_update_rate=1e-3),
]
# The classic bugs: expert gradients divided by ep (normalised by the tokens of one ep group), or
# multiplied by it. Without balancing losses, which the meters check too.
MUTANTS = [Variant(GridShape(dp=4), 4, scale_expert_grads=scale) for scale in (1 / 4, 4.0)]


@pytest.fixture(scope="module")
def four_rank_training():
    return run_ranks(4, several_variants, VARIANTS + MUTANTS, timeout_s=400)


def forced_reference(variant: Variant, per_rank, check_margins: bool = True, make_optimizer=None,
                     reference_batches: TokenBatches | None = None) -> dict:
    """train_reference with every token routed where the distributed run routed it; asserts that
    wherever the reference's own top-k differs, its margin was a rounding-level tie (a mutant's run
    routes from wrong weights after its first step: there only its gradients are compared).
    `make_optimizer`: train_reference's (default AdamW); `reference_batches`: one device's steps
    (default batches(1); a batch-size ramp's steps differ in size)."""
    k = CFG.experts_per_token
    reference_batches = batches(1) if reference_batches is None else reference_batches
    forced = {}
    for results in per_rank:
        for key, calls in results[variant]["choices"].items():
            sequences = reference_batches.step_tokens(key[0]) // SEQ
            full = forced.setdefault(key, torch.full((sequences, SEQ, k), -1, dtype=torch.int64))
            for rows, positions, ids, _ in calls:
                full[rows[:, None], positions[None, :]] = ids
    queue = [forced[(step, layer)].view(-1, k) for step in range(STEPS) for layer in range(variant.cfg.n_layers)]
    assert all((choice >= 0).all() for choice in queue), "every token routed exactly once"
    flips, drops, original, original_mask = [], [], moe_module.top_k_experts, moe_module.capacity_mask

    def teacher_forced(selection, top_k):
        choice, own = queue.pop(0), original(selection, top_k)
        differs = (own.sort(dim=-1).values != choice.sort(dim=-1).values).any(dim=-1)
        ordered = selection.sort(dim=-1, descending=True).values
        flips.extend((ordered[differs, top_k - 1] - ordered[differs, top_k]).tolist())
        return choice

    def counting_drops(*args):
        kept = original_mask(*args)
        drops.append(int((~kept).sum()))
        return kept

    moe_module.top_k_experts, moe_module.capacity_mask = teacher_forced, counting_drops
    try:
        reference = train_reference(variant.cfg, SEED, reference_batches, STEPS, LR, MAX_GRAD_NORM,
                                    mask_targets=mask_targets if variant.masked else None,
                                    bias_update_rate=variant.bias_update_rate, adam_eps=ADAM_EPS,
                                    make_optimizer=make_optimizer)
    finally:
        moe_module.top_k_experts, moe_module.capacity_mask = original, original_mask
    assert not queue
    assert not check_margins or all(margin < FLIP_MARGIN for margin in flips), \
        f"{variant}: a choice differs at margins {flips}"
    assert min(reference["norms"]) > MAX_GRAD_NORM, "clipping must act at every step"
    return dict(reference, flips=len(flips), dropped=sum(drops))


def assert_equals_reference(result, reference, variant: Variant, where: str):
    ep, ep_rank, tp, tp_rank = variant.ep, result["ep_rank"], variant.shape.tp, result["tp_rank"]

    def local(full, name):
        mine = full.chunk(ep, dim=0)[ep_rank] if lesson.is_expert_parameter(name) else full
        split_dim = result["split_dims"][name]
        return mine if split_dim is None else mine.chunk(tp, dim=split_dim)[tp_rank]

    for key in ("grads", "clipped_grads"):
        for name, grad in result[key].items():
            torch.testing.assert_close(grad, local(reference[key][name], name), **TOLERANCE, msg=f"{where} {key} {name}")
    for key, theirs in (("losses", "losses"), ("norms", "norms"), ("aux", "aux_losses"), ("z", "z_losses")):
        torch.testing.assert_close(torch.tensor(result[key]), torch.tensor(reference[theirs]), rtol=0, atol=1e-5,
                                   msg=f"{where} {key}")
    for step, biases in enumerate(result["biases"]):
        for name, bias in biases.items():
            assert torch.equal(bias, reference["router_biases"][step][name]), f"{where} step {step} {name}"
    for name, param in result["params"].items():
        torch.testing.assert_close(param, local(reference["params"][name], name), **PARAM_TOLERANCE,
                                   msg=f"{where} param {name}")


def test_expert_parallel_training_equals_one_device(four_rank_training):
    """Over dp = 4: ep = 4 (one expert per rank), ep = 2 (two ep groups, edp = 2), capacity with
    drops at ep = 2, and ep = 1 (every expert on every rank, summed over edp = dp): softmax and
    sigmoid routers, aux / z losses, the shared expert, router bias, masked targets, looped and
    grouped experts.
    On every rank, the activations at step 0's peak equal the MoE formula on that step's routing
    counts, and every collective's bytes over the run equal the prediction, the all-to-all's from
    every step's counts."""
    for variant in VARIANTS:
        reference = forced_reference(variant, four_rank_training)
        print(f"{variant}: {reference['flips']} routing choices forced at rounding-level ties")
        for rank, results in enumerate(four_rank_training):
            assert_equals_reference(results[variant], reference, variant, f"rank {rank} {variant}")
            assert results[variant]["activations"] == results[variant]["predicted_activations"], (rank, variant)
            assert results[variant]["traffic"] == results[variant]["predicted_traffic"], (rank, variant)
            enabled = {name for name, coef in (("aux", variant.cfg.aux_loss_coef), ("z", variant.cfg.z_loss_coef))
                       if coef}
            assert results[variant]["logged"] == enabled, (rank, variant)
        if variant.bias_update_rate:
            assert any(b.abs().sum() > 0 for b in reference["router_biases"][-1].values())


def test_capacity_drops_exactly_the_reference_tokens(four_rank_training):
    """Capacity is applied by each rank to its own whole sequences; the reference applies it to
    the same choices: the same number of assignments dropped at every layer and step, and more
    than none (the losses and gradients above prove that the same ones were)."""
    variant = VARIANTS[3]
    reference = forced_reference(variant, four_rank_training)
    dropped = sum(call[3] for results in four_rank_training for calls in results[variant]["choices"].values()
                  for call in calls)
    assert dropped == reference["dropped"] > 0


def test_without_balancing_losses_nothing_is_logged_and_the_meters_still_hold(four_rank_training):
    """No aux or z loss: no log values, no collective for them, and on every rank the activations
    and every collective's bytes equal their predictions (the mutation touches neither)."""
    for rank, results in enumerate(four_rank_training):
        for mutant in MUTANTS:
            assert results[mutant]["logged"] == set(), (rank, mutant)
            assert results[mutant]["activations"] == results[mutant]["predicted_activations"], (rank, mutant)
            assert results[mutant]["traffic"] == results[mutant]["predicted_traffic"], (rank, mutant)


@pytest.mark.parametrize("mutant", MUTANTS)
def test_scaling_expert_gradients_by_ep_fails(four_rank_training, mutant):
    """The mutation argument: the same run with expert gradients divided or multiplied by ep (the
    classic normalisation bugs) is caught by the comparison, at the expert gradients."""
    reference = forced_reference(mutant, four_rank_training, check_margins=False)
    with pytest.raises(AssertionError, match="grads layers.0.mlp.experts"):
        assert_equals_reference(four_rank_training[0][mutant], reference, mutant, "mutant")


# ----------------------------------------------------------------------------- the script


def test_torchrun_script_trains():
    """The lesson as a user runs it: ep = 4 over 4 ranks, aux loss on, exit 0, loss falling, report."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
         str(REPO_ROOT / "05_expert_parallel.py"), "--steps", "12", "--aux-loss-coef", "1e-2",
         "--bias-update-rate", "1e-3"],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    losses = [float(m) for m in re.findall(r"step +\d+ \| loss ([0-9.]+)", result.stdout)]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.5, result.stdout
    assert "| aux " in result.stdout and "| z " not in result.stdout and "routing of one step" in result.stdout
    assert re.search(r"all_to_all_single +ep +[0-9.]+ +([0-9.]+) +\1 ", result.stdout), result.stdout
    assert re.search(r"activations +([0-9.]+) +\1\n", result.stdout), result.stdout


# ----------------------------------------------------------------------------- host reads


def test_the_dispatch_reads_to_the_host_once_per_layer_and_nothing_else_does():
    """On a GPU a value read to the host (the split sizes of a dispatch, a nonzero's count) makes
    the host wait for the device, which then idles while the host queues the next kernels. The
    sorted dispatch needs its counts as host integers once per layer and micro-batch; nothing else
    in the forward or backward reads anything, dropped choices included (capacity 1.0). The
    reference loop, which selects each expert's tokens with nonzero, reads E times per layer: the
    counter sees the reads it must see."""
    cfg = replace(CFG, capacity_factor=1.0, aux_loss_coef=1e-2)
    tokens, targets = torch.randint(0, cfg.vocab_size, (2, 2, SEQ), generator=torch.Generator().manual_seed(0))
    for compute, expected in [(looped_expert_compute, [("nonzero", "moe.py:looped_expert_compute")] * cfg.n_experts),
                              (lesson.local_expert_compute, [("tolist", "05_expert_parallel.py:local_expert_compute")]),
                              (functools.partial(lesson.local_expert_compute, run_experts=lesson.grouped_experts),
                               [("tolist", "05_expert_parallel.py:local_expert_compute")])]:
        model = GPT(cfg, seed=SEED)
        for layer in moe_layers(model):
            layer.expert_compute = compute
        with HostReads() as reads:
            model(tokens, targets).backward()
        assert reads.sites == expected * cfg.n_layers, reads.sites
