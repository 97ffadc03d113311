"""The event log: schema, codec, the EventStore protocol and its implementations.

Pure data and protocols live here; exactly one module (``events.redis_store``)
imports ``redis``. Nothing in this package reads a clock or draws randomness.
"""
