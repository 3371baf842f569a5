"""The sign-in limit on the request path ``make serve`` runs: HAProxy (deploy/haproxy.env)
in front of the ingress replica, on an application of its own in the session's cluster
with a token, one group (the plain accumulator) and small bounds: 3 wrong tokens per
client address and 8 for all clients together in a minute.

Serve's HAProxy names no client (its template sets no ``X-Forwarded-For``): every
request reaches the replica from HAProxy's loopback address, which ``trusted_proxies``
trusts by default, with whatever ``X-Forwarded-For`` the client itself wrote. So:

- clients that write none are not one bucket: a client's wrong tokens do not lock the
  others out (they count towards the ceiling only);
- an address in ``X-Forwarded-For`` (as a balancer in front of HAProxy writes it) has its
  own limit;
- a client that writes a new address each try gets past the per-address limit, and the
  ceiling stops it: then every client is refused, the right token too.
"""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import application, shipped_deployment

TOKEN = "haproxy-login-token"
PER_ADDRESS, TOTAL = 3, 8
FORM = {"Content-Type": "application/x-www-form-urlencoded"}


@pytest.fixture(scope="module")
def behind_haproxy(service, tmp_path_factory):
    if service.env.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        pytest.skip("HYBRIDFLOW_SERVE_HAPROXY=0: Serve's own proxy, not HAProxy, is in front")
    app = application(service, "logins", tmp_path_factory, auth_token=TOKEN,
                      deployments=[shipped_deployment("accumulators", ("accumulator",))],
                      limits={"login_failures_per_minute": PER_ADDRESS, "login_failures_per_minute_total": TOTAL})
    try:
        yield app.start()
    finally:
        app.kill()


def test_the_login_limit_through_haproxy(behind_haproxy):
    with httpx.Client(base_url=behind_haproxy.url, timeout=60) as client:

        def login(token: str, forwarded_for: str | None = None) -> httpx.Response:
            headers = {**FORM, **({"X-Forwarded-For": forwarded_for} if forwarded_for else {})}
            return client.post("/login", content=f"token={token}", headers=headers)

        # HAProxy's requests all come from one address: one client's guesses lock no one out
        assert [login("guess").status_code for _ in range(PER_ADDRESS + 1)] == [401] * (PER_ADDRESS + 1)
        signed_in = login(TOKEN)
        assert signed_in.status_code == 303 and "sc_token=" in signed_in.headers["set-cookie"]
        # an address a balancer in front would write: limited on its own (4 failures so far)
        codes = [login("guess", "203.0.113.7").status_code for _ in range(PER_ADDRESS + 1)]
        assert codes == [401] * PER_ADDRESS + [429]
        assert login("guess", "203.0.113.8").status_code == 401  # 8 failures: the ceiling
        # a new address each try no longer helps: every client is refused, the right token too
        for token, forwarded_for in (("guess", "198.51.100.1"), (TOKEN, "198.51.100.2"), (TOKEN, None)):
            refused = login(token, forwarded_for)
            assert refused.status_code == 429, refused.text
            assert "set-cookie" not in refused.headers and "Too many wrong tokens" in refused.text
            assert 1 <= int(refused.headers["retry-after"]) <= 60
        # a bearer client is never held up by it
        assert client.get("/v1/groups/accumulator", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
