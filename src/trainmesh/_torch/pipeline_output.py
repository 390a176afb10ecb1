"""What a stage hands torch's schedule, and what the loss function gets back: the model's own output.

torch's stages pass tensors between processes and its schedules hand the last stage's tensor to
the loss. The user's loss, though, is written for the model's own output (``outputs.logits`` on
a transformers ``ModelOutput``, ``outputs[0]`` on a tuple, a tensor as it is), and must see the
same kind of object with or without a pipe axis. So a stage keeps the tensor it passes on (the
logits on the last stage, the hidden state elsewhere) together with the recipe to rebuild the
model's output type around it, and the runner rebuilds it before calling the loss (training and
evaluation alike): ``CausalLMOutputWithPast(logits=...)`` for a transformers causal LM, a
one-tuple for a model that returns a tuple. Other fields (a cache, hidden states, attentions) are
not rebuilt: a pipeline carries one tensor from stage to stage.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

_KEYS = ("logits", "last_hidden_state")  # what a transformers model output carries, in that order


def split_output(out: Any) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    """The tensor a stage passes on, and how to rebuild ``out``'s type around a tensor like it."""
    if torch.is_tensor(out):
        return out, _identity
    for key in _KEYS:
        value = getattr(out, key, None)
        if torch.is_tensor(value):
            return value, _ModelOutput(type(out), key)
    if isinstance(out, (tuple, list)) and out and torch.is_tensor(out[0]):
        return out[0], _Sequence(type(out))
    raise TypeError(
        f"A pipeline stage must return a tensor, a tuple starting with one, or a model output "
        f"holding logits. Received: {type(out).__name__}"
    )


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class _ModelOutput:
    """``cls(key=tensor)``: a transformers ``ModelOutput`` (a dataclass whose fields default to None)."""

    def __init__(self, cls: type, key: str):
        self.cls, self.key = cls, key

    def __call__(self, tensor: torch.Tensor) -> Any:
        try:
            return self.cls(**{self.key: tensor})
        except TypeError as error:
            raise TypeError(
                f"The last pipeline stage rebuilds the model's output type around its {self.key} "
                f"for the loss function, and {self.cls.__name__}({self.key}=...) failed: {error}. "
                f"Return a transformers ModelOutput, a tuple or a tensor."
            ) from error


class _Sequence:
    """A one-element tuple (or list): ``outputs[0]`` reads the tensor, as on the whole model."""

    def __init__(self, cls: type):
        self.cls = list if issubclass(cls, list) else tuple  # a namedtuple's other fields are not carried

    def __call__(self, tensor: torch.Tensor) -> Any:
        return self.cls([tensor])
