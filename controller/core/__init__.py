"""The controller's functional core: state, reducer, policies, fold, step metrics.

Everything here is a pure function of events and state: no I/O, no clock, no
randomness, no logging (``tests/unit/test_architecture.py`` checks that importing this
package pulls in none of redis, ray, torch, asyncio or structlog). The shell around it
-- the loop, recovery, the log writer, wiring and the CLI -- is the rest of
``controller/``.
"""
