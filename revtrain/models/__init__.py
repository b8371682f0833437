"""The model zoo: RevNets, reversible Transformers and their plain twins, behind one registry.

``create_model(name, num_classes=..., in_channels=...)`` builds any image model
(``create_model(name, context=...)`` a language model) and ``list_models("revnet*")`` lists
them; see ``docs/models.md`` for the architectures, the
choices where the papers are ambiguous and the parameter counts against the papers. Models
are plain PyTorch: set memory modes from outside with :func:`revtrain.core.set_modes`.
"""

# Importing the model files registers their variants.
from revtrain.models import resnet, resnext, revnet, revnet_single_branch, transformer, vit  # noqa: F401
from revtrain.models.revnet_single_branch import PetraRevNet
from revtrain.models.inputs import InputSpec, image_input, token_input
from revtrain.models.registry import (
    MODEL_OVERRIDES,
    ModelInfo,
    count_params,
    create_model,
    create_model_for,
    example_batch,
    input_spec,
    list_models,
    model_info,
    register_model,
)
from revtrain.models.resnet import PreActResNet, ResNet
from revtrain.models.revnet import RevNet
from revtrain.models.transformer import RevTransformerLM, TransformerConfig, TransformerLM
from revtrain.models.vit import RevViT, ViT, ViTConfig

__all__ = [
    "InputSpec",
    "MODEL_OVERRIDES",
    "ModelInfo",
    "PetraRevNet",
    "PreActResNet",
    "ResNet",
    "RevNet",
    "RevTransformerLM",
    "RevViT",
    "TransformerConfig",
    "TransformerLM",
    "ViT",
    "ViTConfig",
    "count_params",
    "create_model",
    "create_model_for",
    "example_batch",
    "image_input",
    "input_spec",
    "list_models",
    "model_info",
    "register_model",
    "token_input",
]
