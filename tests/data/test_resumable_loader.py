"""ResumableLoader: order per (seed, epoch), augmentation per batch, exact resume."""

from __future__ import annotations

import pytest
import torch

from revtrain.data import InMemoryDataset, ResumableLoader, build_digits
from revtrain.data.transforms import BatchTransform


def _dataset(n: int = 50, augment: bool = True) -> InMemoryDataset:
    x = torch.rand(n, 1, 6, 6, generator=torch.Generator().manual_seed(0))
    y = torch.arange(n)  # target == index, so batches reveal the order
    return InMemoryDataset(
        x, y, BatchTransform(train=augment, crop_padding=1 if augment else 0, hflip=augment)
    )


def _loader(seed: int = 0, **kw) -> ResumableLoader:
    kw.setdefault("batch_size", 8)
    return ResumableLoader(_dataset(), shuffle=True, seed=seed, **kw)


def _epoch(loader: ResumableLoader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(loader)


def test_order_is_a_function_of_seed_and_epoch():
    a, b = _loader(), _loader()
    assert torch.equal(a.epoch_order(3), b.epoch_order(3))
    assert sorted(a.epoch_order(3).tolist()) == list(range(50))
    assert not torch.equal(a.epoch_order(3), a.epoch_order(4))
    assert not torch.equal(a.epoch_order(3), _loader(seed=1).epoch_order(3))
    # The batches served are the order, cut into batches.
    targets = torch.cat([y for _, y in _epoch(a)])
    assert torch.equal(targets, a.epoch_order(0))


def test_two_runs_with_one_seed_give_identical_batches_including_augmentation():
    a, b = _loader(), _loader()
    for _ in range(2):
        for (xa, ya), (xb, yb) in zip(_epoch(a), _epoch(b), strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert a.epoch == b.epoch == 2


def test_augmentation_differs_between_epochs_for_the_same_example():
    loader = _loader(batch_size=50)
    ((x0, y0),) = _epoch(loader)
    ((x1, y1),) = _epoch(loader)
    order0, order1 = torch.argsort(y0), torch.argsort(y1)
    assert not torch.equal(x0[order0], x1[order1])


def test_full_pass_advances_the_epoch_and_break_keeps_the_position():
    loader = _loader()
    assert len(loader) == 7 and loader.state_dict()["epoch"] == 0
    _epoch(loader)
    assert (loader.epoch, loader.next_batch) == (1, 0)
    for i, _ in enumerate(loader):
        if i == 2:
            break
    assert (loader.epoch, loader.next_batch) == (1, 3)
    assert len(_epoch(loader)) == 4  # the rest of epoch 1
    assert loader.epoch == 2


@pytest.mark.parametrize("stop_after", [0, 3, 7, 10])
def test_resume_from_state_dict_reproduces_the_uninterrupted_run(stop_after):
    reference = _loader()
    expected = _epoch(reference) + _epoch(reference)  # 14 batches over two epochs

    first = _loader()
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    state = first.state_dict()
    while len(seen) < stop_after:
        for batch in first:
            seen.append(batch)
            state = first.state_dict()  # checkpoint taken after training on the batch
            if len(seen) == stop_after:
                break

    resumed = _loader()
    resumed.load_state_dict(state)
    while resumed.epoch < 2:
        seen.extend(resumed)
    for (xa, ya), (xb, yb) in zip(seen, expected, strict=True):
        assert torch.equal(ya, yb) and torch.equal(xa, xb)


def test_set_epoch_jumps_like_iterating_there():
    walked = _loader()
    for _ in range(3):
        _epoch(walked)
    jumped = _loader()
    jumped.set_epoch(3, start_batch=2)
    tail = _epoch(jumped)
    full = _epoch(walked)
    assert len(tail) == 5
    for (xa, ya), (xb, yb) in zip(tail, full[2:], strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_state_from_another_configuration_is_refused():
    state = _loader(seed=1).state_dict()
    with pytest.raises(ValueError, match="seed=1"):
        _loader(seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="batch_size"):
        _loader(batch_size=16).load_state_dict(_loader().state_dict())
    other = {**_loader().state_dict(), "dataset_size": 9}
    with pytest.raises(ValueError, match=r"the run's data had 9 samples and this data has \d+ \(another --data-dir"):
        _loader().load_state_dict(other)


def test_drop_last_and_eval_order():
    loader = _loader(batch_size=16, drop_last=True)
    batches = _epoch(loader)
    assert len(loader) == len(batches) == 3 and all(len(y) == 16 for _, y in batches)
    evaluation = ResumableLoader(_dataset(augment=False), batch_size=16, shuffle=False)
    assert torch.equal(torch.cat([y for _, y in evaluation]), torch.arange(50))
    with pytest.raises(ValueError, match="batch_size"):
        ResumableLoader(_dataset(), batch_size=64, shuffle=True, drop_last=True)


def test_worker_processes_give_the_same_batches():
    digits = build_digits(augment=True).train
    inline = ResumableLoader(digits, batch_size=256, shuffle=True, seed=5)
    workers = ResumableLoader(digits, batch_size=256, shuffle=True, seed=5, num_workers=2)
    workers.set_epoch(1, start_batch=2)
    inline.set_epoch(1, start_batch=2)
    for (xa, ya), (xb, yb) in zip(inline, workers, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert (workers.epoch, workers.next_batch) == (2, 0)


@pytest.mark.parametrize("message", ["cannot read image a.png (OSError: truncated); replace or remove the file",
                                     "two\nlines: revtrain.data.errors.DatasetFormatError: inside", ""])
def test_a_worker_error_comes_back_as_raised(message: str) -> None:
    """torch re-raises a worker's error as its type with its traceback as the message; the loader
    gets the original message back, of one line, several, or none."""
    from torch._utils import ExceptionWrapper

    from revtrain.data import DatasetFormatError, DatasetNotFoundError
    from revtrain.data.loader import _unwrap_worker_error

    for cls in (DatasetFormatError, DatasetNotFoundError):
        try:
            try:
                raise KeyError("while handling another error")
            except KeyError:
                raise cls(message)
        except cls:
            wrapped = ExceptionWrapper(where="in DataLoader worker process 1")
        with pytest.raises(cls) as caught:
            wrapped.reraise()
        assert str(caught.value).startswith(f"Caught {cls.__name__} in DataLoader worker process 1.\n")
        original = _unwrap_worker_error(caught.value)
        assert type(original) is cls and original is not None and str(original) == message
    assert _unwrap_worker_error(DatasetFormatError("Caught nothing; a plain error")) is None
