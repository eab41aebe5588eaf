"""Samples proven: the KV cache equal to the full forward, samples deterministic under a seed, and
lesson 07's --sample-every leaving training exactly as it was.

The cache: float32 logits of cached decoding (a prompt, a chunk of three, then one token at a
time) against one forward over the whole sequence, for a dense model and two mixtures of experts.

Training: one spawn of 4 gloo ranks runs lesson 07 twice in each of two layouts, with and without
--sample-every 1: dense dp2 x tp2 with sequence parallelism and ZeRO-3 (the padding of the
sample to a multiple of tp, ZeRO-3's gathers), and experts dp2 x tp2 x ep2, ZeRO-1, with the
auxiliary loss and bias balancing (router state a sample must not move). The losses and gradient
norms must be equal bit for bit: sampling draws from a generator of its own, and touches neither
torch's random streams, nor the router loads, nor the meters.

The command line reads the checkpoints those runs wrote: what it writes with the run's seed is
exactly the run's last sample (the reference GPT with the KV cache against the layout's own
forward without one); the same seed gives the same text, another seed another; temperature 0 is
the greedy continuation computed here with plain forwards.
"""

from __future__ import annotations

import io
import json
import os
from contextlib import redirect_stdout
from dataclasses import replace
from functools import partial

import pytest
import torch

import picotron_like.checkpoint as checkpoints
import picotron_like.sample as sampling
from picotron_like.data import load_tokenizer, prepare
from picotron_like.kv_cache import KVCache
from picotron_like.lessons import load_lesson
from picotron_like.model import GPT, get_config
from picotron_like.testing import run_ranks
from picotron_like.run_control import one_after_another
from picotron_like.topology import ConfigError, GridShape, ProcessGrid
from picotron_like.train import RankBatches, checked_plan, plan_run, train

CPU = torch.device("cpu")
COMMON = ["--n-layers", "2", "--seq-len", "32", "--micro-batch-size", "2", "--global-batch-tokens", "256",
          "--seed", "3", "--lr", "3e-3", "--warmup-steps", "2", "--steps", "3"]
SAMPLE = ["--sample-every", "1", "--sample-prompt", "The ", "--sample-tokens", "8"]
LAYOUTS = {"dense": ["--dp", "2", "--tp", "2", "--sequence-parallel", "--zero-stage", "3"],
           "moe": ["--preset", "tiny-moe", "--dp", "2", "--tp", "2", "--ep", "2", "--zero-stage", "1",
                   "--aux-loss-coef", "0.01", "--bias-update-rate", "1e-3"]}
SEED = 3


def lesson():
    return load_lesson("07_full_5d")


# ----------------------------------------------------------------------------- the KV cache


@pytest.mark.parametrize("overrides", [{}, {"n_experts": 4, "ffn_hidden": 64},
                                       {"n_experts": 4, "ffn_hidden": 64, "router": "sigmoid",
                                        "n_shared_experts": 1}], ids=["dense", "moe", "moe-sigmoid-shared"])
def test_cached_decoding_gives_the_logits_of_the_full_forward(overrides):
    """Tolerance 1e-6 on logits of size ~0.7: the same products summed in another order (a query
    row against P keys instead of a masked square; matmuls of one row instead of many), a few
    float32 roundings. A wrong position (rotary offset) or a missing key moves them by ~1e-2."""
    cfg = replace(get_config("tiny"), **{"n_layers": 2, "hidden": 64, "ffn_hidden": 128, **overrides})
    model = GPT(cfg, seed=1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
    caches = [KVCache(20) for _ in model.layers]
    pieces = [model.forward_cached(tokens[:, :5], caches), model.forward_cached(tokens[:, 5:8], caches)]
    pieces += [model.forward_cached(tokens[:, i:i + 1], caches) for i in range(8, 20)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- during training, and from checkpoints


def trainer(argv: list[str]) -> dict:
    """07's main() without the process group, the report and the exit; returns each step's loss
    and gradient norm, and the sample lines rank 0 printed."""
    os.environ["WORLD_SIZE"] = "4"
    full_5d = lesson()
    args = full_5d.parse_args([*COMMON, *argv])
    plan = plan_run(args, full_5d.validate, full_5d.expert_parallel.moe_config)
    grid = ProcessGrid(plan.grid, ep=full_5d.expert_degree(args.ep, plan.cfg, plan.grid))
    model, _ = full_5d.parallelize(plan.cfg, grid, args, CPU)
    optimizer = full_5d.zero.build_sharded_optimizer(model, args.lr)
    settings = full_5d.step_settings(grid, CPU, model.precision, args.max_grad_norm)
    results = []

    def step(batch):
        results.append(full_5d.train_step(model, optimizer, batch, settings, args.bias_update_rate,
                                          full_5d.balancing_log(model, None, grid)))
        return results[-1]

    rng = torch.get_rng_state()
    with redirect_stdout(io.StringIO()) as log:
        train(args, optimizer, step, RankBatches(plan.batches, grid.dp_rank, CPU),
              after_step=one_after_another(
                  sampling.training_sampler(args, plan.cfg, grid, model, settings, partial(full_5d.outside_training, model)),
                  checkpoints.checkpoint_saver(args, plan.cfg, plan.shape, grid, model, optimizer)))
    return {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results],
            "extra": [r.extra for r in results], "rng unchanged": torch.equal(torch.get_rng_state(), rng),
            "samples": [line for line in log.getvalue().splitlines() if "| sample: " in line]}


def four_rank_runs(directory: str) -> dict:
    runs = {}
    for name, layout in LAYOUTS.items():
        runs[name] = trainer(layout)
        runs[f"{name} sampled"] = trainer([*layout, *SAMPLE, "--save-dir", f"{directory}/{name}"])
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("sampled")
    return directory, run_ranks(4, four_rank_runs, str(directory), timeout_s=240)[0]


def test_sampling_during_training_leaves_the_losses_equal_bit_for_bit(runs):
    _, results = runs
    for name in LAYOUTS:
        plain, sampled = results[name], results[f"{name} sampled"]
        assert sampled["losses"] == plain["losses"], name
        assert sampled["norms"] == plain["norms"], name
        assert sampled["extra"] == plain["extra"], name        # the MoE balancing losses
        assert [int(line.split("|")[0].split()[1]) for line in sampled["samples"]] == [0, 1, 2], name
        assert sampled["rng unchanged"] and plain["rng unchanged"], name
        assert not plain["samples"]


def cli(argv: list[str], capsys) -> str:
    sampling.main(argv)
    return capsys.readouterr().out


def test_the_command_line_samples_any_layouts_checkpoint_deterministically(runs, capsys):
    directory, results = runs
    for name in LAYOUTS:
        checkpoint = str(directory / name)
        args = [checkpoint, "--prompt", "The ", "--max-new-tokens", "8", "--top-k", "40", "--seed", str(SEED)]
        text = cli(args, capsys)
        # the reference GPT with its KV cache writes what the layout's own forward wrote at the last step
        assert repr(text.removesuffix("\n")) == results[f"{name} sampled"]["samples"][-1].split("sample: ")[1], name
        assert cli(args, capsys) == text
        assert cli([*args[:-1], str(SEED + 1)], capsys) != text

    model, _ = sampling.load_model(directory / "dense")
    ids = list(b"The ")
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    greedy = cli([str(directory / "dense"), "--prompt", "The ", "--max-new-tokens", "8", "--temperature", "0"], capsys)
    assert greedy == bytes(ids).decode("utf-8", errors="replace") + "\n"


def test_bad_sample_requests_are_one_error_line(tmp_path, capsys, monkeypatch):
    full_5d = lesson()
    for layout, flag in ((["--pp", "2"], "--pp 2"), (["--cp", "2"], "--cp 2")):
        args = full_5d.parse_args([*COMMON, *layout, *SAMPLE])
        with pytest.raises(ConfigError, match=f"--sample-every with {flag}: .*python -m picotron_like.sample"):
            checked_plan(args, full_5d.validate, full_5d.expert_parallel.moe_config, world_size=2)
    # shards made elsewhere have no record of their tokenizer: say how to give one
    args = full_5d.parse_args([*COMMON, *SAMPLE, "--data", str(tmp_path / "llmc_shard.bin")])
    with pytest.raises(ConfigError, match="no tokenizer recorded beside the data .*--tokenizer"):
        sampling.sample_prompt(args, get_config("tiny"), GridShape())
    for argv, message in ((["--temperature", "-1"], "--temperature -1.0 must be 0"),
                          ([], f"{tmp_path / 'none'}: no such checkpoint directory")):
        with pytest.raises(SystemExit) as exit_info:
            sampling.main([str(tmp_path / "none"), *argv])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_a_tokenizer_recorded_by_prepare_is_found_and_decodes(tmp_path):
    """A BPE (trained here, offline) recorded by prepare beside the shard: found from the data path,
    the prompt begins with its document delimiter as every document did, and decoding gives the text."""
    tokenizers = pytest.importorskip("tokenizers")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    text = "the quick brown fox jumps over the lazy dog\n" * 20
    bpe.train_from_iterator([text], tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<unk>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    bpe.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "corpus.txt").write_text(text)
    prepare([tmp_path / "corpus.txt"], tmp_path / "train.bin", load_tokenizer(str(tmp_path / "tokenizer.json")))
    name = sampling.recorded_tokenizer(str(tmp_path / "train*.bin"))
    assert name == str(tmp_path / "tokenizer.json")
    tokenizer = sampling.sample_tokenizer(name, vocab_size=512)
    ids = sampling.prompt_ids(tokenizer, "the lazy dog")
    assert ids[0] == tokenizer.delimiter and tokenizer.decode(ids[1:]) == "the lazy dog"
    with pytest.raises(ConfigError, match="not the tokenizer its data was made with"):
        sampling.sample_tokenizer(name, vocab_size=256)
    assert json.loads((tmp_path / "train.bin.tokenizer.json").read_text())["tokenizer"] == name
    assert sampling.recorded_tokenizer(sampling.BUILTIN_CORPUS) == "byte"
