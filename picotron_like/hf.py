"""
Hugging Face's format: the reference GPT's weights as a Hub model folder, and back.

The problem. A model trained here is only useful where people run models: a Hub folder
(config.json + model.safetensors) that transformers, vLLM or llama.cpp's converters load. And
continued pretraining starts from weights someone else trained, published in that format.

The idea. The reference GPT already is a Llama (dense) or a Mixtral (softmax-router experts):
the same RMSNorm, the same half-rotation RoPE (HF's rotate_half pairs x[i] with x[i + d/2], as
model.apply_rotary does, so q and k copy as they are, with no row permutation), the same SwiGLU,
the same top-k renormalised routing. Only the names differ, and the experts' layout:

    reference GPT                                Hub (LlamaForCausalLM / MixtralForCausalLM)
    tok_embeddings.weight                        model.embed_tokens.weight
    layers.N.attn_norm.weight                    model.layers.N.input_layernorm.weight
    layers.N.attn.{q,k,v,o}_proj.weight          model.layers.N.self_attn.{q,k,v,o}_proj.weight
    layers.N.mlp_norm.weight                     model.layers.N.post_attention_layernorm.weight
    layers.N.mlp.{gate,up,down}_proj.weight      model.layers.N.mlp.{gate,up,down}_proj.weight
    layers.N.mlp.router.weight                   model.layers.N.block_sparse_moe.gate.weight
    layers.N.mlp.experts.gate_proj [E, f, h]     model.layers.N.block_sparse_moe.experts.e.w1.weight [f, h]
    layers.N.mlp.experts.up_proj   [E, f, h]     ... .experts.e.w3.weight [f, h]    (one tensor per expert)
    layers.N.mlp.experts.down_proj [E, h, f]     ... .experts.e.w2.weight [h, f]
    layers.N.mlp.router_bias                     none: Mixtral has no router bias, so it must be zero
    norm.weight, lm_head.weight                  model.norm.weight, lm_head.weight

Every key here is the Hub's on-disk layout, which every transformers version reads (version 5
fuses each layer's experts after loading, and writes this layout back when it saves).

What neither side can express is refused in one line, never loaded or written wrong: RoPE
scaling (Llama 3.1's "llama3" type and the others), attention or MLP biases, a head_dim other than
hidden / heads, an activation other than SiLU, Mixtral's sliding window; on the way out, the
sigmoid router, shared experts and non-zero router biases (DeepSeek-V3's features, which the
Mixtral format has no place for). Tied embeddings are implemented by untying: the LM head starts
as a copy of the embedding and trains as a weight of its own (as every preset here has it), and an
export writes it untied. A model trained with a capacity factor is written: Mixtral routes
dropless, which is what the reference computes wherever no expert overflows.

Loading reads only what a rank holds: safetensors' get_slice reads a box of a tensor from the
file, so a rank of any layout (a HeldSlice: a flat range of a box of a reference tensor) reads the
rows of its box that cover its range, and nothing else.

Needs the `hf` extra (safetensors; transformers only for the tests): imported inside the
functions that use it, so the default run never needs it.

Lesson 07 starts from a Hub folder with --init-from (continued pretraining). Commands:
    python -m picotron_like.checkpoint export --format hf ckpt hf_model     # any checkpoint -> Hub folder
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import fields
from pathlib import Path

import torch

from picotron_like.checkpoint import HeldSlice, reference_shapes, reference_slices
from picotron_like.metrics import log0
from picotron_like.model import GPT, GPTConfig
from picotron_like.topology import ConfigError
from picotron_like.train import MODEL_SHAPE_FLAGS

CONFIG, WEIGHTS, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
# model_type -> (architecture, the defaults of transformers' config class for what a file may omit)
KINDS = {"llama": ("LlamaForCausalLM", {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048}),
         "mixtral": ("MixtralForCausalLM", {"rope_theta": 1e6, "rms_norm_eps": 1e-5,
                                            "max_position_embeddings": 4096 * 32})}
# GPTConfig field -> config.json key, for the fields the two share one to one
SHARED_FIELDS = {"vocab_size": "vocab_size", "hidden": "hidden_size", "ffn_hidden": "intermediate_size",
                 "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads", "norm_eps": "rms_norm_eps",
                 "seq_len": "max_position_embeddings", "init_std": "initializer_range"}
# The stacked experts' Hub names (Mixtral's w1, w2, w3: gate, down, up)
EXPERT_NAMES = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
_RENAMES = [("tok_embeddings.", "model.embed_tokens."), ("norm.weight", "model.norm.weight")]
_LAYER_RENAMES = [(".attn_norm.", ".input_layernorm."), (".mlp_norm.", ".post_attention_layernorm."),
                  (".attn.", ".self_attn.")]


class HubFormatError(ConfigError):
    """A Hub folder or a model that the other side cannot express: one line, with the file and the fix."""


def safetensors_torch():
    """safetensors' torch API, or the one line that says how to install it (the hf extra): the
    default run never needs it, so it is imported only here."""
    try:
        import safetensors.torch
    except ImportError:
        raise HubFormatError("Hugging Face folders need the safetensors package: pip install -e \".[hf]\"") from None
    return safetensors.torch


# ----------------------------------------------------------------------------- names, both ways


def is_stacked(name: str) -> bool:
    """The experts' stacked weights [E, ...], which the Hub holds as one tensor per expert."""
    return ".mlp.experts." in name


def hub_keys(name: str, cfg: GPTConfig) -> list[str]:
    """The Hub keys of reference tensor `name`: one, or for stacked experts one per expert, in
    order (expert e is slice [e] of the reference tensor). Empty for the router bias, which the
    Hub format does not hold."""
    if name.endswith(".router_bias"):
        return []
    if not name.startswith("layers."):
        for ours, theirs in _RENAMES:
            if name.startswith(ours):
                return [theirs + name.removeprefix(ours)]
        return [name]                                                       # lm_head.weight
    hub = "model." + name
    for ours, theirs in _LAYER_RENAMES:
        hub = hub.replace(ours, theirs)
    layer, _, part = hub.partition(".mlp.")
    if part == "router.weight":
        return [f"{layer}.block_sparse_moe.gate.weight"]
    if is_stacked(name):
        weight = EXPERT_NAMES[part.removeprefix("experts.")]
        return [f"{layer}.block_sparse_moe.experts.{e}.{weight}.weight" for e in range(cfg.n_experts)]
    return [hub]


def hub_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every Hub key the model's folder holds and its shape: the reference name -> Hub key map,
    read the other way (the way a folder is checked before anything is loaded)."""
    shapes = {}
    for name, shape in reference_shapes(cfg).items():
        for key in hub_keys(name, cfg):
            shapes[key] = shape[1:] if is_stacked(name) else shape
    return shapes


# ----------------------------------------------------------------------------- configs, both ways


def export_problems(cfg: GPTConfig) -> list[str]:
    """What the Llama / Mixtral formats cannot express of this model (the router bias, a value
    rather than a setting, is checked on the weights: save)."""
    problems = []
    if cfg.n_experts and cfg.router != "softmax":
        problems.append(f"router {cfg.router!r}: Mixtral's router is a softmax; no Hub format is written here for "
                        f"DeepSeek-V3's sigmoid router")
    if cfg.n_shared_experts:
        problems.append(f"n_shared_experts {cfg.n_shared_experts}: Mixtral has no shared expert")
    return problems


def hub_config(cfg: GPTConfig) -> dict:
    """config.json for the model: LlamaForCausalLM when dense, MixtralForCausalLM with experts.
    RoPE's theta is written both where transformers 5 reads it (rope_parameters) and where
    version 4 and other readers do (rope_theta): one reader falling back to its default theta
    would compute other logits from the same weights."""
    problems = export_problems(cfg)
    if problems:
        raise HubFormatError("this model has no Hugging Face format: " + "; ".join(problems))
    kind = "mixtral" if cfg.n_experts else "llama"
    config = {"architectures": [KINDS[kind][0]], "model_type": kind,
              **{key: getattr(cfg, field) for field, key in SHARED_FIELDS.items()},
              "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
              "rope_theta": cfg.rope_theta, "rope_scaling": None,
              "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
              "tie_word_embeddings": False, "torch_dtype": "float32"}
    if kind == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config.update(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                      sliding_window=None, router_jitter_noise=0.0)
    return config


def _rope_problem(config: dict) -> str | None:
    """RoPE scaling of any type (llama3, linear, dynamic, yarn, ...) changes the rotation
    frequencies, which the reference's rotary_tables do not."""
    for key in ("rope_parameters", "rope_scaling"):
        scaling = config.get(key) or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind != "default":
            return (f"{key} of type {kind!r}: the reference RoPE has no frequency scaling; this model cannot be "
                    f"loaded as it was trained")
    return None


def gpt_config(config: dict, where) -> GPTConfig:
    """The reference GPT a Hub config.json describes, or one HubFormatError naming everything it
    cannot express (`where`: the file, for the message)."""
    kind = config.get("model_type")
    if kind not in KINDS:
        raise HubFormatError(f"{where}: model_type {kind!r}: this project reads Llama and Mixtral folders "
                             f"(model_type 'llama' or 'mixtral')")
    defaults = KINDS[kind][1]
    problems = [f"no {key}" for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                        "num_attention_heads") if key not in config]
    if problems:
        raise HubFormatError(f"{where}: not a complete {kind} config: " + ", ".join(problems))
    heads = config["num_attention_heads"]
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {config['hidden_act']!r}: the reference MLP is SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            problems.append(f"{key} true: the reference GPT's linear layers have no bias")
    if config.get("head_dim") not in (None, config["hidden_size"] // heads):
        problems.append(f"head_dim {config['head_dim']} is not hidden_size / num_attention_heads = "
                        f"{config['hidden_size'] // heads}: the reference GPT derives it")
    if (rope := _rope_problem(config)) is not None:
        problems.append(rope)
    if config.get("sliding_window") is not None:
        problems.append(f"sliding_window {config['sliding_window']}: the reference attention is full causal")
    if problems:
        raise HubFormatError(f"{where}: {'; '.join(problems)}")
    values = {field: config.get(key, defaults.get(key)) for field, key in SHARED_FIELDS.items()}
    values["n_kv_heads"] = config.get("num_key_value_heads") or heads
    values["rope_theta"] = float((config.get("rope_parameters") or {}).get(
        "rope_theta", config.get("rope_theta", defaults["rope_theta"])))
    if kind == "mixtral":
        values.update(n_experts=config.get("num_local_experts", 8), experts_per_token=config.get("num_experts_per_tok", 2))
    try:
        return GPTConfig(**{f.name: values[f.name] for f in fields(GPTConfig) if f.name in values})
    except (TypeError, ValueError) as error:
        raise HubFormatError(f"{where}: {error}") from None


# ----------------------------------------------------------------------------- reading a folder


class HubFolder:
    """A Hub model folder: its config and its tensors (one model.safetensors, or the shards an
    index.json names), each read lazily, a box at a time."""

    def __init__(self, directory):
        self.directory = Path(directory)
        path = self.directory / CONFIG
        try:
            self.config = json.loads(path.read_text())
        except FileNotFoundError:
            raise HubFormatError(f"{path}: missing: --init-from takes a Hugging Face model folder (config.json and "
                                 f"model.safetensors)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise HubFormatError(f"{path}: not a readable config ({error})") from None
        self.cfg = gpt_config(self.config, path)
        self.files: dict[Path, object] = {}
        self.file_of = self._file_of_each_key()

    def _file_of_each_key(self) -> dict[str, Path]:
        index = self.directory / INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
                raise HubFormatError(f"{index}: not a readable index ({error!r})") from None
            return {key: self.directory / file for key, file in weight_map.items()}
        path = self.directory / WEIGHTS
        if not path.exists():
            raise HubFormatError(f"{path}: missing: the folder holds no weights ({WEIGHTS} or {INDEX})")
        return dict.fromkeys(self.tensors(path).keys(), path)

    def tensors(self, path: Path):
        """The open file (its header read; tensors read when sliced)."""
        if path not in self.files:
            safetensors = safetensors_torch()
            try:
                self.files[path] = safetensors.safe_open(path, "pt")
            # Whatever the reader raises (no file, a truncated or foreign header), the file is unusable.
            except Exception as error:
                raise HubFormatError(f"{path}: not a readable safetensors file ({error})") from None
        return self.files[path]

    def key_for(self, key: str) -> str:
        """Tied embeddings (as transformers ties them): the LM head is the embedding, whether or
        not the file stores a copy under lm_head.weight."""
        if key == "lm_head.weight" and self.config.get("tie_word_embeddings"):
            return "model.embed_tokens.weight"
        return key

    def check(self) -> None:
        """Every tensor the model needs is there, with its shape, and nothing else is (a bias, a
        layer the config does not count): from the files' headers only, before anything is read."""
        expected = hub_shapes(self.cfg)
        problems = []
        for key, shape in expected.items():
            stored = self.key_for(key)
            if stored not in self.file_of:
                problems.append(f"{key} missing")
            else:
                found = tuple(self.tensors(self.file_of[stored]).get_slice(stored).get_shape())
                if found != shape:
                    problems.append(f"{key} has shape {list(found)}, config.json implies {list(shape)}")
        # Older Llama files carry each layer's RoPE frequencies, which rope_theta gives anyway.
        unexpected = sorted(key for key in self.file_of
                            if key not in expected and not key.endswith("rotary_emb.inv_freq"))
        if unexpected:
            problems.append(f"{len(unexpected)} tensors the model does not have (e.g. {unexpected[0]})")
        if problems:
            raise HubFormatError(f"{self.directory}: weights do not match {CONFIG}: " + "; ".join(problems[:3])
                                 + (f"; and {len(problems) - 3} more" if len(problems) > 3 else ""))

    def rows(self, name: str, offsets, shape, first: int, last: int) -> torch.Tensor:
        """Rows [first, last) (along dim 0) of the box offsets + shape of reference tensor `name`,
        read from the files (float32). Stacked experts: each row is one expert's tensor."""
        keys = hub_keys(name, self.cfg)
        inner = tuple(slice(o, o + s) for o, s in zip(offsets[1:], shape[1:]))
        if is_stacked(name):
            experts = [self._read(keys[e], inner) for e in range(offsets[0] + first, offsets[0] + last)]
            return torch.stack(experts)
        return self._read(keys[0], (slice(offsets[0] + first, offsets[0] + last), *inner))

    def _read(self, key: str, box: tuple) -> torch.Tensor:
        key = self.key_for(key)
        return self.tensors(self.file_of[key]).get_slice(key)[box].to(torch.float32)


def read_config(directory) -> GPTConfig:
    """The model a Hub folder holds, checked against its weights' headers (every rank can call
    it before any process group: it reads no tensor)."""
    folder = HubFolder(directory)
    folder.check()
    return folder.cfg


@torch.no_grad()
def load_slices(directory, slices) -> None:
    """Fill each HeldSlice (picotron_like.checkpoint; a flat range [lo, hi) of a box of a
    reference tensor) from a Hub folder, reading only the rows of the box that cover the range.
    The router biases, which the format does not hold, are zero."""
    folder = HubFolder(directory)
    for held in slices:
        if not hub_keys(held.name, folder.cfg):
            held.tensor.zero_()
            continue
        row = math.prod(held.shape[1:])
        first, last = held.lo // row, -(-held.hi // row)
        values = folder.rows(held.name, held.offsets, held.shape, first, last).reshape(-1)
        held.tensor.copy_(values[held.lo - first * row: held.hi - first * row].view_as(held.tensor))


def load_gpt(directory) -> GPT:
    """A Hub folder as the single-device reference GPT (float32)."""
    cfg = read_config(directory)
    model = GPT(cfg, seed=0)
    state = model.state_dict(keep_vars=True)
    load_slices(directory, [HeldSlice(name, (0,) * t.dim(), tuple(t.shape), 0, t.numel(), t.data)
                            for name, t in state.items()])
    return model


# ----------------------------------------------------------------------------- a training run that starts from a folder


def add_init_flag(parser) -> None:
    parser.add_argument("--init-from", default=None, metavar="HF_DIR",
                        help="continued pretraining: start from a Hugging Face Llama or Mixtral folder (config.json "
                             "and safetensors), each rank reading only its slices; the model is the one config.json "
                             "describes (no --preset, no model-shape flag); a checkpoint that --resume finds comes "
                             "first")


def model_config(cfg, args, configure) -> GPTConfig:
    """The model a run trains: the preset configured by the run's flags (`configure(cfg, args)`,
    the trainer's: its MoE flags, say), or with --init-from the model its config.json describes
    (read_config refuses what the reference GPT cannot express), refused where the flags ask for
    another model. The balancing and capacity flags stay free: they change how the model
    trains, not what its weights mean."""
    if args.init_from is None:
        return configure(cfg, args)
    written = read_config(args.init_from)
    configured = configure(written, args)
    asked = ["--preset"] * (args.preset != "tiny") + [f"--{field.replace('_', '-')}" for field in MODEL_SHAPE_FLAGS
                                                      if getattr(args, field, None) is not None]
    asked += [f"{field} {getattr(configured, field)!r} where the folder has {getattr(written, field)!r}"
              for field in ("router", "n_shared_experts") if getattr(configured, field) != getattr(written, field)]
    if asked:
        raise ConfigError(f"--init-from {args.init_from} with {', '.join(asked)}: the model is the one its config.json "
                          f"describes; drop those flags")
    return configured


def init_from_hub(directory, model, grid) -> None:
    """The starting weights from a Hub folder: each rank reads the slices it holds (reference_slices,
    the description a checkpoint reshards by), then every weight from the master (ZeRO's all-gathers).
    The optimizer starts afresh: continued pretraining, at step 0 of this run's schedule."""
    load_slices(directory, reference_slices(model, grid))
    model.publish_master()
    log0(f"initial weights from {directory}")


# ----------------------------------------------------------------------------- writing a folder


def save(state: dict[str, torch.Tensor], cfg: GPTConfig, out_dir) -> Path:
    """Write the reference GPT's state dict as a Hub folder (config.json, model.safetensors,
    float32). Each file is written beside its name and renamed into place, config.json last: a
    folder with a config has its weights."""
    save_file = safetensors_torch().save_file
    config = hub_config(cfg)
    biased = [name for name, tensor in state.items() if name.endswith(".router_bias") and bool(tensor.any())]
    if biased:
        raise HubFormatError(f"{biased[0]} is not zero (auxiliary-loss-free balancing moved it): Mixtral's router "
                             f"has no bias, so the experts chosen would differ; not written")
    tensors = {}
    for name, tensor in state.items():
        for e, key in enumerate(hub_keys(name, cfg)):
            tensors[key] = (tensor[e] if is_stacked(name) else tensor).contiguous()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    umask = os.umask(0)
    os.umask(umask)
    for name, write in ((WEIGHTS, lambda path: save_file(tensors, path, metadata={"format": "pt"})),
                        (CONFIG, lambda path: Path(path).write_text(json.dumps(config, indent=2) + "\n"))):
        partial = out_dir / (name + ".partial")
        write(str(partial))
        os.chmod(partial, 0o666 & ~umask)       # safetensors creates its file readable by its owner only
        os.replace(partial, out_dir / name)
    return out_dir
