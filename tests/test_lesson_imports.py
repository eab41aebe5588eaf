"""One technique per lesson, read off the code's own imports: which lessons each file loads.

A lesson reaches another lesson only through load_lesson("NN_name") (a file name that starts with
a digit cannot be imported with an import statement), so the calls in a file's syntax tree are its
lesson imports. The rule: lessons 02-06 each teach their technique with data parallelism as the only
other axis, so they may load lesson 01 and nothing else (a lesson's continuation, such as
03_zero_bubble.py, may load its own lesson too); lesson 07 (07_full_5d.py and its siblings) is the
one place where techniques compose; the shared package knows no lesson.
"""

from __future__ import annotations

import ast

import pytest

from picotron_like.lessons import REPO_ROOT, load_lesson

LESSONS = sorted(path.stem for path in REPO_ROOT.glob("0[1-7]_*.py"))
TECHNIQUE_LESSONS = [name for name in LESSONS if name[:2] in {"02", "03", "04", "05", "06"}]
# a lesson's main file: the first of its number (03_pipeline_parallel; 03_zero_bubble continues it)
FIRST_OF_EACH_NUMBER = {min(name for name in TECHNIQUE_LESSONS if name[:2] == number[:2]) for number in TECHNIQUE_LESSONS}


def loaded_lessons(path) -> set[str]:
    """The lesson names a file passes to load_lesson, or to importlib.import_module (a name that
    starts with a digit). A lesson loaded by a computed name would hide from this test: refused."""
    loaded = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        argument = node.args[0]
        literal = argument.value if isinstance(argument, ast.Constant) and isinstance(argument.value, str) else None
        if called == "load_lesson":
            assert literal is not None, f"{path.name}:{node.lineno}: load_lesson of a computed name"
            loaded.add(literal.removesuffix(".py"))
        elif called == "import_module" and literal is not None and literal[:1].isdigit():
            loaded.add(literal.removesuffix(".py"))
    return loaded


def test_every_lesson_is_found():
    assert LESSONS == ["01_data_parallel", "02_tensor_parallel", "03_pipeline_parallel", "03_zero_bubble",
                       "04_context_parallel", "05_expert_parallel", "06_zero", "06_zero_muon", "06_zero_offload",
                       "07_activation_offload", "07_autotune", "07_fp8",
                       "07_full_5d", "07_memory_plan", "07_report", "07_sizing"]


def test_lesson_01_stands_alone():
    assert loaded_lessons(REPO_ROOT / "01_data_parallel.py") == set()


@pytest.mark.parametrize("name", TECHNIQUE_LESSONS)
def test_a_technique_lesson_loads_only_data_parallelism(name):
    loaded = loaded_lessons(REPO_ROOT / f"{name}.py")
    own_lesson = {lesson for lesson in TECHNIQUE_LESSONS if lesson[:2] == name[:2] and lesson != name}
    allowed = {"01_data_parallel"} | (own_lesson if name not in FIRST_OF_EACH_NUMBER else set())
    assert loaded <= allowed, f"{name} composes {sorted(loaded - allowed)}: that is lesson 07's"


def test_a_continuation_loads_its_own_lesson():
    assert loaded_lessons(REPO_ROOT / "03_zero_bubble.py") == {"03_pipeline_parallel"}


def test_lesson_07_composes_every_technique():
    assert loaded_lessons(REPO_ROOT / "07_full_5d.py") >= set(LESSONS[:6])
    assert loaded_lessons(REPO_ROOT / "07_memory_plan.py") <= set(LESSONS)


def test_no_sibling_loads_07_and_no_lessons_load_each_other_in_a_cycle():
    """07 loads its siblings (the plan, FP8, the report); a sibling that loaded 07 back would make
    a cycle, so what they share lives in a sibling both load."""
    loads = {name: loaded_lessons(REPO_ROOT / f"{name}.py") for name in LESSONS}
    assert [name for name, loaded in loads.items() if "07_full_5d" in loaded] == []

    def reached(name: str, path: tuple = ()) -> set[str]:
        assert name not in path, f"a cycle: {' -> '.join(path)} -> {name}"
        return set().union(loads[name], *(reached(other, (*path, name)) for other in loads[name]))

    for name in LESSONS:
        reached(name)


def test_the_shared_package_knows_no_lesson():
    for path in sorted((REPO_ROOT / "picotron_like").glob("*.py")):
        assert loaded_lessons(path) == set(), path.name


def test_load_lesson_by_file_name():
    lesson = load_lesson("01_data_parallel.py")
    assert hasattr(lesson, "BucketedDataParallel")
    assert load_lesson("01_data_parallel") is lesson
