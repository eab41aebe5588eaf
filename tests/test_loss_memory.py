"""The chunked loss (loss.LinearCrossEntropy, issue 20 item 10): proven equal to the textbook loss,
and its memory measured next to its formulas.

Equality, on 3 gloo ranks, every loss chunked over a few tokens (LOSS_CHUNK_BYTES lowered in each
rank: 32 tokens in 7 chunks, the last one short; backward as LossSettings() chooses it, by 7 blocks
of words at tp = 1 and 2, where the 32 tokens are fewer than a rank's words, by the 7 chunks of
tokens at tp = 3), with masked targets, for the mean and the sum:
- tp = 1: the reference GPT's loss and every gradient against the same GPT's logits through
  F.cross_entropy (cross_entropy_loss);
- tp = 2 (ranks 0-1): lesson 02's whole model with sequence parallelism saving the shard, the form
  lesson 07 composes (the head's input gathered for the matmul, only the shard kept, gathered
  again in backward), against the same textbook reference, each rank's gradient shard;
- tp = 3 (all ranks, a vocabulary of 48): lesson 02's head alone, so that the three all-reduces
  combine slices whose chunks see different maxima.
Float32, torch.testing's float32 tolerances (rtol 1.3e-6, atol 1e-5): the two sides differ in the
order of summation only (per chunk, per vocabulary slice, log-sum-exp against log-softmax).

Memory, on one process: the transient of the loss's backward measured on the CPU allocator equals
metrics.loss_transient_parts to the byte in float32 for three chunk sizes, by words and by tokens,
and at the GPU's budget (LOSS_CHUNK_BYTES_CUDA, on the CPU), and in bf16 up to
oneDNN's few KiB of scratch; the textbook loss measured the same way holds more than the issue's
2 * 4 * V * n bytes there. The memory plan counts the transient on the rank with the LM head only
and says what makes the peak.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile

from picotron_like import loss as loss_module
from picotron_like.data import BatchShape
from picotron_like.lessons import load_lesson
from picotron_like.loss import IGNORE_INDEX, LossSettings, cross_entropy_loss, linear_cross_entropy
from picotron_like.metrics import loss_transient_parts, predicted_loss_transient_bytes
from picotron_like.model import GPT, get_config
from picotron_like.testing import run_ranks
from picotron_like.topology import GridShape

CFG = replace(get_config("tiny"), n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=128)
BATCH, SEQ, SEED, CHUNK = 2, 16, 3, 5


def masked_tokens(vocab_size: int, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets [BATCH, seq], about a quarter of the targets ignored (some in each row)."""
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(vocab_size, (BATCH, seq + 1), generator=generator)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    targets[torch.rand(BATCH, seq, generator=generator) < 0.25] = IGNORE_INDEX
    targets[:, 0] = IGNORE_INDEX
    return inputs, targets


def chunk_every(tokens: int, vocab_slice: int) -> None:
    """Make the loss chunk every `tokens` tokens over a vocabulary slice of `vocab_slice` words."""
    loss_module.LOSS_CHUNK_BYTES = 4 * vocab_slice * tokens
    assert loss_module.loss_chunk_tokens(vocab_slice) == tokens


def textbook(reduction: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss from the whole logits and F.cross_entropy, and every gradient, on one device."""
    reference = GPT(CFG, seed=SEED)
    inputs, targets = masked_tokens(CFG.vocab_size)
    loss = cross_entropy_loss(reference(inputs), targets, reduction)
    loss.backward()
    return loss.detach(), {name: param.grad for name, param in reference.named_parameters()}


def assert_equal_to_textbook(model, reduction: str, rank: int, tp: int, what: str) -> None:
    expected_loss, expected_grads = textbook(reduction)
    loss = model(*masked_tokens(CFG.vocab_size), reduction=reduction)
    loss.backward()
    torch.testing.assert_close(loss.detach(), expected_loss, msg=f"{what} {reduction} loss")
    for name, param in model.named_parameters():
        expected = expected_grads[name]
        if hasattr(param, "tp_split_dim"):
            expected = expected.chunk(tp, dim=param.tp_split_dim)[rank]
        torch.testing.assert_close(param.grad, expected, msg=lambda m: f"{what} {reduction} grad {name}: {m}")


def check_vocab_parallel_head(group, vocab_size: int = 48, hidden: int = 16) -> None:
    """Lesson 02's head alone against F.cross_entropy on the whole logits, loss and gradients."""
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    generator = torch.Generator().manual_seed(SEED)
    full = nn.Linear(hidden, vocab_size, bias=False)
    full.weight.data = torch.randn(vocab_size, hidden, generator=generator)
    x = torch.randn(BATCH, SEQ, hidden, generator=generator)
    _, targets = masked_tokens(vocab_size)
    head = load_lesson("02_tensor_parallel").VocabParallelHead(full, group)
    chunk_every(CHUNK, vocab_size // tp)
    for reduction in ("mean", "sum"):
        inputs, local_inputs = x.clone().requires_grad_(), x.clone().requires_grad_()
        full.weight.grad = head.weight.grad = None
        expected = cross_entropy_loss(full(inputs), targets, reduction)
        expected.backward()
        loss = head(local_inputs, targets, reduction)
        loss.backward()
        what = f"head tp={tp} {reduction}"
        torch.testing.assert_close(loss, expected, msg=f"{what} loss")
        torch.testing.assert_close(head.weight.grad, full.weight.grad.chunk(tp)[rank], msg=f"{what} weight grad")
        dist.all_reduce(local_inputs.grad, group=group)     # the f in front of the head sums the slices'
        torch.testing.assert_close(local_inputs.grad, inputs.grad, msg=f"{what} input grad")


def check_chunked_losses() -> None:
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])           # collective: every rank makes it
    check_vocab_parallel_head(dist.group.WORLD)
    if rank < 2:
        tensor_parallel = load_lesson("02_tensor_parallel")
        chunk_every(CHUNK, CFG.vocab_size // 2)
        for reduction in ("mean", "sum"):
            model = tensor_parallel.apply_tensor_parallel(GPT(CFG, seed=SEED), pair, sequence_parallel=True,
                                                          save_sequence_shard=True)
            assert isinstance(model.lm_head, tensor_parallel.ShardSavingVocabParallelHead)
            assert_equal_to_textbook(model, reduction, rank, 2, "tp=2 sequence parallel, saving the shard")
    else:
        chunk_every(CHUNK, CFG.vocab_size)
        for reduction in ("mean", "sum"):
            assert_equal_to_textbook(GPT(CFG, seed=SEED), reduction, 0, 1, "tp=1")


def test_chunked_loss_equals_the_textbook_loss_at_tp_1_2_and_3():
    run_ranks(3, check_chunked_losses, timeout_s=120)


# ----------------------------------------------------------------------------- memory


def allocator_peak(step) -> int:
    """The most bytes the CPU allocator held during step() beyond what it held before it.

    The profiler's own memory records, one per allocation (+bytes) and per free (-bytes), added up
    in the order they happened: each byte counted once, when it is allocated, and subtracted once,
    when it is freed (a block allocated before the profile has no record, and its free none: it is
    not counted at all). Summing the per-operator memory columns of the profiler's table instead
    counts an allocation in its operator and again in every operator that called it."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    records = sorted((event for event in prof.profiler.kineto_results.events() if event.name() == "[memory]"),
                     key=lambda event: event.start_ns())
    live = peak = 0
    for record in records:
        live += record.nbytes()
        peak = max(peak, live)
    return peak


def measured_loss_transient(dtype: torch.dtype, chunk: int | None, chunked: bool = True,
                            settings: LossSettings = LossSettings()) -> int:
    """The backward's transient over the activations the forward kept: one micro-batch of 2 x 64
    tokens through a one-layer GPT whose vocabulary dominates (V = 4096, h = 128), the loss summed,
    gradients already held (a later micro-batch's backward, which adds its dW into .grad: the worse
    case). `chunk` tokens per chunk (as many logits per block of words), or all of them in one;
    the head's loss run as `settings` say."""
    cfg = replace(get_config("tiny"), n_layers=1, vocab_size=4096)
    loss_module.LOSS_CHUNK_BYTES = 4 * cfg.vocab_size * chunk if chunk else 2**30
    model = GPT(cfg, seed=SEED).to(dtype)
    model.lm_head.loss_settings = settings
    inputs, targets = masked_tokens(cfg.vocab_size, seq=64)

    def loss():
        if chunked:
            return model(inputs, targets, reduction="sum")
        return cross_entropy_loss(model(inputs), targets, reduction="sum")
    loss().backward()
    return allocator_peak(loss().backward)


def matmul_scratch_bytes(tokens: int, vocab: int, hidden: int, dtype: torch.dtype) -> int:
    """What this CPU's matmuls dW = g^T x and dx = g W, as the loss's backward calls them on its
    largest block of logits (loss_chunk_shape), allocate for themselves, the larger: oneDNN packs
    its bf16 operands, a whole copy of one on some CPUs (seen on Intel Xeons) and less on others
    that multiply bf16 natively (AMD EPYC with avx512_bf16)."""
    rows, cols = loss_module.loss_chunk_shape(tokens, vocab)
    by_words = rows == tokens
    grad_logits = torch.zeros(rows, cols, dtype=dtype)
    weight = torch.zeros(cols, hidden, dtype=dtype)
    inputs, grad_inputs = torch.zeros(rows, hidden, dtype=dtype), torch.zeros(rows, hidden, dtype=dtype)
    grad_weight = torch.zeros(cols, hidden, dtype=dtype)
    return max(allocator_peak(lambda: torch.mm(grad_logits, weight, out=grad_inputs)),
               allocator_peak(lambda: grad_inputs.addmm_(grad_logits, weight)) if by_words else 0,
               allocator_peak(lambda: torch.mm(grad_logits.t(), inputs, out=grad_weight)) if by_words else
               allocator_peak(lambda: grad_weight.addmm_(grad_logits.t(), inputs)))


def test_loss_transient_measured_on_the_allocator_equals_its_formula():
    """Float32 to the byte, chunked three ways, by words (the default at 128 tokens over 4096 words)
    and by tokens. bf16 (weights in bf16, as 06 and 07 keep them) to the byte in one chunk, where
    the chunk's float32 logits beside their bf16 product make the peak; chunked, the peak moves to
    the matmuls dW = g^T x and dx = g W, whose own allocations on this CPU (oneDNN packing its
    operands) are measured apart on bare matmuls of the same shapes and counted, leaving some KiB
    of scratch of their own (not counted)."""
    chunk_bytes = loss_module.LOSS_CHUNK_BYTES
    try:
        n, hidden, vocab = BATCH * 64, get_config("tiny").hidden, 4096
        for settings in (LossSettings(), LossSettings(backward="tokens")):
            for chunk in (None, 16, CHUNK):
                assert (measured_loss_transient(torch.float32, chunk, settings=settings)
                        == predicted_loss_transient_bytes(n, hidden, vocab, settings=settings)), (settings, chunk)
        for chunk, scratch in ((None, 0), (16, 64 * 2**10)):      # oneDNN's: 6 to 30 KiB seen
            measured = measured_loss_transient(torch.bfloat16, chunk)
            packing = matmul_scratch_bytes(n, vocab, hidden, torch.bfloat16)
            predicted = predicted_loss_transient_bytes(n, hidden, vocab, torch.bfloat16, matmul_scratch_bytes=packing)
            assert 0 <= measured - predicted <= scratch, (chunk, measured, predicted, packing)
        # The textbook loss: the gradients of the log-probabilities and of the logits at once.
        assert measured_loss_transient(torch.float32, None, chunked=False) > 2 * 4 * vocab * n
    finally:
        loss_module.LOSS_CHUNK_BYTES = chunk_bytes


def test_loss_transient_at_the_gpu_budget_equals_its_formula():
    """The GPU's budget (LOSS_CHUNK_BYTES_CUDA, 1 GiB of float32 logits) on the CPU: 1024 tokens over
    294,912 words, more than one budget of logits, so that backward runs two blocks of words
    (262,144 and 32,768): the transient to the byte, as the formula has it for a GPU."""
    chunk_bytes = loss_module.LOSS_CHUNK_BYTES
    try:
        loss_module.LOSS_CHUNK_BYTES = loss_module.LOSS_CHUNK_BYTES_CUDA
        tokens, hidden, vocab = 1024, 4, 294912
        assert loss_module.loss_chunk_shape(tokens, vocab, "cuda") == (tokens, 262144)
        generator = torch.Generator().manual_seed(SEED)
        inputs = torch.randn(tokens, hidden, generator=generator, requires_grad=True)
        weight = torch.randn(vocab, hidden, generator=generator, requires_grad=True)
        targets = torch.randint(vocab, (tokens,), generator=generator)
        loss = linear_cross_entropy(inputs, weight, targets, reduction="sum")
        assert allocator_peak(loss.backward) == predicted_loss_transient_bytes(tokens, hidden, vocab,
                                                                               device_type="cuda")
    finally:
        loss_module.LOSS_CHUNK_BYTES = chunk_bytes


def test_the_plan_counts_the_loss_transient_where_the_head_is(capsys):
    full_5d, plan = load_lesson("07_full_5d"), load_lesson("07_memory_plan")
    cfg, shape = get_config("8b"), BatchShape(1, 8192, 8, 1)
    precision = full_5d.zero.Precision(torch.bfloat16, torch.float32)
    args = full_5d.parse_args(["--pp", "2", "--tp", "4", "--sequence-parallel", "--zero-stage", "1"])
    grid = GridShape(pp=2, tp=4)
    first, last = (plan.planned_memory(cfg, args, grid, 1, shape, precision, rank, plan.plan_device(args))[0]
                   for rank in (0, 1))
    assert first["loss's backward (chunked)"] == 0
    assert last["loss's backward (chunked)"] == predicted_loss_transient_bytes(
        8192, cfg.hidden, cfg.vocab_size // 4, torch.bfloat16, regathered_input=True, device_type="cuda")
    assert loss_transient_parts(8192, cfg.hidden, cfg.vocab_size // 4, torch.bfloat16)["chunk"] <= 1.5 * 2**28
    assert (loss_transient_parts(8192, cfg.hidden, cfg.vocab_size // 4, torch.bfloat16, device_type="cuda")["chunk"]
            <= 1.5 * loss_module.LOSS_CHUNK_BYTES_CUDA)
    full_5d.main(["--plan", "--preset", "8b", "--gpus", "8", "--gpu", "H100", "--seq-len", "8192",
                  "--micro-batch-size", "1", "--grad-accum", "8", "--plan-top", "1"])
    out = capsys.readouterr().out
    assert "  loss's backward (chunked)" in out
    assert "the peak, at the start of a micro-batch's backward, in the LM head: the model states" in out, out
