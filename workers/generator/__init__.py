"""Rollout generators: the plain torch ``Generator`` (``workers.service.GeneratorWorker``
puts it behind the controller's protocol, in-process or as a Ray actor).

The names below are imported on first use, so that importing a torch-free
submodule (the ``config`` the controller's ``Config`` composes) does not pull in torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from workers.lazy import lazy_exports

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


__getattr__ = lazy_exports(__name__, _EXPORTS)
