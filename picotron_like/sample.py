"""
Samples: what a trained model writes, from any checkpoint, one token at a time with a KV cache.

    python -m picotron_like.sample ckpt --prompt "The while statement" --max-new-tokens 200 --temperature 0.8 --top-k 40

The checkpoint, whatever layout wrote it, becomes one reference GPT (checkpoint.assemble: the
resharding that export does). The text goes through the tokenizer recorded beside the run's data
(`python -m picotron_like.data prepare` writes DATA.tokenizer.json; the built-in corpus is bytes),
found from the data path in the checkpoint's manifest, or given with --tokenizer. The prompt
starts with the tokenizer's document delimiter, as every document the model trained on did.

Choosing each token, from the logits of the last position:

    temperature 0       the most likely token (greedy; no randomness at all)
    temperature T > 0   a draw from softmax(logits / T): below 1 sharper, above 1 flatter;
    top-k K             only the K most likely tokens kept before the draw

The draws come from a torch.Generator of the sampler's own, seeded by --seed: the same seed gives
the same text, and torch's global generator, the one a training run's streams live in, is never
touched (a training run samples with this same function: training_sampler). Ids beyond the tokenizer's
vocabulary (a vocabulary padded to a multiple of 64) are never drawn: they have no text.

The KV cache (kv_cache.KVCache). Without one, the n-th token costs a forward over all n positions so
far: n^2 / 2 positions for n tokens. With it, each layer keeps the keys and values of the positions
done; the prompt runs once, then each new token runs alone, its query attending to the kept keys:
n positions of work, for 2 * n_layers * n_kv_heads * head_dim numbers per position kept. The
logits are those of the full forward (tests/test_sample.py). A mixture of experts with a capacity
factor decodes without the cache: capacity is counted per sequence, and a token routed on its own
would be dropped differently than in the whole sequence.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from picotron_like import checkpoint as checkpoints
from picotron_like import comm
from picotron_like.data import DataError, TextTokenizer, load_tokenizer
from picotron_like.kv_cache import KVCache
from picotron_like.metrics import log0
from picotron_like.model import GPT
from picotron_like.moe import moe_layers
from picotron_like.run_control import AfterStep
from picotron_like.topology import ConfigError
from picotron_like.train import traffic_not_counted

BUILTIN_CORPUS = "the built-in corpus"      # what a checkpoint's manifest records as the data of a run without --data


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen (see the module docstring)."""

    max_new_tokens: int = 64
    temperature: float = 0.8
    top_k: int | None = None        # None: every token may be drawn
    seed: int = 0

    def problems(self) -> list[str]:
        problems = []
        if self.max_new_tokens < 1:
            problems.append(f"--max-new-tokens {self.max_new_tokens} must be 1 or more")
        if not self.temperature >= 0:
            problems.append(f"--temperature {self.temperature} must be 0 (greedy) or more")
        if self.top_k is not None and self.top_k < 1:
            problems.append(f"--top-k {self.top_k} must be 1 or more (or left out: every token)")
        return problems


# ----------------------------------------------------------------------------- tokenizers


def recorded_tokenizer(data: str) -> str:
    """The --tokenizer `prepare` recorded beside the run's data (DATA.tokenizer.json): the first
    shard of a list or a glob that has a record; "byte" for the built-in corpus."""
    if data == BUILTIN_CORPUS:
        return "byte"
    for shard in sorted(glob.glob(data)) or [data]:
        record = Path(f"{shard}.tokenizer.json")
        if record.is_file():
            return json.loads(record.read_text())["tokenizer"]
    raise ConfigError(f"no tokenizer recorded beside the data {data} (prepare writes DATA.tokenizer.json; shards "
                      f"made elsewhere have none): give --tokenizer byte, gpt2 or PATH/tokenizer.json")


def sample_tokenizer(name: str, vocab_size: int) -> TextTokenizer:
    """data.load_tokenizer's tokenizer, checked against the model: a tokenizer with more ids than
    the model's vocabulary is not the one it was trained with."""
    try:
        tokenizer = load_tokenizer(name)
    except DataError as error:
        raise ConfigError(str(error)) from None
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(f"tokenizer {name} has {tokenizer.vocab_size} ids, the model's vocabulary {vocab_size}: "
                          f"not the tokenizer its data was made with; give the right one with --tokenizer")
    return tokenizer


def prompt_ids(tokenizer: TextTokenizer, prompt: str) -> list[int]:
    """The prompt as the model saw documents in training: the delimiter first, if the tokenizer has one."""
    ids = ([tokenizer.delimiter] if tokenizer.delimiter is not None else []) + list(tokenizer.encode(prompt))
    if not ids:
        raise ConfigError(f"--prompt {prompt!r} is no token with the {tokenizer.name} tokenizer (which has no "
                          f"document delimiter): give at least one character")
    return ids


# ----------------------------------------------------------------------------- choosing a token


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator, vocab_size: int) -> int:
    """The token chosen from one position's logits [V] (any device): greedy at temperature 0,
    else one draw of a uniform number from `generator` (a CPU generator, so a run on a GPU draws
    what one on a CPU draws) against the cumulative probabilities of the tokens kept."""
    logits = logits[:vocab_size].float().cpu()
    if sampling.temperature == 0:
        return int(logits.argmax())
    if sampling.top_k is not None and sampling.top_k < vocab_size:
        threshold = logits.topk(sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < threshold, -float("inf"))
    cumulative = (logits / sampling.temperature).softmax(dim=-1).cumsum(dim=-1)
    draw = torch.rand((), generator=generator) * cumulative[-1]
    return min(int(torch.searchsorted(cumulative, draw, right=True)), vocab_size - 1)


def generate(model: GPT, prompt: list[int], sampling: Sampling, vocab_size: int) -> list[int]:
    """The prompt's continuation: sampling.max_new_tokens ids, with a KV cache (see above)."""
    generator = torch.Generator().manual_seed(sampling.seed)
    device = next(model.parameters()).device
    tokens = torch.tensor([prompt], device=device)
    cached = model.cfg.capacity_factor is None
    caches = [KVCache(len(prompt) + sampling.max_new_tokens) for _ in model.layers] if cached else None
    new, step_input = [], tokens
    with torch.no_grad():
        for _ in range(sampling.max_new_tokens):
            logits = model.forward_cached(step_input, caches) if cached else model(tokens)
            new.append(next_token(logits[0, -1], sampling, generator, vocab_size))
            step_input = torch.tensor([[new[-1]]], device=device)
            tokens = torch.cat([tokens, step_input], dim=1)
    return new


# ----------------------------------------------------------------------------- samples during training


def add_sample_flags(parser) -> None:
    parser.add_argument("--sample-every", type=int, default=0,
                        help="every N steps and after the last, rank 0 prints what the model writes after "
                             "--sample-prompt (0: never); layouts without --pp and --cp")
    parser.add_argument("--sample-prompt", default="\n", help="with --sample-every: the text to continue")
    parser.add_argument("--sample-tokens", type=int, default=32, help="with --sample-every: tokens to write")


def sample_prompt(args, cfg, grid) -> tuple | None:
    """--sample-every's (tokenizer, prompt ids): the tokenizer recorded beside --data, or None
    when off; a ConfigError before any process group otherwise. The layout (`grid`, a GridShape)
    must give every rank the logits of a whole sequence from its own forward: a pipeline's last
    stage alone computes logits, in micro-batches of the schedule's shape, and context
    parallelism holds a piece of each sequence per rank. Those are refused."""
    if not args.sample_every:
        return None
    problems = [f"--{flag} {value} must be 1 or more" for flag, value in
                (("sample-every", args.sample_every), ("sample-tokens", args.sample_tokens)) if value < 1]
    problems += [f"--sample-every with --{axis} {degree}: {why}; sample a checkpoint instead (python -m "
                 f"picotron_like.sample SAVE_DIR), or drop --sample-every" for axis, degree, why in
                 (("pp", grid.pp, "only the last pipeline stage computes logits"),
                  ("cp", grid.cp, "each rank holds a piece of every sequence")) if degree > 1]
    if problems:
        raise ConfigError("bad sample flags:\n  - " + "\n  - ".join(problems))
    tokenizer = sample_tokenizer(recorded_tokenizer(args.data or BUILTIN_CORPUS), cfg.vocab_size)
    return tokenizer, prompt_ids(tokenizer, args.sample_prompt)


def sample_text(model, grid, settings, tokenizer, prompt: list[int], choice: Sampling, forward_context) -> str:
    """What the model writes after `prompt`, through the layout's own forward: every rank runs it
    on the same tokens (ZeRO-3 gathers, tp's and ep's collectives need every rank), the tp ranks
    put their vocabulary slices of the logits together, and every rank picks the next token with
    next_token and a generator of its own, never torch's global one: the training's random
    streams are not touched. No KV cache: the layers are the layout's, and a short sample is a
    few forwards of one sequence. The sequence is padded after its end to one length, a
    multiple of tp (sequence parallelism splits it): causal attention keeps the padding from
    every position before it, and a compiled model sees one shape. eval(): meters record
    training forwards only; `forward_context()`, the trainer's, leaves the run as it found it."""
    ids, generator = list(prompt), torch.Generator().manual_seed(choice.seed)
    length = math.ceil((len(prompt) + choice.max_new_tokens) / grid.tp_size) * grid.tp_size
    model.eval()
    with torch.no_grad(), traffic_not_counted(), forward_context():
        for _ in range(choice.max_new_tokens):
            tokens = torch.zeros(1, length, dtype=torch.long)
            tokens[0, :len(ids)] = torch.tensor(ids)
            with settings.autocast():
                logits = model(tokens.to(settings.device))[0, len(ids) - 1].contiguous()
            if grid.tp_size > 1:
                slices = [torch.empty_like(logits) for _ in range(grid.tp_size)]
                comm.call(dist.all_gather, slices, logits, group=grid.tp_group)
                logits = torch.cat(slices)
            token = torch.tensor([next_token(logits, choice, generator, tokenizer.vocab_size)],
                                 device=settings.device)
            # Every rank computed the same logits and draws the same number; rank 0's token is
            # sent anyway, so that a last-bit difference between replicas can never give the
            # ranks of one tp group different tokens to run.
            comm.call(dist.broadcast, token, src=0)
            ids.append(int(token))
    model.train()
    return tokenizer.decode(ids[len(prompt):])


def training_sampler(args, cfg, grid, model, settings, forward_context) -> AfterStep | None:
    """train()'s after_step for --sample-every (None when off): rank 0 prints one line.
    `forward_context`: sample_text's."""
    prompt = sample_prompt(args, cfg, grid.shape)
    if prompt is None:
        return None
    choice = Sampling(args.sample_tokens, temperature=0.8, top_k=40, seed=args.seed)

    def due(step: int, last: bool) -> bool:
        return last or (step + 1) % args.sample_every == 0

    def sample(step: int, last: bool) -> None:
        text = sample_text(model, grid, settings, *prompt, choice, forward_context)
        log0(f"step {step:>4} | sample: {args.sample_prompt + text!r}")

    return AfterStep(due, sample)


# ----------------------------------------------------------------------------- command line


def load_model(checkpoint) -> tuple[GPT, dict]:
    """The reference GPT with the checkpoint's weights (float32, CPU), and its manifest."""
    manifest, state = checkpoints.assemble(checkpoint)
    with torch.device("meta"):      # shapes only: the weights come from the checkpoint, not drawn first
        model = GPT(manifest["cfg"])
    model.to_empty(device="cpu").load_state_dict(state)
    for layer in moe_layers(model):     # a counter, not in the state dict
        layer.expert_load.zero_()
    return model.eval(), manifest


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m picotron_like.sample",
                                     description="Continue a prompt with a model from a checkpoint of any layout.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("checkpoint", help="a step directory, or a save directory (its newest checkpoint)")
    parser.add_argument("--prompt", default="\n", help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=Sampling.max_new_tokens, help="tokens to generate")
    parser.add_argument("--temperature", type=float, default=Sampling.temperature,
                        help="0: the most likely token each time (greedy); higher: more varied")
    parser.add_argument("--top-k", type=int, default=Sampling.top_k, help="draw among the K most likely tokens only")
    parser.add_argument("--seed", type=int, default=Sampling.seed, help="the draws' seed: the same seed, the same text")
    parser.add_argument("--tokenizer", default=None,
                        help="byte, gpt2 or PATH/tokenizer.json; default: the one recorded beside the run's data")
    args = parser.parse_args(argv)
    sampling = Sampling(args.max_new_tokens, args.temperature, args.top_k, args.seed)
    try:
        if sampling.problems():
            raise ConfigError("; ".join(sampling.problems()))
        model, manifest = load_model(args.checkpoint)
        name = args.tokenizer or recorded_tokenizer(manifest.get("settings", {}).get("data", BUILTIN_CORPUS))
        tokenizer = sample_tokenizer(name, model.cfg.vocab_size)
        prompt = prompt_ids(tokenizer, args.prompt)
    except ConfigError as error:        # CheckpointError is one
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    new = generate(model, prompt, sampling, tokenizer.vocab_size)
    print(args.prompt + tokenizer.decode(new))


if __name__ == "__main__":
    main()
