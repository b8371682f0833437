"""PETRA's Table 3 in kind: memory per stage with the input buffer on/off and the parameter buffer on/off.

The four configurations of the paper's Table 3 (Rivaud et al. 2024):

| input buffer | parameter buffer | what it is |
|---|---|---|
| on  | on  | PipeDream-style delayed gradients: every stage keeps its input and stashes its weights |
| on  | off | delayed gradients with checkpointing: keep the input, recompute with current weights |
| off | on  | rebuild reversible stages' inputs, with the forward's weights (stashed) |
| off | off | PETRA: rebuild with the current weights; only non-reversible units keep inputs |

"Input buffer off" means ``PetraConfig(input_buffer="needed")``: a reversible unit keeps nothing,
a non-reversible unit (stem, downsampling) still keeps its input, as in the paper.

For every stage ``s`` of J, the stage's steady-state peak is measured on its own with
:func:`revtrain.memory.track_peak_memory`: the forwards of the ``2(J-1-s) + 1`` batches it holds
at once in the steady state (inputs created inside the measurement), then one backward (with
its parameter update). Reported per stage: parameter bytes + that peak (kept inputs and stashed
weights, gradients, optimizer state, the backward's transients), and the bytes kept at the peak
counted exactly from the buffers. The paper's totals exclude the first stage's input buffer
(the dataset's images, which can be read again); both totals are given.

It drives the parallel package's stage worker directly, so it runs only inside
``revtrain bench petra`` (not ``--quick``), where a change of the engine shows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from revtrain.memory import format_bytes, track_peak_memory
from revtrain.models import create_model
from revtrain.parallel import PetraConfig, split_model, stage_shapes
from revtrain.parallel.worker import StageWorker
from revtrain.tasks import Classification

CONFIGS = [("on", "on"), ("on", "off"), ("off", "on"), ("off", "off")]


def measure(args: SimpleNamespace, input_buffer: str, stash: str, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    c, h, w = args.dataset_shape
    model = create_model(args.model, in_channels=c)
    stages = split_model(model, args.stages, args.split)
    b = args.batch_size
    sample = torch.randn(2, c, h, w)
    outs = stage_shapes(stages, sample)
    ins = [(c, h, w), *outs[:-1]]
    config = PetraConfig(lr=0.01, input_buffer="all" if input_buffer == "on" else "needed", stash_params=stash == "on")
    rows = []
    j = args.stages
    for s, stage in enumerate(stages):
        worker = StageWorker(stage, config=config, batch_size=b, task=Classification() if stage.is_last else None)
        params = sum(p.numel() * p.element_size() for p in stage.parameters())
        held = 2 * (j - 1 - s) + 1
        kept = first_input = 0
        start = time.perf_counter()
        with track_peak_memory("cpu") as mem:
            if stage.is_last:
                worker.forward_backward(0, torch.randn(b, *ins[s]), torch.randint(0, 10, (b,)))
            else:
                for batch in range(held):
                    y = worker.forward(batch, torch.randn(b, *ins[s]))
                    del y
                kept = worker.buffer_bytes()
                if s == 0 and worker.input_buffer:
                    first_input = worker.input_buffer[0][0][0].untyped_storage().nbytes() * held
                y_rebuilt = torch.randn(b, *outs[s]) if worker.needs_output else None
                worker.backward(0, y_rebuilt, torch.randn(b, *outs[s]))
        rows.append({"stage": s, "units": f"{stage.units[0].name} .. {stage.units[-1].name}",
                     "reversible": stage.reversible, "batches_held": 1 if stage.is_last else held,
                     "param_bytes": params, "peak_bytes": mem.peak_bytes, "kept_bytes": kept,
                     "first_stage_input_bytes": first_input, "seconds": time.perf_counter() - start})
        log(f"  [{input_buffer}/{stash}] stage {s}: kept {format_bytes(kept)}, peak {format_bytes(mem.peak_bytes)}")
    return rows


def table3(model: str, dataset_shape: tuple[int, int, int], batch_size: int, stages: int,
           split: list[int] | None = None, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """One row per buffer setting (the paper's Table 3): total memory over the stages and the saving."""
    args = SimpleNamespace(model=model, dataset_shape=dataset_shape, batch_size=batch_size, stages=stages, split=split)
    rows, base, base_wo = [], None, None
    for input_buffer, stash in CONFIGS:
        stage_rows = measure(args, input_buffer, stash, log)
        total = sum(r["param_bytes"] + r["peak_bytes"] for r in stage_rows)
        without = total - sum(r["first_stage_input_bytes"] for r in stage_rows)
        base, base_wo = base or total, base_wo or without
        rows.append({"model": model, "input": "x".join(map(str, dataset_shape)), "batch": batch_size, "J": stages,
                     "input_buffer": input_buffer, "parameter_buffer": stash, "total_bytes": total,
                     "saving": 1 - total / base, "total_without_first_input_bytes": without,
                     "saving_without_first_input": 1 - without / base_wo,
                     "kept_bytes": sum(r["kept_bytes"] for r in stage_rows)})
    return rows
