"""``events.factory.open_store``: the one place a store is built from its address."""

from __future__ import annotations

import pytest

from events.factory import NoEmbeddedStoreError, open_store
from events.store import ServerEventStore
from events.store_config import StoreAddress, StoreConfig

pytestmark = pytest.mark.integration


def test_a_url_opens_a_server_store_with_the_given_durability(redis_url):
    store = open_store(StoreAddress(url=redis_url), StoreConfig(wait_timeout_s=2.5))
    try:
        assert isinstance(store, ServerEventStore)
        assert store.replication == StoreConfig(wait_timeout_s=2.5)
        store.require_writable()
        epoch = store.claim_epoch("factory-run")
        assert store.current_epoch("factory-run") == epoch
    finally:
        store.close()


def test_no_config_means_the_default_durability(redis_url):
    store = open_store(StoreAddress(url=redis_url))
    try:
        assert store.replication == StoreConfig()
    finally:
        store.close()


def test_a_directory_without_a_log_is_not_started_unless_asked(tmp_path):
    with pytest.raises(NoEmbeddedStoreError) as err:
        open_store(StoreAddress(data_dir=str(tmp_path / "nothing")))
    assert err.value.data_dir == str(tmp_path / "nothing")
    assert not (tmp_path / "nothing").exists()  # nothing was created


def test_an_address_names_one_server():
    with pytest.raises(ValueError, match="either a URL or Sentinels"):
        open_store(StoreAddress(url="redis://127.0.0.1:1/0", sentinels="127.0.0.1:26379"))
    with pytest.raises(ValueError, match="--redis-master"):
        open_store(StoreAddress(sentinels="127.0.0.1:26379"))
