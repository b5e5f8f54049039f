"""MLflow logging in background threads, so measuring goes on while tracking is slow or down.

Cells are taken in the order they were measured (each is already in the journal), by
`deliveries` threads (tracking.deliveries): with one, MLflow gets them in that order; with
more, several cells are in flight at once (each delivery is a few calls that mostly wait on
a server: a remote store takes several times as many cells a second) and may finish out of
order. With `deliver_many`, a delivery takes up to `batch` cells already waiting in one call
(a database store writes them in one transaction). Each cell is delivered exactly once
whatever the numbers. A failed call is retried with
backoff; when MLflow has refused everything for longer than `outage_s` the uploader gives up
and `failure()` says why, which stops the sweep (the journal keeps the cells for the next
run). It touches the sweep's heartbeat every `heartbeat_s`, busy or idle, so other sweeps
can tell this one is alive.

At most `max_backlog` cells wait in memory (and `deliveries` x `batch` more in flight): when MLflow
is that far behind, `submit` waits for it (a sweep of instant cells then goes at MLflow's
pace, with flat memory; real cells take far longer than their logging). Closing waits for
as long as MLflow keeps taking cells, and for an unreachable MLflow only as long as the
caller allows (tracking.exit_wait_s).
"""
from __future__ import annotations

import logging
import queue
import re
import threading
import time
from typing import Callable, Generic, Optional, TypeVar

from hostsweep.config.redact import error_line

log = logging.getLogger(__name__)

Item = TypeVar("Item")
MAX_BACKOFF_S = 15.0
MAX_BACKLOG = 500
# Put on the queue by close(): the thread, waiting up to a second for an item, ends at once.
_WAKE = object()
_ERRNO = re.compile(r"\[Errno -?\d+\] [^\"')(]+")


def short_reason(exc: BaseException) -> str:
    """Why a call failed, in a few words: the OS error an HTTP client wraps three times
    ("[Errno 111] Connection refused"), else the message's start (the full text is in the
    HTTP library's lines in hostsweep.log)."""
    text = error_line(exc)
    errno = _ERRNO.search(text)
    return errno.group(0) if errno else (text if len(text) <= 160 else text[:157] + "...")


# How often a submit waiting for room in a full backlog asks whether the sweep is stopping.
SUBMIT_SLICE_S = 0.25


class BackgroundLogger(Generic[Item]):
    def __init__(self, deliver: Callable[[Item], None], heartbeat: Callable[[], None], outage_s: float,
                 heartbeat_s: float, clock: Callable[[], float] = time.monotonic,
                 max_backlog: int = MAX_BACKLOG, deliveries: int = 1,
                 deliver_many: Optional[Callable[[list[Item]], None]] = None, batch: int = 1) -> None:
        if deliveries < 1 or batch < 1:
            raise ValueError(f"deliveries and batch must be at least 1, not {deliveries} and {batch}")
        self.deliver, self.heartbeat = deliver, heartbeat
        # with deliver_many: a delivery takes up to `batch` waiting items in one call
        self.deliver_many, self.batch = (deliver_many, batch) if deliver_many is not None else (None, 1)
        self.outage_s, self.heartbeat_s, self.clock = outage_s, heartbeat_s, clock
        self.items: "queue.Queue[Item]" = queue.Queue(maxsize=max_backlog)
        self.wake = threading.Event()  # set to cut a backoff short (closing)
        self.lock = threading.Lock()  # the state below is shared by the delivery threads
        self.closing = False
        self.given_up = False  # closing gave up waiting: deliver nothing more
        self.down_since: Optional[float] = None
        self._failure: Optional[str] = None
        self.last_beat = clock()
        self.submitted = self.delivered = 0
        self.threads = [threading.Thread(target=self._loop, name=f"mlflow-logger-{n}", daemon=True)
                        for n in range(deliveries)]
        self.thread = self.threads[0]
        for thread in self.threads:
            thread.start()

    def submit(self, item: Item, stopping: Callable[[], bool] = lambda: False) -> None:
        """Queue an item; with the backlog full, wait for room, unless `stopping` says the
        sweep is being stopped (then KeyboardInterrupt: the item stays in the journal)."""
        with self.lock:
            self.submitted += 1
        while True:
            try:
                self.items.put(item, timeout=SUBMIT_SLICE_S)
                return
            except queue.Full:
                if stopping():
                    with self.lock:
                        self.submitted -= 1
                    raise KeyboardInterrupt from None

    def failure(self) -> Optional[str]:
        """Why logging gave up (tracking down longer than outage_s), or None."""
        return self._failure

    def pending(self) -> int:
        """Items submitted that MLflow has not taken (yet)."""
        return self.submitted - self.delivered

    def alive(self) -> bool:
        return any(thread.is_alive() for thread in self.threads)

    def _refused(self, exc: BaseException, what: str) -> Optional[float]:
        """Note a refusal; the outage's start, or None once the uploader has given up."""
        with self.lock:
            now = self.clock()
            if self.down_since is None:
                self.down_since = now
                # said once, at the first refusal: what the user needs to know, not the retries
                log.warning("MLflow is unreachable (%s did not go through: %s). Measuring goes on; each measured "
                            "cell is kept in the journal (journal.jsonl) and cells.csv until MLflow takes it. "
                            "Retrying for up to %.0f s (tracking.outage_s), then the sweep stops; a rerun "
                            "uploads what MLflow did not take", what, short_reason(exc), self.outage_s)
            if now - self.down_since >= self.outage_s:
                if self._failure is None:
                    self._failure = (f"MLflow has not answered for {now - self.down_since:.0f} s "
                                     f"(tracking.outage_s={self.outage_s:.0f}): {short_reason(exc)}")
                return None
            return self.down_since

    def _attempt(self, call: Callable[[], None], what: str) -> bool:
        """Run `call`, retrying with backoff until it works or the outage outlasts outage_s."""
        delay = 1.0
        while not self._failure:
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - any refusal is retried the same way
                down = self._refused(exc, what)
                if down is None:
                    return False
                now = self.clock()
                if self.closing and (self.given_up or now - down >= min(self.outage_s, 10.0)):
                    return False  # closing: the journal keeps it, no point waiting the full outage
                self.wake.wait(max(0.0, min(delay, self.outage_s - (now - down))))
                delay = min(2 * delay, MAX_BACKOFF_S)
                continue
            if self.down_since is not None:
                with self.lock:
                    if self.down_since is not None:
                        log.warning("MLflow answers again after %.0f s", self.clock() - self.down_since)
                        self.down_since = None
            return True
        return False

    def _beat_if_due(self) -> None:
        """Touch the heartbeat when heartbeat_s has passed: one thread does, busy or idle."""
        with self.lock:
            if self._failure or self.closing or self.clock() - self.last_beat < self.heartbeat_s:
                return
            self.last_beat = self.clock()  # the others need not: this thread beats
        self._attempt(self.heartbeat, "the heartbeat")
        with self.lock:
            self.last_beat = self.clock()

    def _loop(self) -> None:
        while not self.given_up:
            try:
                item = self.items.get(timeout=min(1.0, self.heartbeat_s))
            except queue.Empty:
                item = _WAKE  # nothing to log: a heartbeat may be due
            if item is _WAKE:
                if self.closing:
                    return
            else:
                items, woken = self._more(item)
                if not self._failure and self._attempt(lambda: self._deliver(items), "a measured cell"):
                    with self.lock:
                        self.delivered += len(items)
                if woken and self.closing:
                    return
            self._beat_if_due()

    def _more(self, item: Item) -> tuple[list[Item], bool]:
        """`item` and up to batch - 1 more already waiting (never waits for them); and
        whether a wake-up (closing) was taken on the way."""
        items = [item]
        while len(items) < self.batch:
            try:
                more = self.items.get_nowait()
            except queue.Empty:
                break
            if more is _WAKE:
                return items, True
            items.append(more)
        return items, False

    def _deliver(self, items: list[Item]) -> None:
        if self.deliver_many is not None:
            self.deliver_many(items)
        else:
            self.deliver(items[0])

    def close(self, timeout_s: float, patient: bool = True, down_wait_s: Optional[float] = None) -> int:
        """Deliver what is queued, stop the threads; returns how many items MLflow did not get
        (they are in the journal). Patient: wait while MLflow keeps taking cells, until it
        has taken none for timeout_s (a long backlog drains however long it is); else wait
        timeout_s at most. down_wait_s: while MLflow is unreachable, wait at most this long
        (from the later of closing and the outage's start) for it to come back."""
        started = progress_at = self.clock()
        last = self.delivered
        while self.pending() and not self._failure and self.alive():
            now = self.clock()
            if self.delivered != last:
                last, progress_at = self.delivered, now
            down = self.down_since
            if down_wait_s is not None and down is not None and now - max(started, down) >= down_wait_s:
                self.given_up = True
                break
            if now - (progress_at if patient else started) >= timeout_s:
                self.given_up = True
                break
            time.sleep(0.05)
        self.closing = True
        self.wake.set()
        for _ in self.threads:  # one wake each; a thread that finds the queue empty ends too
            try:
                self.items.put_nowait(_WAKE)  # type: ignore[arg-type]
            except queue.Full:  # given up on a full backlog: the threads end after their current item
                break
        deadline = self.clock() + max(1.0, timeout_s - (self.clock() - progress_at)) + 15
        for thread in self.threads:
            thread.join(timeout=max(0.0, deadline - self.clock()))
        return self.pending()
