"""Parameter counts of the zoo against the papers, as a markdown table.

Run ``python -m revtrain.models.table`` to print the table pasted into ``docs/models.md``.
Models are built on the ``meta`` device, so counting even the 45M-parameter ImageNet models
allocates no memory.
"""

from __future__ import annotations

import re

from revtrain.models.registry import ModelInfo, count_params, list_models, model_info

__all__ = ["param_table", "main"]


def _order(info: ModelInfo) -> tuple[str, str, str, int, str]:
    """Group by paper and dataset, then ResNets before RevNets, by depth (as Table 2 reads)."""
    match = re.match(r"([a-z]+)(\d+)", info.name)
    family, depth = (match.group(1), int(match.group(2))) if match else (info.name, 0)
    return info.paper, info.dataset, family, depth, info.name


def param_table(pattern: str = "*") -> str:
    """Markdown table: model, source, dataset, our count, the paper's, relative difference."""
    rows = [
        "| Model | Architecture from | Dataset (classes) | Ours | Paper | Difference |",
        "|---|---|---|---:|---:|---:|",
    ]
    for info in sorted((model_info(n) for n in list_models(pattern)), key=_order):
        ours = count_params(info.name)
        if info.paper_params is None:
            paper, diff = "—", "—"
        else:
            paper = f"{info.paper_params / 1e6:g}M"
            diff = f"{(ours - info.paper_params) / info.paper_params:+.2%}"
        rows.append(
            f"| `{info.name}` | {info.paper} | {info.dataset} ({info.num_classes}) "
            f"| {ours:,} ({ours / 1e6:.2f}M) | {paper} | {diff} |"
        )
    return "\n".join(rows)


def main() -> None:
    print(param_table())


if __name__ == "__main__":
    main()
