"""The event log: schema, codec, the EventStore protocol and its implementations.

``schema``, ``codec`` and ``errors`` are pure data and functions (no I/O, no clock, no
randomness) and are all the controller's pure core imports from here. The store
implementations are shell: ``store`` (protocol + in-memory store, async ``follow``),
``redis_store`` (the only module that imports ``redis``) and ``embedded`` (manages a
local ``redis-server`` process).
"""
