"""/docs and /redoc from the server's own assets: the pages name nothing outside it, and in headless
Chromium (on a machine with no internet, as CI's) both render the /predict operation."""

import re

import httpx
import pytest
from fastapi.testclient import TestClient

from loadtest.localserver import start_server, stop_server
from service.http.app import create_app
from service.http.settings import Settings


@pytest.fixture(scope="module")
def server(tiny_rae_bundle, tmp_path_factory):
    running = start_server(tiny_rae_bundle, tmp_path_factory.mktemp("docs-logs") / "server.log")
    yield running
    stop_server(running)


def test_the_pages_and_their_assets_come_from_the_server(tmp_path):
    client = TestClient(create_app(Settings(bundle_dir=tmp_path)))  # no lifespan: the docs need no bundle
    for path in ("/docs", "/redoc"):
        page = client.get(path)
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert not re.search(r"(https?:)?//", page.text), page.text  # no CDN, no fonts, no favicon elsewhere
        for asset in re.findall(r'(?:src|href)="([^"]+)"', page.text):
            assert client.get(asset).status_code == 200, asset
    assert "/docs" not in client.get("/openapi.json").json()["paths"]


def loaded_elsewhere(browser, origin: str) -> list[str]:
    """What the page fetched, or tried to, from anywhere but the server, less what its CSP refused
    (the console says so, and the browser sent nothing)."""
    console = [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    refused = {m.split("'")[1] for m in console if "violates the following Content Security Policy" in m}
    assert len(refused) == len(console), console  # no other error
    names = browser.execute_script("return performance.getEntriesByType('resource').map((e) => e.name)")
    return [name for name in names if not name.startswith(origin) and name not in refused]


def test_swagger_ui_renders_the_predict_operation(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{server.url}/docs")
    paths = WebDriverWait(browser, 30).until(
        lambda d: [e.text for e in d.find_elements(By.CSS_SELECTOR, ".opblock-summary-path")] or None
    )
    assert "/predict" in paths
    predict = browser.find_element(By.CSS_SELECTOR, ".opblock-post .opblock-summary-path[data-path='/predict']")
    assert predict.is_displayed()
    assert loaded_elsewhere(browser, server.url) == []


def test_redoc_renders_the_predict_operation(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(f"{server.url}/redoc")
    section = WebDriverWait(browser, 30).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, "[data-section-id^='operation/predict']") or None
    )[0]
    assert "/predict" in section.get_attribute("textContent")
    assert loaded_elsewhere(browser, server.url) == []  # its vendor's logo is refused by the page's CSP
    assert httpx.get(f"{server.url}/readyz").status_code == 200
