"""The multi-rank test helper itself: results come back, failures surface, hangs end."""

import time

import pytest
import torch
import torch.distributed as dist

from picotron_like.testing import RankFailure, run_ranks


def sum_of_ranks():
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    return dist.get_rank(), torch.get_num_threads(), total.item()


def rank_one_raises():
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank 1")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that is gone


def rank_zero_hangs():
    if dist.get_rank() == 0:
        time.sleep(600)
    return "done"


def test_results_in_rank_order_one_thread_each():
    assert run_ranks(3, sum_of_ranks, timeout_s=60) == [(0, 1, 3.0), (1, 1, 3.0), (2, 1, 3.0)]


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
