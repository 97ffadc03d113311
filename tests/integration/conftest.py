"""Fixtures shared by the CLI integration tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from events.embedded import stop_embedded_redis


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One ``--data-dir`` per test module (its runs share the embedded redis-server,
    which is stopped when the module is done). A module that needs a fresh directory
    per test defines its own ``data_dir``."""
    path = tmp_path_factory.mktemp("rlc-data")
    try:
        yield path
    finally:
        stop_embedded_redis(path)
