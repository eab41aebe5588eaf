"""What a time budget should train: a compute-optimal rule, a family of model shapes, and the steps
that M minutes hold once a run's start and end are paid.

The rule. Hoffmann et al. 2022 ("Training Compute-Optimal Large Language Models", arXiv:2203.15556,
"Chinchilla") trained over 400 models and found that for a budget of training FLOPs C = 6 N D the
lowest loss comes from growing the parameters N and the tokens D in equal proportion: about 20
tokens per parameter (Chinchilla itself: 70 B parameters, 1.4 T tokens). They counted every
parameter, the embeddings included; Kaplan et al. 2020 counted only the others, which is most of
why the two disagree (Pearce and Song 2024, "Reconciling Kaplan and Chinchilla Scaling Laws",
arXiv:2406.12907). It is a rule for the loss per FLOP, not per minute: two models of the same FLOPs
per token can run at different shares of the GPU's peak, so a wall-clock budget buys them different
FLOPs. The sizing therefore prices each candidate's tokens from its own estimated step time and
applies the rule to those tokens.

The family. The candidates keep what the user's model fixes and scale the rest: the vocabulary
(the data's tokenizer sets it), the head size, the query heads per key/value head, the MLP's width
over the model's, and depth against width (layers over hidden, the preset's aspect ratio). A member
is named by its number of key/value heads g: g = the model's own gives the model itself, and both
width and depth grow in proportion to g, so the non-embedding parameters grow as g^3.

The minutes. A run with --max-minutes counts from its process's start (run_control.TimeBudget):
the time to its first step (start-up, building and sharding the model, compiling, the step
itself) comes out of the budget, and TimeBudget keeps two steps of margin and the final validation
(and checkpoint) at the end; the steps in between are what train.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from picotron_like.model import GPTConfig, count_parameters

# The MLP's width rounds to a multiple of this (Llama's multiple_of is 256; 64 keeps the small
# members of the tiny presets' families) so that tensor parallelism's usual degrees divide it.
FFN_MULTIPLE = 64


@dataclass(frozen=True)
class ComputeOptimalRule:
    """Tokens per parameter at the compute-optimal point, and where the figure comes from."""

    tokens_per_parameter: float
    source: str

    def tokens_for(self, cfg: GPTConfig) -> int:
        return round(self.tokens_per_parameter * count_parameters(cfg)["total"])

    def distance(self, tokens_per_parameter: float) -> float:
        """How far a candidate is from the rule: |log(its tokens per parameter / the rule's)|, so
        twice too many and twice too few count the same (Chinchilla fitted each of its isoFLOP
        profiles, the loss against log N at fixed FLOPs, with a parabola: symmetric around its
        minimum); a candidate with no tokens is infinitely far."""
        if tokens_per_parameter <= 0:
            return math.inf
        return abs(math.log(tokens_per_parameter / self.tokens_per_parameter))


CHINCHILLA = ComputeOptimalRule(20.0, "Hoffmann et al. 2022, Training Compute-Optimal Large Language Models "
                                      "(arXiv:2203.15556): about 20 tokens per parameter, every parameter counted")


def family_member(cfg: GPTConfig, kv_heads: int) -> GPTConfig:
    """The member of `cfg`'s family with `kv_heads` key/value heads: the same head size, query heads
    per key/value head, vocabulary and aspect ratio; width, depth and MLP width in proportion to
    kv_heads / cfg.n_kv_heads (the MLP rounded to FFN_MULTIPLE, the depth to a whole layer)."""
    if kv_heads == cfg.n_kv_heads:
        return cfg
    scale = kv_heads / cfg.n_kv_heads
    group = cfg.n_heads // cfg.n_kv_heads
    return replace(cfg, n_kv_heads=kv_heads, n_heads=group * kv_heads, hidden=cfg.head_dim * group * kv_heads,
                   n_layers=max(1, round(cfg.n_layers * scale)),
                   ffn_hidden=max(FFN_MULTIPLE, round(cfg.ffn_hidden * scale / FFN_MULTIPLE) * FFN_MULTIPLE))


def family_description(cfg: GPTConfig) -> str:
    return (f"vocabulary {cfg.vocab_size:,}, head size {cfg.head_dim}, {cfg.n_heads // cfg.n_kv_heads} query heads "
            f"per key/value head, MLP {cfg.ffn_hidden / cfg.hidden:.3g} x hidden, hidden / layers = "
            f"{cfg.hidden / cfg.n_layers:.3g}")


@dataclass(frozen=True)
class RunTime:
    """Where a --max-minutes run's seconds go besides its steps: the time to its first step's end
    (an assumption, or what a run printed), and each validation's seconds as a share of a step."""

    first_step_s: float             # start-up, building the model, compiling, the first step
    val_every: int = 0              # 0: no validation
    val_batches: int = 0
    validation_share: float = 1 / 3     # a validation batch is a global batch's forward: a third of a step's FLOPs

    def seconds(self, steps: int, step_s: float, ramp_s: tuple[float, ...] = ()) -> float:
        """Steps 1.. after the first, each at `step_s` or, the first len(ramp_s) of them, a batch
        ramp's ramp_s[step]; the validations (every val_every steps and after the last), and
        TimeBudget's two steps of margin at the end."""
        validations = steps // self.val_every + 1 if self.val_every else 0
        ramped = min(steps, len(ramp_s))
        return (self.first_step_s + sum(ramp_s[1:ramped]) + (steps - max(ramped, 1)) * step_s
                + validations * self.val_batches * self.validation_share * step_s + 2 * step_s)

    def steps_in(self, budget_s: float, step_s: float, ramp_s: tuple[float, ...] = ()) -> int:
        """The most steps whose run fits in `budget_s` (0 when not even one does)."""
        per_step = step_s * (1 + (self.val_batches * self.validation_share / self.val_every if self.val_every else 0))
        start = max(1, len(ramp_s))
        steps = max(0, math.floor((budget_s - self.seconds(start, step_s, ramp_s)) / per_step) + start)
        while steps and self.seconds(steps, step_s, ramp_s) > budget_s:
            steps -= 1
        while self.seconds(steps + 1, step_s, ramp_s) <= budget_s:
            steps += 1
        return steps
