"""Signing a browser in. A browser cannot send a bearer header when it navigates, so
``POST /login`` checks the token from a form and sets the ``sc_token`` cookie to a
session value derived from it (``hybridflow.http.auth`` accepts either): HttpOnly, so no
page script can read it, SameSite=Strict, so no other site's request carries it, and
Secure when the browser came over https (directly, or as a trusted proxy says). Wrong
tokens are limited per client address and for all clients together
(``hybridflow.http.login_limit``); an address that is a trusted proxy's own (a proxy that
named no client, such as Serve's HAProxy) is no client's, and counts towards the second
only. Open routes, outside the schema.
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from string import Template
from urllib.parse import parse_qs

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from hybridflow.http.auth import COOKIE, session_value, token_matches
from hybridflow.http.body import body_kind, read_body
from hybridflow.http.errors import ApiError
from hybridflow.http.login_limit import LoginLimiter
from hybridflow.http.proxies import came_over_https, client_address, trusted
from hybridflow.http.routes.common import settings

FORM = "application/x-www-form-urlencoded"
#: A token and a path back: a form larger than this is not ours.
MAX_FORM_BYTES = 8192
PAGE = Template((Path(__file__).resolve().parent.parent / "static" / "login.html").read_text())

router = APIRouter(include_in_schema=False)


def local_path(target: str | None) -> str:
    """Where to go after signing in: a path on this service only, never another site."""
    if not target or not target.startswith("/") or target.startswith(("//", "/\\")):
        return "/"
    return target


def login_page(
    target: str, error: str | None = None, status: int = 200, headers: dict[str, str] | None = None
) -> HTMLResponse:
    message = f'<p class="error" role="alert">{html.escape(error)}</p>' if error else ""
    body = PAGE.substitute(error=message, next=html.escape(local_path(target), quote=True))
    return HTMLResponse(body, status_code=status, headers={"Cache-Control": "no-store", **(headers or {})})


@router.get("/login")
async def login_form(request: Request, next: str = "/") -> Response:
    if not settings(request).auth_token:  # nothing to sign in to
        return RedirectResponse(local_path(next), status_code=303)
    return login_page(next)


@router.post("/login")
async def login(request: Request) -> Response:
    config = settings(request)
    limiter: LoginLimiter = request.app.state.login_limiter
    client: str | None = client_address(request, config.trusted_proxies)
    if trusted(client, config.trusted_proxies):  # the proxy's own address: one bucket for everyone behind it
        client = None
    wait = limiter.retry_after(client) if config.auth_token else None
    if wait is not None:  # before the body is read or the token compared
        seconds = str(math.ceil(wait))
        message = f"Too many wrong tokens; try again in {seconds} s."
        return login_page(local_path(request.query_params.get("next")), message, 429, {"Retry-After": seconds})
    body_kind(request, (FORM,))
    body = await read_body(request, MAX_FORM_BYTES)
    try:
        form = parse_qs(body.decode("utf-8"), max_num_fields=4)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ApiError(400, f"login form: {exc}") from None
    token, target = form.get("token", [""])[0], local_path(form.get("next", ["/"])[0])
    configured = config.auth_token
    if configured and not token_matches(token, configured):
        limiter.failed(client)
        return login_page(target, "Wrong token.", 401)
    response = RedirectResponse(target, status_code=303)
    if configured:
        limiter.succeeded(client)
        response.set_cookie(
            COOKIE, session_value(configured), httponly=True, samesite="strict",
            secure=came_over_https(request, config.trusted_proxies), path="/",
        )
    return response


@router.post("/logout")
async def logout() -> Response:
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
    return response
