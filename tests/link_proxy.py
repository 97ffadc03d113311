"""A TCP relay between a replica and its primary that a test can hold, like a partition.

While held, bytes from the primary are kept in the relay instead of being delivered, so
the replica falls behind without noticing (its link stays up, as in a network stall);
``close()`` drops what was held. SIGSTOP on the replica would not do: the kernel still
buffers what the primary sends, and the replica catches up the moment it resumes.
"""

from __future__ import annotations

import socket
import threading

from events.embedded import HOST


class LinkProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server((HOST, 0))
        self.port = self._listener.getsockname()[1]
        self._held = threading.Event()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def hold(self) -> None:
        self._held.set()

    def close(self) -> None:
        """Cut the link and drop anything held (the primary died with it in flight)."""
        self._closed.set()
        with self._lock:
            for s in [self._listener, *self._sockets]:
                try:
                    s.close()
                except OSError:
                    pass

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection((HOST, self.target_port), timeout=5)
                upstream.settimeout(None)
            except OSError:
                if self._closed.is_set():
                    return
                continue
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_primary: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if from_primary and self._held.is_set():
                    continue  # never delivered: lost with the primary
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
