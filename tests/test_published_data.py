"""The published measurements in benchmarks/published/: they parse, every row names its source and date,
the Playbook's 26 cells are the ones read off its heatmap, and the shapes give the models' published sizes."""

import re

import pytest

from benchmarks.published_data import PUBLISHED_DIR, model_config, read_published
from picotron_like.model import count_parameters

PLAYBOOK = "ultrascale_playbook_best_configs"
CELLS = ("model_b", "nodes", "dp", "tp", "pp", "grad_accum", "micro_batch", "zero_stage", "mfu_percent",
         "memory_gb")


def published_files() -> list[str]:
    return sorted(path.stem for path in PUBLISHED_DIR.glob("*.csv"))


def test_the_loader_types_numbers_and_leaves_the_rest(tmp_path, monkeypatch):
    (tmp_path / "sample.csv").write_text("# a note, skipped\na,b,c,d,e\n12,4.50,2025-02-19,,1e5\n")
    monkeypatch.setattr("benchmarks.published_data.PUBLISHED_DIR", tmp_path)
    assert read_published("sample") == [{"a": 12, "b": 4.5, "c": "2025-02-19", "d": None, "e": "1e5"}]


@pytest.mark.parametrize("name", published_files())
def test_every_row_names_its_source_and_date(name):
    rows = read_published(name)
    assert rows, f"{name}.csv has no rows"
    for row in rows:
        assert isinstance(row["source"], str) and row["source"].strip(), row
        assert re.fullmatch(r"\d{4}-\d{2}(-\d{2})?", str(row["date"])), row
        assert None not in row, f"{name}.csv: a row has more fields than the header: {row}"


def test_the_playbook_file_holds_the_26_cells_of_its_heatmap():
    rows = read_published(PLAYBOOK)
    assert len(rows) == 26
    assert {(row["model_b"], row["nodes"]) for row in rows} == (
        {(size, nodes) for size in (1.34, 3.57, 8.86) for nodes in (1, 2, 4, 8, 16, 32, 64)}
        | {(80, nodes) for nodes in (4, 8, 16, 32, 64)})
    # Column sums and position-weighted sums of ../shared/published/ultrascale_playbook_best_configs.csv,
    # computed when the file was copied (the shared folder is not in the repository): a changed or moved
    # value changes one of them.
    sums = {column: round(sum(row[column] for row in rows), 2) for column in CELLS}
    assert sums == {"model_b": 496.39, "nodes": 505, "dp": 869, "tp": 91, "pp": 104, "grad_accum": 1150,
                    "micro_batch": 69, "zero_stage": 16, "mfu_percent": 840.83, "memory_gb": 1221.04}
    weighted = {column: round(sum(i * row[column] for i, row in enumerate(rows)), 2)
                for column in ("mfu_percent", "memory_gb", "dp", "grad_accum")}
    assert weighted == {"mfu_percent": 9976.48, "memory_gb": 17855.16, "dp": 10126, "grad_accum": 21674}


def test_each_playbook_layout_fills_its_nodes_and_its_batch():
    for row in read_published(PLAYBOOK):
        assert row["dp"] * row["tp"] * row["pp"] == row["nodes"] * row["gpus_per_node"], row
        tokens = row["dp"] * row["grad_accum"] * row["micro_batch"] * row["seq_len"]
        assert tokens == row["global_batch_tokens"], row


def test_the_playbook_shapes_give_the_models_published_sizes():
    """nanotron names a model by its parameter count to 3 significant digits (1.34, 3.57, 8.86, 80 B).
    Its 1.34 B and 3.57 B models tie the LM head to the embedding; this project's GPT never does, so a
    tied model counts one vocab x hidden matrix fewer than count_parameters' total."""
    for row in read_published(PLAYBOOK):
        counts = count_parameters(model_config(row))
        parameters = counts["total"] - row["tied_embeddings"] * counts["embedding"]
        assert parameters == pytest.approx(row["model_b"] * 1e9, rel=0.01), row
        assert float(f"{parameters:.3g}") == row["model_b"] * 1e9, row
