"""Each stop signal a driver can get (Ctrl-C, `timeout`/SLURM/Kubernetes, a closed
terminal) stops a sweep the same way: KeyboardInterrupt, and remembered for check()."""
from __future__ import annotations

import os
import signal

import pytest

from hostsweep.run import signals


@pytest.fixture
def installed():
    before = {s: signal.getsignal(s) for s in signals.SIGNALS}
    signals._received.clear()
    signals.install()
    yield
    for s, handler in before.items():
        signal.signal(s, handler)
    signals._received.clear()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_raises_keyboard_interrupt_and_is_remembered_for_the_dispatch_loop(installed, signum):
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signum)  # Python runs the handler before the next bytecode
    assert signals.received() == signum
    with pytest.raises(KeyboardInterrupt):  # a swallowed interrupt is raised again at the next poll
        signals.check()
