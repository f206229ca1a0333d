"""User-facing errors: each carries a one-line message that says what to fix."""


class OmnivoxError(Exception):
    """Base class: the CLI prints `error: <message>` and exits non-zero; the server maps to 4xx."""


class CheckpointError(OmnivoxError):
    """A checkpoint folder is missing, incomplete or inconsistent."""


class InputError(OmnivoxError):
    """A request's input is invalid (unreadable media, unknown speaker, prompt too long, ...)."""


class ContextTooLong(InputError):
    """The prompt does not fit the model's context."""
