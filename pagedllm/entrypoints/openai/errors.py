"""The server's errors, all answered in the OpenAI error shape (``{"error": {message, type, param, code}}``)."""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException
from fastapi.responses import JSONResponse

from pagedllm.entrypoints.openai import protocol as P


class APIError(Exception):
    def __init__(
        self, status: int, message: str, type_: str, param: str | None = None, headers: dict[str, str] | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers


class BodyError(HTTPException):
    """A body that cannot be accepted as it is: unparsable, or over a request limit."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(status, message)
        self.param = param


def error_response(
    status: int, message: str, type_: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    body = P.ErrorResponse(error=P.ErrorInfo(message=message, type=type_, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def json_error_message(doc: Any, err: dict) -> str:
    """'malformed JSON body at line L, column C (character P): reason', positions as a user counts them."""
    pos = err.get("loc", (None, None))[-1]
    reason = (err.get("ctx") or {}).get("error", "invalid JSON")
    if not isinstance(pos, int) or not isinstance(doc, str):
        return f"malformed JSON body: {reason}"
    line = doc.count("\n", 0, pos) + 1
    column = pos - (doc.rfind("\n", 0, pos) + 1) + 1
    return f"malformed JSON body at line {line}, column {column} (character {pos + 1}): {reason}"
