"""The layout fuzzer in CI: a fixed set of draws every run, and a few new ones each run.

tests/layout_fuzz.py explains what a draw is and what is compared. The fixed seeds were picked to
cover, between them, every axis and option at least once (asserted below, so a change of the
drawing code that loses one fails here); the drawn ones start at a seed taken from the clock, or
from PICOTRON_FUZZ_SEED when set, and are printed so that a failure can be replayed with
`python tools/fuzz_layouts.py --seed S --n 1`. Locally, `python tools/fuzz_layouts.py --n 50`
runs as many as asked.
"""

from __future__ import annotations

import os
import time

import pytest

import layout_fuzz
from layout_fuzz import draw, verdict

# Between them these draws exercise everything the drawing code can (features(), asserted below),
# in two spawns (4 and 6 ranks; 65 adds a batch-size ramp, interleaved; 1815 one with experts, ZeRO-3
# under full recomputation; 1057 and 2620 offload the optimizer, 20 the optimizer and activations; 131
# experts at ZeRO-0 over dp3 x cp2, edp 3; 3453 ZeRO-3 under an interleaved pipeline of 3 virtual
# stages, kept gathered). The refused ones: a world that does not match the degrees, zero-bubble with
# recomputation, Ulysses with experts.
FIXED_ACCEPTED = (944, 1057, 3633, 25, 2620, 3005, 57, 0, 65, 1815, 20, 131, 3453)
FIXED_REFUSED = (31, 59, 154)
N_DRAWN_ACCEPTED, N_DRAWN_REFUSED = 2, 1


def drawn_seed() -> int:
    return int(os.environ.get("PICOTRON_FUZZ_SEED", time.time_ns() // 1000 % 1_000_000))


@pytest.fixture(scope="module")
def fixed_runs():
    return layout_fuzz.run_accepted([draw(seed) for seed in FIXED_ACCEPTED])


def test_the_fixed_draws_cover_everything_the_fuzzer_draws():
    """Every feature of the first 2000 draws that 07 accepts (degrees 2-4 on every axis, odd ones,
    every ZeRO stage, schedule, attention mode and kernel, recompute mode, expert option, masked
    targets) is in some fixed draw; the fixed refused draws are refused."""
    possible = set().union(*(layout_fuzz.features(draw(seed)) for seed in range(2000) if verdict(draw(seed)) is None))
    fixed = set().union(*(layout_fuzz.features(draw(seed)) for seed in FIXED_ACCEPTED))
    assert all(verdict(draw(seed)) is None for seed in FIXED_ACCEPTED)
    assert possible - fixed == set()
    assert len(possible) >= 40
    assert all(verdict(draw(seed)) is not None for seed in FIXED_REFUSED)


def test_fixed_draws_equal_one_device(fixed_runs):
    for layout, runs, reference in fixed_runs:
        layout_fuzz.assert_equals_reference(layout, runs, reference)


@pytest.mark.parametrize("where, change", [
    ("last_grads", lambda t: t.mul_(1 + 1e-3)),           # a later step's gradient 0.1% off
    ("last_clipped_grads", lambda t: t.mul_(1 + 1e-3)),
    ("params", lambda t: t.add_(0.1 * layout_fuzz.LR)),     # a parameter 0.1 lr off after the steps
    ("norms", lambda norms: norms.__setitem__(-1, norms[-1] * (1 + 1e-3))),
])
def test_the_comparison_catches_small_errors(fixed_runs, where, change):
    """The mutation argument, on the fixed draws' own results: an error far smaller than any real
    bug's, in one tensor of one rank, fails the comparison."""
    layout, runs, reference = fixed_runs[0]
    mutated = [dict(result) for result in runs]
    victim = mutated[-1]
    if where == "norms":
        victim["norms"] = list(victim["norms"])
        change(victim["norms"])
    else:
        victim[where] = dict(victim[where])
        name = next(name for name in victim[where] if name.endswith("o_proj.weight"))
        victim[where][name] = victim[where][name].clone()
        change(victim[where][name])
    with pytest.raises(AssertionError):
        layout_fuzz.assert_equals_reference(layout, mutated, reference)


@pytest.mark.parametrize("seed", FIXED_REFUSED)
def test_fixed_refused_draws_stop_with_one_error_line(seed):
    layout = draw(seed)
    layout_fuzz.check_refused(layout, verdict(layout))


def test_new_draws_this_run():
    """A few draws no run has tried before; their seed and command lines are printed."""
    accepted, refused = layout_fuzz.draws(drawn_seed(), N_DRAWN_ACCEPTED, N_DRAWN_REFUSED)
    for layout in (*accepted, *(layout for layout, _ in refused)):
        print(layout)
    for layout, error in refused:
        layout_fuzz.check_refused(layout, error)
    layout_fuzz.check_accepted(accepted)
