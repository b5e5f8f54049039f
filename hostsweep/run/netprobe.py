"""Whether something answers at host:port, asked with a bounded timeout before a client
that retries for minutes (Ray's GCS client, a database driver) is handed the address.

Two questions, both refused in one line (ConfigError) within their timeout:
- does anything accept a TCP connection there (`check_listening`): a port nobody listens
  on, a host that drops packets;
- does a gRPC (HTTP/2) server answer there (`check_grpc_answers`): Ray's GCS and its client
  server speak gRPC, and an HTTP/2 server answers a client's connection preface with its
  own SETTINGS frame at once, before any call. A listener that accepts and then stays
  silent (a mistyped port on a busy head, a stuck process) is what made ray.init hang
  for over ten minutes, retrying the GCS every 5-30 s; a server that answers something
  else (an HTTP/1 server, a database) is not a Ray cluster either.
"""
from __future__ import annotations

import socket
import time

from hostsweep.config.schema import ConfigError

# The HTTP/2 client connection preface (RFC 9113 §3.4) and an empty SETTINGS frame:
# 9-byte frame header, length 0, type 0x4, no flags, stream 0.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS_FRAME = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
FRAME_HEADER_BYTES = 9
SETTINGS_TYPE = 0x4


def _open(host: str, port: int, timeout_s: float, what: str) -> socket.socket:
    try:
        return socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise ConfigError(f"{what}: nothing answers at {host}:{port} within {timeout_s:.0f} s "
                          f"({exc.strerror or exc})") from None


def check_listening(host: str, port: int, timeout_s: float, what: str) -> None:
    """ConfigError within timeout_s unless host:port accepts a TCP connection; `what` names
    the setting in the message (e.g. 'ray.address=…')."""
    _open(host, port, timeout_s, what).close()


def _read_frame_header(conn: socket.socket, deadline: float) -> bytes:
    """Up to one frame header's bytes, until the peer closes or the deadline passes."""
    got = b""
    while len(got) < FRAME_HEADER_BYTES:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        conn.settimeout(left)
        try:
            chunk = conn.recv(FRAME_HEADER_BYTES - len(got))
        except socket.timeout:
            break
        except OSError:
            break  # reset by the peer: as good as closed
        if not chunk:
            break
        got += chunk
    return got


def check_grpc_answers(host: str, port: int, timeout_s: float, what: str) -> None:
    """ConfigError within about timeout_s unless a gRPC (HTTP/2) server answers at host:port:
    a connection is accepted and the server's first frame, SETTINGS, comes back."""
    deadline = time.monotonic() + timeout_s
    conn = _open(host, port, timeout_s, what)
    try:
        try:
            conn.sendall(HTTP2_PREFACE + SETTINGS_FRAME)
        except OSError as exc:
            raise ConfigError(f"{what}: {host}:{port} accepted a connection and closed it "
                              f"({exc.strerror or exc}); is it a Ray cluster?") from None
        header = _read_frame_header(conn, deadline)
    finally:
        conn.close()
    if not header:
        raise ConfigError(f"{what}: {host}:{port} accepts connections but does not answer within "
                          f"{timeout_s:.0f} s (no Ray GCS there: a wrong port, or a stuck process?)")
    if len(header) < FRAME_HEADER_BYTES or header[3] != SETTINGS_TYPE:
        raise ConfigError(f"{what}: {host}:{port} answers, but not as a Ray cluster's gRPC server does "
                          f"(first bytes {header[:16]!r}); is it the right port?")
