"""The classification task: its loss is cross-entropy, its sums add up to exact epoch metrics."""

import pytest
import torch
import torch.nn.functional as F

from revtrain.models import input_spec, token_input
from revtrain.tasks import Classification, add_sums, get_task, list_tasks, task_for


def test_loss_is_cross_entropy_and_sums_give_exact_epoch_metrics():
    task = Classification()
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(n, 5, generator=gen), torch.randint(0, 5, (n,), generator=gen)) for n in (3, 7, 1)]
    total: dict[str, float] = {}
    for out, y in batches:
        torch.testing.assert_close(task.loss(out, y), F.cross_entropy(out, y))
        add_sums(total, task.batch_sums(out, y, task.loss(out, y)))
    out = torch.cat([o for o, _ in batches])
    y = torch.cat([t for _, t in batches])
    metrics = task.summarize(total)
    assert metrics["loss"] == pytest.approx(float(F.cross_entropy(out, y)), rel=1e-6)
    assert metrics["acc"] == pytest.approx(float((out.argmax(1) == y).float().mean()))
    assert total["count"] == 11


def test_task_lookup_by_name_and_by_input_spec():
    assert "classification" in list_tasks()
    assert isinstance(get_task("classification"), Classification)
    assert isinstance(task_for(input_spec("revnet38")), Classification)
    with pytest.raises(ValueError, match="unknown task"):
        get_task("regression")


def test_example_batch_refuses_a_spec_of_another_kind():
    with pytest.raises(ValueError, match="tokens"):
        Classification().example_batch(token_input(8, 256), 2)
