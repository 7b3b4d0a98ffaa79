"""`FrozenModule`: an immutable holder of static choices for compiled code.

Dynamo specialises the int attributes of an ``nn.Module`` (and of the objects
it holds): a compiled function that takes such a module as an argument, or
closes over it, sees each of those ints as a compile-time constant, and a
module with other values compiles its own graph. A frozen dataclass passed the
same way does not: once a second value arrives, dynamo's automatic dynamic
shapes make its ints symbolic. So the objects that bind a deployment's static
choices (`fa3_spec.MetadataBuilder`, the sglang adapter's ``SglangConfig``)
are modules with no parameters, frozen once constructed.
"""

from __future__ import annotations

import torch

__all__ = ["FrozenModule"]


class FrozenModule(torch.nn.Module):
    """An ``nn.Module`` with no parameters whose attributes are set once.

    A subclass sets its attributes in ``__init__`` and then calls `freeze`;
    any later assignment raises `AttributeError` (``training`` excepted, so
    ``.eval()`` works).
    """

    @classmethod
    def holding(cls, **attrs) -> "FrozenModule":
        """A frozen module whose attributes are ``attrs``: what a compiled step
        closes over to read static objects (a `fa3_spec.eagle.LoopConfig`)."""
        module = cls()
        for name, value in attrs.items():
            setattr(module, name, value)
        module.freeze()
        return module

    def freeze(self) -> None:
        """Refuse every later attribute assignment."""
        object.__setattr__(self, "_frozen", True)

    def __setattr__(self, name, value) -> None:
        if self.__dict__.get("_frozen", False) and name != "training":
            raise AttributeError(f"{type(self).__name__} is immutable; make a new one "
                                 f"to change {name}")
        super().__setattr__(name, value)
