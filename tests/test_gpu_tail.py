"""benchmarks/gpu_tail.py's CPU mode: the step tail's parts, old path against new, on the tiny preset."""

import importlib.util
import re

from picotron_like.lessons import REPO_ROOT

PARTS = ["accumulate, first micro-batch", "accumulate, later micro-batch", "norm", "clip", "optimizer",
         "publish cast", "zero"]


def gpu_tail():
    spec = importlib.util.spec_from_file_location("gpu_tail", REPO_ROOT / "benchmarks" / "gpu_tail.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tail_benchmark_times_every_part_and_counts_its_bytes(capsys):
    """One line per part with both paths' times, then the step's total: 80 bytes per parameter
    before (the issue's count), 48 now, at one micro-batch; each later micro-batch adds 22 and 10."""
    module = gpu_tail()
    module.main(["--repeats", "1", "--grad-accum", "2"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step tail, tiny (") and " on CPU" in lines[0]
    rows = {line[:31].strip(): line[31:].split() for line in lines[2:]}
    assert list(rows) == [*PARTS, "tail of a step, 2 micro-batches"]
    for part in PARTS:
        old_ms, new_ms, old_bytes, new_bytes = rows[part][:4]
        assert float(old_ms) > 0 and float(new_ms) >= 0
        assert (int(old_bytes), int(new_bytes)) == module.BYTES[part]
    assert rows["tail of a step, 2 micro-batches"][2:4] == ["102", "58"]
    assert re.fullmatch(r"\d+\.\d\dx", rows["tail of a step, 2 micro-batches"][4])
    one_step = module.report({part: (1.0, 1.0) for part in PARTS}, 10**6, 1)
    assert one_step[-1].split()[-4:-2] == ["80", "48"]
