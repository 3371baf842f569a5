"""The HTTP layer against a browser on another port and a guessing client: the sign-in
cookie (a session value, Secure behind an https proxy it trusts), POSTs that only the
cookie authenticates, the login limit, the Idempotency-Key bound, what /readyz tells a
client without the token, and JSON for every error, unexpected ones included."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from hybridflow.config import ConfigError, load_config
from hybridflow.control.contract import CallRequest, CallResult, InferResult
from hybridflow.http.app import create_app
from hybridflow.http.auth import session_value
from hybridflow.http.login_limit import LoginLimiter
from hybridflow.http.routes.common import MAX_IDEMPOTENCY_KEY_CHARS
from hybridflow.http.settings import IngressSettings, ModelRoute

TOKEN = "hardening-token"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
COOKIE = {"sc_token": session_value(TOKEN)}
FORM = {"Content-Type": "application/x-www-form-urlencoded"}
INFER = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}]}).encode()


class Backend:
    """Ready groups; calls and inferences answered at once, counted; ``broken`` raises."""

    def __init__(self, ready: bool = True) -> None:
        self.calls: list[CallRequest] = []
        self.inferred = 0
        self.is_ready = ready

    async def ready(self) -> dict[str, bool]:
        return {"echo": self.is_ready, "secret_group": True}

    async def call(self, request: CallRequest) -> CallResult:
        if request.group == "broken":
            raise RuntimeError("/srv/secret/path: the controller broke")
        self.calls.append(request)
        return CallResult(1, dispatch_mode="ONE_TO_ALL", execute_mode="ALL", world_size=1)

    async def infer(self, model: str, inputs: dict[str, Any]) -> InferResult:
        self.inferred += 1
        return InferResult(outputs={"y": inputs["x"]})


def app_of(backend: Backend | None = None, token: str | None = TOKEN, **settings: Any) -> Any:
    config = IngressSettings(
        auth_token=token, groups={"echo": "d", "broken": "d", "secret_group": "d"},
        models={"double": ModelRoute(deployment="d", group="echo", outputs=["y"])}, **settings,
    )
    return create_app(backend or Backend(), config)


def fetch(app: Any, method: str, path: str, client: tuple[str, int] = ("127.0.0.1", 5000),
          base: str = "http://svc", **kwargs: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, client=client, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url=base) as http:
            return await http.request(method, path, **kwargs)

    return asyncio.run(go())


def is_json_error(answer: httpx.Response, status: int) -> str:
    assert answer.status_code == status, (answer.status_code, answer.text)
    assert answer.headers["content-type"] == "application/json"
    return answer.json()["error"]


# -- the cookie and cross-origin POSTs -----------------------------------------------------


def test_the_cookie_holds_a_session_value_not_the_token():
    app = app_of()
    signed_in = fetch(app, "POST", "/login", content="token=" + TOKEN, headers=FORM)
    assert signed_in.status_code == 303
    assert signed_in.cookies["sc_token"] == session_value(TOKEN) != TOKEN
    assert fetch(app, "GET", "/v1/groups/echo", cookies=COOKIE).status_code != 401
    # the token itself is no cookie, and the session value is no bearer token
    assert fetch(app, "GET", "/readyz", cookies={"sc_token": TOKEN}).json() == {"status": "ready"}
    assert fetch(app, "POST", "/v1/groups/echo/m", json={}, cookies={"sc_token": TOKEN}).status_code == 401
    headers = {"Authorization": f"Bearer {session_value(TOKEN)}"}
    assert fetch(app, "POST", "/v1/groups/echo/m", json={}, headers=headers).status_code == 401
    # another token gives another session: changing the token signs every browser out
    assert session_value("other") != session_value(TOKEN)


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_a_post_only_the_cookie_authenticates_needs_an_api_body_type(content_type):
    backend = Backend()
    app = app_of(backend)
    headers = {} if content_type is None else {"Content-Type": content_type}
    # what a page on another port of this host can send without a preflight
    answer = fetch(app, "POST", "/v2/models/double/infer", content=INFER, headers=headers, cookies=COOKIE)
    assert "sign-in cookie" in is_json_error(answer, 415)
    answer = fetch(app, "POST", "/v1/groups/echo/m", content=b"{}", headers=headers, cookies=COOKIE)
    assert is_json_error(answer, 415)
    assert backend.inferred == 0 and backend.calls == []


def test_bearer_clients_and_api_body_types_keep_working():
    backend = Backend()
    app = app_of(backend)
    # tritonclient sends no Content-Type, with the token in its header
    assert fetch(app, "POST", "/v2/models/double/infer", content=INFER, headers=BEARER).status_code == 200
    json_type = {"Content-Type": "application/json"}
    assert fetch(app, "POST", "/v2/models/double/infer", content=INFER, headers=json_type,
                 cookies=COOKIE).status_code == 200
    assert fetch(app, "POST", "/v1/groups/echo/m", json={}, cookies=COOKIE).status_code == 200
    assert backend.inferred == 2 and len(backend.calls) == 1
    # no token configured: nothing to sign in with, so nothing to forge
    assert fetch(app_of(Backend(), token=None), "POST", "/v2/models/double/infer", content=INFER).status_code == 200


@pytest.mark.parametrize("peer, forwarded, proxies, secure", [
    ("127.0.0.1", "https", None, True),            # a proxy on this host, trusted by default
    ("127.0.0.1", "http", None, False),
    ("127.0.0.1", "http, https", None, True),      # https at any hop
    ("203.0.113.9", "https", None, False),         # anyone else may write the header
    ("10.1.2.3", "https", ["10.0.0.0/8"], True),
    ("127.0.0.1", "https", [], False),             # no proxy believed
    ("127.0.0.1", None, None, False),
])
def test_the_cookie_is_secure_when_a_trusted_proxy_says_https(peer, forwarded, proxies, secure):
    app = app_of(**({} if proxies is None else {"trusted_proxies": proxies}))
    headers = {**FORM, **({} if forwarded is None else {"X-Forwarded-Proto": forwarded})}
    answer = fetch(app, "POST", "/login", client=(peer, 4000), content="token=" + TOKEN, headers=headers)
    flags = {part.strip().lower() for part in answer.headers["set-cookie"].split(";")}
    assert ("secure" in flags) == secure


def test_the_cookie_is_secure_over_https_itself():
    answer = fetch(app_of(trusted_proxies=[]), "POST", "/login", base="https://svc", content="token=" + TOKEN,
                   headers=FORM)
    assert "secure" in {part.strip().lower() for part in answer.headers["set-cookie"].split(";")}


def test_trusted_proxies_are_configured_as_networks():
    args = {"deployments": [{"name": "d", "groups": [
        {"name": "g", "worker": "single_controller.models.tutorial_workers:GPUAccumulator", "plain_actor": True}]}]}
    config = load_config(args)
    assert [str(n) for n in config.trusted_proxies] == ["127.0.0.1/32", "::1/128"]
    assert config.limits.login_failures_per_minute == 10
    assert config.limits.login_failures_per_minute_total == 100
    config = load_config({**args, "trusted_proxies": ["10.0.0.0/8", "fd00::1"]})
    assert [str(n) for n in config.trusted_proxies] == ["10.0.0.0/8", "fd00::1/128"]
    with pytest.raises(ConfigError, match="trusted_proxies"):
        load_config({**args, "trusted_proxies": ["10.0.0.1/8"]})  # host bits set: not a network
    with pytest.raises(ConfigError, match="login_failures_per_minute"):
        load_config({**args, "limits": {"login_failures_per_minute": 0}})
    with pytest.raises(ConfigError, match="login_failures_per_minute_total"):
        load_config({**args, "limits": {"login_failures_per_minute_total": 0}})


# -- the login limit -----------------------------------------------------------------------


def test_wrong_tokens_are_limited_per_client_address():
    app = app_of(login_failures_per_minute=3)
    guesser = ("203.0.113.7", 1000)
    for _ in range(3):
        answer = fetch(app, "POST", "/login", client=guesser, content="token=guess", headers=FORM)
        assert answer.status_code == 401
    for token in ("guess", TOKEN):  # blocked: even the right token tells it nothing
        blocked = fetch(app, "POST", "/login", client=guesser, content="token=" + token, headers=FORM)
        assert blocked.status_code == 429 and "set-cookie" not in blocked.headers
        assert 1 <= int(blocked.headers["retry-after"]) <= 60 and "Too many wrong tokens" in blocked.text
    # another address is not blocked, nor is a bearer client at the blocked one
    other = fetch(app, "POST", "/login", client=("203.0.113.8", 1000), content="token=" + TOKEN, headers=FORM)
    assert other.status_code == 303
    assert fetch(app, "GET", "/v1/groups/echo", client=guesser, headers=BEARER).status_code != 429


def test_behind_a_trusted_proxy_the_limit_counts_the_forwarded_client():
    app = app_of(login_failures_per_minute=2)
    proxy = ("127.0.0.1", 1000)

    def attempt(forwarded_for: str, token: str = "guess") -> int:
        headers = {**FORM, "X-Forwarded-For": forwarded_for}
        return fetch(app, "POST", "/login", client=proxy, content="token=" + token, headers=headers).status_code

    # the client may prepend whatever it likes; the proxy's own entry is the last one
    assert [attempt(f"198.51.100.{i}, 203.0.113.7") for i in range(3)] == [401, 401, 429]
    assert attempt("203.0.113.99", TOKEN) == 303
    # an untrusted peer's header is its own: it is counted by its address
    spoofer = ("203.0.113.50", 1)
    codes = [fetch(app, "POST", "/login", client=spoofer, content="token=x",
                   headers={**FORM, "X-Forwarded-For": f"192.0.2.{i}"}).status_code for i in range(3)]
    assert codes == [401, 401, 429]


def test_the_ceiling_holds_whatever_address_a_client_claims():
    app = app_of(login_failures_per_minute=3, login_failures_per_minute_total=5)
    proxy = ("127.0.0.1", 1000)  # trusted (loopback): it passes on what the client wrote

    def attempt(forwarded_for: str | None, token: str = "guess", client: tuple[str, int] = proxy):
        headers = {**FORM, **({"X-Forwarded-For": forwarded_for} if forwarded_for else {})}
        return fetch(app, "POST", "/login", client=client, content="token=" + token, headers=headers)

    # a new address every try: the per-address limit never applies, the ceiling does
    assert [attempt(f"198.51.100.{i}").status_code for i in range(5)] == [401] * 5
    for forwarded_for, token, peer in (("198.51.100.77", "guess", proxy), ("192.0.2.1", TOKEN, proxy),
                                       (None, TOKEN, ("203.0.113.60", 1))):
        blocked = attempt(forwarded_for, token, peer)  # every client, right token or not
        assert blocked.status_code == 429 and "set-cookie" not in blocked.headers, blocked.text
        assert 1 <= int(blocked.headers["retry-after"]) <= 60
    # bearer clients are never limited by it
    called = fetch(app, "POST", "/v1/groups/echo/add", client=proxy, content=b'{"kwargs": {}}',
                   headers={**BEARER, "Content-Type": "application/json"})
    assert called.status_code == 200, called.text


def test_a_trusted_proxys_own_address_is_no_clients_bucket():
    # Serve's HAProxy names no client: every request comes from its address
    app = app_of(login_failures_per_minute=3, login_failures_per_minute_total=10)
    haproxy = ("127.0.0.1", 1000)
    codes = [fetch(app, "POST", "/login", client=haproxy, content="token=guess", headers=FORM).status_code
             for _ in range(5)]
    assert codes == [401] * 5  # past the per-address limit: counted towards the ceiling only
    signed_in = fetch(app, "POST", "/login", client=haproxy, content="token=" + TOKEN, headers=FORM)
    assert signed_in.status_code == 303 and "set-cookie" in signed_in.headers
    codes = [fetch(app, "POST", "/login", client=haproxy, content="token=guess", headers=FORM).status_code
             for _ in range(6)]
    assert codes == [401] * 5 + [429]  # the ceiling: 10 failures, the sign-in forgot none of them
    # an address the service does not trust is a client's own, with its own limit
    untrusted = app_of(login_failures_per_minute=3, login_failures_per_minute_total=10, trusted_proxies=[])
    codes = [fetch(untrusted, "POST", "/login", client=haproxy, content="token=guess", headers=FORM).status_code
             for _ in range(4)]
    assert codes == [401, 401, 401, 429]


def test_the_ceiling_counts_every_failure_in_a_sliding_minute():
    now = [0.0]
    limiter = LoginLimiter(failures=2, total=3, window_s=60, clock=lambda: now[0])
    for second, client in ((0.0, "a"), (5.0, "b"), (20.0, None)):
        now[0] = second
        assert limiter.retry_after(client) is None
        limiter.failed(client)
    assert limiter.retry_after("c") == 40.0 and limiter.retry_after(None) == 40.0
    limiter.succeeded("a")  # a success forgets that client's failures, not the ceiling's
    assert limiter.retry_after("a") == 40.0
    now[0] = 60.5  # the first failure has left the window
    assert limiter.retry_after("c") is None
    now[0] = 61.0
    limiter.failed("c")  # full again: 5, 20 and 61, for everyone until 5 + 60
    assert limiter.retry_after("d") == 4.0 and limiter.retry_after(None) == 4.0
    assert LoginLimiter(failures=4).total == 40


def test_the_login_limiter_forgets_after_the_window_and_keeps_its_memory_bounded():
    now = [0.0]
    limiter = LoginLimiter(failures=2, total=10_000, window_s=60, clients=3, clock=lambda: now[0])
    limiter.failed("a")
    now[0] = 10.0
    limiter.failed("a")
    assert limiter.retry_after("a") == 50.0
    now[0] = 60.5  # the first failure has left the window
    assert limiter.retry_after("a") is None
    limiter.failed("a")
    assert limiter.retry_after("a") == 9.5
    limiter.succeeded("a")
    assert limiter.retry_after("a") is None and len(limiter) == 0
    for i in range(1000):
        limiter.failed(f"client {i}")
        limiter.failed(f"client {i}")
    # only the clients most recently failed are kept, each with at most `failures` times
    assert len(limiter) == 3 and limiter.retry_after("client 999") is not None
    assert limiter.retry_after("client 0") is None
    with pytest.raises(ValueError, match="positive"):
        LoginLimiter(failures=0)


# -- bounds and what the probes tell -------------------------------------------------------


def test_an_idempotency_key_is_bounded():
    backend = Backend()
    app = app_of(backend)
    fits = fetch(app, "POST", "/v1/groups/echo/m", json={}, headers={**BEARER, "Idempotency-Key": "k" * 200})
    assert fits.status_code == 200 and backend.calls[0].idempotency_key == "k" * MAX_IDEMPOTENCY_KEY_CHARS
    for path in ("/v1/groups/echo/m", "/v1/jobs/echo/m"):
        long = fetch(app, "POST", path, json={}, headers={**BEARER, "Idempotency-Key": "k" * 201})
        assert is_json_error(long, 400) == "Idempotency-Key has 201 characters, over the limit of 200"
    assert len(backend.calls) == 1


def test_readiness_names_groups_only_to_a_client_with_the_token():
    app = app_of()
    assert fetch(app, "GET", "/readyz").json() == {"status": "ready"}
    assert fetch(app, "GET", "/readyz", headers=BEARER).json() == {
        "status": "ready", "groups": {"echo": True, "secret_group": True}}
    waiting = app_of(Backend(ready=False))
    assert is_json_error(fetch(waiting, "GET", "/readyz"), 503) == "not ready"
    assert is_json_error(fetch(waiting, "GET", "/readyz", cookies=COOKIE), 503) == "not ready: echo"
    # no token configured: the detail is everyone's
    assert "groups" in fetch(app_of(token=None), "GET", "/readyz").json()
    assert fetch(app, "GET", "/healthz").json() == {"status": "live"}


def test_an_unexpected_exception_is_a_json_500_without_its_traceback():
    answer = fetch(app_of(), "POST", "/v1/groups/broken/m", json={}, headers=BEARER)
    message = is_json_error(answer, 500)
    assert message.startswith("internal error (RuntimeError)")
    assert "secret" not in answer.text and "Traceback" not in answer.text


def test_a_dataproto_dtype_numpy_cannot_make_is_a_json_4xx():
    document = {"rows": 1, "batch": {}, "meta_info": {},
                "non_tensor_batch": {"a": {"dtype": "(2147483647,)f4", "shape": [1], "data": [1]}}}
    backend = Backend()
    answer = fetch(app_of(backend), "POST", "/v1/groups/echo/m", headers=BEARER,
                   json={"kwargs": {"data": {"__dataproto__": document}}})
    assert "must be numeric or 'object'" in is_json_error(answer, 422)
    assert backend.calls == []
