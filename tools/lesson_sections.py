"""
Code lines per section of each lesson: how much of a lesson is the technique.

A lesson is cut into sections by fence lines, one comment line per section:

    # ==== the technique: <what>              (may appear several times: the simplest form, refinements)
    # ==== configuration rules
    # ==== measuring the three challenges
    # ==== main

Counted: non-blank lines of code, outside docstrings and comments. Lines before the first fence
(imports) count as "preamble". Run:  python tools/lesson_sections.py [FILES...]
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from collections import Counter
from pathlib import Path

FENCE = "# ===="
REPO_ROOT = Path(__file__).resolve().parent.parent


def code_lines(source: str) -> set[int]:
    """Line numbers holding code: not blank, not only a comment, not inside a docstring."""
    docstring_lines = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                docstring_lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENCODING, tokenize.ENDMARKER}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skip:
            lines.update(range(token.start[0], token.end[0] + 1))
    return lines - docstring_lines


def section_of(line: str) -> str:
    """'technique' for every technique fence, else the fence's own words."""
    words = line[len(FENCE):].strip("= ").strip()
    return "technique" if words.startswith("the technique") else words


def sections(path: Path) -> Counter:
    source = path.read_text()
    code = code_lines(source)
    counts, current = Counter(), "preamble"
    for number, line in enumerate(source.splitlines(), start=1):
        if line.startswith(FENCE):
            current = section_of(line)
        elif number in code:
            counts[current] += 1
    return counts


def main(argv=None) -> None:
    paths = [Path(p) for p in (argv or sys.argv[1:])] or sorted(REPO_ROOT.glob("0*_*.py"))
    names = ["preamble", "technique", "configuration rules", "measuring the three challenges", "main"]
    short = ["preamble", "technique", "config", "measuring", "main"]
    print(f"{'lesson':<26}" + "".join(f"{n:>11}" for n in short) + f"{'total':>8}{'technique':>11}")
    for path in paths:
        counts = sections(path)
        extras = [n for n in counts if n not in names]      # a fence with words of its own
        total = sum(counts.values())
        share = 100 * counts["technique"] / total if total else 0.0
        print(f"{path.name:<26}" + "".join(f"{counts[n]:>11}" for n in names)
              + f"{total:>8}{share:>10.0f}%" + "".join(f"  (+{counts[n]} in '{n}')" for n in extras))


if __name__ == "__main__":
    main()
