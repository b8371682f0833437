"""Numbers only where they are measured: every figure of the README's "at a glance" table appears in
the results files its row names, and results/README.md points at each of those files."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NUMBER = re.compile(r"\d+(?:\.\d+)?")


def glance_rows() -> list[tuple[str, str, list[str]]]:
    """``(what, figure, result files)`` per row of the README's "At a glance" table."""
    text = (ROOT / "README.md").read_text()
    start = text.index("**At a glance**")
    lines = text[start:].splitlines()
    table = []
    for line in lines[1:]:
        if line.startswith("|"):
            table.append(line)
        elif table:
            break
    rows = []
    for line in table[2:]:  # after the heading and the rule
        what, figure, where = (cell.strip() for cell in line.strip("|").split("|"))
        rows.append((what, figure, re.findall(r"`([\w.]+)`", where)))
    return rows


def test_the_table_is_there_and_every_row_names_an_existing_results_file() -> None:
    rows = glance_rows()
    assert len(rows) >= 5
    for what, _, files in rows:
        assert files, f"row {what!r} names no results file"
        for name in files:
            assert (ROOT / "results" / f"{name}.md").exists(), f"row {what!r}: results/{name}.md does not exist"


def test_every_figure_appears_in_the_files_its_row_names() -> None:
    for what, figure, files in glance_rows():
        text = "\n".join((ROOT / "results" / f"{name}.md").read_text() for name in files)
        numbers = NUMBER.findall(figure)
        assert numbers, f"row {what!r} has no figure"
        missing = [n for n in numbers if not re.search(rf"(?<![\d.]){re.escape(n)}(?!\d)", text)]
        assert not missing, f"row {what!r}: {missing} appear in none of {files}"


def test_results_readme_points_at_every_file_of_the_table() -> None:
    index = (ROOT / "results" / "README.md").read_text()
    for what, _, files in glance_rows():
        for name in files:
            assert f"`{name}.md`" in index, f"results/README.md does not point at {name}.md (row {what!r})"


def test_results_readme_answers_every_row_of_the_table_in_order() -> None:
    """results/README.md's first table has one row per "at a glance" row, naming its files and
    where in them the figure is."""
    text = (ROOT / "results" / "README.md").read_text()
    section = text[text.index("## The README's"):].split("\n## ")[0]
    index = [line for line in section.splitlines() if line.startswith("|")][2:]
    rows = glance_rows()
    assert len(index) == len(rows), f"results/README.md indexes {len(index)} rows, the README has {len(rows)}"
    for line, (what, _, files) in zip(index, rows):
        _, named, where = (cell.strip() for cell in line.strip("|").split("|"))
        assert re.findall(r"`([\w.]+)\.md`", named) == files, f"row {what!r}: the index names {named}"
        assert where, f"row {what!r}: the index does not say where in {files} the figure is"


def test_results_stay_few_and_named_by_suite_and_device() -> None:
    from revtrain.bench.runner import SUITES

    files = [p for p in (ROOT / "results").iterdir() if p.is_file()]
    assert len(files) <= 40
    for p in files:
        if p.name != "README.md":
            suite = p.name.split("_cpu")[0].split("_cuda")[0]
            assert suite in SUITES and re.search(r"_(cpu|cuda_\w+?)(_|\.)", p.name), p.name
