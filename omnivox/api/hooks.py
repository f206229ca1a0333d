"""The server-side text hook plug-in (`omnivox serve --text-hook module:function`).

A plug-in is a *factory*: `function(request: dict) -> hook | None`, called once per audio
request with the request's JSON body. The hook it returns decides what the Talker voices:
`hook(delta: str, final: bool) -> str | None` gets each new piece of the Thinker's text (and,
once, final=True) and returns the text to voice now ("" or None withholds it). The reply's
`content` is always the Thinker's own text; only the speech (and its `transcript`) follows the
hook. Returning None from the factory leaves that request un-hooked.

NOTE: the hook runs in the engine thread, between model steps: it must be quick and must not
block. An exception in a hook is printed once and that request's text is then voiced as is, so
one faulty plug-in call never fails the other requests in the batch.
"""
from __future__ import annotations

import importlib
import sys
import traceback
from typing import Any, Callable

from omnivox.errors import OmnivoxError

TextHook = Callable[[str, bool], "str | None"]
HookFactory = Callable[[dict[str, Any]], "TextHook | None"]


def load_hook_factory(spec: str) -> HookFactory:
    """Import `module:function` (the module must be importable, e.g. on PYTHONPATH)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise OmnivoxError(f"--text-hook must look like module:function, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise OmnivoxError(f"cannot import text hook module {module_name!r}: {e}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise OmnivoxError(f"text hook {spec!r}: {module_name} has no callable {attr!r}")
    return factory


class GuardedHook:
    """Calls the plug-in's hook; after its first exception, voices the text unchanged."""

    def __init__(self, hook: TextHook, name: str = "text hook"):
        self.hook, self.name, self.broken = hook, name, False

    def __call__(self, delta: str, final: bool) -> str | None:
        if self.broken:
            return delta
        try:
            out = self.hook(delta, final)
        except Exception:
            self.broken = True
            print(f"omnivox: {self.name} raised; voicing this request's text unchanged", file=sys.stderr)
            traceback.print_exc()
            return delta
        if out is not None and not isinstance(out, str):
            self.broken = True
            print(f"omnivox: {self.name} returned {type(out).__name__}, not str; voicing the text unchanged",
                  file=sys.stderr)
            return delta
        return out


def sentences(request: dict[str, Any]) -> TextHook:
    """An example plug-in (`--text-hook omnivox.api.hooks:sentences`): voice whole sentences only."""
    pending: list[str] = []

    def hook(delta: str, final: bool) -> str:
        pending.append(delta)
        text = "".join(pending)
        cut = max(text.rfind(c) for c in ".!?\n") + 1
        if final:
            cut = len(text)
        pending[:] = [text[cut:]]
        return text[:cut]

    return hook
