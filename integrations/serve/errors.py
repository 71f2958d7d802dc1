"""Errors the server answers with, in OpenAI's shape.

Every error response of the server is ``{"error": {"message", "type", "param", "code"}}`` with the
HTTP status of the ``APIError`` that produced it, never FastAPI's default 422 body. Handlers raise an
``APIError`` (or call one of the constructors below); the app turns it into a JSON response.
"""

from __future__ import annotations


class APIError(Exception):
    """An error answered to the client: HTTP ``status`` plus OpenAI's error fields.

    ``headers`` are extra response headers (``WWW-Authenticate`` on 401, ``Retry-After`` on 429).
    """

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, code={self.code!r})"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """400: the request cannot be served as sent (malformed, out of range, too long)."""
    return APIError(400, message, param=param, code=code)


def unauthorized() -> APIError:
    """401: the bearer key is missing or not one of the server's keys (the key is never echoed)."""
    return APIError(401, "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'.",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def model_not_found(model: str) -> APIError:
    """404: the request names a model this server does not serve."""
    return APIError(404, f"The model '{model}' does not exist on this server.", param="model",
                    code="model_not_found")


def route_not_found(path: str) -> APIError:
    """404 for a path the server does not have."""
    return APIError(404, f"No route {path!r}.", code="not_found")


def method_not_allowed(method: str, path: str) -> APIError:
    """405 for a known path called with the wrong method."""
    return APIError(405, f"Method {method} is not allowed on {path!r}.", code="method_not_allowed")


def queue_full(limit: int) -> APIError:
    """429: every running and queued slot is taken; the client should retry later."""
    return APIError(429, f"The server is at its limit of {limit} requests in flight; retry later.",
                    type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})


def unavailable(message: str, code: str = "unavailable") -> APIError:
    """503: the server cannot generate right now (no engine attached, engine stopped or overloaded,
    the server shutting down: ``code`` "server_shutting_down")."""
    return APIError(503, message, type="server_error", code=code, headers={"Retry-After": "1"})


def too_large(message: str, param: str | None = None) -> APIError:
    """413: the request is over one of the server's input bounds (its body's bytes, its messages,
    tools or stop strings); the message names the bound and the option that sets it."""
    return APIError(413, message, param=param, code="request_too_large")


def internal(message: str) -> APIError:
    """500: a failure inside the server; the message names it without a traceback."""
    return APIError(500, message, type="server_error", code="internal_error")
