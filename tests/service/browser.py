"""Headless Chromium through Selenium for the page's tests (tests/service/test_ui_browser.py).

Debian's `chromium` and `chromium-driver` (`make test` installs them when it runs as root) and
the `selenium` package (the test extra). Without them the tests skip, saying what is missing.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
WINDOW = (1000, 720)  # CSS pixels: the screenshots' size
NETWORK_ERROR = re.compile(r"Failed to load resource: the server responded with a status of (\d+)")


def _binary() -> str | None:
    return next((found for name in BROWSERS if (found := shutil.which(name))), None)


def missing() -> str | None:
    """Why the browser tests cannot run here (None: they can)."""
    if importlib.util.find_spec("selenium") is None:
        return "selenium is not installed (pip install -e '.[test]')"
    if _binary() is None or shutil.which("chromedriver") is None:
        return (
            "no chromium / chromedriver: apt-get install chromium chromium-driver "
            "(`make test` does it when run as root)"
        )
    return None


def chrome(window: tuple[int, int] = WINDOW) -> Any:
    """A headless Chromium session that keeps the browser's console log; skips without one."""
    reason = missing()
    if reason is not None:
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = _binary(), shutil.which("chromedriver")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in (
        "--headless=new",
        "--no-sandbox",  # root in a container
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--disable-extensions",
        "--no-first-run",
        "--hide-scrollbars",
        f"--window-size={window[0]},{window[1]}",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver: Selenium Manager would otherwise look for one on the network.
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    # --window-size is the window's, with the (headless) browser's frame: size the viewport.
    width, height = driver.execute_script("return [window.innerWidth, window.innerHeight]")
    driver.set_window_size(2 * window[0] - width, 2 * window[1] - height)
    return driver


def console_errors(driver: Any, allowed_statuses: frozenset[int] = frozenset()) -> list[str]:
    """The browser console's errors since the last call, less the failed requests whose HTTP
    status a test provoked on purpose (Chromium logs every 4xx / 5xx answer to fetch())."""
    errors = []
    for entry in driver.get_log("browser"):
        if entry["level"] != "SEVERE":
            continue
        network = NETWORK_ERROR.search(entry["message"])
        if network and int(network.group(1)) in allowed_statuses:
            continue
        errors.append(entry["message"])
    return errors


def wait_until(condition: Callable[[], Any], timeout: float = 15.0, what: str = "") -> Any:
    """Poll `condition` until it returns something truthy (returned), else fail."""
    end = time.monotonic() + timeout
    while True:
        try:
            value = condition()
        except Exception:  # an element replaced while read: try again
            value = None
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what or condition}")
        time.sleep(0.05)


def save_png(driver: Any, path: Path, colors: int = 128) -> Path:
    """A screenshot of the viewport as a palette PNG (a few dozen kB instead of hundreds)."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(path))
    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)
    return path
