"""The OpenAI error envelope and the exceptions that map onto it.

Every error the server sends, before or after streaming starts, is
`{"error": {"message", "type", "param", "code"}}`. `code` is the integer HTTP status, as vLLM sends
it (OpenAI sends a string there; clients read `message` and the status). Bad input is always a 4xx:
handlers raise `APIError` with the status, and the app turns any other exception into a 500.
"""
from __future__ import annotations

from fastapi.responses import JSONResponse

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 405: "MethodNotAllowedError", 409: "ConflictError",
               413: "RequestTooLargeError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    """An error with its HTTP status; `headers` carries e.g. Retry-After on a 503."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers or {}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": param,
                      "code": status}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.param), status_code=err.status,
                        headers=err.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)
