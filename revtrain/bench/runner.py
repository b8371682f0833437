"""``revtrain bench SUITE``: one runner, shared options, one report per suite and machine kind.

Every suite is a module of :mod:`revtrain.bench.suites` with ``run(options, device, out, log) ->
Report`` (and optionally ``report_suffix(options) -> str``, appended to the default report name
when the options pick a part that has a report of its own); :data:`SUITES` says what each answers. The runner parses the shared options,
times the run, fills the report's header (machine, device, torch version, date, command, load
average before and after) and writes ``<out>.md`` and ``<out>.csv`` (:mod:`revtrain.bench.report`);
with ``--merge`` it folds the run into the report ``<out>.json`` holds (a suite run in parts).
By default ``<out>`` is ``results/<suite>_<device>`` (``cpu``, ``cuda_h100``, ...); a ``--quick``
run writes under ``results/tmp/`` so that it never replaces a full report.

    revtrain bench core --quick              # a smoke run: < 2 minutes on 2 CPU cores
    revtrain bench core                      # the full grid: methods x shapes
    revtrain bench zoo --models revnet38 revnet110
    revtrain bench core zoo                  # two suites, one after the other
    revtrain bench planner --models revnet110 --merge   # one part of a long suite, into its report
    revtrain bench all --device cuda         # every suite, on a GPU
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from revtrain.bench.machine import BUSY_LOAD_PER_CORE, machine_info
from revtrain.core.checks import FIRST_CHECKS
from revtrain.bench.report import Report, merge_reports, read_report, refuse_foreign_merge, write_report
from revtrain.device import resolve_device

__all__ = ["SUITES", "BenchOptions", "add_arguments", "device_label", "main", "run_suite", "suite_module"]

SUITES: dict[str, str] = {
    "core": "M-mode against plain autograd, C-mode, checkpointing and the peer libraries, per shape: time and memory",
    "zoo": "every reversible zoo model in M- and C-mode and its plain twin: step time and step memory",
    "planner": "the plan's speed-up over all-M and the memory it keeps under the budget, across batch sizes",
    "petra": "PETRA's throughput against plain backprop, GPipe and 1F1B; its accuracy; memory per stage",
    "transformer": "the reversible Transformer against its plain twin and checkpointing: memory by depth and length",
    "inplace_abn": "ResNeXt with In-place ABN in M- and C-mode against BatchNorm + LeakyReLU: time and memory",
    "compile": "what torch.compile (revtrain train --compile) gains on a training run",
    "train": "the README's training commands as a user runs them: accuracy, time, step memory",
}
"""Every suite and the question it answers, in the order ``all`` runs them."""

Log = Callable[[str], None]


@dataclass(kw_only=True)
class BenchOptions:
    """The options every suite shares; a suite reads those that apply to it."""

    device: str = "auto"
    """auto (CUDA when available), cpu, cuda or cuda:N."""
    models: tuple[str, ...] = ()
    """Zoo models to measure (zoo, planner, compile, petra, train); default the suite's."""
    shapes: tuple[str, ...] = ()
    """Shapes to measure, in the suite's form: core BATCHxCHANNELSxSIZExDEPTH, zoo SIDE:BATCH,
    planner and inplace_abn batch sizes, transformer SEQ_LEN; default the suite's grid."""
    methods: tuple[str, ...] = ()
    """core: exactly these methods, plain (the reference) always among them (plain, M, C, checkpoint,
    a peer library, M-nocheck, M-check1, M-check4, M-norng, M-exact, M-overlap, M-chain; default plain, M, C,
    checkpoint and every installed peer); planner: its parts (sweep, whole-model); petra: its parts
    (accuracy, throughput, memory, rank-exit)."""
    repeats: int | None = None
    """Timed rounds per measurement; default the suite's."""
    warmup: int | None = None
    """Untimed steps before timing; default past the rebuild check's first calls
    (:data:`~revtrain.core.checks.FIRST_CHECKS`), so that M-mode is timed on the default
    schedule's steady state (one checked step in ``DEFAULT_EVERY``); 1 with ``--quick``."""
    threads: int | None = None
    """CPU threads during the run (torch.set_num_threads); default torch's."""
    quick: bool = False
    """A smoke run: the smallest grid, few repeats, one CPU thread unless --threads says otherwise,
    written under results/tmp/ by default."""
    out: str | None = None
    """Path of the report without suffix; default results/<suite>_<device> (results/tmp/... with --quick)."""
    json: bool = False
    """Also write <out>.json (header and every row)."""
    merge: bool = False
    """Fold this run into the report <out>.json holds (rows of the same model, run or method are
    replaced, others kept; the header lists every part's command and load) and write it back with
    its .json: how a suite too long for one sitting is run in parts (--models, --shapes, --methods)."""

    def warmup_steps(self) -> int:
        """``warmup`` when given, else 1 with ``--quick``, else ``FIRST_CHECKS + 1``."""
        if self.warmup is not None:
            return self.warmup
        return 1 if self.quick else FIRST_CHECKS + 1

    def pick(self, full: int, quick: int) -> int:
        """``repeats`` when given, else ``quick`` or ``full`` by ``self.quick``."""
        return self.repeats if self.repeats is not None else (quick if self.quick else full)


def suite_module(name: str) -> ModuleType:
    """The module of suite ``name`` (imported on demand, so a suite's imports cost only its runs);
    raises ``ValueError`` naming the suites for an unknown one."""
    if name not in SUITES:
        raise ValueError(f"unknown benchmark suite {name!r}; choose from {', '.join(SUITES)} (or all)")
    return importlib.import_module(f"revtrain.bench.suites.{name}")


def device_label(info: dict) -> str:
    """``cpu``, or ``cuda_`` and the GPU's model (``cuda_h100`` for an NVIDIA H100 80GB HBM3)."""
    if "gpu" not in info:
        return "cpu"
    words = re.findall(r"[a-z]+\d+[a-z]*", info["gpu"].lower())
    return "cuda_" + (words[0] if words else re.sub(r"\W+", "_", info["gpu"].lower()).strip("_"))


def _commit(here: Path = Path(__file__).resolve().parent) -> str | None:
    """The commit of the checkout holding ``here``, marked when tracked files under ``here`` (the
    package: the measured code, not results or docs) differ from it, so a report of a tree no
    commit holds does not read as that commit's; None outside a checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10, cwd=here)
    except (OSError, subprocess.TimeoutExpired):
        return None
    commit = head.stdout.strip() if head.returncode == 0 else ""
    if not commit:
        return None
    try:
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "."],
                                 capture_output=True, text=True, timeout=30, cwd=here)
    except (OSError, subprocess.TimeoutExpired):
        changed = None
    if changed is None or changed.returncode != 0:
        return f"{commit} (uncommitted changes not known)"
    return f"{commit} with uncommitted changes" if changed.stdout.strip() else commit


def run_suite(name: str, options: BenchOptions, *, command: str | None = None, log: Log = print) -> tuple[Report, list[Path]]:
    """Run suite ``name`` with ``options``; write its report; return it and the files written."""
    module = suite_module(name)
    device = resolve_device(options.device)
    threads_before = torch.get_num_threads()
    threads = options.threads if options.threads is not None else 1 if options.quick and device.type == "cpu" else None
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)
    try:
        before = machine_info(device)
        label = device_label(before)
        if options.out:
            out = Path(options.out)
        else:
            suffix = module.report_suffix(options) if hasattr(module, "report_suffix") else ""
            out = Path("results") / ("tmp" if options.quick else "") / f"{name}_{label}{suffix}"
        held = _merge_target(options, out, name, label)  # checked before measuring, not after
        log(f"revtrain bench {name}: {device} ({before.get('gpu') or before['cpu']}), load average "
            f"{before['load_average']}")
        start = time.perf_counter()
        report: Report = module.run(options, device, out, log)
        wall = time.perf_counter() - start
        after = machine_info(device)
    finally:
        torch.set_num_threads(threads_before)
    nice = os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else 0
    report.header = {
        "suite": name, "device": str(device), "device_label": label, "hardware": before.get("gpu") or before["cpu"],
        "torch": before["torch"], "python": before["python"], "threads": before["torch_threads"],
        "cpu_count": before["cpu_count"], "date": before["date"],
        "command": (f"nice -n {nice} " if nice else "") + (command or f"revtrain bench {name}"),
        "load_before": before["load_average"], "load_after": after["load_average"], "wall_s": round(wall, 1),
        "commit": _commit(), "env": before["env"], **report.header,
    }
    loads = [x["load_average"][0] for x in (before, after) if x["load_average"]]
    cores = before["cpu_count"] or 1
    if device.type == "cpu" and loads and max(loads) - before["torch_threads"] > BUSY_LOAD_PER_CORE * cores:
        report.notes.append(f"the machine was busy (1-minute load average {loads}, the run's own threads "
                            f"{before['torch_threads']}, {cores} cores): read the ratios, not the times")
    previous = out.with_name(out.name + ".json")
    if held is not None:
        report = merge_reports(held, report)
        parts = report.header.get("parts")
        log(f"merged into {previous}: {len(parts)} parts" if parts else
            f"{previous}: every row it held was measured again; replaced whole")
    paths = write_report(report, out, json_too=options.json or options.merge)
    log("wrote " + ", ".join(str(p) for p in paths))
    return report, paths


def _merge_target(options: BenchOptions, out: Path, name: str, label: str) -> Report | None:
    """The report ``--merge`` folds this run into (None: no ``--merge``, or no report yet);
    one of another suite or device is refused now, before the suite runs."""
    previous = out.with_name(out.name + ".json")
    if not (options.merge and previous.exists()):
        return None
    held = read_report(previous)
    refuse_foreign_merge(held, name, label, where=f" ({previous}); nothing was measured")
    return held


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The runner's options on ``parser`` (the CLI's ``bench`` and ``benchmarks/run.py`` share them)."""
    lines = [f"  {name:12s} {question}" for name, question in SUITES.items()]
    parser.description = "Run one benchmark suite (or all) and write results/<suite>_<device>.md and .csv."
    parser.epilog = "suites:\n" + "\n".join(lines)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("suite", nargs="+", choices=[*SUITES, "all"],
                        help="which suite(s) to run, one after another (all: every suite)")
    defaults = BenchOptions()
    parser.add_argument("--device", default=defaults.device, help=_doc("device"))
    parser.add_argument("--models", nargs="+", default=(), help=_doc("models"))
    parser.add_argument("--shapes", nargs="+", default=(), help=_doc("shapes"))
    parser.add_argument("--methods", nargs="+", default=(), help=_doc("methods"))
    parser.add_argument("--repeats", type=int, default=None, help=_doc("repeats"))
    parser.add_argument("--warmup", type=int, default=None, help=_doc("warmup"))
    parser.add_argument("--threads", type=int, default=None, help=_doc("threads"))
    parser.add_argument("--quick", action="store_true", help=_doc("quick"))
    parser.add_argument("--out", default=None, help=_doc("out"))
    parser.add_argument("--json", action="store_true", help=_doc("json"))
    parser.add_argument("--merge", action="store_true", help=_doc("merge"))


def _doc(name: str) -> str:
    """The field docstrings above, as --help (read from the source, one place)."""
    return _FIELD_HELP.get(name, "")


def _field_help() -> dict[str, str]:
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(BenchOptions))
    body = tree.body[0].body  # type: ignore[attr-defined]
    found = {}
    for stmt, nxt in zip(body, body[1:]):
        if isinstance(stmt, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            found[stmt.target.id] = " ".join(str(nxt.value.value).split())  # type: ignore[union-attr]
    return found


_FIELD_HELP = _field_help()


def main(args: argparse.Namespace, *, prog: str = "revtrain bench", argv: Sequence[str] | None = None) -> int:
    """Run the suite(s) ``args`` names (parsed by a parser given :func:`add_arguments`)."""
    options = BenchOptions(device=args.device, models=tuple(args.models), shapes=tuple(args.shapes),
                           methods=tuple(args.methods), repeats=args.repeats, warmup=args.warmup,
                           threads=args.threads, quick=args.quick, out=args.out, json=args.json,
                           merge=args.merge)
    for name in ("repeats", "warmup"):
        value = getattr(options, name)
        if value is not None and value < (1 if name == "repeats" else 0):
            raise ValueError(f"--{name} must be at least {1 if name == 'repeats' else 0}, got {value}")
    given = list(argv) if argv is not None else sys.argv[1:]
    names = list(SUITES) if "all" in args.suite else list(dict.fromkeys(args.suite))
    if len(names) > 1 and options.out:
        raise ValueError("--out names one report; with several suites leave it out (each writes results/<suite>_<device>)")
    rest = [a for a in given if a not in args.suite]  # the options, as given
    for name in names:
        command = f"{prog} {shlex.join([name, *rest])}"
        run_suite(name, options, command=command, log=lambda line: print(line, flush=True))
    return 0
