"""Measurement observes from outside, read off the code (DESIGN rule 11): a meter uses hooks the
technique calls anyway (module and autograd hooks, comm.call, Optimizer step hooks, a context the
lesson enters for one step), and never reshapes what it measures.

Read here: the measuring code (every lesson's "measuring the three challenges" sections, the
package's meters in metrics.py and pipeline_tools.py, and 07_report.py, which is all measurement)
calls neither globals() nor setattr(), and assigns no attribute but its own (self's) or that of a
copy it made (copy.copy): no swapped module globals, no replaced optimizer.step, no dispatch
wrapped in place. Each of those stood in the code once, and this test fails on it.
"""

from __future__ import annotations

import ast

import pytest

from picotron_like.lessons import REPO_ROOT

FENCE = "# ===="
WHOLLY_MEASUREMENT = ["picotron_like/metrics.py", "picotron_like/pipeline_tools.py", "07_report.py"]
LESSONS = sorted(path.name for path in REPO_ROOT.glob("0[1-7]_*.py") if path.name not in WHOLLY_MEASUREMENT)


def measuring_lines(source: str) -> set[int]:
    """The line numbers inside a lesson's "measuring ..." sections."""
    lines, section = set(), ""
    for number, line in enumerate(source.splitlines(), 1):
        if line.startswith(FENCE):
            section = line
        if "measuring" in section:
            lines.add(number)
    return lines


def writes_from_outside(source: str, lines: set[int] | None) -> list[str]:
    """The globals()/setattr() calls and the attribute assignments to anything but self, cls or a
    copy.copy the same function made, on `lines` (None: every line)."""
    found = []
    for scope in ast.walk(ast.parse(source)):
        if not isinstance(scope, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        own = {"self", "cls"} | {target.id for node in ast.walk(scope) if isinstance(node, ast.Assign)
                                 and isinstance(node.value, ast.Call)
                                 and ast.unparse(node.value.func) in ("copy.copy", "copy.deepcopy")
                                 for target in node.targets if isinstance(target, ast.Name)}
        for node in ast.walk(scope):
            if lines is not None and getattr(node, "lineno", None) not in lines:
                continue
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("globals", "setattr"):
                found.append(f"{node.lineno}: {node.func.id}()")
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                if isinstance(target, ast.Attribute) and not (isinstance(target.value, ast.Name)
                                                              and target.value.id in own):
                    found.append(f"{node.lineno}: {ast.unparse(target)} = ...")
    return sorted(set(found))


@pytest.mark.parametrize("name", LESSONS)
def test_a_lessons_measurement_writes_nothing_of_the_technique(name):
    source = (REPO_ROOT / name).read_text()
    assert writes_from_outside(source, measuring_lines(source)) == [], name


@pytest.mark.parametrize("path", WHOLLY_MEASUREMENT)
def test_the_meters_write_nothing_of_what_they_measure(path):
    assert writes_from_outside((REPO_ROOT / path).read_text(), None) == [], path


def test_the_reading_finds_what_patching_looks_like():
    """The three forms that once stood in the code, each found."""
    patched = '''
def measure(model, optimizer, layers):
    globals()["ring_block"] = counting(ring_block)
    optimizer.step = observed(optimizer.step)
    for layer in layers:
        layer.expert_compute = recorded(layer.expert_compute)
    setattr(model, "forward", timed(model.forward))
    kept = copy.copy(layers[0])
    kept.calls = []
'''
    assert writes_from_outside(patched, None) == [
        "3: globals()", "4: optimizer.step = ...", "6: layer.expert_compute = ...", "7: setattr()"]
