"""The error tree. Each error knows its HTTP status, OpenAI error type and code.

Only ``omlx.api`` turns these into HTTP responses; everything else raises them.
"""

from __future__ import annotations


class OmlxError(Exception):
    http_status = 500
    error_type = "server_error"
    code = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def headers(self) -> dict[str, str]:
        return {}

    def extra_fields(self) -> dict[str, object]:
        """Fields added to the error object next to message/type/param/code."""
        return {}


class InvalidRequestError(OmlxError):
    http_status = 400
    error_type = "invalid_request_error"
    code = "invalid_request"


class RequestTooLargeError(InvalidRequestError):
    """A request body over ``server.max_body_bytes``; refused before it is parsed."""

    http_status = 413
    code = "request_too_large"


class UnsupportedMediaTypeError(InvalidRequestError):
    """A state-changing request that is not JSON (what a web page's form would send)."""

    http_status = 415
    code = "unsupported_media_type"


class ForbiddenError(OmlxError):
    """Refused whoever asks: a foreign Host or a cross-site request."""

    http_status = 403
    error_type = "permission_error"
    code = "forbidden"


class ContextLengthExceededError(InvalidRequestError):
    code = "context_length_exceeded"


class WrongModelKindError(InvalidRequestError):
    """An embedding model asked to chat, or an LLM asked for embeddings."""

    code = "wrong_model_kind"

    def __init__(self, model: str, kind: str, wanted: str, hint: str = ""):
        uses = {"llm": "chat and completions", "embedding": "/v1/embeddings and /v1/rerank"}
        use = f"; use it with {uses[kind]}" if kind in uses else ""
        needs = "a chat model (llm or vlm)" if wanted == "chat" else f"an {wanted} model"
        super().__init__(
            f"model '{model}' is an {kind} model and this endpoint needs {needs}{use}{hint}",
            param="model",
        )


class PrefillMemoryExceededError(InvalidRequestError):
    """A prompt whose prefill can never fit under the memory ceiling."""

    code = "prefill_memory_exceeded"

    def __init__(
        self, message: str, *, estimated_bytes: int, limit_bytes: int, param: str = "messages"
    ):
        super().__init__(message, param=param)
        self.estimated_bytes = estimated_bytes
        self.limit_bytes = limit_bytes

    def extra_fields(self) -> dict[str, object]:
        return {"estimated_bytes": self.estimated_bytes, "limit_bytes": self.limit_bytes}


class AuthenticationError(OmlxError):
    http_status = 401
    error_type = "authentication_error"
    code = "invalid_api_key"

    def headers(self) -> dict[str, str]:
        # Bearer (not Basic): browsers show no login box of their own.
        return {"WWW-Authenticate": 'Bearer realm="omlx"'}


class ModelNotFoundError(OmlxError):
    http_status = 404
    error_type = "not_found_error"
    code = "model_not_found"

    def __init__(self, model: str, available: list[str]):
        names = ", ".join(available) if available else "none (put a model folder in a model dir)"
        super().__init__(
            f"The model '{model}' does not exist. Available models: {names}", param="model"
        )
        self.available = available


class NotFoundError(OmlxError):
    http_status = 404
    error_type = "not_found_error"
    code = "not_found"


class UnsupportedEndpointError(OmlxError):
    """An endpoint of a foreign API that omlx does not provide; the message says
    what to use instead."""

    http_status = 501
    error_type = "invalid_request_error"
    code = "not_implemented"


class QueueFullError(OmlxError):
    http_status = 503
    error_type = "overloaded_error"
    code = "queue_full"

    def __init__(self, message: str, *, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class RateLimitedError(OmlxError):
    """Too many attempts from one client (e.g. failed logins); retry after the header."""

    http_status = 429
    error_type = "rate_limit_error"
    code = "rate_limited"

    def __init__(self, message: str, *, retry_after_s: int = 60):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class ProtectedSettingError(ForbiddenError):
    """A security setting the request may not change over HTTP; the message says how."""

    code = "protected_setting"


class ServiceUnavailableError(OmlxError):
    http_status = 503
    error_type = "overloaded_error"
    code = "service_unavailable"

    def __init__(self, message: str, *, retry_after_s: int | None = None):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}


class InsufficientMemoryError(OmlxError):
    """Loading a model cannot fit under the memory ceiling, even after evictions."""

    http_status = 507
    error_type = "insufficient_memory"
    code = "model_exceeds_memory"

    def __init__(self, message: str, *, needed_bytes: int, limit_bytes: int, used_bytes: int):
        super().__init__(message, param="model")
        self.needed_bytes = needed_bytes
        self.limit_bytes = limit_bytes
        self.used_bytes = used_bytes

    def extra_fields(self) -> dict[str, object]:
        return {
            "needed_bytes": self.needed_bytes,
            "limit_bytes": self.limit_bytes,
            "used_bytes": self.used_bytes,
        }


class MemoryPressureError(OmlxError):
    """Work ended or refused because memory is at the limit (forward gate, enforcer,
    released memory). Retrying later may succeed."""

    http_status = 503
    error_type = "overloaded_error"
    code = "memory_pressure"

    def __init__(self, message: str, *, retry_after_s: int = 2):
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class ModelLoadError(OmlxError):
    """A model folder exists but cannot be loaded (bad files, unsupported type)."""

    http_status = 500
    error_type = "server_error"
    code = "model_load_failed"


class RemoteCodeNotAllowedError(ModelLoadError):
    """A model folder ships Python code its loaders would import (an ``auto_map``
    module, mlx-lm's ``model_file``) and its settings do not allow it
    (omlx/models/remote_code.py). Not a 500: the server refuses by design until the
    user sets ``trust_remote_code``."""

    http_status = 403
    error_type = "permission_error"
    code = "remote_code_not_allowed"


class ArchitectureCrashError(ModelLoadError):
    """The model's architecture killed the probe process running its first forward
    (engine/arch_probe.py): the server will not load it, and keeps serving the others.
    Not a 500: nothing failed in the server, this machine's MLX cannot run the model."""

    http_status = 501
    error_type = "invalid_request_error"
    code = "model_architecture_crashed"


class ModuleMissingError(ModelLoadError):
    """A served family's model imports a Python module omlx leaves optional (mlx-vlm's
    multi_modality imports OpenCV's cv2: models/vlm_refusals.py OPTIONAL_MODULES), and
    it does not import here. Not a 500: nothing failed; the message names the package
    to install."""

    http_status = 501
    error_type = "invalid_request_error"
    code = "model_needs_module"


class ImageEmbeddingMismatchError(OmlxError):
    """A vision model embedded a prompt into more (or fewer) rows than the prompt has
    tokens: omlx prefills one row per token, so it refuses the request rather than
    answer from cut-off embeddings. Not the request's fault and nothing crashed: this
    model's image path is one omlx cannot run (the other requests go on)."""

    http_status = 501
    error_type = "invalid_request_error"
    code = "image_embedding_mismatch"


class ImportFailedError(OmlxError):
    """A GGUF (or other) import cannot be done; the message says why."""

    http_status = 400
    error_type = "invalid_request_error"
    code = "import_failed"


class EngineError(OmlxError):
    http_status = 500
    error_type = "server_error"
    code = "engine_error"


class SettingsError(OmlxError):
    """Invalid settings (file, env or flag); the message names the field."""

    http_status = 400
    error_type = "invalid_request_error"
    code = "invalid_settings"


class OutputExistsError(OmlxError):
    """The output folder (or a queued task's output) already has that name."""

    http_status = 409
    error_type = "invalid_request_error"
    code = "output_exists"


class TaskConflictError(OmlxError):
    """The task is in a state that does not allow the operation (e.g. delete while running)."""

    http_status = 409
    error_type = "invalid_request_error"
    code = "task_conflict"


class BadGatewayError(OmlxError):
    """An upstream server (a router's backend) failed or could not be reached."""

    http_status = 502
    error_type = "server_error"
    code = "bad_gateway"
