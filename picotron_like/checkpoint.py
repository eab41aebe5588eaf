"""
Checkpoints that outlive the layout they were written in: save, resume in any layout, export.

The problem. A pretraining run is stopped all the time: preemption, a node lost, a job limit, a
cluster that is bigger next week. Resuming must continue the run as if it had never stopped, and
it must work on a different number of GPUs, where every tensor is cut differently: lesson 02
splits a weight over tp, 03 spreads layers over pp, 05 experts over ep, and 06 flattens each
module into one buffer and cuts *that* into dp x cp shards at arbitrary places.

The idea. Every rank describes what it holds in the reference GPT's own terms (HeldSlice):

    "the elements [lo, hi) (row-major) of the box  offsets + shape  of reference tensor `name`"

    layers.0.mlp.down_proj.weight [128, 384]   tp = 2 splits dim 1; ZeRO (dp = 2) cuts each half
                                                wherever the flat unit's shard boundary falls:
          +----------- tp 0 ----------+----------- tp 1 ----------+
          | box (0, 0) [128, 192]     | box (0, 192) [128, 192]   |
          | dp 0: [0, 12288)          | dp 0: [0, 12288)          |
          | dp 1: [12288, 24576)      | dp 1: [12288, 24576)      |
          +---------------------------+---------------------------+

A checkpoint is one file per rank holding its slices (the float32 master weights and the optimizer's
states of each: AdamW's two moments and step count, or Muon's momentum; the persistent buffers
such as MoE router biases; the rank's RNG states) and a manifest listing every file's slices,
written last. Loading in another layout is index arithmetic: each rank asks, for every slice it
holds now, which written slices intersect it, and copies the overlap. Nothing about tp, pp, ep or ZeRO is known here: the lesson hands over the
description (reference_slices), this module stores and reshards it. Padding of ZeRO's flat
units is not saved; replicas (a norm gain on every tp rank, ZeRO-0's whole copies) are written by
one rank only (HeldSlice.write), so each element of each reference tensor is stored exactly once,
which the manifest check verifies before anything is read.

Why not torch.distributed.checkpoint (DCP)? DCP reshards DTensor and ShardedTensor state; the
lessons hold plain tensors and hand-made flat shards, so every one would have to be wrapped first,
and a flat range cut across several parameters of a ZeRO unit is no DTensor placement. A small
format of our own is a few hundred lines and *is* the lesson: resharding is intersecting boxes.

    DIR/step_00000020/                  one checkpoint: 20 optimizer steps done
        rank_00000.pt ... rank_0000N.pt     torch.save of {format, step, rank, entries, tensors, rng}
        manifest.json                       format, step, model config, layout, run, optimizer,
                                            settings, files (bytes, sha256, entries), its own
                                            checksum: written last, by rank 0
    DIR/step_00000030.partial/          a checkpoint being written (or deleted): never read

Atomic. Each rank writes rank_N.pt.partial, fsyncs and renames it; rank 0 then writes the manifest
the same way, fsyncs the directory and renames step_N.partial to step_N. A checkpoint is complete
or absent: a writer killed at any point leaves a .partial directory that no reader considers, and
the next save removes it. A complete checkpoint is never overwritten. Every rank must see DIR
(across nodes, a shared filesystem): rank 0 reads the other ranks' files for the manifest.

Refused, each with one line naming the file and the problem, before any collective: no manifest
(torn: something removed it, or copied half a checkpoint), a manifest of another format (foreign),
a rank file missing or of another size (truncated), a model whose tensor shapes differ, a run
whose global batch or seed differ (its data would not continue where the checkpoint stopped),
a run with another --optimizer (its states would not fit: check_optimizer_kind), tensors that do
not cover every element of the reference exactly once. A rank file whose bytes differ from the
manifest's sha256 (copied in from another checkpoint) is found when a rank reads it; every rank
then stops, and rank 0 prints that line.

What continues exactly. The step (so the learning-rate schedule and the data: TokenBatches is a
function of the step), the float32 master weights (bf16 weights are their cast), the optimizer's
states (AdamW's moments and step count, Muon's momentum), router biases, RNG states (per rank,
restored when the world size is the same).
In the same layout the run continues bit for bit on CPU; on CUDA too when the run is
deterministic (torch.use_deterministic_algorithms and CUBLAS_WORKSPACE_CONFIG=:4096:8; atomics in
some backward kernels and NCCL's choice of algorithm otherwise change the last bits of a sum).
In another layout the sums run in another order: the losses agree to float32 rounding.

The price. Saving writes 12 bytes per parameter (master + two moments, float32) once over all
ranks and reads them back on a CPU copy; loading reads, for each tensor, the writer slices that
intersect this rank's, and materialises one writer box and one reader box at a time.

Lesson 07 writes a checkpoint (--save-dir, --save-every) and continues from it in any layout
(--resume). Commands:
    python -m picotron_like.checkpoint inspect ckpt                                  # what is in it
    python -m picotron_like.checkpoint export ckpt model.pt                          # one GPT state dict
    python -m picotron_like.checkpoint export --format hf ckpt hf_model              # a Hugging Face folder
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, fields
from itertools import accumulate
from pathlib import Path

import torch
import torch.distributed as dist

from picotron_like import comm
from picotron_like.data import TokenBatches
from picotron_like.metrics import log0
from picotron_like.model import GPT, GPTConfig
from picotron_like.moe import is_expert_parameter
from picotron_like.run_control import AfterStep, follow_time_budget, time_budget_settings
from picotron_like.topology import ConfigError, group_rank, group_size
from picotron_like.train import exit_with_error

FORMAT = "picotron_like checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
PARTIAL = ".partial"
_STEP_DIR = re.compile(r"step_(\d+)")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used: the message names the file and the problem, in one line."""


# ----------------------------------------------------------------------------- what a rank holds


@dataclass
class HeldSlice:
    """Elements [lo, hi) of the row-major box `offsets` + `shape` of the reference tensor `name`.

    `tensor` holds them (1-D, hi - lo elements): an optimizer parameter (its AdamW states are
    saved and loaded with it) or a buffer. `write` is False on a rank whose copy another rank
    writes (replicas): loading fills every slice, writing skips those.
    """

    name: str
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    lo: int
    hi: int
    tensor: torch.Tensor
    write: bool = True

    def entry(self) -> list:
        return [self.name, list(self.offsets), list(self.shape), self.lo, self.hi]


def reference_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the reference GPT's state dict (parameters and persistent buffers) and its
    shape, from a model built on the meta device (no memory, no initialisation cost)."""
    with torch.device("meta"):
        model = GPT(cfg, seed=0)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def reference_offsets(name: str, param, shape, grid) -> tuple[int, ...]:
    """Where a rank's tensor `name`, of `shape` as the rank holds it, begins in the reference
    tensor of that name: lesson 02 cut a split parameter into tp equal parts along the
    tp_split_dim it attached, tp rank r keeping part r; lesson 05 gave ep rank r experts
    [r E/ep, (r+1) E/ep) along dim 0."""
    offsets = [0] * len(shape)
    if getattr(param, "tp_split_dim", None) is not None:
        offsets[param.tp_split_dim] = grid.tp_rank * shape[param.tp_split_dim]
    if is_expert_parameter(name):
        offsets[0] = grid.ep_rank * shape[0]
    return tuple(offsets)


def master_pieces(model):
    """Each piece of a parameter in this rank's master shards (lesson 06), as (unit, name, shape,
    start, master): the piece holds elements [start, start + master.numel()) of the (row-major)
    parameter `name` of shape `shape`, as this rank holds that parameter. Padding is left out."""
    for unit in model.units:
        shapes = dict(zip(unit.names, unit.shapes))
        offsets = dict(zip(unit.names, accumulate((shape.numel() for shape in unit.shapes), initial=0)))
        for piece in unit.pieces:
            if piece.param is not None:
                yield unit, piece.name, shapes[piece.name], unit.start + piece.lo - offsets[piece.name], piece.master


def reference_slices(model, grid) -> list[HeldSlice]:
    """What this rank of a sharded model (lesson 06's wrapper, whatever lessons cut it before)
    holds, each tensor as a slice of the reference GPT's tensor of the same name: the layout's
    description, which this module saves, and reshards into any other layout.

    Names: every lesson keeps the reference's (03 numbers a stage's layers as the whole model).
    Boxes: reference_offsets. Elements: the master shards hold a flat range of each box
    (master_pieces). Replicas are written once: a norm gain every tp rank holds (by tp rank 0),
    a unit ZeRO-0 keeps whole on each rank of its group (by the group's rank 0), the router
    biases (by dp, cp and tp rank 0)."""
    slices = []
    for unit, name, shape, start, master in master_pieces(model):
        param = unit.params[unit.names.index(name)]
        offsets = reference_offsets(name, param, shape, grid)
        whole_on_every_rank = unit.shard_numel == unit.padded_numel and group_size(unit.group) > 1
        write = ((grid.tp_rank == 0 or not getattr(param, "tp_replicated", False))
                 and (not whole_on_every_rank or group_rank(unit.group) == 0))
        slices.append(HeldSlice(name, offsets, tuple(shape), start, start + master.numel(), master, write))
    persistent = model.module.state_dict().keys()
    first_replica = grid.dp_rank == grid.cp_rank == grid.tp_rank == 0
    for name, buffer in model.module.named_buffers():
        if name in persistent:
            slices.append(HeldSlice(name, (0,) * buffer.dim(), tuple(buffer.shape), 0, buffer.numel(), buffer,
                                    first_replica))
    return slices


# ----------------------------------------------------------------------------- flags


def add_checkpoint_flags(parser) -> None:
    parser.add_argument("--save-dir", default=None,
                        help="directory of checkpoints (step_N/ per checkpoint); written after the last step "
                             "and every --save-every steps")
    parser.add_argument("--save-every", type=int, default=0, help="save every N steps (0: after the last step only)")
    parser.add_argument("--keep-last", type=int, default=0, help="keep the newest K checkpoints (0: keep all)")
    parser.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                        help="continue from the latest checkpoint in --save-dir (from scratch if it holds none), "
                             "or from the checkpoint directory given; any layout the world size allows")


def check_flags(args) -> None:
    """The checkpoint flags' own rules, as ConfigError (before any process group)."""
    problems = []
    for flag in ("save_every", "keep_last"):
        if getattr(args, flag) < 0:
            problems.append(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be 0 or more")
    if args.resume == "latest" and args.save_dir is None:
        problems.append("--resume without a checkpoint needs --save-dir (the directory to continue from)")
    if (args.save_every or args.keep_last) and args.save_dir is None:
        problems.append("--save-every / --keep-last need --save-dir")
    if problems:
        raise ConfigError("bad checkpoint flags:\n  - " + "\n  - ".join(problems))
    if args.save_dir is not None:
        check_writable(args.save_dir)


def check_writable(save_dir) -> None:
    """--save-dir exists (created here) and this rank can write a file in it: checked before the
    first step, so that a wrong path costs one error line, not the run that trained up to its
    first checkpoint. Every rank writes a probe of its own (each writes its own rank file later);
    whether the ranks of every node see the same directory is checked once the process group
    exists (check_shared)."""
    probe = Path(save_dir) / f".probe_{os.getpid()}"       # one per process: ranks probe at the same time
    try:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"picotron_like")
        probe.unlink()
    except OSError as error:
        raise CheckpointError(f"--save-dir {save_dir}: not a directory this run can write checkpoints in "
                              f"({error.strerror or error}); give a writable directory") from None


def check_shared(save_dir) -> None:
    """Every rank sees the file rank 0 writes in --save-dir: a directory local to each node would
    split a checkpoint over the nodes, and no node could resume from it. One collective (after
    the process group exists, before the first step); a CheckpointError on every rank otherwise."""
    probe = Path(save_dir) / ".probe_shared"
    token = f"{os.getpid()}-{time.time_ns()}"
    if dist.get_rank() == 0:
        probe.write_text(token)
    token = [token]
    comm.bookkeeping(dist.broadcast_object_list, token, src=0)
    seen = probe.exists() and probe.read_text() == token[0]
    everyone_sees_it = _agree(seen)
    if dist.get_rank() == 0:
        probe.unlink()
    if not everyone_sees_it:
        raise CheckpointError(f"--save-dir {save_dir}: some ranks do not see the files rank 0 writes there (a "
                              f"directory local to each node?); give a directory every node shares")


# ----------------------------------------------------------------------------- finding and checking


def step_directory(save_dir, step: int) -> Path:
    return Path(save_dir) / f"step_{step:08d}"


def list_checkpoints(save_dir) -> list[tuple[int, Path]]:
    """The step directories in save_dir (complete or not; .partial ones excluded), oldest first."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    found = [(int(match.group(1)), path) for path in save_dir.iterdir()
             if path.is_dir() and (match := _STEP_DIR.fullmatch(path.name))]
    return sorted(found)


def resolve(resume: str, save_dir) -> Path | None:
    """--resume's checkpoint: the newest step directory in save_dir (None if there is none), or
    the directory given. The newest is not skipped when damaged: read_manifest refuses it, so a
    run never silently falls back to older weights."""
    if resume != "latest":
        path = Path(resume)
        # A save directory (not a step directory) means its newest checkpoint.
        return resolve("latest", path) if not (path / MANIFEST).exists() and list_checkpoints(path) else path
    found = list_checkpoints(save_dir)
    return found[-1][1] if found else None


def read_manifest(directory, cfg: GPTConfig | None = None, expect: dict | None = None) -> dict:
    """The checkpoint's manifest, checked against the files and the run that wants it.

    Reads only the manifest and the files' sizes, so every rank reaches the same verdict before
    any collective. `cfg`: the model this run builds (None: the checkpoint's own, for export).
    `expect`: run values that must equal those written (the global batch, the seed). Adds
    "directory" and "cfg" (a GPTConfig) to the returned dict. Raises CheckpointError.
    """
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    if not path.exists():
        raise CheckpointError(f"{path}: missing: the checkpoint is torn (its writer never finished, or files were "
                              f"removed); resume from an older one")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: not a readable manifest ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: foreign: not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise CheckpointError(f"{path}: format version {manifest.get('version')}, this code reads {VERSION}")
    if manifest.get("checksum") != _manifest_checksum(manifest):
        raise CheckpointError(f"{path}: contents differ from its checksum: the manifest is damaged")
    try:
        written_cfg = GPTConfig(**manifest["model"])
        files = [(record["file"], int(record["bytes"]), record["sha256"], record["entries"])
                 for record in manifest["files"]]
        run = dict(manifest["run"])
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{path}: foreign: not the manifest this code writes ({error!r})") from None
    for name, value in (expect or {}).items():
        if run.get(name) != value:
            raise CheckpointError(f"{path}: written by a run with {name} {run.get(name)}, this run has {value}: "
                                  f"the data would not continue where it stopped; use the same value")
    cfg = cfg or written_cfg
    shapes = reference_shapes(cfg)
    if reference_shapes(written_cfg) != shapes:
        differ = [f"{f.name} {getattr(written_cfg, f.name)} in the checkpoint, {getattr(cfg, f.name)} here"
                  for f in fields(GPTConfig) if getattr(written_cfg, f.name) != getattr(cfg, f.name)]
        raise CheckpointError(f"{path}: model shape differs: {'; '.join(differ)}")
    _check_files(directory, files)
    _check_coverage(path, files, shapes)
    return {**manifest, "directory": str(directory), "cfg": cfg}


def _check_files(directory: Path, files: list) -> None:
    for file, size, _, _ in files:
        path = directory / file
        if not path.exists():
            raise CheckpointError(f"{path}: missing: the checkpoint is torn")
        if path.stat().st_size != size:
            raise CheckpointError(f"{path}: truncated or replaced: {path.stat().st_size} bytes, the manifest says "
                                  f"{size}")


def _check_coverage(path: Path, files: list, shapes: dict) -> None:
    """Every element of every reference tensor stored once: slices inside their tensor, and per
    tensor their sizes summing to its element count (with no slice outside, a gap would need an
    overlap and an overlap a gap: both show as a wrong sum)."""
    stored = dict.fromkeys(shapes, 0)
    for file, _, _, entries in files:
        for name, offsets, shape, lo, hi in entries:
            if name not in shapes:
                raise CheckpointError(f"{path}: foreign: {file} holds {name}, which the model does not have")
            inside = (len(offsets) == len(shape) == len(shapes[name])
                      and all(0 <= o and o + s <= full for o, s, full in zip(offsets, shape, shapes[name]))
                      and 0 <= lo < hi <= math.prod(shape))
            if not inside:
                raise CheckpointError(f"{path}: {file} holds a slice of {name} outside its shape "
                                      f"{list(shapes[name])}: offsets {offsets}, box {shape}, elements [{lo}, {hi})")
            stored[name] += hi - lo
    for name, count in stored.items():
        if count != math.prod(shapes[name]):
            raise CheckpointError(f"{path}: {name} has {count} elements stored, the model has "
                                  f"{math.prod(shapes[name])}: the checkpoint is incomplete")


def unpinned_differences(manifest: dict, settings: dict) -> list[str]:
    """What a resuming run changes that the checkpoint does not pin, one line each: the model's
    fields that leave every tensor's shape as it is (read_manifest refuses the others), and the
    run's `settings` against those save() wrote with the checkpoint (its info's "settings")."""
    written_model, written_settings = manifest["model"], manifest.get("settings", {})
    lines = [f"model {name} {written_model.get(name)} in the checkpoint, {value} in this run"
             for name, value in asdict(manifest["cfg"]).items() if written_model.get(name) != value]
    lines += [f"--{name.replace('_', '-')} {written_settings.get(name)} in the checkpoint, {value} in this run"
              for name, value in settings.items() if written_settings.get(name) != value]
    return lines


# ----------------------------------------------------------------------------- writing


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _write_atomically(path: Path, write) -> None:
    """write(file) into path.partial, fsync, rename to path: a reader sees all of it or nothing."""
    partial = path.with_name(path.name + PARTIAL)
    with open(partial, "wb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _agree(ok: bool) -> bool:
    """Whether every rank is ok: a MIN over ranks of a CPU tensor (gloo, also beside NCCL)."""
    flag = torch.tensor([int(ok)], dtype=torch.int32)
    comm.bookkeeping(dist.all_reduce, flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _optimizer_states(optimizer) -> dict[int, dict]:
    return {id(param): state for param, state in optimizer.state.items()} if optimizer is not None else {}


def _rank_payload(step: int, slices: list[HeldSlice], optimizer, world_size: int) -> dict:
    """What this rank writes: its slices' values, their optimizer states cut to the slice
    (tensors of the slice's size; scalars such as AdamW's step as they are), its RNG states."""
    states = _optimizer_states(optimizer)
    mine = [held for held in slices if held.write]
    tensors, scalars = [], []
    for held in mine:
        values = {"value": held.tensor.detach().to("cpu", torch.float32, copy=True)}
        scalar = {}
        for key, state in states.get(id(held.tensor), {}).items():
            if torch.is_tensor(state) and state.numel() == held.tensor.numel() and state.dim():
                values[key] = state.detach().to("cpu", torch.float32, copy=True)
            else:
                scalar[key] = float(state)
        tensors.append(values)
        scalars.append(scalar)
    rank = dist.get_rank()
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    return {"format": FORMAT, "version": VERSION, "step": step, "rank": rank, "world_size": world_size,
            "entries": [held.entry() for held in mine], "tensors": tensors, "scalars": scalars, "rng": rng}


def save(save_dir, step: int, slices: list[HeldSlice], optimizer, info: dict, keep_last: int = 0) -> Path:
    """Write checkpoint `step` of this rank's slices (every rank calls this); return its directory.

    `info` goes into the manifest as it is: "model" (asdict of the GPTConfig), "layout" (how the
    run was cut), "run" (what read_manifest's `expect` compares: global batch, seed, ...),
    "settings" (what a resuming run may change: unpinned_differences lists what it did).
    """
    final = step_directory(save_dir, step)
    partial = final.with_name(final.name + PARTIAL)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    problem = None
    if rank == 0 and final.exists():
        problem = f"{final}: exists already; a checkpoint is never overwritten"
    elif rank == 0:
        try:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            for stale in Path(save_dir).glob(f"step_*{PARTIAL}"):      # a dead writer's leftovers
                shutil.rmtree(stale)
            partial.mkdir()
        except OSError as error:
            problem = f"{partial}: could not be created ({error})"
    if not _agree(problem is None):
        raise CheckpointError(problem or f"{final}: rank 0 could not start the checkpoint")
    started = time.perf_counter()
    record = torch.zeros(6, dtype=torch.int64)    # ok, bytes, sha256 as 4 x 8 bytes
    path = partial / f"rank_{rank:05d}.pt"
    try:
        payload = _rank_payload(step, slices, optimizer, world_size)
        _write_atomically(path, lambda file: torch.save(payload, file))
        record[0], record[1] = 1, path.stat().st_size
        record[2:] = torch.frombuffer(bytearray(bytes.fromhex(_sha256(path))), dtype=torch.int64)
    except (OSError, RuntimeError) as error:
        # torch.save's zip writer meets a failed write (a full disk) with an OSError, then its own
        # RuntimeError while closing the archive: the OSError is the cause worth naming.
        cause = error.__context__ if isinstance(error.__context__, OSError) else error
        problem = f"{path}: could not be written ({cause})"
    records = torch.zeros(world_size * 6, dtype=torch.int64)
    comm.bookkeeping(comm.all_gather_single, records, record)
    records = records.view(world_size, 6)
    if not bool(records[:, 0].all()):
        failed = [r for r in range(world_size) if not records[r, 0]]
        raise CheckpointError(problem or f"{partial}: ranks {failed} could not write their files")
    if rank == 0:
        try:
            _finish(partial, final, step, records, info, keep_last)
        except OSError as error:
            problem = f"{final}: could not be completed ({error})"
    # Every rank returns once the checkpoint is complete: a job stopped after save() keeps it.
    if not _agree(problem is None):
        raise CheckpointError(problem or f"{final}: rank 0 could not complete the checkpoint")
    log0(f"checkpoint {final} | {int(records[:, 1].sum()) / 1e6:.1f} MB in {world_size} files | "
         f"{time.perf_counter() - started:.2f} s")
    return final


def _finish(partial: Path, final: Path, step: int, records: torch.Tensor, info: dict, keep_last: int) -> None:
    """Rank 0, once every rank file is in place: the manifest, then the rename that publishes
    the checkpoint, then the oldest ones beyond --keep-last removed."""
    world_size = records.shape[0]
    entries = _gather_entries(partial, world_size)
    files = [{"file": f"rank_{r:05d}.pt", "bytes": int(records[r, 1]),
              "sha256": records[r, 2:].numpy().tobytes().hex(), "entries": entries[r]} for r in range(world_size)]
    manifest = {"format": FORMAT, "version": VERSION, "step": step, "world_size": world_size,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"), **info, "files": files}
    manifest["checksum"] = _manifest_checksum(manifest)
    _write_atomically(partial / MANIFEST, lambda file: file.write(json.dumps(manifest, indent=1).encode()))
    _fsync_directory(partial)
    os.rename(partial, final)
    _fsync_directory(final.parent)
    prune(final.parent, keep_last)


def _manifest_checksum(manifest: dict) -> str:
    """sha256 of the manifest's contents but its own checksum: a flipped byte in a number (a
    setting, a file's size or sha256) would still parse, and must not pass."""
    body = {key: value for key, value in manifest.items() if key != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _gather_entries(partial: Path, world_size: int) -> list[list]:
    """Rank 0 reads each rank's entry list back from its file (the entries only: mmap, no tensors
    touched), so the manifest indexes every file without a collective of variable size."""
    return [torch.load(partial / f"rank_{r:05d}.pt", mmap=True, weights_only=True)["entries"]
            for r in range(world_size)]


def prune(save_dir, keep_last: int) -> None:
    """Delete all but the newest keep_last complete checkpoints (0: keep all). Each is renamed to
    .partial first, so that a crash half-way through a deletion leaves nothing that looks whole."""
    if keep_last <= 0:
        return
    complete = [path for _, path in list_checkpoints(save_dir) if (path / MANIFEST).exists()]
    for path in complete[:-keep_last]:
        doomed = path.with_name(path.name + PARTIAL)
        os.rename(path, doomed)
        shutil.rmtree(doomed)


# ----------------------------------------------------------------------------- reading and resharding


class _Reader:
    """The slices of one checkpoint, assembled into any box of any reference tensor on demand."""

    def __init__(self, manifest: dict):
        self.directory = Path(manifest["directory"])
        self.manifest = manifest
        self.files: dict[int, dict] = {}
        self.by_name: dict[str, list] = {}
        for index, record in enumerate(manifest["files"]):
            for position, (name, offsets, shape, lo, hi) in enumerate(record["entries"]):
                self.by_name.setdefault(name, []).append((tuple(offsets), tuple(shape), lo, hi, index, position))

    def file(self, index: int) -> dict:
        """A rank file, its sha256 checked against the manifest, then mapped (tensors read lazily)."""
        if index not in self.files:
            record = self.manifest["files"][index]
            path = self.directory / record["file"]
            if _sha256(path) != record["sha256"]:
                raise CheckpointError(f"{path}: contents differ from the manifest's sha256: a file from another "
                                      f"checkpoint, or damaged")
            payload = torch.load(path, mmap=True, weights_only=True)
            if payload.get("format") != FORMAT or payload.get("step") != self.manifest["step"]:
                raise CheckpointError(f"{path}: foreign: written for step {payload.get('step')}, the manifest is "
                                      f"step {self.manifest['step']}")
            self.files[index] = payload
        return self.files[index]

    def box(self, name: str, offsets, shape) -> tuple[dict[str, torch.Tensor], dict]:
        """The box offsets + shape of tensor `name`, assembled from every written slice that
        intersects it: {field: tensor} for each field all of them hold ("value", and AdamW's
        "exp_avg", "exp_avg_sq" once it has stepped), and the scalars stored with them ("step")."""
        writers: dict = {}
        for w_offsets, w_shape, lo, hi, index, position in self.by_name.get(name, []):
            if _intersection(w_offsets, w_shape, offsets, shape) is not None:
                writers.setdefault((w_offsets, w_shape), []).append((lo, hi, index, position))
        pieces = [(self.file(index), position) for group in writers.values() for _, _, index, position in group]
        common = set.intersection(*(set(payload["tensors"][position]) for payload, position in pieces)) \
            if pieces else {"value"}
        targets = {field: torch.empty(shape, dtype=torch.float32) for field in common}
        covered = torch.zeros(shape, dtype=torch.bool)
        scalars: dict = {}
        for (w_offsets, w_shape), group in writers.items():
            written = {field: torch.empty(math.prod(w_shape), dtype=torch.float32) for field in common}
            filled = torch.zeros(math.prod(w_shape), dtype=torch.bool)
            for lo, hi, index, position in group:
                payload = self.file(index)
                for field in common:
                    written[field][lo:hi] = payload["tensors"][position][field]
                filled[lo:hi] = True
                scalars.update(payload["scalars"][position])
            mine, theirs = _intersection(offsets, shape, w_offsets, w_shape)
            for field in common:
                targets[field][mine] = written[field].view(w_shape)[theirs]
            covered[mine] = filled.view(w_shape)[theirs]
        if not bool(covered.all()):
            raise CheckpointError(f"{self.directory}: {name} is not fully stored for the box {list(offsets)} + "
                                  f"{list(shape)}")
        return targets, scalars


def _intersection(a_offsets, a_shape, b_offsets, b_shape):
    """Where boxes a and b overlap, as (index into a, index into b), or None."""
    into_a, into_b = [], []
    for a0, a_len, b0, b_len in zip(a_offsets, a_shape, b_offsets, b_shape):
        lo, hi = max(a0, b0), min(a0 + a_len, b0 + b_len)
        if lo >= hi:
            return None
        into_a.append(slice(lo - a0, hi - a0))
        into_b.append(slice(lo - b0, hi - b0))
    return tuple(into_a), tuple(into_b)


def load(manifest: dict, slices: list[HeldSlice], optimizer) -> None:
    """Fill every slice this rank holds (and its optimizer states) from the checkpoint, whatever
    layout wrote it; restore this rank's RNG states when the world size is the same. Every rank
    calls this: one all-reduce makes all of them stop together if any finds a damaged file. The
    caller then rebuilds what derives from the slices (07: the weights from the master)."""
    reader = _Reader(manifest)
    problem, filled, rng = None, [], None
    try:
        for held in slices:
            boxes, scalars = reader.box(held.name, held.offsets, held.shape)
            filled.append(({field: box.reshape(-1)[held.lo: held.hi] for field, box in boxes.items()}, scalars))
        if manifest["world_size"] == dist.get_world_size():
            rng = reader.file(dist.get_rank())["rng"]
    except CheckpointError as error:
        problem = str(error)
    if not _agree(problem is None):
        # Every rank raises the same line (the lowest refusing rank's), so that the caller can
        # print it once, from rank 0, as for every other refusal.
        problems = [None] * dist.get_world_size()
        comm.bookkeeping(dist.all_gather_object, problems, problem)
        raise CheckpointError(next(found for found in problems if found))
    states = {}
    with torch.no_grad():
        for held, (values, scalars) in zip(slices, filled):
            held.tensor.copy_(values.pop("value").view_as(held.tensor))
            if values:
                states[id(held.tensor)] = {**values, **scalars}
    if optimizer is not None and states:
        _load_optimizer_states(optimizer, states)
    if rng is not None:
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])


def _load_optimizer_states(optimizer, states: dict[int, dict]) -> None:
    """Through optimizer.load_state_dict, which puts each state on its parameter's device and
    dtype the way the optimizer's own implementation (per-tensor, foreach or fused) expects."""
    state_dict = optimizer.state_dict()
    params = [param for group in optimizer.param_groups for param in group["params"]]
    state_dict["state"] = {index: {key: torch.tensor(value, dtype=torch.float32) if not torch.is_tensor(value)
                                   else value.view_as(param).clone() for key, value in states[id(param)].items()}
                           for index, param in enumerate(params) if id(param) in states}
    optimizer.load_state_dict(state_dict)


# ----------------------------------------------------------------------------- a training run that saves and resumes


def run_identity(args, shape) -> dict:
    """What a checkpoint's run and the resuming run must share for the data to continue where it
    stopped: TokenBatches reads step s's windows at [s G, (s+1) G) of a stream its seed orders, or
    under a batch-size ramp (lesson 07's --batch-ramp) where the tokens trained before it end."""
    return {"seed": args.seed, "seq_len": shape.seq_len, "sequences_per_step": shape.sequences_per_step,
            "batch_ramp": getattr(args, "batch_ramp", None)}


def run_settings(args, precision) -> dict:
    """What a resuming run may change, but is told about when it does (resume's notes): the
    learning-rate schedule (with a time budget's planned steps and wsd's decay: follow_time_budget),
    Muon's own settings under Muon (the optimizer itself is pinned: check_optimizer_kind),
    clipping, the dtypes the weights and gradients are held in, the data."""
    muon = ({"muon_lr": args.muon_lr, "muon_weight_decay": args.muon_weight_decay,
             "muon_momentum": args.muon_momentum, "muon_adjust_lr": args.muon_adjust_lr}
            if args.optimizer == "muon" else {})
    return {"lr": args.lr, "warmup_steps": args.warmup_steps, "steps": args.steps, **muon,
            "lr_schedule": args.lr_schedule, "decay_share": args.decay_share,
            "max_minutes": args.max_minutes, **time_budget_settings(args),
            "max_grad_norm": args.max_grad_norm, "bias_update_rate": args.bias_update_rate,
            "data": args.data or "the built-in corpus",
            "dtype": str(precision.param_dtype).removeprefix("torch."),
            "reduce_dtype": str(precision.reduce_dtype).removeprefix("torch.")}


def checkpoint_to_resume(args, cfg, shape) -> dict | None:
    """The manifest of --resume's checkpoint, checked against this run (None: start at step 0).
    Called before any process group: a bad checkpoint is one error line. Refuses too a run that
    would later overwrite a checkpoint in --save-dir, or has no step left to train."""
    manifest = None
    if args.resume is not None:
        directory = resolve(args.resume, args.save_dir)
        if directory is not None:
            manifest = read_manifest(directory, cfg, run_identity(args, shape))
            follow_time_budget(args, manifest.get("settings", {}))
    if manifest is not None:
        check_optimizer_kind(manifest, args.optimizer)
    start = manifest["step"] if manifest else 0
    if manifest and start >= args.steps:
        raise CheckpointError(f"{manifest['directory']}: already at step {start}, --steps {args.steps}: "
                              f"nothing left to train; raise --steps")
    saved = list_checkpoints(args.save_dir) if args.save_dir else []
    later = [path for step, path in saved if step > start]
    if later:
        raise CheckpointError(f"{later[-1]}: this run starts at step {start} and would overwrite it; "
                              f"resume from it (--resume), or choose another --save-dir")
    return manifest


def check_optimizer_kind(manifest: dict, optimizer: str) -> None:
    """A checkpoint resumes under the optimizer that wrote it: AdamW keeps two moments for every
    element, Muon one momentum for its matrices' (and AdamW's two for the rest), so the states of
    one are no start for the other. A manifest without the field was written before Muon existed,
    by AdamW."""
    written = manifest.get("optimizer", "adamw")
    if written != optimizer:
        raise CheckpointError(f"{manifest['directory']}: written with --optimizer {written}, this run has "
                              f"--optimizer {optimizer}: the optimizer states differ; resume with --optimizer "
                              f"{written}, or start afresh in another --save-dir")


def resume(args, manifest, model, optimizer, grid) -> int:
    """Load the checkpoint into this rank's slices, whatever layout wrote it, then every weight
    from the master (ZeRO's all-gathers); returns the step to continue from (0: no checkpoint).
    Says which of this run's settings (run_settings) and model fields differ from the writer's."""
    if manifest is None:
        if args.resume is not None:     # a restarted job's first start, say
            log0(f"--resume: no checkpoint in {args.save_dir if args.resume == 'latest' else args.resume} yet: "
                 f"starting from step 0")
        return 0
    try:
        load(manifest, reference_slices(model, grid), optimizer)
    except CheckpointError as error:     # a damaged file, found by whichever rank read it
        exit_with_error(error)
    model.publish_master()
    layout = ", ".join(f"{key} {value}" for key, value in manifest["layout"].items())
    log0(f"resumed from {manifest['directory']} at step {manifest['step']} (written with {layout})")
    for difference in unpinned_differences(manifest, run_settings(args, model.precision)):
        log0(f"note: {difference}: this run's applies from step {manifest['step']}")
    return manifest["step"]


def checkpoint_saver(args, cfg, shape, grid, model, optimizer, data: TokenBatches | None = None) -> AfterStep | None:
    """train()'s after_step: a checkpoint every --save-every steps and after the last, the run's
    or the one all ranks agreed to stop after on a scheduler's signal (None without --save-dir).
    Under a batch-size ramp (`data`'s) it records the global tokens of every step trained
    ("ramp_history": BatchRamp.realised_history), where a resumed run's ramp continues."""
    if args.save_dir is None:
        return None
    try:
        check_shared(args.save_dir)     # every node sees it; writable was checked in check_flags
    except CheckpointError as error:
        exit_with_error(error)
    slices = reference_slices(model, grid)
    info = {"model": asdict(cfg), "run": run_identity(args, shape), "optimizer": args.optimizer,
            "layout": {"dp": grid.dp_size, "pp": grid.pp_size, "cp": grid.cp_size, "tp": grid.tp_size,
                       "ep": grid.ep_size, "zero_stage": args.zero_stage, "virtual_stages": args.virtual_stages}}

    def due(step: int, last: bool) -> bool:
        return last or bool(args.save_every and (step + 1) % args.save_every == 0)

    def save_step(step: int, last: bool) -> None:
        info["settings"] = run_settings(args, model.precision)     # a time budget plans its steps late
        if data is not None and data.ramp is not None:
            info["ramp_history"] = data.ramp.realised_history(step + 1)
        model.wait_for_weights()    # the weights' all-gathers a ZeRO step leaves running read the float32 master
        save(args.save_dir, step + 1, slices, optimizer, info, args.keep_last)

    return AfterStep(due, save_step)


# ----------------------------------------------------------------------------- export and inspect


def assemble(checkpoint) -> tuple[dict, dict[str, torch.Tensor]]:
    """(manifest, state dict of the reference GPT: float32 master weights, buffers) of a checkpoint,
    whatever layout wrote it. `checkpoint`: a step directory, or a save directory (its newest)."""
    manifest = read_manifest(resolve(str(checkpoint), None))
    reader = _Reader(manifest)
    state = {}
    for name, shape in reference_shapes(manifest["cfg"]).items():
        state[name] = reader.box(name, (0,) * len(shape), shape)[0]["value"]
    return manifest, state


def export(checkpoint, out, out_format: str = "pt") -> dict[str, torch.Tensor]:
    """The checkpoint as one state dict of the reference GPT, written atomically to the file `out`
    (out_format "pt"), or as a Hugging Face model folder `out` ("hf": picotron_like.hf)."""
    manifest, state = assemble(checkpoint)
    if out_format == "hf":
        from picotron_like import hf        # the hf extra: only this format needs safetensors

        hf.save(state, manifest["cfg"], out)
    else:
        _write_atomically(Path(out), lambda file: torch.save(state, file))
    return state


def describe(manifest: dict) -> str:
    files = manifest["files"]
    lines = [f"{manifest['directory']}: step {manifest['step']}, written {manifest.get('saved_at', '?')} by "
             f"{manifest['world_size']} ranks",
             "layout: " + ", ".join(f"{k} {v}" for k, v in manifest.get("layout", {}).items()),
             f"optimizer: {manifest.get('optimizer', 'adamw')}",
             "run: " + ", ".join(f"{k} {v}" for k, v in manifest.get("run", {}).items()),
             "settings: " + ", ".join(f"{k} {v}" for k, v in manifest.get("settings", {}).items()),
             "model: " + ", ".join(f"{k} {v}" for k, v in asdict(manifest["cfg"]).items()),
             f"files: {len(files)}, {sum(f['bytes'] for f in files) / 1e6:.1f} MB, "
             f"{sum(len(f['entries']) for f in files)} slices of {len(reference_shapes(manifest['cfg']))} tensors"]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m picotron_like.checkpoint",
                                     description="Inspect a checkpoint, or export it as one GPT state dict or a "
                                                 "Hugging Face model folder.")
    commands = parser.add_subparsers(dest="command", required=True)
    inspect = commands.add_parser("inspect", help="check a checkpoint and print what it holds")
    inspect.add_argument("checkpoint", help="a step directory, or a save directory (its newest checkpoint)")
    export_parser = commands.add_parser("export", help="write a state dict that picotron_like.model.GPT loads, or "
                                                       "a Hugging Face model folder")
    export_parser.add_argument("--format", choices=("pt", "hf"), default="pt",
                               help="pt: one torch.save state dict of the reference GPT; hf: a folder of config.json "
                                    "and model.safetensors (LlamaForCausalLM, or MixtralForCausalLM with experts; "
                                    "float32; needs the hf extra)")
    export_parser.add_argument("checkpoint", help="a step directory, or a save directory (its newest checkpoint)")
    export_parser.add_argument("out", help="the .pt file to write (--format pt) or the folder (--format hf)")
    args = parser.parse_args(argv)
    try:
        if args.command == "inspect":
            print(describe(read_manifest(resolve(args.checkpoint, None))))
        else:
            state = export(args.checkpoint, args.out, args.format)
            print(f"wrote {args.out}: {len(state)} tensors, "
                  f"{sum(t.numel() for t in state.values()):,} values (float32)")
    except (CheckpointError, ConfigError) as error:     # ConfigError: what the hf format cannot express
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    except OSError as error:
        print(f"error: {error.filename}: {error.strerror}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
