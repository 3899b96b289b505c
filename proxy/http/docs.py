"""The OpenAPI document (`/api/openapi.json`), written from the route table, and the page that reads it (Swagger UI
at `/api/docs`), served whole from the package: its scripts and styles come from the `fastapi-offline` package
(Swagger UI 5, which reads the OpenAPI 3.1 FastAPI writes; 4.x cannot), not a CDN, so the page works offline and in
air-gapped clusters.

FastAPI writes the document from every route of the table that names a response model: from the signature of the
handler FastAPI serves, or, for a plain handler, from the query and body models the route names.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from functools import cached_property
from importlib.resources import files
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, FastAPI, Query
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy import __version__, schema
from proxy.http.edge import respond
from proxy.http.framework_errors import framework_errors, http_error
from proxy.http.routes import Route

ASSETS = "/docs-assets"  # outside /api: static files, no data, no token needed
OPENAPI = "/api/openapi.json"
_HTML = [(b"content-type", b"text/html; charset=utf-8")]


def framework_router(table: Sequence[Route], documented: bool) -> APIRouter:
    """The table's routes as FastAPI's, in the table's order: those FastAPI serves (`documented=False`), or every
    route the document describes."""
    failed = {"model": schema.ApiError, "description": "the database or a model answering for the trainer failed"}
    refused = {"model": schema.ApiError, "description": "refused; 422: the query or body does not fit this schema"}
    router = APIRouter(tags=["trainer"], responses={"4XX": refused, "5XX": failed})
    for route in table:
        if route.endpoint is None and not (documented and route.model is not None):
            continue
        router.add_api_route(
            route.path,
            route.endpoint or declared(route),
            methods=sorted(route.allowed),
            status_code=route.status,
            response_model=route.model,
            include_in_schema=route.model is not None,
        )
    return router


def declared(route: Route) -> Callable[..., Any]:
    """What the document reads of a plain handler: its name, its docstring, and a signature of its query and body
    models (never called)."""
    parameters = []
    if route.query is not None:
        annotation = Annotated[route.query, Query()]  # type: ignore[name-defined]
        parameters.append(inspect.Parameter("query", inspect.Parameter.KEYWORD_ONLY, annotation=annotation))
    if route.body is not None:
        parameters.append(inspect.Parameter("body", inspect.Parameter.KEYWORD_ONLY, annotation=route.body))

    def operation(**_: Any) -> None:
        raise NotImplementedError  # served by its plain handler

    operation.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    operation.__name__ = getattr(route.serve, "__name__", "operation")
    operation.__doc__ = inspect.getdoc(route.serve)
    return operation


def _read(route: Route) -> tuple[Any, ...]:
    """All the document reads of a route (`framework_router`, `declared`): its methods, path, status and models, and
    its handler's code (a FastAPI endpoint's, else the plain handler's), which gives the signature and docstring."""
    handler = route.endpoint if route.endpoint is not None else route.serve
    # a bound method: its function, the same for every app; a wrapper (`for_every_app`): the function it serves
    function = inspect.unwrap(getattr(handler, "__func__", handler))
    code = getattr(function, "__code__", None) or type(function)  # an ASGI app object: its class's __call__ and doc
    return route.methods, route.path, route.status, route.model, route.query, route.body, route.endpoint is None, code


_documents: dict[tuple[Any, ...], dict[str, Any]] = {}  # by what the document reads of the table (`_read`)
_frameworks: dict[tuple[Any, ...], FastAPI] = {}  # the same, for the app serving the table's FastAPI routes


def framework_app(table: Sequence[Route]) -> FastAPI:
    """The FastAPI app serving the table's routes that name a FastAPI `endpoint`, with the domain's errors answered as
    the plain handlers answer them: built once a process for a table (its endpoints serve every app's requests)."""
    served = [route for route in table if route.endpoint is not None]
    read = tuple(_read(route) for route in served)
    if read not in _frameworks:
        app = FastAPI(title="trajproxy", version=__version__, openapi_url=None, docs_url=None, redoc_url=None)
        framework_errors(app)
        app.include_router(framework_router(served, documented=False))
        _frameworks[read] = app
    return _frameworks[read]


class ApiDocs:
    """The document, its page, and the page's assets."""

    def __init__(self, table: Callable[[], Sequence[Route]]) -> None:
        self._table = table  # the table holds these routes too: read once it is whole
        assets = files("fastapi_offline") / "static"  # only its files: its FastAPI wrapper is not used
        routes = [Mount(ASSETS, StaticFiles(directory=str(assets)))]
        self.assets: ASGIApp = Starlette(routes=routes, exception_handlers={HTTPException: http_error})  # type: ignore[dict-item]

    @cached_property
    def document(self) -> dict[str, Any]:
        """The document (read it, never change it: the process's apps of the same table share it)."""
        table = [route for route in self._table() if route.endpoint is not None or route.documented]
        read = tuple(_read(route) for route in table)
        if read not in _documents:  # about 0.2 s of CPU: once a process, not once an app (the tests make hundreds)
            routes = framework_router(table, True).routes
            _documents[read] = get_openapi(title="trajproxy", version=__version__, routes=routes)
        return _documents[read]

    @cached_property
    def _document_bytes(self) -> bytes:
        return orjson.dumps(self.document)

    async def openapi(self, _scope: Scope, _receive: Receive, send: Send) -> None:
        await respond(send, 200, self._document_bytes)

    async def page(self, _scope: Scope, _receive: Receive, send: Send) -> None:
        html = get_swagger_ui_html(
            openapi_url=OPENAPI,
            title="trajproxy: the trainer API",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon.png",
        )
        await respond(send, 200, bytes(html.body), _HTML)
