"""The rollout page and its admin endpoints against real servers: A (tiny-rae) mirrored to a remote
xmcserve shadow (tiny-labels), B loaded from the bundle root. The API is checked with httpx; the
page itself in headless Chromium (Debian's chromium and chromium-driver, driven by Selenium),
skipped with the reason where either is missing (a failure under CI=true).

The docs' screenshots are taken on real bundles by ``python -m tools.rollout_screenshots``, not here."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi.testclient import TestClient

from loadtest.localserver import start_server, stop_server
from service.http.app import create_app
from service.http.settings import Settings
from tests.conftest import SAMPLE_DIR, wait_for

TOKEN = "rollout-token"
ADMIN = {"X-Admin-Token": TOKEN}
GRAFANA = "http://grafana.test:3000"
TEXTS = [
    "python3-numpy: Fast array facility to the Python 3 language",
    "libssl-dev: Secure Sockets Layer toolkit - development files",
]


@pytest.fixture(scope="module")
def evaluation(bundle_root) -> dict:
    """tiny-rae's dev-split evaluation, stored beside it as ``make evaluate`` stores one."""
    from export.evaluate import main as evaluate

    out = bundle_root / "tiny-rae-eval-dev.json"
    evaluate(["--bundle", str(bundle_root / "tiny-rae"), "--data", str(SAMPLE_DIR), "--k", "10", "--out", str(out)])
    yield json.loads(out.read_text())
    out.unlink()


@pytest.fixture(scope="module")
def servers(bundle_root, evaluation, tmp_path_factory):
    """(primary, shadow): A serves tiny-rae and mirrors every request to a shadow serving tiny-labels."""
    logs = tmp_path_factory.mktemp("rollout-logs")
    # a log directory of its own: the primary loads tiny-labels into B too (one writer per log)
    own_logs = {"XMCSERVE_APPEND_LOG_DIR": str(logs / "shadow-appends")}
    shadow = start_server(bundle_root / "tiny-labels", logs / "shadow.log", extra_env=own_logs)
    env = {
        "XMCSERVE_BUNDLE_ROOT": str(bundle_root),
        "XMCSERVE_ADMIN_TOKEN": TOKEN,
        "XMCSERVE_SHADOW_URL": shadow.url,
        "XMCSERVE_SHADOW_FRACTION": "1.0",
        "XMCSERVE_SHADOW_TIMEOUT_MS": "20000",
        "XMCSERVE_GRAFANA_URL": GRAFANA,
    }
    try:
        primary = start_server(bundle_root / "tiny-rae", logs / "primary.log", extra_env=env)
    except BaseException:
        stop_server(shadow)
        raise
    yield primary, shadow
    stop_server(primary)
    stop_server(shadow)


def mirrored_traffic(primary, count: int) -> int:
    """``count`` /predict requests (mirrored to the shadow); waits until the shadow compared them."""
    with httpx.Client(base_url=primary.url, timeout=30) as client:
        for i in range(count):
            text = f"python3-module-{i}: a Python module" if i % 2 else f"lib{i}-dev: development files"
            assert client.post("/predict", json={"text": text, "k": 5}).status_code == 200
        return wait_for(
            lambda: len(c := client.get("/admin/agreement", headers=ADMIN).json()["compared"]) >= count and len(c),
            step_s=0.2,
        )


def test_the_page_is_off_when_the_admin_api_is(tmp_path):
    client = TestClient(create_app(Settings(bundle_dir=tmp_path)))  # no lifespan: the page needs no bundle
    for path in ("/rollout", "/rollout/rollout.js"):
        response = client.get(path)
        assert response.status_code == 404 and "admin API is disabled" in response.text


def test_the_page_holds_no_state_and_allows_only_its_own_files(servers):
    primary, _ = servers
    page = httpx.get(f"{primary.url}/rollout")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "default-src 'self'" in page.headers["content-security-policy"]
    a_id = httpx.get(f"{primary.url}/readyz").json()["bundle_id"]
    assert a_id not in page.text and "http" not in page.text.replace("http-equiv", "")  # nothing fetched elsewhere
    for path in ("/admin/compare", "/admin/agreement", "/admin/bundles"):
        method = "POST" if path == "/admin/compare" else "GET"
        assert httpx.request(method, f"{primary.url}{path}").status_code == 401


def test_compare_answers_both_sides_with_the_shadows_agreement(servers):
    primary, _ = servers
    body = {"texts": TEXTS, "k": 5}
    alone = httpx.post(f"{primary.url}/admin/compare", json=body, headers=ADMIN, timeout=60).json()
    assert alone["sides"]["B"]["error"] == "variant B has no bundle loaded" and alone["agreement"] == []
    assert len(alone["sides"]["A"]["results"]) == 2

    loaded = httpx.post(
        f"{primary.url}/admin/reload", json={"variant": "B", "bundle": "tiny-labels"}, headers=ADMIN, timeout=60
    )
    assert loaded.status_code == 200, loaded.text
    both = httpx.post(f"{primary.url}/admin/compare", json=body, headers=ADMIN, timeout=60).json()
    a, b = both["sides"]["A"], both["sides"]["B"]
    # an RAE memory against a labels index: ranks compare, scores do not
    assert not both["scores"]["comparable"] and all(row["score_delta"] is None for row in both["agreement"])
    assert a["bundle_id"] != b["bundle_id"] == loaded.json()["bundle_id"]
    assert a["latency_ms"] > 0 and b["latency_ms"] > 0
    for i in range(2):
        a_uids = [label["uid"] for label in a["results"][i]]
        b_uids = [label["uid"] for label in b["results"][i]]
        shared = set(a_uids) & set(b_uids)
        assert [label["shared"] for label in a["results"][i]] == [uid in shared for uid in a_uids]
        assert both["agreement"][i]["overlap"] == len(shared) / 5
        assert all(label["text"] for label in a["results"][i] + b["results"][i])
    top = a["results"][0][0]["uid"]
    excluded = httpx.post(f"{primary.url}/admin/compare", json={**body, "exclude": [top]}, headers=ADMIN, timeout=60)
    for side in excluded.json()["sides"].values():
        assert all(top not in [label["uid"] for label in labels] for labels in side["results"])
    refused = httpx.post(f"{primary.url}/admin/compare", json={**body, "k": 0}, headers=ADMIN, timeout=60)
    assert refused.status_code == 422
    httpx.post(f"{primary.url}/admin/reload", json={"variant": "B", "bundle": "tiny-rae"}, headers=ADMIN, timeout=60)


def test_manifests_put_the_bundles_side_by_side_with_their_stored_quality(servers, evaluation):
    primary, shadow = servers
    data = httpx.get(f"{primary.url}/admin/manifests", headers=ADMIN, timeout=30).json()
    a, remote = data["variants"]["A"], data["variants"]["shadow"]
    assert a["bundle_id"] == httpx.get(f"{primary.url}/readyz").json()["bundle_id"] == evaluation["bundle_id"]
    (stored,) = a["evaluations"]
    assert (stored["split"], stored["stale"], stored["date"]) == ("dev", False, evaluation["evaluated_at"])
    assert stored["metrics"]["P@1"] == evaluation["metrics"]["P@1"]
    assert remote["bundle_id"] == httpx.get(f"{shadow.url}/readyz").json()["bundle_id"]
    assert remote["evaluations"] is None  # beside the shadow's bundle, on its machine
    against = data["against_a"]["shadow"]
    rows = {row["field"]: row for row in against["rows"]}
    assert rows["index_kind"] == {"field": "index_kind", "a": "rae_memory", "b": "labels", "differs": True}
    assert not rows["dim"]["differs"]
    assert not against["scores_comparable"] and "cosine" in against["why"]
    loaded = httpx.post(
        f"{primary.url}/admin/reload", json={"variant": "B", "bundle": "tiny-rae"}, headers=ADMIN, timeout=60
    )
    assert loaded.status_code == 200, loaded.text
    data = httpx.get(f"{primary.url}/admin/manifests", headers=ADMIN, timeout=30).json()
    same = data["against_a"]["B"]
    assert data["variants"]["B"]["bundle_id"] == a["bundle_id"] and same["scores_comparable"]
    assert not [row for row in same["rows"] if row["differs"]]
    assert [link["url"] for link in data["dashboards"]] == [
        f"{GRAFANA}/d/xmcserve/xmcserve",
        f"{GRAFANA}/d/xmcserve-ray/xmcserve-ray",
    ]


def test_live_traffic_per_variant_from_the_servers_counters(servers):
    primary, _ = servers
    before = httpx.get(f"{primary.url}/admin/live", params={"window_s": 3600}, headers=ADMIN).json()
    answered_before = before["variants"].get("A", {}).get("requests", 0)
    with httpx.Client(base_url=primary.url, timeout=30) as client:
        for i in range(5):
            assert client.post("/predict", json={"text": f"lib{i}: live", "k": 3}).status_code == 200
        assert client.post("/predict", json={"text": "x", "k": 0}).status_code == 422  # before a variant: not A's
    live = httpx.get(f"{primary.url}/admin/live", params={"window_s": 3600}, headers=ADMIN).json()
    a = live["variants"]["A"]
    assert a["requests"] - answered_before == 5 and a["failed"] == 0 and a["failed_share"] == 0
    assert a["qps"] > 0 and 0 < a["p50_ms"] <= a["p99_ms"]
    assert live["split_b"] == 0.0 and live["interval_s"] == 5.0


def test_agreement_keeps_the_recent_comparisons_and_the_worst_texts(servers):
    primary, _ = servers
    compared = mirrored_traffic(primary, 6)
    data = httpx.get(f"{primary.url}/admin/agreement", params={"worst": 3}, headers=ADMIN).json()
    assert len(data["compared"]) == compared and data["capacity"] == 2048
    assert all(0.0 <= row[1] <= 1.0 for row in data["compared"])
    overlaps = sorted(row[1] for row in data["compared"])
    assert [w["overlap"] for w in data["worst"]] == overlaps[:3]
    bundles = httpx.get(f"{primary.url}/admin/bundles", headers=ADMIN).json()["bundles"]
    assert {b["name"] for b in bundles} == {"tiny-rae", "tiny-labels", "corrupt"}


# ---------------------------------------------------------------- the page in a real browser


def test_an_operator_compares_watches_and_promotes_in_the_browser(servers, evaluation, browser, tmp_path):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    primary, _ = servers
    shots = tmp_path
    # the page redraws its plots and list every 5 s: an element found just before a redraw is retried
    wait = WebDriverWait(browser, 30, ignored_exceptions=[StaleElementReferenceException])
    find = browser.find_element
    a_id = httpx.get(f"{primary.url}/readyz").json()["bundle_id"]
    httpx.post(f"{primary.url}/admin/config", json={"split_b": 0.0}, headers=ADMIN)
    mirrored_traffic(primary, 12)  # points for the plots

    # the token gate: nothing but the gate until the right token is entered
    browser.get(f"{primary.url}/rollout")
    assert find(By.ID, "gate").is_displayed() and not find(By.ID, "main").is_displayed()
    assert a_id not in browser.page_source
    find(By.ID, "token").send_keys("wrong-token")
    find(By.ID, "unlock").click()
    wait.until(lambda d: "403: admin token rejected" in find(By.ID, "gate-error").text)
    assert not find(By.ID, "main").is_displayed()
    find(By.ID, "token").send_keys(TOKEN)
    find(By.ID, "unlock").click()
    wait.until(lambda d: find(By.ID, "main").is_displayed() and find(By.ID, "a-bundle").text == a_id)

    # reload B through the page: a corrupt bundle is refused in words, then a good one loads. The
    # bundle list is a fetch of its own, after the page unlocks: on a loaded machine it came later
    def choose_bundle(name: str) -> None:
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, f'#bundle option[value="{name}"]'))
        Select(find(By.ID, "bundle")).select_by_value(name)

    choose_bundle("corrupt")
    find(By.ID, "reload-b").click()
    wait.until(lambda d: "checksum mismatch" in find(By.ID, "action-result").text)
    choose_bundle("tiny-labels")
    find(By.ID, "reload-b").click()
    wait.until(lambda d: find(By.ID, "action-result").text.startswith("B now serves"))
    b_id = httpx.get(f"{primary.url}/admin/state", headers=ADMIN).json()["variants"]["B"]["bundle_id"]
    wait.until(lambda d: find(By.ID, "b-bundle").text == b_id)

    # the two manifests side by side, differences marked; scores not compared across kinds
    def differing_fields(driver) -> list[str]:
        rows = driver.find_elements(By.CSS_SELECTOR, "#manifest-table tr.differs td:first-child")
        return [row.text.lstrip("≠ ") for row in rows]

    wait.until(lambda d: "index_kind" in differing_fields(d) and b_id in find(By.ID, "manifest-table").text)
    assert "dim" not in wait.until(differing_fields)  # differences only, by default
    find(By.ID, "only-differences").click()
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#manifest-table tr.same"))
    find(By.ID, "only-differences").click()
    assert "Score deltas not shown" in find(By.ID, "scores-note").text and "cosine" in find(By.ID, "scores-note").text
    # the offline quality stored beside A's bundle, with its split and date
    quality = find(By.ID, "quality-table").text
    assert f"{evaluation['metrics']['P@1']:.2f}" in quality and " dev " in f" {quality} "
    assert evaluation["evaluated_at"][:10] in quality and "make evaluate BUNDLE=" in quality  # B has none
    # live traffic per variant from the server's counters, and the dashboards' links
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#live-charts svg")) == 3)
    # read through the wait: the live table is redrawn every 5 s, and a row found just before a
    # redraw is stale by the time its text is read
    live_a = wait.until(lambda d: find(By.CSS_SELECTOR, "#live-table tr:nth-child(2)").text.split())
    assert live_a[0] == "A" and int(live_a[1]) >= 12
    link = find(By.CSS_SELECTOR, "#dashboards a")
    assert link.get_attribute("href") == f"{GRAFANA}/d/xmcserve/xmcserve"

    # a side-by-side query: two texts, both sides' labels, the shared ones marked, the same agreement as the API
    texts = find(By.ID, "texts")
    texts.clear()
    texts.send_keys("\n".join(TEXTS))
    k = find(By.ID, "k")
    k.clear()
    k.send_keys("5")
    find(By.ID, "run-compare").click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#compare-result .query")) == 2)
    expected = httpx.post(f"{primary.url}/admin/compare", json={"texts": TEXTS, "k": 5}, headers=ADMIN).json()
    for i, query in enumerate(browser.find_elements(By.CSS_SELECTOR, "#compare-result .query")):
        assert query.find_element(By.TAG_NAME, "h3").text == TEXTS[i]
        shown = query.find_element(By.CLASS_NAME, "agreement").text
        assert f"overlap@5 {expected['agreement'][i]['overlap']:.2f}" in shown and "score" not in shown
        for side in ("A", "B"):
            column = query.find_element(By.CSS_SELECTOR, f".side-{side}")
            assert expected["sides"][side]["bundle_id"] in column.text and " ms" in column.text
            rows = column.find_elements(By.CSS_SELECTOR, "tr.shared, tr.only")
            labels = expected["sides"][side]["results"][i]
            assert [r.get_attribute("class") for r in rows] == ["shared" if x["shared"] else "only" for x in labels]
            assert [r.find_elements(By.TAG_NAME, "td")[1].text.lstrip("●○ ") for r in rows] == [
                x["text"] for x in labels
            ]
    assert browser.find_elements(By.CSS_SELECTOR, "#compare-result tr.shared")  # tiny-rae and tiny-labels share some
    assert "Score deltas not shown" in find(By.ID, "compare-scores").text
    find(By.ID, "compare-panel").screenshot(str(shots / "rollout-compare.png"))

    # agreement over time: points on the plots; a worst text opens in the query box
    Select(find(By.ID, "window")).select_by_value("60")
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#charts svg:first-child circle")) >= 12)
    titles = [t.text for t in browser.find_elements(By.CSS_SELECTOR, "#charts svg .title")]
    assert not [t for t in titles if "score" in t] and "not plotted" in find(By.ID, "agreement-scores").text

    def open_worst(driver) -> str | None:
        listed = driver.find_elements(By.CSS_SELECTOR, "#worst li button")
        if not listed:
            return None
        text = listed[0].text
        listed[0].click()
        return text

    first_text = wait.until(open_worst)
    headings = "#compare-result .query h3"
    wait.until(lambda d: [h.text for h in d.find_elements(By.CSS_SELECTOR, headings)] == [first_text])
    assert find(By.ID, "texts").get_attribute("value") == first_text
    find(By.ID, "agreement-panel").screenshot(str(shots / "rollout-agreement.png"))

    # a split change
    split = find(By.ID, "split")
    split.clear()
    split.send_keys("0.3")
    find(By.ID, "apply-config").click()
    wait.until(lambda d: "split to B 0.3" in find(By.ID, "config-result").text)
    assert httpx.get(f"{primary.url}/admin/state", headers=ADMIN).json()["split_b"] == 0.3

    # promote, after a confirmation naming both bundles
    browser.execute_script("window.scrollTo(0, 0)")
    find(By.ID, "promote").click()
    wait.until(lambda d: find(By.ID, "promote-dialog").is_displayed())
    question = find(By.ID, "promote-text").text
    assert a_id in question and b_id in question
    browser.save_screenshot(str(shots / "rollout-promote.png"))
    find(By.ID, "promote-confirm").click()
    wait.until(lambda d: find(By.ID, "action-result").text.startswith(f"promoted: A now serves {b_id}"))
    assert httpx.get(f"{primary.url}/readyz").json()["bundle_id"] == b_id
    wait.until(lambda d: find(By.ID, "a-bundle").text == b_id and find(By.ID, "b-bundle").text == "no bundle loaded")
    assert find(By.ID, "promote").get_attribute("disabled")
    # and back: a rollback, after the same kind of confirmation naming both bundles
    find(By.ID, "rollback").click()
    wait.until(lambda d: find(By.ID, "rollback-dialog").is_displayed())
    question = find(By.ID, "rollback-text").text
    assert a_id in question and b_id in question
    find(By.ID, "rollback-confirm").click()
    wait.until(lambda d: find(By.ID, "action-result").text.startswith(f"rolled back: A now serves {a_id}"))
    assert httpx.get(f"{primary.url}/readyz").json()["bundle_id"] == a_id
    assert all((shots / f"rollout-{name}.png").stat().st_size > 0 for name in ("compare", "agreement", "promote"))
    # no script error, no blocked request; the refusals above (403, 422) are the only failed loads
    console = [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert console and all("Failed to load resource" in message for message in console), console
