"""Credentials in URIs (`http://user:pw@host`) kept out of everything printed, logged or saved.

A tracking URI may carry a password; the sweep prints it, logs it, saves it in the
config artifact and Hydra writes it into the run directory. Every such place goes
through `redact`, which keeps the user name and hides the password; the entry points
also pass every log record (`redact_log_records`) and every console write
(`redact_console`) through it, for what other code prints.
"""
from __future__ import annotations

import logging
import re
import sys
from typing import TextIO

HIDDEN = "***"
# scheme://userinfo@host: the userinfo is what is hidden (its password part, or all of a token)
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/@\s'\"]+)@")


def _hide(userinfo: str) -> str:
    user, sep, _ = userinfo.partition(":")
    return f"{user}:{HIDDEN}" if sep else HIDDEN


def redact(text: str) -> str:
    """`text` with the credentials of every URI in it hidden: user:pw@ -> user:***@."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{_hide(m['userinfo'])}@", text)


def error_line(exc: BaseException) -> str:
    """An exception as one line a person reads: its message's first line, credentials
    hidden; its type's name when it has no message."""
    lines = str(exc).strip().splitlines()
    return redact(lines[0]) if lines else type(exc).__name__


def redact_log_records() -> None:
    """Every log record's message passes through redact: credentials in a tracking URI
    never reach the console or a log file, whoever logs them (MLflow and urllib3 included).
    Installed once by each entry point (hostsweep, hostsweep-model)."""
    make = logging.getLogRecordFactory()

    def factory(*args: object, **kwargs: object) -> logging.LogRecord:
        record = make(*args, **kwargs)
        message = record.getMessage()
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, ()
        return record

    logging.setLogRecordFactory(factory)


class RedactingStream:
    """A text stream whose every write goes through redact. The CLI's stdout and stderr
    are wrapped: what hostsweep does not print itself is covered too (Hydra's "Error
    executing job with overrides: [...]" quotes the overrides, a traceback may quote a URI)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(redact(text))
        return len(text)

    def writelines(self, lines: list[str]) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> object:  # flush, fileno, isatty, encoding, buffer...
        return getattr(self._stream, name)


def redact_console() -> None:
    """Wrap sys.stdout and sys.stderr in RedactingStream (once)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, RedactingStream):
            setattr(sys, name, RedactingStream(stream))
