"""The bearer token: when one is set (``auth_token`` or HYBRIDFLOW_TOKEN), every route but
the health probes needs it, the API docs included.

A client sends ``Authorization: Bearer <token>``; a browser (the status page, the API
docs) may send the ``sc_token`` cookie instead, set by ``POST /login``. The cookie holds a
session value derived from the token (:func:`session_value`), never the token itself. It
is HttpOnly and SameSite=Strict; but a page on another port of the same host is the same
site, so a POST that only the cookie authenticates must also carry one of the API's body
types (:data:`COOKIE_POST_TYPES`), which no page can send to another origin without a CORS
preflight, which this service never grants.
"""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import urlencode

from fastapi import Request

from hybridflow.http.body import JSON, OCTET_STREAM, SAFETENSORS, media_type
from hybridflow.http.errors import ApiError

COOKIE = "sc_token"
#: What the session value is an HMAC of, with the token as key.
_SESSION_LABEL = b"hybridflow browser session"
#: Body types a cookie-authenticated POST may have (``+json`` types count as JSON).
COOKIE_POST_TYPES = (JSON, SAFETENSORS, OCTET_STREAM)


def token_matches(given: str | None, token: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), token.encode())


def session_value(token: str) -> str:
    """The cookie's value for ``token``: a stolen cookie does not give away the token
    (nor work as a bearer token), and changing the token signs every browser out."""
    return hmac.new(token.encode(), _SESSION_LABEL, hashlib.sha256).hexdigest()


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    return header[7:] if header[:7].lower() == "bearer " else None


def authorized(request: Request) -> bool:
    """Whether the request carries the configured token (or none is configured)."""
    token = request.app.state.settings.auth_token
    if not token:
        return True
    return token_matches(_bearer(request), token) or token_matches(request.cookies.get(COOKIE), session_value(token))


def by_cookie_only(request: Request) -> bool:
    """Whether the configured token is present only as the browser's cookie."""
    token = request.app.state.settings.auth_token
    return bool(token) and not token_matches(_bearer(request), token) and authorized(request)


async def require_token(request: Request) -> None:
    """FastAPI dependency: 401 unless the request carries the configured token; 415 for a
    POST that only the cookie authenticates and that has none of the API's body types (a
    form or a body without Content-Type: what another page can post without a preflight).
    Async (it does no I/O), so that FastAPI runs it on the loop instead of its thread pool."""
    if not authorized(request):
        raise ApiError(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
    if request.method == "POST" and by_cookie_only(request):
        kind = media_type(request.headers.get("content-type"))
        if kind not in COOKIE_POST_TYPES and not kind.endswith("+json"):
            named = f"Content-Type {kind!r}" if kind else "a body without Content-Type"
            raise ApiError(
                415,
                f"unsupported media type: {named} with the sign-in cookie; send {', '.join(COOKIE_POST_TYPES)}, "
                "or authenticate with an Authorization header",
            )


async def require_page_token(request: Request) -> None:
    """FastAPI dependency of the HTML pages: a browser without the token is sent to the
    login form, which brings it back here."""
    if not authorized(request):
        raise ApiError(303, "sign in first", {"Location": "/login?" + urlencode({"next": request.url.path})})
