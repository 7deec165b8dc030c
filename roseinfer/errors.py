"""Exceptions that name what was wrong, for callers and the CLI to show as they are."""


class RoseInferError(Exception):
    """Base class of roseinfer's own errors."""


class ModelLoadError(RoseInferError, ValueError):
    """The model path, file format, architecture or tensor type cannot be used."""


class InvalidRequestError(RoseInferError, ValueError):
    """A request or sampling parameter is invalid; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """The prompt, or the prompt plus the tokens asked for, does not fit in the model's context."""


class EngineDeadError(RoseInferError):
    """The engine core stopped (crashed or shut down); requests in flight cannot finish."""


class EngineOverloadedError(RoseInferError):
    """More requests are waiting than the admission limit allows (or the server is shutting
    down); retry after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestTimeoutError(RoseInferError):
    """A request ran longer than the server's per-request time limit and was aborted."""


class ExecutorFailedError(EngineDeadError):
    """A model worker died or raised: the engine cannot run another step."""
