"""Rollout generators: the plain torch ``Generator`` (``workers.service.GeneratorWorker``
puts it behind the controller's protocol, in-process or as a Ray actor)."""

from workers.generator.generator import Generator, GroupResult, make_row, row_key

__all__ = ["Generator", "GroupResult", "make_row", "row_key"]
