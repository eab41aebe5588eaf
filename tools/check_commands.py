"""
Runs every command the documentation prints, on this CPU with few steps, and fails on any error.

Readers copy commands from README.md, from docs/*.md and from each lesson's docstring ("Run it:").
No test runs them, so a renamed flag or a moved file breaks them unnoticed; this script runs them:

    python tools/check_commands.py                       # all of them: about 8 minutes on 2 cores
    python tools/check_commands.py --list                # what runs (and as what), what is skipped and why
    python tools/check_commands.py --only 07_ --timeout 120

Commands. In fenced code blocks, in indented lines and in `code spans`, text that starts with
torchrun, python, python3, pytest, bash or pip (after an optional "$ ") is a command; a lone
program name in a span is only a mention. A trailing # comment is dropped, a line that ends in a
backslash goes on on the next one, `a && b` is two commands, and an optional part in brackets
(`01_data_parallel.py [--mode naive]`) gives two: without it and with it.

Skipped, each on its own line with the reason: installs (pip), the test suite (pytest, .ci/run: it
takes minutes, run it as README.md says), what needs a GPU (benchmarks/gpu_check.sh,
--memory-snapshot, a preset other than tiny and tiny-moe under torchrun or --autotune, whose children
train under torchrun), more than 8 ranks or more
than one node, templates (N, DIR, HOST, <lesson>.py, ...), inputs that neither the repository nor
an earlier command of the same file provides (--data shards, --resume with no earlier --save-dir,
run.jsonl), and this script itself. A file a command writes to a positional argument reads here as
an input: name outputs with their flag (--metrics, --save-dir, -o).

How they run. Each file's commands run in the file's order in a temporary copy of the working tree
(tracked and untracked files, not ignored ones: what a fresh clone holds, plus uncommitted edits),
so a checkpoint one command writes is there for a later command's --resume, and nothing is written
into the repository. torchrun becomes `python -m torch.distributed.run --standalone` (a free port,
no rendezvous to set up), python becomes this interpreter, and OMP_NUM_THREADS=1 (the ranks share
the cores). A lesson under torchrun trains few steps: --steps 2, or the printed --steps capped at
3; --save-every N becomes 1, so the periodic checkpoint runs too (the last step is saved anyway); a
run that resumes trains 4 steps, one past the newest checkpoint a capped run can have written;
--calibrate measures its quick sweep (--calibrate-quick).
The layout fuzzer (tools/fuzz_layouts.py) runs one draw, --n 1. Everything else (benchmarks,
--plan, tools) runs as printed. A command that repeats one that already ran, and writes nothing a
later command reads, does not run twice.

Output: one line per command (ok and its time, FAIL and the last lines of its output, skip and
why), then a summary; the exit code is 1 if any command failed.
"""

from __future__ import annotations

import argparse
import ast
import glob
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SELF = Path(__file__).resolve().relative_to(REPO_ROOT).as_posix()

COMMAND_WORDS = {"torchrun", "python", "python3", "pytest", "bash", "pip"}
PYTHONS = {"python", "python3"}
FEW_STEPS, MAX_STEPS = 2, 3
RESUMED_STEPS = MAX_STEPS + 1
MAX_RANKS = 8
CPU_PRESETS = ("tiny", "tiny-moe")
GPU_ONLY_SCRIPTS = {"benchmarks/gpu_check.sh"}
CUDA_ONLY_FLAGS = {"--memory-snapshot"}
OUTPUT_FLAGS = {"--metrics", "--save-dir", "--profile", "--memory-snapshot", "-o", "--out", "--calibrate",
                "--autotune-out"}
INPUT_FLAGS = {"--data", "--val-data"}
FILE_SUFFIXES = {".bin", ".txt", ".jsonl", ".json", ".pt", ".safetensors", ".npy"}
# Scripts besides the lessons whose size one flag sets, and the small value they run with here.
SMALL_RUNS = {"tools/fuzz_layouts.py": ("--n", "1")}
# torchrun's options that take no value; every other option without "=" takes the next word
TORCHRUN_SWITCHES = {"--standalone", "--no-python", "--no_python", "--module", "-m", "--run-path", "--run_path"}

FENCE = re.compile(r"\s*(```|~~~)")
SPAN = re.compile(r"(?<!`)`([^`]+)`(?!`)")
OPTIONAL = re.compile(r"\s\[([^\]]+)\]")
PLACEHOLDER = re.compile(r"\.\.\.|<[^>]*>.*|[A-Z][A-Z_]*(\.\w+)?")
LESSON = re.compile(r"0\d_\w+\.py")
# torchrun's own log lines, and its report of a failed rank: the ranks' lines before it say why
TORCHRUN_LOG = re.compile(r"[EWI]\d{4} .*torch/distributed/elastic/")
TORCHRUN_REPORT = re.compile(r"torch/distributed/elastic/.*failed \(exitcode")
TAIL_LINES = 12


@dataclass(eq=False)
class Command:
    where: str                  # file:line, where a reader finds it
    document: Path              # the commands of one file share one working copy
    words: list[str]            # as printed, the comment dropped
    kind: str = "unknown"
    skip: str = ""              # why it does not run here ("" if it runs)
    argv: list[str] = field(default_factory=list)
    needs: Command | None = None  # the earlier command that writes the checkpoint it resumes

    @property
    def text(self) -> str:
        return shlex.join(self.words)


@dataclass
class Outcome:
    status: str                 # "ok" or "FAIL"
    seconds: float
    detail: list[str]


# ============================================================================ finding the commands


def documents(root: Path = REPO_ROOT) -> list[Path]:
    """The files whose commands readers see: README.md, docs/**/*.md, the lessons' docstrings."""
    markdown = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    return [path for path in markdown if path.is_file()] + sorted(root.glob("0*.py"))


def is_command(text: str) -> bool:
    words = text.strip().removeprefix("$ ").split()
    return bool(words) and words[0] in COMMAND_WORDS


def with_continuations(lines: list[str], index: int) -> tuple[str, int]:
    """The command at lines[index] with the lines its trailing backslashes continue on, and the
    index of its last line."""
    text = lines[index].strip()
    while text.endswith("\\") and index + 1 < len(lines):
        index += 1
        text = text[:-1].rstrip() + " " + lines[index].strip()
    return text, index


def code_spans(paragraph: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """(line, text) of the command spans in a paragraph; a span may run over a line break."""
    text = "\n".join(line for _, line in paragraph)
    # A lone program name in prose ("under `torchrun`") is a mention, not a command.
    return [(paragraph[0][0] + text.count("\n", 0, match.start()), " ".join(match.group(1).split()))
            for match in SPAN.finditer(text) if is_command(match.group(1)) and len(match.group(1).split()) > 1]


def command_snippets(text: str, first_line: int = 1) -> list[tuple[int, str]]:
    """(line, text) of every command in fenced blocks, indented lines and code spans, in order."""
    lines = text.splitlines()
    snippets, paragraph, fenced, index = [], [], False, 0
    while index < len(lines):
        line, number = lines[index], first_line + index
        is_block_line = fenced or line.startswith("    ")
        if FENCE.match(line) or not line.strip() or (is_block_line and is_command(line)):
            # Code spans never cross a fence or a blank line, so a paragraph ends here.
            snippets += code_spans(paragraph) if paragraph else []
            paragraph = []
        if FENCE.match(line):
            fenced = not fenced
        elif is_block_line and is_command(line):
            command, index = with_continuations(lines, index)
            snippets.append((number, command))
        elif line.strip() and not fenced:
            paragraph.append((number, line))
        index += 1
    return snippets + (code_spans(paragraph) if paragraph else [])


def snippets_of(path: Path) -> list[tuple[int, str]]:
    if path.suffix == ".md":
        return command_snippets(path.read_text())
    body = ast.parse(path.read_text()).body
    docstring = body[0].value if body and isinstance(body[0], ast.Expr) else None
    if not (isinstance(docstring, ast.Constant) and isinstance(docstring.value, str)):
        return []
    # The string starts on the line of its opening quotes.
    return command_snippets(docstring.value, first_line=docstring.lineno)


def optional_variants(text: str) -> list[str]:
    """`x.py [--mode naive]` runs as `x.py` and as `x.py --mode naive`."""
    if not OPTIONAL.search(text):
        return [text]
    return [OPTIONAL.sub("", text), OPTIONAL.sub(lambda match: " " + match.group(1), text)]


def commands_of(snippet: str) -> list[list[str]]:
    """The words of each command a snippet holds."""
    commands = []
    for variant in optional_variants(snippet.strip().removeprefix("$ ")):
        try:
            words = shlex.split(variant, comments=True)
        except ValueError:          # an unbalanced quote: run it as printed and let it fail
            words = variant.split()
        parts, current = [], []
        for word in words + ["&&"]:
            if word == "&&":
                parts.append(current)
                current = []
            else:
                current.append(word)
        commands += [part for part in parts if part and part[0] in COMMAND_WORDS]
    return commands


# ============================================================================ reading a command


def option(words: list[str], name: str) -> str | None:
    """The value of --name (as --name=V or --name V; '_' and '-' alike), None if absent."""
    wanted = name.replace("_", "-")
    for index, word in enumerate(words):
        flag, equals, value = word.partition("=")
        if flag.replace("_", "-") == wanted:
            if equals:
                return value
            return words[index + 1] if index + 1 < len(words) else ""
    return None


def resume_target(args: list[str]) -> str | None:
    """--resume's checkpoint: "latest" when it names none, None without --resume."""
    if "--resume" not in args and option(args, "--resume") is None:
        return None
    value = option(args, "--resume")
    return value if value and not value.startswith("-") else "latest"


def launched(words: list[str]) -> list[str] | None:
    """The words after the launcher (torchrun or python -m torch.distributed.run); None if none."""
    if words[0] == "torchrun":
        return words[1:]
    if words[0] in PYTHONS and words[1:3] == ["-m", "torch.distributed.run"]:
        return words[3:]
    return None


def split_launch(words: list[str]) -> tuple[list[str], list[str]]:
    """torchrun's own options, and the script with its arguments."""
    index = 0
    while index < len(words) and words[index].startswith("-"):
        takes_value = "=" not in words[index] and words[index] not in TORCHRUN_SWITCHES
        index += 1 + takes_value
    return words[:index], words[index:]


def target_and_args(words: list[str], root: Path) -> tuple[str | None, list[str]]:
    """The file a command runs (relative to the repository) and the arguments it gets."""
    launch = launched(words)
    if launch is not None:
        script = split_launch(launch)[1]
        return (script[0], script[1:]) if script else (None, [])
    if words[0] in PYTHONS and words[1:2] == ["-m"] and len(words) > 2:
        module = words[2].replace(".", "/")
        package_main = f"{module}/__main__.py"
        return (package_main if (root / package_main).is_file() else f"{module}.py"), words[3:]
    if words[0] in PYTHONS | {"bash"} and len(words) > 1:
        return words[1], words[2:]
    return None, []


def placeholders(words: list[str], root: Path) -> list[str]:
    """Words a reader replaces: N, DIR, HOST:29500, <lesson>.py, ..."""
    found = []
    for word in words:
        value = word.partition("=")[2] if word.startswith("-") else word
        parts = re.split(r"[/:]", value)
        if any(PLACEHOLDER.fullmatch(part) for part in parts) and not (root / value).exists():
            found.append(word)
    return found


def kind_of(words: list[str], root: Path) -> str:
    """install, tests, template, self, train (a lesson under torchrun), launch (another script
    under torchrun), module, script, shell; unknown when what it runs is not in the repository."""
    if placeholders(words, root):
        return "template"
    if words[0] == "pip" or words[1:3] == ["-m", "pip"]:
        return "install"
    if words[0] == "pytest" or words[1:3] == ["-m", "pytest"] or words[1:2] == [".ci/run"]:
        return "tests"
    target, _ = target_and_args(words, root)
    if target is None or not (root / target).is_file():
        return "unknown"
    if Path(target).as_posix() == SELF:
        return "self"
    if launched(words) is not None:
        return "train" if LESSON.fullmatch(target) else "launch"
    if words[0] == "bash":
        return "shell"
    return "module" if words[1] == "-m" else "script"


def outputs_of(words: list[str]) -> list[str]:
    """What a command writes that a later one may read: the values of its output flags."""
    return [os.path.normpath(value) for flag in OUTPUT_FLAGS if (value := option(words, flag))]


def file_arguments(args: list[str]) -> list[str]:
    """Arguments that name a file to read: a data suffix, not the value of an output or input flag."""
    found, previous = [], ""
    for word in args:
        if not word.startswith("-") and previous not in OUTPUT_FLAGS | INPUT_FLAGS \
                and Path(word).suffix in FILE_SUFFIXES:
            found.append(word)
        previous = word
    return found


# ============================================================================ can it run here?


def needs_gpu(command: Command, target: str | None) -> str:
    if target in GPU_ONLY_SCRIPTS:
        return "needs a GPU (the CUDA and NCCL checks)"
    flags = [flag for flag in CUDA_ONLY_FLAGS if option(command.words, flag) is not None]
    return f"{flags[0]} is CUDA-only" if flags else ""


def needs_more_ranks(command: Command) -> str:
    launch = launched(command.words)
    if "--autotune" in command.words:       # its children run --gpus ranks each
        gpus = option(command.words, "--gpus") or "8"
        return f"--autotune --gpus {gpus}: {gpus} ranks (at most {MAX_RANKS} here)" if int(gpus) > MAX_RANKS else ""
    if launch is None:
        return ""
    options = split_launch(launch)[0]
    nodes = (option(options, "--nnodes") or "1").split(":")[-1]     # a range MIN:MAX may grow to MAX
    ranks = option(options, "--nproc-per-node") or "1"
    if nodes.isdigit() and int(nodes) > 1:
        return f"--nnodes={nodes}: several nodes"
    if ranks == "gpu":
        return "--nproc_per_node=gpu: one rank per GPU"
    return f"{ranks} ranks (at most {MAX_RANKS} here)" if ranks.isdigit() and int(ranks) > MAX_RANKS else ""


def needs_gpu_memory(command: Command, args: list[str]) -> str:
    preset = option(args, "--preset")
    trains = command.kind in ("train", "launch") or "--autotune" in args     # --autotune's children train it
    if trains and preset and preset not in CPU_PRESETS:
        return f"--preset {preset} is sized for GPUs (a CPU trains {' and '.join(CPU_PRESETS)})"
    return ""


def missing_inputs(args: list[str], root: Path, written: dict[str, Command]) -> str:
    """What a command reads that neither the repository nor an earlier command provides."""
    for flag in INPUT_FLAGS:
        pattern = option(args, flag)
        if pattern and not glob.glob(pattern, root_dir=root) and os.path.normpath(pattern) not in written:
            return f"needs {flag} {pattern}, which the repository does not hold"
    resume = resume_target(args)
    # --resume with --save-dir runs with or without a checkpoint there (07 starts at step 0 and
    # says so), so only a checkpoint named outright must exist
    if resume not in (None, "latest") and not (root / resume).exists() and Path(resume).parts[0] not in written:
        return f"--resume {resume}: no such checkpoint, and no earlier command of this file writes it"
    for name in file_arguments(args):
        if not (root / name).exists() and os.path.normpath(name) not in written:
            return f"needs {name}, which neither the repository nor an earlier command of this file provides"
    return ""


def skip_reason(command: Command, root: Path, written: dict[str, Command]) -> str:
    """Why a command cannot run here, "" if it can; the hardware a command needs is named first,
    since no filling in of a template makes it run on this CPU."""
    fixed = {"install": "installs packages",
             "tests": "the test suite itself (minutes; run it as README.md says)",
             "self": "this check itself"}
    if command.kind in fixed:
        return fixed[command.kind]
    target, args = target_and_args(command.words, root)
    hardware = needs_gpu(command, target) or needs_more_ranks(command) or needs_gpu_memory(command, args)
    if hardware or command.kind == "template":
        return hardware or f"a template: fill in {' '.join(placeholders(command.words, root))}"
    return missing_inputs(args, root, written)


# ============================================================================ what runs


def with_flag(args: list[str], name: str, value: str) -> list[str]:
    """args with --name set to value: replaced where given (--name V or --name=V), else appended."""
    result, index, replaced = [], 0, False
    while index < len(args):
        word = args[index]
        if word == name and index + 1 < len(args):
            result += [name, value]
            index += 2
            replaced = True
            continue
        replaced |= word.startswith(name + "=")
        result.append(f"{name}={value}" if word.startswith(name + "=") else word)
        index += 1
    return result if replaced else result + [name, value]


def few_steps(args: list[str]) -> list[str]:
    """A lesson's arguments for a short run (the rule is in the module docstring)."""
    given = option(args, "--steps")
    if resume_target(args) is not None:
        steps = RESUMED_STEPS
    elif given and given.isdigit():
        steps = min(int(given), MAX_STEPS)
    else:
        steps = FEW_STEPS
    if option(args, "--save-every") is not None:
        args = with_flag(args, "--save-every", "1")
    if option(args, "--calibrate") is not None and "--calibrate-quick" not in args:
        args = args + ["--calibrate-quick"]
    return with_flag(args, "--steps", str(steps))


def argv_for(command: Command) -> list[str]:
    words = command.words
    launch = launched(words)
    if launch is not None:
        options, script = split_launch(launch)
        if command.kind == "train":
            script = [script[0], *few_steps(script[1:])]
        standalone = [] if "--standalone" in options else ["--standalone"]
        return [sys.executable, "-m", "torch.distributed.run", *standalone, *options, *script]
    if words[0] in PYTHONS:
        small = SMALL_RUNS.get(target_and_args(words, REPO_ROOT)[0])
        argv = [sys.executable, *words[1:]]
        return with_flag(argv, *small) if small else argv
    return list(words)


def planned_commands(paths: list[Path], root: Path = REPO_ROOT) -> list[Command]:
    """Every command of the files, in order, each with its kind and either its argv or why it is
    skipped."""
    commands = []
    for path in paths:
        written: dict[str, Command] = {}        # what this file's earlier commands write, by path
        not_written: dict[str, Command] = {}    # what skipped commands would have written
        for line, snippet in snippets_of(path):
            for words in commands_of(snippet):
                command = Command(f"{path.relative_to(root)}:{line}", path, words)
                command.kind = kind_of(words, root)
                command.skip = skip_reason(command, root, written)
                unwritten = [word for word in words if os.path.normpath(word) in not_written]
                if unwritten and not command.skip:
                    command.skip = f"needs {unwritten[0]}, which {not_written[os.path.normpath(unwritten[0])].where} " \
                                   f"writes, skipped here"
                if command.skip:
                    not_written.update(dict.fromkeys(outputs_of(words), command))
                    commands.append(command)
                    continue
                command.argv = argv_for(command)
                if resume_target(words) is not None:
                    command.needs = written.get(os.path.normpath(option(words, "--save-dir") or "."))
                written.update(dict.fromkeys(outputs_of(words), command))
                commands.append(command)
    return commands


def writes_or_resumes(command: Command) -> bool:
    return bool(outputs_of(command.words)) or resume_target(command.words) is not None


def repeats(commands: list[Command]) -> dict[Command, Command]:
    """Each command that runs exactly as an earlier one did, and the earlier one. Commands that
    write or resume checkpoints, metrics or profiles always run: a later command may read them."""
    first, repeated = {}, {}
    for command in commands:
        if command.skip or writes_or_resumes(command):
            continue
        key = tuple(command.argv)
        if key in first:
            repeated[command] = first[key]
        else:
            first[key] = command
    return repeated


def selected(commands: list[Command], pattern: str | None) -> list[Command]:
    """The commands whose file:line or text matches, and the runs whose checkpoints they resume."""
    if pattern is None:
        return commands
    wanted = {command for command in commands if re.search(pattern, f"{command.where} {command.text}")}
    for command in reversed(commands):          # a writer comes before the run that resumes it
        if command in wanted and command.needs is not None:
            wanted.add(command.needs)
    return [command for command in commands if command in wanted]


# ============================================================================ running


def working_copy(root: Path, destination: Path) -> Path:
    """The working tree as git lists it: tracked and untracked files, ignored ones left out."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=root, capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, listed):
        source = root / name
        if source.is_file():                # a tracked file deleted in the working tree is gone
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


def descendants(pid: int) -> list[int]:
    """pid's children, their children, ...: torchrun starts its ranks in sessions of their own,
    so killing torchrun or its process group would leave the ranks running."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):   # the process ended while we read
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, pending = [], [pid]
    while pending:
        kids = children.get(pending.pop(), [])
        found += kids
        pending += kids
    return found


def kill_with_descendants(pid: int) -> None:
    for process in [pid, *descendants(pid)]:
        try:
            os.kill(process, signal.SIGKILL)
        except ProcessLookupError:
            pass


def environment(copy: Path) -> dict[str, str]:
    """The copy's package first on the path (the editable install points at the repository), this
    interpreter's bin first for scripts that call python, one thread per rank."""
    python_path = os.pathsep.join(filter(None, [str(copy), os.environ.get("PYTHONPATH")]))
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=python_path, PATH=path)


def failure_lines(stderr: str, stdout: str, code: int | None, timeout: float) -> list[str]:
    lines = stderr.splitlines() or stdout.splitlines()
    for index, line in enumerate(lines):
        if TORCHRUN_REPORT.search(line):
            # torchrun's report (its own traceback, the ChildFailedError banner) only names the rank
            lines = [line for line in lines[:index] if not TORCHRUN_LOG.match(line)] or lines[index:index + 1]
            break
    head = f"timed out after {timeout:g} s" if code is None else f"exit code {code}"
    return [head, *lines[-TAIL_LINES:]]


def run(command: Command, copy: Path, timeout: float) -> Outcome:
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(command.argv, cwd=copy, env=environment(copy), stdin=subprocess.DEVNULL,
                                   stdout=out, stderr=err, text=True)
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:                            # on a timeout, and on Ctrl-C too
            if process.poll() is None:
                kill_with_descendants(process.pid)
                process.wait()
        seconds = time.monotonic() - start
        if code == 0:
            return Outcome("ok", seconds, [])
        out.seek(0)
        err.seek(0)
        return Outcome("FAIL", seconds, failure_lines(err.read(), out.read(), code, timeout))


def shown(argv: list[str]) -> str:
    return shlex.join("python" if word == sys.executable else word for word in argv)


def line(status: str, info: str, command: Command) -> str:
    return f"{status:<4}  {info}  {command.where}  {command.text}"


def print_list(commands: list[Command]) -> None:
    repeated = repeats(commands)
    for command in commands:
        if command.skip:
            print(line("skip", command.skip, command))
        elif command in repeated:
            print(line("same", f"(as {repeated[command].where})", command))
        else:
            print(line("run", command.kind, command))
            print(f"      as  {shown(command.argv)}")


def run_all(commands: list[Command], timeout: float) -> bool:
    """Runs the commands, one line each, then the summary; True if none failed."""
    start, repeated = time.monotonic(), repeats(commands)
    outcomes: dict[Command, Outcome] = {}
    skipped = 0
    with tempfile.TemporaryDirectory(prefix="check_commands_") as scratch:
        copies: dict[Path, Path] = {}
        for command in commands:
            if command.skip:
                skipped += 1
                print(line("skip", command.skip, command), flush=True)
            elif command in repeated:
                first = repeated[command]
                print(line(outcomes[first].status, f"(same as {first.where})", command), flush=True)
            else:
                if command.document not in copies:
                    copies[command.document] = working_copy(REPO_ROOT, Path(scratch) / f"copy{len(copies)}")
                outcome = outcomes[command] = run(command, copies[command.document], timeout)
                print(line(outcome.status, f"{outcome.seconds:5.1f}s", command), flush=True)
                if outcome.status == "FAIL":
                    print(f"      as  {shown(command.argv)}")
                    print("\n".join(f"      | {detail}" for detail in outcome.detail), flush=True)
    failed = [command for command, outcome in outcomes.items() if outcome.status == "FAIL"]
    files = len({command.document for command in commands})
    print(f"\n{len(commands)} commands in {files} file{'s' * (files != 1)}: {len(outcomes)} ran "
          f"({len(outcomes) - len(failed)} ok, {len(failed)} failed), {len(repeated)} repeated one that ran, "
          f"{skipped} skipped; {time.monotonic() - start:.0f} s")
    for command in failed:
        print(line("FAIL", "", command))
    return not failed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--list", action="store_true",
                        help="print what would run (and as what) or be skipped; run nothing")
    parser.add_argument("--only", metavar="REGEX",
                        help="only the commands whose file:line or text matches "
                             "(and the runs whose checkpoints they resume)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per command (default 300)")
    args = parser.parse_args(argv)
    commands = selected(planned_commands(documents()), args.only)
    if args.list:
        print_list(commands)
        return 0
    return 0 if run_all(commands, args.timeout) else 1


if __name__ == "__main__":
    sys.exit(main())
