"""The model registry's table: ``@register_model`` adds a factory under its name (as timm's
``_registry``).  The built-in architectures (:mod:`sensai.architectures`) register themselves
here when imported; :mod:`sensai.models` imports them when the table is first read."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torch import nn

ModelFactory = Callable[..., "nn.Module"]
FACTORIES: dict[str, ModelFactory] = {}
DESCRIPTIONS: dict[str, str] = {}  # name -> the first line of the factory's docstring


def register_model(fn: ModelFactory | None = None, *, name: str | None = None):
    """Decorator adding a factory ``fn(num_classes, in_channels, **kw) -> nn.Module``."""

    def wrap(f: ModelFactory) -> ModelFactory:
        key = name or f.__name__
        if key in FACTORIES:
            raise ValueError(f"model {key!r} is registered twice")
        FACTORIES[key] = f
        DESCRIPTIONS[key] = (f.__doc__ or "").strip().splitlines()[0] if f.__doc__ else ""
        return f

    return wrap(fn) if fn is not None else wrap
