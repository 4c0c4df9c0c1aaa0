"""OpenAI-style errors: every failure is ``{"error": {"message", "type", "param", "code"}}``.

FastAPI would answer a malformed body with a 422 listing its internals; the server parses
bodies itself and maps every client mistake to 400 (413 for an oversized body, 401 for a bad
key, 404 for an unknown route or model, 429 when full), so clients see OpenAI's shapes only.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def install_handlers(app) -> None:
    """Route every exception FastAPI/Starlette can raise to an OpenAI-style JSON error."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        server = getattr(request.app.state, "server", None)
        if server is not None:
            server.counters.request_errors += 1
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def _http_error(request, exc: HTTPException):
        message = {404: f"unknown route {request.method} {request.url.path}",
                   405: f"method {request.method} not allowed on {request.url.path}"}.get(exc.status_code,
                                                                                          str(exc.detail))
        return JSONResponse(error_body(exc.status_code, message), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        return JSONResponse(error_body(400, "invalid request"), status_code=400)

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(500, "internal server error"), status_code=500)
