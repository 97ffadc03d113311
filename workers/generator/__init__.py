"""Rollout generators: the plain ``Generator`` and its Ray actor shell."""

from workers.generator.generator import Generator, GroupResult, make_row, row_key

__all__ = ["Generator", "GroupResult", "make_row", "row_key"]
