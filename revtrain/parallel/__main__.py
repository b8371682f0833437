"""``python -m revtrain.parallel``: train a zoo model with PETRA.

Three ways to run the same training::

    python -m revtrain.parallel --stages 2                      # 2 local processes (gloo)
    python -m revtrain.parallel --stages 4 --engine simulator   # all stages in this process
    torchrun --nnodes 1 --nproc-per-node 2 -m revtrain.parallel --run-dir runs/x   # torchrun starts the ranks

Options come from :class:`~revtrain.parallel.options.RunOptions` and
:class:`~revtrain.parallel.config.PetraConfig` (``--help`` lists them with their docs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback
import typing
from collections.abc import Sequence
from typing import Any

from revtrain.parallel.config import PetraConfig
from revtrain.parallel.errors import PipelineConfigError, StageFailedError
from revtrain.parallel.launch import ERROR_FILE_ENV, launch
from revtrain.parallel.options import RunOptions
from revtrain.parallel.runner import train
from revtrain.train import field_docs

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The command line: one option per field of RunOptions and PetraConfig."""
    parser = argparse.ArgumentParser(
        prog="python -m revtrain.parallel",
        description="Train a zoo model with PETRA: J stages, one per process (or simulated in one).",
    )
    run = parser.add_argument_group("run")
    _add_fields(run, RunOptions)
    algo = parser.add_argument_group("PETRA")
    _add_fields(algo, PetraConfig)
    parser.add_argument("--worker-config", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker_config:
        return _run_worker(args.worker_config)
    given_run = _given(args, RunOptions)
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ and "WORLD_SIZE" in os.environ
    if under_torchrun:
        given_run["engine"] = "processes"
        given_run.setdefault("stages", int(os.environ["WORLD_SIZE"]))
    try:
        options = RunOptions(**given_run)
        petra = PetraConfig(**_given(args, PetraConfig))
        if under_torchrun or options.engine == "simulator":
            train(options, petra)
        else:
            launch(options, petra)
    except PipelineConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except StageFailedError as err:
        print(f"StageFailedError: {err}", file=sys.stderr)
        return 1
    return 0


def _run_worker(path: str) -> int:
    """One rank started by the local launcher: train, or write the error where the launcher reads it."""
    try:
        data = json.loads(open(path).read())
        train(RunOptions(**_tuples(RunOptions, data["options"])), PetraConfig(**data["petra"]))
    except BaseException as err:  # noqa: BLE001 - report every failure to the launcher, then fail
        error_file = os.environ.get(ERROR_FILE_ENV)
        if error_file and not isinstance(err, KeyboardInterrupt):
            with open(error_file, "w") as f:
                f.write(traceback.format_exc())
                f.write(f"{type(err).__name__}: {err}\n")
        raise
    return 0


def _tuples(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """JSON turns tuples into lists; give tuple-typed fields their tuples back."""
    hints = typing.get_type_hints(cls)
    return {k: tuple(v) if typing.get_origin(hints.get(k)) is tuple and isinstance(v, list) else v
            for k, v in data.items()}


def _add_fields(parser: Any, cls: type) -> None:
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    for f in dataclasses.fields(cls):
        kind = _unwrap_optional(hints[f.name])
        shown = "" if f.default is None else f" (default: {_show(f.default)})"
        kwargs: dict[str, Any] = dict(dest=f.name, default=argparse.SUPPRESS,
                                      help=(docs.get(f.name, "") + shown).replace("%", "%%"))
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is typing.Literal:
            kwargs["choices"] = typing.get_args(kind)
        elif typing.get_origin(kind) is tuple:
            kwargs.update(nargs="+", type=typing.get_args(kind)[0])
        else:
            kwargs.update(type=kind, metavar=f.name.upper())
        parser.add_argument("--" + f.name.replace("_", "-"), **kwargs)


def _given(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}


def _unwrap_optional(kind: Any) -> Any:
    rest = [a for a in typing.get_args(kind) if a is not type(None)]
    if len(rest) == 1 and len(typing.get_args(kind)) == 2:
        return rest[0]
    return kind


def _show(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, tuple) else str(value)


if __name__ == "__main__":
    sys.exit(main())
