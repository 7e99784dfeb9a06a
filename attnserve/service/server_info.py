"""GET /v1/server: the served models and the server's limits, read-only, for people (the page's
Server view) and programs. It is an API route: the API key, readiness and metrics apply."""

from __future__ import annotations

import importlib.metadata

from fastapi import APIRouter

from attnserve.service.documents import source_languages, target_languages
from attnserve.service.models import ServedModel
from attnserve.service.routes import ERROR_RESPONSES
from attnserve.service.schemas import ServerInfo, ServerLimits, ServerModel
from attnserve.service.settings import Settings
from attnserve.service.state import Service
from attnserve.text.detect import language_name

router = APIRouter()


def package_version() -> str:
    try:
        return importlib.metadata.version("attnserve")
    except importlib.metadata.PackageNotFoundError:
        return "0"


def _model(m: ServedModel, default: bool, settings: Settings) -> ServerModel:
    return ServerModel(
        name=m.name,
        kind="generation" if m.generates else "translation",
        default=default,
        backend=m.backend_name,
        variant=m.variant,
        provider=m.provider,
        threads=settings.threads or None,
        context_length=m.backend.spec.max_positions,
        max_input_tokens=m.max_input_tokens,
        max_new_tokens=m.max_new_tokens,
        beam_size=m.defaults.beam_size,
        source_languages=None if m.generates else source_languages(m),
        target_languages=[] if m.generates else target_languages(m),
    )


@router.get(
    "/v1/server",
    response_model=ServerInfo,
    responses={401: ERROR_RESPONSES[401], 503: ERROR_RESPONSES[503]},
    summary="The served models (kind, variant, threads, context, languages) and the limits",
)
async def server_info(service: Service) -> ServerInfo:
    settings, default = service.settings, service.registry.default
    models = [_model(m, m is default, settings) for m in service.registry]
    codes = {c for m in models for c in [*(m.source_languages or []), *m.target_languages]}
    return ServerInfo(
        version=package_version(),
        phase=service.lifecycle.phase,
        batching=settings.batching,
        max_batch_rows=settings.max_batch_rows,
        models=models,
        languages={code: language_name(code) for code in sorted(codes)},
        limits=ServerLimits(
            max_body_bytes=settings.max_body_bytes,
            max_texts_per_request=settings.max_texts_per_request,
            max_sentences_per_request=settings.max_sentences_per_request,
            max_beam_size=settings.beam_limit,
            max_waiting=settings.max_waiting,
            default_timeout_ms=settings.default_timeout_ms,
            max_timeout_ms=settings.max_timeout_ms,
        ),
    )
