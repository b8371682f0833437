"""The ``revtrain`` command: parse options, build objects, run them.

    revtrain train [options]      train a model (default: RevNet-38 on digits, M-mode)
    revtrain models [pattern]     the model zoo with parameter counts
    revtrain sample --checkpoint  continue a text prompt with a trained language model
    revtrain plan [options]       choose M/C per reversible block for a memory budget
    revtrain bench [options]      step time and memory of a reversible stack, four ways

Options of ``train`` and ``bench`` are the fields of their config dataclasses, with the
fields' docstrings as help. Errors in what the user asked for (an unknown model, a missing
dataset folder, a bad checkpoint, an impossible budget) print one message and exit with 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import typing
from collections.abc import Callable, Sequence
from typing import Any

from revtrain._version import __version__
from revtrain.errors import RevtrainError

__all__ = ["main"]

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

# `revtrain bench` runs in seconds on a laptop CPU; benchmarks/core_stack.py has the full sizes.
_BENCH_DEFAULTS = {"batch": 16, "channels": 32, "size": 16, "depths": (4, 8, 16), "repeats": 3}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``revtrain`` command line; returns the exit status."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("revtrain: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (RevtrainError, ValueError, OSError) as err:
        if os.environ.get("REVTRAIN_DEBUG"):
            raise
        print(f"revtrain {args.command}: error: {err}", file=sys.stderr)
        return EXIT_USAGE


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="revtrain", description="Train reversible neural networks fast and in little memory.",
        epilog="Set REVTRAIN_DEBUG=1 to see the traceback behind an error message.",
    )
    parser.add_argument("--version", action="version", version=f"revtrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    from revtrain.models import list_models
    from revtrain.tasks import list_tasks
    from revtrain.train import TrainConfig

    train = sub.add_parser("train", help="train a model (default: RevNet-38 on digits, M-mode)",
                           description="Train a model; every option defaults to the recipe in TrainConfig.")
    _add_config_options(train, TrainConfig, const={"amp": "bf16"}, help_suffix={
        "model": f" Choices: {', '.join(list_models())}.",
        "task": f" Choices: {', '.join(list_tasks())}.",
    })
    train.set_defaults(run=_run_train)

    from revtrain.train.sample import SampleConfig

    sample = sub.add_parser("sample", help="continue a text prompt with a trained language model",
                            description="Generate bytes with the model of a `revtrain train --dataset text` run.")
    _add_config_options(sample, SampleConfig)
    sample.set_defaults(run=_run_sample)

    models = sub.add_parser("models", help="list the model zoo with parameter counts")
    models.add_argument("pattern", nargs="?", default="*", help="shell-style filter, e.g. 'revnet*'")
    models.set_defaults(run=_run_models)

    plan = sub.add_parser("plan", help="choose M/C mode per reversible block for a memory budget")
    _wire_optional(plan, "revtrain.planner.command", "add_plan_arguments", "run_plan")

    bench = sub.add_parser("bench", help="time and memory of a reversible stack: M, C, plain, checkpoint")
    _wire_bench(bench)
    return parser


# ----------------------------------------------------------------------------- commands


def _run_train(args: argparse.Namespace) -> int:
    from revtrain.train import TrainConfig, Trainer, TrainingInterrupted, resolve_run

    trainer = Trainer(resolve_run(_given(args, TrainConfig)))
    try:
        trainer.fit()
    except TrainingInterrupted as stop:  # the checkpoint is saved and the trainer said where
        return 128 + stop.signum
    return 0


def _run_sample(args: argparse.Namespace) -> int:
    from revtrain.train.sample import SampleConfig, sample_from_checkpoint

    print(sample_from_checkpoint(SampleConfig(**_given(args, SampleConfig))))
    return 0


def _run_models(args: argparse.Namespace) -> int:
    from revtrain.models import count_params, list_models, model_info

    names = list_models(args.pattern)
    if not names:
        raise ValueError(f"no model matches {args.pattern!r}; run `revtrain models` for the full list")
    rows = [("model", "kind", "dataset", "params", "paper", "description")]
    for name in names:
        info = model_info(name)
        paper = f"{info.paper_params / 1e6:.2f}M" if info.paper_params else "-"
        kind = "reversible" if info.reversible else "plain"
        rows.append((name, kind, f"{info.dataset} ({info.num_classes})", f"{count_params(name) / 1e6:.2f}M",
                     paper, info.description))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for row in rows:
        print("  ".join(cell.ljust(w) if i in (0, 1, 2) else cell.rjust(w)
                        for i, (cell, w) in enumerate(zip(row, widths, strict=False))) + "  " + row[5])
    return 0


def _wire_bench(parser: argparse.ArgumentParser) -> None:
    try:
        stack = importlib.import_module("revtrain.bench.stack")
    except ModuleNotFoundError as err:
        if err.name not in ("revtrain.bench", "revtrain.bench.stack"):
            raise
        parser.set_defaults(run=_unavailable("bench", "revtrain.bench.stack"))
        return
    config_cls = stack.StackBenchConfig
    _add_config_options(parser, config_cls, defaults=_BENCH_DEFAULTS)

    def run(args: argparse.Namespace) -> int:
        options = {**_BENCH_DEFAULTS, **_given(args, config_cls)}
        rows = stack.run_stack_benchmark(config_cls(**options), log=lambda line: print(line, flush=True))
        print(stack.format_table(rows))
        return 0

    parser.set_defaults(run=run)


def _wire_optional(parser: argparse.ArgumentParser, module: str, add_name: str, run_name: str) -> None:
    """Wire a subcommand implemented elsewhere, if that module is installed."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as err:
        if not module.startswith(str(err.name)):
            raise
        parser.set_defaults(run=_unavailable(parser.prog.split()[-1], module))
        return
    getattr(mod, add_name)(parser)
    parser.set_defaults(run=getattr(mod, run_name))


def _unavailable(command: str, module: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        raise RevtrainError(f"`revtrain {command}` is not available in this installation ({module} is "
                            "missing); reinstall revtrain or update it")

    return run


# ----------------------------------------------------------------------------- config -> options


def _add_config_options(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    defaults: dict[str, Any] | None = None,
    const: dict[str, Any] | None = None,
    help_suffix: dict[str, str] | None = None,
) -> None:
    """One ``--option`` per field of a dataclass, typed from its annotation, helped by its docstring.

    Options default to ``argparse.SUPPRESS``: only the options given appear in the namespace,
    so the dataclass's own defaults (or a resumed run's settings) apply to the rest.
    """
    from revtrain.train import field_docs

    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    defaults, const, help_suffix = defaults or {}, const or {}, help_suffix or {}
    for f in dataclasses.fields(cls):
        kind = _unwrap_optional(hints[f.name])
        default = defaults.get(f.name, f.default)
        required = default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        shown = "" if default is None or required else f" (default: {_show(default)})"
        text = docs.get(f.name, "") + help_suffix.get(f.name, "") + shown
        kwargs: dict[str, Any] = dict(dest=f.name, default=argparse.SUPPRESS, help=text.replace("%", "%%"),
                                      required=required)
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is typing.Literal:
            kwargs["choices"] = typing.get_args(kind)
        elif typing.get_origin(kind) is tuple:
            kwargs.update(nargs="+", type=typing.get_args(kind)[0], metavar=f.name[:-1].upper() or "X")
        else:
            kwargs.update(type=kind, metavar=f.name.upper())
        if f.name in const:
            kwargs.update(nargs="?", const=const[f.name])
        parser.add_argument("--" + f.name.replace("_", "-"), **kwargs)


def _given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of ``cls`` that were given on the command line (the others are absent)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}


def _unwrap_optional(kind: Any) -> Any:
    """``X | None`` -> ``X`` (an option that is not given stays None)."""
    rest = [a for a in typing.get_args(kind) if a is not type(None)]
    if len(rest) == 1 and len(typing.get_args(kind)) == 2:
        return rest[0]
    return kind


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return " ".join(map(str, value))
    return str(value)


if __name__ == "__main__":
    sys.exit(main())
