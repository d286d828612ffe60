"""The headless browser the page tests share (the rollout page, the API docs)."""

import importlib.util

import pytest

from tests.conftest import need_tool
from tests.support.browser import headless_chromium, installed


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    need_tool(installed(), "browser test skipped: Debian's chromium and chromium-driver are not installed")
    need_tool(importlib.util.find_spec("selenium") is not None, "browser test skipped: selenium is not installed")
    driver = headless_chromium(tmp_path_factory.mktemp("chromium-profile"), window=(1280, 1400))
    yield driver
    driver.quit()
