"""``--ray-address`` is checked in seconds: a Ray head answers as gRPC, nothing else does.

Real servers on loopback: a gRPC server (what a Ray head's GCS is), one that says
nothing, one that answers as Redis would, one that answers as a web server would.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from concurrent import futures

import pytest

from cli.common import CliError
from cli.ray_cluster import check_address


def _serve_once(reply: bytes | None) -> tuple[int, threading.Event]:
    """A listening port whose one connection gets ``reply`` (None: silence until done)."""
    srv = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        conn, _ = srv.accept()
        conn.recv(100)
        if reply is not None:
            conn.sendall(reply)
        done.wait(10)
        conn.close()
        srv.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1], done


@pytest.fixture
def grpc_port() -> Iterator[int]:
    grpc = pytest.importorskip("grpc")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port
    server.stop(None)


def test_a_grpc_server_is_taken_for_a_ray_head(grpc_port):
    check_address(f"127.0.0.1:{grpc_port}", timeout_s=10)


@pytest.mark.parametrize("reply", [None, b"-ERR unknown command 'PRI'\r\n",
                                   b"HTTP/1.1 400 Bad Request\r\n\r\n"])
def test_something_else_listening_is_refused_in_one_line(reply):
    port, done = _serve_once(reply)
    try:
        with pytest.raises(CliError, match="does not answer as Ray") as err:
            check_address(f"127.0.0.1:{port}", timeout_s=0.5)
    finally:
        done.set()
    assert "\n" not in str(err.value)


def test_a_closed_port_and_a_bad_form_are_refused():
    with pytest.raises(CliError, match="cannot reach Ray at 127.0.0.1:1"):
        check_address("127.0.0.1:1")
    with pytest.raises(CliError, match="expected host:port"):
        check_address("headnode")
    check_address("auto")  # left to Ray
    check_address("ray://head:10001")
