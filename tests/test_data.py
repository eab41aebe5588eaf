"""Tests of picotron_like.data: the shard format, its error messages, and the batch layout per rank.

Most shards here hold the tokens 0, 1, 2, ...: a window is then identified by its first token,
which makes "every window exactly once" and "these rows came from that rank" easy to check.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import picotron_like.data as data_module
from picotron_like.data import (
    HEADER_INTS,
    SHARD_MAGIC,
    SHARD_VERSION,
    BatchShape,
    ByteTokenizer,
    DataError,
    TokenBatches,
    builtin_corpus_paths,
    main,
    read_token_shard,
    write_token_shard,
)

REPO_ROOT = Path(__file__).resolve().parent.parent


def counting_shard(directory, name, n_tokens, first=0):
    path = directory / name
    write_token_shard(path, np.arange(first, first + n_tokens))
    return path


def whole_windows(micro_batches):
    """Rebuild the seq_len+1 windows from (inputs, targets) pairs, in order."""
    return torch.cat([torch.cat([inputs, targets[:, -1:]], dim=1) for inputs, targets in micro_batches])


# ----------------------------------------------------------------------------- the shard format


def test_shard_round_trip(tmp_path):
    tokens = np.arange(1000) * 37 % 65536
    path = tmp_path / "shard.bin"
    write_token_shard(path, tokens)

    body = read_token_shard(path)
    assert isinstance(body, np.memmap) and body.dtype == np.uint16
    np.testing.assert_array_equal(body, tokens)
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    assert list(header[:3]) == [SHARD_MAGIC, SHARD_VERSION, len(tokens)]
    assert path.stat().st_size == 4 * HEADER_INTS + 2 * len(tokens)
    assert [p.name for p in tmp_path.iterdir()] == ["shard.bin"], "the temporary file must be gone"


def test_ids_beyond_uint16_make_a_llama3_shard_read_through_memmap(tmp_path):
    """Llama 3's 128,256 ids do not fit uint16: the shard takes llm.c's uint32 layout (magic
    20240801, version 7), and batches read it as they read the uint16 one."""
    tokens = 2**16 + np.arange(1000) * 131 % (128256 - 2**16)      # every id beyond uint16
    path = tmp_path / "llama3.bin"
    write_token_shard(path, tokens)
    body = read_token_shard(path)
    assert isinstance(body, np.memmap) and body.dtype == np.uint32
    np.testing.assert_array_equal(body, tokens)
    assert list(np.fromfile(path, dtype="<i4", count=3)) == [20240801, 7, len(tokens)]
    assert path.stat().st_size == 4 * HEADER_INTS + 4 * len(tokens)
    shape = BatchShape(micro_batch_size=2, seq_len=16, grad_accum=1, dp=1)
    inputs, targets = TokenBatches(path, shape, seed=0, vocab_size=128256).micro_batches(0, 0)[0]
    for window in torch.cat([inputs, targets[:, -1:]], dim=1).numpy():      # each a slice of the shard
        start = int(np.flatnonzero(tokens == window[0])[0])                 # (the ids are distinct)
        np.testing.assert_array_equal(window, tokens[start: start + 17])
    with pytest.raises(DataError, match=f"token id {tokens.max()} >= the model's vocab_size 50304"):
        TokenBatches(path, shape, seed=0, vocab_size=50304)


@pytest.mark.parametrize("bad_id", [2**32, -1])
def test_write_rejects_ids_outside_uint32(tmp_path, bad_id):
    with pytest.raises(DataError, match=str(bad_id)):
        write_token_shard(tmp_path / "shard.bin", [1, 2, bad_id])


def header_bytes(magic=SHARD_MAGIC, version=SHARD_VERSION, n_tokens=0):
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = magic, version, n_tokens
    return header.tobytes()


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "prepare"),  # missing file: the message says how to make one
        (b"\0" * 100, "100 bytes is shorter than the 1024-byte"),
        (header_bytes(magic=1234, n_tokens=1) + b"\0\0", "magic is 1234.*not an llm.c token shard"),
        (header_bytes(magic=20240801, n_tokens=1) + b"\0" * 4, "version 1 with magic 20240801.*version 7 .Llama 3"),
        (header_bytes(magic=20240801, version=7, n_tokens=2) + b"\0" * 4, "1032 bytes, the file has 1028 bytes"),
        (header_bytes(version=2, n_tokens=1) + b"\0\0", "version 2"),
        (header_bytes(n_tokens=10) + b"\0" * 18, "1044 bytes, the file has 1042 bytes"),
    ],
    ids=["missing", "shorter-than-header", "wrong-magic", "llama3-magic", "llama3-truncated", "wrong-version",
         "truncated"],
)
def test_bad_shards_fail_clearly(tmp_path, content, message):
    path = tmp_path / "bad.bin"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DataError, match=message) as error:
        read_token_shard(path)
    assert str(path) in str(error.value)


def test_token_id_beyond_vocab_fails_clearly(tmp_path):
    path = counting_shard(tmp_path, "shard.bin", 301)
    shape = BatchShape(micro_batch_size=1, seq_len=8, grad_accum=1, dp=1)
    with pytest.raises(DataError, match="token id 300 >= the model's vocab_size 256.*vocab_size >= 301"):
        TokenBatches(path, shape, seed=0, vocab_size=256)
    TokenBatches(path, shape, seed=0, vocab_size=301)


def test_token_ids_are_checked_where_they_are_read_not_by_reading_every_shard(tmp_path, monkeypatch):
    """Start-up reads only the first IDS_CHECKED_AT_START tokens of a shard; an id beyond the
    vocabulary after them is refused when a step reads its window, naming the shard and the place."""
    monkeypatch.setattr(data_module, "IDS_CHECKED_AT_START", 64)
    tokens = np.arange(1000) % 200
    tokens[500] = 250
    path = tmp_path / "late.bin"
    write_token_shard(path, tokens)
    shape = BatchShape(micro_batch_size=1, seq_len=8, grad_accum=1, dp=1)
    batches = TokenBatches(path, shape, seed=0, vocab_size=200)         # the first 64 tokens are fine
    steps = range(batches.n_windows)        # one window per step: one epoch reads every window once
    with pytest.raises(DataError, match=r"late\.bin \(the window at token 496\): token id 250 >= the "
                                        r"model's vocab_size 200"):
        for step in steps:
            batches.step_batch(step, 0)
    for step in steps:                      # the same data fits a larger vocabulary
        TokenBatches(path, shape, seed=0, vocab_size=251).step_batch(step, 0)


def test_too_little_data_for_one_batch_fails_clearly(tmp_path):
    path = counting_shard(tmp_path, "shard.bin", 100)  # (100-1)//8 = 12 windows
    shape = BatchShape(micro_batch_size=4, seq_len=8, grad_accum=2, dp=2)  # 16 sequences
    with pytest.raises(DataError, match="100 tokens = 12 windows.*one global batch of 16 sequences"):
        TokenBatches(path, shape, seed=0)


def test_glob_matching_nothing_fails_clearly(tmp_path):
    pattern = str(tmp_path / "fineweb_train_*.bin")
    with pytest.raises(DataError, match="no token shard matches the pattern"):
        TokenBatches(pattern, BatchShape(1, 8, 1, 1), seed=0)


# ----------------------------------------------------------------------------- batches


@pytest.mark.parametrize("step", [0, 7, 18])
def test_dp_slices_are_disjoint_complete_and_independent_of_dp(tmp_path, step):
    # 300 windows of 9 tokens, 16 per step: step 18 takes the last 12 windows of epoch 0 and the
    # first 4 of epoch 1, so a rank's slice may cross the boundary.
    path = counting_shard(tmp_path, "shard.bin", 300 * 8 + 1)
    reference = None
    for dp in (1, 2, 4):
        shape = BatchShape(micro_batch_size=2, seq_len=8, grad_accum=8 // dp, dp=dp)
        batches = TokenBatches(path, shape, seed=1)
        global_batch = batches.global_batch(step)
        assert global_batch.shape == (16, 9) and global_batch.dtype == torch.long
        rank_windows = [whole_windows(batches.micro_batches(step, rank)) for rank in range(dp)]
        for rank, windows in enumerate(rank_windows):
            rows_of_rank = slice(rank * 16 // dp, (rank + 1) * 16 // dp)
            torch.testing.assert_close(windows, global_batch[rows_of_rank], rtol=0, atol=0)
        torch.testing.assert_close(torch.cat(rank_windows), global_batch, rtol=0, atol=0)
        if (step + 1) * 16 <= batches.n_windows:  # within one epoch no window repeats
            first_tokens = [set(w[:, 0].tolist()) for w in rank_windows]
            assert sum(len(s) for s in first_tokens) == len(set().union(*first_tokens)) == 16
        if reference is None:
            reference = global_batch
        torch.testing.assert_close(global_batch, reference, rtol=0, atol=0)


def test_micro_batch_shapes_and_shifted_targets(tmp_path):
    path = counting_shard(tmp_path, "shard.bin", 2000)
    batches = TokenBatches(path, BatchShape(micro_batch_size=3, seq_len=16, grad_accum=2, dp=2), seed=0)
    pairs = batches.micro_batches(step=5, dp_rank=1)
    assert len(pairs) == 2
    for inputs, targets in pairs:
        assert inputs.shape == targets.shape == (3, 16)
        assert inputs.dtype == targets.dtype == torch.long
        torch.testing.assert_close(targets, inputs + 1, rtol=0, atol=0)  # the counting shard's next token
        torch.testing.assert_close(targets[:, :-1], inputs[:, 1:], rtol=0, atol=0)
        assert ((inputs[:, 0] % 16) == 0).all(), "windows start at multiples of the stride seq_len"
    with pytest.raises(DataError, match="dp_rank 2"):
        batches.micro_batches(step=0, dp_rank=2)


def test_batches_are_deterministic_per_seed_and_step(tmp_path):
    path = counting_shard(tmp_path, "shard.bin", 5000)
    shape = BatchShape(micro_batch_size=2, seq_len=8, grad_accum=2, dp=1)

    def batch(seed, step):
        return TokenBatches(path, shape, seed=seed).global_batch(step)

    assert torch.equal(batch(seed=0, step=2), batch(seed=0, step=2))
    assert not torch.equal(batch(seed=0, step=2), batch(seed=1, step=2))
    assert not torch.equal(batch(seed=0, step=2), batch(seed=0, step=3))


def test_each_epoch_visits_every_window_once_even_across_the_boundary(tmp_path):
    # 10 windows, 4 per step: steps 0..4 cover two epochs, and step 2 straddles them.
    path = counting_shard(tmp_path, "shard.bin", 10 * 8 + 1)
    batches = TokenBatches(path, BatchShape(micro_batch_size=2, seq_len=8, grad_accum=1, dp=2), seed=3)
    assert batches.n_windows == 10
    stream = torch.cat([batches.global_batch(step) for step in range(5)])[:, 0].tolist()
    all_window_starts = list(range(0, 80, 8))
    assert sorted(stream[:10]) == all_window_starts
    assert sorted(stream[10:]) == all_window_starts
    assert stream[:10] != stream[10:], "each epoch draws its own order"


def test_windows_span_several_shards_in_glob_order(tmp_path):
    # The middle shard is too short for one window; windows never cross from one shard to the next.
    counting_shard(tmp_path, "part_000.bin", 100, first=0)  # 12 windows
    counting_shard(tmp_path, "part_001.bin", 5, first=500)  # 0 windows
    counting_shard(tmp_path, "part_002.bin", 150, first=1000)  # 18 windows
    batches = TokenBatches(str(tmp_path / "part_*.bin"), BatchShape(2, 8, 1, 3), seed=0)
    assert [p.name for p in batches.paths] == ["part_000.bin", "part_001.bin", "part_002.bin"]
    assert batches.n_windows == 30
    windows = torch.cat([batches.global_batch(step) for step in range(5)])
    expected_starts = list(range(0, 96, 8)) + list(range(1000, 1144, 8))
    assert sorted(windows[:, 0].tolist()) == expected_starts
    torch.testing.assert_close(windows, windows[:, :1] + torch.arange(9), rtol=0, atol=0)


def test_step_batch_counts_the_targets_of_the_global_batch(tmp_path):
    """n_targets is the whole step's count (every rank, every micro-batch), the same on every rank:
    each rank divides its summed loss by it, so the shares add up to the global mean."""
    path = counting_shard(tmp_path, "shard.bin", 2000)
    batches = TokenBatches(path, BatchShape(micro_batch_size=2, seq_len=8, grad_accum=3, dp=3), seed=0)
    for step in (0, 4):
        global_targets = batches.global_batch(step)[:, 1:]
        step_batches = [batches.step_batch(step, rank) for rank in range(3)]
        assert [b.n_targets for b in step_batches] == [global_targets.numel()] * 3 == [18 * 8] * 3
        for rank, batch in enumerate(step_batches):
            expected = batches.micro_batches(step, rank)
            assert len(batch.micro_batches) == len(expected) == 3
            for got, want in zip(batch.micro_batches, expected):
                assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_batch_shape_from_global_batch_tokens():
    shape = BatchShape.from_global_batch_tokens(256, micro_batch_size=2, seq_len=8, dp=2)
    assert shape == BatchShape(micro_batch_size=2, seq_len=8, grad_accum=8, dp=2)
    assert shape.sequences_per_step == 32 and shape.tokens_per_step == 256
    with pytest.raises(DataError, match="100 tokens.*2\\*8\\*2 = 32.*use 96 tokens \\(grad_accum 3\\)"):
        BatchShape.from_global_batch_tokens(100, micro_batch_size=2, seq_len=8, dp=2)
    with pytest.raises(DataError, match="use 32 tokens \\(grad_accum 1\\)"):
        BatchShape.from_global_batch_tokens(10, micro_batch_size=2, seq_len=8, dp=2)
    with pytest.raises(DataError, match="BatchShape.dp must be a positive integer, got 0"):
        BatchShape(micro_batch_size=2, seq_len=8, grad_accum=1, dp=0)


# ----------------------------------------------------------------------------- tokenizer, corpus, CLI


def test_byte_tokenizer_round_trip():
    tokenizer = ByteTokenizer()
    text = "Grüße, 世界! 🚀"
    ids = tokenizer.encode(text)
    assert tokenizer.vocab_size == 256 and all(0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(torch.tensor(ids)) == text
    assert tokenizer.decode(ids[:-1]).endswith("\ufffd"), "a cut character decodes as a replacement"


def test_builtin_corpus_is_english_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("PICOTRON_DATA_DIR", str(tmp_path))
    train_path, val_path = builtin_corpus_paths()
    version = f"py{sys.version_info.major}{sys.version_info.minor}"
    assert train_path == tmp_path / f"builtin_{version}_train.bin"
    assert val_path == tmp_path / f"builtin_{version}_val.bin"
    train, val = read_token_shard(train_path), read_token_shard(val_path)
    assert train.size > 100_000 and 8 < train.size / val.size < 10
    text = ByteTokenizer().decode(train[:20_000])
    assert text.count(" the ") > 50
    TokenBatches(train_path, BatchShape(4, 64, 1, 1), seed=0, vocab_size=256)

    modified = (train_path.stat().st_mtime_ns, val_path.stat().st_mtime_ns)
    assert builtin_corpus_paths() == (train_path, val_path)
    assert (train_path.stat().st_mtime_ns, val_path.stat().st_mtime_ns) == modified, "files are reused"


def test_prepare_command_writes_a_valid_shard(tmp_path):
    text = "Data parallelism copies the model; tensor parallelism splits it. Ça marche.\n" * 20
    source, shard = tmp_path / "input.txt", tmp_path / "out" / "input.bin"
    source.write_text(text, encoding="utf-8")
    result = subprocess.run(
        [sys.executable, "-m", "picotron_like.data", "prepare", str(source), str(shard)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    n_tokens = len(text.encode("utf-8"))
    assert f"wrote {n_tokens} tokens" in result.stdout
    assert ByteTokenizer().decode(read_token_shard(shard)) == text


DOCUMENTS = ["Pipeline parallelism cuts the layers.", "Tensor parallelism cuts the matrices; ça marche.",
             "Context parallelism cuts the sequence.", "Experts are spread over the ranks."]


def jsonl_of(path, texts):
    path.write_text("".join(json.dumps({"text": text, "id": n}) + "\n" for n, text in enumerate(texts)),
                    encoding="utf-8")
    return path


def split_documents(ids, delimiter):
    """Token ids cut at each delimiter (every document starts with one)."""
    starts = [i for i, token in enumerate(ids) if token == delimiter] + [len(ids)]
    assert starts[0] == 0
    return [list(ids[a + 1: b]) for a, b in zip(starts, starts[1:])]


def test_prepare_with_a_hugging_face_tokenizer_json(tmp_path):
    """A BPE trained here on the built-in corpus (offline) and saved as tokenizer.json, as Llama 3's
    ships: JSONL documents, each starting with the delimiter, the first ones in the validation
    shard, the rest in the train shard, the tokenizer recorded beside them; every document decodes
    back to its text."""
    tokenizers = pytest.importorskip("tokenizers")
    from pydoc_data.topics import topics

    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=["<|begin_of_text|>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([topics[key] for key in sorted(topics)[:50]], trainer)
    bpe.save(str(tmp_path / "tokenizer.json"))
    train, val = tmp_path / "train.bin", tmp_path / "val.bin"
    main(["prepare", str(jsonl_of(tmp_path / "docs.jsonl", DOCUMENTS)), str(train), "--tokenizer",
          str(tmp_path / "tokenizer.json"), "--val", str(val), "--val-tokens", "5"])
    delimiter = bpe.token_to_id("<|begin_of_text|>")
    decoded = [bpe.decode(ids) for shard in (val, train) for ids in split_documents(read_token_shard(shard), delimiter)]
    assert decoded == DOCUMENTS
    assert len(split_documents(read_token_shard(val), delimiter)) == 1      # the first whole document holds >= 5
    assert json.loads((tmp_path / "train.bin.tokenizer.json").read_text()) == {
        "tokenizer": str(tmp_path / "tokenizer.json"), "vocab_size": bpe.get_vocab_size(), "delimiter": delimiter}


def test_prepare_with_gpt2_through_tiktoken_and_bad_inputs(tmp_path, monkeypatch, capsys):
    """--tokenizer gpt2 through tiktoken, with an Encoding built here (byte-level, its end-of-text
    token after the bytes) in place of the GPT-2 table tiktoken would download; a text file is one
    document. A JSONL line without the field, and an unknown tokenizer file, are one error line."""
    tiktoken = pytest.importorskip("tiktoken")
    encoding = tiktoken.Encoding("gpt2-like", pat_str=r"""'s|'t|'re|'ve|'m|'ll|'d| ?\w+| ?\d+| ?[^\s\w\d]+|\s+""",
                                 mergeable_ranks={bytes([b]): b for b in range(256)},
                                 special_tokens={"<|endoftext|>": 256})
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: encoding)
    text = "\n".join(DOCUMENTS) + "\n"
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    main(["prepare", str(tmp_path / "a.txt"), str(tmp_path / "a.bin"), "--tokenizer", "gpt2"])
    ids = read_token_shard(tmp_path / "a.bin")
    assert list(ids) == [256, *text.encode("utf-8")] and ids.dtype == np.uint16
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    for argv, message in [(["prepare", str(tmp_path / "bad.jsonl"), str(tmp_path / "b.bin")],
                           f"error: {tmp_path / 'bad.jsonl'}:2: not a JSON object with a 'text' field"),
                          (["prepare", str(tmp_path / "a.txt"), str(tmp_path / "c.bin"), "--tokenizer",
                            str(tmp_path / "a.txt")], f"error: --tokenizer {tmp_path / 'a.txt'}: cannot load it")]:
        with pytest.raises(SystemExit) as stopped:
            main(argv)
        assert stopped.value.code == 2 and capsys.readouterr().err.splitlines()[-1].startswith(message)
    assert not (tmp_path / "b.bin").exists() and not (tmp_path / "c.bin").exists()


def test_a_run_longer_than_its_data_says_when_it_starts_the_next_pass(tmp_path):
    """31 windows, 2 per step: step 16 starts the second pass over the data, in a new order. The
    shared loop says so in one line, once per pass (decided: wrap, with a note, as llm.c's and
    nanoGPT's loaders do; never silently)."""
    path = tmp_path / "small.bin"
    write_token_shard(path, np.arange(1000) % 256)
    batches = TokenBatches(path, BatchShape(micro_batch_size=2, seq_len=32, grad_accum=1, dp=1), seed=0)
    assert [batches.epoch_at(step) for step in (0, 15, 16, 31, 32)] == [0, 0, 1, 2, 2]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                          str(REPO_ROOT / "01_data_parallel.py"), "--data", str(path), "--val-data", str(path),
                          "--steps", "18", "--seq-len", "32", "--micro-batch-size", "2", "--grad-accum", "1"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    notes = [line for line in run.stdout.splitlines() if line.startswith("note: step")]
    assert notes == ["note: step 16 starts pass 2 over the data (1,000 tokens): every window again, in a new order"]
