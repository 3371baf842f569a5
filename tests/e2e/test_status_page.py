"""The status page and the API docs of the session's service in a real headless Chromium:
the tutorial's groups with their rank placement, a job's progress, a group shown
rebuilding after one of its workers is killed (and ready again, with the rebuild counted
in the metrics), and Swagger UI rendered from the ingress's own assets."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx

from tests.browser import save_screenshot
from tests.e2e.cluster import kill_actor, metrics_endpoints, scrape_until, wait_until_noticed

TUTORIAL = {
    "accumulators": ["accumulator", "gpu_accumulator", "gpu_accumulator_a", "gpu_accumulator_merge",
                     "gpu_accumulator_decorator"],
    "test_actor": ["test_actor"],
    "mlp": ["mlp", "mlp_rollout"],
}
VICTIM = "gpu_accumulator_a"


def row(group: str, status: str | None = None) -> str:
    return f'tr[data-group="{group}"]' + (f'[data-status="{status}"]' if status else "")


#: The error a group's row shows while it is rebuilding, read in the same look that finds the
#: row rebuilding (the rebuild may be over a moment later); null until then.
REBUILDING_ERROR = """group => {
    const row = document.querySelector(`tr[data-group="${group}"][data-status="rebuilding"]`);
    const error = row && row.querySelector(".error");
    return error ? error.innerText : null;
}"""


def pids_shown(page, group: str, count: int) -> list[int]:
    chips = page.locator(row(group) + " .rank")
    chips.nth(count - 1).wait_for()
    return [int(text.split("pid ")[1].split(" ")[0]) for text in chips.all_inner_texts()]


def kill_and_call(service, detail: dict, url: str) -> None:
    kill_actor(service, detail["namespace"], detail["ranks"][1]["actor_name"])
    with httpx.Client(base_url=str(url), timeout=60) as client:
        wait_until_noticed(client, VICTIM, "get_value", detail["rebuilds"])


def test_status_page_shows_groups_a_job_and_a_rebuild(service, http, browser, tmp_path):
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    outside: list[str] = []
    page.on("request", lambda r: None if r.url.startswith(service.url) else outside.append(r.url))
    page.goto(service.url + "/")
    for deployment, groups in TUTORIAL.items():
        section = page.locator(f'section[data-deployment="{deployment}"]')
        for group in groups:
            section.locator(row(group, "ready")).wait_for(timeout=30_000)
    assert page.locator("tr[data-group]").count() == sum(map(len, TUTORIAL.values()))
    detail = http.get(f"/v1/groups/{VICTIM}").json()
    assert pids_shown(page, VICTIM, 4) == [r["pid"] for r in detail["ranks"]]

    # a job, with its progress
    hidden = http.get("/v2/models/mlp").json()["inputs"][0]["shape"][-1]
    x = {"datatype": "FP32", "shape": [4, 1, hidden], "data": [0.01] * (4 * hidden)}
    job = http.post("/v1/jobs/mlp/run_layer?split=4", json={"args": [[x]]})
    assert job.status_code == 202, job.text
    shown = page.locator(f'tr[data-job="{job.json()["id"]}"][data-status="succeeded"]')
    shown.wait_for(timeout=60_000)
    assert "100%" in shown.inner_text() and "mlp.run_layer (split 4)" in shown.inner_text()

    # a worker dies: the page shows the group rebuilding, with why, then ready on new processes.
    # The rebuild can be over within seconds, so the page is watched while the worker is
    # killed (and called, so that the group notices at once), not after.
    killer = threading.Thread(target=kill_and_call, args=(service, detail, http.base_url))
    killer.start()
    try:
        why = page.wait_for_function(REBUILDING_ERROR, arg=VICTIM, timeout=60_000).json_value()
    finally:
        killer.join(timeout=120)
    assert "ActorDiedError" in why  # why: the last error
    save_screenshot(page, tmp_path / "status-page.png")
    page.locator(row(VICTIM, "ready")).wait_for(timeout=120_000)
    rebuilt = http.get(f"/v1/groups/{VICTIM}").json()
    assert rebuilt["rebuilds"] == detail["rebuilds"] + 1
    new_pids = pids_shown(page, VICTIM, 4)
    assert new_pids == [r["pid"] for r in rebuilt["ranks"]] and set(new_pids).isdisjoint(r["pid"] for r in detail["ranks"])
    assert Path(tmp_path / "status-page.png").stat().st_size > 10_000
    # the last events, as they came: the lost rank and the rebuild, with their group
    for kind in ("rank_lost", "group_rebuilt"):
        event = page.locator(f'#events tr[data-event="{kind}"]').first
        event.wait_for(timeout=30_000)
        assert VICTIM in event.inner_text()
    assert outside == []

    # the metrics count the same rebuilds and replayed calls as the group reports
    labels = {"group": VICTIM}
    scrape_until(metrics_endpoints(service), lambda s: (
        s.total("ray_hybridflow_group_rebuilds_total", **labels) == rebuilt["rebuilds"]
        and s.total("ray_hybridflow_group_replayed_calls_total", **labels) == rebuilt["replayed_calls"]
    ))
    page.close()


def test_swagger_ui_renders_offline_and_lists_the_routes(service, browser):
    page = browser.new_page()
    outside: list[str] = []
    page.on("request", lambda r: None if r.url.startswith(service.url) else outside.append(r.url))
    page.goto(service.url + "/docs")
    page.wait_for_selector(".opblock-summary-path", timeout=30_000)
    paths = set(page.locator(".opblock-summary-path").evaluate_all("els => els.map(e => e.dataset.path)"))
    assert {"/readyz", "/v1/groups", "/v1/groups/{group}/{method}", "/v1/jobs/{group}/{method}", "/v2/models/{model}/infer",
            "/v2/models/{model}/stats", "/v2/repository/index"} <= paths
    assert page.locator(".swagger-ui .info .title").inner_text().startswith("HybridFlow single controller")
    assert outside == []
    page.close()
