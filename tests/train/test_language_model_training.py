"""Training a byte-level language model end to end: text data, AdamW, clipping, sampling."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from revtrain.cli import main
from revtrain.train import ConfigError, TrainConfig, Trainer
from revtrain.train.sample import SampleConfig, sample_from_checkpoint

def _config(corpus: Path, run_dir: Path, **overrides) -> TrainConfig:
    options = dict(model="revformer_tiny", dataset="text", data_dir=str(corpus), batch_size=8, epochs=1,
                   max_steps_per_epoch=60, optimizer="adamw", lr=1e-2, warmup_epochs=0, grad_clip=1.0,
                   device="cpu", quiet=True, memory_report=False, run_dir=str(run_dir))
    options.update(overrides)
    return TrainConfig(**options)


def test_adamw_with_clipping_learns_the_corpus_and_reports_bits_per_byte(corpus, tmp_path):
    trainer = Trainer(_config(corpus, tmp_path / "run"))
    assert isinstance(trainer.optimizer, torch.optim.AdamW)
    summary = trainer.fit()
    bpb = summary["test_bpb"]
    assert summary["headline"] == "bpb" and math.isfinite(bpb)
    # Uniform guessing costs 8 bits per byte and the corpus's unigram entropy is 4.4 bits; it
    # repeats one sentence, so 60 steps of a tiny model get far below that (measured: 1.5).
    assert bpb < 3.0, bpb


def test_gradients_are_clipped_to_the_bound(corpus, tmp_path):
    trainer = Trainer(_config(corpus, tmp_path / "run", grad_clip=1e-3, max_steps_per_epoch=1))
    x, y = trainer.first_batch()
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.forward_backward((x, y))
    before = torch.nn.utils.get_total_norm([p.grad for p in trainer.model.parameters() if p.grad is not None])
    assert before > 1e-3
    trainer.optimizer_step()  # clips the gradients in place, then steps
    after = torch.nn.utils.get_total_norm([p.grad for p in trainer.model.parameters() if p.grad is not None])
    assert float(after) == pytest.approx(1e-3, rel=1e-4)


def test_window_longer_than_the_model_and_context_on_images_are_refused(corpus, tmp_path):
    with pytest.raises(ConfigError, match="longer than revformer_tiny's context"):
        Trainer(_config(corpus, tmp_path / "a", context=10_000))
    with pytest.raises(ConfigError, match="--context applies to token models"):
        Trainer(TrainConfig(model="revnet38", context=16, device="cpu", run_dir=str(tmp_path / "b")))
    # A token model on the default (image) dataset: the kinds are named, not an option never given.
    with pytest.raises(ConfigError, match="takes tokens inputs but dataset digits gives image"):
        Trainer(TrainConfig(model="revformer_tiny", device="cpu", run_dir=str(tmp_path / "c")))
    with pytest.raises(ConfigError, match="grad_clip"):
        TrainConfig(grad_clip=0.0)
    with pytest.raises(ConfigError, match="optimizer"):
        TrainConfig(optimizer="lion")  # type: ignore[arg-type]


def test_sample_continues_a_prompt_from_a_checkpoint(corpus, tmp_path, capsys):
    Trainer(_config(corpus, tmp_path / "run")).fit()
    capsys.readouterr()
    text = sample_from_checkpoint(SampleConfig(checkpoint=str(tmp_path / "run"), prompt="the quick", length=30,
                                               temperature=0, seed=0))
    assert text.startswith("the quick") and len(text.encode()) >= len("the quick") + 30 - 3
    assert main(["sample", "--checkpoint", str(tmp_path / "run"), "--prompt", "the", "--length", "5",
                 "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("the")


def test_sample_refuses_an_image_model_checkpoint(tmp_path):
    from tests.train.conftest import make_tiny_config

    Trainer(make_tiny_config(tmp_path / "img", epochs=1, max_steps_per_epoch=1)).fit()
    with pytest.raises(ConfigError, match="language model"):
        sample_from_checkpoint(SampleConfig(checkpoint=str(tmp_path / "img")))
