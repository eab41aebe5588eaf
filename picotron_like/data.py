"""
Tokens in: token shards on disk, a tokenizer, a built-in corpus, and the batches each rank trains on.

Every lesson trains on the same stream of tokens, and every test compares a distributed run with
a single-device run on the same data. So this module has one job beyond reading files: the batch
of a training step must be a pure function of (files, seq_len, global batch size, seed, step),
whatever the data-parallel degree and however the batch is cut into micro-batches.

The shard format is the one llm.c and the nanoGPT speedrun use, so their FineWeb shards work here
as they are:

    bytes 0 .. 1023     256 little-endian int32: [0] magic 20240520, [1] version 1, [2] n_tokens
    bytes 1024 ..       n_tokens little-endian uint16 token ids (GPT-2 and smaller vocabularies),
                        or with magic 20240801, version 7: uint32 ids (llm.c's Llama 3 layout)

A shard is read through np.memmap: the operating system pages tokens in as windows are sliced, so
a 100 GB dataset costs no RAM beyond the windows of the current step.

Windows. Each shard is cut into windows of seq_len+1 tokens at a stride of seq_len. The extra
token is the target of the last input; the stride makes the last token of one window the first of
the next, so every token of the text is predicted exactly once per epoch:

    shard:     t0 t1 t2 ... tS tS+1 ... t2S ...
    window 0: [t0 ........... tS]
    window 1:                [tS ........... t2S]
    inputs = window[:-1]    targets = window[1:]

Order. All windows of all shards form one index 0..W-1. Epoch e visits them in the order of a
permutation drawn from np.random.default_rng([seed, e]); epochs are laid end to end into one
stream, and step s takes the G = sequences_per_step windows at stream positions [s*G, (s+1)*G).
A step near the end of an epoch simply continues into the next one:

    stream:  | epoch 0: perm_0 of W windows  | epoch 1: perm_1 of W windows  | ...
             | step 0 | step 1 | ... | step k  |   (step k straddles the boundary)

Slices. The global batch of a step is split rank-major: data-parallel rank r owns the contiguous
rows [r*M*A, (r+1)*M*A), cut in order into A micro-batches of M rows (M = micro_batch_size,
A = grad_accum):

    global batch of step s (G = dp*A*M rows of seq_len+1 tokens)
    +-------------------------------+-------------------------------+-----+
    |          dp rank 0            |          dp rank 1            | ... |
    | mb 0 | mb 1 | ... | mb A-1    | mb 0 | mb 1 | ... | mb A-1    |     |
    +-------------------------------+-------------------------------+-----+
      M rows each

Because the rows come from the stream and only the cut depends on dp and A, a run with dp=4 and
grad_accum=1 sees exactly the batch of a dp=1 run with grad_accum=4.

A batch-size ramp (BatchRamp, lesson 07's --batch-ramp) changes A from step to step, nothing else:
step s then starts at the stream position of the sequences trained before it, not at s*G.

The built-in corpus needs no network: the Python language reference ships inside Python itself
(pydoc_data.topics), ~460 KB of English prose, enough for a small model's loss to fall visibly.
Larger runs use `python -m picotron_like.data prepare` on a text file, or llm.c shards.
"""

import argparse
import contextlib
import copy
import glob
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
# llm.c's layout for Llama 3 tokenizers (128,256 ids do not fit uint16): the same header with
# another magic and version, then uint32 tokens.
LLAMA3_SHARD_MAGIC = 20240801
LLAMA3_SHARD_VERSION = 7
# (magic, version) -> the token body's little-endian dtype, and the tokenizers each is for
SHARD_LAYOUTS = {(SHARD_MAGIC, SHARD_VERSION): ("<u2", "GPT-2 sized vocabularies, ids < 65536"),
                 (LLAMA3_SHARD_MAGIC, LLAMA3_SHARD_VERSION): ("<u4", "Llama 3 sized vocabularies")}

PREPARE_HINT = "make one with: python -m picotron_like.data prepare INPUT.txt OUT.bin"
IDS_CHECKED_AT_START = 2**20    # tokens at the start of each shard checked before training (2 MB)


class DataError(ValueError):
    """A token file or a batch configuration that cannot work; the message says how to fix it."""


# ----------------------------------------------------------------------------- the shard format


class ShardWriter:
    """An llm.c shard written as tokens come (a corpus need not fit in memory): the body is
    appended, and the header, which holds the token count, is written when the writer closes.
    Atomic: the file is written beside its path and renamed there at the end (os.replace, atomic
    within one file system), so a rank that opens the path never sees a half-written shard.
    `wide`: uint32 tokens (llm.c's Llama 3 layout) instead of uint16."""

    def __init__(self, path, wide: bool = False):
        self.path, self.n_tokens = Path(path), 0
        self.magic, self.version = (LLAMA3_SHARD_MAGIC, LLAMA3_SHARD_VERSION) if wide else (SHARD_MAGIC, SHARD_VERSION)
        self.dtype = np.dtype(SHARD_LAYOUTS[self.magic, self.version][0])
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self.temp_name = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        self.file = os.fdopen(fd, "wb")
        self.file.write(bytes(HEADER_BYTES))

    def write(self, tokens) -> None:
        tokens = np.asarray(tokens)
        if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
            raise DataError(f"{self.path}: token ids must be integers, got dtype {tokens.dtype}")
        limit = np.iinfo(self.dtype).max + 1
        if tokens.size and (tokens.min() < 0 or tokens.max() >= limit):
            bad = tokens.min() if tokens.min() < 0 else tokens.max()
            raise DataError(f"{self.path}: token id {bad} does not fit the shard's {self.dtype.name} body "
                            f"(0 <= id < {limit})")
        if self.n_tokens + tokens.size >= 2**31:
            raise DataError(f"{self.path}: more than 2**31 - 1 tokens overflow the int32 count; split them into "
                            f"shards")
        self.file.write(tokens.astype(self.dtype.str).tobytes())
        self.n_tokens += tokens.size

    def __enter__(self):
        return self

    def __exit__(self, error_type, *exc):
        try:
            if error_type is None:
                header = np.zeros(HEADER_INTS, dtype="<i4")
                header[:3] = self.magic, self.version, self.n_tokens
                self.file.seek(0)
                self.file.write(header.tobytes())
            self.file.close()
            if error_type is None:
                os.replace(self.temp_name, self.path)
        finally:
            if os.path.exists(self.temp_name):
                os.unlink(self.temp_name)
        return False


def write_token_shard(path, tokens) -> None:
    """Write token ids as an llm.c shard: uint16 when every id fits (llm.c's GPT-2 layout), else
    uint32 (its Llama 3 layout)."""
    tokens = np.asarray(tokens)
    wide = bool(tokens.size) and np.issubdtype(tokens.dtype, np.integer) and tokens.max() >= 2**16
    with ShardWriter(path, wide) as writer:
        writer.write(tokens)


def read_token_shard(path) -> np.memmap:
    """The token body of an llm.c shard, uint16 or uint32 as its header says, as a read-only
    memmap, after checking the header against the file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such token shard; {PREPARE_HINT}")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise DataError(
            f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte shard header; "
            f"the file is empty or cut off, {PREPARE_HINT}"
        )
    magic, version, n_tokens = (int(value) for value in np.fromfile(path, dtype="<i4", count=3))
    version_of = {magic: version for magic, version in SHARD_LAYOUTS}     # each magic has one version
    if magic not in version_of:
        raise DataError(f"{path}: header magic is {magic}, expected {SHARD_MAGIC} (uint16 tokens) or "
                        f"{LLAMA3_SHARD_MAGIC} (uint32, Llama 3): not an llm.c token shard; {PREPARE_HINT}")
    if version != version_of[magic]:
        raise DataError(f"{path}: shard version {version} with magic {magic} is not supported: that magic's "
                        f"layout is version {version_of[magic]} ({SHARD_LAYOUTS[magic, version_of[magic]][1]}); "
                        f"{PREPARE_HINT}")
    dtype = np.dtype(SHARD_LAYOUTS[magic, version][0])
    expected = HEADER_BYTES + dtype.itemsize * n_tokens
    if size != expected:
        raise DataError(
            f"{path}: header promises {n_tokens} tokens = {expected} bytes, the file has {size} bytes; "
            f"the shard is truncated or corrupt, write it again"
        )
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(n_tokens,))


# ----------------------------------------------------------------------------- tokenizer and corpus


class ByteTokenizer:
    """One token per UTF-8 byte: no vocabulary file to download, and every text is encodable."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        # A sampled sequence can end in the middle of a multi-byte character; replace, don't fail.
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class TextTokenizer:
    """What `prepare` needs of a tokenizer: text to ids, the vocabulary size (which decides the
    shard's layout), and the id that starts every document (None: documents just follow each
    other); and ids back to text, for the samples (picotron_like.sample). `name` is what
    --tokenizer said, recorded beside the shards."""

    name: str
    encode: object          # str -> list[int]
    vocab_size: int
    delimiter: int | None
    decode: object          # list[int] -> str


# The special tokens that start a document, in the order they are looked for in a tokenizer.json:
# Llama 3's begin-of-text, GPT-2's end-of-text (llm.c puts it before every document), SentencePiece's.
DOCUMENT_DELIMITERS = ("<|begin_of_text|>", "<|endoftext|>", "<s>")


def load_tokenizer(name: str) -> TextTokenizer:
    """--tokenizer: "byte" (no file, 256 ids), "gpt2" (tiktoken's GPT-2 BPE, 50,257 ids; tiktoken
    fetches its table once and caches it), or the path of a Hugging Face tokenizer.json, read by
    the `tokenizers` package (Llama 3's ships as one: 128,256 ids, uint32 shards). The packages are
    optional: only this command needs them."""
    if name == "byte":
        return TextTokenizer("byte", ByteTokenizer().encode, ByteTokenizer.vocab_size, None, ByteTokenizer().decode)
    try:
        if name == "gpt2":
            import tiktoken
            encoding = tiktoken.get_encoding("gpt2")
            return TextTokenizer("gpt2", encoding.encode_ordinary, encoding.n_vocab, encoding.eot_token,
                                 encoding.decode)
        from tokenizers import Tokenizer
        tokenizer = Tokenizer.from_file(name)
    except ImportError as error:
        raise DataError(f"--tokenizer {name} needs the {error.name} package: pip install {error.name} "
                        f"(or the test extra: pip install -e '.[test]')") from None
    except Exception as error:      # a file that is not a tokenizer, or tiktoken without its table
        raise DataError(f"--tokenizer {name}: cannot load it ({error}); give byte, gpt2 or the path of a "
                        f"Hugging Face tokenizer.json") from None
    delimiter = next((tokenizer.token_to_id(token) for token in DOCUMENT_DELIMITERS
                      if tokenizer.token_to_id(token) is not None), None)
    return TextTokenizer(name, lambda text: tokenizer.encode(text, add_special_tokens=False).ids,
                         tokenizer.get_vocab_size(with_added_tokens=True), delimiter, tokenizer.decode)


def documents(paths, text_field: str = "text", piece_chars: int = 1 << 20):
    """(starts a document, text) pieces of the inputs, never a whole file in memory: a JSONL file
    is one document per line (its `text_field`), any other file one document, read in pieces of
    about `piece_chars` characters cut after a newline (so no word is cut)."""
    for path in paths:
        with open(path, encoding="utf-8") as file:
            if str(path).endswith(".jsonl"):
                for number, line in enumerate(file, start=1):
                    if line.strip():
                        try:
                            yield True, json.loads(line)[text_field]
                        except (json.JSONDecodeError, KeyError, TypeError) as error:
                            raise DataError(f"{path}:{number}: not a JSON object with a {text_field!r} "
                                            f"field ({error!r})") from None
                continue
            first = True
            while piece := file.read(piece_chars):
                piece += file.readline()
                yield first, piece
                first = False


def prepare(paths, output, tokenizer: TextTokenizer, val_output=None, val_tokens: int = 0,
            text_field: str = "text") -> dict[str, int]:
    """Tokenize the input files into a train shard at `output` and, with `val_output`, a
    validation shard of the first whole documents holding at least `val_tokens` tokens (so the two
    share no document). Every document starts with the tokenizer's delimiter, if it has one. The
    tokenizer is recorded beside the train shard (OUTPUT.tokenizer.json). Returns the token counts."""
    wide = tokenizer.vocab_size > 2**16
    sizes = sum(os.path.getsize(path) for path in paths)
    try:
        from tqdm import tqdm
        progress = tqdm(total=sizes, unit="B", unit_scale=True, desc="tokenizing", file=sys.stderr)
    except ImportError:
        progress = None
    with ShardWriter(output, wide) as train, \
            (ShardWriter(val_output, wide) if val_output else contextlib.nullcontext()) as val, \
            (progress if progress is not None else contextlib.nullcontext()):
        writer = val if val_output and val_tokens > 0 else train
        for starts, text in documents(paths, text_field):
            if starts and writer is val and val.n_tokens >= val_tokens:
                writer = train          # the validation shard is full: from this document on, train
            ids = ([tokenizer.delimiter] if starts and tokenizer.delimiter is not None else []) + tokenizer.encode(text)
            writer.write(np.asarray(ids, dtype=np.int64))
            if progress is not None:
                progress.update(len(text.encode("utf-8")))
        counts = {"train": train.n_tokens, "val": val.n_tokens if val_output else 0}
    record = {"tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "delimiter": tokenizer.delimiter}
    Path(f"{output}.tokenizer.json").write_text(json.dumps(record, indent=1) + "\n")
    return counts


def builtin_corpus_paths(cache_dir=None) -> tuple[Path, Path]:
    """(train, val) shards of the Python language reference, written on first use and then reused.

    The cache directory is `cache_dir`, else $PICOTRON_DATA_DIR, else `data/` in the repository.
    """
    from pydoc_data.topics import topics

    if cache_dir is None:
        repo_root = Path(__file__).resolve().parent.parent
        cache_dir = os.environ.get("PICOTRON_DATA_DIR") or repo_root / "data"
    # The reference text changes between Python releases, so each release gets its own files.
    stem = Path(cache_dir) / f"builtin_py{sys.version_info.major}{sys.version_info.minor}"
    train_path, val_path = Path(f"{stem}_train.bin"), Path(f"{stem}_val.bin")
    try:
        for path in (train_path, val_path):
            read_token_shard(path)
        return train_path, val_path
    except DataError:
        pass  # absent or damaged: (re)write both below
    # Sorted keys make the text, and so every batch drawn from it, the same on every run.
    text = "\n\n".join(topics[key] for key in sorted(topics))
    tokens = np.array(ByteTokenizer().encode(text), dtype=np.uint16)
    split = int(0.9 * len(tokens))
    # Ranks starting together may all get here; each writes identical bytes atomically.
    write_token_shard(train_path, tokens[:split])
    write_token_shard(val_path, tokens[split:])
    return train_path, val_path


# ----------------------------------------------------------------------------- batches


@dataclass(frozen=True)
class BatchShape:
    """How a step's batch is cut: global batch tokens = micro_batch_size * seq_len * grad_accum * dp."""

    micro_batch_size: int  # sequences per micro-batch per data-parallel rank
    seq_len: int
    grad_accum: int  # micro-batches per optimizer step per rank
    dp: int  # data-parallel degree

    def __post_init__(self):
        for name in ("micro_batch_size", "seq_len", "grad_accum", "dp"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise DataError(f"BatchShape.{name} must be a positive integer, got {value!r}")

    @property
    def sequences_per_step(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.dp

    @property
    def tokens_per_step(self) -> int:
        return self.sequences_per_step * self.seq_len

    @classmethod
    def from_global_batch_tokens(cls, global_batch_tokens, micro_batch_size, seq_len, dp) -> "BatchShape":
        """Derive grad_accum, the one free factor, from a batch size given in tokens."""
        tokens_per_micro_step = micro_batch_size * seq_len * dp
        if global_batch_tokens < tokens_per_micro_step or global_batch_tokens % tokens_per_micro_step:
            grad_accum = max(1, round(global_batch_tokens / tokens_per_micro_step))
            raise DataError(
                f"global batch of {global_batch_tokens} tokens is not a whole number of micro-steps "
                f"of micro_batch_size*seq_len*dp = {micro_batch_size}*{seq_len}*{dp} = "
                f"{tokens_per_micro_step} tokens; use {grad_accum * tokens_per_micro_step} tokens "
                f"(grad_accum {grad_accum})"
            )
        return cls(micro_batch_size, seq_len, global_batch_tokens // tokens_per_micro_step, dp)


class BatchRamp:
    """A global batch that grows with the tokens trained (lesson 07's --batch-ramp): the first step
    trains about `start_tokens`, and the batch grows linearly in the tokens trained until, after
    `ramp_tokens`, it is the full one (DeepSeek-V3 grew its batch so over its first 469 B tokens;
    Megatron-LM's --rampup-batch-size grows it in samples).

    It is realised by the number of micro-batches per step and rank, so every tensor keeps its
    shape: a step's count is the target rounded up to `multiple` (a pipeline's rule: a multiple of
    pp for the interleaved schedule), at least `min_micro_batches` (pp under a pipeline) and at most
    the full batch's `full_micro_batches`; `micro_step_tokens` is one micro-batch on every dp rank.

    A step's size depends on the tokens trained before it, so the ramp is walked from the first
    step: `history` holds the global tokens of the steps a checkpoint's run trained, run-length
    encoded ((tokens, steps), ...), so that a run resumed in another layout (another
    micro_step_tokens) continues from the same stream position and the same tokens trained
    (realised_history writes it)."""

    def __init__(self, start_tokens: int, ramp_tokens: int, full_micro_batches: int, micro_step_tokens: int,
                 min_micro_batches: int = 1, multiple: int = 1, history: tuple = ()):
        self.start_tokens, self.ramp_tokens = start_tokens, ramp_tokens
        self.full_micro_batches, self.micro_step_tokens = full_micro_batches, micro_step_tokens
        self.min_micro_batches, self.multiple = min_micro_batches, multiple
        self.full_tokens = full_micro_batches * micro_step_tokens
        self.history = tuple((int(tokens), int(steps)) for tokens, steps in history)
        # the global tokens of each step until the first full one, walked on demand; then every step is full
        self.sizes = [tokens for tokens, steps in self.history for _ in range(steps)]
        self.before = [0]
        for size in self.sizes:
            self.before.append(self.before[-1] + size)

    def micro_batches_for(self, tokens_trained: int) -> int:
        """Micro-batches per rank of a step after `tokens_trained`: the linear target, rounded up."""
        if tokens_trained >= self.ramp_tokens:
            return self.full_micro_batches
        # target = start + (full - start) * trained / ramp, in integers: ceil(target / micro_step_tokens)
        numerator = self.start_tokens * self.ramp_tokens + (self.full_tokens - self.start_tokens) * tokens_trained
        count = -(-numerator // (self.ramp_tokens * self.micro_step_tokens))
        count = -(-count // self.multiple) * self.multiple
        return min(self.full_micro_batches, max(self.min_micro_batches, count))

    def _walk_to(self, step: int) -> None:
        while len(self.sizes) <= step and (not self.sizes or self.sizes[-1] != self.full_tokens):
            self.sizes.append(self.micro_batches_for(self.before[-1]) * self.micro_step_tokens)
            self.before.append(self.before[-1] + self.sizes[-1])

    def step_tokens(self, step: int) -> int:
        """The global tokens of step `step`."""
        self._walk_to(step)
        return self.sizes[step] if step < len(self.sizes) else self.full_tokens

    def tokens_before(self, step: int) -> int:
        """The tokens trained before step `step`."""
        self._walk_to(step)
        if step < len(self.before):
            return self.before[step]
        return self.before[-1] + (step - len(self.sizes)) * self.full_tokens

    def full_from(self) -> int:
        """The first step from which every step is full (the ramp's end)."""
        self._walk_to(2**62)
        return len(self.sizes) - 1

    def realised_history(self, steps: int) -> list[list[int]]:
        """The global tokens of steps [0, steps), run-length encoded: what a checkpoint records."""
        runs = []
        for step in range(steps):
            tokens = self.step_tokens(step)
            if runs and runs[-1][0] == tokens:
                runs[-1][1] += 1
            else:
                runs.append([tokens, 1])
        return runs


@dataclass
class StepBatch:
    """What one rank trains on in one optimizer step.

    micro_batches: this rank's micro-batches, each a tuple of model arguments: (inputs, targets),
        or (inputs, targets, positions) once context parallelism hands a rank part of a sequence.
    n_targets: the targets that count (not IGNORE_INDEX) in the *global* batch, over every rank and
        micro-batch. Every distributed step divides its summed loss by this number, so the loss is
        the reference's mean over the whole batch however the batch is cut, even when ranks hold
        different numbers of ignored targets. It is known from the data before the forward pass,
        so finding it costs no collective.
    """

    micro_batches: list
    n_targets: int


def _expand_paths(paths) -> list[Path]:
    """Files in the order given; a string with *, ? or [ is a glob pattern, expanded sorted."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files = []
    for entry in paths:
        if isinstance(entry, str) and any(c in entry for c in "*?["):
            matches = sorted(glob.glob(entry))
            if not matches:
                raise DataError(f"no token shard matches the pattern {entry!r}; {PREPARE_HINT}")
            files.extend(Path(m) for m in matches)
        else:
            files.append(Path(entry))
    if not files:
        raise DataError(f"no token shards given; {PREPARE_HINT}")
    return files


class TokenBatches:
    """Deterministic batches of windows over token shards: see the module docstring for the layout."""

    def __init__(self, paths, shape: BatchShape, seed: int, vocab_size: int | None = None,
                 ramp: BatchRamp | None = None):
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise DataError(f"seed must be a non-negative integer (numpy's seeding rule), got {seed!r}")
        self.paths = _expand_paths(paths)
        self.shape, self.ramp = shape, ramp
        self.seed = int(seed)
        self.shards = [read_token_shard(path) for path in self.paths]
        # Token ids are checked against the model's vocabulary where they are read, not by reading
        # every shard in full at start-up (every rank of a node would read the whole dataset before
        # its first step): here, the start of each shard, which catches shards of the wrong
        # tokenizer before any process group exists; then every window as a step reads it.
        self.vocab_size = vocab_size
        if vocab_size is not None:
            for path, shard in zip(self.paths, self.shards):
                self._check_ids(shard[:IDS_CHECKED_AT_START], path)
        # The index is the cumulative window count per shard, not a table of (shard, offset) pairs:
        # a binary search turns a window id into both, at a cost of one integer per shard.
        windows_per_shard = np.array([max(0, (s.size - 1) // shape.seq_len) for s in self.shards])
        self._first_window = np.concatenate([[0], np.cumsum(windows_per_shard)[:-1]])
        self.n_tokens = sum(s.size for s in self.shards)
        self.n_windows = int(windows_per_shard.sum())
        if self.n_windows < shape.sequences_per_step:
            raise DataError(
                f"shard(s) hold {self.n_tokens} tokens = {self.n_windows} windows of seq_len+1 = "
                f"{shape.seq_len + 1} tokens, fewer than one global batch of {shape.sequences_per_step} "
                f"sequences; use a smaller batch or more data"
            )
        self._epoch_orders: dict[int, np.ndarray] = {}

    def _epoch_order(self, epoch: int) -> np.ndarray:
        order = self._epoch_orders.get(epoch)
        if order is None:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            # A step spans at most two epochs (G <= W), so two cached orders serve every step of a
            # run without drawing a permutation of millions of windows per step.
            if len(self._epoch_orders) == 2:
                del self._epoch_orders[min(self._epoch_orders)]
            self._epoch_orders[epoch] = order
        return order

    def _read_stream(self, start: int, count: int) -> torch.Tensor:
        """Windows at stream positions [start, start+count), as int64 rows of seq_len+1 tokens."""
        positions = np.arange(start, start + count)
        epochs = positions // self.n_windows
        window_ids = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            in_epoch = epochs == epoch
            window_ids[in_epoch] = self._epoch_order(int(epoch))[positions[in_epoch] % self.n_windows]
        # side="right" skips shards too short to hold a window: they share their start with the next.
        shard_ids = np.searchsorted(self._first_window, window_ids, side="right") - 1
        offsets = (window_ids - self._first_window[shard_ids]) * self.shape.seq_len
        rows = np.empty((count, self.shape.seq_len + 1), dtype=np.int64)
        for row, shard_id, offset in zip(rows, shard_ids, offsets):
            row[:] = self.shards[shard_id][offset : offset + self.shape.seq_len + 1]
        if self.vocab_size is not None and rows.size and rows.max() >= self.vocab_size:
            bad = int(np.argmax(rows.max(axis=1) >= self.vocab_size))
            self._check_ids(rows[bad], self.paths[shard_ids[bad]], where=f" (the window at token {offsets[bad]})")
        return torch.from_numpy(rows)

    def _check_ids(self, tokens: np.ndarray, path: Path, where: str = "") -> None:
        max_id = int(tokens.max()) if tokens.size else -1
        if max_id >= self.vocab_size:
            raise DataError(
                f"{path}{where}: token id {max_id} >= the model's vocab_size {self.vocab_size}, so the "
                f"embedding cannot look it up; use a model config with vocab_size >= {max_id + 1} "
                f"(GPT-2 token shards need 50257, or 50304 padded) or shards of a smaller tokenizer"
            )

    def with_ramp(self, ramp: BatchRamp | None) -> "TokenBatches":
        """These batches, their steps sized by `ramp` (None: the shape's, as they are)."""
        if ramp is None:
            return self
        ramped = copy.copy(self)
        ramped.ramp = ramp
        return ramped

    def grad_accum_at(self, step: int) -> int:
        """Micro-batches per rank of step `step`: the shape's, or the ramp's."""
        return self.shape.grad_accum if self.ramp is None else self.step_tokens(step) // self.ramp.micro_step_tokens

    def step_tokens(self, step: int) -> int:
        """The global batch's tokens of step `step`."""
        return self.shape.tokens_per_step if self.ramp is None else self.ramp.step_tokens(step)

    def tokens_before(self, step: int) -> int:
        """The tokens trained before step `step` (the learning rate's progress counts them)."""
        return step * self.shape.tokens_per_step if self.ramp is None else self.ramp.tokens_before(step)

    def full_from(self) -> int:
        """The first step from which every step trains the full batch (0 without a ramp)."""
        return 0 if self.ramp is None else self.ramp.full_from()

    def epoch_at(self, step: int) -> int:
        """The pass over the data that step `step` starts in (0: the first). The stream wraps: a run
        longer than the data sees it again, in a new order, and the loop says so when it does."""
        return self.tokens_before(step) // self.shape.seq_len // self.n_windows

    def global_batch(self, step: int) -> torch.Tensor:
        """All windows of a step, [its sequences, seq_len+1]: what one device would train on."""
        if step < 0:
            raise DataError(f"step must be >= 0, got {step}")
        return self._read_stream(self.tokens_before(step) // self.shape.seq_len,
                                 self.step_tokens(step) // self.shape.seq_len)

    def step_batch(self, step: int, dp_rank: int) -> "StepBatch":
        """This rank's micro-batches of a step, with the number of targets of the whole global batch.

        A shard holds unsigned token ids, never IGNORE_INDEX, so every target of these batches counts:
        the global count is known from the batch shape alone, without reading the other ranks' rows.
        (Masked batches, as fine-tuning brings, carry their own count: see testing.masked_step_batch.)
        """
        return StepBatch(self.micro_batches(step, dp_rank), self.step_tokens(step))

    def micro_batches(self, step: int, dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's grad_accum (inputs, targets) pairs (the ramp's count of them at this step),
        each [micro_batch_size, seq_len]."""
        M, dp = self.shape.micro_batch_size, self.shape.dp
        if not 0 <= dp_rank < dp:
            raise DataError(f"dp_rank {dp_rank} is outside 0..{dp - 1} for dp = {dp}")
        if step < 0:
            raise DataError(f"step must be >= 0, got {step}")
        A = self.grad_accum_at(step)
        # Read only this rank's rows of the global batch, not all of it.
        windows = self._read_stream(self.tokens_before(step) // self.shape.seq_len + dp_rank * M * A, M * A)
        micro = [windows[a * M : (a + 1) * M] for a in range(A)]
        # contiguous(): the shifted slices are strided views; a loss that .view()s them would fail.
        return [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in micro]


# ----------------------------------------------------------------------------- command line


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m picotron_like.data",
        description="Make token shards in llm.c's layouts (a 256-int32 header, then uint16 tokens, or "
                    "uint32 for vocabularies beyond 65,536 ids).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    prepare_parser = commands.add_parser("prepare", help="tokenize UTF-8 text or JSONL files into token shards")
    prepare_parser.add_argument("inputs", nargs="+", metavar="INPUT",
                                help="UTF-8 text files (one document each) or .jsonl files (one document per line)")
    prepare_parser.add_argument("output", help="train shard to write, e.g. data/mytext_train.bin")
    prepare_parser.add_argument("--tokenizer", default="byte",
                                help="byte (256 ids), gpt2 (tiktoken) or the path of a Hugging Face tokenizer.json")
    prepare_parser.add_argument("--val", dest="val_output", metavar="PATH",
                                help="also write a validation shard here, of the first documents")
    prepare_parser.add_argument("--val-tokens", type=int, default=100_000,
                                help="with --val: whole documents until the validation shard holds this many tokens")
    prepare_parser.add_argument("--text-field", default="text", help="the JSONL field holding a document's text")
    builtin = commands.add_parser("builtin", help="write (or reuse) the built-in corpus, print its paths")
    builtin.add_argument("--data-dir", help="default: $PICOTRON_DATA_DIR, else data/ in the repository")
    args = parser.parse_args(argv)

    if args.command == "prepare":
        try:
            counts = prepare(args.inputs, args.output, load_tokenizer(args.tokenizer), args.val_output,
                             args.val_tokens, args.text_field)
        except (OSError, UnicodeDecodeError, DataError) as error:
            print(f"error: {error}", file=sys.stderr)
            raise SystemExit(2) from None
        print(f"wrote {counts['train']} tokens to {args.output}"
              + (f" and {counts['val']} to {args.val_output}" if args.val_output else "")
              + f" ({args.tokenizer} tokenizer, recorded in {args.output}.tokenizer.json)")
    else:
        for split, path in zip(("train", "val"), builtin_corpus_paths(args.data_dir)):
            print(f"{split}: {path} ({read_token_shard(path).size} tokens)")


if __name__ == "__main__":
    main()
