"""The published measurements in benchmarks/published/: they parse, every row names its source and date,
the Playbook's 26 cells are the ones read off its heatmap, and the shapes give the models' published sizes."""

import re

import pytest

from benchmarks.published_data import PUBLISHED_DIR, model_config, read_published
from picotron_like.model import count_parameters, flops_per_token

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
    tied model counts one vocab x hidden matrix fewer than count_parameters' total. A run of a GQA
    variant (80 B on 8 nodes, n_kv_heads 8) keeps its model's name: the name is the full-head shape's."""
    for row in read_published(PLAYBOOK):
        counts = count_parameters(model_config({**row, "n_kv_heads": row["n_heads"]}))
        parameters = counts["total"] - row["tied_embeddings"] * counts["embedding"]
        assert parameters == pytest.approx(row["model_b"] * 1e9, rel=0.01), row
        assert float(f"{parameters:.3g}") == row["model_b"] * 1e9, row


def test_each_peer_row_states_a_model_and_a_figure():
    for row in read_published("peers"):
        for column in ("n_layers", "hidden", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "gpus"):
            assert isinstance(row[column], int), (column, row)
        assert row["mlp"] in ("swiglu", "gelu"), row
        figures = (row["tokens_per_s_per_gpu"], row["tflops_per_gpu"], row["mfu_percent"])
        assert any(figure is not None for figure in figures), row


def test_each_stated_peer_layout_fills_its_gpus_and_its_batch():
    for row in read_published("peers"):
        degrees = [row[axis] for axis in ("dp", "tp", "pp", "cp")]
        if None not in degrees:
            assert degrees[0] * degrees[1] * degrees[2] * degrees[3] == row["gpus"], row
        if None not in (row["dp"], row["local_batch"], row["global_batch"]):
            assert row["dp"] * row["local_batch"] * (row["grad_accum"] or 1) == row["global_batch"], row


def test_our_flops_per_token_gives_the_mfu_the_peers_state():
    """torchtitan states 33% to 39% MFU for its bf16 FSDP runs of Llama 3.1 8B on 8 and 128 H100s at
    the H100 SXM peak of 989 TFLOP/s; Megatron-LM prints each row's MFU next to its TFLOP/s per GPU. Our
    flops_per_token (6 N with the head + the full s x s attention) reproduces torchtitan's range from its
    tokens/s, and 989 TFLOP/s turns Megatron-LM's TFLOP/s into its MFU: the conventions agree."""
    peak = 989e12
    torchtitan_bf16 = [row for row in read_published("peers") if row["framework"] == "torchtitan"
                       and row["precision"] == "bf16" and row["gpus"] in (8, 128) and row["tp"] == 1]
    assert len(torchtitan_bf16) == 4
    for row in torchtitan_bf16:
        mfu = row["tokens_per_s_per_gpu"] * flops_per_token(model_config(row), row["seq_len"]) / peak
        assert 0.325 <= mfu < 0.395, (mfu, row)
    megatron = [row for row in read_published("peers") if row["tflops_per_gpu"] is not None]
    assert len(megatron) == 9
    for row in megatron:
        assert round(row["tflops_per_gpu"] * 1e12 / peak * 100) == row["mfu_percent"], row


def test_model_config_refuses_a_gelu_row():
    gelu = next(row for row in read_published("peers") if row["mlp"] == "gelu")
    with pytest.raises(ValueError, match="SwiGLU only"):
        model_config(gelu)


def test_each_playbook_cell_is_one_of_its_runs_and_its_memory_the_runs_reserved_memory():
    """The heatmap's 26 cells are runs of the Playbook's table: the same layout, shape and MFU, and the
    cell's memory is that run's reserved memory (torch.cuda.max_memory_reserved)."""
    runs = read_published("ultrascale_playbook_runs")
    assert len(runs) == 2884 and {run["status"] for run in runs} == {"Success", "OOM"}
    layout = ("model_b", "nodes", "dp", "tp", "pp", "grad_accum", "micro_batch", "zero_stage", "n_kv_heads")
    for cell in read_published(PLAYBOOK):
        matches = [run for run in runs if all(run[key] == cell[key] for key in layout)
                   and run["mfu_percent"] == cell["mfu_percent"]]
        assert [run["memory_reserved_gb"] for run in matches] == [cell["memory_gb"]], cell
