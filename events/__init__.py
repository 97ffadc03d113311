"""The event log: schema, codec, the EventStore protocol tiers and their implementations.

``schema``, ``codec`` and ``errors`` are pure data and functions (no I/O, no clock, no
randomness) and are all the controller's pure core imports from here; so are
``config_checks`` and ``store_config`` (the ``[store]`` table and a store's address).
The store is shell: ``store`` (the ``EventStore`` / ``ServerEventStore`` protocols and
the checks every implementation shares), ``memory_store`` (the in-process twin),
``redis_store`` (the only package that imports ``redis``), ``factory`` (``open_store``:
an address to a store) and ``embedded`` (manages a local ``redis-server`` process).
"""
