"""Rollout generators: the plain torch ``Generator`` (``workers.service.GeneratorWorker``
puts it behind the controller's protocol, in-process or as a Ray actor).

The names below are imported on first use, so that importing a torch-free
submodule (the ``config`` the controller's ``Config`` composes) does not pull in torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.generator.generator import Generator, GroupResult, make_row, row_key

#: public name -> the module that defines it (imported on first use)
_EXPORTS = {
    "Generator": "workers.generator.generator",
    "GroupResult": "workers.generator.generator",
    "make_row": "workers.generator.generator",
    "row_key": "workers.generator.generator",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
