"""Each lesson is free of the lessons after it, read off the code, as test_lesson_imports reads the imports.

What a later file needs from an earlier lesson it reaches by subclassing or wrapping from the later
file, so an earlier lesson, and the shared package, never name a later file (03_zero_bubble.py
continues 03_pipeline_parallel.py, so it is later than it; 07_full_5d.py and its siblings are later
than 01-06) nor use an identifier that a later file exports (a name defined at its top level that no
earlier file defines too: generic ones such as main or report are every lesson's own). Names are
looked for in the code (attributes, keywords, names not bound in the file) and the later files'
names in its strings, docstrings and comments too. The one exception is rule 2's: a refusal message,
a string raised or collected into the problems a ConfigError lists, may point a reader to 07's file.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize

import pytest

from picotron_like.lessons import REPO_ROOT

LESSONS = sorted(path.stem for path in REPO_ROOT.glob("0[1-7]_*.py"))
PACKAGE = sorted((REPO_ROOT / "picotron_like").glob("*.py"))
FIRST_OF_EACH_NUMBER = {min(name for name in LESSONS if name[:2] == lesson[:2]) for lesson in LESSONS}


def is_later(name: str, than: str | None) -> bool:
    """Whether lesson file `name` comes after `than` (None: the package, before every lesson)."""
    if than is None or name[:2] > than[:2]:
        return True
    return name[:2] == than[:2] and than in FIRST_OF_EACH_NUMBER and name != than


def top_level_names(tree: ast.Module) -> set[str]:
    """The names a file defines at its top level, without the handles on other lessons (x = load_lesson(...))."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            value = node.value
            if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "load_lesson":
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)}
    return names


def parsed(path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


TREES = {name: parsed(REPO_ROOT / f"{name}.py") for name in LESSONS} | {path.stem: parsed(path) for path in PACKAGE}
DEFINED = {name: top_level_names(tree) for name, tree in TREES.items()}
PACKAGE_NAMES = set().union(*(DEFINED[path.stem] for path in PACKAGE))


def is_distinctive(identifier: str) -> bool:
    """A name no prose or unrelated code uses by chance: snake_case of two words or more, or CamelCase of two."""
    return "_" in identifier.strip("_") or re.search("[a-z][A-Z]", identifier) is not None


def exported(name: str) -> set[str]:
    """What a lesson file exports: its distinctive top-level names that no other lesson file defines (a
    name every lesson defines, such as train_step or parse_args, is each lesson's own)."""
    others = set().union(*(DEFINED[other] for other in LESSONS if other != name))
    return {identifier for identifier in DEFINED[name] - others if is_distinctive(identifier)}


def later_identifiers(lesson: str | None) -> dict[str, str]:
    """identifier -> the later file that exports it, for a lesson (None: the package)."""
    own = set(PACKAGE_NAMES).union(*(DEFINED[name] for name in LESSONS if not is_later(name, lesson)))
    return {identifier: name for name in LESSONS if is_later(name, lesson) for identifier in sorted(exported(name) - own)}


def bound_names(tree: ast.Module) -> set[str]:
    """Every name the file binds anywhere: assignments, parameters, definitions, imports."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return bound


def used_identifiers(tree: ast.Module):
    """(line, identifier) of every attribute, keyword and name the file uses and does not bind itself."""
    bound = bound_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            used = node.lineno, node.attr
        elif isinstance(node, ast.keyword) and node.arg:
            used = node.value.lineno, node.arg
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            used = node.lineno, node.id
        else:
            continue
        if used[1] not in bound:
            yield used


def refusal_lines(tree: ast.Module) -> set[int]:
    """The lines of strings that are refusal messages: raised, or appended to a list of problems."""
    lines = set()
    for node in ast.walk(tree):
        refusal = isinstance(node, ast.Raise) or (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "problems")
        if refusal:
            lines |= set(range(node.lineno, node.end_lineno + 1))
    return lines


def named_files(path, lesson: str | None, identifiers):
    """(line, name) for every later file, or identifier it exports, named in a string or a comment,
    refusals aside."""
    names = [name for name in LESSONS if is_later(name, lesson)] + sorted(identifiers)
    pattern = re.compile(r"\b(" + "|".join(names) + r")\b")
    refusals = refusal_lines(TREES[path.stem])
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type not in (tokenize.STRING, tokenize.COMMENT, getattr(tokenize, "FSTRING_MIDDLE", -1)):
            continue
        for found in pattern.finditer(token.string):
            line = token.start[0] + token.string.count("\n", 0, found.start())
            if token.type == tokenize.COMMENT or line not in refusals:
                yield line, found.group(1)


def mentions_of_later_files(path, lesson: str | None) -> list[str]:
    identifiers = later_identifiers(lesson)
    found = [f"{path.name}:{line}: {name} (exported by {identifiers[name]}.py)"
             for line, name in used_identifiers(TREES[path.stem]) if name in identifiers]
    found += [f"{path.name}:{line}: names {name}" + (f" (exported by {identifiers[name]}.py)" if name in identifiers
                                                     else ".py") for line, name in named_files(path, lesson, identifiers)]
    return sorted(set(found))


@pytest.mark.parametrize("lesson", [name for name in LESSONS if not name.startswith("07")])
def test_a_lesson_names_nothing_of_the_lessons_after_it(lesson):
    found = mentions_of_later_files(REPO_ROOT / f"{lesson}.py", lesson)
    assert not found, "a later lesson reaches this one by subclassing or wrapping it:\n" + "\n".join(found)


@pytest.mark.parametrize("path", PACKAGE, ids=lambda path: path.name)
def test_the_package_names_no_lesson_file_nor_its_identifiers(path):
    found = mentions_of_later_files(path, None)
    assert not found, "the package serves every lesson alike:\n" + "\n".join(found)


def test_the_reader_finds_what_it_refuses():
    """The test can see what it forbids: names in code and in text, and it lets refusals through."""
    source = ('import x\nproblems = []\nproblems.append("run 07_full_5d.py")\nraise ValueError("see 07_fp8.py")\n'
              'y = x.split_moe_mlp\n')
    tree = ast.parse(source)
    assert ("split_moe_mlp" in {name for _, name in used_identifiers(tree)}
            and "split_moe_mlp" in later_identifiers("02_tensor_parallel"))
    assert not is_distinctive("parallelize") and is_distinctive("ZeroBubblePipeline")
    assert refusal_lines(tree) == {3, 4}
    assert "03_zero_bubble" in {name for name in LESSONS if is_later(name, "03_pipeline_parallel")}
    assert not is_later("03_pipeline_parallel", "03_zero_bubble")
