"""Event <-> bytes. JSON, so any Redis client in any language can read the log.

The value structs an event carries (``Segment``, ``EnvCall``, ``EnvResult``,
``SegmentFlush``) are written with their default-valued fields left out (the compact
form, ``docs/segments.md``); events' own fields are always written (``schema_version``
must stay on the wire: a missing one reads as the current version). Older logs wrote
every field and decode to the same values. :func:`full_form` gives the every-field form
for tools that print events (``tail --json`` kept its shape).

Decoding is strict: garbage, an unknown ``type``, a missing field or a ``schema_version``
newer than this code knows raises :class:`EventDecodeError` naming the stream position.
Older schema versions pass through :data:`UPCASTERS` (raw dict -> raw dict, one version
step each) before typed decoding, so a log written by any earlier release still decodes.
"""

from __future__ import annotations

from typing import Any, Callable, Final

import msgspec

from events.errors import EventDecodeError
from events.schema import CURRENT_SCHEMA_VERSION, EVENT_TYPES, AnyEvent, Event

_encoder = msgspec.json.Encoder()
_fast_decoder = msgspec.json.Decoder(AnyEvent)
_raw_decoder = msgspec.json.Decoder(dict[str, Any])

#: (type name, from_version) -> function upgrading the raw dict to from_version + 1.
#: Empty while every type is at version 1; a rename adds an entry here plus a golden
#: fixture of the old bytes.
UPCASTERS: Final[dict[tuple[str, int], Callable[[dict[str, Any]], dict[str, Any]]]] = {}


def encode(event: Event) -> bytes:
    return _encoder.encode(event)


def full_form(value: Any) -> Any:
    """``value`` as builtins with every field present, defaults included (what
    ``msgspec.to_builtins`` gives for a struct without ``omit_defaults``): the shape a
    reader of printed events has always seen, whatever the wire leaves out."""
    if isinstance(value, msgspec.Struct):
        info = value.__struct_config__
        out: dict[str, Any] = {} if info.tag_field is None else {info.tag_field: info.tag}
        for name, wire in zip(value.__struct_fields__, value.__struct_encode_fields__):
            out[wire] = full_form(getattr(value, name))
        return out
    if isinstance(value, (list, tuple)):
        return [full_form(v) for v in value]
    if isinstance(value, dict):
        return {k: full_form(v) for k, v in value.items()}
    # bytes stay bytes: msgpack writes them as such (JSON as base64, as before)
    return msgspec.to_builtins(value, builtin_types=(bytes, bytearray, memoryview))


def decode(data: bytes | str, position: int | None = None) -> AnyEvent:
    """Decode one event. ``position`` is only used to name the entry in errors."""
    try:
        event = _fast_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as fast_err:
        # Slow path: tell a future version, an old version, an unknown type and
        # plain garbage apart, and upcast where we can.
        return _decode_slow(data, position, fast_err)
    if event.schema_version != CURRENT_SCHEMA_VERSION:
        return _decode_slow(data, position, None)
    return event


def _decode_slow(
    data: bytes | str, position: int | None, fast_err: Exception | None
) -> AnyEvent:
    try:
        raw = _raw_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise EventDecodeError(position, f"not a JSON object: {err}") from None
    type_name = raw.get("type")
    if not isinstance(type_name, str):
        raise EventDecodeError(position, "missing or non-string 'type' field")
    if type_name not in EVENT_TYPES:
        raise EventDecodeError(
            position,
            f"unknown event type {type_name!r} (known: {', '.join(sorted(EVENT_TYPES))})",
        )
    version = raw.get("schema_version", CURRENT_SCHEMA_VERSION)
    if not isinstance(version, int) or version < 1:
        raise EventDecodeError(position, f"invalid schema_version {version!r}")
    if version > CURRENT_SCHEMA_VERSION:
        raise EventDecodeError(
            position,
            f"{type_name} has schema_version {version}, newer than this code "
            f"understands ({CURRENT_SCHEMA_VERSION}); upgrade rl-controller",
        )
    while version < CURRENT_SCHEMA_VERSION:
        upcaster = UPCASTERS.get((type_name, version))
        if upcaster is None:
            raise EventDecodeError(
                position, f"no upcaster for {type_name} schema_version {version}"
            )
        raw = upcaster(raw)
        version += 1
        raw["schema_version"] = version
    try:
        return msgspec.convert(raw, AnyEvent)
    except msgspec.ValidationError as err:
        detail = err if fast_err is None else fast_err
        raise EventDecodeError(position, f"invalid {type_name}: {detail}") from None
