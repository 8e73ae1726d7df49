"""Errors in OpenAI's format, and the coordinator's errors translated into them.

OpenAI clients read ``{"error": {"message", "type", "param", "code"}}`` and
raise by status (the ``openai`` package: 400 BadRequestError, 401
AuthenticationError, 404 NotFoundError, 429 RateLimitError, 500
InternalServerError), so every refusal here names the field the client
sent, not the coordinator input it became."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from coordinator.request.admission import is_refusal
from coordinator.request.api import INPUT_NAMES

# Coordinator inputs whose OpenAI field has another name (the rest keep theirs).
OPENAI_FIELDS = {"random_seed": "seed", "stop_words": "stop", "text_input": "prompt"}

# Seconds a refused client is asked to wait (Retry-After): a request in flight
# typically frees its slot within seconds.
RETRY_AFTER_SECONDS = 1

_LEADING_NAME = re.compile(r"(?:\[request id: [^\]]*\]\s*)?([A-Za-z_]+)\b")


class OpenAIError(Exception):
    """A request the server answers with an OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.type = type
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def server_error(message: str) -> OpenAIError:
    return OpenAIError(message, status=500, type="server_error")


def unauthorized(message: str) -> OpenAIError:
    """A request without the API key or with a wrong one (OpenAI answers 401 ``invalid_api_key``)."""
    return OpenAIError(message, status=401, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def server_busy(message: str) -> OpenAIError:
    """The coordinator refused the request at max_inflight_requests: a 429,
    which the ``openai`` package retries after ``Retry-After`` (RateLimitError
    once its retries are spent)."""
    return OpenAIError(message, status=429, type="server_busy", code="max_inflight_requests",
                       headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def model_not_found(model: str, served: str) -> OpenAIError:
    return OpenAIError(f"The model {model!r} does not exist; this server serves {served!r}", param="model",
                       status=404, code="model_not_found")


def from_coordinator(message: str, fields: Mapping[str, str] | None = None) -> OpenAIError:
    """The coordinator's error response as an OpenAI error.

    Its validation errors start with the input's name ("max_tokens must be
    between 1 and 1024, got 0"): a 400 whose ``param`` is the OpenAI field that
    input came from (``fields``: input -> field for this request, else
    ``OPENAI_FIELDS``). Anything else (an engine failure, an internal error)
    is the server's fault: a 500. The coordinator's refusal at
    max_inflight_requests is a 429."""
    if is_refusal(message):
        return server_busy(message)
    match = _LEADING_NAME.match(message)
    name = match.group(1) if match else ""
    if name not in INPUT_NAMES:
        return server_error(message)
    param = (fields or {}).get(name) or OPENAI_FIELDS.get(name, name)
    return OpenAIError(message if param == name else f"{param}: {message}", param=param)


def from_validation(errors: Iterable[Mapping]) -> OpenAIError:
    """FastAPI's request validation errors (a body that is not a JSON object)
    as one 400, instead of FastAPI's default 422."""
    for error in errors:
        location = [part for part in error.get("loc", ()) if part != "body"]
        field = location[0] if location and isinstance(location[0], str) else None
        detail = error.get("msg", "invalid")
        if error.get("type") == "json_invalid":
            reason = (error.get("ctx") or {}).get("error")
            return OpenAIError(f"the request body is not valid JSON ({reason or detail})")
        if field is None:
            return OpenAIError(f"the request body must be a JSON object: {detail}")
        return OpenAIError(f"{field}: {detail}", param=field)
    return OpenAIError("the request body is invalid")
