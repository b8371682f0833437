"""One result schema for every benchmark suite, and one writer for it.

A suite returns a :class:`Report`: a header (machine, device, torch version, date, command,
load average) and one or more :class:`Table` of flat rows (plain scalars, one dict per row).
:func:`write_report` writes ``<out>.md`` (what a reader reads: the header, then each table with
its note), ``<out>.csv`` (every row of every table, with ``suite``, ``device`` and ``table``
columns first) and, on request, ``<out>.json`` (the header and every table's rows).

An interval is three keys in a row, ``name``, ``name_low`` and ``name_high``; a column of kind
``"interval"`` prints them as ``1.330 [1.260, 1.410]``.

A suite too long for one sitting is run in parts (``--models``, ``--shapes``, ``--methods``) with
``--merge``: :func:`merge_reports` folds each part into the report its ``.json`` holds, so the suite
still has one report per machine, whose header lists every part's command, date and load.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from revtrain.memory import format_bytes
from revtrain.timing import MedianInterval

__all__ = ["Column", "Table", "Report", "write_report", "render_markdown", "interval_cells", "merge_reports", "refuse_foreign_merge",
           "read_report", "HEADER_KEYS"]

HEADER_KEYS = ("suite", "device", "hardware", "torch", "threads", "date", "command", "load_before",
               "load_after", "wall_s")
"""What every report's header holds (more keys may follow)."""
PART_KEYS = ("command", "date", "wall_s", "load_before", "load_after", "commit", "env")
"""What a merged report's header keeps of each part (``header["parts"]``)."""

_FORMATS: dict[str, Callable[[Any], str]] = {
    "bytes": lambda v: format_bytes(int(v)),
    "ms": lambda v: f"{v * 1e3:.1f} ms",
    "s": lambda v: f"{v:.2f} s",
    "ratio": lambda v: f"{v:.2f}",
    "ratio3": lambda v: f"{v:.3f}",
    "pct": lambda v: f"{v:.2%}",
    "int": lambda v: f"{int(v)}",
    "sci": lambda v: f"{v:.1e}",
    "text": str,
}


@dataclass(frozen=True)
class Column:
    """One column of a markdown table: the row key, its heading and how to print it."""

    key: str
    heading: str
    kind: str = "text"
    """One of ``bytes``, ``ms`` (seconds shown in ms), ``s``, ``ratio`` (2 decimals), ``ratio3``,
    ``pct``, ``int``, ``sci``, ``text``, ``interval`` (``key``, ``key_low``, ``key_high``), or
    a format spec such as ``.1f``."""

    def cell(self, row: Mapping[str, Any]) -> str:
        value = row.get(self.key)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "–"
        if self.kind == "interval":
            low, high = row.get(f"{self.key}_low"), row.get(f"{self.key}_high")
            return f"{value:.3f}" if low is None else f"{value:.3f} [{low:.3f}, {high:.3f}]"
        fmt = _FORMATS.get(self.kind)
        return fmt(value) if fmt else format(value, self.kind)


@dataclass
class Table:
    """Rows of one kind of measurement, with the columns the markdown shows."""

    name: str
    """Short key (the CSV's ``table`` column)."""
    title: str
    columns: Sequence[Column]
    rows: list[dict[str, Any]] = field(default_factory=list)
    note: str = ""
    """What the table measures and how to read it (markdown, printed above the table)."""
    merge_key: tuple[str, ...] | None = None
    """The columns that name a row when a part is merged (:func:`merge_reports`): a new row replaces
    the old rows with the same values there. None: the first column; ``()``: the table is one
    measurement, which a new part replaces whole."""

    def key_columns(self) -> tuple[str, ...]:
        return (self.columns[0].key,) if self.merge_key is None else tuple(self.merge_key)

    def markdown(self) -> str:
        lines = ["| " + " | ".join(c.heading for c in self.columns) + " |",
                 "|" + "|".join("---" if c.kind == "text" else "---:" for c in self.columns) + "|"]
        lines += ["| " + " | ".join(c.cell(r) for c in self.columns) + " |" for r in self.rows]
        return "\n".join(lines)


@dataclass
class Report:
    """What a suite measured: a header and its tables."""

    suite: str
    title: str
    header: dict[str, Any]
    tables: list[Table]
    intro: str = ""
    """What was measured and how (markdown)."""
    notes: list[str] = field(default_factory=list)
    """Warnings and facts about this run (a busy machine, a peer library not installed)."""
    figures: list[str] = field(default_factory=list)
    """Files written beside the report (plots), by name."""
    appendix: str = ""
    """Markdown printed after the tables (e.g. what each run printed)."""

    def table(self, name: str) -> Table:
        for t in self.tables:
            if t.name == name:
                return t
        raise KeyError(f"report {self.suite!r} has no table {name!r}; it has {[t.name for t in self.tables]}")


def interval_cells(key: str, interval: MedianInterval) -> dict[str, float]:
    """The three row keys of an interval column."""
    return {key: interval.median, f"{key}_low": interval.low, f"{key}_high": interval.high}


def _env(env: dict[str, str]) -> str:
    return ", ".join(f"`{k}={v}`" for k, v in sorted(env.items()))


def render_markdown(report: Report) -> str:
    h = report.header
    lines = [f"# {report.title}", ""]
    if report.intro:
        lines += [report.intro, ""]
    parts = h.get("parts") or []
    device = (f"- device: {h.get('device')} ({h.get('hardware')}), torch {h.get('torch')}, "
              f"{h.get('threads')} thread(s), {h.get('cpu_count')} CPUs")
    if len(parts) > 1:
        lines += [f"- measured in {len(parts)} parts, merged (`--merge`):"]
        lines += [f"  - `{p.get('command', '')}`: {p.get('date')}; wall {p.get('wall_s') or 0:.0f} s; load average "
                  f"before {_load(p.get('load_before'))}, after {_load(p.get('load_after'))}"
                  + (f"; commit {p['commit']}" if p.get("commit") else "")
                  + (f"; environment {_env(p['env'])}" if p.get("env") else "") for p in parts]
        lines.append(device)
    else:
        lines += [
            f"- command: `{h.get('command', '')}`",
            device,
            f"- date: {h.get('date')}; wall {h.get('wall_s', 0):.0f} s; load average before "
            f"{h.get('load_before')}, after {h.get('load_after')}",
        ]
        if h.get("commit"):
            lines.append(f"- revtrain at commit {h['commit']}")
        if h.get("env"):  # settings that change timings (threads, the allocator), as the run had them
            lines.append(f"- environment: {_env(h['env'])}")
    lines += [f"- {n}" for n in report.notes]
    for t in report.tables:
        lines += ["", f"## {t.title}", ""]
        if t.note:
            lines += [t.note, ""]
        lines.append(t.markdown())
    if report.figures:
        lines += ["", "Figures: " + ", ".join(f"`{f}`" for f in report.figures)]
    if report.appendix:
        lines += ["", report.appendix]
    return "\n".join(lines) + "\n"


def _load(value: Any) -> str:
    """A load average as the single-part header prints it (a JSON round trip makes tuples lists)."""
    return str(tuple(value)) if isinstance(value, list) else str(value)


def _csv_rows(report: Report) -> tuple[list[str], list[dict[str, Any]]]:
    keys: dict[str, None] = dict.fromkeys(("suite", "device", "table"))
    rows = []
    for t in report.tables:
        for r in t.rows:
            keys.update(dict.fromkeys(r))
            rows.append({"suite": report.suite, "device": report.header.get("device_label"), "table": t.name, **r})
    return list(keys), rows


def write_report(report: Report, out: Path, *, json_too: bool = False) -> list[Path]:
    """Write ``out``.md and ``out``.csv (and ``out``.json when ``json_too``); returns the paths."""
    out.parent.mkdir(parents=True, exist_ok=True)
    md, csv_path = out.with_name(out.name + ".md"), out.with_name(out.name + ".csv")
    md.write_text(render_markdown(report))
    keys, rows = _csv_rows(report)
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    paths = [md, csv_path]
    if json_too:
        path = out.with_name(out.name + ".json")
        payload = {"suite": report.suite, "title": report.title, "header": report.header, "intro": report.intro,
                   "notes": report.notes, "figures": report.figures, "appendix": report.appendix,
                   "tables": [{"name": t.name, "title": t.title, "note": t.note, "merge_key": t.key_columns(),
                               "columns": [[c.key, c.heading, c.kind] for c in t.columns], "rows": t.rows}
                              for t in report.tables]}
        path.write_text(json.dumps(payload, indent=1, default=str) + "\n")
        paths.append(path)
    return paths


def read_report(path: Path) -> Report:
    """The report a ``--json`` run wrote to ``path`` (``<out>.json``); raises ``ValueError`` naming
    the fix for a file written before tables kept their columns."""
    data = json.loads(Path(path).read_text())
    tables = []
    for t in data.get("tables", []):
        if "columns" not in t:
            raise ValueError(f"{path} has no table columns (written by an older runner), so parts cannot be merged "
                             "into it; run the whole suite once without --merge, or delete the file")
        key = t.get("merge_key")
        tables.append(Table(t["name"], t["title"], [Column(*c) for c in t["columns"]], list(t["rows"]), t.get("note", ""),
                            None if key is None else tuple(key)))
    return Report(data["suite"], data.get("title", data["suite"]), dict(data.get("header", {})), tables,
                  intro=data.get("intro", ""), notes=list(data.get("notes", [])), figures=list(data.get("figures", [])),
                  appendix=data.get("appendix", ""))


def refuse_foreign_merge(old: Report, suite: str, device_label: Any, where: str = "") -> None:
    """Raise ``ValueError`` unless a report of ``suite`` on ``device_label`` may merge into ``old``
    (``where``: what the message adds, e.g. the file and what was not done)."""
    for what, a, b in (("suite", old.suite, suite), ("device", old.header.get("device_label"), device_label)):
        if a != b:
            raise ValueError(f"cannot merge a report of {what} {b!r} into one of {what} {a!r}{where}; give --out a "
                             "report of the same suite and device, or leave --merge out")


def merge_reports(old: Report, new: Report) -> Report:
    """``new`` folded into ``old``: per table, a row of ``new`` replaces the rows of ``old`` with the
    same values in the table's key columns (:attr:`Table.merge_key`; by default the first column:
    the model, run or shape), other rows of ``old`` stay (none where the key is ``()``); tables
    only in ``old`` stay, in their place; notes and figures are the union, less the notes of
    ``old`` about a replaced key (those that start with ``"<key>: "``, as the suites write
    per-model notes); the header is ``new``'s with ``parts`` listing every part
    (:data:`PART_KEYS`). Where ``new`` replaces every row ``old`` held, the result is ``new``
    alone. Raises ``ValueError`` for reports of two suites or devices."""
    refuse_foreign_merge(old, new.suite, new.header.get("device_label"))
    fresh = {t.name: t for t in new.tables}
    tables = []
    old_left = 0  # rows of old that stay
    replaced_names: set[str] = set()  # first key values of replaced rows
    for t in old.tables:
        if t.name not in fresh:
            tables.append(t)
            old_left += len(t.rows)
            continue
        n = fresh.pop(t.name)
        keys = n.key_columns()
        replaced = {tuple(r.get(k) for k in keys) for r in n.rows}
        kept = [r for r in t.rows if keys and tuple(r.get(k) for k in keys) not in replaced]
        old_left += len(kept)
        replaced_names |= {str(key[0]) for key in replaced if key}
        tables.append(Table(n.name, n.title, n.columns, kept + n.rows, n.note, n.merge_key))
    if not old_left:
        return new
    tables += fresh.values()
    parts = old.header.get("parts") or [{k: old.header.get(k) for k in PART_KEYS}]
    header = {**new.header, "parts": [*parts, {k: new.header.get(k) for k in PART_KEYS}]}
    kept_notes = [n for n in old.notes if not any(n.startswith(f"{name}: ") for name in replaced_names)]
    notes = list(dict.fromkeys([*kept_notes, *new.notes]))
    figures = list(dict.fromkeys([*old.figures, *new.figures]))
    appendix = "\n\n".join(a for a in dict.fromkeys([old.appendix, new.appendix]) if a)
    return Report(new.suite, new.title, header, tables, intro=new.intro, notes=notes, figures=figures, appendix=appendix)
