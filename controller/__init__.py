"""The controller: pure state, reducer and policies (core) plus the async loop, recovery and wiring (shell)."""
