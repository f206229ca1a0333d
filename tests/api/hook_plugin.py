"""A text hook plug-in for the API tests (`--text-hook hook_plugin:make_hook`).

Requests whose `metadata` holds {"voice_text": T} get a hook that withholds the Thinker's text
and voices exactly T at the end; {"hook": "raise"} gets a hook that always raises; for
{"hook": "factory-raise"} the factory itself raises; every other request is left un-hooked (None)."""


def make_hook(request: dict):
    meta = request.get("metadata") or {}
    if meta.get("hook") == "factory-raise":
        raise RuntimeError("plug-in secret: /srv/omnivox/hook.key")
    if meta.get("hook") == "raise":
        def broken(delta, final):
            raise RuntimeError("this plug-in is broken")
        return broken
    text = meta.get("voice_text")
    if text is None:
        return None
    return lambda delta, final: text if final else ""
