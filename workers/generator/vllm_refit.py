"""Weight refit inside a vLLM worker: a ``worker_extension_cls`` mixed into its Worker.

vLLM imports this class by name in whichever process runs the model (the generator's
own process with the in-process engine, the engine's child otherwise) and adds its
methods to the worker; ``LLM.collective_rpc("rlc_...", args=...)`` calls them. Only
bytes and strings cross that call, which is what both engine modes can carry (in the
multi-process engine a function cannot be sent and tensors arrive as lists).

Protocol, one refit: ``rlc_begin_refit`` -> ``rlc_stage_bucket(bytes)`` per bucket
(``workers.weight_buckets``) -> ``rlc_finish_refit(strip_prefix)``, which reloads the
model from the staged buckets through the worker's ``reload_weights`` (the path that
keeps vLLM's loaded-weight post-processing right; a bare ``model.load_weights`` fails
on parameters it has already processed) and returns how many tensors it loaded. The
caller then resets the prefix cache.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from workers.weight_buckets import unpack_buckets


class RefitExtension:
    _rlc_buckets: list[bytes]

    def rlc_begin_refit(self) -> None:
        self._rlc_buckets = []

    def rlc_stage_bucket(self, bucket: bytes) -> int:
        staged = getattr(self, "_rlc_buckets", None)
        if staged is None:
            raise RuntimeError("rlc_stage_bucket before rlc_begin_refit")
        staged.append(bytes(bucket))
        return len(staged)

    def rlc_finish_refit(self, strip_prefix: str = "") -> int:
        buckets, self._rlc_buckets = getattr(self, "_rlc_buckets", []), []
        count = 0

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for name, tensor in unpack_buckets(buckets):
                count += 1
                yield name.removeprefix(strip_prefix), tensor

        self.reload_weights(weights_iterator=weights())  # type: ignore[attr-defined]
        return count
