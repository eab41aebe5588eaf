"""
Lesson 02 proven equal to one device, on real gloo ranks.

Sequence parallelism (SP) comes in its three forms throughout: off, plain, and saving the shard
(tp_lesson.SEQUENCE_PARALLEL_FORMS). Spawns of 2 and 4 ranks carry every multi-rank check
(starting ranks is the slow part):
- layers: column (each form), row and embedding (with and without SP) and the vocab-parallel
  cross-entropy (mean and sum, with ignored targets, and with every target ignored) against their
  single-device counterparts at tp = 2 and 4, a bad model refused by apply_tensor_parallel, two
  pipeline-stage halves converted separately (each form), and PyTorch's own
  torch.distributed.tensor.parallel on the same model;
- the whole GPT at tp = 2 and 4 and dp x tp = 2 x 2 (each form): losses, gradient norms, gradients
  before and after clipping and parameters after AdamW steps with gradient accumulation, against
  one device training on the whole global batch; dp x tp on targets masked differently on every
  rank and micro-batch (one micro-batch entirely), so that only a loss token-weighted over the
  global batch can agree; the traffic of every group against the formulas, every collective on
  the rank's device, the saved activations against their formula, and what each form of SP saves
  (plain: the norms' work / tp; saving the shard: every activation of a block / tp) from the
  measurements alone;
- the script under torchrun, and its refusal of bad flags and configurations.

Tolerances. A tensor-parallel matmul adds the same products as the reference in a different order
(partial sums per rank, then the all-reduce), so results differ by float32 rounding: a few ulps
of the largest term. assert_close's float32 defaults (rtol 1.3e-6, atol 1e-5) hold that for layer
outputs and gradients of magnitude ~1. The model-level tolerances are explained where they are
used (test_model_matches_single_device_and_formulas).
"""

import re
import subprocess
import sys
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from picotron_like import comm
from picotron_like import loss as loss_module
from picotron_like.data import BatchShape, TokenBatches, builtin_corpus_paths
from picotron_like.lessons import load_lesson
from picotron_like.loss import IGNORE_INDEX
from picotron_like.metrics import ActivationMeter, add_traffic, data_parallel_traffic, step_bookkeeping_traffic
from picotron_like.model import GPT, GPTConfig, get_config
from picotron_like.testing import ignore_targets, masked_step_batch, run_ranks, train_reference
from picotron_like.topology import ConfigError, GridShape, ProcessGrid
from picotron_like.train import StepSettings, build_optimizer, checked_plan, set_learning_rate

tp_lesson = load_lesson("02_tensor_parallel")
dp_lesson = load_lesson("01_data_parallel")
FORMS = tp_lesson.SEQUENCE_PARALLEL_FORMS       # off, plain, saving the shard: keywords of the lesson's functions

ROOT = Path(__file__).resolve().parent.parent

# Small enough for 4 ranks on 2 cores, shaped so that tp = 4 divides everything and grouped-query
# attention stays grouped on every rank (8 query heads, 4 kv heads: 2 and 1 kv heads per rank).
CFG = get_config("tiny", n_layers=2, hidden=64, n_heads=8, n_kv_heads=4, ffn_hidden=128)
SEQ, MICRO, SEQUENCES_PER_STEP, STEPS, LR, SEED = 16, 2, 8, 3, 3e-3, 0
# Small enough that clipping scales every step's gradient: the clipping norm must then be the
# norm of the whole model, summed over tp shards, with the replicated norm gains counted once.
MAX_GRAD_NORM = 0.1


def assert_close(actual, expected, what, **tolerance):
    torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}", **tolerance)


def shard(full, dim, rank, tp):
    return full.chunk(tp, dim=dim)[rank]


# ----------------------------------------------------------------------------- layers


def check_column(group, form):
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    gen = torch.Generator().manual_seed(1)
    full = nn.Linear(16, 24, bias=True)
    with torch.no_grad():
        full.weight.copy_(torch.randn(24, 16, generator=gen))
        full.bias.copy_(torch.randn(24, generator=gen))
    x = torch.randn(2, 8, 16, generator=gen, requires_grad=True)
    grad_out = torch.randn(2, 8, 24, generator=gen)
    (full(x) * grad_out).sum().backward()

    # a copy, not a view: a view of x would keep x's whole storage, which the meter would count
    x_local = (x if form == "off" else shard(x, 1, rank, tp)).detach().clone().requires_grad_()
    column, enter = {"off": (tp_lesson.ColumnParallelLinear, tp_lesson.CopyToTensorParallelRegion.apply),
                     "plain": (tp_lesson.ColumnParallelLinear, tp_lesson.GatherFromSequenceParallelRegion.apply),
                     "saving the shard": (tp_lesson.ShardSavingColumnLinear, tp_lesson.SequenceParallelInput)}[form]
    layer = column(full, group)
    with ActivationMeter(layer) as saved:
        entered = enter(x_local, group)
        out = layer(entered)
    what = f"column tp={tp} sp={form}"
    # The layer keeps the input it multiplies, the whole sequence (gathered, under plain sequence
    # parallelism), unless it saves the shard: then this rank's tokens only (backward gathers again).
    kept = x_local if form == "saving the shard" else x
    assert saved.peak_bytes == kept.numel() * kept.element_size(), what
    assert_close(out, shard(full(x), 2, rank, tp), f"{what} output")
    (out * shard(grad_out, 2, rank, tp)).sum().backward()
    if form == "saving the shard":      # its one reader's backward is done: the regathered sequence is gone
        assert entered.regather.readers == 0 and entered.regather.full is None, what
    expected_x_grad = x.grad if form == "off" else shard(x.grad, 1, rank, tp)
    assert_close(x_local.grad, expected_x_grad, f"{what} input grad")
    assert_close(layer.weight.grad, shard(full.weight.grad, 0, rank, tp), f"{what} weight grad")
    assert_close(layer.bias.grad, shard(full.bias.grad, 0, rank, tp), f"{what} bias grad")


def check_row(group, sequence_parallel):
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    gen = torch.Generator().manual_seed(2)
    full = nn.Linear(24, 16, bias=True)
    with torch.no_grad():
        full.weight.copy_(torch.randn(16, 24, generator=gen))
        full.bias.copy_(torch.randn(16, generator=gen))
    x = torch.randn(2, 8, 24, generator=gen, requires_grad=True)
    grad_out = torch.randn(2, 8, 16, generator=gen)
    reference = full(x)
    (reference * grad_out).sum().backward()

    layer = (tp_lesson.SequenceParallelRowLinear if sequence_parallel else tp_lesson.RowParallelLinear)(full, group)
    x_local = shard(x, 2, rank, tp).detach().requires_grad_()
    out = layer(x_local)
    # under sequence parallelism the row layer's reduce-scatter leaves this rank's tokens
    local = (lambda t: shard(t, 1, rank, tp)) if sequence_parallel else (lambda t: t)
    what = f"row tp={tp} sp={sequence_parallel}"
    assert_close(out, local(reference), f"{what} output")
    (out * local(grad_out)).sum().backward()
    assert_close(x_local.grad, shard(x.grad, 2, rank, tp), f"{what} input grad")
    assert_close(layer.weight.grad, shard(full.weight.grad, 1, rank, tp), f"{what} weight grad")
    assert_close(layer.bias.grad, full.bias.grad, f"{what} bias grad")


def check_embedding(group, sequence_parallel):
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    gen = torch.Generator().manual_seed(3)
    full = nn.Embedding(32, 12)
    with torch.no_grad():
        full.weight.copy_(torch.randn(32, 12, generator=gen))
    tokens = torch.randint(0, 32, (2, 8), generator=gen)
    grad_out = torch.randn(2, 8, 12, generator=gen)
    reference = full(tokens)
    (reference * grad_out).sum().backward()

    layer = (tp_lesson.SequenceParallelEmbedding if sequence_parallel else tp_lesson.VocabParallelEmbedding)(full, group)
    out = layer(tokens)
    local = (lambda t: shard(t, 1, rank, tp)) if sequence_parallel else (lambda t: t)
    what = f"embedding tp={tp} sp={sequence_parallel}"
    assert_close(out, local(reference), f"{what} output")
    (out * local(grad_out)).sum().backward()
    assert_close(layer.weight.grad, shard(full.weight.grad, 0, rank, tp), f"{what} weight grad")


def check_cross_entropy(group):
    """The vocab-parallel head's loss, chunked over 3 tokens at a time (16 tokens: 6 chunks), equals
    F.cross_entropy on the whole logits, with its gradients; tests/test_loss_memory.py proves the
    whole models and the chunk rule."""
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 8, 16, generator=gen)
    full = nn.Linear(16, 32, bias=False)
    full.weight.data = torch.randn(32, 16, generator=gen) / 2
    targets = torch.randint(0, 32, (2, 8), generator=gen)
    targets[torch.rand(2, 8, generator=gen) < 0.25] = IGNORE_INDEX
    assert (targets == IGNORE_INDEX).any() and (targets != IGNORE_INDEX).any()
    head = tp_lesson.VocabParallelHead(full, group)
    chunk_bytes, loss_module.LOSS_CHUNK_BYTES = loss_module.LOSS_CHUNK_BYTES, 4 * 32 // tp * 3
    for reduction in ("mean", "sum"):
        inputs, local_inputs = x.clone().requires_grad_(), x.clone().requires_grad_()
        full.weight.grad = head.weight.grad = None
        reference = F.cross_entropy(full(inputs).flatten(0, 1), targets.flatten(), reduction=reduction)
        (0.5 * reference).backward()
        loss = head(local_inputs, targets, reduction)
        what = f"cross-entropy tp={tp} {reduction}"
        assert_close(loss, reference, f"{what} loss")
        (0.5 * loss).backward()
        assert_close(head.weight.grad, shard(full.weight.grad, 0, rank, tp), f"{what} weight grad")
        # a partial sum over the vocabulary slices, which the f in front of the head sums over tp
        comm.call(dist.all_reduce, local_inputs.grad, group=group)
        assert_close(local_inputs.grad, inputs.grad, f"{what} input grad")

    # Every target ignored (a micro-batch of padding): the sum is 0 with a zero gradient, so a
    # training step can add it in; the mean is 0 / 0, NaN, as F.cross_entropy's.
    ignored = torch.full_like(targets, IGNORE_INDEX)
    head.weight.grad = None
    loss = head(x, ignored, "sum")
    assert loss.item() == 0.0 == F.cross_entropy(full(x).flatten(0, 1), ignored.flatten(), reduction="sum").item()
    loss.backward()
    assert torch.equal(head.weight.grad, torch.zeros_like(head.weight))
    assert head(x, ignored).isnan()
    loss_module.LOSS_CHUNK_BYTES = chunk_bytes


def check_apply_refuses_indivisible_kv_heads(group):
    """tiny's 2 kv heads cannot be split over 4 ranks: ConfigError, raised before any collective."""
    with pytest.raises(ConfigError, match=r"n_kv_heads=2 is not divisible by --tp 4"):
        tp_lesson.apply_tensor_parallel(GPT(get_config("tiny")), group, sequence_parallel=False)


def torch_tensor_parallel_loss(tokens):
    """The same GPT split by torch.distributed.tensor.parallel over a DeviceMesh of every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = GPT(CFG, seed=SEED)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    plan = {}
    for index in range(CFG.n_layers):
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"layers.{index}.{name}"] = ColwiseParallel()
        for name in ("attn.o_proj", "mlp.down_proj"):
            plan[f"layers.{index}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    # gradients come back as DTensors; full_tensor() gathers the shards into the reference shape
    grads = {name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
             for name, p in model.named_parameters()}
    return loss.item(), grads


def check_reduce_scatter_refuses_uneven_sequence(group):
    """A caller that skipped validate_tensor_parallel still gets a ConfigError, raised from the shape on
    every rank before the collective, not a hang."""
    with pytest.raises(ConfigError, match="sequence length 6 is not divisible by tp=4"):
        tp_lesson.reduce_scatter_sequence(torch.zeros(1, 6, 4), group)


def check_pipeline_stages(tokens, group, form):
    """Two pipeline-stage-like halves of the GPT, converted separately, called the way lesson 03
    calls them: stage 0 has the embedding and layer 0, stage 1 layer 1, the final norm and the head.
    The stages exchange the hidden states as they are (this rank's s/tp tokens under SP).
    Returns the mean loss, the traffic by collective, and each stage's measured and predicted
    activations."""
    tp = dist.get_world_size(group)
    first, second = GPT(CFG, seed=SEED), GPT(CFG, seed=SEED)
    first.layers, first.norm, first.lm_head = first.layers[:1], None, None
    second.layers, second.tok_embeddings = second.layers[1:], None
    for stage in (first, second):
        tp_lesson.apply_tensor_parallel(stage, group, **FORMS[form])
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    rope = first.rope(torch.arange(inputs.shape[1]))
    comm.meter.reset()
    with ActivationMeter(first) as first_saved:
        hidden = first.layers[0](first.embed(inputs), rope)
    # summed, as a training step asks for it (predicted_tp_activation_bytes assumes the sum)
    with ActivationMeter(second) as second_saved:
        loss = second.head_loss(second.layers[0](hidden, rope), targets, reduction="sum")
    loss.backward()
    predicted = [tp_lesson.predicted_tp_activation_bytes(CFG, *inputs.shape, tp, stage=stage, **FORMS[form])
                 for stage in (first, second)]
    predicted_traffic = {}
    for stage in (first, second):
        for (kind, _), value in tp_lesson.predicted_tp_traffic(CFG, 2, SEQ, 1, tp, stage=stage,
                                                               **FORMS[form]).items():
            predicted_traffic[kind] = predicted_traffic.get(kind, 0) + value
    return {"loss": loss.item() / targets.numel(),
            "traffic": {kind: entry.payload_bytes for (kind, _), entry in comm.meter.traffic.items()},
            "activations": [first_saved.peak_bytes, second_saved.peak_bytes], "predicted_activations": predicted,
            "predicted_traffic": predicted_traffic}


def check_layers():
    world = dist.get_world_size()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # new_group is collective: all ranks make both
    for group in (dist.group.WORLD, pairs[dist.get_rank() // 2]):
        for form in FORMS:
            check_column(group, form)
        for sequence_parallel in (False, True):     # both forms of SP share the row layer and embedding
            check_row(group, sequence_parallel)
            check_embedding(group, sequence_parallel)
        check_cross_entropy(group)
    check_apply_refuses_indivisible_kv_heads(dist.group.WORLD)
    check_reduce_scatter_refuses_uneven_sequence(dist.group.WORLD)

    tokens = torch.randint(0, CFG.vocab_size, (2, SEQ + 1), generator=torch.Generator().manual_seed(5))
    ours = tp_lesson.apply_tensor_parallel(GPT(CFG, seed=SEED), dist.group.WORLD, sequence_parallel=False)
    reference = GPT(CFG, seed=SEED)
    reference_loss = reference(tokens[:, :-1], tokens[:, 1:])
    reference_loss.backward()
    torch_loss, torch_grads = torch_tensor_parallel_loss(tokens)
    for name, param in reference.named_parameters():
        assert_close(torch_grads[name], param.grad, f"torch.distributed.tensor.parallel grad {name}")
    return {"world": world, "ours": ours(tokens[:, :-1], tokens[:, 1:]).item(),
            "stages": {form: check_pipeline_stages(tokens, dist.group.WORLD, form) for form in FORMS},
            "torch_tp": torch_loss, "reference": reference_loss.item()}


def test_layers_and_torch_tensor_parallel_match_single_device():
    results = run_ranks(4, check_layers, timeout_s=120)
    for result in results:
        # One forward of the whole model: float32 rounding only (see the module docstring).
        assert result["ours"] == pytest.approx(result["reference"], rel=1e-6, abs=0)
        for form, stages in result["stages"].items():
            assert stages["loss"] == pytest.approx(result["reference"], rel=1e-6, abs=0)
            assert stages["activations"] == stages["predicted_activations"]
            assert stages["traffic"] == stages["predicted_traffic"], form
        # PyTorch's DTensor tensor parallelism runs on gloo/CPU in this torch and agrees (its gradients
        # were compared inside the ranks).
        assert result["torch_tp"] == pytest.approx(result["reference"], rel=1e-6, abs=0)


# ----------------------------------------------------------------------------- the whole model


def batches(dp, grad_accum):
    shape = BatchShape(MICRO, SEQ, grad_accum, dp)
    return TokenBatches(builtin_corpus_paths()[0], shape, seed=SEED, vocab_size=CFG.vocab_size)


# Masked targets for the dp x tp runs: every row ignores a different number of its first targets,
# and rows 4-5, dp rank 1's first micro-batch at dp = 2, ignore all of theirs. Per-rank or
# per-micro-batch means would be NaN there and weigh the other tokens wrongly everywhere else.
MASK = partial(ignore_targets, ignored_rows=(4, 5))

# See build_test_optimizer.
ADAM_EPS = 1e-4


def build_test_optimizer(model):
    """The lessons' AdamW with eps = 1e-4 instead of 1e-8, in both runs.

    AdamW moves a weight by lr * m / (sqrt(v) + eps), about lr whatever the gradient's size. Where
    a gradient is at the float32 rounding floor (~1e-9 here, measured), its sign is decided by the
    summation order, and with eps = 1e-8 the two runs step that weight in different directions by
    up to lr. An eps above the rounding floor but below the typical gradient (1e-4 .. 1e-2 here)
    keeps real updates Adam-like and shrinks a rounding-level gradient's update to lr * g / eps.
    """
    optimizer = build_optimizer(model, LR)
    for group in optimizer.param_groups:
        group["eps"] = ADAM_EPS
    set_learning_rate(optimizer, LR)
    return optimizer


def capture_gradients(model, optimizer, before, after):
    """Keep the step-0 gradients as the optimizer step would see them without clipping (right after
    data parallelism's all-reduce) and with it (the optimizer's pre-step hook), from outside."""
    finish = model.finish_gradient_synchronization

    def finish_and_keep():
        finish()
        if not before:
            before.update({name: p.grad.detach().clone() for name, p in model.module.named_parameters()})
    model.finish_gradient_synchronization = finish_and_keep

    def keep_clipped(opt, args, kwargs):
        if not after:
            after.update({name: p.grad.detach().clone() for name, p in model.module.named_parameters()})
    optimizer.register_step_pre_hook(keep_clipped)


def check_model(configs):
    results = []
    device = torch.device("cpu")
    for dp, tp, form, masked in configs:
        grid = ProcessGrid(GridShape(dp=dp, tp=tp))
        module = tp_lesson.apply_tensor_parallel(GPT(CFG, seed=SEED), grid.tp_group, **FORMS[form])
        model = dp_lesson.wrap_data_parallel(module, grid.dp_group, "bucketed", 16 * 2**10)
        optimizer = build_test_optimizer(module)
        settings = StepSettings(device, torch.float32, MAX_GRAD_NORM, norm_groups=(grid.tp_group,),
                                counts_toward_norm=tp_lesson.tp_counts_toward_norm(grid.tp_group))
        grads, clipped_grads = {}, {}
        capture_gradients(model, optimizer, grads, clipped_grads)
        data = batches(dp, SEQUENCES_PER_STEP // (MICRO * dp))
        activations = ActivationMeter(model)
        comm.meter.reset()
        steps = []
        for step in range(STEPS):
            batch = masked_step_batch(data, step, grid.dp_rank, MASK) if masked else data.step_batch(step, grid.dp_rank)
            with activations if step == 0 else nullcontext():
                steps.append(dp_lesson.train_step(model, optimizer, batch, settings))
        results.append({
            "config": (dp, tp, form, masked), "tp_rank": grid.tp_rank,
            "losses": [result.loss for result in steps], "norms": [result.grad_norm for result in steps],
            "grads": grads, "clipped_grads": clipped_grads,
            "params": {name: p.detach().clone() for name, p in module.named_parameters()},
            "split_dims": {name: getattr(p, "tp_split_dim", None) for name, p in module.named_parameters()},
            "traffic": {key: entry.payload_bytes for key, entry in comm.meter.traffic.items()},
            "devices": {key: sorted(devices) for key, devices in comm.meter.devices.items()},
            "activation_bytes": activations.peak_bytes,
        })
    return results


def local_view(full, split_dim, tp_rank, tp):
    return full if split_dim is None else shard(full, split_dim, tp_rank, tp)


# (dp, tp, sequence parallelism's form, masked targets) per world size, each form: tp = 2 and 4 alone
# on the data as it comes, and dp x tp = 2 x 2 on masked targets.
MODEL_CONFIGS = {2: [(1, 2, form, False) for form in FORMS],
                 4: [(1, 4, form, False) for form in FORMS] + [(2, 2, form, True) for form in FORMS]}


@pytest.fixture(scope="module")
def reference():
    """One device, each step's whole global batch in one piece (its mean loss over the targets that
    count), the same clipping and AdamW steps; as the data comes and with MASK's targets."""
    data = batches(1, SEQUENCES_PER_STEP // MICRO)
    return {masked: train_reference(CFG, SEED, data, STEPS, LR, MAX_GRAD_NORM, adam_eps=ADAM_EPS,
                                    mask_targets=MASK if masked else None)
            for masked in (False, True)}


def test_masked_targets_differ_between_ranks_and_micro_batches():
    """What the dp x tp runs train on: the mask the token-weighted loss must handle."""
    data = batches(2, SEQUENCES_PER_STEP // (MICRO * 2))
    for step in range(STEPS):
        counts = [[int((targets != IGNORE_INDEX).sum()) for _, targets in
                   masked_step_batch(data, step, dp_rank, MASK).micro_batches] for dp_rank in (0, 1)]
        assert counts[1][0] == 0, counts
        assert sum(counts[0]) != sum(counts[1]) and len(set(counts[0])) == 2, counts


@pytest.mark.parametrize("world_size", sorted(MODEL_CONFIGS))
def test_model_matches_single_device_and_formulas(world_size, reference):
    for run in reference.values():
        assert min(run["norms"]) > MAX_GRAD_NORM, "clipping must be active for the test to cover it"
    per_rank = run_ranks(world_size, check_model, MODEL_CONFIGS[world_size], timeout_s=240)
    for rank, results in enumerate(per_rank):
        for result in results:
            dp, tp, form, masked = result["config"]
            ref = reference[masked]
            what = f"rank {rank} dp={dp} tp={tp} sp={form} masked={masked}"
            # Losses and norms: float32 rounding of a differently ordered sum (split matmuls, the
            # token-weighted shares of micro-batches and dp ranks).
            assert result["losses"] == pytest.approx(ref["losses"], rel=1e-6, abs=0), what
            assert result["norms"] == pytest.approx(ref["norms"], rel=1e-6, abs=0), what
            for name, split_dim in result["split_dims"].items():
                view = partial(local_view, split_dim=split_dim, tp_rank=result["tp_rank"], tp=tp)
                # Gradients at step 0 before clipping: the largest are ~0.2, where a float32 ulp is
                # ~1.5e-8; reordered sums differ by a few ulps of the largest terms (measured <= 6e-8).
                assert_close(result["grads"][name], view(ref["grads"][name]), f"{what} grad {name}",
                             rtol=1e-5, atol=4e-7)
                # ... and after clipping: the largest are ~1e-2, where a float32 ulp is ~1e-9 (measured
                # <= 2.8e-9). Both atols are 2e-6 of the largest gradient.
                assert_close(result["clipped_grads"][name], view(ref["clipped_grads"][name]),
                             f"{what} clipped grad {name}", rtol=1e-5, atol=2e-8)
                # Parameters after 3 AdamW steps (eps: see build_test_optimizer): weights ~0.02 differ
                # by <= 2e-8 (measured, ~10 ulps), norm gains ~1 by one ulp (1.2e-7). atol 1e-7 is
                # lr * 3e-5: a wrong gradient anywhere would move weights by a good fraction of lr.
                assert_close(result["params"][name], view(ref["params"][name]), f"{what} param {name}",
                             rtol=1e-6, atol=1e-7)

            # Every group's traffic equals the formulas the report prints: tp from this lesson, dp's
            # gradient all-reduce from lesson 01, the loss summed over dp and the norm over tp.
            n_micro = SEQUENCES_PER_STEP // (MICRO * dp)
            predicted = add_traffic(
                tp_lesson.predicted_tp_traffic(CFG, MICRO, SEQ, n_micro, tp, **FORMS[form]),
                data_parallel_traffic(tp_lesson.tp_parameter_count(CFG, tp)),
                step_bookkeeping_traffic(loss_groups=("dp",), norm_groups=("tp",)))
            assert result["traffic"] == {key: STEPS * value for key, value in predicted.items()}, what
            # Every collective of the training step moved tensors on the rank's device (on a GPU,
            # NCCL refuses anything else).
            assert result["devices"] == {key: ["cpu"] for key in result["traffic"]}, what
            assert result["activation_bytes"] == tp_lesson.predicted_tp_activation_bytes(
                CFG, MICRO, SEQ, tp, **FORMS[form]), what

        # What each form of sequence parallelism saves, from the measurements alone (independently
        # of the formula). Plain: the 2L + 1 norms' inputs, 1/rms and normalised inputs, 2h + 1
        # floats per token, go from every token to s/tp tokens; their outputs, which the column
        # layers keep gathered, stay whole ...
        measured = {result["config"][:3]: result["activation_bytes"] for result in results}
        norm_tokens = (2 * CFG.n_layers + 1) * MICRO * SEQ
        norm_work, norm_outputs = norm_tokens * (2 * CFG.hidden + 1) * 4, norm_tokens * CFG.hidden * 4
        for dp, tp, _ in measured:
            off, plain, saving = (measured[(dp, tp, form)] for form in FORMS)
            assert off - plain == norm_work - norm_work // tp, (rank, dp, tp)
            # ... and saving the shard keeps s/tp tokens of those outputs: less than plain by
            # exactly what the formula predicts between the two
            assert plain - saving == norm_outputs - norm_outputs // tp, (rank, dp, tp)
            assert plain - saving == (tp_lesson.predicted_tp_activation_bytes(CFG, MICRO, SEQ, tp, **FORMS["plain"])
                                      - tp_lesson.predicted_tp_activation_bytes(CFG, MICRO, SEQ, tp,
                                                                                **FORMS["saving the shard"]))
        # Saving the shard, everything else a block saves is split too: what is left after the
        # parts outside the blocks that no tp rank splits (the rotary tables, the token ids with the
        # embedding's mask, the targets and the loss's float32 log-sum-exp) scales as 1/tp (tp = 2
        # and 4 agree).
        tokens = MICRO * SEQ
        unsplit = SEQ * CFG.head_dim * 4 + tokens * (8 + 1) + tokens * (8 + 4)
        assert len({(nbytes - unsplit) * tp for (_, tp, form), nbytes in measured.items()
                    if form == "saving the shard"}) == 1, rank


# ----------------------------------------------------------------------------- async dgrad


def train_steps(grid, cfg, seq, form, async_dgrad, dtype, steps):
    """`steps` steps of the whole GPT at tp (dp = 1, two micro-batches a step, clipping on): what the
    step sees (losses, norms, gradients before and after clipping), the parameters after, the traffic."""
    module = tp_lesson.apply_tensor_parallel(GPT(cfg, seed=SEED), grid.tp_group, **FORMS[form],
                                             async_dgrad=async_dgrad)
    model = dp_lesson.wrap_data_parallel(module, grid.dp_group, "bucketed", 16 * 2**10)
    optimizer = build_test_optimizer(module)
    settings = StepSettings(torch.device("cpu"), dtype, MAX_GRAD_NORM, norm_groups=(grid.tp_group,),
                            counts_toward_norm=tp_lesson.tp_counts_toward_norm(grid.tp_group))
    grads, clipped_grads = {}, {}
    capture_gradients(model, optimizer, grads, clipped_grads)
    # When each column layer's weight gradient arrives, how many of the norms' backward collectives
    # (all-reduces, or reduce-scatters under sequence parallelism) have been issued so far.
    entry = ("all_reduce" if form == "off" else "reduce_scatter_single", "tp")
    issued_before = {}

    def arrived(name, param):
        issued_before.setdefault(name, comm.meter.get(*entry).calls)
    for name, param in module.named_parameters():
        if name.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            param.register_post_accumulate_grad_hook(partial(arrived, name))
    data = TokenBatches(builtin_corpus_paths()[0], BatchShape(MICRO, seq, 2, 1), seed=SEED, vocab_size=cfg.vocab_size)
    comm.meter.reset()
    results = [dp_lesson.train_step(model, optimizer, data.step_batch(step, 0), settings) for step in range(steps)]
    return {"losses": [result.loss for result in results], "norms": [result.grad_norm for result in results],
            "grads": grads, "clipped_grads": clipped_grads, "issued_before": issued_before,
            "params": {name: p.detach().clone() for name, p in module.named_parameters()},
            "traffic": {key: (entry.calls, entry.payload_bytes) for key, entry in comm.meter.traffic.items()}}


def check_async_dgrad(cfg, seq):
    """Each form of sequence parallelism with async dgrad on and off, float32 (3 steps) and bf16
    autocast (1 step): whether the weight gradients are made before or while the collective
    travels, they are the same products accumulated in the same order, so everything is equal
    bit for bit."""
    grid = ProcessGrid(GridShape(tp=dist.get_world_size()))
    for form in FORMS:
        for dtype, steps in ((torch.float32, 3), (torch.bfloat16, 1)):
            on, off = (train_steps(grid, cfg, seq, form, async_dgrad, dtype, steps) for async_dgrad in (True, False))
            what = f"tp={grid.tp_size} sp={form} {dtype}"
            # On, the norm's collective has left before the weight gradients of its readers are made.
            assert len(on["issued_before"]) == 5 * cfg.n_layers, what
            assert on["issued_before"] == {name: n + 1 for name, n in off["issued_before"].items()}, what
            assert on["traffic"] == off["traffic"], what
            assert on["losses"] == off["losses"] and on["norms"] == off["norms"], what
            for name in on["params"]:
                for key in ("grads", "clipped_grads", "params"):
                    assert torch.equal(on[key][name], off[key][name]), f"{what} {key} {name}"
    return True


# tp = 3 needs every split dimension divisible by 3, and a sequence too under sequence parallelism
CFG_TP3 = get_config("tiny", n_layers=2, hidden=48, n_heads=6, n_kv_heads=3, ffn_hidden=96, vocab_size=258)


@pytest.mark.parametrize("tp, cfg, seq", [(2, CFG, SEQ), (3, CFG_TP3, 12)])
def test_async_dgrad_equals_the_order_it_replaces(tp, cfg, seq):
    assert run_ranks(tp, check_async_dgrad, cfg, seq, timeout_s=240) == [True] * tp


# ----------------------------------------------------------------------------- configuration errors


@pytest.mark.parametrize("overrides, tp, seq_len, sequence_parallel, message", [
    ({"n_heads": 6, "n_kv_heads": 6, "hidden": 96}, 4, None, False, "n_heads=6 is not divisible by --tp 4"),
    ({"n_heads": 8, "n_kv_heads": 2}, 4, None, False, "n_kv_heads=2 is not divisible by --tp 4"),
    ({"hidden": 18, "n_heads": 3, "n_kv_heads": 3}, 4, None, False, "hidden=18 is not divisible by --tp 4"),
    ({"ffn_hidden": 390}, 4, None, False, "ffn_hidden=390 is not divisible by --tp 4"),
    ({"vocab_size": 258}, 4, None, False, "vocab_size=258 is not divisible by --tp 4"),
    ({}, 2, 33, True, "--seq-len 33 is not divisible by --tp 2"),
    ({"n_experts": 4}, 2, None, False, "n_experts=4"),
])
def test_bad_configuration_is_one_clear_line(overrides, tp, seq_len, sequence_parallel, message):
    cfg = GPTConfig(**{**vars(get_config("tiny")), **overrides})
    with pytest.raises(ConfigError) as error:
        tp_lesson.validate_tensor_parallel(cfg, tp, seq_len, sequence_parallel)
    lines = [line for line in str(error.value).splitlines() if line.startswith("  - ")]
    assert len([line for line in lines if message in line]) == 1, str(error.value)


# ----------------------------------------------------------------------------- the script


def run_script(*flags, nproc=4, timeout=240):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={nproc}", str(ROOT / "02_tensor_parallel.py"), *flags],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_script_trains_with_tp_and_dp_and_reports():
    run = run_script("--tp", "2", "--dp", "2", "--steps", "6", "--warmup-steps", "2",
                     "--seq-len", "64", "--micro-batch-size", "2")
    assert run.returncode == 0, run.stdout + run.stderr
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", run.stdout)]
    assert len(losses) == 6 and losses[-1] < losses[0], run.stdout
    for line in ("== memory", "== communication", "all_reduce            tp", "tokens/s"):
        assert line in run.stdout, run.stdout


def test_script_refuses_a_bad_configuration_without_hanging():
    # One process is enough: every rank finds the same problems from the same flags (the 2-rank
    # tests of lessons 01 and 03 show rank 0's line reaching the user).
    run = run_script("--tp", "4", "--dp", "1", "--sequence-parallel", "--seq-len", "33", nproc=1, timeout=120)
    assert run.returncode != 0
    for problem in ("the world size is 1", "n_kv_heads=2 is not divisible by --tp 4",
                    "--seq-len 33 is not divisible by --tp 4"):
        assert problem in run.stderr, run.stderr


def test_save_sequence_shard_needs_sequence_parallel():
    """The refinement alone would refine nothing: one line naming both flags, before any process group."""
    args = tp_lesson.parse_args(["--tp", "2", "--save-sequence-shard"])
    with pytest.raises(ConfigError, match="--save-sequence-shard refines sequence parallelism: add --sequence-parallel"):
        checked_plan(args, tp_lesson.validate, None, world_size=2)


def test_script_refuses_sequence_parallel_without_tensor_parallel():
    """--sequence-parallel with --tp 1 would split nothing: one line, exit code 2, before any process
    group (the banner, printed once the grid exists, never comes)."""
    run = run_script("--tp", "1", "--sequence-parallel", nproc=2, timeout=120)
    assert run.returncode != 0
    assert re.search(r"exitcode\s*:\s*2\b", run.stderr), run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: bad flags:"], run.stderr
    assert "--sequence-parallel needs --tp > 1" in run.stderr and "lesson 02" not in run.stdout, run.stdout
