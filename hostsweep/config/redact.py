"""Credentials in URIs (`http://user:pw@host`) kept out of everything printed, logged or saved.

A tracking URI may carry a password; the sweep prints it, logs it, saves it in the
config artifact and Hydra writes it into the run directory. Every such place goes
through `redact`, which keeps the user name and hides the password.
"""
from __future__ import annotations

import re
from typing import Iterable
from urllib.parse import urlsplit

HIDDEN = "***"
# scheme://userinfo@host: the userinfo is what is hidden (its password part, or all of a token)
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/@\s'\"]+)@")


def _hide(userinfo: str) -> str:
    user, sep, _ = userinfo.partition(":")
    return f"{user}:{HIDDEN}" if sep else HIDDEN


def redact(text: str) -> str:
    """`text` with the credentials of every URI in it hidden: user:pw@ -> user:***@."""
    return _USERINFO.sub(lambda m: f"{m['scheme']}{_hide(m['userinfo'])}@", text)


def secrets_in(texts: Iterable[str]) -> list[str]:
    """The credential strings (userinfo) of the URIs in `texts`, longest first: what must
    never appear in a file written from them."""
    found = set()
    for text in texts:
        for match in _USERINFO.finditer(text):
            found.add(match["userinfo"])
    return sorted(found, key=len, reverse=True)


def has_credentials(uri: str) -> bool:
    try:
        return bool(urlsplit(uri).username or urlsplit(uri).password)
    except ValueError:
        return False
