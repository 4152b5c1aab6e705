"""The project's own errors.

Every ``open_*`` boundary unwraps exception groups into one of these, and
:mod:`gezel_trio.api.errors` maps them to HTTP status codes in one place.
Each carries an OpenAI-style ``code`` and the HTTP status it becomes.
"""

from __future__ import annotations


class GezelError(Exception):
    """Base class. ``status`` is the HTTP status the API answers with."""

    status: int = 500
    code: str = "internal_error"
    type: str = "server_error"

    def __init__(self, message: str, *, detail: object | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail


class ConfigError(GezelError):
    """The configuration is invalid; the message names the key and what is expected."""

    status = 400
    code = "invalid_config"
    type = "invalid_request_error"


class BadRequest(GezelError):
    """The request body or its fields are wrong; the message names the field."""

    status = 400
    code = "invalid_request"
    type = "invalid_request_error"


class FieldError(BadRequest):
    """One field of the request is wrong; ``param`` names it (OpenAI's error ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class UnknownModel(GezelError):
    status = 404
    code = "model_not_found"
    type = "invalid_request_error"


class WrongModelKind(FieldError):
    """The request names a model of another kind than its route serves (an image model
    on a text route, a text model on an image route); ``param`` is ``model``."""

    code = "model_kind_mismatch"

    def __init__(self, message: str) -> None:
        super().__init__("model", message)


class ModelLocked(GezelError):
    """``lock_model`` is on and the request names another model."""

    status = 409
    code = "model_locked"
    type = "invalid_request_error"


class SessionNotFound(GezelError):
    """No session with that id is held for the caller (in a slot or parked)."""

    status = 404
    code = "session_not_found"
    type = "invalid_request_error"


class SessionBusy(GezelError):
    """The session is running a request, so its slot cannot be erased now."""

    status = 409
    code = "session_busy"
    type = "invalid_request_error"


class QueueFull(GezelError):
    """The scheduler's bounded queue is full. The API adds ``Retry-After``."""

    status = 503
    code = "queue_full"

    def __init__(self, message: str, *, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class SchedulerClosed(GezelError):
    """The scheduler shut down before the job could run (or finish)."""

    status = 503
    code = "scheduler_closed"


class NoCapacity(GezelError):
    """The device ledger cannot admit an engine; the message says who holds what."""

    status = 503
    code = "no_capacity"


class EngineNotFound(GezelError):
    """No llama-server binary could be resolved; the message lists every place tried."""

    status = 503
    code = "engine_not_found"


class EngineFailed(GezelError):
    """An engine failed to start; the message summarizes its last log lines."""

    status = 503
    code = "engine_failed"


class EngineStopped(EngineFailed):
    """An engine was stopped on purpose (an eviction, an unload) while it was starting."""

    code = "engine_stopped"


class EngineCrashed(GezelError):
    """An engine exited (or stopped answering) while a request was in flight."""

    status = 502
    code = "engine_crashed"


class EngineAbandoned(EngineCrashed):
    """An external engine failed its health checks while a request was in flight: the
    host stopped waiting for it (it cannot kill an engine it does not run)."""


class EngineTimeout(GezelError):
    """The engine did not answer within the configured time."""

    status = 504
    code = "engine_timeout"
