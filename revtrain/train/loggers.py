"""Logs users read, beside ``metrics.jsonl``: CSV files, TensorBoard event files, and a curve PNG.

:class:`~revtrain.train.metrics.MetricsWriter` hands every record it writes to its sinks:

- :class:`CsvSink` (always): ``steps.csv`` (one row per ``"step"`` record) and ``epochs.csv`` (one
  row per evaluated epoch), columns as in ``metrics.jsonl``; a resumed run rewrites them from the
  records kept in ``metrics.jsonl`` and goes on appending, so they always match it.
- :class:`TensorBoardSink` (``--tensorboard``; needs ``pip install 'revtrain[tensorboard]'``):
  event files in ``<run>/tensorboard/``; scalars ``step/<name>`` at every logged step and
  ``epoch/<name>`` at each evaluation, at the optimizer step they belong to. A resumed run purges
  the events written after its checkpoint (TensorBoard's ``purge_step``).

:func:`write_curves` draws ``curves.png`` from ``metrics.jsonl`` at the end of every run: the
training loss per step with the epochs' test loss, and each other metric the task reports
(accuracy, bits per byte) for training and test per epoch.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from revtrain.train.config import ConfigError
from revtrain.train.files import atomic_write, atomic_write_text

__all__ = ["CsvSink", "RecordSink", "TensorBoardSink", "open_sinks", "read_records", "write_curves"]

CSV_FILES = {"step": "steps.csv", "epoch": "epochs.csv"}
"""Which records go to which CSV file."""
_NOT_SCALARS = ("event", "time", "step", "epoch", "memory_kind")


class RecordSink(Protocol):
    """Where a copy of each metrics record goes."""

    def begin(self, records: list[dict[str, Any]]) -> None:
        """Called once with the records already in ``metrics.jsonl`` (a resumed run), or none."""

    def write(self, record: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (lines a crash cut off are skipped)."""
    records = []
    path = Path(path)
    if not path.exists():
        return records
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class CsvSink:
    """``steps.csv`` and ``epochs.csv`` in ``folder``."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self._writers: dict[str, tuple[Any, csv.DictWriter]] = {}
        self._columns: dict[str, list[str]] = {}

    def begin(self, records: list[dict[str, Any]]) -> None:
        for event, name in CSV_FILES.items():
            rows = [r for r in records if r.get("event") == event]
            if rows:
                self._columns[event] = _columns(rows[0])
                buffer = io.StringIO()
                writer = csv.DictWriter(buffer, self._columns[event], extrasaction="ignore", restval="")
                writer.writeheader()
                writer.writerows(rows)
                atomic_write_text(self.folder / name, buffer.getvalue(), what="metrics file")
            else:
                (self.folder / name).unlink(missing_ok=True)

    def write(self, record: Mapping[str, Any]) -> None:
        event = record.get("event")
        if event not in CSV_FILES:
            return
        if event not in self._writers:
            path = self.folder / CSV_FILES[event]
            new = event not in self._columns
            if new:
                self._columns[event] = _columns(record)
            f = path.open("a" if not new else "w", encoding="utf-8", newline="")
            writer = csv.DictWriter(f, self._columns[event], extrasaction="ignore", restval="")
            if new:
                writer.writeheader()
            self._writers[event] = (f, writer)
        f, writer = self._writers[event]
        writer.writerow(record)
        f.flush()

    def close(self) -> None:
        for f, _ in self._writers.values():
            f.close()
        self._writers.clear()


def _columns(record: Mapping[str, Any]) -> list[str]:
    return [k for k in record if k != "event"]


class TensorBoardSink:
    """TensorBoard event files in ``folder`` (see the module docstring)."""

    def __init__(self, folder: str | os.PathLike[str], purge_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("--tensorboard needs the tensorboard package: pip install 'revtrain[tensorboard]' "
                              "(or pip install tensorboard), or drop --tensorboard") from None
        self.writer = SummaryWriter(str(folder), purge_step=purge_step)

    def begin(self, records: list[dict[str, Any]]) -> None:
        pass  # the events of the records kept are in the event files already

    def write(self, record: Mapping[str, Any]) -> None:
        event = record.get("event")
        if event not in ("step", "epoch"):
            return
        for name, value in record.items():
            if name not in _NOT_SCALARS and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(f"{event}/{name}", value, global_step=int(record["step"]))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_sinks(run_dir: str | os.PathLike[str], *, tensorboard: bool, resume_step: int | None) -> list[RecordSink]:
    """The sinks of a run: CSV always, TensorBoard when asked (purging events after ``resume_step``)."""
    sinks: list[RecordSink] = [CsvSink(run_dir)]
    if tensorboard:
        purge = resume_step + 1 if resume_step is not None else None
        sinks.append(TensorBoardSink(Path(run_dir) / "tensorboard", purge_step=purge))
    return sinks


def write_curves(metrics: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path | None:
    """Draw ``out`` (a PNG) from the records of ``metrics``; None when there is nothing to draw
    or matplotlib is not installed."""
    records = read_records(metrics)
    steps = [r for r in records if r.get("event") == "step" and isinstance(r.get("loss"), (int, float))]
    epochs = [r for r in records if r.get("event") == "epoch"]
    if not steps and not epochs:
        return None
    try:  # the object API: no pyplot, no global backend switched under the user's feet
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    names = sorted({k[len("test_"):] for r in epochs for k in r if k.startswith("test_")} - {"loss"})
    fig = Figure(figsize=(5 * (1 + len(names)), 3.6))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 1 + len(names), squeeze=False)
    ax = axes[0][0]
    if steps:
        ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], lw=0.8, alpha=0.7, color="C0",
                label="train (step)")
    _epoch_lines(ax, epochs, "loss")
    ax.set(xlabel="optimizer step", ylabel="loss", title="loss")
    ax.legend(fontsize=8)
    for ax, name in zip(axes[0][1:], names, strict=True):
        _epoch_lines(ax, epochs, name)
        ax.set(xlabel="optimizer step", ylabel=name, title=name)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    atomic_write(out, lambda f: f.write(buffer.getvalue()), what="plot")
    return out


def _epoch_lines(ax: Any, epochs: Iterable[Mapping[str, Any]], name: str) -> None:
    epochs = list(epochs)
    for split, marker, color in (("train", "o", "C1"), ("test", "s", "C2")):
        points = [(r["step"], r[f"{split}_{name}"]) for r in epochs if isinstance(r.get(f"{split}_{name}"), (int, float))]
        if points:
            ax.plot(*zip(*points, strict=True), marker=marker, ms=3, color=color, label=f"{split} (epoch)")
