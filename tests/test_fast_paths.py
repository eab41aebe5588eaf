"""The GPU fast paths proven equal to the plain paths, on the CPU where the op exists there.

Fused ring blocks (lesson 04). One block in one flash-attention kernel (the CPU's
_scaled_dot_product_flash_attention_for_cpu) against attention_block / attention_block_backward,
which lesson 04's tests prove equal to SDPA in a whole ring. The backward is the point: the ring
hands every block the *final* lse and output of its rows, merged over all blocks, and the kernel
must then give exactly the plain block gradients. In float32 both compute the same softmax with
sums in another order: a few ulp on values of order 1 (randn inputs), measured below 1e-6; 1e-5
is ten times that, and a block given its own lse instead of the final one is off by 0.1 or more.
In bf16 the two round at different points (the plain block rounds the probabilities to bf16
before P V, the kernel rounds only its output): they differ by one or two bf16 ulp (2^-6 for the
values in [2, 4), the largest here); the tolerance is 4 such ulp.

Fused AdamW: which implementation build_optimizer asks for, decided from the device alone.

--compile (lesson 07): two ranks (cp = 2 ring, ZeRO-3, full recomputation: the block's compiled
forward split around the ring's point-to-point calls, recomputed under checkpoint, its weights
gathered and freed by ZeRO-3's hooks) with and without TorchInductor, 3 steps: the same losses and
gradient norms to 1e-5. Inductor fuses elementwise operations and reorders float32 reductions
(RMSNorm's mean of squares, softmax sums), which moves the last bits; losses near 5 have a float32
ulp of 5e-7, and the runs agree to a few ulp. A block compiled wrong, or recomputed or gathered
wrong around the compiled code, moves them far more: scaling each compiled block's output by
1 + 1e-4 already fails the test.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from picotron_like.data import BatchShape, TokenBatches, builtin_corpus_paths
from picotron_like.lessons import load_lesson
from picotron_like.model import GPT, get_config
from picotron_like.testing import run_ranks
from picotron_like.topology import GridShape, ProcessGrid
from picotron_like.run_control import StepFigures
from picotron_like.train import adamw_implementation, build_optimizer, on_device

context_parallel = load_lesson("04_context_parallel")

TOLERANCE = 1e-5
BF16_TOLERANCE = 4 * 2**-6           # 4 bf16 ulp at values in [2, 4): bf16 keeps 8 significant bits
BATCH, KV_HEADS, GROUP, CHUNK, HEAD_DIM = 2, 2, 2, 8, 16


def random_blocks(dtype, device=torch.device("cpu"), seed=0):
    """Grouped queries [b, kv_heads, group, s, d], and two K/V blocks [b, kv_heads, 1, s, d]: an
    earlier chunk (fully visible) and the queries' own chunk (causal), as the ring meets them."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, KV_HEADS, GROUP, CHUNK, HEAD_DIM, generator=generator)
    blocks = [(torch.randn(BATCH, KV_HEADS, 1, CHUNK, HEAD_DIM, generator=generator),
               torch.randn(BATCH, KV_HEADS, 1, CHUNK, HEAD_DIM, generator=generator), causal)
              for causal in (False, True)]
    d_out = torch.randn(q.shape, generator=generator)
    return (q.to(device, dtype), [(k.to(device, dtype), v.to(device, dtype), causal) for k, v, causal in blocks],
            d_out.to(device, dtype))


def max_error(a, b) -> float:
    return (a - b).abs().max().item()


# The CUDA cases run where a GPU is: the flash kernel in bf16 (CUDA has none in float32, and its
# ring computes float32 blocks the plain way) and the fused AdamW.
ON_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("device, dtype, tolerance", [
    ("cpu", torch.float32, TOLERANCE), ("cpu", torch.bfloat16, BF16_TOLERANCE),
    pytest.param("cuda", torch.bfloat16, BF16_TOLERANCE, marks=ON_CUDA)])
def test_fused_block_equals_plain_block_forward_and_backward_with_the_final_lse(device, dtype, tolerance):
    q, blocks, d_out = random_blocks(dtype, torch.device(device))
    out = torch.zeros(q.shape, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
    for k, v, causal in blocks:
        plain = context_parallel.attention_block(q, k, v, causal)
        fused = context_parallel.fused_attention_block(q, k, v, causal)
        for ours, theirs in zip(fused, plain):
            assert ours.dtype == theirs.dtype == torch.float32 and ours.shape == theirs.shape
            assert max_error(ours, theirs) < tolerance, (dtype, causal)
        out, lse = context_parallel.merge_blocks(out, lse, *plain)
    # Backward of each block from the rows' final output and lse (both blocks merged).
    out = out.to(dtype)
    delta = (d_out.float() * out.float()).sum(dim=-1)
    for k, v, causal in blocks:
        plain = context_parallel.attention_block_backward(q, k, v, d_out, lse, delta, causal)
        fused = context_parallel.fused_attention_block_backward(q, k, v, d_out, out, lse, causal)
        for name, ours, theirs in zip(("dq", "dk", "dv"), fused, plain):
            assert ours.dtype == theirs.dtype == torch.float32 and ours.shape == theirs.shape, name
            assert max_error(ours, theirs) < tolerance, (dtype, causal, name)


def test_ring_of_one_uses_the_fused_kernel_by_default_and_equals_sdpa(monkeypatch):
    """cp = 1 (no process group: the ring passes nothing) through RingAttention itself: the default
    ring_kernel computes its block with fused_attention_block, plain with attention_block, and
    both equal SDPA, forward and backward."""
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(BATCH, KV_HEADS * GROUP, 2 * CHUNK, HEAD_DIM, generator=generator)
    k, v = (torch.randn(BATCH, KV_HEADS, 2 * CHUNK, HEAD_DIM, generator=generator) for _ in range(2))
    d_out = torch.randn(q.shape, generator=generator)
    reference = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(reference[0], *(t.repeat_interleave(GROUP, 1) for t in reference[1:]),
                                   is_causal=True).backward(d_out)
    used = []
    for name in ("attention_block", "fused_attention_block"):
        function = getattr(context_parallel, name)
        monkeypatch.setattr(context_parallel, name,
                            lambda *args, name=name, function=function: used.append(name) or function(*args))
    default = context_parallel.ContextParallel(None, 1, 0, 0, 0, context_parallel.SequenceSplit(1, zigzag=True))
    assert default.ring_kernel == "fused"
    for cp, kernel in ((default, "fused_attention_block"), (replace(default, ring_kernel="plain"), "attention_block")):
        used.clear()
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = context_parallel.ring_attention(*inputs, cp)
        out.backward(d_out)
        assert set(used) == {kernel}, (cp.ring_kernel, used)
        for ours, theirs in zip(inputs, reference):
            assert max_error(ours.grad, theirs.grad) < TOLERANCE, cp.ring_kernel
        reference_out = F.scaled_dot_product_attention(q, *(t.repeat_interleave(GROUP, 1) for t in (k, v)),
                                                       is_causal=True)
        assert max_error(out, reference_out) < TOLERANCE, cp.ring_kernel


def test_flash_kernels_exist_for_cpu_and_cuda_half_precision_only():
    runs = context_parallel.fused_kernel_runs
    assert runs(torch.device("cpu"), torch.float32) and runs(torch.device("cpu"), torch.bfloat16)
    assert runs(torch.device("cuda", 0), torch.bfloat16) and runs(torch.device("cuda", 0), torch.float16)
    assert not runs(torch.device("cuda", 0), torch.float32), "FlashAttention-2 has no float32 kernel"


# ----------------------------------------------------------------------------- fused AdamW


def test_adamw_is_fused_on_cuda_and_a_plain_per_tensor_loop_elsewhere():
    assert adamw_implementation(torch.device("cuda", 0)) == {"fused": True}
    assert adamw_implementation(torch.device("cpu")) == {"foreach": False}
    optimizer = build_optimizer(torch.nn.Linear(4, 4), lr=1e-3)
    assert optimizer.defaults["foreach"] is False and not optimizer.defaults["fused"]


@ON_CUDA
def test_adamw_builds_fused_and_steps_on_cuda():
    layer = torch.nn.Linear(4, 4, device="cuda")
    optimizer = build_optimizer(layer, lr=1e-3)
    layer(torch.ones(4, device="cuda")).sum().backward()
    optimizer.step()
    assert optimizer.defaults["fused"] and torch.isfinite(layer.weight).all()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_CUDA)])
def test_a_model_made_on_its_device_holds_the_reference_values_drawn_on_the_cpu(device):
    """Lesson 07 makes its chunks on the device (the host holds one tensor at a time): under a
    device context the reference values are still drawn on the CPU (a CUDA generator would draw
    others), so the model equals one made on the CPU and moved."""
    cfg = replace(get_config("tiny-moe"), n_layers=2)
    with torch.device(device):
        made_there = GPT(cfg, seed=5)
    moved = GPT(cfg, seed=5).to(device)
    for (name, made), expected in zip(made_there.state_dict().items(), moved.state_dict().values(), strict=True):
        assert made.device.type == device and torch.equal(made, expected), name


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_CUDA)])
def test_the_loop_puts_each_step_batch_on_its_device_without_waiting(device):
    """train.on_device: on a GPU every micro-batch tensor is copied from pinned host memory, queued
    without the host waiting; on a CPU the batch is the very same object."""
    shape = BatchShape(micro_batch_size=2, seq_len=16, grad_accum=2, dp=1)
    batch = TokenBatches(builtin_corpus_paths()[0], shape, seed=0).step_batch(0, 0)
    moved = on_device(batch, torch.device(device))
    if device == "cpu":
        assert moved is batch
    else:
        torch.cuda.synchronize()
        for there, here in zip(moved.micro_batches, batch.micro_batches, strict=True):
            assert all(t.device.type == "cuda" and torch.equal(t.cpu(), h) for t, h in zip(there, here, strict=True))
        assert moved.n_targets == batch.n_targets


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_CUDA)])
def test_a_steps_figures_reach_the_host_without_waiting_for_its_cuda_work(device):
    """run_control.StepFigures, the lagged log line's copy: on a GPU, copy() returns while the
    step's work (here 20 large matmuls) still runs, and read() then gives every value exactly (float32 tensors,
    a flag, a Python number, in the order given) and the step's time from CUDA events; on a CPU the
    same values and the host clock's time."""
    where = torch.device(device)
    figures = StepFigures(where)
    x = torch.randn(4096, 4096, device=where) if device == "cuda" else torch.randn(64, 64)
    for _ in range(20):
        x = torch.tanh(x @ x / x.shape[0] ** 0.5)
    loss = x.abs().mean()
    figures.copy({"loss": loss, "grad_norm": 0.25, "skipped": ~torch.isfinite(loss), "aux": loss.double() / 3})
    if device == "cuda":
        assert not figures.copied.query(), "copy() waited for the step's work"
    values, seconds = figures.read()
    assert list(values) == ["loss", "grad_norm", "skipped", "aux"] and seconds > 0
    assert values == {"loss": loss.item(), "grad_norm": 0.25, "skipped": 0.0, "aux": (loss.double() / 3).item()}


# ----------------------------------------------------------------------------- --compile


CFG = replace(get_config("tiny"), n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=128)
SEQ, MICRO, ACCUM, STEPS, LR, SEED, MAX_GRAD_NORM = 32, 2, 2, 3, 3e-3, 7, 1.0


def compiled_and_eager_runs() -> dict:
    full_5d = load_lesson("07_full_5d")
    zero = full_5d.zero
    # The ranks share the machine's cores: a pool of compile workers per rank would only fight
    # over them (and each worker imports torch). What is compiled does not depend on it.
    import torch._inductor.config
    torch._inductor.config.compile_threads = 1
    grid = ProcessGrid(GridShape(cp=2))
    runs = {}
    for compiled in (False, True):
        args = full_5d.parse_args(["--cp", "2", "--zero-stage", "3", "--recompute", "full", "--seq-len", str(SEQ),
                                   "--micro-batch-size", str(MICRO), "--grad-accum", str(ACCUM), "--seed", str(SEED),
                                   *(["--compile"] if compiled else [])])
        model, _ = full_5d.parallelize(CFG, grid, args, torch.device("cpu"))   # no pipeline
        optimizer = zero.build_sharded_optimizer(model, LR)
        settings = full_5d.step_settings(grid, torch.device("cpu"), zero.Precision(), MAX_GRAD_NORM)
        data = TokenBatches(builtin_corpus_paths()[0], BatchShape(MICRO, SEQ, ACCUM, grid.dp_size), seed=SEED,
                            vocab_size=CFG.vocab_size)
        cut = full_5d.context_parallel.sequence_cut(grid, args.zigzag)
        results = [full_5d.train_step(model, optimizer, cut(data.step_batch(step, grid.dp_rank)), settings)
                   for step in range(STEPS)]
        runs[compiled] = {"losses": [r.loss for r in results], "norms": [r.grad_norm for r in results]}
    return runs


def test_compiled_blocks_give_the_same_losses():
    for rank, runs in enumerate(run_ranks(2, compiled_and_eager_runs, timeout_s=300)):
        for key in ("losses", "norms"):
            torch.testing.assert_close(torch.tensor(runs[True][key]), torch.tensor(runs[False][key]),
                                       rtol=0, atol=TOLERANCE, msg=f"rank {rank} {key}")


def compilations(n_layers: int, recompute: str) -> int:
    """Graphs compiled for one training forward and backward of a GPT of n_layers blocks, each
    block compiled as --compile compiles it, with recompute mode `recompute` applied as
    parallelize() applies it. Counted by a backend of the test's own, which runs the traced graph
    as it is: seconds, where TorchInductor would take minutes."""
    full_5d = load_lesson("07_full_5d")
    torch._dynamo.reset()
    graphs = []

    def counting_backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    model = GPT(replace(CFG, n_layers=n_layers), seed=SEED)
    full_5d.apply_recompute(full_5d.compile_blocks(model, True, backend=counting_backend), recompute)
    tokens = torch.randint(0, CFG.vocab_size, (MICRO, SEQ), generator=torch.Generator().manual_seed(0))
    model(tokens, tokens).backward()
    return len(graphs)


@pytest.mark.parametrize("recompute", ("none", "selective", "full"))
def test_compile_serves_every_block_with_one_compilation_in_each_recompute_mode(recompute):
    """Ten blocks compile as often as two: every block shares the first one's compilation. A forward
    set on each block's norm or SwiGLU (selective recomputation did that) makes Dynamo compile each
    block anew, and after torch._dynamo.config.recompile_limit (8) blocks run the rest eagerly, as
    the first GPU run showed (benchmarks/RESULTS.md)."""
    assert compilations(10, recompute) == compilations(2, recompute) > 0
