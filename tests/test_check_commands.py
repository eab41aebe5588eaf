"""
tools/check_commands.py finds the documentation's commands (README.md and docs/**/*.md) and decides
each one: the extraction and the classification only, no command runs (the checker itself runs
them: python tools/check_commands.py).
"""

import importlib.util
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def load_checker():
    spec = importlib.util.spec_from_file_location("check_commands", REPO_ROOT / "tools" / "check_commands.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


check = load_checker()
README = check.planned_commands([REPO_ROOT / "README.md"])
# The documentation set, as the checker lists it: README.md, then docs/**/*.md (lessons' docstrings left out).
DOCS = check.planned_commands([path for path in check.documents() if path.suffix == ".md"])


def lessons_of(commands):
    return {match.group(1) for command in commands if (match := re.search(r"\b(0\d)_\w+\.py", command.text))}


def test_readme_runs_a_command_of_every_lesson():
    runnable = [command for command in README if not command.skip]
    assert {f"0{n}" for n in range(1, 8)} <= lessons_of(runnable)


def test_every_documented_command_is_known_and_every_skip_says_why():
    assert {"README.md", "docs/running.md", "docs/07_full_5d.md"} <= {command.where.split(":")[0] for command in DOCS}
    assert not [command.text for command in DOCS if command.kind == "unknown"]
    for command in DOCS:
        assert bool(command.skip) != bool(command.argv), command.text
    reasons = {command.text: command.skip for command in DOCS}
    assert reasons["pytest"].startswith("the test suite")
    assert reasons["bash benchmarks/gpu_check.sh"].startswith("needs a GPU")
    assert any(text.startswith("pip install") and reason == "installs packages" for text, reason in reasons.items())
    assert any("--nnodes=2" in text and "several nodes" in reason for text, reason in reasons.items())
    assert any("--preset 8b" in text and "sized for GPUs" in reason for text, reason in reasons.items())


def test_a_training_command_runs_few_steps_and_a_resume_finds_its_checkpoint():
    """The checkpoint the documentation writes (--steps 40 --save-every 10) is resumed by the next
    command of the same page: the writer is capped, saves every step, and the resumed run trains
    past its last checkpoint."""
    writer, resumer = [command for command in DOCS if "--save-dir ckpt" in command.text and not command.skip
                       and command.where.startswith("docs/running.md")]
    assert resumer.needs is writer and resumer.document == writer.document
    assert check.option(writer.argv, "--save-every") == "1"
    assert int(check.option(writer.argv, "--steps")) <= check.MAX_STEPS < int(check.option(resumer.argv, "--steps"))
    assert writer.argv[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    bare = next(command for command in DOCS if command.text.endswith("--nproc_per_node=4 01_data_parallel.py"))
    assert bare.argv[-2:] == ["--steps", str(check.FEW_STEPS)]


def test_snippets_from_fences_spans_and_docstrings():
    text = "\n".join([
        "Run `torchrun --standalone --nproc_per_node=2",
        "01_data_parallel.py [--mode naive]` or read `torchrun` first.",
        "",
        "```bash",
        "$ python 07_full_5d.py --plan \\",
        "    --preset 8b   # the plan",
        "output line",
        "```",
        "    pip install -e . && pytest",
    ])
    snippets = check.command_snippets(text)
    assert [line for line, _ in snippets] == [1, 5, 9]
    assert [check.commands_of(snippet) for _, snippet in snippets] == [
        [["torchrun", "--standalone", "--nproc_per_node=2", "01_data_parallel.py"],
         ["torchrun", "--standalone", "--nproc_per_node=2", "01_data_parallel.py", "--mode", "naive"]],
        [["python", "07_full_5d.py", "--plan", "--preset", "8b"]],
        [["pip", "install", "-e", "."], ["pytest"]],
    ]
    lessons = check.planned_commands(sorted(REPO_ROOT.glob("0*.py")))
    assert {f"0{n}" for n in range(1, 8)} <= lessons_of([command for command in lessons if not command.skip])


def test_readme_section_counts_are_the_tools_output():
    """README's table of code lines per section is what tools/lesson_sections.py prints for the
    lessons as they are: a changed lesson with a stale table fails here."""
    import subprocess
    printed = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "lesson_sections.py")], capture_output=True,
                             text=True, check=True).stdout
    readme = (REPO_ROOT / "README.md").read_text()
    table = readme[readme.index("```\nlesson  ") + 4:]
    assert table[:table.index("```")] == printed
