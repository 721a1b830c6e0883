"""The chat page ``loom serve`` answers at ``GET /`` (``--disable-web-ui`` turns it off).

The page is three files in ``static/`` (index.html, style.css, app.js; no build step, no
CDN). At start-up the stylesheet and the script are inlined into the HTML, so the page
is one response with no asset URLs to get wrong under ``--root-path``, and it is served
with a Content-Security-Policy that runs only those two inline blocks (by hash) and lets
the page talk only to its own origin. The page needs no API key; the API calls it makes
do (the page asks for the key and keeps it in the tab's sessionStorage).
"""

from __future__ import annotations

import base64
import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI
from starlette.responses import Response

STATIC_DIR = Path(__file__).with_name("static")
# The tags in index.html that the inlined files replace (they also let the HTML file
# open on its own from disk while the page is edited).
_STYLESHEET_TAG = '<link rel="stylesheet" href="style.css">'
_SCRIPT_TAG = '<script src="app.js"></script>'


@dataclass(frozen=True)
class WebPage:
    html: bytes
    headers: dict[str, str]

    @classmethod
    def from_static(cls, static_dir: Path = STATIC_DIR) -> WebPage:
        html = (static_dir / "index.html").read_text(encoding="utf-8")
        css = (static_dir / "style.css").read_text(encoding="utf-8")
        script = (static_dir / "app.js").read_text(encoding="utf-8")
        for tag, text, closing in ((_STYLESHEET_TAG, css, "</style"),
                                   (_SCRIPT_TAG, script, "</script")):
            if html.count(tag) != 1 or closing in text.lower():
                raise ValueError(f"{static_dir}: index.html must hold {tag} once and the file "
                                 f"it names must not contain {closing}")
        html = (html.replace(_STYLESHEET_TAG, f"<style>{css}</style>")
                    .replace(_SCRIPT_TAG, f"<script>{script}</script>"))
        policy = "; ".join((
            "default-src 'none'", f"script-src '{_sha256(script)}'", f"style-src '{_sha256(css)}'",
            "connect-src 'self'", "img-src 'self' data:", "base-uri 'none'", "form-action 'self'",
            "frame-ancestors 'none'"))
        return cls(html.encode(), {"Content-Security-Policy": policy,
                                   "X-Content-Type-Options": "nosniff",
                                   "Referrer-Policy": "no-referrer",
                                   "Cache-Control": "no-cache"})

    def response(self) -> Response:
        return Response(self.html, media_type="text/html; charset=utf-8", headers=self.headers)


@functools.cache
def chat_page() -> WebPage:
    """The page, built once per process (the server answers with it while loading too)."""
    return WebPage.from_static()


def add_web_ui(app: FastAPI) -> None:
    """Serve the chat page at GET / (and HEAD /)."""
    page = chat_page()

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def web_ui() -> Response:
        return page.response()


def _sha256(text: str) -> str:
    return "sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()
