"""Credentials in URIs (`http://user:pw@host`) kept out of everything printed, logged or saved.

A tracking URI may carry a password; the sweep prints it, logs it, saves it in the
config artifact and Hydra writes it into the run directory. Every such place goes
through `redact`, which keeps the user name and hides the password.
"""
from __future__ import annotations

import logging
import re

HIDDEN = "***"
# scheme://userinfo@host: the userinfo is what is hidden (its password part, or all of a token)
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/@\s'\"]+)@")


def _hide(userinfo: str) -> str:
    user, sep, _ = userinfo.partition(":")
    return f"{user}:{HIDDEN}" if sep else HIDDEN


def redact(text: str) -> str:
    """`text` with the credentials of every URI in it hidden: user:pw@ -> user:***@."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{_hide(m['userinfo'])}@", text)


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
