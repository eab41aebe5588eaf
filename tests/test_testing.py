"""The test helpers themselves: results come back, failures surface, hangs end; masked batches
are cut as the data loader cuts them."""

import time

import pytest
import torch
import torch.distributed as dist

from picotron_like.data import BatchShape, TokenBatches, builtin_corpus_paths
from picotron_like.loss import IGNORE_INDEX
from picotron_like.testing import RankFailure, ignore_targets, masked_step_batch, run_ranks


def sum_of_ranks(tensors):
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    return dist.get_rank(), torch.get_num_threads(), total.item() + float(sum(tensors))


def rank_one_raises():
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank 1")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that is gone


def rank_zero_hangs():
    # Both ranks connected first: rank 1 leaving while rank 0 still sets up its gloo connections
    # would fail rank 0's start-up (seen on a loaded machine) instead of letting it hang.
    dist.barrier()
    if dist.get_rank() == 0:
        time.sleep(600)
    return "done"


def test_results_in_rank_order_one_thread_each():
    """And arguments of many tensors reach the ranks: multiprocessing would pass each through a
    file descriptor, and a new process takes fewer than 252 ("ValueError: too many fds")."""
    tensors = [torch.ones(1) for _ in range(300)]
    assert run_ranks(3, sum_of_ranks, tensors, timeout_s=60) == [(0, 1, 303.0), (1, 1, 303.0), (2, 1, 303.0)]


def test_failing_rank_reaches_pytest_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_ranks(2, rank_one_raises, timeout_s=60)
    message = str(failure.value)
    assert "rank 1 raised" in message
    assert "ValueError: deliberate failure on rank 1" in message
    assert "in rank_one_raises" in message  # the traceback, not only the message
    assert time.monotonic() - start < 30, "a failure must not wait for the timeout"


def test_hung_rank_fails_with_timeout_and_its_stack():
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_ranks(2, rank_zero_hangs, timeout_s=8)
    message = str(failure.value)
    assert "ranks [0] did not finish within 8 s" in message
    assert "rank_zero_hangs" in message  # where rank 0 was stuck, from faulthandler
    assert time.monotonic() - start < 20


def test_masked_step_batch_is_the_step_batch_with_masked_targets():
    batches = TokenBatches(builtin_corpus_paths()[0], BatchShape(2, 16, 2, 3), seed=0)
    step, rows = 1, range(4, 6)

    def mask(step, targets):
        return ignore_targets(step, targets, ignored_rows=rows)

    masked_global = mask(step, batches.global_batch(step)[:, 1:].clone())
    for rank in range(3):
        plain, masked = batches.step_batch(step, rank), masked_step_batch(batches, step, rank, mask)
        assert masked.n_targets == int((masked_global != IGNORE_INDEX).sum()) < plain.n_targets
        for (inputs, targets), (plain_inputs, plain_targets) in zip(masked.micro_batches, plain.micro_batches):
            assert torch.equal(inputs, plain_inputs)
            kept = targets != IGNORE_INDEX
            assert torch.equal(targets[kept], plain_targets[kept])
    # Row r ignores its first (3 r + 5 step) % seq_len targets; rows 4 and 5 (rank 1's first
    # micro-batch) ignore all of them.
    ignored = (masked_global == IGNORE_INDEX).sum(dim=1).tolist()
    assert ignored == [5, 8, 11, 14, 16, 16, 7, 10, 13, 0, 3, 6]
