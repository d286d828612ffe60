"""``/docs`` (Swagger UI) and ``/redoc`` (ReDoc) served from this server, for machines without
internet access.

FastAPI's own pages fetch Swagger UI, ReDoc, a favicon and (ReDoc) Google Fonts from CDNs, so on a
closed network they render blank. The same pages are built here by FastAPI's
:func:`~fastapi.openapi.docs.get_swagger_ui_html` / :func:`~fastapi.openapi.docs.get_redoc_html`,
pointed at the copies of those scripts that the ``fastapi-offline`` package ships (Swagger UI 5,
which reads the OpenAPI 3.1 document FastAPI writes, and ReDoc 2), under ``/docs/static``. A
Content-Security-Policy keeps the pages to this server: ReDoc's sidebar would otherwise still
fetch its vendor's logo from a CDN (hidden when that fails, so nothing is lost by refusing it).
"""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS = Path(fastapi_offline.__file__).resolve().parent / "static"
ASSETS_PATH = "/docs/static"
# Swagger UI's validator badge would send the document to validator.swagger.io: off.
SWAGGER_PARAMETERS = {"validatorUrl": None}
# This server only; the inline start-up script and styles both UIs use; ReDoc's search in a blob worker.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self' 'unsafe-inline'; "
    "style-src 'self' 'unsafe-inline'; img-src 'self' data:; worker-src 'self' blob:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
}


def add_api_docs(app: FastAPI) -> None:
    """The two pages and their assets; the app is created with ``docs_url=None, redoc_url=None``."""
    app.mount(ASSETS_PATH, StaticFiles(directory=ASSETS), name="api-docs-static")

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        page = get_swagger_ui_html(
            openapi_url=request.scope.get("root_path", "") + app.openapi_url,
            title=f"{app.title} - API documentation",
            swagger_js_url=f"{ASSETS_PATH}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS_PATH}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS_PATH}/favicon.png",
            swagger_ui_parameters=SWAGGER_PARAMETERS,
        )
        page.headers.update(SECURITY_HEADERS)
        return page

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        page = get_redoc_html(
            openapi_url=request.scope.get("root_path", "") + app.openapi_url,
            title=f"{app.title} - API documentation",
            redoc_js_url=f"{ASSETS_PATH}/redoc.standalone.js",
            redoc_favicon_url=f"{ASSETS_PATH}/favicon.png",
            with_google_fonts=False,
        )
        page.headers.update(SECURITY_HEADERS)
        return page
