"""A cluster address is asked, with a bounded timeout, whether a gRPC server answers there
before Ray is handed it; and joining a cluster is bounded and stays interruptible."""
from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest

from hostsweep.config.schema import ConfigError
from hostsweep.run import cluster
from hostsweep.run.netprobe import check_grpc_answers, check_listening
from tests.listeners import grpc_like_listener, http1_listener, silent_listener


def closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    return port


def test_a_listener_that_never_answers_is_refused_within_the_timeout():
    with silent_listener() as port:
        started = time.monotonic()
        with pytest.raises(ConfigError, match=f"127.0.0.1:{port} accepts connections but does not answer within 1 s"):
            check_grpc_answers("127.0.0.1", port, 1.0, "ray.address=x")
        assert time.monotonic() - started < 3


def test_a_server_answering_the_http2_preface_passes():
    with grpc_like_listener() as port:
        check_grpc_answers("127.0.0.1", port, 2.0, "ray.address=x")


def test_a_server_answering_something_else_is_refused_as_not_a_ray_cluster():
    with http1_listener() as port:
        with pytest.raises(ConfigError, match="answers, but not as a Ray cluster's gRPC server does"):
            check_grpc_answers("127.0.0.1", port, 2.0, "ray.address=x")


def test_a_port_nobody_listens_on_is_refused_with_nothing_answers():
    port = closed_port()
    with pytest.raises(ConfigError, match=f"ray.address=x: nothing answers at 127.0.0.1:{port}"):
        check_grpc_answers("127.0.0.1", port, 1.0, "ray.address=x")
    with pytest.raises(ConfigError, match="nothing answers"):
        check_listening("127.0.0.1", port, 1.0, "ray.address=x")


def test_the_address_check_asks_the_grpc_handshake_unless_tls_is_on(monkeypatch):
    with silent_listener() as port:
        monkeypatch.delenv("RAY_USE_TLS", raising=False)
        with pytest.raises(ConfigError, match="does not answer"):
            cluster.check_address_answers(f"127.0.0.1:{port}", timeout_s=0.5)
        monkeypatch.setenv("RAY_USE_TLS", "1")  # a TLS server cannot be asked in cleartext
        cluster.check_address_answers(f"127.0.0.1:{port}", timeout_s=0.5)


class HangingRay:
    """ray.init as Ray's GCS client behaves against a server that never becomes a cluster:
    it does not return (until released, so the test leaves no thread behind)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.called = threading.Event()

    def init(self, **kwargs) -> None:
        self.called.set()
        self.release.wait(30)
        raise ConnectionError("released by the test")


def test_joining_a_cluster_that_never_connects_gives_up_at_the_timeout_in_one_line():
    ray = HangingRay()
    started = time.monotonic()
    try:
        with pytest.raises(ConfigError, match=r"ray.address=127.0.0.1:1: Ray did not connect within 1 s "
                                              r"\(ray.connect_timeout_s\)"):
            cluster._join(ray, "127.0.0.1:1", log_to_driver=False, timeout_s=1.0)
    finally:
        ray.release.set()
    assert ray.called.is_set() and time.monotonic() - started < 3


def test_joining_leaves_the_drivers_environment_as_it_was(monkeypatch):
    """Whatever a join sets in os.environ reaches every engine and child the driver starts
    (and, in a test run, every later test's sweep): a set RAY_BACKEND_LOG_LEVEL put Ray's
    announcement of it on their consoles."""
    monkeypatch.delenv("RAY_BACKEND_LOG_LEVEL", raising=False)
    ray = HangingRay()
    ray.release.set()
    before = dict(os.environ)
    with pytest.raises(ConfigError, match="could not join the cluster: released by the test"):
        cluster._join(ray, "127.0.0.1:1", log_to_driver=False, timeout_s=5.0)
    assert dict(os.environ) == before


def test_a_stop_signal_while_joining_stops_the_wait(monkeypatch):
    """ray.init blocks in C++, where a signal's Python handler cannot run: the wait for it
    happens on the main thread, so the stop handler (raising KeyboardInterrupt) runs."""
    ray = HangingRay()

    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            cluster._join(ray, "127.0.0.1:1", log_to_driver=False, timeout_s=20.0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        ray.release.set()
    assert time.monotonic() - started < 3


def test_a_refusal_by_ray_itself_is_one_line_naming_the_address():
    class RefusingRay:
        def init(self, **kwargs) -> None:
            raise ConnectionError("Could not find any running Ray instance.\nmore lines")

    with pytest.raises(ConfigError, match="ray.address=127.0.0.1:1: could not join the cluster: "
                                          "Could not find any running Ray instance.$"):
        cluster._join(RefusingRay(), "127.0.0.1:1", log_to_driver=False, timeout_s=5.0)
