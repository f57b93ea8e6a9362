"""Keeping secrets out of what is shown or sent: passwords in URLs, and one-line error reasons."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

# scheme://[user]:password@ — the password is whatever stands between the colon and the @.
_URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^\s:/@]*:)[^\s@/]+@", re.IGNORECASE)
MAX_REASON_CHARS = 500


def redact_url(url: str | None) -> str | None:
    """`url` with any password replaced by `***`, for display."""
    if not url:
        return url
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:" if parts.username else ":"
    return urlunsplit(parts._replace(netloc=f"{user}***@{netloc}"))


def redact_text(text: str) -> str:
    """`text` with the password of every URL in it replaced by `***`."""
    return _URL_PASSWORD.sub(r"\1***@", text)


def one_line_reason(reason: str | BaseException) -> str:
    """A reason as a job or a run stores it: one line, no NUL, no URL password, bounded."""
    if isinstance(reason, BaseException):
        first = str(reason).strip().splitlines()[0] if str(reason).strip() else ""
        reason = f"{type(reason).__name__}: {first}" if first else type(reason).__name__
    line = " ".join(redact_text(reason).replace("\x00", "\ufffd").split())
    return line if len(line) <= MAX_REASON_CHARS else line[: MAX_REASON_CHARS - 1] + "…"


def without_credentials(url: str) -> str:
    """`url` without its user and password: the address a record or a message may carry."""
    netloc = urlsplit(url).netloc
    if "@" not in netloc:
        return url
    start = url.index("//") + 2  # by hand: urlunsplit would write unix:///path as unix:/path
    return url[:start] + netloc.rsplit("@", 1)[1] + url[start + len(netloc) :]


def has_credentials(url: str) -> bool:
    """Whether `url` carries a user or a password."""
    return "@" in urlsplit(url).netloc
