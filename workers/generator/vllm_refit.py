"""Weight refit inside a vLLM worker: a ``worker_extension_cls`` mixed into its Worker.

vLLM imports this class by name in whichever process runs the model (the generator's
own process with the in-process engine, the engine's child otherwise) and adds its
methods to the worker; ``LLM.collective_rpc("rlc_...", args=...)`` calls them. Only a
path, integers and strings cross that call, which is what both engine modes can carry
(in the multi-process engine a function cannot be sent and tensors arrive as lists).

One refit is one call, ``rlc_refit_from_spool(path, spans, strip_prefix)``: the
version's buckets (``workers.weight_buckets``) lie in the generator's spool file
(``workers.weight_spool``, on the same host), and the worker reads them back one at a
time into its ``reload_weights`` (the path that keeps vLLM's loaded-weight
post-processing right; a bare ``model.load_weights`` fails on parameters it has
already processed). So the engine holds about one bucket and one reassembled tensor
beyond its model, never a staged copy of the whole version. It returns how many
tensors it loaded; the caller then resets the prefix cache.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from workers.weight_buckets import unpack_buckets
from workers.weight_spool import SpooledBuckets


class RefitExtension:
    def rlc_refit_from_spool(
        self, path: str, spans: Sequence[Sequence[int]], strip_prefix: str = ""
    ) -> int:
        buckets = SpooledBuckets(path, tuple((int(o), int(n)) for o, n in spans))
        count = 0

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for name, tensor in unpack_buckets(buckets):
                count += 1
                yield name.removeprefix(strip_prefix), tensor

        self.reload_weights(weights_iterator=weights())  # type: ignore[attr-defined]
        return count
