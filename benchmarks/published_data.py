"""
Published measurements the step-time model is held against, read from benchmarks/published/*.csv.

    read_published("ultrascale_playbook_best_configs")   # the Playbook's 26 best layouts (H100, nanotron)
    read_published("ultrascale_playbook_runs")           # its 2,884 runs of those shapes: finished or out of memory
    read_published("peers")                              # picotron's, torchtitan's, Megatron-LM's figures

Each file is a CSV whose '#' lines are notes (sources, conventions, what could not be checked); every row
carries its own source and date, and the model's shape, so a row stands alone. `read_published(name)`
returns the rows as dicts keyed by the header: a whole number becomes an int, a decimal a float, an empty
field None, anything else stays a string; a field the source does not state is empty. `model_config(row)`
builds the row's GPTConfig from its shape columns (vocab_size, seq_len, n_layers, hidden, n_heads,
n_kv_heads, ffn_hidden) for a SwiGLU row (`mlp` "swiglu"; Megatron-LM's GPT rows are "gelu", two matrices,
which this project's GPT cannot state). This project's GPT always has an LM head of its own, so for a row
whose `tied_embeddings` is 1 the published model holds one vocab_size x hidden matrix fewer than the
config's count_parameters()["total"] (its FLOPs are the same: the head's matmul runs either way).

From a script in benchmarks/:  from published_data import read_published, model_config
From a test (root on sys.path): from benchmarks.published_data import read_published, model_config
"""

import csv
import re
from pathlib import Path

from picotron_like.model import GPTConfig

PUBLISHED_DIR = Path(__file__).resolve().parent / "published"

# Decimal literals only: a field such as a date or a short commit must never turn into a number by
# accident, as float() would do for "1e5" or "inf".
_INT = re.compile(r"-?\d+")
_FLOAT = re.compile(r"-?\d+\.\d*")


def _typed(field: str):
    if field == "":
        return None
    if _INT.fullmatch(field):
        return int(field)
    if _FLOAT.fullmatch(field):
        return float(field)
    return field


def read_published(name: str) -> list[dict]:
    """The rows of benchmarks/published/<name>.csv as dicts with typed numbers, '#' lines skipped."""
    path = PUBLISHED_DIR / f"{name}.csv"
    with path.open(newline="") as file:
        lines = [line for line in file if not line.startswith("#")]
    return [{key: _typed(value) for key, value in row.items()} for row in csv.DictReader(lines)]


def model_config(row: dict) -> GPTConfig:
    """The GPTConfig of a published row's model (dense, untied head: see the module's docstring)."""
    if row["mlp"] != "swiglu":
        raise ValueError(f"a {row['mlp']!r} MLP: picotron_like's GPT is SwiGLU only")
    return GPTConfig(vocab_size=row["vocab_size"], seq_len=row["seq_len"], n_layers=row["n_layers"],
                     hidden=row["hidden"], n_heads=row["n_heads"], n_kv_heads=row["n_kv_heads"],
                     ffn_hidden=row["ffn_hidden"])
