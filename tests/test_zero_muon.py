"""Muon proven (06_zero_muon.py): on one device equal to torch.optim.Muon with AdamW beside it, then
over real gloo ranks with ZeRO-0/1/2/3 equal to one device, its traffic and memory to their formulas.

One device: PyTorch's Muon (the same adjust_lr_fn) for the blocks' matrices plus the shared AdamW
for the rest, against the lesson's Muon, several steps on the reference GPT in float32: the same
float operations on the same values, so the parameters must agree bit for bit.

Distributed: every stage at dp = 2 and dp = 3 (units padded, matrices cut between ranks unevenly),
and at dp 3 a mixture of experts (each expert's matrix orthogonalised on its own, stacks cut by
shard boundaries), against the lesson's one-device Muon: losses of every step and step-0
gradients before and after clipping within lesson 06's tolerances (the same sums in another
order), parameters bit for bit; a checkpoint written at dp 2 resumed at dp 3, bit for bit too.
Bit for bit because the optimizer is fed the one-device run's clipped gradients (replay, after the
rank's own were recorded): Newton-Schulz runs in bf16, where a float32 gradient an ulp apart can
land on the other side of a rounding and move the result by a bf16 step, which the iteration then
amplifies (a 1e-6 relative noise on the gradients moves this model's weights by 4e-3 in 4 steps,
where AdamW's move by 1e-7): compared free-running, Muon's parameters would prove only that they
are near. Fed the same gradients, the distributed step performs the very operations of one device
(elementwise on the pieces, Newton-Schulz on the same whole matrix), and any slip in the exchange
(a part sent to the wrong owner, a piece misplaced) would show as a difference. Because every
step's parameters are then the reference's, every step's loss is compared too.
"""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest
import torch
import torch.distributed as dist

import picotron_like.checkpoint as checkpoints
from picotron_like import comm, train
from picotron_like.data import BatchShape, TokenBatches, builtin_corpus_paths
from picotron_like.lessons import load_lesson
from picotron_like.lr_schedule import learning_rate
from picotron_like.metrics import add_traffic, step_bookkeeping_traffic
from picotron_like.model import GPT, get_config
from picotron_like.moe import is_expert_parameter
from picotron_like.testing import run_ranks
from picotron_like.topology import ConfigError, GridShape, ProcessGrid
from picotron_like.train import build_optimizer, clip_grad_norm_, optimizer_step
from test_zero import ADAM_EPS, CFG, MOE_CFG, TOLERANCE, gathered, observe_gradients

SEQ, MICRO, GLOBAL_SEQUENCES, STEPS, LR, SEED = 32, 2, 12, 4, 3e-3, 7
SAVED_AT = 2        # the step whose checkpoint a run at another dp resumes
MUON_LR, MAX_GRAD_NORM = 0.02, 1.0
CPU = torch.device("cpu")
# The fused tail divides each gradient by 1 / clip factor where the exact one multiplies by it: an
# ulp apart, and Newton-Schulz's bf16 input flips a rounding here and there, which the iteration
# amplifies (measured: 7.8e-5 after two steps). The suite's tolerance on parameters, 1e-2 lr.
FUSED_TOLERANCE = 1e-2 * MUON_LR


def lesson():
    return load_lesson("06_zero_muon")


def muon_settings(adjust_lr: str = "original"):
    return lesson().MuonSettings(lr=MUON_LR, weight_decay=0.1, adjust_lr=adjust_lr)


def batches(dp: int) -> TokenBatches:
    shape = BatchShape(MICRO, SEQ, GLOBAL_SEQUENCES // (MICRO * dp), dp)
    return TokenBatches(builtin_corpus_paths()[0], shape, seed=SEED, vocab_size=CFG.vocab_size)


def with_adam_eps(optimizer):
    """ADAM_EPS on AdamW's groups (test_zero's reason: rounding-noise gradients damped alike)."""
    for group in optimizer.param_groups:
        if "eps" in group:
            group["eps"] = ADAM_EPS
    return optimizer


def train_one_device(model, optimizer, steps: int = STEPS) -> dict:
    """The reference loop (testing.train_reference's) with any optimizer."""
    data, losses, norms, seen = batches(1), [], [], {}
    for step in range(steps):
        window = data.global_batch(step)
        loss = model(window[:, :-1], window[:, 1:])
        loss.backward()
        seen.setdefault("grads", {name: p.grad.clone() for name, p in model.named_parameters()})
        norm = clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        seen.setdefault("clipped_grads", {name: p.grad.clone() for name, p in model.named_parameters()})
        clipped = {name: p.grad.clone() for name, p in model.named_parameters()}
        seen.setdefault("every_clipped_grads", []).append(clipped)
        optimizer_step(optimizer, norm)
        optimizer.zero_grad()
        losses.append(loss.item())
        norms.append(norm.item())
    return {**seen, "losses": losses, "norms": norms,
            "params": {name: p.detach().clone() for name, p in model.named_parameters()}}


class TorchMuonWithAdamW(torch.optim.Optimizer):
    """The reference: PyTorch's Muon and the shared AdamW, stepped one after the other."""

    def __init__(self, model, adjust_lr: str):
        settings = muon_settings(adjust_lr)
        hidden = lesson().is_hidden_matrix
        self.muon = torch.optim.Muon([p for n, p in model.named_parameters() if hidden(n, p.shape)],
                                     lr=settings.lr, weight_decay=settings.weight_decay,
                                     momentum=settings.momentum, nesterov=True, adjust_lr_fn=adjust_lr)
        self.adamw = build_optimizer([(n, p) for n, p in model.named_parameters() if not hidden(n, p.shape)], LR)
        super().__init__([*self.muon.param_groups, *self.adamw.param_groups], {})

    def step(self, closure=None):
        self.muon.step()
        self.adamw.step()


def muon_on_one_device(cfg) -> dict:
    """The lesson's Muon on one device (the distributed runs' ground truth)."""
    model = GPT(cfg, seed=SEED)
    result = train_one_device(model, with_adam_eps(lesson().build_muon_optimizer(model, LR, muon_settings())))
    assert min(result["norms"]) > MAX_GRAD_NORM, "clipping must act, or the clipped gradients prove nothing"
    return result


@pytest.fixture(scope="module")
def reference():
    return {"dense": muon_on_one_device(CFG), "experts": muon_on_one_device(MOE_CFG)}


@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_one_device_muon_equals_pytorchs_bit_for_bit(adjust_lr):
    ours_model, theirs_model = GPT(CFG, seed=SEED), GPT(CFG, seed=SEED)
    ours = train_one_device(ours_model, lesson().build_muon_optimizer(ours_model, LR, muon_settings(adjust_lr)))
    theirs = train_one_device(theirs_model, TorchMuonWithAdamW(theirs_model, adjust_lr))
    assert ours["losses"] == theirs["losses"]
    for name, param in theirs["params"].items():
        assert torch.equal(ours["params"][name], param), name
    moved = {name for name, p in ours_model.named_parameters()
             if not torch.equal(p, GPT(CFG, seed=SEED).get_parameter(name))}
    assert moved == set(theirs["params"]), "every parameter must have been stepped"


def test_expert_stacks_step_as_their_matrices_one_by_one():
    """A stack of experts [E, rows, cols]: each expert's matrix orthogonalised and scaled on its own,
    as PyTorch's Muon steps E separate matrices."""
    torch.manual_seed(0)
    stack = torch.nn.Parameter(torch.randn(3, 24, 16))
    separate = [torch.nn.Parameter(matrix.detach().clone()) for matrix in stack]
    ours = lesson().Muon([stack], muon_settings())
    theirs = torch.optim.Muon(separate, lr=MUON_LR, weight_decay=0.1, adjust_lr_fn="original")
    for _ in range(3):
        grad = torch.randn(3, 24, 16)
        stack.grad = grad.clone()
        for index, matrix in enumerate(separate):
            matrix.grad = grad[index].clone()
        ours.step()
        theirs.step()
    for index, matrix in enumerate(separate):
        assert torch.equal(stack[index], matrix), index


def test_the_schedule_moves_muon_at_its_own_peak_and_adamw_unchanged():
    model = GPT(CFG, seed=SEED)
    optimizer = lesson().build_muon_optimizer(model, LR, muon_settings())
    adamw = build_optimizer(GPT(CFG, seed=SEED), LR)
    for step in (0, 3, 10, 19):
        lr = learning_rate(step, LR, 5, 20)
        train.set_learning_rate(optimizer, lr)
        train.set_learning_rate(adamw, lr)
        assert [g["lr"] for g in optimizer.adamw.param_groups] == [g["lr"] for g in adamw.param_groups] == [lr, lr]
        assert optimizer.muon.param_groups[0]["lr"] == pytest.approx(lr * MUON_LR / LR, rel=1e-15)


def test_the_fused_tail_and_a_non_finite_norm_reach_muon():
    """With fused AdamW beside it (the CUDA tail; fused AdamW runs on a CPU too), the combined
    optimizer takes optimizer_step's found_inf and grad_scale: a non-finite norm changes no bit of
    any weight or state; a finite one steps as the exact tail does (the gradients divided by
    1 / clip factor instead of multiplied by it: rounding apart)."""
    zero_muon = lesson()

    def build(fused: bool):
        model = GPT(CFG, seed=SEED)
        hidden = [p for n, p in model.named_parameters() if zero_muon.is_hidden_matrix(n, p.shape)]
        rest = [p for n, p in model.named_parameters() if not zero_muon.is_hidden_matrix(n, p.shape)]
        adamw = torch.optim.AdamW(rest, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=fused)
        return model, zero_muon.MuonWithAdamW(zero_muon.Muon(hidden, muon_settings()), adamw)

    data = batches(1)
    results = {}
    for tail in ("exact", "fused"):
        model, optimizer = build(fused=tail == "fused")
        assert train.supports_amp_scaling(optimizer) == (tail == "fused")
        settings = train.StepSettings(CPU, max_grad_norm=MAX_GRAD_NORM, tail=tail)
        for step in range(2):
            window = data.global_batch(step)
            model(window[:, :-1], window[:, 1:]).backward()
            norm, skipped = train.clip_and_step(optimizer, model.parameters(), settings)
            optimizer.zero_grad()
            assert norm > MAX_GRAD_NORM and not skipped
        results[tail] = {name: p.detach().clone() for name, p in model.named_parameters()}
    for name, param in results["fused"].items():
        torch.testing.assert_close(param, results["exact"][name], rtol=0, atol=FUSED_TOLERANCE, msg=name)
    window = data.global_batch(2)
    model(window[:, :-1], window[:, 1:]).backward()
    states = {param: {key: value.clone() for key, value in state.items()} for param, state in optimizer.state.items()}
    next(model.parameters()).grad[0, 0] = float("nan")      # a poisoned gradient: the step must change nothing
    norm, skipped = train.clip_and_step(optimizer, model.parameters(), settings)
    assert bool(skipped)
    for name, param in model.named_parameters():
        assert torch.equal(param, results["fused"][name]), name
    for param, state in optimizer.state.items():
        for key, value in state.items():
            assert torch.equal(value, states[param][key]), key


# ----------------------------------------------------------------------------- over ZeRO's shards on gloo ranks


def replay(model, optimizer, clipped_grads: list[dict]) -> None:
    """Before each step, every master piece's gradient replaced by its slice of the one-device run's
    clipped gradient of that step (after observe_gradients' hook has seen the rank's own): the
    optimizer then steps the same values, and must give the same bits."""
    slices = []
    for unit in model.units:
        offsets = dict(zip(unit.names, [0, *torch.tensor([s.numel() for s in unit.shapes]).cumsum(0).tolist()]))
        for piece in unit.pieces:
            if piece.param is not None:
                lo = unit.start + piece.lo - offsets[piece.name]
                slices.append((piece.master, piece.name, lo, lo + piece.hi - piece.lo))
    steps = iter(clipped_grads)

    def with_reference_gradients(*_):
        grads = next(steps)
        for master, name, lo, hi in slices:
            master.grad = grads[name].reshape(-1)[lo:hi].clone()

    optimizer.register_step_pre_hook(with_reference_gradients)


def muon_zero_run(grid: ProcessGrid, stage: int, clipped_grads: list[dict], save_dir=None, cfg=CFG) -> dict:
    """STEPS steps of lesson 06's ZeRO at `stage` with Muon, the optimizer fed the one-device run's
    gradients (replay); what the tests compare, and the traffic and model states next to their
    formulas. With `save_dir`, a checkpoint after step SAVED_AT."""
    zero_muon, zero = lesson(), load_lesson("06_zero")
    precision = zero.Precision()
    model = zero.wrap_zero(GPT(cfg, seed=SEED), grid.dp_group, stage, precision)
    optimizer = with_adam_eps(zero_muon.build_sharded_muon_optimizer(model, LR, muon_settings()))
    settings = zero.step_settings(CPU, precision, MAX_GRAD_NORM)
    seen = observe_gradients(model, optimizer)
    replay(model, optimizer, clipped_grads)
    data = batches(grid.dp_size)
    comm.meter.reset()
    results = []
    for step in range(STEPS):
        results.append(zero.train_step(model, optimizer, data.step_batch(step, grid.dp_rank), settings))
        if save_dir is not None and step + 1 == SAVED_AT:
            save(save_dir, model, optimizer, grid)
    model.wait_for_weights()
    n, counts = grid.dp_size, [unit.numel for unit in model.units]
    exchanges = optimizer.muon.exchanges
    predicted = add_traffic(zero_muon.predicted_muon_traffic(exchanges),
                            zero.predicted_zero_traffic(counts, n, stage, precision, data.shape.grad_accum, True, "dp"),
                            step_bookkeeping_traffic(loss_groups=("dp",), norm_groups=("dp",) if stage else ()))
    states = zero_muon.predicted_model_states(counts, n, stage, precision, zero_muon.muon_elements_held(exchanges))
    return {"grads": seen["before"], "clipped_grads": seen["after"],
            "params": gathered(model, lambda unit: unit.master),
            "losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
            "traffic": {key: value.payload_bytes for key, value in comm.meter.traffic.items()},
            "predicted": {key: STEPS * value for key, value in predicted.items()},
            "states": asdict(zero.measured_model_states(model, optimizer)), "predicted_states": asdict(states),
            "owners": [m.owner for m in exchanges[0].matrices],
            "split": [sum(hi > lo for lo, hi in m.held) for m in exchanges[0].matrices
                      if not cfg.n_experts or is_expert_parameter(m.name)]}


def save(save_dir, model, optimizer, grid) -> None:
    """Lesson 07's checkpoint of this rank's master pieces and their optimizer states."""
    info = {"model": asdict(CFG), "layout": {"dp": grid.dp_size, "zero_stage": model.stage}, "run": {}, "settings": {}}
    model.wait_for_weights()
    checkpoints.save(save_dir, SAVED_AT, checkpoints.reference_slices(model, grid), optimizer, info)


def resumed_run(grid: ProcessGrid, stage: int, clipped_grads: list[dict], save_dir) -> dict:
    """A model built from another seed, loaded from the checkpoint (whatever dp and stage wrote
    it), trained on from step SAVED_AT with the same replayed gradients."""
    zero_muon, zero = lesson(), load_lesson("06_zero")
    model = zero.wrap_zero(GPT(CFG, seed=SEED + 1), grid.dp_group, stage)
    optimizer = with_adam_eps(zero_muon.build_sharded_muon_optimizer(model, LR, muon_settings()))
    manifest = checkpoints.read_manifest(checkpoints.step_directory(save_dir, SAVED_AT), CFG)
    checkpoints.load(manifest, checkpoints.reference_slices(model, grid), optimizer)
    model.publish_master()
    replay(model, optimizer, clipped_grads[SAVED_AT:])
    settings, data = zero.step_settings(CPU, zero.Precision(), MAX_GRAD_NORM), batches(grid.dp_size)
    losses = [zero.train_step(model, optimizer, data.step_batch(step, grid.dp_rank), settings).loss
              for step in range(SAVED_AT, STEPS)]
    model.wait_for_weights()
    return {"losses": losses, "params": gathered(model, lambda unit: unit.master)}


def every_stage(clipped_grads: dict[str, list[dict]], save_dir) -> dict:
    """Stages 0-3; at dp 2, ZeRO-1 saves a checkpoint, which dp 3 resumes with ZeRO-2; at dp 3, a
    mixture of experts with ZeRO-2 too (lesson 06's units on data parallelism alone: stacks of
    expert matrices cut by shard boundaries)."""
    grid = ProcessGrid(GridShape(dp=dist.get_world_size()))
    saving = grid.dp_size == 2
    dense = clipped_grads["dense"]
    runs = {("dense", stage): muon_zero_run(grid, stage, dense, save_dir if saving and stage == 1 else None)
            for stage in (0, 1, 2, 3)}
    if not saving:
        runs["resumed"] = resumed_run(grid, 2, dense, save_dir)
        runs[("experts", 2)] = muon_zero_run(grid, 2, clipped_grads["experts"], cfg=MOE_CFG)
    return runs


def test_every_stage_equals_one_device_muon_and_its_formulas_and_resumes_at_another_dp(reference, tmp_path):
    """dp 2, then dp 3: no unit's size is a multiple of 3, and shards cut matrices at uneven places.
    The checkpoint dp 2 writes mid-run (ZeRO-1) carries Muon's momentum, cut to the pieces: dp 3
    (ZeRO-2) resumes it, and its parameters after the last step are the reference's, bit for bit."""
    for dp in (2, 3):
        clipped_grads = {model: result["every_clipped_grads"] for model, result in reference.items()}
        check_every_stage(dp, run_ranks(dp, every_stage, clipped_grads, tmp_path, timeout_s=240), reference)


def check_every_stage(dp: int, ranks: list[dict], reference: dict) -> None:
    for rank, runs in enumerate(ranks):
        resumed = runs.pop("resumed", None)
        assert (resumed is None) == (dp == 2), "dp 3 resumes dp 2's checkpoint"
        if resumed is not None:
            dense = reference["dense"]
            torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(dense["losses"][SAVED_AT:]),
                                       rtol=0, atol=1e-5, msg=f"dp={dp} rank={rank} resumed losses")
            for name, tensor in dense["params"].items():
                assert torch.equal(resumed["params"][name], tensor), f"dp={dp} rank={rank} resumed {name}"
        assert (("experts", 2) in runs) == (dp == 3)
        for (model, stage), result in runs.items():
            where, one_device = f"dp={dp} rank={rank} {model} ZeRO-{stage}", reference[model]
            for key in ("grads", "clipped_grads"):
                for name, tensor in one_device[key].items():
                    torch.testing.assert_close(result[key][name], tensor, **TOLERANCE, msg=f"{where} {key} {name}")
            for key in ("losses", "norms"):
                torch.testing.assert_close(torch.tensor(result[key]), torch.tensor(one_device[key]), rtol=0,
                                           atol=1e-5, msg=f"{where} {key}")
            for name, tensor in one_device["params"].items():
                assert torch.equal(result["params"][name], tensor), f"{where} param {name}"
            assert result["traffic"] == result["predicted"], where
            assert result["states"] == result["predicted_states"], where
            assert sorted(set(result["owners"])) == list(range(dp)), f"{where}: every rank must own matrices"
        if dp == 3:
            assert max(runs[("dense", 1)]["split"]) > 1, "some matrix must be cut between ranks"
            assert max(runs[("experts", 2)]["split"]) > 1, "some expert's matrix must be cut between ranks"


# ----------------------------------------------------------------------------- the docstring's figures


def tiny_matrices(n: int, tie_to_holders: bool = True) -> list:
    """The tiny preset's hidden matrices with the owners lesson 06's units at n shards get; without
    `tie_to_holders`, the owners balance alone would pick (ties to the lower rank)."""
    zero_muon, zero = lesson(), load_lesson("06_zero")
    model = GPT(get_config("tiny"))
    names = {param: name for name, param in model.named_parameters()}
    units = [zero.FlatUnit([(names[p], p) for m in modules for p in m.parameters()], n, 0, None)
             for modules in zero.unit_modules(model)]
    matrices = [matrix for _, _, matrix in zero_muon.hidden_matrices(units, n)]
    if tie_to_holders:
        return zero_muon.balanced_owners(matrices, n)
    owners = zero_muon.balanced_owners([replace(m, held=((0, 0),) * n) for m in matrices], n)
    return [replace(m, owner=o.owner) for m, o in zip(matrices, owners)]


def travelling_share(matrices) -> float:
    """The share of the matrices' elements their owners do not hold."""
    span = lesson().span
    return sum(m.numel - span(m.held[m.owner]) for m in matrices) / sum(m.numel for m in matrices)


def test_the_docstrings_figures():
    zero_muon = lesson()
    doc = " ".join(zero_muon.__doc__.split())

    def split(n):
        return sum(sum(hi > lo for lo, hi in m.held) > 1 for m in tiny_matrices(n))

    assert f"{split(3)} of the {len(tiny_matrices(3))} hidden matrices lie across a shard boundary at dp 3, " \
           f"{split(8)} at dp 8" in doc
    assert f"({travelling_share(tiny_matrices(4)):.2f} instead of " \
           f"{travelling_share(tiny_matrices(4, tie_to_holders=False)):.2f} on the tiny preset at dp 4)" in doc
    block_0 = [m.owner for m in tiny_matrices(2)[:7]]
    assert f"owners:        {'   '.join(map(str, block_0[:4]))}          {block_0[4]}               " \
           f"{block_0[5]}          {block_0[6]}" in zero_muon.__doc__
    big = get_config("1b")
    flops = zero_muon.newton_schulz_flops((big.ffn_hidden, big.hidden))
    assert f"{flops:.1e} for the 1b preset's {big.ffn_hidden} x {big.hidden} MLP".replace("e+", "e") in doc
    assert f"for {round(flops / (6 * big.hidden * big.ffn_hidden), -2):,.0f} tokens" in doc
    loads = [sum(zero_muon.newton_schulz_flops(m.shape) for m in tiny_matrices(3) if m.owner == rank)
             for rank in range(3)]
    assert max(loads) / min(loads) < 1.01, "the Newton-Schulz FLOPs balanced over the ranks"


def test_bad_muon_flags_are_one_line_before_any_process_group():
    zero_muon = lesson()
    args = zero_muon.parse_args(["--muon-lr", "0", "--muon-weight-decay", "-1", "--muon-momentum", "1"])
    with pytest.raises(ConfigError) as refused:
        train.checked_plan(args, zero_muon.validate, None, 2)
    assert str(refused.value).splitlines() == [
        "bad Muon flags:", "  - --muon-lr 0.0 must be a positive number",
        "  - --muon-weight-decay -1.0 must be 0 or more", "  - --muon-momentum 1.0 must be in [0, 1)"]
