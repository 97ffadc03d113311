"""Multi-turn environments and the episode runner (docs/agents.md).

``base``: the Environment interface (reset/step, idempotency keys, declared dedup);
``tools``: tool calls in a small model's text; ``calculator``: the built-in tool task;
``reasoning_gym`` / ``textarena``: adapters for those packages; ``recorder``: the turn
recorder every model turn and env step passes through; ``runner``: the episode runner;
``trajectory``: token-exact trajectories, loss masks and per-token advantages;
``group``: a generator's group of episodes.

Importing this package imports no torch (the torch modules are imported by name).
"""
