"""The page at / in a real browser (headless Chromium, Selenium) against a real uvicorn server.

One browser for the module. The server serves two translation models (the tiny Marian model,
en -> de/nl, and a copy that translates between de and nl, as ende-small does between its
languages) and the tiny language model, slowed down so that a chat can be stopped mid-answer.
The tiny models are random: their output is gibberish, but it is there, paragraph by paragraph.
Screenshots of the three views go to the test's temporary folder, and to the folder named by
ATTNSERVE_UI_SCREENSHOTS when it is set (`ATTNSERVE_UI_SCREENSHOTS=docs` renews the README's).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.service.browser import chrome, console_errors, missing, save_png, wait_until
from tests.service.helpers import (
    LiveServer,
    make_settings,
    metric_value,
    slow_factory,
    wait_for_metric,
)

MISSING = missing()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(MISSING is not None, reason=MISSING or "")]
if MISSING is None:
    from selenium.webdriver.common.keys import Keys

LM_STEP_DELAY = 0.05  # seconds a step of the language model: a 100-token answer takes 5 s
KEY = "s3cret-key"
ENGLISH = "The Lord is my shepherd. I shall not want.\n\nHe leadeth me beside the still waters."
GERMAN = "Der Herr ist mein Hirte. Ich will nicht."


@pytest.fixture(scope="module")
def multi_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model without a declared source language: it translates between its target
    languages (de, nl), as ende-small does between de and en."""
    out = tmp_path_factory.mktemp("ui") / "tiny-multi"
    shutil.copytree(model_dir, out)
    config = json.loads((out / "tokenizer.json").read_text())
    config["source_lang"] = None
    (out / "tokenizer.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def server(model_dir: Path, multi_dir: Path, lm_model: Path) -> Iterator[LiveServer]:
    models = [str(model_dir), str(multi_dir), str(lm_model)]
    settings = make_settings(model_dir, models=models, variant="int8")
    factory = slow_factory(LM_STEP_DELAY, only=lm_model.name)
    with LiveServer(settings, backend_factory=factory) as live:
        yield live


@pytest.fixture(scope="module")
def keyed(model_dir: Path) -> Iterator[LiveServer]:
    """An API key, and room for one running and one waiting request (a 429 is easy)."""
    settings = make_settings(
        model_dir, variant="int8", api_key=KEY, max_batch_rows=1, max_waiting=1
    )
    with LiveServer(settings, backend_factory=slow_factory(0.05)) as live:
        yield live


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    driver = chrome()
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ui-screenshots")


def screenshot(driver: Any, shots: Path, name: str) -> None:
    driver.execute_script("document.activeElement?.blur()")  # no focus ring in the picture
    path = save_png(driver, shots / f"ui-{name}.png")
    target = os.environ.get("ATTNSERVE_UI_SCREENSHOTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(target) / path.name)


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """The browser; after the test, its console must hold no errors (but the HTTP statuses
    the test put in `browser.allowed_statuses`)."""
    browser.allowed_statuses = frozenset()
    console_errors(browser)  # drop what earlier tests left
    yield browser
    assert console_errors(browser, browser.allowed_statuses) == []


def by_id(driver: Any, element_id: str) -> Any:
    return driver.find_element("id", element_id)


def text_of(driver: Any, element_id: str) -> str:
    return str(by_id(driver, element_id).get_attribute("textContent"))


def open_view(driver: Any, server: LiveServer, view: str) -> None:
    driver.get("about:blank")  # a new page: the same URL again would only change its #view
    driver.get(f"{server.url}/#{view}")
    wait_until(lambda: by_id(driver, f"view-{view}").is_displayed(), what=f"the {view} view")


def wait_loaded(driver: Any) -> None:
    """/v1/server answered: the target languages are filled in."""
    wait_until(
        lambda: driver.execute_script("return document.getElementById('target-lang').length"),
        what="the languages",
    )


def select(driver: Any, element_id: str, value: str) -> None:
    from selenium.webdriver.support.ui import Select

    Select(by_id(driver, element_id)).select_by_value(value)


def type_into(driver: Any, element_id: str, text: str) -> None:
    box = by_id(driver, element_id)
    box.clear()
    box.send_keys(text)


def translated(driver: Any) -> str:
    wait_until(
        lambda: (
            by_id(driver, "translate").is_enabled()
            and "tokens" in text_of(driver, "translate-info")
        ),
        what="the translation",
    )
    return text_of(driver, "target-text")


def test_translate_streams_each_paragraph(page: Any, server: LiveServer, shots: Path) -> None:
    open_view(page, server, "translate")
    wait_loaded(page)
    assert by_id(page, "translate-model-field").is_displayed()  # two translation models
    type_into(page, "source-text", ENGLISH)
    assert text_of(page, "char-count").startswith(f"{len(ENGLISH)} / ")
    wait_until(lambda: "English" in text_of(page, "detected"), what="the detected language")
    by_id(page, "translate").click()
    wait_until(
        lambda: (
            by_id(page, "translate-stop").is_displayed() or by_id(page, "translate").is_enabled()
        )
    )
    output = translated(page)
    paragraphs = output.split("\n\n")
    assert len(paragraphs) == 2 and all(p.strip() for p in paragraphs), output
    assert by_id(page, "copy").is_enabled()
    assert by_id(page, "translate-error").is_displayed() is False
    screenshot(page, shots, "translate")
    # Copy: the translation, as shown, on the clipboard
    page.execute_cdp_cmd(
        "Browser.grantPermissions",
        {"origin": server.url, "permissions": ["clipboardReadWrite", "clipboardSanitizedWrite"]},
    )
    by_id(page, "copy").click()
    wait_until(lambda: text_of(page, "copy") == "Copied", what="the copy button's answer")
    pasted = page.execute_async_script(
        "const done = arguments[0]; navigator.clipboard.readText().then(done, e => done(String(e)))"
    )
    assert pasted == output
    wait_until(lambda: text_of(page, "copy") == "Copy", what="the button back to Copy")


def test_auto_detect_and_swap(page: Any, server: LiveServer) -> None:
    open_view(page, server, "translate")
    wait_loaded(page)
    type_into(page, "source-text", GERMAN)
    wait_until(lambda: "German" in text_of(page, "detected"), what="German detected")
    select(page, "target-lang", "nl")
    by_id(page, "source-text").send_keys(Keys.CONTROL, Keys.ENTER)  # the keyboard's Translate
    output = translated(page)
    assert output.strip() and "tiny-multi" in text_of(page, "translate-info")
    by_id(page, "swap").click()
    source, target = by_id(page, "source-lang"), by_id(page, "target-lang")
    assert (source.get_attribute("value"), target.get_attribute("value")) == ("nl", "de")
    assert by_id(page, "source-text").get_attribute("value") == output
    assert text_of(page, "target-text") == GERMAN


def test_alternatives_html_and_errors(page: Any, server: LiveServer) -> None:
    open_view(page, server, "translate")
    wait_loaded(page)
    select(page, "source-lang", "en")
    select(page, "target-lang", "de")
    type_into(page, "source-text", "The Lord is my shepherd.")
    by_id(page, "opt-alternatives").click()
    by_id(page, "translate").click()
    translated(page)
    wait_until(lambda: by_id(page, "alternatives").is_displayed(), what="the alternatives")
    assert page.find_elements("css selector", "#alternatives-list li")
    by_id(page, "opt-alternatives").click()
    by_id(page, "opt-html").click()
    type_into(page, "source-text", "<p>The Lord is my <b>shepherd</b>.</p>")
    by_id(page, "translate").click()
    output = translated(page)
    assert output.startswith("<p>") and output.endswith("</p>") and "<b>" in output
    # an invalid request: the API's own words
    page.allowed_statuses = frozenset({422})
    type_into(page, "source-text", "<div>The Lord is my shepherd.")
    by_id(page, "translate").click()
    error = wait_until(
        lambda: by_id(page, "translate-error").is_displayed() and text_of(page, "translate-error")
    )
    assert error == "text is not well-formed HTML: <div> is never closed"
    by_id(page, "opt-html").click()


def _running(server: LiveServer, model: str) -> float:
    return metric_value(server.metrics(), "attnserve_requests_running", model=model)


def test_chat_streams_and_stop_cancels(
    page: Any, server: LiveServer, lm_model: Path, shots: Path
) -> None:
    lm = lm_model.name
    open_view(page, server, "chat")
    wait_until(lambda: by_id(page, "chat-model").get_attribute("value") == lm, what="the model")
    type_into(page, "chat-temperature", "0")  # greedy: the tiny model answers to max tokens
    type_into(page, "chat-max-tokens", "100")
    before = server.metrics()
    type_into(page, "chat-input", "w1 w2 w3\n")  # Enter sends
    answer = "#chat-log .message.assistant .content"
    wait_until(
        lambda: page.find_element("css selector", answer).get_attribute("textContent"),
        what="a first token",
    )
    assert by_id(page, "chat-stop").is_displayed()
    assert _running(server, lm) == 1
    by_id(page, "chat-stop").click()
    wait_until(lambda: text_of(page, "chat-log").endswith("Stopped"), what="stopped")
    # the server saw the client go: the request left the batch, cancelled
    assert wait_for_metric(server, "attnserve_requests_running", 0, model=lm) == 0
    cancelled = "attnserve_decoding_requests_total"
    after = server.metrics()
    assert metric_value(after, cancelled, model=lm, outcome="cancelled") == (
        metric_value(before, cancelled, model=lm, outcome="cancelled") + 1
    )
    wait_until(lambda: server.service.lifecycle.in_flight == 0, what="no request in flight")
    streamed = page.find_element("css selector", answer).get_attribute("textContent")
    assert streamed.strip() and len(streamed.split()) < 100
    # a short answer streams to its end; Regenerate replaces it; Escape stops a stream too
    type_into(page, "chat-max-tokens", "5")
    by_id(page, "chat-regenerate").click()
    wait_until(lambda: "tokens" in text_of(page, "chat-log"), what="an answer's summary")
    assert len(page.find_elements("css selector", "#chat-log .message")) == 2
    screenshot(page, shots, "chat")
    type_into(page, "chat-max-tokens", "100")
    by_id(page, "chat-regenerate").click()
    wait_until(lambda: by_id(page, "chat-stop").is_displayed(), what="a stream")
    by_id(page, "chat-input").send_keys(Keys.ESCAPE)
    wait_until(lambda: text_of(page, "chat-log").endswith("Stopped"), what="stopped by Escape")
    assert wait_for_metric(server, "attnserve_requests_running", 0, model=lm) == 0
    by_id(page, "chat-clear").click()
    assert page.find_elements("css selector", "#chat-log .message") == []
    # JSON-schema mode: this model's word-level tokenizer cannot be constrained, and the page
    # says so in the API's words (a 400); the question stays for Regenerate
    page.allowed_statuses = frozenset({400})
    page.find_element("css selector", "details.settings summary").click()
    by_id(page, "chat-json").click()
    type_into(page, "chat-input", "w1\n")
    error = wait_until(
        lambda: by_id(page, "chat-error").is_displayed() and text_of(page, "chat-error")
    )
    assert error.startswith("response_format: the model's tokenizer cannot be constrained")
    assert len(page.find_elements("css selector", "#chat-log .message.user")) == 1
    assert by_id(page, "chat-regenerate").is_enabled()


def test_server_view_shows_the_models(page: Any, server: LiveServer, shots: Path) -> None:
    open_view(page, server, "translate")
    by_id(page, "tab-translate").send_keys(Keys.ARROW_RIGHT)  # tabs move with the arrow keys
    assert by_id(page, "view-chat").is_displayed() and page.current_url.endswith("#chat")
    page.switch_to.active_element.send_keys(Keys.END)
    assert by_id(page, "view-server").is_displayed()
    names = [Path(m).name for m in server.settings.models]
    rows = wait_until(
        lambda: [
            r.get_attribute("data-model")
            for r in page.find_elements("css selector", "#models-body tr")
        ],
        what="the models",
    )
    assert rows == names
    table = text_of(page, "models-body")
    assert "translation" in table and "language model" in table and "onnx int8" in table
    # two scrapes of /metrics: a rate needs both
    wait_until(lambda: text_of(page, "fig-tokens") != "–", what="the tokens per second")
    assert text_of(page, "fig-running") == "0"
    assert text_of(page, "models-body").count("0 / 0") == len(names)  # running / waiting
    assert text_of(page, "fig-ttft").endswith("ms")  # the earlier tests' requests
    screenshot(page, shots, "server")


def test_page_waits_for_the_models_to_load(page: Any, server: LiveServer) -> None:
    """Opened while the models load, the page says so and retries after Retry-After."""
    page.allowed_statuses = frozenset({503})
    lifecycle = server.service.lifecycle
    lifecycle.phase = "loading"
    try:
        page.get("about:blank")
        page.get(f"{server.url}/#translate")
        message = wait_until(
            lambda: by_id(page, "global-status").is_displayed() and text_of(page, "global-status"),
            what="the loading message",
        )
        assert message == "models are still loading: retrying in 1 s…"
        assert page.execute_script("return document.getElementById('target-lang').length") == 0
    finally:
        lifecycle.phase = "ready"
    wait_loaded(page)
    assert not by_id(page, "global-status").is_displayed()


def test_phone_width_and_dark_mode(page: Any, server: LiveServer) -> None:
    size = page.get_window_size()
    size = (size["width"], size["height"])
    page.set_window_size(390, 800)
    try:
        page.execute_cdp_cmd(
            "Emulation.setEmulatedMedia",
            {"features": [{"name": "prefers-color-scheme", "value": "dark"}]},
        )
        open_view(page, server, "translate")
        wait_loaded(page)
        overflow = page.execute_script(
            "return document.documentElement.scrollWidth - document.documentElement.clientWidth"
        )
        assert overflow <= 0
        source, target = by_id(page, "source-text"), by_id(page, "target-text")
        assert source.location["x"] == target.location["x"]  # one column
        assert target.location["y"] > source.location["y"]
        background = page.execute_script("return getComputedStyle(document.body).backgroundColor")
        assert background == "rgb(21, 23, 26)"
    finally:
        page.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})
        page.set_window_size(*size)


def test_api_key_is_asked_for(page: Any, keyed: LiveServer) -> None:
    page.allowed_statuses = frozenset({401, 403, 429})
    page.get(keyed.url)
    wait_until(lambda: by_id(page, "key-panel").is_displayed(), what="the key panel")
    assert "needs an API key" in text_of(page, "key-message")
    type_into(page, "key-input", "wrong\n")
    wait_until(lambda: "refused" in text_of(page, "key-message"), what="the key refused")
    type_into(page, "key-input", KEY + "\n")
    wait_loaded(page)
    assert not by_id(page, "key-panel").is_displayed()
    assert page.execute_script("return sessionStorage.getItem('attnserve-api-key')") == KEY
    select(page, "source-lang", "en")
    type_into(page, "source-text", "He leadeth me beside the still waters.")
    by_id(page, "translate").click()
    assert translated(page).strip()
    # the queue full (one running, one waiting): the page says so, with Retry-After
    body = {"text": "The Lord", "target_lang": "de", "min_new_tokens": 60, "max_new_tokens": 60}
    headers = {"Authorization": f"Bearer {KEY}"}

    def busy() -> None:
        httpx.post(f"{keyed.url}/v1/generate", json=body, headers=headers, timeout=30)

    # One after the other: started together, the second could arrive while the first still
    # waits (then the second is the one refused, and the page's request finds room).
    threads = [threading.Thread(target=busy) for _ in range(2)]
    model = keyed.service.registry.default.name
    threads[0].start()
    assert wait_for_metric(keyed, "attnserve_requests_running", 1, model=model) == 1
    threads[1].start()
    assert wait_for_metric(keyed, "attnserve_requests_waiting", 1, model=model) == 1
    by_id(page, "translate").click()
    error = wait_until(
        lambda: by_id(page, "translate-error").is_displayed() and text_of(page, "translate-error")
    )
    for thread in threads:
        thread.join()
    assert error.startswith("Busy, retry in 1 s (") and "capacity" in error


def try_out(page: Any, operation_id: str) -> str:
    """Swagger UI's Try it out and Execute on one operation: the status it shows."""
    operation = wait_until(
        lambda: page.find_element("css selector", f"#operations-default-{operation_id}"),
        what=operation_id,
    )
    operation.find_element("css selector", ".opblock-summary").click()
    wait_until(lambda: operation.find_element("css selector", ".try-out__btn"), what="Try").click()
    wait_until(lambda: operation.find_element("css selector", ".execute"), what="Run").click()
    cell = ".live-responses-table tbody .response-col_status"
    status = wait_until(
        lambda: operation.find_element("css selector", cell).text.strip(),
        what=f"{operation_id}'s answer",
    )
    return str(status)


def test_the_docs_page_runs_under_its_policy(page: Any, live: LiveServer, shots: Path) -> None:
    """Swagger UI from the app's own files, started by docs/init.js: under the page's
    Content-Security-Policy it renders the schema and runs requests (a POST passes the origin
    check: it is same-origin), with no console error (a blocked script or style would be one)."""
    page.get(live.url + "/docs")
    wait_until(
        lambda: "attnserve" in page.find_element("css selector", ".swagger-ui .info .title").text,
        what="the schema rendered",
    )
    for operation_id in ("healthz_healthz_get", "translate_v1_translate_post"):
        assert try_out(page, operation_id).startswith("200"), operation_id
    screenshot(page, shots, "docs")
