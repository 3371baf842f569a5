"""The status page, login and the API docs, on the service's real app over a stub backend:
the routes with httpx, then the page in a real headless Chromium (login with the token,
the groups and jobs it draws, the docs rendered from the ingress's own assets)."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from hybridflow.http.auth import session_value
from tests.unit.observed_stub import GROUPS, JOB, observed_app
from tests.unit.served_app import served

TOKEN = "page-token"
SESSION = session_value(TOKEN)


def run(coro):
    return asyncio.run(coro)


async def fetch(app, method: str, path: str, **kwargs) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://svc") as client:
        return await client.request(method, path, **kwargs)


def test_pages_are_open_without_a_token():
    app = observed_app()
    for path in ("/", "/ui"):
        page = run(fetch(app, "GET", path))
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "/v1/groups" in page.text and "/v1/jobs" in page.text
    # nothing to sign in to: the form sends the browser on
    assert run(fetch(app, "GET", "/login?next=/ui")).headers["location"] == "/ui"


def test_with_a_token_pages_send_a_browser_to_the_login_form():
    app = observed_app(TOKEN)
    for path in ("/", "/ui", "/docs", "/redoc"):
        answer = run(fetch(app, "GET", path))
        assert answer.status_code == 303, path
        assert answer.headers["location"] == "/login?next=" + path.replace("/", "%2F")
    # the API itself still answers 401 (no redirect for a client)
    assert run(fetch(app, "GET", "/v1/groups")).status_code == 401
    assert run(fetch(app, "GET", "/openapi.json")).status_code == 401
    form = run(fetch(app, "GET", "/login?next=/docs"))
    assert form.status_code == 200 and 'name="next" value="/docs"' in form.text


def test_login_checks_the_token_and_sets_an_httponly_strict_cookie():
    app = observed_app(TOKEN)
    wrong = run(fetch(app, "POST", "/login", data={"token": "nope", "next": "/ui"}))
    assert wrong.status_code == 401 and "Wrong token" in wrong.text and "set-cookie" not in wrong.headers
    right = run(fetch(app, "POST", "/login", data={"token": TOKEN, "next": "/ui"}))
    assert right.status_code == 303 and right.headers["location"] == "/ui"
    cookie = right.headers["set-cookie"]
    assert cookie.startswith(f"sc_token={SESSION};") and TOKEN not in cookie
    assert {"httponly", "path=/", "samesite=strict"} <= {part.strip().lower() for part in cookie.split(";")}
    with_cookie = {"cookies": {"sc_token": SESSION}}
    assert run(fetch(app, "GET", "/ui", **with_cookie)).status_code == 200
    assert run(fetch(app, "GET", "/v1/groups", **with_cookie)).status_code == 200
    out = run(fetch(app, "POST", "/logout"))
    assert out.status_code == 303 and out.headers["set-cookie"].startswith('sc_token="";')


@pytest.mark.parametrize("target", ["https://evil.example/", "//evil.example/", "/\\evil.example", "ui"])
def test_login_only_sends_back_to_this_service(target):
    answer = run(fetch(observed_app(TOKEN), "POST", "/login", data={"token": TOKEN, "next": target}))
    assert answer.status_code == 303 and answer.headers["location"] == "/"


def test_login_takes_only_a_form():
    app = observed_app(TOKEN)
    assert run(fetch(app, "POST", "/login", json={"token": TOKEN})).status_code == 415
    too_many = "&".join(f"f{i}=1" for i in range(10))
    answer = run(fetch(app, "POST", "/login", content=too_many,
                       headers={"Content-Type": "application/x-www-form-urlencoded"}))
    assert answer.status_code == 400


def test_docs_load_their_assets_from_the_ingress():
    app = observed_app(TOKEN)
    auth = {"headers": {"Authorization": f"Bearer {TOKEN}"}}
    for path in ("/docs", "/redoc"):
        page = run(fetch(app, "GET", path, **auth)).text
        sources = re.findall(r'(?:src|href)="([^"]+)"', page)
        assert sources and all(s.startswith("/docs/assets/") for s in sources), sources
    js = run(fetch(app, "GET", "/docs/assets/swagger-ui-bundle.js", **auth))
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert b"SwaggerUIBundle" in js.content[:2000]
    assert run(fetch(app, "GET", "/docs/assets/swagger-ui-bundle.js")).status_code == 401
    assert run(fetch(app, "GET", "/docs/assets/..%2Fcore.py", **auth)).status_code == 404


# -- in a real browser -------------------------------------------------------------------


def test_in_a_browser_login_then_the_page_shows_groups_ranks_and_jobs(browser):
    with served(observed_app(TOKEN)) as url:
        page = browser.new_page()
        outside: list[str] = []
        page.on("request", lambda r: None if r.url.startswith((url, "data:")) else outside.append(r.url))
        page.goto(url + "/")
        assert page.url == url + "/login?next=%2F"
        page.fill("#token", "wrong")
        page.click("button[type=submit]")
        assert page.locator("[role=alert]").inner_text() == "Wrong token."
        page.fill("#token", TOKEN)
        page.click("button[type=submit]")
        page.wait_for_url(url + "/")
        page.wait_for_selector("tr[data-group]")
        # the cookie is HttpOnly: the page's own scripts cannot read it
        assert "sc_token" not in page.evaluate("document.cookie")
        rows = page.locator("tr[data-group]")
        assert sorted(rows.evaluate_all("rows => rows.map(r => r.dataset.group)")) == sorted(GROUPS)
        for name, (deployment, _, status, last_error) in GROUPS.items():
            row = page.locator(f'section[data-deployment="{deployment}"] tr[data-group="{name}"]')
            assert row.get_attribute("data-status") == status
            assert row.locator(".status").inner_text() == status
            if last_error:
                assert row.locator(".error").inner_text() == last_error
        ready = page.locator('tr[data-group="gpu_accumulator"] .rank')
        ready.nth(3).wait_for()
        assert ready.count() == 4
        assert ready.nth(2).inner_text() == "rank 2 \u00b7 node ab12cd34 \u00b7 pid 4002 \u00b7 GPU 2"
        assert ready.nth(2).get_attribute("title") == "ab12cd34ef56" * 4 + "\n10.0.0.7"
        job = page.locator(f'tr[data-job="{JOB["id"]}"]')
        assert job.get_attribute("data-status") == "running" and "50%" in job.inner_text()
        assert "mlp.run_layer (split 4)" in job.inner_text()
        assert outside == []
        page.close()


def test_in_a_browser_the_api_docs_render_offline_and_list_the_routes(browser):
    with served(observed_app(TOKEN)) as url:
        context = browser.new_context()
        context.add_cookies([{"name": "sc_token", "value": SESSION, "url": url}])
        page = context.new_page()
        outside: list[str] = []
        page.on("request", lambda r: None if r.url.startswith((url, "data:")) else outside.append(r.url))
        page.goto(url + "/docs")
        page.wait_for_selector(".opblock-summary-path")
        paths = set(page.locator(".opblock-summary-path").evaluate_all("els => els.map(e => e.dataset.path)"))
        assert {"/v1/groups", "/v1/groups/{group}/{method}", "/v1/jobs/{job_id}", "/v2/models/{model}/infer",
                "/v2/models/{model}/stats", "/v2/repository/index"} <= paths
        assert outside == []
        context.close()
