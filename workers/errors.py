"""The one mark of a group's own failure.

A generator call carries several groups (``rollout.groups_per_call``). An error raised
while generating one of them from its own prompt, task, environment or agent -- a
reward ``checked_reward`` refuses, an environment's ``EnvError``, an agent's
``AgentError`` -- fails that group alone: the generator returns a ``"failed"`` outcome
for it and the other groups' outcomes as usual (``workers.service``). Any other error
-- the data plane, fencing, weights, a lost worker, or a bug in our code -- still fails
the whole call, so a bug is never turned quietly into a retried group.

An error is a group's own only if its class derives from :class:`GroupError`; the
classes that do are listed in ``docs/running.md`` (Failures).
"""

from __future__ import annotations


class GroupError(Exception):
    """Generating one group failed for a reason of its own (its prompt, task, env or
    agent); derived from by the errors that say so, beside their usual base class."""
