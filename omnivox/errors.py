"""User-facing errors: each carries a one-line message that says what to fix, and the HTTP-like
status a request failed with it gets (`status_of`). A stage fails a request by raising or
returning one of these; the engine turns it into that request's `Failed` event, nobody else's."""


class OmnivoxError(Exception):
    """Base class: the CLI prints `error: <message>` and exits non-zero; the server maps to 4xx/5xx."""

    status = 500

    def __init__(self, message: str = "", *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code  # the request field to fix and a machine-readable code


class CheckpointError(OmnivoxError):
    """A checkpoint folder is missing, incomplete or inconsistent."""


class InputError(OmnivoxError):
    """A request's input is invalid (unreadable media, unknown speaker, prompt too long, ...)."""

    status = 400


class ContextTooLong(InputError):
    """The prompt does not fit the model's context."""


class CannotFit(OmnivoxError):
    """The request can never fit a stage's KV cache, even alone."""

    status = 413


class Overloaded(OmnivoxError):
    """More requests than max_running + max_queue: try again later."""

    status = 503


class Draining(Overloaded):
    """The server is draining (SIGTERM or SIGINT): it takes no new work, and what still runs at
    the drain's timeout is cut; the client retries elsewhere."""

    def __init__(self, message: str):
        super().__init__(message, code="draining")


class KVStarved(Overloaded):
    """No KV pages for a request, and none will free: the pages are held by streamed prompts
    waiting for their users (open realtime turns) and nothing else runs."""

    def __init__(self, held: int):
        super().__init__(f"no KV cache pages free for this request: the {held} in use are held by open realtime "
                         "turns waiting for their users (see --realtime-turn-kv-share)", code="kv_cache_full")


class EngineFailed(OmnivoxError):
    """The engine cannot compute any more (a tensor-parallel rank died): every request fails with
    it, the engine stops, and /health answers 503."""

    status = 503

    def __init__(self, message: str):
        super().__init__(message, code="engine_failed")


def status_of(error: BaseException) -> int:
    """The status a request failing with `error` gets: its own, or 500 for anything unexpected."""
    return error.status if isinstance(error, OmnivoxError) else 500


def message_of(error: BaseException) -> str:
    """What the client is told. NOTE: an unexpected exception's text stays in the server log."""
    if isinstance(error, OmnivoxError):
        return str(error)
    return f"internal error ({type(error).__name__}); see the server log"


def code_of(error: BaseException) -> str | None:
    """The machine-readable code a request failing with `error` gets (None: the status says it)."""
    return error.code if isinstance(error, OmnivoxError) else None
