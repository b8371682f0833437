"""``revtrain sample``: continue a text prompt with a language model from a training checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from revtrain.models import create_model, input_spec
from revtrain.models.sampling import sample_text
from revtrain.train.build import MODEL_OVERRIDES
from revtrain.train.checkpoint_folder import checkpoint_of, read_checkpoint
from revtrain.train.config import ConfigError

__all__ = ["SampleConfig", "sample_from_checkpoint"]


@dataclass(kw_only=True)
class SampleConfig:
    """What to sample, from which run."""

    checkpoint: str
    """A run's checkpoint.pt, or its run folder (from `revtrain train --dataset text`)."""
    prompt: str = ""
    """Text to continue (default: start from a newline)."""
    length: int = 200
    """Bytes to generate."""
    temperature: float = 0.8
    """Divides the logits before sampling; 0 picks the most likely byte (greedy)."""
    top_k: int | None = None
    """Sample only among the top-k most likely bytes (default: all)."""
    seed: int = 0
    """Seed of the sampling draws (the same seed gives the same text)."""

    def __post_init__(self) -> None:
        if self.length < 1:
            raise ConfigError(f"length (--length) must be >= 1, got {self.length}")
        if not self.temperature >= 0 or self.temperature == float("inf"):
            raise ConfigError(f"temperature (--temperature) must be a finite number >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"top_k (--top-k) must be >= 1, got {self.top_k}")


def sample_from_checkpoint(config: SampleConfig) -> str:
    """Load the run's model from its checkpoint (checksum checked) and continue the prompt."""
    path = checkpoint_of(config.checkpoint)
    state = read_checkpoint(path)
    name = state["model_name"]
    spec = input_spec(name)
    if spec.kind != "tokens":
        raise ConfigError(f"checkpoint {path} holds {name}, an {spec.kind} model; `revtrain sample` continues "
                          "text with a language model (train one with --dataset text)")
    data = state["data"]  # what the model was fitted to (revtrain.data.DatasetInfo.to_dict)
    spec = spec.with_changes(shape=tuple(data["input_shape"]), num_classes=int(data["num_classes"]))
    with torch.device("cpu"):
        model = create_model(name, **MODEL_OVERRIDES["tokens"](spec))
    model.load_state_dict(state["model"])
    return sample_text(model, config.prompt, config.length, temperature=config.temperature,
                       top_k=config.top_k, seed=config.seed)
