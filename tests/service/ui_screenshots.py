"""The README's screenshots of the page, taken against a running server with the default models.

    make serve                      # in another terminal: ende-small and SmolLM2-135M-Instruct
    make screenshots                # python -m tests.service.ui_screenshots --out docs

Headless Chromium (tests/service/browser.py) opens the three views, translates a two-paragraph
text, asks the language model a question (greedy, so the answer is the same each time) and waits
for the server view's live figures; each view is saved as docs/ui-<view>.png. What the models
write is theirs: nothing is picked or edited.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tests.service.browser import chrome, console_errors, missing, save_png, wait_until

TRANSLATE = (
    "The Lord is my shepherd; I shall not want. He maketh me to lie down in green pastures.\n\n"
    "And God said, Let there be light: and there was light."
)
TARGET = "de"
QUESTION = "How do I make a cup of tea?"
TIMEOUT = 300.0  # seconds: a first request on a cold server, on two cores


def _by_id(driver: Any, element_id: str) -> Any:
    return driver.find_element("id", element_id)


def _text(driver: Any, element_id: str) -> str:
    return str(_by_id(driver, element_id).get_attribute("textContent"))


def _open(driver: Any, url: str, view: str) -> None:
    driver.get("about:blank")
    driver.get(f"{url}/#{view}")
    wait_until(lambda: _by_id(driver, f"view-{view}").is_displayed(), TIMEOUT, f"the {view} view")


def _type(driver: Any, element_id: str, text: str) -> None:
    box = _by_id(driver, element_id)
    box.clear()
    box.send_keys(text)


def _save(driver: Any, out: Path, view: str) -> None:
    driver.execute_script("window.scrollTo(0, 0); document.activeElement?.blur()")
    print(save_png(driver, out / f"ui-{view}.png"))


def translate_view(driver: Any, url: str, out: Path) -> None:
    from selenium.webdriver.support.ui import Select

    _open(driver, url, "translate")
    wait_until(
        lambda: driver.execute_script("return document.getElementById('target-lang').length"),
        TIMEOUT,
        "the languages",
    )
    Select(_by_id(driver, "target-lang")).select_by_value(TARGET)
    _type(driver, "source-text", TRANSLATE)
    wait_until(lambda: _text(driver, "detected"), TIMEOUT, "the detected language")
    _by_id(driver, "translate").click()
    wait_until(
        lambda: (
            _by_id(driver, "translate").is_enabled() and "tokens" in _text(driver, "translate-info")
        ),
        TIMEOUT,
        "the translation",
    )
    _save(driver, out, "translate")


def chat_view(driver: Any, url: str, out: Path) -> None:
    _open(driver, url, "chat")
    wait_until(lambda: _by_id(driver, "chat-model").get_attribute("value"), TIMEOUT, "a model")
    _type(driver, "chat-temperature", "0")
    _type(driver, "chat-max-tokens", "200")
    _type(driver, "chat-input", QUESTION + "\n")
    wait_until(lambda: "tokens" in _text(driver, "chat-log"), TIMEOUT, "the answer")
    _save(driver, out, "chat")


def server_view(driver: Any, url: str, out: Path) -> None:
    _open(driver, url, "server")
    wait_until(lambda: _text(driver, "fig-tokens") != "–", TIMEOUT, "the tokens per second")
    wait_until(lambda: _text(driver, "fig-ttft").endswith("ms"), TIMEOUT, "the TTFT")
    _save(driver, out, "server")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the running server")
    parser.add_argument("--out", type=Path, default=Path("docs"), help="folder for ui-*.png")
    args = parser.parse_args(argv)
    reason = missing()
    if reason is not None:
        print(f"cannot take screenshots: {reason}", file=sys.stderr)
        return 2
    driver = chrome()
    try:
        for view in (translate_view, chat_view, server_view):
            view(driver, args.url.rstrip("/"), args.out)
        errors = console_errors(driver)
    finally:
        driver.quit()
    for error in errors:
        print(f"browser console: {error}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
