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

    flock /tmp/revtrain-cpu.lock python benchmarks/petra_memory.py --model revnet50 --batch-size 64 --stages 4
    flock /tmp/revtrain-cpu.lock python benchmarks/petra_memory.py --model revnet38 --dataset-shape 1 8 8 --stages 9 --out results/petra_memory_digits
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from revtrain.bench import machine_info
from revtrain.memory import format_bytes, track_peak_memory
from revtrain.models import create_model
from revtrain.parallel import PetraConfig, split_model, stage_shapes
from revtrain.parallel.worker import StageWorker
from revtrain.tasks import Classification

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = [("on", "on"), ("on", "off"), ("off", "on"), ("off", "off")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="revnet50")
    p.add_argument("--dataset-shape", type=int, nargs=3, default=[3, 32, 32], metavar=("C", "H", "W"))
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--split", type=int, nargs="*", default=None, help="blocks per stage (default: even)")
    p.add_argument("--configs", nargs="*", default=[f"{i}/{s}" for i, s in CONFIGS],
                   help="input/params buffer settings to run, e.g. on/on off/off")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "petra_memory_revnet50")
    return p.parse_args(argv)


def measure(args: argparse.Namespace, input_buffer: str, stash: str) -> list[dict[str, Any]]:
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
        print(f"  [{input_buffer}/{stash}] stage {s}: kept {format_bytes(kept)}, peak {format_bytes(mem.peak_bytes)}",
              flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    before = machine_info("cpu")
    out_json = args.out.with_suffix(".json")
    result = json.loads(out_json.read_text()) if out_json.exists() else {"runs": {}}
    for name in args.configs:
        input_buffer, stash = name.split("/")
        result["runs"][name] = measure(args, input_buffer, stash)
    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])])
    result.setdefault("commands", []).append({"command": command, "machine_before": before,
                                              "machine_after": machine_info("cpu")})
    result["setup"] = {"model": args.model, "input": args.dataset_shape, "batch_size": args.batch_size,
                       "stages": args.stages, "split": args.split}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(result, indent=2))
    text = _markdown(result)
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return 0


def _markdown(result: dict[str, Any]) -> str:
    setup = result["setup"]
    runs = result["runs"]
    lines = [f"# PETRA Table 3 in kind: {setup['model']}, input {tuple(setup['input'])}, batch {setup['batch_size']}, "
             f"{setup['stages']} stages (CPU, tensor bytes)", ""]
    for c in result["commands"]:
        m0, m1 = c["machine_before"], c["machine_after"]
        lines.append(f"- `{c['command']}` — {m0['cpu']}, torch {m0['torch']}, load average before "
                     f"{m0['load_average']}, after {m1['load_average']}")
    lines += ["", "| input buffer | parameter buffer | total memory | saving | total without stage 0's input | "
              "saving | kept bytes (all stages) |", "|---|---|---:|---:|---:|---:|---:|"]
    base = base_wo = None
    for name in [f"{i}/{s}" for i, s in CONFIGS]:
        if name not in runs:
            continue
        rows = runs[name]
        total = sum(r["param_bytes"] + r["peak_bytes"] for r in rows)
        without = total - sum(r["first_stage_input_bytes"] for r in rows)
        kept = sum(r["kept_bytes"] for r in rows)
        base, base_wo = base or total, base_wo or without
        i, s = name.split("/")
        lines.append(f"| {i} | {s} | {format_bytes(total)} | {100 * (1 - total / base):.1f}% | {format_bytes(without)} | "
                     f"{100 * (1 - without / base_wo):.1f}% | {format_bytes(kept)} |")
    lines += ["", "Per stage (parameters + measured peak; kept bytes at the peak):", "",
              "| stage | units | reversible | batches held | " + " | ".join(
                  f"{n}" for n in runs) + " |", "|---|---|---|---:|" + "---:|" * len(runs)]
    first = next(iter(runs.values()))
    for k, r in enumerate(first):
        cells = [f"{format_bytes(runs[n][k]['param_bytes'] + runs[n][k]['peak_bytes'])} "
                 f"({format_bytes(runs[n][k]['kept_bytes'])})" for n in runs]
        lines.append(f"| {r['stage']} | {r['units']} | {r['reversible']} | {r['batches_held']} | " + " | ".join(cells) + " |")
    lines += ["", "Columns of the per-stage table are `input/parameter` buffer settings.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
