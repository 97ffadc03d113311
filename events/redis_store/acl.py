"""Least-privilege Redis ACL users for the run log (see docs/security.md).

Two roles, both limited to the ``rlc:*`` keys and no pub/sub channels:

* ``controller`` -- exactly the commands ``events.redis_store`` sends (and the ones its
  Lua scripts call, which Redis checks against the same user);
* ``reader`` -- read commands only (``+@read``): ``runs``, ``tail --follow``, ``replay``,
  ``staleness`` and ``audit`` work; ``run`` fails at its first write, before any write.

The reader gets no scripting: the scripted page read of ``controller.projector`` falls back
to plain XRANGE when EVAL is refused.

    ACL SETUSER rlc-controller on >secret <rules of acl_rules("controller")>
"""

from __future__ import annotations

from typing import Literal

Role = Literal["controller", "reader"]

#: what every client sends on connecting: handshake, auth, db selection, ping. (redis-py
#: also tries CLIENT SETINFO, which does not exist before Redis 7.2; it ignores a refusal.)
CONNECTION_COMMANDS = ("hello", "auth", "select", "ping")

#: commands the controller's store sends, directly or from its scripts
CONTROLLER_COMMANDS = (
    "eval", "evalsha",                                      # append, snapshot scripts
    "xadd", "xrange", "xread", "xlen",                      # the stream
    "hget", "hmget", "hset", "hincrby",                     # meta and snapshot hashes
    "sadd", "smembers", "sismember",                        # the set of runs
    "wait", "set", "info",                                  # store.replicas > 0: WAIT, the
)                                                           # replay barrier key, and the
                                                            # connected replicas (INFO)

KEY_PATTERN = "rlc:*"


def acl_rules(role: Role) -> list[str]:
    """ACL SETUSER rules (without ``on`` and the password) for ``role``."""
    base = ["resetkeys", f"~{KEY_PATTERN}", "resetchannels", "-@all"]
    allowed = [f"+{c}" for c in CONNECTION_COMMANDS]
    if role == "controller":
        return base + allowed + [f"+{c}" for c in CONTROLLER_COMMANDS]
    if role == "reader":
        return base + allowed + ["+@read"]
    raise ValueError(f"unknown ACL role {role!r}; expected 'controller' or 'reader'")
