"""Profiling leaves nothing behind: after ``profile_setup`` the only tensors alive are the
model's, the batch's and the prepared state's, so every later measurement in the same process
(on CUDA, through the caching allocator) starts from the model alone."""

from __future__ import annotations

import gc

import torch

from revtrain.planner import TimingRule, prepare, profile_setup, saved_bytes_in_context

from .helpers import tiny_batch, tiny_model


def _live_storages() -> dict[int, torch.UntypedStorage]:
    """Every storage of a tensor that gc can reach, by address."""
    gc.collect()
    found: dict[int, torch.UntypedStorage] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.layout == torch.strided:
            st = obj.untyped_storage()
            found.setdefault(st.data_ptr(), st)
    return found


def _left_behind(setup, before: dict[int, torch.UntypedStorage]) -> int:
    """Bytes of storages alive now that were not alive in ``before`` and that are not the
    model's parameters, gradients or buffers, the batch or the prepared state's copy."""
    owned = [*setup.model.parameters(), *setup.model.buffers(), *setup.state.values.values()]
    owned += [p.grad for p in setup.model.parameters() if p.grad is not None]
    inputs = setup.inputs if isinstance(setup.inputs, tuple) else (setup.inputs,)
    owned += [*inputs, setup.targets]
    known = {t.untyped_storage().data_ptr() for t in owned} | set(before)
    return sum(st.nbytes() for ptr, st in _live_storages().items() if ptr not in known)


def _one_activation(batch) -> int:
    """Bytes of the tiny model's widest activation (the stem's output, 8 channels)."""
    x, _ = batch
    return x.shape[0] * 8 * x.shape[2] * x.shape[3] * x.element_size()


def test_counting_saved_bytes_frees_every_forward():
    # Each counting forward saves the whole model's activations; a reference cycle through
    # autograd's graph (a saved-tensor hook returning the tensor it packs) kept all of them.
    model, batch = tiny_model(), tiny_batch()
    with prepare(model, batch, device="cpu", repeats=1, warmup=1) as setup:
        before = _live_storages()  # held: their addresses cannot be reused meanwhile
        by_hooks, _ = saved_bytes_in_context(setup)
        assert sum(by_hooks.values()) > 0
        assert _left_behind(setup, before) < _one_activation(batch)


def test_profiling_leaves_no_tensor_behind():
    model, batch = tiny_model(), tiny_batch()
    rule = TimingRule(warmup_pairs=1, min_pairs=3, max_pairs=3)
    with prepare(model, batch, device="cpu", repeats=1, max_repeats=2, warmup=1) as setup:
        before = _live_storages()
        profile = profile_setup(setup, timing=rule, run_baseline_c=True)
        assert profile.blocks and profile.layers  # what was profiled, still held
        assert _left_behind(setup, before) < _one_activation(batch)
