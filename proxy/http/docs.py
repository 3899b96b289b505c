"""The trainer API's docs page (Swagger UI at /api/docs) served whole from the package: its scripts and styles come
from the `fastapi-offline` package (Swagger UI 5, which reads the OpenAPI 3.1 FastAPI writes; 4.x cannot), not a
CDN, so the page works offline and in air-gapped clusters."""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.staticfiles import StaticFiles
from starlette.responses import HTMLResponse

ASSETS = "/docs-assets"  # outside /api: static files, no data, no token needed


def add_docs(app: FastAPI, openapi_url: str, path: str = "/api/docs") -> None:
    assets = files("fastapi_offline") / "static"  # only its files: its FastAPI wrapper is not used
    app.mount(ASSETS, StaticFiles(directory=str(assets)), name="docs-assets")

    @app.get(path, include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title="trajproxy: the trainer API",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon.png",
        )
