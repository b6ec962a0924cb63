"""benchmarks/report.py: tables made from saved runs, written to benchmarks.md and into the
marked blocks of doc pages."""
from __future__ import annotations


import pytest

from benchmark_modules import load

program_results = load("program_results")
report = load("report")
Measurement = program_results.Measurement

PAGE = """# A page

Text before.

<!-- bench: toy "toy: seconds" -->
typed by hand, replaced
<!-- /bench -->

<!-- bench: absent "anything" -->
kept until absent runs here
<!-- /bench -->

Text after.
"""


def test_marked_blocks_are_regenerated_from_the_latest_run(tmp_path, monkeypatch):
    monkeypatch.setenv("DITORCH_BENCH_STORAGE", str(tmp_path / "store"))
    program_results.save_run("toy", [Measurement("toy: seconds per step", "fast", [2.0, 3.0, 4.0]),
                                     Measurement("toy: seconds per step", "slow", [8.0, 9.0, 10.0], {"peer": True}),
                                     Measurement("other group", "x", [1.0])])
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "page.md").write_text(PAGE)
    assert report.main(["--storage", str(tmp_path / "store"), "--out", str(tmp_path / "all.md"),
                        "--docs", str(docs)]) == 0
    page = (docs / "page.md").read_text()
    assert "typed by hand" not in page and "kept until absent runs here" in page
    assert page.startswith("# A page\n\nText before.") and page.endswith("Text after.\n")
    # medians 3 and 9: the fast row runs in a third of its peer's time
    assert "| fast | 3 s | 2 s | 0.33x |  |" in page
    assert "| slow | 9 s | 8 s | *peer* |  |" in page
    assert "other group" not in page
    assert "### other group" in (tmp_path / "all.md").read_text()
    # regenerating is idempotent
    report.main(["--storage", str(tmp_path / "store"), "--out", str(tmp_path / "all.md"), "--docs", str(docs)])
    assert (docs / "page.md").read_text() == page


def test_a_block_naming_no_group_of_the_run_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("DITORCH_BENCH_STORAGE", str(tmp_path / "store"))
    program_results.save_run("toy", [Measurement("toy: seconds per step", "fast", [1.0])])
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "page.md").write_text('<!-- bench: toy "no such group" -->\n<!-- /bench -->\n')
    with pytest.raises(SystemExit, match="no group of toy's run .* starts with 'no such group'"):
        report.main(["--storage", str(tmp_path / "store"), "--out", str(tmp_path / "all.md"), "--docs", str(docs)])


def test_a_block_adds_extra_info_columns_and_keeps_the_saved_order(tmp_path, monkeypatch):
    monkeypatch.setenv("DITORCH_BENCH_STORAGE", str(tmp_path / "store"))
    program_results.save_run("cases", [
        Measurement("cases: search", "case-b", [4.0], {"peer_s": 8.0, "chips": 768, "HSR_sim": 1.14549}),
        Measurement("cases: search", "case-a", [1.0], {"peer_s": 10.0, "chips": 1024, "note": "OOM"}),
    ])
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "page.md").write_text('<!-- bench: cases "cases" columns=chips,HSR_sim,note order=saved -->\n'
                                  "old\n<!-- /bench -->\n")
    report.main(["--storage", str(tmp_path / "store"), "--out", str(tmp_path / "all.md"), "--docs", str(docs)])
    page = (docs / "page.md").read_text()
    assert "| benchmark | median | min | ratio | target | chips | HSR sim | note |" in page
    # saved order (b before a, though a is faster); ratios 4/8 and 1/10; absent values are a dash
    assert page.index("| case-b |") < page.index("| case-a |")
    assert "| case-b | 4 s | 4 s | 0.50x |  | 768 | 1.145 | – |" in page
    assert "| case-a | 1 s | 1 s | 0.10x |  | 1024 | – | OOM |" in page


def test_an_unknown_block_option_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("DITORCH_BENCH_STORAGE", str(tmp_path / "store"))
    program_results.save_run("cases", [Measurement("cases: search", "a", [1.0])])
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "page.md").write_text('<!-- bench: cases "cases" colums=chips -->\n<!-- /bench -->\n')
    with pytest.raises(SystemExit, match=r"unknown bench block option\(s\) \['colums'\]"):
        report.main(["--storage", str(tmp_path / "store"), "--out", str(tmp_path / "all.md"), "--docs", str(docs)])


def test_a_program_without_a_run_here_keeps_its_section(tmp_path, monkeypatch):
    monkeypatch.setenv("DITORCH_BENCH_STORAGE", str(tmp_path / "store"))
    program_results.save_run("toy", [Measurement("toy: seconds per step", "fast", [2.0])])
    out = tmp_path / "all.md"
    out.write_text("# old\n\n## Program elsewhere\n\nits table, from a run on another machine\n\n"
                   "## Program toy\n\nan old toy table\n")
    report.main(["--storage", str(tmp_path / "store"), "--out", str(out), "--docs", ""])
    text = out.read_text()
    assert "its table, from a run on another machine" in text  # no run of it here: kept
    assert "an old toy table" not in text and "| fast | 2 s |" in text  # regenerated
    assert text.index("## Program elsewhere") < text.index("## Program toy")
    report.main(["--storage", str(tmp_path / "store"), "--out", str(out), "--docs", ""])
    assert out.read_text() == text  # idempotent
