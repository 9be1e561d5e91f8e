"""Errors as the two APIs shape them (a 4xx for what the client can fix, a 500 for the server's own), and
the JSON encoding every reply goes through."""

from __future__ import annotations

import json
import re

from fastapi.responses import JSONResponse

ANTHROPIC = "/v1/messages"
INTERNAL = "internal server error (logged on the server)"
CLIENT_GONE = 499  # (nginx's status for a request whose client closed the connection first)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def __reduce__(self):  # (as it is made: from a worker process, server/processes.py)
        return ApiError, (self.status, self.message, self.param, self.code)


_OPENAI_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "api_error",
}


def shown(text: str, most: int = 100) -> str:
    """A client's text as an error message quotes it: cut in the middle past `most` characters (a
    megabyte-long model name need not come back whole)."""
    return text if len(text) <= most else f"{text[: most // 2]}...{text[-most // 2 :]}"


def error_body(path: str, status: int, message: str, param=None, code=None) -> dict:
    if path.startswith(ANTHROPIC):
        return {
            "type": "error",
            "error": {"type": _ANTHROPIC_TYPES.get(status, "invalid_request_error"), "message": message},
        }
    kind = "server_error" if status >= 500 else _OPENAI_TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def dumps(data) -> str:
    """JSON text that UTF-8 can carry. A string holding a lone UTF-16 surrogate (a template's error that
    quotes the client's text, tool arguments the model wrote as JSON escapes) has it replaced by U+FFFD:
    UTF-8 cannot carry it, and clients' JSON parsers refuse it escaped (the Anthropic SDK's)."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _LONE.sub("\ufffd", text)
    return text


_LONE = re.compile("[\ud800-\udfff]")  # (a str holds a pair as one character: these are lone)


class Json(JSONResponse):
    """FastAPI's JSON reply, through `dumps` (its own fails on a lone surrogate: a 500)."""

    def render(self, content) -> bytes:
        return dumps(content).encode("utf-8")


def error_response(path: str, status: int, message: str, **kw) -> Json:
    headers = {"Retry-After": "1"} if status == 429 else None  # (busy: seconds, as clients read it)
    return Json(error_body(path, status, message, **kw), status_code=status, headers=headers)
