"""The chat page: `GET /` serves static/index.html and `/static/` its scripts and styles.

The page is plain files shipped inside the package (no build step); it talks only to this
server's own /v1 routes. It is served without the API key: the key is typed into the page and
sent by it on each /v1 request.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

from roseinfer.server.api_family import ApiContext

STATIC_DIR = Path(__file__).with_name("static")

# The page loads nothing from another origin, and markup that got past the Markdown sanitiser
# could still neither run a script nor fetch anything (an <img> pointing elsewhere, say). Images
# may be data: URLs: the thumbnails of the images a person attaches (they fetch nothing).
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
# Browsers revalidate (a cheap 304) instead of running a stale page after an upgrade.
NO_CACHE = {"Cache-Control": "no-cache"}


class _RevalidatedStaticFiles(StaticFiles):
    def file_response(self, full_path, stat_result, scope: Scope, status_code: int = 200):
        response = super().file_response(full_path, stat_result, scope, status_code)
        response.headers.update(NO_CACHE)
        return response


def register(app: FastAPI, context: ApiContext) -> None:
    """The chat page, unless the server runs without it (--disable-web-ui)."""
    if context.enable_web_ui:
        add_web_ui(app)


def add_web_ui(app: FastAPI) -> None:
    """Serve the chat page at / and its files under /static/."""

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html",
                            headers=NO_CACHE | {"Content-Security-Policy": CONTENT_SECURITY_POLICY})

    app.mount("/static", _RevalidatedStaticFiles(directory=STATIC_DIR), name="static")
