"""The errors of the handlers FastAPI serves (the trainer API's, the page's, the docs'), in the shape of the plain
handlers' (`proxy.http.edge`)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from proxy.core import errors
from proxy.http.edge import error_body, invalid, redact, status_of


def framework_errors(app: FastAPI) -> None:
    """Have `app` answer the domain's errors, its own validation's and its routing's as the plain handlers do."""
    app.add_exception_handler(errors.TrajproxyError, _domain_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _invalid)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, http_error)  # type: ignore[arg-type]


def error_response(status: int, kind: str, message: str) -> Response:
    return Response(error_body(kind, message), status, media_type="application/json")


async def _domain_error(_request: Request, error: errors.TrajproxyError) -> Response:
    return error_response(status_of(error), error.kind, error.message)


async def _invalid(_request: Request, error: RequestValidationError) -> Response:
    problems = error.errors()
    if any(problem.get("type") == "json_invalid" for problem in problems):
        return error_response(400, "invalid_request_error", "request body is not valid JSON")
    return error_response(422, "invalid_request_error", invalid(problems))


async def http_error(request: Request, error: HTTPException) -> Response:
    if error.status_code == 404:
        return error_response(404, "not_found_error", f"no route {request.method} {redact(request.url.path)}")
    if error.status_code == 405:
        message = f"{request.method} is not allowed on {redact(request.url.path)}"
        return error_response(405, "invalid_request_error", message)
    return error_response(error.status_code, "error", str(error.detail))
