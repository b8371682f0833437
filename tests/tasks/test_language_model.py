"""Language modelling: the loss is next-token cross-entropy, sums give exact epoch bits per byte."""

import math

import pytest
import torch
import torch.nn.functional as F

from revtrain.models import input_spec
from revtrain.tasks import (
    LanguageModeling,
    add_sums,
    get_task,
    list_tasks,
    task_for,
    unigram_cross_entropy,
    unigram_entropy,
)


def test_loss_is_token_cross_entropy_and_sums_give_exact_epoch_metrics():
    task = LanguageModeling()
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(b, t, 7, generator=gen), torch.randint(0, 7, (b, t), generator=gen))
               for b, t in ((2, 5), (3, 5), (1, 5))]
    total: dict[str, float] = {}
    for out, y in batches:
        loss = task.loss(out, y)
        torch.testing.assert_close(loss, F.cross_entropy(out.permute(0, 2, 1), y))
        add_sums(total, task.batch_sums(out, y, loss))
    out = torch.cat([o for o, _ in batches])
    y = torch.cat([t for _, t in batches])
    metrics = task.summarize(total)
    assert total["count"] == 30  # tokens, not sequences
    assert metrics["loss"] == pytest.approx(float(F.cross_entropy(out.permute(0, 2, 1), y)), rel=1e-6)
    assert metrics["bpb"] == pytest.approx(metrics["loss"] / math.log(2))
    assert metrics["acc"] == pytest.approx(float((out.argmax(-1) == y).float().mean()))
    assert task.format(metrics).startswith(f"loss {metrics['loss']:.4f} bpb ")
    assert task.samples(y) == 6 and task.headline == "bpb" and not task.higher_is_better


def test_lookup_and_example_batches():
    assert "language_modeling" in list_tasks()
    assert isinstance(get_task("language_modeling"), LanguageModeling)
    spec = input_spec("revformer_tiny")
    assert isinstance(task_for(spec), LanguageModeling)
    x, y = LanguageModeling().example_batch(spec, 3)
    assert x.shape == y.shape == (3, 16)
    with pytest.raises(ValueError, match="'image'"):
        LanguageModeling().example_batch(input_spec("revnet38"), 2)


def test_shapes_that_do_not_fit_are_explained():
    with pytest.raises(ValueError, match=r"logits \(batch, sequence, vocab\)"):
        LanguageModeling().loss(torch.randn(2, 5, 7), torch.zeros(2, 6, dtype=torch.long))


def test_unigram_entropy():
    assert unigram_entropy(bytes(range(256)) * 3) == pytest.approx(8.0)
    assert unigram_entropy(b"aaaa") == 0.0
    assert unigram_entropy(b"abab") == pytest.approx(1.0)
    assert unigram_entropy(torch.tensor([97, 98, 97, 98], dtype=torch.uint8)) == pytest.approx(1.0)
    # p = (3/4, 1/4): H = 0.8113 bits
    assert unigram_entropy(b"aaab") == pytest.approx(-(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25)))
    with pytest.raises(ValueError, match="empty"):
        unigram_entropy(b"")


def test_unigram_cross_entropy_scores_one_split_with_the_others_frequencies():
    # fit "ab" (+1 smoothing over 256 symbols): q(a) = q(b) = 2/258
    assert unigram_cross_entropy(b"a", b"ab") == pytest.approx(-math.log2(2 / 258))
    text = bytes(range(256)) * 1000
    assert unigram_cross_entropy(text, text) == pytest.approx(unigram_entropy(text), abs=1e-9)
