"""Keeps clients' keys out of uvicorn's log: `install()` adds a filter to the loggers that write
request lines (`uvicorn.access` for HTTP, `uvicorn.error` for WebSocket "accepted"/"rejected"
lines), which blanks the value of every key-like query parameter (`?api_key=`, `?key=`,
`?access_token=`, `?openai-insecure-api-key=`, ...) before the line is formatted.

Why: this server reads keys only from headers, but a client may still put one in a URL (some SDKs
and browser code do), and at `--log-level info` every URL is written out in full. Headers
(`Authorization`) are never logged: uvicorn's lines hold the method, path, query and status only.
"""
from __future__ import annotations

import logging
import re
from urllib.parse import unquote_plus

LOGGERS = ("uvicorn.access", "uvicorn.error")
SECRET_NAME = re.compile(r"key|token|secret|passw|auth|sig|credential|session", re.IGNORECASE)
PARAM = re.compile(r"([?&;])([^=&;#\s\"]*)=([^&;#\s\"]*)")
REDACTED = "***"


def redact(text: str) -> str:
    """`text` with the values of key-like query parameters replaced by `***`."""
    if "?" not in text:
        return text

    def blank(m: re.Match) -> str:
        name = unquote_plus(m.group(2))
        return f"{m.group(1)}{m.group(2)}={REDACTED}" if SECRET_NAME.search(name) else m.group(0)

    return PARAM.sub(blank, text)


class RedactQueryKeys(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and record.args:
            record.args = tuple(redact(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.msg, str):
            record.msg = redact(record.msg)
        return True


def install() -> None:
    """Add the filter to uvicorn's loggers (once; safe before or after uvicorn configures logging,
    which keeps a logger's filters)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RedactQueryKeys) for f in logger.filters):
            logger.addFilter(RedactQueryKeys())
