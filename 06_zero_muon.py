"""
Lesson 06, continued: Muon, an optimizer that needs each matrix whole, over ZeRO's flat shards.

    torchrun --nproc_per_node=2 06_zero_muon.py                        # ZeRO-3, Muon, CPU, ~20 s
    torchrun --nproc_per_node=3 06_zero_muon.py --zero-stage 1         # shards that cut matrices unevenly
    torchrun --nproc_per_node=2 06_zero_muon.py --optimizer adamw      # lesson 06 as it was, to compare

The problem. Muon (Jordan et al. 2024; Liu et al. 2025, "Muon is Scalable for LLM Training") steps
each hidden weight matrix by its momentum *orthogonalised*: about U V^T of the momentum's singular
value decomposition U S V^T, every direction moved alike. It is the optimizer of the modded-nanogpt
speed records and keeps one moment where AdamW keeps two. But orthogonalising is not elementwise:
it needs the whole matrix, and ZeRO (lesson 06) holds flat shards cut at arbitrary places. On the
tiny preset, 8 of the 28 hidden matrices lie across a shard boundary at dp 3, 20 at dp 8; and a
rank holds nothing of most of the others.

The idea. Keep everything elementwise where it is, on each rank's master pieces: the momentum
(one float32 buffer per element, in the optimizer's state like AdamW's moments, so checkpoints
save and reshard it alike), the Nesterov blend, the weight decay, the update. Only Newton-Schulz
needs a matrix whole, so each matrix gets one owner, chosen so that the Newton-Schulz FLOPs are
balanced over the ranks (the same choice on every rank, from the layout alone). One all-to-all
sends the parts to the owners, each owner orthogonalises its matrices, one all-to-all sends every
part of the results back to the rank that holds it. Block 0 of the tiny preset at dp 2:

    flat unit:  [n| q | k | v | o |n|      gate      |    up    |   down   ]
                |<-------------- rank 0 --------------->|<------- rank 1 ------->|
    owners:        0   0   1   1          0               1          1
    out:        v, o from rank 0 to rank 1; gate's last row from rank 1 to rank 0
    back:       the same parts of the results, the other way

Everything else (embedding, head, norm gains, a router) keeps lesson 06's AdamW on its pieces.
ZeRO-0 holds every matrix on every rank: the owners still split the work, each sending its
results to all the others, rather than every rank orthogonalising everything: the N-fold
Newton-Schulz FLOPs cost more than one bf16 copy of the updates on the wire (below).

Newton-Schulz (Jordan's quintic, as torch.optim.Muon runs it): X = M / |M|_F in bf16, transposed
so that it is m x n with m <= n, then 5 times X <- a X + (b A + c A^2) X with A = X X^T and
(a, b, c) = (3.4445, -4.775, 2.0315): every singular value pushed towards 1 (to roughly 0.7-1.2:
fast rather than exact, and good enough). The step is scaled by sqrt(max(1, rows/cols))
("original", Jordan's) or 0.2 sqrt(max(rows, cols)) ("match_rms_adamw", Moonshot's: the update's
RMS of AdamW's, so that AdamW's learning rate and weight decay carry over).

The price. Compute: per iteration 2 m^2 n (A), 2 m^3 (A^2, added to b A in one addmm) and 2 m^2 n
(times X), so 10 m^2 (2n + m) FLOPs in bf16 on the matrix's owner: 7.7e11 for the 1b preset's
8192 x 2048 MLP matrices, what that matrix's forward and backward cost for 7,700 tokens
(6 x 2048 x 8192 per token): small against a step of a million tokens, and divided over the ranks.
Communication per step, bf16 (2 bytes per element): out, each rank's parts of matrices it does not
own; back, each owner's results to their other holders. Summed over the ranks, each way carries the
matrices' elements their owners do not hold: (N-1)/N of them if owners held a random share; less,
because among equally loaded ranks the one holding most of a matrix owns it (0.38 instead of 0.75
on the tiny preset at dp 4). ZeRO-0: nothing out, 2 (N-1) bytes per element back over all ranks.
Memory: 4 bytes of momentum per Muon element where AdamW keeps 8. During the step only: the
Nesterov update of the rank's pieces (float32), their bf16 parts on the way out and back, the
owner's whole matrices and the Newton-Schulz temporaries (a few m x m and m x n) in bf16.

What to look for: the loss falls faster than lesson 06's AdamW (--optimizer adamw: the same run);
the all-to-all bytes measured next to their prediction from the layout and the owners; the
optimizer states, half of AdamW's for the matrices, measured next to predicted; the Newton-Schulz
share of the step time.
"""

from __future__ import annotations

import argparse
import math
import re
import time
from dataclasses import dataclass, replace
from functools import cached_property, partial

import torch
import torch.distributed as dist
from torch import nn

from picotron_like import comm
from picotron_like.lessons import load_lesson
from picotron_like.metrics import (GatheredParameterMeter, MeteredRun, ModelStates, SavedTensorMeters, log0,
                                   log_compute_report, log_traffic_rows)
from picotron_like.model import GPT, count_parameters
from picotron_like.run_control import StepMeters
from picotron_like.topology import ConfigError, ProcessGrid, group_rank, group_size, init_distributed, shutdown
from picotron_like.train import RankBatches, add_parallel_flags, add_training_flags, build_optimizer, plan_run, train

zero = load_lesson("06_zero")

# ============================================================================ the technique: Muon on one device

# Jordan's quintic: the steepest slope at zero (small singular values grow fastest), bought by
# settling between about 0.7 and 1.2 instead of converging to 1.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7


@dataclass(frozen=True)
class MuonSettings:
    """Muon's own settings, beside AdamW's (which keeps --lr and its weight decay for the rest)."""

    lr: float = 0.02
    weight_decay: float = 0.1
    momentum: float = 0.95
    nesterov: bool = True
    adjust_lr: str = "original"         # or "match_rms_adamw"


_HIDDEN = re.compile(r"(^|\.)layers\.\d+\.(attn|mlp)\.")


def is_hidden_matrix(name: str, shape) -> bool:
    """Whether Muon steps this parameter: a block's attention or MLP weight (a stack of matrices for
    experts, each orthogonalised on its own); not the router, the embedding, the head or a gain."""
    return len(shape) >= 2 and bool(_HIDDEN.search(name)) and ".router." not in name


def newton_schulz(matrix: torch.Tensor) -> torch.Tensor:
    """The matrix's orthogonalisation, approximately U V^T of its U S V^T, in bf16, with the very
    operations of torch.optim.Muon (so that a test can demand equality): normalised by its Frobenius
    norm (a bound on the spectral norm, so the iteration starts inside its basin), worked on as its
    wide side (m <= n: the Gram matrix X X^T is the small m x m one)."""
    a, b, c = NS_COEFFICIENTS
    x = matrix.bfloat16()
    transposed = matrix.size(0) > matrix.size(1)
    if transposed:
        x = x.T
    x.div_(x.norm().clamp(min=NS_EPS))
    for _ in range(NS_STEPS):
        gram = x @ x.T
        polynomial = torch.addmm(gram, gram, gram, beta=b, alpha=c)     # b A + c A^2
        x = torch.addmm(x, polynomial, x, beta=a)                        # a X + (b A + c A^2) X
    return x.T if transposed else x


def newton_schulz_flops(shape) -> int:
    """10 m^2 (2n + m) for m x n with m <= n: per iteration 2 m^2 n (X X^T), 2 m^3 (A A), 2 m^2 n (. X)."""
    m, n = sorted(shape[-2:])
    return NS_STEPS * (4 * m * m * n + 2 * m ** 3)


def adjusted_lr(lr: float, shape, rule: str) -> float:
    """The learning rate for a matrix of `shape` (its last two dims): orthogonal updates have RMS
    1 / sqrt(max(m, n))-ish, so each rule rescales by the shape (torch.optim.Muon's _adjust_lr)."""
    rows, cols = shape[-2:]
    if rule == "original":
        return lr * math.sqrt(max(1, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


class Muon(torch.optim.Optimizer):
    """Muon over whole matrices (2-D weights, or stacks of them: each expert's matrix on its own).

    Per parameter: momentum B <- mu B + (1 - mu) G (torch's lerp form), the Nesterov blend
    U = (1 - mu) G + mu B, O = newton_schulz(U) per matrix, then W <- W (1 - lr wd) - lr' O with lr'
    the shape-adjusted rate. The momentum, the blend and the update are elementwise: a subclass
    that holds pieces of matrices (ShardedMuon) keeps them and replaces only `orthogonalised`.

    It honours the step tail's `found_inf` and `grad_scale` (train.optimizer_step) where they are
    set on it (MuonWithAdamW hands them on beside fused AdamW): gradients divided by grad_scale in
    place, and where found_inf is 1 the momentum and the weights kept as they were, decided on
    the device.
    """

    def __init__(self, params, settings: MuonSettings = MuonSettings()):
        defaults = dict(lr=settings.lr, weight_decay=settings.weight_decay, momentum=settings.momentum,
                        nesterov=settings.nesterov, adjust_lr=settings.adjust_lr)
        super().__init__(params, defaults)

    def matrix_shape(self, param: torch.Tensor) -> torch.Size:
        """The shape of the matrices `param` holds, which sets its learning rate's adjustment."""
        return param.shape[-2:]

    def momentum_update(self, param: torch.Tensor, group: dict, skip) -> torch.Tensor:
        """The Nesterov momentum update of `param` (elementwise: a piece of a matrix steps as its
        part of the whole would)."""
        grad = param.grad
        if getattr(self, "grad_scale", None) is not None:
            grad.div_(self.grad_scale)
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        buffer, momentum = state["momentum_buffer"], group["momentum"]
        if skip is None:
            buffer.lerp_(grad, 1 - momentum)
        else:
            buffer.copy_(torch.where(skip, buffer, buffer.lerp(grad, 1 - momentum)))
        return grad.lerp(buffer, momentum) if group["nesterov"] else buffer

    def orthogonalised(self, params: list[torch.Tensor], updates: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each update orthogonalised, matrix by matrix (bf16)."""
        return [newton_schulz(update) if update.dim() == 2 else
                torch.stack([newton_schulz(matrix) for matrix in update]) for update in updates]

    @torch.no_grad()
    def step(self, closure=None):
        found_inf = getattr(self, "found_inf", None)
        skip = None if found_inf is None else found_inf.bool()
        for group in self.param_groups:
            params = [param for param in group["params"] if param.grad is not None]
            updates = [self.momentum_update(param, group, skip) for param in params]
            for param, update in zip(params, self.orthogonalised(params, updates)):
                lr = group["lr"]
                rate = adjusted_lr(lr, self.matrix_shape(param), group["adjust_lr"])
                if skip is None:
                    param.mul_(1 - lr * group["weight_decay"])
                    param.add_(update.view_as(param), alpha=-rate)
                else:
                    stepped = param.mul(1 - lr * group["weight_decay"]).add_(update.view_as(param), alpha=-rate)
                    param.copy_(torch.where(skip, param, stepped))


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer to the training loop and the step's tail: Muon's groups and AdamW's side by
    side (shared `param_groups` and `state`), each stepped by its own.

    Muon's groups carry "lr_ratio", Muon's peak rate over AdamW's, so that train.set_learning_rate
    moves both along the schedule, each at its own peak. The step tail's found_inf and grad_scale
    (optimizer_step) reach both where AdamW takes them (fused, CUDA); elsewhere the tail scales
    the gradients itself and asks the host whether to step at all."""

    def __init__(self, muon: Muon, adamw: torch.optim.Optimizer):
        self.muon, self.adamw = muon, adamw
        for group in muon.param_groups:
            group["lr_ratio"] = group["lr"] / adamw.param_groups[0]["lr"]
        super().__init__([*adamw.param_groups, *muon.param_groups], {})
        self._share_groups_and_state()
        self._step_supports_amp_scaling = getattr(adamw, "_step_supports_amp_scaling", False)

    def _share_groups_and_state(self) -> None:
        n_adamw = len(self.adamw.param_groups)
        self.adamw.param_groups, self.muon.param_groups = self.param_groups[:n_adamw], self.param_groups[n_adamw:]
        self.adamw.state = self.muon.state = self.state

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)     # replaces the groups and the state: share them again
        self._share_groups_and_state()

    @torch.no_grad()
    def step(self, closure=None):
        for inner in (self.muon, self.adamw):
            for name in ("found_inf", "grad_scale"):
                if hasattr(self, name):
                    setattr(inner, name, getattr(self, name))
            try:
                inner.step()
            finally:
                for name in ("found_inf", "grad_scale"):
                    if hasattr(inner, name):
                        delattr(inner, name)


def build_muon_optimizer(named_params, lr: float, muon: MuonSettings) -> MuonWithAdamW:
    """Muon for the hidden matrices, train.build_optimizer's AdamW (at `lr`) for everything else.
    `named_params`: a module, or (name, tensor) pairs."""
    pairs = list(named_params.named_parameters() if isinstance(named_params, nn.Module) else named_params)
    matrices = [param for name, param in pairs if is_hidden_matrix(name, param.shape)]
    rest = [(name, param) for name, param in pairs if not is_hidden_matrix(name, param.shape)]
    return MuonWithAdamW(Muon(matrices, muon), build_optimizer(rest, lr))


# ============================================================================ the technique: Muon over ZeRO's shards


@dataclass(frozen=True)
class Matrix:
    """One matrix that Newton-Schulz orthogonalises: matrix `index` of parameter `name` (0 for a
    2-D weight, expert `index` of a stack), of `shape`; `held[r]` is the range of its elements
    (row-major) that group rank r holds, possibly empty; `owner` the rank that orthogonalises it."""

    name: str
    index: int
    shape: tuple[int, int]
    held: tuple[tuple[int, int], ...]
    owner: int = 0

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


def span(bounds: tuple[int, int]) -> int:
    """The number of elements in [lo, hi)."""
    return bounds[1] - bounds[0]


def held_ranges(unit, start: int, numel: int, n: int) -> tuple[tuple[int, int], ...]:
    """Which elements of [start, start + numel) of `unit` each of its n group ranks holds: its
    shard's part (ZeRO-1/2/3: rank r holds [r S, (r+1) S) of the unit), or all (ZeRO-0)."""
    if unit.shard_numel == unit.padded_numel:
        return ((0, numel),) * n
    ranges = []
    for rank in range(n):
        lo, hi = max(start, rank * unit.shard_numel), min(start + numel, (rank + 1) * unit.shard_numel)
        ranges.append((lo - start, hi - start) if lo < hi else (0, 0))
    return tuple(ranges)


def balanced_owners(matrices: list[Matrix], n: int) -> list[Matrix]:
    """Each matrix given to the rank with the fewest Newton-Schulz FLOPs so far, largest first
    (greedy longest-processing-time, within 4/3 of the best balance). Among ranks as loaded, the one
    that holds most of the matrix (it sends and receives least of it: on the tiny preset at dp 4,
    0.38 of the matrices' elements travel each way instead of 0.75), then the lower rank. Decided
    from the layout alone, so every rank computes the same owners without a word exchanged."""
    load, owners = [0] * n, {}
    for position in sorted(range(len(matrices)), key=lambda i: (-newton_schulz_flops(matrices[i].shape), i)):
        held = matrices[position].held
        owner = min(range(n), key=lambda rank: (load[rank], -span(held[rank]), rank))
        load[owner] += newton_schulz_flops(matrices[position].shape)
        owners[position] = owner
    return [replace(matrix, owner=owners[i]) for i, matrix in enumerate(matrices)]


def hidden_matrices(units: list, n: int):
    """(unit, the matrix's first element in it, Matrix) for every hidden matrix of the units (each
    expert's of a stack on its own), in the units' order, with what each of the n ranks holds."""
    for unit in units:
        offset = 0
        for name, shape in zip(unit.names, unit.shapes):
            if is_hidden_matrix(name, shape):
                rows, cols = shape[-2:]
                for index in range(shape.numel() // (rows * cols)):
                    start = offset + index * rows * cols
                    yield unit, start, Matrix(name, index, (rows, cols), held_ranges(unit, start, rows * cols, n))
            offset += shape.numel()


class MatrixExchange:
    """The hidden matrices of the flat units that shard over one process group, with their owners,
    and where this rank's part of each lies: `mine[position]` = (its piece's master, the offset
    of the part in it). Built from the units' layout alone: the same on every rank."""

    def __init__(self, units: list, group):
        self.group, self.n, self.rank = group, group_size(group), group_rank(group)
        self.replicated = all(unit.shard_numel == unit.padded_numel for unit in units)
        placed = list(hidden_matrices(units, self.n))
        self.matrices = balanced_owners([matrix for _, _, matrix in placed], self.n)
        self.mine = {position: self._place(unit, start + matrix.held[self.rank][0])
                     for position, (unit, start, matrix) in enumerate(placed) if span(matrix.held[self.rank])}

    # Whether any rank sends anything each way: if not (one rank; ZeRO-0's way out), no collective.
    @cached_property
    def any_to_owners(self) -> bool:
        return any(span(self.to_owner(m, r)) for m in self.matrices for r in range(self.n))

    @cached_property
    def any_to_holders(self) -> bool:
        return any(span(self.to_holder(m, r)) for m in self.matrices for r in range(self.n))

    @staticmethod
    def _place(unit, element: int) -> tuple[torch.Tensor, int]:
        """The piece of this rank's shard holding the unit's `element`, and its offset there."""
        for piece in unit.pieces:
            if unit.start + piece.lo <= element < unit.start + piece.hi:
                return piece.master, element - unit.start - piece.lo
        raise AssertionError(f"element {element} is outside this rank's shard")

    def to_owner(self, matrix: Matrix, rank: int) -> tuple[int, int]:
        """The part of `matrix` that `rank` sends its owner: what it holds, unless it is the owner
        or every rank holds it all (ZeRO-0: the owner has it already)."""
        return (0, 0) if self.replicated or rank == matrix.owner else matrix.held[rank]

    def to_holder(self, matrix: Matrix, rank: int) -> tuple[int, int]:
        """The part of `matrix`'s result that its owner sends `rank`: what `rank` holds of it."""
        return (0, 0) if rank == matrix.owner else matrix.held[rank]

    def owned(self, owner: int) -> list[tuple[int, Matrix]]:
        return [(position, m) for position, m in enumerate(self.matrices) if m.owner == owner]


def matrix_exchanges(model) -> list[MatrixExchange]:
    """One MatrixExchange per process group the model's units shard over."""
    by_group: dict = {}
    for unit in model.units:
        by_group.setdefault(unit.group, []).append(unit)
    return [MatrixExchange(units, group) for group, units in by_group.items()]


def matrix_piece_shapes(model) -> dict[torch.Tensor, torch.Size]:
    """This rank's master pieces of the hidden matrices, each with its parameter's shape (read from
    the unit: ZeRO-3's parameters are empty between gathers)."""
    shapes = {}
    for unit in model.units:
        shape_of = {id(param): shape for param, shape in zip(unit.params, unit.shapes)}
        for piece in unit.pieces:
            if piece.param is not None and is_hidden_matrix(piece.name, shape_of[id(piece.param)]):
                shapes[piece.master] = shape_of[id(piece.param)]
    return shapes


class ShardedMuon(Muon):
    """Muon over this rank's float32 master pieces of lesson 06's flat units (any stage).

    The momentum, the Nesterov blend and the update stay elementwise on the pieces (Muon's);
    `orthogonalised` is the distributed part: per process group the units shard over, one
    all-to-all sends each rank's parts of the matrices (cast to bf16, as Newton-Schulz would cast
    them) to their owners, each owner orthogonalises its whole matrices, and one all-to-all sends
    every rank its parts of the results (uneven splits both ways: what each pair exchanges follows
    from the layout and the owners).

    Seams for a later lesson to subclass (their base versions are the identity):
      whole_matrix(matrix, local)    the matrix to orthogonalise, from the one the owner assembled
      local_update(matrix, result)   the part of the orthogonalised matrix that `local` stands for
      matrix_shape(param)            the shape that sets a piece's learning-rate adjustment
    """

    def __init__(self, model, settings: MuonSettings = MuonSettings()):
        shapes = matrix_piece_shapes(model)
        super().__init__([{"params": list(shapes)}], settings)      # a rank may hold no matrix at all
        self.piece_shapes = shapes
        self.device = model.units[0].master.device
        self.exchanges = matrix_exchanges(model)

    def matrix_shape(self, param: torch.Tensor) -> torch.Size:
        return self.piece_shapes[param][-2:]

    def whole_matrix(self, matrix: Matrix, local: torch.Tensor) -> torch.Tensor:
        return local

    def local_update(self, matrix: Matrix, result: torch.Tensor) -> torch.Tensor:
        return result

    def orthogonalised(self, params: list[torch.Tensor], updates: list[torch.Tensor]) -> list[torch.Tensor]:
        update_of = {master: update for master, update in zip(params, updates)}
        results = {master: torch.empty_like(master, dtype=torch.bfloat16) for master in params}
        for exchange in self.exchanges:
            self._orthogonalise_over(exchange, update_of, results)
        return [results[master] for master in params]

    def _orthogonalise_over(self, exchange: MatrixExchange, update_of: dict, results: dict) -> None:
        me, n = exchange.rank, exchange.n

        def my_part(position: int, values: dict) -> torch.Tensor:
            master, offset = exchange.mine[position]
            return values[master][offset: offset + span(exchange.matrices[position].held[me])]

        # 1. Every rank's parts to the owners; the owner's own part stays where it is.
        outgoing = [[my_part(p, update_of) for p, m in exchange.owned(q) if span(exchange.to_owner(m, me))]
                    for q in range(n)]
        incoming = [[span(exchange.to_owner(m, r)) for _, m in exchange.owned(me)] for r in range(n)]
        received = self._all_to_all(exchange, outgoing, incoming, exchange.any_to_owners)

        # 2. The owner's matrices assembled, orthogonalised, cut for their holders.
        back = [[] for _ in range(n)]
        for slot, (position, matrix) in enumerate(exchange.owned(me)):
            local = torch.empty(matrix.numel, dtype=torch.bfloat16, device=self.device)
            if position in exchange.mine:
                lo, hi = matrix.held[me]
                local[lo:hi].copy_(my_part(position, update_of))
            for rank in range(n):
                lo, hi = exchange.to_owner(matrix, rank)
                local[lo:hi].copy_(received[rank][slot])
            result = self.local_update(matrix, newton_schulz(self.whole_matrix(matrix, local.view(matrix.shape))))
            result = result.reshape(-1)
            if position in exchange.mine:
                lo, hi = matrix.held[me]
                my_part(position, results).copy_(result[lo:hi])
            for rank in range(n):
                lo, hi = exchange.to_holder(matrix, rank)
                if hi > lo:
                    back[rank].append(result[lo:hi])

        # 3. Every holder's parts of the results back from the owners.
        incoming = [[span(exchange.to_holder(m, me)) for _, m in exchange.owned(q)] for q in range(n)]
        returned = self._all_to_all(exchange, back, incoming, exchange.any_to_holders)
        for owner in range(n):
            for slot, (position, matrix) in enumerate(exchange.owned(owner)):
                if span(exchange.to_holder(matrix, me)):
                    my_part(position, results).copy_(returned[owner][slot])

    def _all_to_all(self, exchange: MatrixExchange, outgoing: list[list[torch.Tensor]],
                    incoming: list[list[int]], anything: bool) -> list[list[torch.Tensor]]:
        """outgoing[q]'s tensors to rank q, in bf16, in one all_to_all_single; returns, per sending
        rank r, the tensors of the sizes incoming[r] (zero-sized where nothing comes). Skipped
        (no collective) when no rank sends anything: the layout tells every rank alike."""
        sizes = [sum(part.numel() for part in parts) for parts in outgoing]
        send = torch.empty(sum(sizes), dtype=torch.bfloat16, device=self.device)
        offset = 0
        for part in (part for parts in outgoing for part in parts):
            send[offset: offset + part.numel()].copy_(part)
            offset += part.numel()
        expected = [sum(counts) for counts in incoming]
        receive = torch.empty(sum(expected), dtype=torch.bfloat16, device=self.device)
        if anything:
            comm.call(dist.all_to_all_single, receive, send, output_split_sizes=expected, input_split_sizes=sizes,
                      group=exchange.group)
        by_rank, offset = [], 0
        for counts in incoming:
            by_rank.append(list(receive[offset: offset + sum(counts)].split(counts)))
            offset += sum(counts)
        return by_rank


def build_sharded_muon_optimizer(model, lr: float, muon: MuonSettings) -> MuonWithAdamW:
    """Muon over the pieces of the hidden matrices (ShardedMuon), lesson 06's AdamW over every
    other piece (the padding included)."""
    muon_optimizer = ShardedMuon(model, muon)
    rest = [(piece.name, piece.master) for unit in model.units for piece in unit.pieces
            if piece.master not in muon_optimizer.piece_shapes]
    return MuonWithAdamW(muon_optimizer, build_optimizer(rest, lr))


# ============================================================================ configuration rules


def add_muon_flags(parser) -> None:
    """The optimizer's flags: which one, and Muon's settings beside AdamW's --lr."""
    defaults = MuonSettings()
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default="muon",
                        help="muon: Muon for the blocks' matrices, AdamW (--lr) for the rest; adamw: AdamW for all")
    parser.add_argument("--muon-lr", type=float, default=defaults.lr,
                        help="Muon's peak learning rate (the schedule moves it with --lr's)")
    parser.add_argument("--muon-weight-decay", type=float, default=defaults.weight_decay,
                        help="Muon's decoupled weight decay: each step the matrices shrink by lr x this")
    parser.add_argument("--muon-momentum", type=float, default=defaults.momentum, help="Muon's momentum (Nesterov)")
    parser.add_argument("--muon-adjust-lr", choices=("original", "match_rms_adamw"), default=defaults.adjust_lr,
                        help="the shape's learning-rate factor: original: sqrt(max(1, rows/cols)) (Jordan); "
                             "match_rms_adamw: 0.2 sqrt(max(rows, cols)), AdamW's update RMS (Moonshot)")


def muon_settings(args) -> MuonSettings:
    return MuonSettings(args.muon_lr, args.muon_weight_decay, args.muon_momentum, adjust_lr=args.muon_adjust_lr)


def validate_muon(args) -> None:
    """Muon's own ranges, before any process group exists."""
    problems = []
    if not (args.muon_lr > 0 and math.isfinite(args.muon_lr)):
        problems.append(f"--muon-lr {args.muon_lr} must be a positive number")
    if not (args.muon_weight_decay >= 0 and math.isfinite(args.muon_weight_decay)):
        problems.append(f"--muon-weight-decay {args.muon_weight_decay} must be 0 or more")
    if not 0 <= args.muon_momentum < 1:
        problems.append(f"--muon-momentum {args.muon_momentum} must be in [0, 1)")
    if problems:
        raise ConfigError("bad Muon flags:\n  - " + "\n  - ".join(problems))


def validate(cfg, grid, shape, args, world_size: int) -> None:
    """Lesson 06's rules, then Muon's."""
    zero.validate(cfg, grid, shape, args, world_size)
    validate_muon(args)


def build_optimizer_from_flags(model, args):
    """--optimizer: Muon with AdamW beside it, or lesson 06's AdamW alone."""
    if args.optimizer == "muon":
        return build_sharded_muon_optimizer(model, args.lr, muon_settings(args))
    return zero.build_sharded_optimizer(model, args.lr)


# ============================================================================ measuring the three challenges


def predicted_muon_traffic(exchanges: list[MatrixExchange]) -> dict:
    """Payload bytes per step of Muon's two all-to-alls on each group, for this rank: bf16 parts
    of matrices it does not own, to their owners; its matrices' results, to their other holders."""
    traffic = {}
    for exchange in exchanges:
        me, group = exchange.rank, comm.group_name(exchange.group)
        to_owners = sum(span(exchange.to_owner(m, me)) for m in exchange.matrices)
        to_holders = sum(span(exchange.to_holder(m, r)) for _, m in exchange.owned(me) for r in range(exchange.n))
        if exchange.any_to_owners or exchange.any_to_holders:      # else no collective runs
            key = ("all_to_all_single", group)
            traffic[key] = traffic.get(key, 0) + 2 * (to_owners + to_holders)
    return traffic


def muon_elements_held(exchanges: list[MatrixExchange]) -> int:
    """The hidden matrices' elements this rank's shards hold (ZeRO-0: all of them)."""
    return sum(span(m.held[e.rank]) for e in exchanges for m in e.matrices)


def predicted_model_states(unit_counts: list[int], n: int, stage: int, precision, muon_elements: int) -> ModelStates:
    """Lesson 06's formula with Muon's states: of this rank's shard, `muon_elements` keep one
    float32 moment (4 bytes), every other element (padding included) AdamW's two (8)."""
    states = zero.predicted_model_states(unit_counts, n, stage, precision)
    return replace(states, optimizer_states=states.optimizer_states - 4 * muon_elements)


def newton_schulz_flops_by_owner(exchange: MatrixExchange) -> int:
    """The Newton-Schulz FLOPs per step of the exchange's busiest owner: the step waits for it."""
    return max(sum(newton_schulz_flops(m.shape) for _, m in exchange.owned(rank)) for rank in range(exchange.n))


def newton_schulz_seconds(exchanges: list[MatrixExchange], device, repeats: int = 3) -> float:
    """The seconds this rank's Newton-Schulz work takes per step, timed apart on random matrices
    of its owned shapes (the best of `repeats`: the step's own calls are not touched)."""
    shapes = [m.shape for e in exchanges for _, m in e.owned(e.rank)]
    inputs = [torch.randn(shape, device=device) for shape in shapes]
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        for matrix in inputs:
            newton_schulz(matrix)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best


def report(model, run: MeteredRun, gathered: GatheredParameterMeter, n_micro: int, tokens_per_step: int) -> None:
    """Lesson 06's report with Muon's rows: the model states with one moment for the matrices,
    the all-to-alls next to their prediction, the Newton-Schulz share of the step."""
    optimizer = run.optimizer
    if not isinstance(optimizer, MuonWithAdamW):
        zero.report(model, run, gathered, n_micro)
        return
    exchanges = optimizer.muon.exchanges
    n, stage, precision = group_size(model.dp_group), model.stage, model.precision
    counts, group = [unit.numel for unit in model.units], comm.group_name(model.dp_group)
    reshard, prefetch = (model.reshard_after_forward, model.prefetch) if stage == 3 else (True, True)
    peak = zero.predicted_gathered_peak([zero.padded(count, n) * precision.param_dtype.itemsize for count in counts],
                                        reshard, prefetch)
    held = muon_elements_held(exchanges)
    zero.log_model_states(model, optimizer, f"ZeRO-{stage} over {n} ranks, Muon for {held:,} of this rank's "
                          f"elements", predicted_model_states(counts, n, stage, precision, held), gathered, peak)
    log0(f"Muon's momentum: {4 * held / 1e6:.3f} MB for those elements, where AdamW's two moments would take "
         f"{8 * held / 1e6:.3f} MB")
    log_traffic_rows(run, f"{n_micro} micro-batches; Muon's all-to-alls in bf16",
                     technique=predicted_muon_traffic(exchanges),
                     gradients=zero.predicted_zero_traffic(counts, n, stage, precision, n_micro, reshard, group),
                     loss_groups=(group,), norm_groups=(group,) if stage else ())
    owned = [m for e in exchanges for _, m in e.owned(e.rank)]
    flops = sum(newton_schulz_flops(m.shape) for m in owned)
    busiest = max(newton_schulz_flops_by_owner(e) for e in exchanges)
    seconds = newton_schulz_seconds(exchanges, run.device)
    step_seconds = tokens_per_step / run.throughput.tokens_per_second
    log0(f"\n== Newton-Schulz (rank 0) ==\n{len(owned)} of {sum(len(e.matrices) for e in exchanges)} matrices "
         f"owned, {flops / 1e9:.3f} GFLOP per step (the busiest rank {busiest / 1e9:.3f}): {1e3 * seconds:.2f} ms, "
         f"{100 * seconds / step_seconds:.1f} % of the mean step ({1e3 * step_seconds:.1f} ms)")
    log_compute_report(run)


# ============================================================================ main


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description="Lesson 06, continued: Muon over ZeRO stages 0-3 (run with torchrun).",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_parallel_flags(parser, axes=("dp",), fill_axis="dp", bucket_flag=False)
    zero.add_zero_flags(parser)
    add_muon_flags(parser)
    add_training_flags(parser, micro_batch_size=4, grad_accum=2, steps=20)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    plan = plan_run(args, validate)
    device = init_distributed()
    grid = ProcessGrid(plan.grid)
    precision = zero.precision_from_flags(args.dtype, args.reduce_dtype, device)
    model = zero.wrap_zero(GPT(plan.cfg, seed=args.seed).to(device), grid.dp_group, args.zero_stage, precision,
                           args.reshard_after_forward, args.prefetch, args.overlap_weight_gather)
    optimizer = build_optimizer_from_flags(model, args)
    settings = zero.step_settings(device, precision, args.max_grad_norm, args.step_tail)
    log0(f"lesson 06 (Muon): ZeRO-{args.zero_stage} over dp = {grid.dp_size} ranks, optimizer {args.optimizer}"
         + (f" (Muon lr {args.muon_lr}, weight decay {args.muon_weight_decay}, {args.muon_adjust_lr}; AdamW lr "
            f"{args.lr} for the rest)" if args.optimizer == "muon" else "")
         + f", {count_parameters(plan.cfg)['total']:,} parameters, {plan.shape.tokens_per_step:,} tokens per step")

    gathered = GatheredParameterMeter(model.module)
    batches = RankBatches(plan.batches, grid.dp_rank, device, val=plan.val_batches)    # this rank's share
    throughput = train(args, optimizer, partial(zero.train_step, model, optimizer, settings=settings), batches,
                       evaluate=partial(zero.evaluate, model, settings=settings),
                       meters=StepMeters((SavedTensorMeters(gathered),)), cfg=plan.cfg)
    model.wait_for_weights()        # the last step's gathers, before the report and the process group's end
    report(model, MeteredRun(model.module, optimizer, None, throughput, plan.cfg, plan.shape.seq_len, grid.dp_size,
                             device, throughput.steps), gathered, plan.shape.grad_accum,
           plan.shape.tokens_per_step)
    shutdown()


if __name__ == "__main__":
    main()
