"""Hugging Face weights out and in, proven against the transformers version the tests pin.

Two small Hub folders are built here from random weights (a Llama and a Mixtral; save_pretrained,
float32, nothing downloaded). One spawn of 4 gloo ranks starts lesson 07 from each with
--init-from, in layouts that cut every tensor (pp 2 x tp 2 for the Llama; dp 2 x tp 2 with ep 2
and ZeRO-3 for the Mixtral, whose shards end anywhere inside a tensor), saves the weights as
loaded (step 0), trains one step and saves again (step 1). Proven:

- step 0's loss, computed by the parallel layout, is transformers' loss on the same batch;
- HF folder -> --init-from -> export --format hf gives back every tensor bit for bit;
- the step-1 folder (trained weights) loaded in LlamaForCausalLM / MixtralForCausalLM gives the
  reference GPT's logits;
- what the reference GPT cannot express is refused in one line, both ways; tied embeddings load.

Tolerances. Equal float32 weights through the same operations, some in another order
(transformers' eager attention against SDPA, its expert loop against ours), differ by float32
rounding: measured 0 for the Llama and 6e-7 for the Mixtral on logits of magnitude 2 (a float32
step there is 2.4e-7), so logits must agree to 2e-6. A parallel layout's loss sums its shares in
another order again: 1e-5, the suite's tolerance against one device. Bit for bit where no
arithmetic happens: the weights read, resharded, written back.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F

import picotron_like.checkpoint as checkpoints
import picotron_like.hf as hub
from picotron_like.lessons import load_lesson
from picotron_like.model import GPT, GPTConfig
from picotron_like.testing import run_ranks
from picotron_like.topology import ConfigError, ProcessGrid
from picotron_like.train import RankBatches, checked_plan, plan_run, train

CPU = torch.device("cpu")
SMALL = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)
# Thetas away from each class's default: a reader that fell back to its default would be seen.
KINDS = {"llama": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}),
         "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                     {"num_local_experts": 4, "num_experts_per_tok": 2,
                      "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})}
COMMON = ["--seq-len", "16", "--micro-batch-size", "2", "--global-batch-tokens", "128", "--steps", "1", "--lr", "1e-2",
          "--warmup-steps", "0", "--seed", "5"]
LAYOUTS = {"llama": ["--pp", "2", "--tp", "2"], "mixtral": ["--dp", "2", "--tp", "2", "--ep", "2", "--zero-stage", "3"]}
LOGITS = dict(rtol=0, atol=2e-6)
LOSS_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def transformers():
    # Imported here, not at the top: the ranks import this module and need none of it.
    return pytest.importorskip("transformers")


def hub_model(transformers, kind: str, **overrides):
    """A transformers model of the small shape with random weights: every tensor drawn, norm
    gains around one (a mapping that swapped two norms would show), routers wide enough that the
    top-2 choice depends on the token."""
    config_class, model_class, extra = KINDS[kind]
    config = getattr(transformers, config_class)(**SMALL, **extra, **overrides)
    torch.manual_seed(11)
    model = getattr(transformers, model_class)(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0, 0.5 if ".gate." in name else 0.08)
    return model


def init_save_step(argv: list[str], save_dir: str) -> dict:
    """07's main(), from --init-from to one trained step, without its report: saves the weights
    as loaded (step 0) and after the step (step 1); returns step 0's loss and global batch."""
    os.environ["WORLD_SIZE"] = "4"
    full_5d = load_lesson("07_full_5d")
    args = full_5d.parse_args([*COMMON, *argv, "--save-dir", save_dir])
    plan = plan_run(args, full_5d.validate, full_5d.model_config)
    grid = ProcessGrid(plan.grid, ep=full_5d.expert_degree(args.ep, plan.cfg, plan.grid))
    # as main() does: nothing drawn, every value NaN until the folder's arrive (the export below would show a miss)
    model, pipeline = full_5d.parallelize(plan.cfg, grid, args, CPU, values_to_load=True)
    optimizer = full_5d.zero.build_sharded_optimizer(model, args.lr)
    hub.init_from_hub(args.init_from, model, grid)
    save = checkpoints.checkpoint_saver(args, plan.cfg, plan.shape, grid, model, optimizer)
    save(-1, True)      # after_step(s) writes the checkpoint of s + 1 steps done: step 0, the weights as loaded
    settings = full_5d.step_settings(grid, CPU, model.precision, args.max_grad_norm)
    results = []

    def step(batch):
        results.append(full_5d.train_step(model if pipeline is None else pipeline, optimizer, batch, settings))
        return results[-1]

    batches = RankBatches(plan.batches, grid.dp_rank, CPU, cut=full_5d.context_parallel.sequence_cut(grid, args.zigzag))
    train(args, optimizer, step, batches, after_step=save)
    return {"loss": results[0].loss, "batch": plan.batches.global_batch(0)}


def both_runs(folders: dict, directory: str) -> dict:
    return {kind: init_save_step([*LAYOUTS[kind], "--init-from", folders[kind]], f"{directory}/{kind}")
            for kind in KINDS}


@pytest.fixture(scope="module")
def runs(transformers, tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf")
    folders = {}
    for kind in KINDS:
        folders[kind] = str(directory / f"{kind}_hub")
        hub_model(transformers, kind).save_pretrained(folders[kind])
    results = run_ranks(4, both_runs, folders, str(directory), timeout_s=300)[0]
    return directory, folders, results


def hub_logits(transformers, folder, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


@pytest.mark.parametrize("kind", list(KINDS))
def test_init_from_then_export_is_bit_exact_and_the_loss_is_transformers(runs, transformers, kind, tmp_path):
    from safetensors.torch import load_file

    directory, folders, results = runs
    out = tmp_path / "exported"
    checkpoints.main(["export", "--format", "hf", str(directory / kind / "step_00000000"), str(out)])
    original, exported = load_file(f"{folders[kind]}/model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(exported) == sorted(original)
    unequal = [key for key in original if not (exported[key].dtype == torch.float32
                                               and torch.equal(exported[key], original[key]))]
    assert not unequal, unequal
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [KINDS[kind][1]]
    assert hub.gpt_config(config, "exported") == hub.gpt_config(
        json.loads(open(f"{folders[kind]}/config.json").read()), "original")
    # The parallel layout's step-0 loss is transformers' on the same global batch.
    batch = results[kind]["batch"]
    logits = hub_logits(transformers, folders[kind], batch[:, :-1])
    expected = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()
    assert abs(results[kind]["loss"] - expected) < LOSS_TOLERANCE, (results[kind]["loss"], expected)


@pytest.mark.parametrize("kind", list(KINDS))
def test_trained_export_gives_the_reference_logits_in_transformers(runs, transformers, kind, tmp_path):
    directory, _, _ = runs
    step_1 = directory / kind / "step_00000001"
    checkpoints.main(["export", "--format", "hf", str(step_1), str(tmp_path / "hub")])
    checkpoints.main(["export", str(step_1), str(tmp_path / "model.pt")])
    reference = GPT(checkpoints.read_manifest(step_1)["cfg"])
    reference.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True), strict=True)
    tokens = torch.randint(0, SMALL["vocab_size"], (3, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = reference(tokens)
    torch.testing.assert_close(hub_logits(transformers, tmp_path / "hub", tokens), expected, **LOGITS)


def test_a_tied_sharded_folder_loads_untied_with_the_same_logits(transformers, tmp_path):
    """Tied embeddings (no lm_head tensor: the head is the embedding), in shards that an index names."""
    model = hub_model(transformers, "llama", tie_word_embeddings=True)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / hub.INDEX).exists() and not (tmp_path / hub.WEIGHTS).exists()
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(3))
    loaded = hub.load_gpt(tmp_path)
    assert torch.equal(loaded.lm_head.weight, model.model.embed_tokens.weight)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens), model(input_ids=tokens).logits, **LOGITS)


def test_what_the_reference_cannot_express_is_refused_in_one_line(runs):
    _, folders, _ = runs
    llama = json.loads(open(f"{folders['llama']}/config.json").read())
    mixtral = json.loads(open(f"{folders['mixtral']}/config.json").read())
    llama3_scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_theta": 5e5}
    cases = {
        "rope_parameters of type 'llama3'": {**llama, "rope_parameters": llama3_scaling},
        "rope_scaling of type 'linear'": {**llama, "rope_scaling": {"type": "linear", "factor": 2.0}},
        "attention_bias true": {**llama, "attention_bias": True},
        "mlp_bias true": {**llama, "mlp_bias": True},
        "head_dim 16 is not hidden_size / num_attention_heads = 8": {**llama, "head_dim": 16},
        "hidden_act 'gelu'": {**llama, "hidden_act": "gelu"},
        "sliding_window 32": {**mixtral, "sliding_window": 32},
        "model_type 'qwen2'": {**llama, "model_type": "qwen2"},
    }
    for words, config in cases.items():
        with pytest.raises(hub.HubFormatError) as refused:
            hub.gpt_config(config, "config.json")
        assert words in str(refused.value) and "\n" not in str(refused.value), (words, refused.value)
    for cfg, words in ((GPTConfig(n_experts=4, router="sigmoid"), "sigmoid router"),
                       (GPTConfig(n_experts=4, n_shared_experts=1), "no shared expert")):
        with pytest.raises(hub.HubFormatError, match=words):
            hub.hub_config(cfg)
    moe = GPTConfig(n_experts=4, n_layers=1)
    state = GPT(moe).state_dict()
    state["layers.0.mlp.router_bias"][1] = 0.5
    with pytest.raises(hub.HubFormatError, match="router_bias is not zero"):
        hub.save(state, moe, "never_written")


def test_lesson_07_refuses_a_bad_folder_or_another_model_before_any_collective(runs, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    _, folders, _ = runs
    full_5d = load_lesson("07_full_5d")
    broken = tmp_path / "broken"
    shutil.copytree(folders["llama"], broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    save_file(tensors, broken / "model.safetensors")
    truncated = tmp_path / "truncated"
    shutil.copytree(folders["llama"], truncated)
    os.truncate(truncated / "model.safetensors", 100)
    cases = {
        ("--init-from", str(truncated)): "model.safetensors: not a readable safetensors file",
        ("--init-from", str(broken)): "model.layers.1.mlp.up_proj.weight missing; 1 tensors the model does not "
                                      "have (e.g. model.layers.0.self_attn.q_proj.bias)",
        ("--init-from", str(tmp_path / "nothing")): "config.json: missing",
        ("--init-from", folders["llama"], "--preset", "tiny-moe"): "with --preset: the model is the one its "
                                                                  "config.json describes",
        ("--init-from", folders["mixtral"], "--router", "sigmoid"): "router 'sigmoid' where the folder has 'softmax'",
        ("--init-from", folders["llama"], "--hidden", "64"): "with --hidden: the model is the one its config.json "
                                                             "describes",
    }
    for flags, words in cases.items():
        args = full_5d.parse_args([*COMMON, *flags])
        with pytest.raises(ConfigError) as refused:
            checked_plan(args, full_5d.validate, full_5d.model_config, 1)
        assert words in str(refused.value) and "\n" not in str(refused.value), (flags, refused.value)
    # Without the hf extra: the fix, not an ImportError's traceback.
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ConfigError, match=r"need the safetensors package: pip install -e \"\.\[hf\]\""):
        checked_plan(full_5d.parse_args([*COMMON, "--init-from", folders["llama"]]), full_5d.validate,
                     full_5d.model_config, 1)
