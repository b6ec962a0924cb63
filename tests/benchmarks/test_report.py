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
