"""Media a request points at: `data:` URLs, base64, and local files under
`--allowed-local-media-path DIR` (vLLM's convention). Nothing is ever fetched from the network:
an `http(s)://` URL is a 400.

A local reference is a `file://` URI, an absolute path, or a path relative to DIR. It is read
only when the server was started with the option, and only when its real path (symlinks and
`..` resolved) lies inside DIR's real path. The file is then opened without following a final
symlink and, where /proc exists, the opened descriptor's path is checked again, so a path
swapped for a symlink between the check and the open is refused too. Only regular files are
read, at most `max_bytes` of them.

NOTE: every method may read a file of up to `max_bytes`: call them in a worker thread, never on
the event loop.
"""
from __future__ import annotations

import base64
import binascii
import os
import stat
from pathlib import Path
from urllib.parse import unquote, urlsplit

from omnivox.api.errors import ApiError

MAX_LOCAL_BYTES = 64 << 20  # a local file (the video decoder's own limit)
OPTION = "--allowed-local-media-path"


def strict_b64(data: str) -> bytes | None:
    """Strict standard base64 (padded, no whitespace), or None."""
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw or None


def unreadable(ref: str, param: str) -> ApiError:
    """The one refusal of a local path: outside DIR, missing, not a regular file or swapped for
    a symlink while opened. NOTE: one message, without DIR's real path, so a client cannot map
    the server's files (which exist outside DIR, where DIR lies) from the answers."""
    return ApiError(400, f"{param}: local media {ref!r:.200} is not a readable file under {OPTION}", param=param,
                    code="media_path_not_allowed")


def _is_url(ref: str) -> bool:
    head = ref.split("://", 1)[0] if "://" in ref else ""
    return bool(head) and head.replace("+", "").replace("-", "").replace(".", "").isalnum()


class MediaReader:
    """Turns what a request names (a data: URL, base64, a local path) into the file's bytes."""

    def __init__(self, root: Path | None = None, max_bytes: int = MAX_LOCAL_BYTES):
        self.root = Path(os.path.realpath(root)) if root is not None else None
        self.max_bytes = max_bytes

    # ---- what a field may hold -------------------------------------------------------------
    def audio(self, ref: str, param: str) -> bytes:
        """`ref_audio`: a data: URL, a file:// URI, a path naming a file that exists (with the
        option), else base64 of the file. NOTE: a path that does not exist and is also valid base64
        is read as base64: write file:// URIs to be unambiguous."""
        if ref.startswith("data:"):
            return self.data_url(ref, param)
        if _is_url(ref) or self._names_a_file(ref):
            return self.local(ref, param)  # file:// is read; any other scheme is refused there
        raw = strict_b64(ref)
        if raw is not None:
            return raw
        if self.root is None:
            raise ApiError(400, f"{param} is neither valid base64 nor a data: URL (a local path needs the server "
                                f"option {OPTION})", param=param, code="invalid_base64")
        return self.local(ref, param)

    def _names_a_file(self, ref: str) -> bool:
        if self.root is None or len(ref) > 4096:
            return False
        try:
            return os.path.lexists(self.root / ref)  # absolute refs replace the root
        except (OSError, ValueError):
            return False

    def url(self, ref: str, param: str) -> bytes | None:
        """A content part's URL: None for a data: URL (decoded later, with the prompt), else the
        bytes of the local file it names."""
        if ref.startswith("data:"):
            return None
        return self.local(ref, param)

    def data_url(self, ref: str, param: str) -> bytes:
        head, sep, payload = ref.partition(",")
        raw = strict_b64(payload) if sep and head.endswith(";base64") else None
        if raw is None:
            raise ApiError(400, f"{param} is not a base64 data: URL (data:<mime>;base64,<standard padded base64>)",
                           param=param, code="invalid_base64")
        return raw

    # ---- local files ---------------------------------------------------------------------
    def local(self, ref: str, param: str) -> bytes:
        """The bytes of the local file `ref` names (a path or a file:// URI), inside the root only."""
        path = self._path(ref, param)
        real = Path(os.path.realpath(path))
        if not real.is_relative_to(self.root):
            raise unreadable(ref, param)
        return self._read(real, ref, param)

    def _path(self, ref: str, param: str) -> Path:
        if _is_url(ref):
            parts = urlsplit(ref)
            scheme = parts.scheme.lower()
            if scheme in ("http", "https"):
                raise ApiError(400, f"{param}: this server fetches nothing from the network; send the media "
                                    "inline (base64 or a data: URL)", param=param, code="url_not_allowed")
            if scheme != "file" or parts.netloc not in ("", "localhost"):
                raise ApiError(400, f"{param}: only data: URLs and file:// URIs (under {OPTION}) are accepted, "
                                    f"got a {scheme}: URL", param=param, code="url_not_allowed")
            ref = unquote(parts.path)
        if self.root is None:
            raise ApiError(400, f"{param}: local media paths are off; start the server with {OPTION} DIR to read "
                                "files under DIR, or send the media inline (base64 or a data: URL)",
                           param=param, code="media_path_not_allowed")
        if not ref or "\x00" in ref:
            raise ApiError(400, f"{param}: empty or invalid path", param=param, code="media_path_not_allowed")
        path = Path(ref)
        return path if path.is_absolute() else self.root / path

    def _read(self, real: Path, ref: str, param: str) -> bytes:
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)  # no FIFO waits
        try:
            fd = os.open(real, flags)
        except OSError:
            raise unreadable(ref, param) from None
        try:
            info = os.fstat(fd)
            proc = Path(f"/proc/self/fd/{fd}")
            escaped = proc.exists() and not Path(os.readlink(proc)).is_relative_to(self.root)
            if escaped or not stat.S_ISREG(info.st_mode):
                raise unreadable(ref, param)
            if info.st_size > self.max_bytes:
                raise ApiError(413, f"{param}: {ref!r:.200} is {info.st_size} bytes; the limit is {self.max_bytes}",
                               param=param, code="request_too_large")
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read(self.max_bytes + 1)
        finally:
            os.close(fd)
        if len(data) > self.max_bytes:  # it grew after fstat
            raise ApiError(413, f"{param}: {ref!r:.200} is larger than {self.max_bytes} bytes", param=param,
                           code="request_too_large")
        if not data:
            raise ApiError(400, f"{param}: {ref!r:.200} is empty", param=param, code="invalid_value")
        return data
