"""`attnserve serve`: flags over ATTNSERVE_* settings, the models provisioned, uvicorn; with
`--replicas N` / `--ray`, replicas on Ray Serve instead (service/replicas.py, ray_serve.py).

Imported by the CLI only when `serve` runs (FastAPI and uvicorn load then, torch only if a model
must be exported first, Ray only for replicas).
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from pydantic import ValidationError

from attnserve.defaults import default_model_dir
from attnserve.service import replicas
from attnserve.service.settings import Settings

log = logging.getLogger(__name__)

# flag -> (Settings field, type); flags left out keep the environment's (or default) value.
FLAGS: dict[str, tuple[str, type]] = {
    "--host": ("host", str),
    "--port": ("port", int),
    "--backend": ("backend", str),
    "--variant": ("variant", str),
    "--provider": ("provider", str),
    "--threads": ("threads", int),
    "--max-batch-rows": ("max_batch_rows", int),
    "--max-batch-tokens": ("max_batch_tokens", int),
    "--max-waiting": ("max_waiting", int),
    "--batching": ("batching", str),
    "--join-rows": ("join_rows", int),
    "--max-join-steps": ("max_join_steps", int),
    "--max-cohorts": ("max_cohorts", int),
    "--max-join-padding": ("max_join_padding", int),
    "--lm-max-join-padding": ("lm_max_join_padding", int),
    "--prefill-chunk": ("prefill_chunk", int),
    "--prefix-cache-bytes": ("prefix_cache_bytes", int),
    "--prefix-block": ("prefix_block", int),
    "--max-prompt-tokens": ("max_prompt_tokens", int),
    "--default-timeout-ms": ("default_timeout_ms", int),
    "--max-timeout-ms": ("max_timeout_ms", int),
    "--max-texts-per-request": ("max_texts_per_request", int),
    "--max-sentences-per-request": ("max_sentences_per_request", int),
    "--sentence-tokens": ("sentence_tokens", int),
    "--max-input-tokens": ("max_input_tokens", int),
    "--max-new-tokens-limit": ("max_new_tokens_limit", int),
    "--max-beam-size": ("max_beam_size", int),
    "--max-body-bytes": ("max_body_bytes", int),
    "--prompt-bytes-per-token": ("prompt_bytes_per_token", int),
    "--extra-chat-roles": ("extra_chat_roles", str),
    "--cors-origins": ("cors_origins", str),
    "--published-host": ("published_host", str),
    "--allowed-hosts": ("allowed_hosts", str),
    "--header-timeout-seconds": ("header_timeout_seconds", float),
    "--body-timeout-seconds": ("body_timeout_seconds", float),
    "--keep-alive-seconds": ("keep_alive_seconds", int),
    "--max-connections": ("max_connections", int),
    "--drain-seconds": ("drain_seconds", float),
    "--trim-seconds": ("trim_seconds", float),
    "--log-level": ("log_level", str),
    "--tool-call-parser": ("tool_call_parser", str),
    "--reasoning-parser": ("reasoning_parser", str),
}


class ServeError(Exception):
    """A configuration or model problem found before the server starts (exit status 2)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `attnserve serve` (the command is registered in `attnserve.cli.serve`)."""
    p.add_argument(
        "--model",
        default=None,
        help=f"model directories, comma-separated; the first is the default "
        f"(env ATTNSERVE_MODELS; default {default_model_dir()})",
    )
    for flag, (field, kind) in FLAGS.items():
        p.add_argument(
            flag, dest=field, type=kind, default=None, help=f"env ATTNSERVE_{field.upper()}"
        )
    p.add_argument(
        "--log-json",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="JSON log lines (default: on; env ATTNSERVE_LOG_JSON)",
    )
    p.add_argument(
        "--auto-export",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="import the default language model and export MODEL/onnx/<variant> when they "
        "are missing (default: on; env ATTNSERVE_AUTO_EXPORT)",
    )
    p.add_argument(
        "--ui",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the page for people at / (default: on; env ATTNSERVE_UI)",
    )
    p.add_argument(
        "--docs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the OpenAPI page at /docs and /openapi.json (default: on; env ATTNSERVE_DOCS)",
    )
    p.add_argument(
        "--prompt-special-tokens",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="read special tokens' text in raw prompts (/v1/completions, /v1/generate text, "
        "/tokenize) as those tokens, for trusted back ends; chat text never is (default: off; "
        "env ATTNSERVE_PROMPT_SPECIAL_TOKENS)",
    )
    p.add_argument(
        "--spinning",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ONNX Runtime's threads spin between nodes: faster with 2+ threads on a dedicated "
        "machine, CPU burnt while idle (default: off; env ATTNSERVE_SPINNING)",
    )
    p.add_argument(
        "--allow-no-api-key",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="serve without an API key though the server is reachable beyond this machine "
        "(default: refuse to start; env ATTNSERVE_ALLOW_NO_API_KEY)",
    )
    replicas.add_arguments(p)


def check_exposure(settings: Settings) -> None:
    """Refuse an open API reachable from other machines unless it is meant (then warn)."""
    if not settings.open_beyond_loopback:
        return
    where = settings.exposed_host or "every interface"
    if not settings.allow_no_api_key:
        raise ServeError(
            f"the API would be reachable beyond this machine ({where}) without an API key: "
            "set ATTNSERVE_API_KEY (clients send `Authorization: Bearer <key>`), bind to "
            "127.0.0.1 (--host), or pass --allow-no-api-key (ATTNSERVE_ALLOW_NO_API_KEY=1) "
            "to serve an open API on purpose"
        )
    log.warning(
        "the API is open: reachable beyond this machine (%s) and no API key is set "
        "(--allow-no-api-key); anyone who reaches it can use every route",
        where,
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {}
    if args.model is not None:
        overrides["models"] = args.model
    for field, _ in FLAGS.values():
        if getattr(args, field, None) is not None:
            overrides[field] = getattr(args, field)
    for field in (
        "log_json",
        "auto_export",
        "spinning",
        "ui",
        "docs",
        "allow_no_api_key",
        "prompt_special_tokens",
    ):
        if getattr(args, field, None) is not None:
            overrides[field] = getattr(args, field)
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'settings'}: {e['msg']}" for e in exc.errors()
        )
        raise ServeError(f"invalid settings: {problems}") from exc


def check_models(settings: Settings) -> None:
    """Fail early, naming the directory and how to get a model; import the default language
    model from its wheel and export ONNX when missing (attnserve/provision.py)."""
    from attnserve.provision import provision

    for directory in settings.model_dirs:
        try:
            provision(directory, settings.runtime)
        except FileNotFoundError as exc:  # no such model, or a missing piece it may not make
            raise ServeError(str(exc)) from exc


def cmd_serve(args: argparse.Namespace) -> int:
    import sys

    from attnserve.service.logs import configure_logging

    try:
        options = replicas.options_from_args(args)
        settings = settings_from_args(args)
    except (ServeError, replicas.ReplicaError) as exc:
        sys.stderr.write(f"attnserve serve: {exc}\n")
        return 2
    if options.on_ray and not replicas.ray_installed():
        sys.stderr.write(replicas.missing_ray_message(options) + "\n")
        return 2
    try:
        configure_logging(settings.log_level, settings.log_json)
        check_exposure(settings)
        check_models(settings)
    except ServeError as exc:
        sys.stderr.write(f"attnserve serve: {exc}\n")
        return 2
    if options.on_ray:
        import os

        from attnserve.service.ray_serve import run

        threads = replicas.replica_threads(settings, options, os.cpu_count())
        return run(settings.model_copy(update={"threads": threads}), options)
    from attnserve.service.server import serve

    return serve(settings)
