"""
The plan's step-time model and memory against the Ultra-Scale Playbook's measured best layouts.

    python benchmarks/step_time_vs_published.py            # the table and the summary (~3 min on 2 busy cores)
    python benchmarks/step_time_vs_published.py --fit      # search the published profiles' fitted constants (~15 s)
    python benchmarks/step_time_vs_published.py --runs     # the plan's memory and verdict on all 2,884 runs (~1 min)

The Playbook (Hugging Face, 2025) trained Llama-style models of 1.34 to 80 B parameters with
nanotron on 1 to 64 nodes of 8 x H100 (sequence 4096, batches of 1 M tokens, bf16, tp with
sequence parallelism), searched dp x tp x pp, micro-batch and ZeRO stage for each, and published
the best layout of each cell with its MFU and peak reserved memory: 26 cells, read from
benchmarks/published/ultrascale_playbook_best_configs.csv (published_data.py: each row's shape,
source and date). Each cell's layout is planned for lesson 07's trainer as the Playbook ran it:
bf16 weights, float32 gradient reduction, sequence parallelism with tp, no recomputation, 1F1B,
--compile (nanotron's fused norm and rotary kernels; the plan's compiled elementwise passes). For
each cell:

  (a) MFU     the plan's estimate for the measured layout (07_memory_plan.plan_layout on the H100's
              published profile) over the measured MFU (the same convention: model.flops_per_token);
  (b) rank    where the measured grid (dp, tp, pp) lands among the plan's grids of the kind the
              Playbook searched: every dp x tp x pp of the cell's GPUs (tp within two nodes, cp 1),
              each grid at its fastest micro-batch (powers of 2 that divide the batch) and ZeRO
              stage (0 or 1, as the measured cells use) among those whose fullest stage fits 90% of
              80 GB; 1 = the plan's own first choice;
  (c) memory  the plan's bytes on the fullest rank of the measured layout, its allocator's reserve
              included, over the measured memory: the figure is torch.cuda.max_memory_reserved in
              GiB (each of its 26 labels is the "Mem Res (GB)" of its run in the Playbook's table of
              runs, published_data.py), plus what nanotron holds that this trainer does not: at
              ZeRO-0/1 it flattens a bucket's gradients into a copy to reduce them (one unit's, in
              the reduce dtype, nanotron_flat_gradients), where this trainer writes them straight
              into its buffers. This trainer's head is never tied to the embedding: for the 1.34
              and 3.57 B models, which nanotron ties, the plan holds one matrix more.

The published H100 profile's free constants (picotron_like/published_profiles.Constants) are
fitted on the cells of up to 8 nodes only (--fit: the smallest sum of absolute log MFU ratios, by
coordinate search inside each constant's physical range, BOUNDS; absolute, so that one anomalous
cell, 80 B on 4 nodes at the memory limit, does not steer the fit); the 16-64-node cells are held
out and summarised apart. The allocator's reserve (published_profiles.ALLOCATOR_RESERVE, a share of
the bytes a step allocates and frees) is fitted on the same cells' memory, apart (fit_allocator_reserve).
Where a cell's estimate is off by more than 1.5 x, the report gives the
gap and by what factor each of the estimate's two largest parts would have to change to close it.

--runs holds the memory plan against every run of the Playbook's table that finished or ran out of
memory (benchmarks/published/ultrascale_playbook_runs.csv, 2,884 runs): the plan's bytes over the
reserved memory of each finished run, and its verdict against how each run ended.
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import sys

import torch

from picotron_like.data import BatchShape
from picotron_like.lessons import REPO_ROOT, load_lesson
from picotron_like.model import flops_per_token
from picotron_like.published_profiles import ALLOCATOR_RESERVE, Constants, published_profile
from picotron_like.topology import ConfigError, GridShape

from published_data import model_config, read_published

SEQ, BATCH_TOKENS, GPUS_PER_NODE, FITTED_NODES = 4096, 2**20, 8, 8
# Each constant's physical range: the fit searches inside it, so that no constant leaves what a
# kernel, a link or NCCL can do to absorb another term's miss.
BOUNDS = {"gemm_peak_share": (0.6, 0.85), "gemm_half_rate_s": (1e-6, 2e-5), "attention_peak_share": (0.3, 0.75),
          "network_bus_share": (0.3, 1.0), "overlap": (0.5, 1.0), "network_step_latency_s": (3e-6, 3e-5),
          "hbm_share": (0.6, 0.95)}
MFU_TOLERANCE, MEMORY_TOLERANCE = 1.5, 0.25
GIB = 2**30

full_5d = load_lesson("07_full_5d")
plan = full_5d.memory_plan


def read_cells() -> list[dict]:
    return read_published("ultrascale_playbook_best_configs")


def layout_args(grid: GridShape, micro: int, zero_stage: int):
    accum = BATCH_TOKENS // SEQ // (grid.dp * micro)
    return full_5d.parse_args(["--dp", str(grid.dp), "--tp", str(grid.tp), "--pp", str(grid.pp),
                               "--zero-stage", str(zero_stage), "--micro-batch-size", str(micro),
                               "--grad-accum", str(accum), "--seq-len", str(SEQ), "--recompute", "none",
                               "--dtype", "bfloat16", "--gpu", "H100", "--gpus", str(grid.world_size), "--compile",
                               # nanotron's ZeRO-1 all-gathers the weights inside its optimizer step and waits
                               "--no-overlap-weight-gather"]
                              + ["--sequence-parallel"] * (grid.tp > 1))


PRECISION = full_5d.zero.Precision(torch.bfloat16, torch.float32)


def layout_of(cfg, grid: GridShape, micro: int, zero_stage: int):
    """(flags, batch shape) of one layout, or None where lesson 07 refuses it."""
    args = layout_args(grid, micro, zero_stage)
    shape = BatchShape(micro, SEQ, args.grad_accum, grid.dp)
    try:
        full_5d.validate(cfg, grid, shape, args, grid.world_size)
    except (ConfigError, ValueError):
        return None
    return args, shape


def planned(cfg, grid: GridShape, micro: int, zero_stage: int, device):
    """The plan for one layout, or None where lesson 07 refuses it."""
    layout = layout_of(cfg, grid, micro, zero_stage)
    if layout is None:
        return None
    args, shape = layout
    return plan.plan_layout(cfg, args, grid, 1, shape, PRECISION, device)


def searched_grids(world: int):
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    for tp in divisors:
        for pp in divisors:
            if world % (tp * pp) == 0 and tp <= 2 * GPUS_PER_NODE:
                yield GridShape(dp=world // (tp * pp), tp=tp, pp=pp)


USABLE = 80 * GIB * (1 - plan.PLAN_MARGIN)    # what the plan fills of an H100's 80 GiB


def fullest_stage_bytes(cfg, args, grid: GridShape, shape, device, nanotron: bool = False) -> int:
    """plan_layout's memory without its step time: the fullest pipeline stage's bytes (with nanotron's
    flat gradients where `nanotron`)."""
    return max(sum(plan.planned_memory(cfg, args, grid, 1, shape, PRECISION, rank, device)[0].values())
               + (nanotron_flat_gradients(cfg, args, grid, rank) if nanotron else 0) for rank in range(grid.pp))


def fits(cfg, args, grid: GridShape, shape) -> bool:
    """Whether the layout's fullest stage fits 90% of 80 GiB."""
    return fullest_stage_bytes(cfg, args, grid, shape, plan.plan_device(args)) <= USABLE


def rank_of_measured(cfg, cell: dict, device) -> tuple[int, int, str]:
    """(rank of the measured grid, grids that fit, the plan's first grid): each grid at its
    fastest micro-batch and ZeRO stage among the layouts that fit (each grid's layouts are tried
    fastest first, so that memory is planned only until one fits)."""
    best = {}
    sequences = BATCH_TOKENS // SEQ
    for grid in searched_grids(cell["nodes"] * GPUS_PER_NODE):
        candidates = []
        for micro in (2**i for i in range(9)):
            for stage in (0, 1):
                layout = None if sequences % (grid.dp * micro) else layout_of(cfg, grid, micro, stage)
                if layout is not None:
                    args, shape = layout
                    seconds = sum(plan.slowest_stage_seconds(cfg, args, grid, 1, shape, PRECISION, device).values())
                    candidates.append((seconds, micro, stage, args, shape))
        for seconds, _, _, args, shape in sorted(candidates, key=lambda candidate: candidate[:3]):
            if fits(cfg, args, grid, shape):
                best[(grid.dp, grid.tp, grid.pp)] = seconds
                break
    order = sorted(best, key=best.get)
    measured = (cell["dp"], cell["tp"], cell["pp"])
    first = "dp{} tp{} pp{}".format(*order[0]) if order else "-"
    return (order.index(measured) + 1 if measured in order else 0), len(order), first


def missing_term(layout, measured_mfu: float) -> str:
    """The gap between the estimated and the measured step, and by what factor each of the two
    largest parts of the estimate would have to change to close it alone."""
    step = layout.step_seconds
    measured = step * layout.mfu / measured_mfu
    gap = measured - step
    largest = sorted(((seconds, part) for part, seconds in layout.seconds.items() if seconds > 0), reverse=True)[:2]
    factors = ", or ".join(f"{part} x {(seconds + gap) / seconds:.1f} (now {seconds:.3f} s)"
                           for seconds, part in largest if seconds + gap > 0)
    return (f"step {step:.3f} s estimated, {measured:.3f} s measured: {abs(gap):.3f} s "
            f"{'missing' if gap > 0 else 'too many'}; closing it alone takes {factors}")


def nanotron_flat_gradients(cfg, args, grid: GridShape, pp_rank: int) -> int:
    """Bytes nanotron holds beside the plan's at ZeRO-0/1: the largest unit's gradients flattened
    into a copy in the reduce dtype for their reduction (its buckets), alive at the backward's peak.
    This trainer held the same until its gradients went straight into ZeRO's buffers (lesson 06)."""
    if args.zero_stage > 1:
        return 0
    units = plan.zero_units(cfg, args, grid, 1, pp_rank)
    return max(units.dense + units.experts) * PRECISION.reduce_dtype.itemsize


def evaluate(cells: list[dict], device, with_ranks: bool = True) -> list[dict]:
    rows = []
    for cell in cells:
        cfg = model_config(cell)
        grid = GridShape(dp=cell["dp"], tp=cell["tp"], pp=cell["pp"])
        layout = planned(cfg, grid, cell["micro_batch"], cell["zero_stage"], device)
        memory = (layout.peak_bytes + nanotron_flat_gradients(cfg, layout.args, grid, layout.pp_rank)) / GIB
        reserve = layout.memory.get(plan.ALLOCATOR_RESERVE_ROW, 0) / GIB
        transient = plan.transient_bytes(layout.memory, layout.args) / GIB
        row = {**cell, "estimate": layout.mfu * 100, "mfu_ratio": layout.mfu * 100 / cell["mfu_percent"],
               "memory": memory, "memory_ratio": memory / cell["memory_gb"],
               # the share of the transient bytes the measured reserve beyond the plan's other bytes is
               "measured_reserve": (cell["memory_gb"] - memory + reserve) / transient,
               "layout": layout, "held_out": cell["nodes"] > FITTED_NODES}
        if with_ranks:
            row["rank"], row["grids"], row["first"] = rank_of_measured(cfg, cell, device)
        rows.append(row)
    return rows


def estimated_mfu(cell: dict, device) -> float:
    """The plan's MFU for the cell's measured layout, from its step time alone (no memory)."""
    cfg = model_config(cell)
    grid = GridShape(dp=cell["dp"], tp=cell["tp"], pp=cell["pp"])
    args = layout_args(grid, cell["micro_batch"], cell["zero_stage"])
    shape = BatchShape(cell["micro_batch"], SEQ, args.grad_accum, grid.dp)
    seconds = sum(plan.slowest_stage_seconds(cfg, args, grid, 1, shape, PRECISION, device).values())
    peak = device.peak_flops["bfloat16"]
    return shape.tokens_per_step * flops_per_token(cfg, SEQ) / (seconds * grid.world_size * peak)


def fit_loss(cells: list[dict], constants: Constants) -> float:
    device = published_profile("H100", constants)
    return sum(abs(math.log(estimated_mfu(cell, device) * 100 / cell["mfu_percent"]))
               for cell in cells if cell["nodes"] <= FITTED_NODES)


def fit(cells: list[dict]) -> Constants:
    """Coordinate search over the constants, each by factors of a shrinking step, from the current ones."""
    best, loss = Constants(), fit_loss(cells, Constants())
    for step in (1.5, 1.2, 1.08):
        improved = True
        while improved:
            improved = False
            for name in Constants._fields:
                for factor in (step, 1 / step):
                    value = getattr(best, name) * factor
                    low, high = BOUNDS[name]
                    if not low <= value <= high:
                        continue
                    trial = best._replace(**{name: value})
                    trial_loss = fit_loss(cells, trial)
                    if trial_loss < loss - 1e-4:
                        best, loss, improved = trial, trial_loss, True
                        print(f"  {name} = {value:.4g}: sum of |log ratio| {loss:.4f}", flush=True)
    return best


def read_runs() -> list[dict]:
    return read_published("ultrascale_playbook_runs")


def score_runs(runs: list[dict], device) -> list[dict]:
    """Every run of the Playbook's table (ultrascale_playbook_runs.csv) planned for lesson 07's trainer
    as the cells are (layout_args): the fullest stage's bytes with nanotron's flat gradients, over the
    run's reserved memory where it finished, and the plan's verdict (fits 90% of 80 GiB, as `fits`)
    against how it ended. A layout lesson 07 refuses has no plan ("refused")."""
    shapes = {cell["model_b"]: cell for cell in read_cells()}
    scored = []
    for run in runs:
        cfg = model_config({**shapes[run["model_b"]], "n_kv_heads": run["n_kv_heads"]})
        grid = GridShape(dp=run["dp"], tp=run["tp"], pp=run["pp"])
        layout = layout_of(cfg, grid, run["micro_batch"], run["zero_stage"])
        if layout is None:
            scored.append({**run, "refused": True})
            continue
        args, shape = layout
        peak = fullest_stage_bytes(cfg, args, grid, shape, device, nanotron=True)
        scored.append({**run, "refused": False, "planned_gib": peak / GIB, "fits": peak <= USABLE,
                       "memory_ratio": peak / GIB / run["memory_reserved_gb"] if run["status"] == "Success" else None})
    return scored


def runs_summary(scored: list[dict]) -> dict:
    """Over the planned runs: how many finished and ran out of memory, the memory ratio's median and the
    share within MEMORY_TOLERANCE (finished runs), and the share of each outcome the verdict foresaw."""
    planned = [run for run in scored if not run["refused"]]
    finished = [run for run in planned if run["status"] == "Success"]
    oom = [run for run in planned if run["status"] == "OOM"]
    ratios = [run["memory_ratio"] for run in finished]
    return {"runs": len(scored), "refused": len(scored) - len(planned), "finished": len(finished), "oom": len(oom),
            "memory_median": statistics.median(ratios) if ratios else math.nan,
            "memory_within": sum(abs(r - 1) <= MEMORY_TOLERANCE for r in ratios) / len(ratios) if ratios else math.nan,
            "finished_fit": sum(run["fits"] for run in finished) / len(finished) if finished else math.nan,
            "oom_refused": sum(not run["fits"] for run in oom) / len(oom) if oom else math.nan}


def print_runs(runs: list[dict]) -> None:
    with_reserve = score_runs(runs, published_profile("H100"))
    without = score_runs(runs, published_profile("H100", allocator_reserve=0.0))
    print(f"the plan's memory against every run of the Playbook's table (benchmarks/published/"
          f"ultrascale_playbook_runs.csv; commit {commit()}): the fullest stage's bytes over the run's reserved "
          f"memory where it finished, and the verdict (fits {1 - plan.PLAN_MARGIN:.0%} of 80 GiB) against how it ended")
    print(f"{'model':>6}  {'reserve':<9}{'runs':>6}{'refused':>8}{'finished':>9}{'OOM':>6}{'median':>8}"
          f"{'within 25%':>11}{'finished, fits':>16}{'OOM, does not':>15}")
    for model in sorted({run["model_b"] for run in runs}) + ["all"]:
        for name, scored in ((f"{ALLOCATOR_RESERVE:.3f}", with_reserve), ("none", without)):
            s = runs_summary([run for run in scored if model == "all" or run["model_b"] == model])
            print(f"{model:>6}  {name:<9}{s['runs']:>6}{s['refused']:>8}{s['finished']:>9}{s['oom']:>6}"
                  f"{s['memory_median']:>8.2f}{s['memory_within']:>11.0%}{s['finished_fit']:>16.0%}"
                  f"{s['oom_refused']:>15.0%}")


def fit_allocator_reserve(cells: list[dict]) -> float:
    """The allocator's reserve, as a share of the transient bytes, that best matches the measured reserved
    memory of the cells of up to FITTED_NODES nodes: the smallest sum of |log memory ratio|, in steps of 0.001."""
    rows = [row for row in evaluate(cells, published_profile("H100", allocator_reserve=0.0), with_ranks=False)
            if not row["held_out"]]
    base = [(row["memory"], plan.transient_bytes(row["layout"].memory, row["layout"].args) / GIB, row["memory_gb"])
            for row in rows]

    def loss(share: float) -> float:
        return sum(abs(math.log((memory + share * transient) / measured)) for memory, transient, measured in base)

    return min((share / 1000 for share in range(1001)), key=loss)


def commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                          text=True).stdout.strip() or "unknown"


def summary(rows: list[dict]) -> dict:
    held = [row["mfu_ratio"] for row in rows if row["held_out"]]
    fitted = [row["mfu_ratio"] for row in rows if not row["held_out"]]

    def worst(ratios):
        return max(ratios, key=lambda r: max(r, 1 / r))

    return {"cells": len(rows),
            "mfu_within": sum(1 / MFU_TOLERANCE <= row["mfu_ratio"] <= MFU_TOLERANCE for row in rows),
            "top5": sum(1 <= row["rank"] <= 5 for row in rows),
            "memory_within": sum(abs(row["memory_ratio"] - 1) <= MEMORY_TOLERANCE for row in rows),
            "memory_worst": worst([row["memory_ratio"] for row in rows]),
            "memory_fitted_median": statistics.median(row["memory_ratio"] for row in rows if not row["held_out"]),
            "memory_held_out_median": statistics.median(row["memory_ratio"] for row in rows if row["held_out"]),
            "measured_reserve": sorted(row["measured_reserve"] for row in rows),
            "fitted_median": statistics.median(fitted), "fitted_worst": worst(fitted),
            "held_out_median": statistics.median(held), "held_out_worst": worst(held)}


def print_report(rows: list[dict]) -> None:
    print(f"the plan's step-time model and memory against the Ultra-Scale Playbook's best layouts (8 x H100 per node; "
          f"commit {commit()}); fitted on cells of <= {FITTED_NODES} nodes, * = held out")
    print(f"{'model':>6}{'nodes':>6}  {'dp x tp x pp':<14}{'mbs':>4}{'acc':>5}{'ZeRO':>5}{'MFU %':>7}{'est %':>7}"
          f"{'ratio':>7}{'rank':>8}  {'plan first':<16}{'GiB':>7}{'plan':>7}{'ratio':>7}")
    for row in rows:
        print(f"{row['model_b']:>6}{row['nodes']:>5}{'*' if row['held_out'] else ' '}  "
              f"{'{} x {} x {}'.format(row['dp'], row['tp'], row['pp']):<14}{row['micro_batch']:>4}"
              f"{row['grad_accum']:>5}{row['zero_stage']:>5}{row['mfu_percent']:>7.2f}{row['estimate']:>7.2f}"
              f"{row['mfu_ratio']:>7.2f}{(str(row['rank']) if row['rank'] else 'n/a') + '/' + str(row['grids']):>8}  "
              f"{row['first']:<16}{row['memory_gb']:>7.1f}{row['memory']:>7.1f}{row['memory_ratio']:>7.2f}")
    print("\nparts of the estimated step (s) for each cell's measured layout:")
    for row in rows:
        print(f"  {row['model_b']:>5} B {row['nodes']:>2} nodes: " + ", ".join(
            f"{name} {seconds:.3f}" for name, seconds in row["layout"].seconds.items() if seconds >= 0.0005))
    misses = [row for row in rows if not 1 / MFU_TOLERANCE <= row["mfu_ratio"] <= MFU_TOLERANCE]
    if misses:
        print(f"\ncells whose estimate is off by more than {MFU_TOLERANCE} x, and the term that misses:")
        for row in misses:
            print(f"  {row['model_b']} B on {row['nodes']} nodes (ratio {row['mfu_ratio']:.2f}): "
                  f"{missing_term(row['layout'], row['mfu_percent'] / 100)}")
    s = summary(rows)
    print(f"\nsummary over {s['cells']} cells: MFU within {MFU_TOLERANCE} x in {s['mfu_within']} "
          f"({s['mfu_within'] / s['cells']:.0%}); measured best among the plan's first 5 grids in {s['top5']} "
          f"({s['top5'] / s['cells']:.0%}); memory within {MEMORY_TOLERANCE:.0%} in {s['memory_within']} "
          f"(worst ratio {s['memory_worst']:.2f})")
    print(f"MFU ratio estimate / measured: fitted cells median {s['fitted_median']:.2f}, "
          f"worst {s['fitted_worst']:.2f}; "
          f"held-out cells median {s['held_out_median']:.2f}, worst {s['held_out_worst']:.2f}")
    reserve = s["measured_reserve"]
    print(f"memory ratio plan / measured reserved: fitted cells median {s['memory_fitted_median']:.2f}, held-out "
          f"cells median {s['memory_held_out_median']:.2f}; the measured reserve beyond the plan's other bytes, as "
          f"a share of the transient bytes: {reserve[0]:.2f} to {reserve[-1]:.2f} (median "
          f"{statistics.median(reserve):.2f}) where the profile takes {ALLOCATOR_RESERVE:.3f}")


def peer_rows(device) -> list[dict]:
    """torchtitan's bf16 rows of benchmarks/published/peers.csv whose layout the source states
    whole (dp sharded as FSDP, that is ZeRO-3; tp; local batch; sequence; recomputation; compile),
    priced for lesson 07's trainer on the published H100 profile (torchtitan's H100 is the 96 GB,
    500 W part: a little more memory, lower clocks): estimated over measured tokens/s per GPU. Our
    tp has no asynchronous overlap: torchtitan's async-TP rows are priced without it."""
    rows = []
    for row in read_published("peers"):
        if row["framework"] != "torchtitan" or row["precision"] != "bf16" or row["pp"] != 1 or row["cp"] != 1:
            continue
        cfg, grid = model_config(row), GridShape(dp=row["dp"], tp=row["tp"])
        recompute = "full" if row["activation_checkpointing"] == "full" else "selective"
        args = full_5d.parse_args(["--dp", str(grid.dp), "--tp", str(grid.tp), "--zero-stage", "3",
                                   "--micro-batch-size", str(row["local_batch"]), "--grad-accum", "1",
                                   "--seq-len", str(row["seq_len"]), "--recompute", recompute, "--dtype", "bfloat16",
                                   "--gpu", "H100", "--gpus", str(grid.world_size)]
                                  + ["--sequence-parallel"] * (grid.tp > 1) + ["--compile"] * bool(row["compile"]))
        shape = BatchShape(row["local_batch"], row["seq_len"], 1, grid.dp)
        seconds = sum(plan.slowest_stage_seconds(cfg, args, grid, 1, shape, PRECISION, device).values())
        estimate = shape.tokens_per_step / seconds / grid.world_size
        rows.append({**row, "estimate": estimate, "ratio": estimate / row["tokens_per_s_per_gpu"]})
    return rows


def print_peers(rows: list[dict]) -> None:
    print("\nheld out: torchtitan's bf16 runs (benchmarks/published/peers.csv), tokens/s per GPU")
    print(f"  {'model':<14}{'GPUs':>5}  {'layout':<16}{'seq':>7}  {'AC':<19}{'compile':>8}{'async tp':>9}"
          f"{'measured':>10}{'estimate':>10}{'ratio':>7}")
    for row in rows:
        layout = f"fsdp{row['dp']}" + (f" tp{row['tp']}" if row["tp"] > 1 else "") + f" b{row['local_batch']}"
        print(f"  {row['model']:<14}{row['gpus']:>5}  {layout:<16}{row['seq_len']:>7}"
              f"  {row['activation_checkpointing']:<19}{row['compile']:>8}{str(row['async_tp'] or 0):>9}"
              f"{row['tokens_per_s_per_gpu']:>10,.0f}{row['estimate']:>10,.0f}{row['ratio']:>7.2f}")
    ratios = [row["ratio"] for row in rows]
    print(f"torchtitan rows: median ratio {statistics.median(ratios):.2f}, worst "
          f"{max(ratios, key=lambda r: max(r, 1 / r)):.2f}, within {MFU_TOLERANCE} x in "
          f"{sum(1 / MFU_TOLERANCE <= r <= MFU_TOLERANCE for r in ratios)} of {len(ratios)}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fit", action="store_true",
                        help="search the published profiles' constants on the cells of up to 8 nodes, print them")
    parser.add_argument("--runs", action="store_true",
                        help="the plan's memory and verdict against every run of the Playbook's table (~1 min)")
    args = parser.parse_args(argv)
    if args.runs:
        print_runs(read_runs())
        return
    cells = read_cells()
    if args.fit:
        print("fitting on the cells of up to 8 nodes:")
        print(fit(cells))
        print(f"the allocator's reserve: {fit_allocator_reserve(cells):.3f} of the transient bytes")
        return
    device = published_profile("H100")
    print_report(evaluate(cells, device))
    print_peers(peer_rows(device))


if __name__ == "__main__":
    sys.exit(main())
