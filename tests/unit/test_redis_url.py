"""Redis URLs are checked before redis-py sees them, and redacted even when malformed."""

from __future__ import annotations

import re

import pytest

from events.errors import StoreUrlError
from events.redis_store.url import check_url, redact_url


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:6379/0", "redis://localhost", "redis://:pw@h:1/2",
    "rediss://user:pw@h:6380/0?ssl_ca_certs=/ca.pem", "unix:///run/redis.sock?db=1",
])
def test_urls_redis_py_accepts_pass(url):
    check_url(url)


@pytest.mark.parametrize(("url", "says"), [
    ("http://localhost:6379", "is not a Redis URL"),
    ("localhost:6379", "is not a Redis URL"),
    ("127.0.0.1", "is not a Redis URL"),
    ("redis://127.0.0.1:notaport/0", "port 'notaport' is not a number"),
    ("redis://127.0.0.1:99999", "port '99999' is not a number"),
    ("redis://127.0.0.1:6379/zero", "database 'zero' is not a number"),
    ("unix://", "names no socket"),
])
def test_malformed_urls_are_one_sentence(url, says):
    with pytest.raises(StoreUrlError, match=says) as err:
        check_url(url)
    assert "\n" not in str(err.value)


def test_the_password_never_shows_even_in_a_malformed_url():
    with pytest.raises(StoreUrlError) as err:
        check_url("redis://:s3cret@host:notaport/0")
    assert "s3cret" not in str(err.value) and ":***@host" in str(err.value)
    assert redact_url("redis://u:s3cret@h:1/0") == "redis://u:***@h:1/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"


@pytest.mark.parametrize(("url", "says"), [
    ("redis://127.0.0.1:1/0?ssl_ca_certs=/ca.pem",
     "no URL parameter 'ssl_ca_certs' for a redis:// connection (TLS parameters need a rediss"),
    ("redis://127.0.0.1:1/0?sockettimeout=2", "no URL parameter 'sockettimeout' for a redis://"),
    ("rediss://127.0.0.1:1/0?ssl_ca_cert=/ca.pem", "no URL parameter 'ssl_ca_cert' for a rediss://"),
])
def test_a_url_parameter_redis_py_does_not_know_is_one_sentence(url, says):
    # redis-py passes it to the connection's constructor: a TypeError at the first
    # command. No server is needed: the store refuses it before it connects.
    from events.redis_store import RedisEventStore

    with pytest.raises(StoreUrlError, match=re.escape(says)) as err:
        RedisEventStore(url)
    assert "\n" not in str(err.value)
