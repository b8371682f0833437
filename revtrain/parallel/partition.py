"""Cut a model into J contiguous stages at block boundaries.

:func:`split_model` returns one :class:`Stage` per worker. The stem always goes with the first
stage and the head (with the loss) with the last; the blocks in between are shared out

- explicitly, by the number of blocks per stage (``split=[3, 3, 2]``) or by the names of the
  blocks that open stages 2..J (``split=["stages.1.transition", "stages.2.reversible.blocks.1"]``);
- or, by default, so that the slowest stage is as fast as possible, from measured per-unit
  costs (:func:`revtrain.parallel.timing.time_units`): a stage other than the last costs the
  forward of its units plus their PETRA backward (rebuild or recompute, then backward); the
  last stage costs its units' forward and plain backward. An exact dynamic programme over
  contiguous splits minimises the largest stage cost.

A stage is *reversible* when every unit in it is: it then keeps no input at all between its
forward and its backward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from revtrain.parallel.errors import PipelineConfigError
from revtrain.parallel.units import Unit, model_units

__all__ = ["Stage", "split_model", "split_counts", "balanced_counts", "stage_shapes"]

Split = Sequence[int] | Sequence[str] | None


class Stage(nn.Module):
    """A contiguous run of a model's units, run by one PETRA worker.

    The stage shares its modules with the model (no copy): training a stage trains the model.

    Args:
        index: Position of the stage, 0-based.
        num_stages: J, the number of stages of the split.
        units: The stage's units in forward order.
    """

    def __init__(self, index: int, num_stages: int, units: Sequence[Unit]) -> None:
        super().__init__()
        self.index = index
        self.num_stages = num_stages
        self._units = tuple(units)
        self.layers = nn.ModuleList([u.module for u in units])

    @property
    def units(self) -> tuple[Unit, ...]:
        return self._units

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def reversible(self) -> bool:
        """Every unit is reversible: the stage rebuilds its input and keeps none."""
        return all(u.reversible for u in self._units)

    @property
    def num_blocks(self) -> int:
        return sum(u.role == "block" for u in self._units)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def unit_state_dict(self) -> dict[str, dict[str, Tensor]]:
        """Parameters and buffers of each unit, keyed by the unit's name in the model."""
        return {u.name: u.module.state_dict() for u in self._units}

    def load_unit_state_dict(self, state: dict[str, dict[str, Tensor]]) -> None:
        """Load what :meth:`unit_state_dict` saved; the unit names must match exactly."""
        names = [u.name for u in self._units]
        if sorted(state) != sorted(names):
            raise PipelineConfigError(
                f"stage {self.index} holds units {_few(names)}, the saved state holds "
                f"{_few(list(state))}; resume with the same model and the same split"
            )
        for u in self._units:
            u.module.load_state_dict(state[u.name])

    def describe(self) -> str:
        kinds = "reversible" if self.reversible else "not reversible"
        return (f"stage {self.index} of {self.num_stages}: {self._units[0].name} .. "
                f"{self._units[-1].name} ({len(self._units)} units, {kinds})")

    def extra_repr(self) -> str:
        return f"index={self.index}, units={[u.name for u in self._units]}"


def split_counts(units: Sequence[Unit], num_stages: int, split: Split) -> list[int]:
    """Blocks per stage for an explicit ``split`` (counts or opening block names).

    Raises:
        PipelineConfigError: J < 1, J larger than the number of blocks, or a split that does
            not cover the model (wrong length, counts below 1 or not adding up, unknown or
            unordered names).
    """
    blocks = [u.name for u in units if u.role == "block"]
    _check_num_stages(num_stages, len(blocks))
    if split is None:
        raise PipelineConfigError("split_counts needs a split; use balanced_counts without one")
    split = list(split)
    if all(isinstance(s, str) for s in split) and split:
        return _counts_from_names(blocks, num_stages, split)  # type: ignore[arg-type]
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in split):
        raise PipelineConfigError(
            f"split must be block counts per stage (e.g. [3, 3, 2]) or block names, got {split!r}"
        )
    counts = [int(s) for s in split]
    if len(counts) != num_stages:
        raise PipelineConfigError(
            f"split {counts} has {len(counts)} entries for {num_stages} stages; give one block "
            "count per stage"
        )
    if min(counts) < 1:
        raise PipelineConfigError(f"split {counts}: every stage needs at least one block")
    if sum(counts) != len(blocks):
        raise PipelineConfigError(
            f"split {counts} covers {sum(counts)} blocks but the model has {len(blocks)}; the "
            f"counts must add up to {len(blocks)}"
        )
    return counts


def balanced_counts(
    forward_cost: Sequence[float], last_cost: Sequence[float], units: Sequence[Unit], num_stages: int
) -> list[int]:
    """Blocks per stage minimising the slowest stage (module docstring).

    Args:
        forward_cost: Per unit, the cost of a stage other than the last: forward plus PETRA
            backward (seconds, or any additive unit).
        last_cost: Per unit, the cost in the last stage: forward plus plain backward.
        units: The model's units (stem and head are pinned to the first and last stage).
        num_stages: J.
    """
    if not (len(forward_cost) == len(last_cost) == len(units)):
        raise ValueError("one forward cost and one last-stage cost per unit are needed")
    block_idx = [i for i, u in enumerate(units) if u.role == "block"]
    n = len(block_idx)
    _check_num_stages(num_stages, n)
    stem = sum(forward_cost[i] if num_stages > 1 else last_cost[i]
               for i, u in enumerate(units) if u.role == "stem")
    head = sum(last_cost[i] for i, u in enumerate(units) if u.role == "head")
    pre_f = [0.0]
    pre_l = [0.0]
    for i in block_idx:
        pre_f.append(pre_f[-1] + forward_cost[i])
        pre_l.append(pre_l[-1] + last_cost[i])

    def cost(j: int, lo: int, hi: int) -> float:  # stage j holds blocks lo..hi-1
        if j == num_stages - 1:
            return pre_l[hi] - pre_l[lo] + head + (stem if j == 0 else 0.0)
        return pre_f[hi] - pre_f[lo] + (stem if j == 0 else 0.0)

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    choice = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for j in range(1, num_stages + 1):
        for hi in range(j, n - (num_stages - j) + 1):
            for lo in range(j - 1, hi):
                value = max(best[j - 1][lo], cost(j - 1, lo, hi))
                if value < best[j][hi]:
                    best[j][hi], choice[j][hi] = value, lo
    counts, hi = [], n
    for j in range(num_stages, 0, -1):
        lo = choice[j][hi]
        counts.append(hi - lo)
        hi = lo
    return counts[::-1]


def split_model(
    model: nn.Module,
    num_stages: int,
    split: Split = None,
    *,
    costs: tuple[Sequence[float], Sequence[float]] | None = None,
) -> list[Stage]:
    """Cut ``model`` into ``num_stages`` stages (module docstring).

    Args:
        model: A zoo model or an ``nn.Sequential`` (see :func:`~revtrain.parallel.units.model_units`).
        num_stages: J >= 1.
        split: Blocks per stage or opening block names; None to balance by ``costs``.
        costs: ``(forward_cost, last_cost)`` per unit for a balanced split (see
            :func:`balanced_counts`); None with ``split=None`` gives every stage the same
            number of blocks (the first stages one more when they do not divide evenly).
    """
    units = model_units(model)
    blocks = sum(u.role == "block" for u in units)
    if split is not None:
        counts = split_counts(units, num_stages, split)
    elif costs is not None:
        counts = balanced_counts(costs[0], costs[1], units, num_stages)
    else:
        _check_num_stages(num_stages, blocks)
        q, r = divmod(blocks, num_stages)
        counts = [q + (j < r) for j in range(num_stages)]
    stages: list[list[Unit]] = [[] for _ in range(num_stages)]
    j, left = 0, counts[0]
    for u in units:
        if u.role == "block":
            if left == 0:
                j += 1
                left = counts[j]
            left -= 1
            stages[j].append(u)
        elif u.role == "stem":
            stages[0].append(u)
        else:
            stages[-1].append(u)
    return [Stage(i, num_stages, us) for i, us in enumerate(stages)]


@torch.no_grad()
def stage_shapes(stages: Sequence[Stage], sample: Tensor, model: nn.Module | None = None) -> list[tuple[int, ...]]:
    """Shape of each stage's output for one sample (without the batch dimension).

    Runs the stages in evaluation mode (no statistics change) on ``sample`` (a batch of one or
    more inputs). With ``model``, also checks that the stages in order compute what the
    model's own forward computes, so a model whose forward is not the chain of its units is
    refused instead of being trained wrongly.
    """
    modes = [s.training for s in stages]
    was_model = model.training if model is not None else None
    shapes = []
    try:
        x = sample
        for s in stages:
            s.eval()
            x = s(x)
            shapes.append(tuple(x.shape[1:]))
        if model is not None:
            model.eval()
            expected = model(sample)
            if expected.shape != x.shape or not torch.allclose(expected, x, rtol=1e-5, atol=1e-6):
                raise PipelineConfigError(
                    f"{type(model).__name__}'s forward is not the chain of its units (stem, blocks, "
                    "head): running the stages in order gives a different output; stage-parallel "
                    "training needs forward = head(blocks(stem(x)))"
                )
    finally:
        for s, m in zip(stages, modes):
            s.train(m)
        if model is not None and was_model is not None:
            model.train(was_model)
    return shapes


def _check_num_stages(num_stages: int, num_blocks: int) -> None:
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise PipelineConfigError(f"the number of stages must be an integer >= 1, got {num_stages!r}")
    if num_stages > num_blocks:
        raise PipelineConfigError(
            f"{num_stages} stages for a model of {num_blocks} blocks: every stage needs at least "
            f"one block; use at most {num_blocks} stages"
        )


def _counts_from_names(blocks: list[str], num_stages: int, names: list[str]) -> list[int]:
    if names and names[0] == blocks[0] and len(names) == num_stages:
        names = names[1:]  # the first stage's opening block may be given too
    if len(names) != num_stages - 1:
        raise PipelineConfigError(
            f"split by names needs the {num_stages - 1} blocks that open stages 2..{num_stages}, "
            f"got {len(names)}: {names}"
        )
    starts = [0]
    for name in names:
        if name not in blocks:
            raise PipelineConfigError(
                f"split names block {name!r}, which is not a block of this model; blocks are named "
                f"like {_few(blocks)}"
            )
        i = blocks.index(name)
        if i <= starts[-1]:
            raise PipelineConfigError(
                f"split names must be in forward order and open non-empty stages; {name!r} comes "
                f"too early"
            )
        starts.append(i)
    ends = starts[1:] + [len(blocks)]
    return [e - s for s, e in zip(starts, ends)]


def _few(names: Sequence[str], k: int = 4) -> str:
    shown = ", ".join(names[:k])
    return shown + (", ..." if len(names) > k else "")
