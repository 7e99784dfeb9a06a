"""Settings from the environment and flags, `attnserve serve` start-up checks, no torch."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from attnserve.cli import build_parser, main
from attnserve.service.launch import ServeError, check_models, settings_from_args
from attnserve.service.settings import Settings, is_loopback
from tests.service.helpers import LiveServer, make_settings


def test_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNSERVE_MODELS", "/m/first, /m/second")
    monkeypatch.setenv("ATTNSERVE_MAX_BATCH_ROWS", "3")
    monkeypatch.setenv("ATTNSERVE_CORS_ORIGINS", "https://a.example,https://b.example")
    monkeypatch.setenv("ATTNSERVE_API_KEY", "")
    monkeypatch.setenv("ATTNSERVE_LOG_JSON", "false")
    settings = Settings()
    assert settings.models == ["/m/first", "/m/second"]
    assert settings.max_batch_rows == 3 and settings.beam_limit == 3
    assert settings.cors_origins == ["https://a.example", "https://b.example"]
    assert settings.api_key is None and settings.log_json is False
    assert Settings().models == Settings(models="/m/first,/m/second").models


def test_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNSERVE_PORT", "7000")
    monkeypatch.setenv("ATTNSERVE_MAX_WAITING", "5")
    args = build_parser().parse_args(["serve", "--model", "/m/a,/m/b", "--port", "9000"])
    settings = settings_from_args(args)
    assert settings.port == 9000 and settings.max_waiting == 5
    assert settings.models == ["/m/a", "/m/b"]
    assert [Settings.model_name(d) for d in settings.models] == ["a", "b"]


def test_prompt_safety_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off by default: raw prompts' special tokens are text, roles are the chat roles."""
    default = Settings(models=["/m/a"])
    assert default.prompt_special_tokens is False and default.extra_chat_roles == []
    assert default.prompt_bytes_per_token == 64
    monkeypatch.setenv("ATTNSERVE_EXTRA_CHAT_ROLES", "ipython, function")
    monkeypatch.setenv("ATTNSERVE_PROMPT_SPECIAL_TOKENS", "1")
    assert Settings(models=["/m/a"]).extra_chat_roles == ["ipython", "function"]
    assert Settings(models=["/m/a"]).prompt_special_tokens is True
    flags = [
        "--no-prompt-special-tokens",
        "--extra-chat-roles",
        "ipython",
        "--prompt-bytes-per-token",
        "16",
    ]
    settings = settings_from_args(build_parser().parse_args(["serve", "--model", "/m/a", *flags]))
    assert settings.prompt_special_tokens is False and settings.extra_chat_roles == ["ipython"]
    assert settings.prompt_bytes_per_token == 16


def test_spinning_reaches_the_onnx_sessions(
    monkeypatch: pytest.MonkeyPatch, tiny_onnx_import: Path
) -> None:
    """--spinning (or ATTNSERVE_SPINNING) turns ORT's thread spinning on; off by default."""
    from attnserve.service.models import default_backend_factory

    key = "session.intra_op.allow_spinning"
    for flags, env, expected in (([], None, "0"), (["--spinning"], None, "1"), ([], "1", "1")):
        if env is not None:
            monkeypatch.setenv("ATTNSERVE_SPINNING", env)
        args = build_parser().parse_args(["serve", "--model", str(tiny_onnx_import), *flags])
        settings = settings_from_args(args)
        backend = default_backend_factory(tiny_onnx_import, settings)
        assert backend.decoder.get_session_options().get_session_config_entry(key) == expected


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "/x/same,/y/same"], "share the name same"),
        (["--default-timeout-ms", "9", "--max-timeout-ms", "5"], "default_timeout_ms"),
        (["--variant", "int2"], "variant"),
    ],
)
def test_invalid_settings(flags: list[str], message: str) -> None:
    with pytest.raises(ServeError, match=message):
        settings_from_args(build_parser().parse_args(["serve", *flags]))


def test_serve_without_the_model_fails_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The command would set up the process's logging; keep pytest's.
    monkeypatch.setattr("attnserve.service.logs.configure_logging", lambda *a, **k: None)
    missing = tmp_path / "ende-small"
    assert main(["serve", "--model", str(missing)]) == 2
    error = capsys.readouterr().err
    assert f"model directory {missing} does not exist" in error
    assert "attnserve import HF_DIR DIR" in error


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LOCALHOST.", True),
        ("app.localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("", False),
        ("10.0.0.5", False),
        ("example.com", False),
        ("localhost.example.com", False),
    ],
)
def test_loopback_addresses(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_an_open_api_beyond_loopback_does_not_start(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before any model is looked at: no key and a wildcard address is a refusal (status 2),
    unless meant (--allow-no-api-key: a warning), or a key is set, or only loopback."""
    monkeypatch.setattr("attnserve.service.logs.configure_logging", lambda *a, **k: None)
    missing = str(tmp_path / "ende-small")
    assert main(["serve", "--model", missing, "--host", "0.0.0.0"]) == 2
    error = capsys.readouterr().err
    assert "reachable beyond this machine (0.0.0.0) without an API key" in error
    assert "does not exist" not in error  # refused first
    # a container bound to 0.0.0.0 whose port is published on loopback only
    flags = ["serve", "--model", missing, "--host", "0.0.0.0", "--published-host", "127.0.0.1"]
    assert main(flags) == 2 and "does not exist" in capsys.readouterr().err
    flags = ["serve", "--model", missing, "--host", "::1", "--published-host", "192.0.2.7"]
    assert main(flags) == 2 and "(192.0.2.7) without an API key" in capsys.readouterr().err
    monkeypatch.setenv("ATTNSERVE_API_KEY", "k3y")
    assert main(["serve", "--model", missing, "--host", "0.0.0.0"]) == 2
    assert "does not exist" in capsys.readouterr().err
    monkeypatch.delenv("ATTNSERVE_API_KEY")
    caplog.set_level("WARNING", logger="attnserve.service.launch")
    assert main(["serve", "--model", missing, "--host", "0.0.0.0", "--allow-no-api-key"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert any("the API is open" in r.getMessage() for r in caplog.records)


def test_missing_default_model_says_how_to_get_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wheel run outside the checkout finds no default model: the error says where it ships."""
    monkeypatch.setenv("ATTNSERVE_DEFAULT_MODEL", str(tmp_path / "ende-small"))
    with pytest.raises(ServeError, match="default model ships in the attnserve checkout"):
        check_models(Settings())


def test_serve_refuses_a_model_without_graphs_when_auto_export_is_off(
    tmp_path: Path, tiny_marian_import: Path
) -> None:
    model = tmp_path / "tiny"
    shutil.copytree(tiny_marian_import, model)
    with pytest.raises(ServeError, match=f"attnserve export {model} --variants int8"):
        check_models(Settings(models=[str(model)], auto_export=False))


@pytest.mark.slow
def test_serve_exports_a_model_without_graphs(tmp_path: Path, tiny_marian_import: Path) -> None:
    model = tmp_path / "tiny"
    shutil.copytree(tiny_marian_import, model)
    check_models(Settings(models=[str(model)], variant="fp32"))
    assert (model / "onnx" / "fp32" / "decoder.onnx").is_file()


def test_a_model_that_fails_to_load_stops_the_server(model_dir: Path) -> None:
    def broken(directory: Path, settings: Settings) -> object:
        raise RuntimeError("corrupt graph")

    server = LiveServer(make_settings(model_dir), backend_factory=broken, wait_ready=False)
    server.thread.join(30)
    assert not server.thread.is_alive() and server.server.failed
    assert server.service.lifecycle.phase == "failed"
    assert "corrupt graph" in (server.service.lifecycle.detail or "")
    server.sock.close()


def test_the_service_never_imports_torch(model_dir: Path) -> None:
    """Loading and serving the ONNX model end to end leaves torch unimported."""
    code = f"""
import sys
import time
from fastapi.testclient import TestClient
from attnserve.service.app import create_app
from attnserve.service.launch import check_models
from attnserve.service.server import serve
from attnserve.service.settings import Settings
settings = Settings(models=[{str(model_dir)!r}], threads=1, provider="cpu")
check_models(settings)
with TestClient(create_app(settings), base_url="http://localhost") as client:
    while (ready := client.get("/readyz")).json()["status"] == "loading":
        time.sleep(0.01)
    assert ready.status_code == 200, ready.text
    body = {{"text": "ka", "target_lang": "de"}}
    assert client.post("/v1/translate", json=body).status_code == 200
sys.exit("torch" in sys.modules)
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_version_and_docs_are_served(live: LiveServer) -> None:
    schema = httpx.get(live.url + "/openapi.json").json()
    assert schema["info"]["title"] == "attnserve"
    assert "TokenEvent" in schema["components"]["schemas"]
