"""The API docs page works offline: /api/docs loads Swagger UI from trajproxy itself, never from a CDN, and its
scripts and styles are there to load (no token needed: no data in them)."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import httpx
from fastapi.openapi.utils import get_openapi
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from proxy import __version__
from proxy.app import create_app
from proxy.http.docs import ApiDocs, framework_router
from proxy.settings import Settings
from tests.test_ui import browser, wait  # noqa: F401 (the browser fixture)


def test_the_docs_page_loads_everything_from_trajproxy(server: Any) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as http:
        page = http.get("/api/docs")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        sources = re.findall(r"""(?:src|href)=['"]([^'"]+)['"]""", page.text)
        assert sources and all(source.startswith("/") for source in sources), sources  # no http(s)://, no CDN
        assert "/api/openapi.json" in page.text
        for source in sources:
            asset = http.get(source)
            assert asset.status_code == 200, source
            assert asset.content, source
        script = http.get("/docs-assets/swagger-ui-bundle.js")
        assert "javascript" in script.headers["content-type"] and b"SwaggerUIBundle" in script.content
        assert http.get("/docs-assets/nothing-here.js").status_code == 404
        assert http.get("/api/openapi.json").json()["info"]["title"] == "trajproxy"


def test_the_docs_page_lists_the_operations_in_a_browser(server: Any, browser: WebDriver) -> None:  # noqa: F811
    """FastAPI writes OpenAPI 3.1; a Swagger UI before 5 refuses it ("does not specify a valid version field")."""
    browser.get(f"{server.url}/api/docs")
    listed = wait(browser, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".opblock-summary"))
    operations = {" ".join(op.text.split()[:2]) for op in listed}
    assert "POST /api/episodes" in operations and "GET /api/turns/next" in operations, operations
    assert "valid version field" not in browser.find_element(By.TAG_NAME, "body").text


def test_apps_of_the_same_table_share_one_document_and_another_table_gets_its_own(tmp_path: Any) -> None:
    """The document is built once a process for each table (0.2 s of CPU an app before): what it reads of a route
    (`proxy.http.docs._read`) tells tables apart, so a table with a route changed gets a document of its own."""
    first, second = (create_app(Settings(_env_file=None, database_url=f"sqlite:///{tmp_path}/{n}.db")) for n in "ab")
    document = ApiDocs(lambda: first.table).document
    assert ApiDocs(lambda: second.table).document is document
    assert document == get_openapi(
        title="trajproxy", version=__version__, routes=framework_router(first.table, True).routes
    )

    changed = [replace(route, status=202) if route.path == "/api/pause" else route for route in first.table]
    other = ApiDocs(lambda: changed).document
    assert other is not document and other["paths"]["/api/pause"]["post"]["responses"].keys() >= {"202"}
    assert "202" not in document["paths"]["/api/pause"]["post"]["responses"]
