"""LibreTranslate's API: `POST /translate`, `POST /detect`, `GET /languages`, in the shapes
its clients (libretranslatepy, browser extensions, apps) read.

Bodies are JSON, form-encoded or multipart, query parameters too (LibreTranslate reads them
all). Errors are `{"error": "message"}` with 400 (the native routes' 422), 403 for the API key,
429 and 500; the key travels as `api_key` in the body or as the native `Authorization: Bearer`.
A translation is decoded by the native path (documents, html, detection, batching, metrics);
the model is the request's `model`, else the first served translation model that translates
into `target` (and from `source`, or from the detected language).
"""

from __future__ import annotations

import contextlib
import hmac
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from attnserve.engine.scheduler import Outcome
from attnserve.model.languages import same_language
from attnserve.service.answers import answers
from attnserve.service.decoding import wait_all
from attnserve.service.documents import (
    AUTO,
    DETECT_CHARS,
    source_languages,
    start_translation,
    target_languages,
    visible_text,
)
from attnserve.service.errors import ApiError, shown
from attnserve.service.models import ServedModel
from attnserve.service.routes import raise_for
from attnserve.service.schemas import TranslateRequest
from attnserve.service.state import Service, ServiceState
from attnserve.text.detect import detector_for, language_name

router = APIRouter(tags=["LibreTranslate"])

# The OpenAPI description of the routes (their bodies are read by hand: JSON, form or query).
_ERROR = {
    "type": "object",
    "properties": {"error": {"type": "string"}},
    "required": ["error"],
}
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"description": what, "content": {"application/json": {"schema": _ERROR}}}
    for status, what in {
        400: "Invalid request (LibreTranslate's error shape)",
        403: "API key missing or wrong (when the server has one)",
        413: "Body larger than the server's max_body_bytes",
        429: "Queue full: retry after Retry-After seconds",
        500: "Decoding failed",
        503: "Not ready yet, or shutting down",
        504: "Deadline exceeded",
    }.items()
}
_TEXTS = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
_DETECTED = {
    "type": "object",
    "properties": {"confidence": {"type": "number"}, "language": {"type": "string"}},
    "required": ["confidence", "language"],
}


def _body(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": required}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _ok(schema: dict[str, Any]) -> dict[int | str, dict[str, Any]]:
    return {200: {"description": "OK", "content": {"application/json": {"schema": schema}}}}


TRANSLATE_PATH, DETECT_PATH, LANGUAGES_PATH = "/translate", "/detect", "/languages"
MAX_ALTERNATIVES = 7
MAX_NAME = 64  # characters of a language code or model name


async def _params(request: Request) -> dict[str, Any]:
    """Query parameters, then the body's fields over them (JSON object, or a form)."""
    params: dict[str, Any] = dict(request.query_params)
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "application/json":
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            detail = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:200]
            raise ApiError(400, f"Invalid request: the body is not JSON ({detail})") from exc
        if not isinstance(body, dict):
            raise ApiError(400, "Invalid request: the JSON body must be an object")
        params.update(body)
    elif kind in ("application/x-www-form-urlencoded", "multipart/form-data"):
        form = await request.form()
        for key in form:
            values = [v for v in form.getlist(key) if isinstance(v, str)]
            if values:
                params[key] = values if len(values) > 1 else values[0]
    elif kind and await request.body():
        raise ApiError(400, f"Invalid request: unsupported content type {shown(kind)}")
    return params


def _check_key(request: Request, service: ServiceState, params: dict[str, Any]) -> None:
    """403 unless the server has no key or the request gives it (api_key or Bearer)."""
    key = service.settings.api_key
    if key is None:
        return
    secret = key.get_secret_value()
    given = params.get("api_key")
    supplied = given.encode("utf-8", "surrogatepass") if isinstance(given, str) else b""
    scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
    # the header's own bytes (Starlette read them as latin-1), as the middleware compares them
    header = bearer.encode("latin-1").strip(b" \t") if scheme.lower() == "bearer" else b""
    forms = {secret.encode()}
    with contextlib.suppress(UnicodeEncodeError):
        forms.add(secret.encode("latin-1"))
    ok = [hmac.compare_digest(x, form) for x in (supplied, header) for form in forms]
    if not any(ok):
        service.metrics.reject("unauthorized")
        message = "Invalid API key" if supplied or header else "Please provide an API key"
        raise ApiError(403, message, param="api_key")


def _string(
    params: dict[str, Any], name: str, default: str | None = None, limit: int | None = MAX_NAME
) -> str:
    value = params.get(name, default)
    if value is None or value == "":
        raise ApiError(400, f"Invalid request: missing {name} parameter", param=name)
    if not isinstance(value, str):
        raise ApiError(400, f"Invalid request: {name} must be a string", param=name)
    if limit is not None and len(value) > limit:
        raise ApiError(
            400, f"Invalid request: {name} is longer than {limit} characters", param=name
        )
    return value


def _translation_models(service: ServiceState) -> list[ServedModel]:
    return [m for m in service.registry if not m.generates]


def _choose(
    service: ServiceState,
    params: dict[str, Any],
    source: str,
    target: str,
    texts: list[str],
    fmt: str,
) -> ServedModel:
    """The model named by `model`, else the first that translates source -> target (400)."""
    name = params.get("model")
    models = _translation_models(service)
    if name is not None and not isinstance(name, str):
        raise ApiError(400, "Invalid request: model must be a string", param="model")
    if name:
        name = _string(params, "model")
        found = service.registry.get(name)
        if found is None or found.generates:
            known = ", ".join(m.name for m in models)
            raise ApiError(
                400, f"unknown translation model {shown(name)}; served: {known}", param="model"
            )
        return found

    def into(m: ServedModel) -> bool:
        return any(same_language(target, t) for t in target_languages(m))

    def from_(m: ServedModel, lang: str) -> bool:
        sources = source_languages(m)
        return sources is None or any(same_language(lang, s) for s in sources)

    candidates = [m for m in models if into(m)]
    if not candidates:
        targets = sorted({t for m in models for t in target_languages(m)})
        raise ApiError(
            400,
            f"target {shown(target)} is not supported; targets: {', '.join(targets)}",
            param="target",
        )
    if source == AUTO:  # the first text's visible words decide (each text is detected again)
        languages = _union(source_languages(m) for m in candidates)
        sample = visible_text(texts[0], fmt)[:DETECT_CHARS] if texts else ""
        found_lang = detector_for(languages).detect(sample)
        if found_lang is None:
            return candidates[0]
        source = found_lang.language
    for m in candidates:
        if from_(m, source):
            return m
    raise ApiError(
        400,
        f"{shown(source)} -> {shown(target)} is not supported by the served models",
        param="source",
    )


def _union(groups: Any) -> list[str] | None:
    out: list[str] = []
    for group in groups:
        if group is None:
            return None
        out.extend(x for x in group if x not in out)
    return out


@router.post(
    TRANSLATE_PATH,
    summary="LibreTranslate: translate text or html (q: one or a list)",
    openapi_extra=_body(
        {
            "q": _TEXTS,
            "source": {"type": "string", "description": 'a language code, or "auto"'},
            "target": {"type": "string"},
            "format": {"type": "string", "enum": ["text", "html"]},
            "alternatives": {"type": "integer", "minimum": 0, "maximum": MAX_ALTERNATIVES},
            "api_key": {"type": "string"},
            "model": {"type": "string"},
        },
        ["q", "target"],
    ),
    responses={
        **_ok(
            {
                "type": "object",
                "properties": {
                    "translatedText": _TEXTS,
                    "detectedLanguage": {
                        "oneOf": [_DETECTED, {"type": "array", "items": _DETECTED}]
                    },
                    "alternatives": {"type": "array"},
                },
                "required": ["translatedText"],
            }
        ),
        **_ERRORS,
    },
)
async def translate(request: Request, service: Service) -> Response:
    params = await _params(request)
    _check_key(request, service, params)
    q = params.get("q")
    if q is None:
        raise ApiError(400, "Invalid request: missing q parameter", param="q")
    if not isinstance(q, str) and not (isinstance(q, list) and all(isinstance(x, str) for x in q)):
        raise ApiError(400, "Invalid request: q must be a string or a list of strings", param="q")
    texts = [q] if isinstance(q, str) else list(q)
    limit = min(service.settings.max_texts_per_request, service.settings.max_waiting)
    if len(texts) > limit:
        raise ApiError(400, f"Invalid request: {len(texts)} texts; at most {limit}", param="q")
    source = _string(params, "source", AUTO).lower()
    target = _string(params, "target")
    fmt = params.get("format", "text")
    if fmt not in ("text", "html"):
        raise ApiError(400, "Invalid request: format must be text or html", param="format")
    alternatives = _alternatives(params.get("alternatives", 0))
    model = _choose(service, params, source, target, texts, fmt)
    fields: dict[str, Any] = {
        "text": q,
        "model": model.name,
        "source_lang": source,
        "target_lang": target,
        "format": fmt,
    }
    if alternatives:
        beam = max(model.defaults.beam_size, alternatives + 1)
        fields.update(beam_size=beam, num_hypotheses=alternatives + 1)
    try:
        body = TranslateRequest.model_validate(fields)
    except ValidationError as exc:
        raise ApiError(400, f"Invalid request: {exc.errors()[0]['msg']}") from exc
    run = await start_translation(body, service, model)
    outcome = await wait_all(model, run.requests, run.futures, run.timeout, request.receive)
    raise_for(outcome, run.requests, run.timeout, run.request_id)
    if outcome is Outcome.CANCELLED:
        return Response(status_code=499)  # the client is gone; logged and counted as 499
    results = await answers(model, run.plan, [f.result() for f in run.futures])
    out: list[dict[str, Any]] = []
    for answer in results:
        entry: dict[str, Any] = {"translatedText": answer.text}
        if answer.detected_language is not None:
            entry["detectedLanguage"] = {
                "confidence": round(answer.detected_language.confidence * 100, 1),
                "language": answer.detected_language.language,
            }
        if alternatives:
            others = [h.text for h in answer.hypotheses or []][1:]
            entry["alternatives"] = others[:alternatives]
        out.append(entry)
    if isinstance(q, str):
        return JSONResponse(out[0])
    merged: dict[str, Any] = {"translatedText": [e["translatedText"] for e in out]}
    if source == AUTO:
        merged["detectedLanguage"] = [e.get("detectedLanguage") for e in out]
    if alternatives:
        merged["alternatives"] = [e["alternatives"] for e in out]
    return JSONResponse(merged)


def _alternatives(value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ApiError(
            400, "Invalid request: alternatives must be an integer", param="alternatives"
        )
    try:
        count = int(value)
    except (TypeError, ValueError, OverflowError):
        raise ApiError(
            400, "Invalid request: alternatives must be an integer", param="alternatives"
        ) from None
    if not 0 <= count <= MAX_ALTERNATIVES:
        raise ApiError(
            400,
            f"Invalid request: alternatives must be 0 to {MAX_ALTERNATIVES}",
            param="alternatives",
        )
    return count


@router.post(
    DETECT_PATH,
    summary="LibreTranslate: the language of a text, with confidence",
    openapi_extra=_body({"q": {"type": "string"}, "api_key": {"type": "string"}}, ["q"]),
    responses={**_ok({"type": "array", "items": _DETECTED}), **_ERRORS},
)
async def detect(request: Request, service: Service) -> JSONResponse:
    params = await _params(request)
    _check_key(request, service, params)
    q = _string(params, "q", limit=None)
    models = _translation_models(service)
    languages = _union(source_languages(m) for m in models) if models else None
    detector = detector_for(languages)
    best = detector.detect(q)
    if best is None:
        raise ApiError(400, "could not detect the language of q (it has no letters)", param="q")
    # the served languages likeliest first, unless the text is clearly in another one
    ranked = detector.ranked(q)
    found = ranked if best.language in {d.language for d in ranked} else [best]
    return JSONResponse(
        [{"confidence": round(d.confidence * 100, 1), "language": d.language} for d in found]
    )


@router.post(LANGUAGES_PATH, include_in_schema=False)
@router.get(
    LANGUAGES_PATH,
    summary="LibreTranslate: languages and targets",
    responses={
        **_ok(
            {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "code": {"type": "string"},
                        "name": {"type": "string"},
                        "targets": {"type": "array", "items": {"type": "string"}},
                    },
                    "required": ["code", "name", "targets"],
                },
            }
        ),
        **_ERRORS,
    },
)
async def languages(request: Request, service: Service) -> JSONResponse:
    pairs: dict[str, list[str]] = {}
    for model in _translation_models(service):
        targets = target_languages(model)
        for source in source_languages(model) or targets:
            known = pairs.setdefault(source, [])
            known.extend(t for t in targets if t not in known and t != source)
    return JSONResponse(
        [{"code": code, "name": language_name(code), "targets": targets}
         for code, targets in pairs.items()]
    )  # fmt: skip
