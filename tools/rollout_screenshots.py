"""The rollout page's screenshots in docs/, taken on real bundles in headless Chromium at a laptop's
window size (1366x768): A serves ``--bundle`` (the default bundle), B and the shadow serve
``--alt-bundle`` (e.g. the labels kind), B answers ``--split`` of the traffic, and a client sends
the sample's dev texts for ``--seconds`` before the page is opened, so its live and agreement
plots show minutes of a real split. Evaluations stored beside the bundles (``make evaluate``)
appear in the page's quality table.

    python -m tools.rollout_screenshots --bundle bundles/default --alt-bundle bundles/minilm-labels
"""

from __future__ import annotations

import argparse
import gzip
import json
import tempfile
import time
from pathlib import Path

import httpx

from loadtest.localserver import start_server, stop_server
from tests.support.browser import LAPTOP, headless_chromium

TOKEN = "screenshots"
ADMIN = {"X-Admin-Token": TOKEN}
# Where a compose stack's Grafana listens (deploy/README.md): the page links its dashboards.
GRAFANA = "http://127.0.0.1:3000"


def dev_texts(data: Path, count: int) -> list[str]:
    with gzip.open(data / "dev.json.gz", "rt") as lines:
        return [json.loads(line)["title"] for line, _ in zip(lines, range(count), strict=False)]


def traffic(url: str, texts: list[str], seconds: float, rate: float) -> int:
    """One client sending ``texts`` round-robin at about ``rate`` requests a second."""
    sent, deadline = 0, time.monotonic() + seconds
    with httpx.Client(base_url=url, timeout=30) as client:
        while time.monotonic() < deadline:
            started = time.monotonic()
            client.post("/predict", json={"text": texts[sent % len(texts)], "k": 10})
            sent += 1
            time.sleep(max(0.0, 1 / rate - (time.monotonic() - started)))
    return sent


def shoot(url: str, out: Path, compare_texts: list[str], profile: Path) -> list[Path]:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    driver = headless_chromium(profile, LAPTOP)
    wait = WebDriverWait(driver, 60, ignored_exceptions=[StaleElementReferenceException])
    find = driver.find_element
    written = []

    def element(name: str, element_id: str) -> None:
        node = find(By.ID, element_id)
        driver.execute_script("arguments[0].scrollIntoView({block: 'start'})", node)
        time.sleep(0.3)
        node.screenshot(str(out / name))
        written.append(out / name)

    try:
        driver.get(f"{url}/rollout")
        find(By.ID, "token").send_keys(TOKEN)
        find(By.ID, "unlock").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#manifest-table tr.differs"))
        Select(find(By.ID, "live-window")).select_by_value("300")
        Select(find(By.ID, "window")).select_by_value("300")
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#live-charts svg polyline")) >= 2)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#charts svg circle"))
        driver.execute_script("window.scrollTo(0, 0)")
        time.sleep(1)
        driver.save_screenshot(str(out / "rollout-page.png"))  # what a laptop shows on unlocking
        written.append(out / "rollout-page.png")
        element("rollout-bundles.png", "bundles-panel")
        element("rollout-live.png", "live-panel")
        texts = find(By.ID, "texts")
        texts.clear()
        texts.send_keys("\n".join(compare_texts))
        find(By.ID, "k").clear()
        find(By.ID, "k").send_keys("5")
        find(By.ID, "run-compare").click()
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#compare-result .query")) == len(compare_texts))
        element("rollout-compare.png", "compare-panel")
        element("rollout-agreement.png", "agreement-panel")
        driver.execute_script("window.scrollTo(0, 0)")
        find(By.ID, "promote").click()
        wait.until(lambda d: find(By.ID, "promote-dialog").is_displayed())
        time.sleep(0.3)
        driver.save_screenshot(str(out / "rollout-promote.png"))
        written.append(out / "rollout-promote.png")
        find(By.ID, "promote-cancel").click()
    finally:
        driver.quit()
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, default=Path("bundles/default"), help="A's bundle (the primary)")
    parser.add_argument("--alt-bundle", type=Path, required=True, help="B's and the shadow's bundle")
    parser.add_argument("--data", type=Path, default=Path("data/debian-sample"), help="where the dev texts come from")
    parser.add_argument("--split", type=float, default=0.3, help="share of the traffic B answers")
    parser.add_argument("--seconds", type=float, default=150, help="how long the client sends before the shots")
    parser.add_argument("--rate", type=float, default=4.0, help="requests a second the client sends")
    parser.add_argument("--out", type=Path, default=Path("docs"), help="where the PNGs are written")
    args = parser.parse_args(argv)
    alt = args.alt_bundle.resolve()
    work = Path(tempfile.mkdtemp(prefix="rollout-screenshots-"))
    shadow = start_server(alt, work / "shadow.log", {"XMCSERVE_APPEND_LOG_DIR": str(work / "shadow-appends")})
    env = {
        "XMCSERVE_BUNDLE_ROOT": str(alt.parent),
        "XMCSERVE_ADMIN_TOKEN": TOKEN,
        "XMCSERVE_SHADOW_URL": shadow.url,
        "XMCSERVE_SHADOW_FRACTION": "1.0",
        "XMCSERVE_GRAFANA_URL": GRAFANA,
        "XMCSERVE_APPEND_LOG_DIR": str(work / "appends"),
    }
    try:
        primary = start_server(args.bundle.resolve(), work / "primary.log", env)
        try:
            with httpx.Client(base_url=primary.url, headers=ADMIN, timeout=120) as admin:
                admin.post("/admin/reload", json={"variant": "B", "bundle": alt.name}).raise_for_status()
                admin.post("/admin/config", json={"split_b": args.split}).raise_for_status()
            texts = dev_texts(args.data, 400)
            sent = traffic(primary.url, texts, args.seconds, args.rate)
            print(f"{sent} requests in {args.seconds:.0f} s, split to B {args.split}")
            args.out.mkdir(parents=True, exist_ok=True)
            for path in shoot(primary.url, args.out, texts[:2], work / "chromium-profile"):
                print(f"wrote {path}")
        finally:
            stop_server(primary)
    finally:
        stop_server(shadow)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
