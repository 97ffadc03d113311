"""Redis URLs: checked before any connection, and shown without their password.

redis-py parses a URL only when a client is built, and a malformed one surfaces as a
traceback from deep inside it (``http://...``: a bare ValueError; ``host:6379``: the
host taken for a scheme; ``:notaport``: urllib's port cast) -- or, for a database that
is not a number, is silently read as database 0. ``check_url`` says what is wrong in
one sentence, naming the forms that work.
"""

from __future__ import annotations

from urllib.parse import unquote, urlsplit, urlunsplit

from events.errors import StoreUrlError

FORMS = ("redis://[[USER]:PASSWORD@]HOST[:PORT][/DB], rediss://... (TLS) "
         "or unix:///PATH/TO/SOCKET[?db=DB]")


def redact_url(url: str) -> str:
    """The URL without its password, for messages and logs (also for a malformed URL)."""
    parts = urlsplit(url)
    userinfo, at, host = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.split(":", 1)[0]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def check_url(url: str) -> None:
    """Raise :class:`StoreUrlError` when redis-py could not use ``url`` as meant."""
    safe = redact_url(url)
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise StoreUrlError(f"{safe!r} is not a Redis URL: expected {FORMS}")
    if parts.scheme == "unix":
        if not parts.path:
            raise StoreUrlError(f"{safe!r} names no socket: expected unix:///PATH/TO/SOCKET")
        return
    try:
        parts.port  # noqa: B018 -- urllib checks the port when it is read
    except ValueError:
        port = parts.netloc.rpartition("@")[2].rpartition(":")[2]
        raise StoreUrlError(
            f"{safe!r}: port {port!r} is not a number from 0 to 65535 (expected {FORMS})"
        ) from None
    db = unquote(parts.path).strip("/")
    if db and not db.isdigit():
        raise StoreUrlError(f"{safe!r}: database {db!r} is not a number (expected {FORMS})")
