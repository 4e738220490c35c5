"""The OpenAI wire protocol's error: an HTTP status with OpenAI's error object as its body
(`{"error": {"message", "type", "param", "code"}}`), raised by request parsing (openai_wire.py,
chat_wire.py) and the routes (app.py)."""

from __future__ import annotations


class ApiError(Exception):
    """An HTTP error with OpenAI's error object as its body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def show(v) -> str:
    """A client's value as an error message quotes it: short, containers by their type."""
    s = repr(v) if not isinstance(v, (dict, list)) else type(v).__name__
    return s if len(s) <= 40 else s[:37] + "..."
