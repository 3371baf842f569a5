"""The bearer token: when one is set (``auth_token`` or SC_AUTH_TOKEN), every route but
the health probes needs it, the API docs included.

A client sends ``Authorization: Bearer <token>``; a browser (the status page, the API
docs) may send it as the ``sc_token`` cookie instead, set by ``POST /login``. The cookie
is SameSite=Strict and the mutating routes take only JSON or safetensors bodies, so
another site's page can neither read nor post with it.
"""

from __future__ import annotations

import hmac
from urllib.parse import urlencode

from fastapi import Request

from hybridflow.http.errors import ApiError

COOKIE = "sc_token"


def token_matches(given: str | None, token: str) -> bool:
    return given is not None and hmac.compare_digest(given.encode(), token.encode())


def authorized(request: Request) -> bool:
    """Whether the request carries the configured token (or none is configured)."""
    token = request.app.state.settings.auth_token
    if not token:
        return True
    header = request.headers.get("authorization", "")
    bearer = header[7:] if header[:7].lower() == "bearer " else None
    return token_matches(bearer, token) or token_matches(request.cookies.get(COOKIE), token)


async def require_token(request: Request) -> None:
    """FastAPI dependency: 401 unless the request carries the configured token. Async
    (it does no I/O), so that FastAPI runs it on the loop instead of its thread pool."""
    if not authorized(request):
        raise ApiError(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})


async def require_page_token(request: Request) -> None:
    """FastAPI dependency of the HTML pages: a browser without the token is sent to the
    login form, which brings it back here."""
    if not authorized(request):
        raise ApiError(303, "sign in first", {"Location": "/login?" + urlencode({"next": request.url.path})})
