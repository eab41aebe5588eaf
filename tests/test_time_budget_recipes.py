"""benchmarks/time_budget_recipes.py's pure parts: the corpus from a library's sources, the recipes
lesson 07 accepts, the steps that reach a token count, and the table. The benchmark itself (runs of
minutes) is not a test: `--quick` checks it in about a minute."""

import pytest

from benchmarks.time_budget_recipes import (BASELINE, RECIPES, Run, available_recipes, markdown_table,
                                            prepare_corpus, stdlib_sources, steps_for_tokens, summarise,
                                            tokens_per_pass)
from picotron_like.data import read_token_shard
from picotron_like.lessons import load_lesson
from picotron_like.lr_schedule import DEFAULT_DECAY_SHARE


def write(path, text, encoding="utf-8"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode(encoding))


def fake_stdlib(root):
    """A library of 21 UTF-8 modules (one in 20 goes to validation: two here), and files to skip."""
    for index in range(21):
        write(root / ("pkg" if index % 2 else "") / f"mod{index:02d}.py", f"# module {index}\n" + "x = 1\n" * (20 + index))
    write(root / "site-packages" / "installed.py", "installed = True\n")
    write(root / "test" / "test_a.py", "assert True\n")
    write(root / "pkg" / "tests" / "test_b.py", "assert True\n")
    write(root / "latin.py", "# -*- coding: latin-1 -*-\nname = 'café'\n", encoding="latin-1")


def test_the_corpus_is_the_library_sources_in_path_order_without_packages_tests_or_other_encodings(tmp_path):
    fake_stdlib(tmp_path)
    names = [path.relative_to(tmp_path).as_posix() for path in stdlib_sources(tmp_path)]
    assert names == sorted(names) and len(names) == 21
    assert not any(name.startswith(("site-packages", "test/", "pkg/tests")) or name == "latin.py" for name in names)


def test_prepare_corpus_holds_out_whole_files_cuts_validation_to_its_windows_and_is_reused(tmp_path):
    library, data = tmp_path / "lib", tmp_path / "data"
    fake_stdlib(library)
    files = stdlib_sources(library)
    corpus = prepare_corpus(data, library, val_windows=4, seq_len=16)
    assert (corpus.train_files, corpus.val_files) == (19, 2)
    held_out = files[0].stat().st_size + files[20].stat().st_size      # files[::20]
    assert corpus.train_tokens == sum(path.stat().st_size for path in files) - held_out   # byte tokenizer
    assert corpus.val_tokens == read_token_shard(corpus.val).size == 4 * 16 + 1
    assert tokens_per_pass(corpus, seq_len=16) == (corpus.train_tokens - 1) // 16 * 16
    written = corpus.train.stat().st_mtime_ns, corpus.val.stat().st_mtime_ns
    assert prepare_corpus(data, library, val_windows=4, seq_len=16) == corpus
    assert (corpus.train.stat().st_mtime_ns, corpus.val.stat().st_mtime_ns) == written    # reused
    old_size = files[1].stat().st_size
    write(files[1], "y = 2\n")          # another library: prepared again
    again = prepare_corpus(data, library, val_windows=4, seq_len=16)
    assert again.train_tokens == corpus.train_tokens - old_size + len("y = 2\n")


def test_recipes_lesson_07_refuses_are_skipped_with_its_reason_and_the_others_show_their_defaults():
    available, skipped = available_recipes({BASELINE: [], "wsd": RECIPES["wsd"], "muon": RECIPES["muon"],
                                            "bogus": ["--no-such-flag", "1"]})
    assert list(available) == [BASELINE, "wsd", "muon"]
    assert skipped == {"bogus": "unrecognized arguments: --no-such-flag 1"}
    defaults = load_lesson("07_full_5d").parse_args([])
    assert available[BASELINE]["lr"] == defaults.lr and available[BASELINE]["warmup_steps"] == defaults.warmup_steps
    assert "decay_share" not in available[BASELINE]                       # cosine has none
    assert available["wsd"]["decay_share"] == DEFAULT_DECAY_SHARE          # filled in at start-up, shown
    assert available["muon"]["muon_lr"] == defaults.muon_lr and available["muon"]["optimizer"] == "muon"
    assert not any(key.startswith("muon_") for key in available[BASELINE])    # AdamW's recipe runs no Muon


def test_steps_for_tokens_come_nearest_to_the_target_following_the_measured_steps_then_the_last_one():
    ramp = [1024, 2048, 4096, 4096]         # after each step: 1,024, 3,072, 7,168, 11,264 tokens
    assert steps_for_tokens(ramp, 1) == 1
    assert steps_for_tokens(ramp, 3072) == 2
    assert steps_for_tokens(ramp, 3073) == 2
    assert steps_for_tokens(ramp, 5120) == 3                    # a tie: the more steps
    assert steps_for_tokens(ramp, 11264) == 4
    assert steps_for_tokens(ramp, 11264 + 2 * 4096 - 1) == 6    # beyond the measured steps: the last one's size


def run(recipe, seed, loss, comparison="budget", error=None):
    return Run(recipe, comparison, seed, [], error=error, steps=10 + seed, tokens=1000 * (10 + seed),
               wall_s=120.0 + seed, val_loss=loss)


def test_the_table_gives_each_recipe_median_spread_and_change_against_the_baseline():
    runs = [run(BASELINE, 0, 3.0), run(BASELINE, 1, 3.2), run(BASELINE, 2, 3.1),
            run("muon", 0, 2.9), run("muon", 1, 3.0), run("muon", 2, None, error="exit code 1"),
            run(BASELINE, 0, 9.0, comparison="tokens")]
    rows = summarise(runs, "budget", [BASELINE, "muon", "wsd"])
    assert [row["recipe"] for row in rows] == [BASELINE, "muon"]        # wsd did not run
    baseline, muon = rows
    assert (baseline["median"], baseline["min"], baseline["max"], baseline["runs"]) == (3.1, 3.0, 3.2, "3/3")
    assert muon["runs"] == "2/3" and muon["median"] == pytest.approx(2.95)
    assert muon["vs_baseline"] == pytest.approx(-0.15) and baseline["vs_baseline"] == 0
    assert (baseline["tokens"], baseline["steps"], baseline["wall_s"]) == (11000, 11, 121.0)
    table = markdown_table(rows).splitlines()
    assert table[0].startswith("| recipe | val loss, median | min – max | vs baseline |")
    assert table[3] == "| muon | 2.9500 | 2.9000 – 3.0000 | -0.1500 | 10,500 | 10 | 120 | 2/3 |"
    assert summarise(runs, "tokens", [BASELINE])[0]["median"] == 9.0
