"""picotron_like.pipeline_tools on hand-written programs: the tools know no lesson, only the duck
types their docstring names (actions with kind / chunk / micro_batch, transfer batches as tuples of
transfers with direction / peer / message). Lesson 03's tests run them on its real schedules."""

from __future__ import annotations

import ast
from collections import namedtuple
from dataclasses import dataclass

import pytest

from picotron_like import pipeline_tools
from picotron_like.pipeline_tools import (PipelineDeadlock, bubble_fraction, peak_live_micro_batches,
                                          render_timeline, simulate_pipeline)


@dataclass(frozen=True)
class Step:
    kind: str
    chunk: int
    micro_batch: int


Send = namedtuple("Send", "direction peer message")


def send(peer, message):
    return Send("send", peer, message)


def recv(peer, message):
    return Send("recv", peer, message)


def two_stage_program():
    """One micro-batch through two stages: the activation goes forward, its gradient comes back."""
    first = [Step("F", 0, 0), (send(1, "act 0"),), (recv(1, "grad 0"),), Step("B", 0, 0)]
    second = [(recv(0, "act 0"),), Step("F", 0, 0), Step("B", 0, 0), (send(0, "grad 0"),)]
    return [first, second]


def test_simulator_runs_a_hand_written_program_and_times_it():
    events = simulate_pipeline(two_stage_program(), forward_time=1.0, backward_time=2.0)
    assert [(a.kind, start, end) for a, start, end in events[0]] == [("F", 0.0, 1.0), ("B", 4.0, 6.0)]
    assert [(a.kind, start, end) for a, start, end in events[1]] == [("F", 1.0, 2.0), ("B", 2.0, 4.0)]
    # span 6; stage 0 busy 3, stage 1 busy 3: idle / busy = 1 on each
    assert bubble_fraction(events) == pytest.approx(1.0)
    assert render_timeline(events, width=6).splitlines() == ["stage 0 |0...aa|", "stage 1 |.0aa..|"]


def test_simulator_finds_a_deadlock_and_a_wrong_message():
    # Both ranks wait to receive before sending: nobody moves.
    stuck = [[(recv(1, "x"),), (send(1, "y"),)], [(recv(0, "y"),), (send(0, "x"),)]]
    with pytest.raises(PipelineDeadlock, match="no rank can move"):
        simulate_pipeline(stuck)
    # The first message on the link is not the one the receiver expects first.
    crossed = [[(send(1, "a"), send(1, "b"))], [(recv(0, "b"),), (recv(0, "a"),)]]
    with pytest.raises(PipelineDeadlock, match="expects b but message number 0 on that link is a"):
        simulate_pipeline(crossed)


def test_peak_live_micro_batches_counts_between_forward_and_backward():
    program = [Step("F", 0, 0), Step("F", 1, 0), (send(1, "m"),), Step("B", 1, 0), Step("F", 0, 1), Step("B", 0, 0)]
    assert peak_live_micro_batches(program) == 2
    # chunk 0 holds micro-batches 0 and 1 at once after chunk 1's backward: 2 x 10 > 10 + 3
    assert peak_live_micro_batches(program, chunk_sizes=[10, 3]) == 20
    # micro-batches of their own sizes: chunk 0's two (10 + 7) at once outweigh chunk 0's 10 and chunk 1's 3
    sizes = {(0, 0): 10, (1, 0): 3, (0, 1): 7}
    assert peak_live_micro_batches(program, micro_batch_sizes=sizes) == 17


def test_the_package_imports_no_lesson():
    tree = ast.parse(open(pipeline_tools.__file__).read())
    modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    modules |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(name[0].isdigit() for name in modules), modules
    assert "load_lesson" not in open(pipeline_tools.__file__).read()
