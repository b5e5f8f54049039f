"""Loopback listeners that stand for a cluster address gone wrong: one that accepts and
never answers (a mistyped port on a busy head, a stuck process), one that answers as an
HTTP/2 (gRPC) server does, one that answers as something else. Each runs on a daemon
thread on 127.0.0.1 and stops when its block ends."""
from __future__ import annotations

import socket
import threading
from contextlib import contextmanager
from typing import Iterator, Optional

from hostsweep.run.netprobe import SETTINGS_FRAME


@contextmanager
def listener(reply: Optional[bytes]) -> Iterator[int]:
    """A loopback port that accepts every connection and, given `reply`, sends it once
    (None: says nothing, keeping the connection open); yields the port."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    held: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except (socket.timeout, OSError):
                continue
            held.append(conn)
            if reply is not None:
                conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(2)
        for conn in held:
            conn.close()
        server.close()


def silent_listener():
    return listener(None)


def grpc_like_listener():
    return listener(SETTINGS_FRAME)


def http1_listener():
    return listener(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
