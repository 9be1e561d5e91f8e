"""Errors as the two APIs shape them: a 4xx for what the client can fix, a 500 for the server's own."""

from __future__ import annotations

from fastapi.responses import JSONResponse

ANTHROPIC = "/v1/messages"
INTERNAL = "internal server error (logged on the server)"


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


_OPENAI_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "api_error",
}


def error_body(path: str, status: int, message: str, param=None, code=None) -> dict:
    if path.startswith(ANTHROPIC):
        return {
            "type": "error",
            "error": {"type": _ANTHROPIC_TYPES.get(status, "invalid_request_error"), "message": message},
        }
    kind = "server_error" if status >= 500 else _OPENAI_TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(path: str, status: int, message: str, **kw) -> JSONResponse:
    return JSONResponse(error_body(path, status, message, **kw), status_code=status)
