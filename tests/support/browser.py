"""Headless Chromium driven by Selenium: Debian's ``chromium`` and ``chromium-driver`` (no driver
or browser download), for the browser tests and the rollout page's screenshots in docs/."""

from __future__ import annotations

from pathlib import Path

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
# The size of a laptop's browser window: what the docs' screenshots show.
LAPTOP = (1366, 768)


def installed() -> bool:
    return CHROMIUM.exists() and CHROMEDRIVER.exists()


def headless_chromium(profile_dir: Path, window: tuple[int, int] = LAPTOP):
    """A WebDriver on a fresh profile in ``profile_dir``, the page's console kept for
    ``get_log("browser")``."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    # Chromium's switches, not options of a CLI of ours (which tests/test_cli_help.py holds to help=);
    # no background, update or sync traffic: the closed network would only refuse it
    add_switch = options.add_argument
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--window-size={window[0]},{window[1]}",
        f"--user-data-dir={profile_dir}",
    ):
        add_switch(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(30)
    return driver
