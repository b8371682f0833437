"""Tasks: the loss, the metrics and the example inputs of a kind of learning problem.

``get_task("classification")`` or ``task_for(spec)`` (the task that trains a model with this
:class:`~revtrain.models.inputs.InputSpec`). A new task subclasses :class:`Task` and is added
with :func:`register_task`.
"""

from __future__ import annotations

from revtrain.models.inputs import InputSpec
from revtrain.tasks.base import Task, add_sums
from revtrain.tasks.classification import Classification
from revtrain.tasks.language_model import LanguageModeling, unigram_cross_entropy, unigram_entropy

__all__ = [
    "Classification",
    "LanguageModeling",
    "Task",
    "add_sums",
    "get_task",
    "list_tasks",
    "register_task",
    "task_for",
    "unigram_cross_entropy",
    "unigram_entropy",
]

_TASKS: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    """Register a :class:`Task` subclass under its ``name`` (usable as a class decorator)."""
    if cls.name in _TASKS and _TASKS[cls.name] is not cls:
        raise ValueError(f"task {cls.name!r} is registered twice")
    _TASKS[cls.name] = cls
    return cls


def list_tasks() -> list[str]:
    """Registered task names, sorted."""
    return sorted(_TASKS)


def get_task(name: str) -> Task:
    """A new instance of the registered task ``name``."""
    try:
        return _TASKS[name]()
    except KeyError:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(list_tasks())}") from None


def task_for(spec: InputSpec) -> Task:
    """The task that trains a model whose input is ``spec`` (images: classification, tokens: language modelling)."""
    for cls in _TASKS.values():
        if cls.input_kind == spec.kind:
            return cls()
    raise ValueError(f"no registered task trains on {spec.kind!r} inputs; known tasks: {', '.join(list_tasks())}")


register_task(Classification)
register_task(LanguageModeling)
