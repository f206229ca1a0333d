"""What a request must show before any of its body is read: an allowed `Host`, a same-origin
`Origin` for state-changing requests to a server without an API key, `Content-Type:
application/json` on JSON routes, and room in the budget of bodies being received; all of them,
with the API key and the body's size, in the order a client fixes them: `RequestGuard`, which
`omnivox serve` (`server.Gate`) and the ingress of `--replicas` (`replicas/ingress.py`) share.

Why: a web page the user visits can send "simple" cross-origin requests (text/plain,
multipart/form-data) to a local server without a preflight, and a DNS-rebinding page can even
read replies by naming its own domain in `Host`. Requiring JSON's content type forces a
preflight (which this server never grants); the Origin check stops multipart ones; the Host
check stops rebinding (an IP literal cannot be rebound, a name must be allowed).
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
from typing import Callable, Protocol
from urllib.parse import urlsplit

from starlette.types import Message, Receive, Scope

from omnivox.api.errors import ApiError

JSON_ROUTES = ("/v1/chat/completions", "/v1/audio/speech")
WILDCARDS = ("0.0.0.0", "::", "")
DISCARD_BYTES = 64 * 2**20
DISCARD_IDLE_S = 1.0  # a refused body that stalls this long is not waited for
LOOPBACK_NAMES = ("localhost",)


def _ip(name: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return None


def split_host(value: str) -> str:
    """The host name of a `Host` value (`name:port`, `[v6]:port`), lower case, no trailing dot."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0].rstrip(".") if value.count(":") == 1 else value.rstrip(".")


def names_this_machine(value: str) -> bool:
    """Whether a `Host` value (or an origin's `name:port`) names this machine in a way no DNS
    rebinding can claim: an IP literal or `localhost`."""
    name = split_host(value)
    return name in LOOPBACK_NAMES or _ip(name) is not None


class HostPolicy:
    """Which `Host` headers this server answers: IP literals of the bound address (any IP when
    bound to a wildcard address), `localhost` when bound to loopback or a wildcard, and the names
    of `--allowed-hosts` (`*` allows any)."""

    def __init__(self, bind_host: str, allowed: list[str] | tuple[str, ...] = ()):
        self.bind = bind_host.strip("[]")
        self.any = "*" in allowed
        self.names = {split_host(a) for a in allowed if a != "*"}
        ip = _ip(self.bind)
        self.bind_ip = ip
        if self.bind in WILDCARDS or (ip is not None and ip.is_loopback) or self.bind in LOOPBACK_NAMES:
            self.names.update(LOOPBACK_NAMES)
        if ip is None and self.bind not in WILDCARDS:
            self.names.add(self.bind.lower())  # bound by name

    @classmethod
    def from_flags(cls, args) -> "HostPolicy":
        """The policy of the serve flags --host and --allowed-hosts (comma-separated)."""
        return cls(args.host, [h.strip() for h in args.allowed_hosts.split(",") if h.strip()])

    def allows(self, host: str) -> bool:
        name = split_host(host)
        if self.any or name in self.names:
            return True
        ip = _ip(name)
        if ip is None:
            return False
        return self.bind in WILDCARDS or ip == self.bind_ip

    def check(self, headers: dict[bytes, bytes]) -> ApiError | None:
        host = headers.get(b"host")
        if host is None:  # HTTP/1.0 without Host: no browser sends that
            return None
        value = host.decode("latin-1")
        if self.allows(value):
            return None
        return ApiError(400, f"Host {value[:100]!r} is not served here: this server answers its bind address "
                             f"{self.bind or '*'} and the names of --allowed-hosts (start it with "
                             f"--allowed-hosts {split_host(value)[:100]} to allow this one)", code="invalid_host")


def check_origin(headers: dict[bytes, bytes], policy: HostPolicy) -> ApiError | None:
    """A state-changing request from a web page must come from this server's own origin: under a
    Host it answers that is an IP literal, `localhost`, or a name --allowed-hosts lists. NOTE:
    never a name answered only through `--allowed-hosts '*'`: a page on a rebound DNS name claims
    that name as both Host and Origin."""
    site = headers.get(b"sec-fetch-site", b"").decode("latin-1").lower()
    origin = headers.get(b"origin")
    if origin is None and site not in ("cross-site", "same-site"):
        return None  # not sent by a browser on another site (curl, SDKs, the openai client)
    value = (origin or b"").decode("latin-1")
    own = headers.get(b"host", b"").decode("latin-1").lower()
    parts = urlsplit(value)
    named = names_this_machine(parts.netloc) or split_host(parts.netloc.lower()) in policy.names
    same = parts.scheme in ("http", "https") and parts.netloc.lower() == own and policy.allows(parts.netloc) and named
    if same and site in ("", "same-origin", "none"):
        return None
    return ApiError(403, f"cross-origin request refused (Origin {value[:100] or site!r}): without --api-key this "
                         "server takes state-changing requests only from clients that are not web pages on "
                         "another site", code="cross_origin_refused")


def check_json(headers: dict[bytes, bytes]) -> ApiError | None:
    kind = headers.get(b"content-type", b"").decode("latin-1")
    if kind.split(";", 1)[0].strip().lower() == "application/json":
        return None
    got = f"Content-Type {kind[:80]!r}" if kind else "no Content-Type"
    return ApiError(415, f"send the body as JSON with Content-Type: application/json ({got} was sent)",
                    code="unsupported_media_type")


class BodyBudget:
    """Bytes of request bodies being received or held by requests in progress, and their limit
    (`--max-pending-body-mb`): a request that would pass it gets 503 before its body is read.
    Touched on the event loop only."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0

    def reserve(self, size: int) -> ApiError | None:
        if self.used + size > self.limit:
            return ApiError(503, f"server busy: {self.used // 2**20} MB of request bodies are being received "
                                 f"(limit {self.limit // 2**20} MB, --max-pending-body-mb); retry shortly",
                            code="server_overloaded", headers={"Retry-After": "1"})
        self.used += size
        return None

    def release(self, size: int) -> None:
        self.used -= size


async def discard_body(receive: Receive) -> bool:
    """Read (and drop) a refused request's body, so the client can read the error instead of a
    reset; False when it was left unread. NOTE: bounded: past DISCARD_BYTES, the body's deadline or
    DISCARD_IDLE_S without bytes, the connection is simply closed after the reply."""
    seen, more = 0, True
    try:
        while more and seen <= DISCARD_BYTES:
            async with asyncio.timeout(DISCARD_IDLE_S):
                message = await receive()
            if message["type"] != "http.request":
                return False
            seen += len(message.get("body", b""))
            more = message.get("more_body", False)
    except (ApiError, asyncio.TimeoutError):  # the body's deadline passed, or the client stalls
        return False
    return not more


class Refusals(Protocol):
    def refusal(self, path: str) -> ApiError | None:
        """Why no new work is taken now (loading, draining: `lifecycle.Lifecycle`), or None."""


class RequestGuard:
    """Everything a request is checked against before any of its body is read (`admit`), and its
    body's size limit while it is read (`limited`). `lifecycle`: the server's refusals while it
    takes no work; `capacity`: (method, path) -> a 503 when the work that route needs is full."""

    def __init__(self, *, api_key: str | None, max_body_bytes: int, hosts: HostPolicy, bodies: BodyBudget,
                 lifecycle: Refusals | None = None, capacity: Callable[[str, str], ApiError | None] | None = None):
        self.api_key, self.limit, self.hosts, self.bodies = api_key, max_body_bytes, hosts, bodies
        self.lifecycle, self.capacity = lifecycle, capacity

    def admit(self, scope: Scope) -> tuple[ApiError | None, int]:
        """The first reason to refuse the request, else None and the bytes it reserved in the
        pending-body budget (give them back with `bodies.release` once the body is not held)."""
        error = self.refuse(scope)
        if error is not None:
            return error, 0
        reserved = self.body_size(scope)
        error = self.bodies.reserve(reserved)
        return (error, 0) if error is not None else (None, reserved)

    def refuse(self, scope: Scope) -> ApiError | None:
        """The first reason to refuse this request before reading its body, in the order a client
        fixes them: Host, draining, API key, Origin, Content-Type, size, capacity."""
        headers, path, method = dict(scope["headers"]), scope["path"], scope["method"]
        for check in (lambda: self.hosts.check(headers),
                      lambda: self.lifecycle.refusal(path) if self.lifecycle is not None else None,
                      lambda: self._auth(headers, path),
                      lambda: self._origin(headers, path, method),
                      lambda: check_json(headers) if method == "POST" and path in JSON_ROUTES else None,
                      lambda: self._size(headers),
                      lambda: self.capacity(method, path) if self.capacity is not None else None):
            error = check()
            if error is not None:
                return error
        return None

    def body_size(self, scope: Scope) -> int:
        """The bytes to reserve for this request's body: its Content-Length, else the limit."""
        if scope["method"] in ("GET", "HEAD", "DELETE", "OPTIONS"):
            return 0
        length = dict(scope["headers"]).get(b"content-length")
        return int(length) if length is not None and length.isdigit() else self.limit

    def limited(self, receive: Receive, discard: bool = True) -> Receive:
        """`receive`, raising 413 once the body passes the limit (a chunked body has no
        Content-Length to refuse it by); with `discard`, the rest of it is read and dropped first."""
        seen = 0

        async def wrapped() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    if discard and message.get("more_body", False):
                        await discard_body(receive)
                    raise self.too_large(None)
            return message

        return wrapped

    def too_large(self, size: int | None) -> ApiError:
        got = f"request body is {size} bytes" if size is not None else "request body is too large"
        return ApiError(413, f"{got}; this server accepts at most {self.limit} bytes (omnivox serve --max-body-mb); "
                             "send shorter media", code="request_too_large")

    def _auth(self, headers: dict, path: str) -> ApiError | None:
        if self.api_key is None or not path.startswith("/v1"):
            return None
        auth = headers.get(b"authorization", b"").decode("latin-1")
        given = auth[7:] if auth[:7].lower() == "bearer " else ""
        if hmac.compare_digest(given.encode(), self.api_key.encode()):
            return None
        what = "no API key was given" if not auth else "the API key is not valid"
        return ApiError(401, f"{what}: send the server's API key as `Authorization: Bearer <key>`",
                        code="invalid_api_key")

    def _origin(self, headers: dict, path: str, method: str) -> ApiError | None:
        """Without a key, a state-changing request from a web page must be same-origin."""
        if self.api_key is not None or not path.startswith("/v1") or method in ("GET", "HEAD", "OPTIONS"):
            return None
        return check_origin(headers, self.hosts)

    def _size(self, headers: dict) -> ApiError | None:
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return self.too_large(int(length))
        return None
