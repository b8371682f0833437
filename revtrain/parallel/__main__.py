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
import json
import os
import sys
import typing
from collections.abc import Sequence
from typing import Any

from revtrain.options import add_config_options, given_options
from revtrain.parallel.config import PetraConfig
from revtrain.parallel.errors import PipelineConfigError, StageFailedError
from revtrain.parallel.launch import launch, run_rank
from revtrain.parallel.options import RunOptions
from revtrain.parallel.runner import train

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The command line: one option per field of RunOptions and PetraConfig."""
    parser = argparse.ArgumentParser(
        prog="python -m revtrain.parallel",
        description="Train a zoo model with PETRA: J stages, one per process (or simulated in one).",
    )
    run = parser.add_argument_group("run")
    add_config_options(run, RunOptions)
    algo = parser.add_argument_group("PETRA")
    add_config_options(algo, PetraConfig)
    parser.add_argument("--worker-config", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker_config:
        return _run_worker(args.worker_config)
    given_run = given_options(args, RunOptions)
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ and "WORLD_SIZE" in os.environ
    if under_torchrun:
        given_run["engine"] = "processes"
        given_run.setdefault("stages", int(os.environ["WORLD_SIZE"]))
    try:
        options = RunOptions(**given_run)
        petra = PetraConfig(**given_options(args, PetraConfig))
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
    def work() -> None:
        data = json.loads(open(path).read())
        train(RunOptions(**_tuples(RunOptions, data["options"])), PetraConfig(**data["petra"]))

    run_rank(work)


def _tuples(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """JSON turns tuples into lists; give tuple-typed fields their tuples back."""
    hints = typing.get_type_hints(cls)
    return {k: tuple(v) if typing.get_origin(hints.get(k)) is tuple and isinstance(v, list) else v
            for k, v in data.items()}


if __name__ == "__main__":
    sys.exit(main())
