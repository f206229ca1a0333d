"""Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}`.

Every failure the HTTP layer knows about becomes an `ApiError`; handlers registered in the app
turn it (and FastAPI's own errors) into a JSON response, so no request ever sees a traceback.
"""
from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
         500: "server_error", 503: "server_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def draining_error(message: str) -> ApiError:
    """The 503 of a draining server (`api/lifecycle.py`): retry at once, on a new connection (a
    load balancer sends it to another server)."""
    return ApiError(503, message, code="draining", headers={"Retry-After": "1", "Connection": "close"})


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def _param(loc: tuple) -> str:
    """('messages', 0, 'content', 1, 'input_audio', 'data') -> 'messages[0].content[1].input_audio.data'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _clean(loc: tuple) -> tuple:
    """Drop union-branch names ('str', 'list[...]') and discriminator tags (a tag repeats its field name)."""
    out: list = []
    for p in loc:
        if isinstance(p, str) and ("[" in p or p in ("str", "int", "float", "bool")):
            continue
        if out and isinstance(p, str) and out[-1] == p:
            continue
        out.append(p)
    return tuple(out)


def from_validation(err: ValidationError) -> ApiError:
    """A 400 naming the first invalid field, what it holds and what it must be."""
    errors = err.errors(include_url=False)
    if errors and errors[0]["type"] == "json_invalid":
        return ApiError(400, f"request body is not valid JSON: {errors[0]['ctx'].get('error', errors[0]['msg'])}",
                        code="invalid_json")
    for e in errors:
        e["loc"] = _clean(e["loc"])
    deepest = max(errors, key=lambda e: len(e["loc"]))["loc"]
    same = [e for e in errors if e["loc"] == deepest]  # several union branches failing at one place
    msgs = list(dict.fromkeys(e["msg"] for e in same))
    msg = msgs[0] + "".join(f" or {m[0].lower()}{m[1:]}" for m in msgs[1:])
    param = _param(deepest) or None
    first = same[0]
    got = first.get("input")
    shown = "" if first["type"] == "missing" or isinstance(got, (dict, list)) else f" (got {got!r:.60})"
    where = f"{param}: " if param else "request body: "
    return ApiError(400, f"{where}{msg}{shown}", param=param, code="invalid_value")
