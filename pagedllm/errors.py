"""Typed errors raised for bad user input.

Every error a user can cause is a subclass of ``ValueError`` (or ``LookupError``
for things that do not exist), so callers can catch them without importing
pagedllm, and the server can map them to HTTP status codes.
"""


class PagedLLMError(Exception):
    """Base class of all pagedllm errors."""


class InvalidParameterError(PagedLLMError, ValueError):
    """A user-supplied value is outside its allowed range.

    ``param`` names the offending parameter so the HTTP layer can report it.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class QueueFullError(InvalidParameterError):
    """The server has no room for this request now (its queue, or the images it decodes at once); retry later."""


class PromptTooLongError(InvalidParameterError):
    """The prompt (plus requested output) cannot fit in the model's context."""


class ModelNotFoundError(PagedLLMError, LookupError):
    """The model path or name does not resolve to local weights."""


class UnsupportedModelError(PagedLLMError, ValueError):
    """The model's architecture or weight format is not supported."""


class EngineDeadError(PagedLLMError, RuntimeError):
    """The engine loop died; no further requests can be served."""


class RequestFailedError(PagedLLMError, RuntimeError):
    """This request failed inside the engine (the server's 500); the engine serves the others on."""
