"""The served models: each one's backend, tokenizer, defaults and engine thread."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnserve.engine.backend import Backend
from attnserve.engine.engine_loop import EngineLoop
from attnserve.engine.memory import MemoryTrimmer
from attnserve.engine.options import DecodingOptions
from attnserve.engine.prefix_cache import PrefixCache
from attnserve.engine.scheduler import Outcome, Request, Scheduler, SchedulerLimits, lm_request
from attnserve.service.metrics import Metrics
from attnserve.service.reasoning import model_thinks
from attnserve.service.settings import Settings

log = logging.getLogger(__name__)

# Builds a model directory's backend (tests wrap the default to slow it down or make it fail).
BackendFactory = Callable[..., Backend[Any]]  # (directory, settings[, stop_ids])

WARMUP_TEXT = "Hello, world."


def default_backend_factory(
    directory: Path, settings: Settings, stop_ids: Sequence[int] = ()
) -> Backend[Any]:
    """The backend of a directory `check_models` provisioned (attnserve/provision.py)."""
    from attnserve.provision import build_backend

    return build_backend(directory, settings.runtime, stop_ids)


@dataclass
class ServedModel:
    """One model as the routes see it: a translation model (encoder-decoder, `Tokenizer`) or
    a language model ("generation": decoder-only, `TextTokenizer` with its chat template)."""

    name: str
    directory: Path
    backend: Backend[Any]
    tokenizer: Any  # Tokenizer (translation) or TextTokenizer (generation)
    defaults: DecodingOptions  # the model's generation config, within the server's limits
    engine: EngineLoop
    backend_name: str
    variant: str | None
    provider: str | None
    max_input_tokens: int  # min(settings.max_input_tokens, the model's max positions)
    max_new_tokens: int  # min(settings.max_new_tokens_limit, the model's max positions)
    kind: str = "translation"
    # writes its reasoning in <think> blocks, answered apart (service/reasoning.py)
    thinks: bool = False
    created: int = field(default_factory=lambda: int(time.time()))  # loaded at (Unix time)

    @property
    def generates(self) -> bool:
        return self.kind == "generation"

    def encode(
        self,
        text: str,
        target_lang: str | None,
        source_lang: str | None = None,
        typed: bool = True,
    ) -> list[int]:
        """Source ids (not truncated: the route rejects sources over max_input_tokens);
        `typed`: see Tokenizer.encode_source."""
        if self.generates:
            return list(self.tokenizer.encode(text))
        return list(
            self.tokenizer.encode_source(
                text, target_lang=target_lang, source_lang=source_lang, typed=typed
            )
        )


def _thinks(parser: str, tokenizer: Any) -> bool:
    """Whether a language model's answers are split into reasoning and content."""
    if parser == "none":
        return False
    if parser == "auto":
        return model_thinks(tokenizer.chat_template, tokenizer.token_to_id)
    return True  # named: the operator knows the model thinks


def scheduler_limits(
    settings: Settings, max_new_tokens: int, generation: bool = False
) -> SchedulerLimits:
    """The scheduler limits a model is served with. A language model's rows join the running
    batch whatever its age (`lm_max_join_padding`): their prompts make the cache wide anyway,
    and a column of padding costs a row far less than its weights do."""
    return SchedulerLimits(
        max_batch_rows=settings.max_batch_rows,
        max_batch_tokens=settings.max_batch_tokens,
        max_waiting=settings.max_waiting,
        max_new_tokens=max_new_tokens,
        join_rows=settings.join_rows,
        max_join_steps=settings.max_join_steps,
        max_cohorts=settings.max_cohorts,
        max_join_padding=settings.lm_max_join_padding if generation else settings.max_join_padding,
        batching=settings.batching,
        prefill_chunk=settings.prefill_chunk,
    )


def load_model(
    directory: Path,
    settings: Settings,
    metrics: Metrics,
    factory: BackendFactory,
    trimmer: MemoryTrimmer | None = None,
) -> ServedModel:
    """Tokenizer, backend and engine of one model directory (blocking: run it in a thread);
    `trimmer`: shared by the models' engines (engine/memory.py)."""
    from attnserve.model.checkpoint import load_tokenizer, read_metadata
    from attnserve.model.decoder_checkpoint import ENCODER_DECODER, directory_family

    name = settings.model_name(directory)
    generates = directory_family(directory) != ENCODER_DECODER
    if generates:
        from attnserve.engine.generator import lm_defaults
        from attnserve.model.text_tokenizer import TextTokenizer

        tokenizer: Any = TextTokenizer.load(directory)
        tokenizer.prepare()
        backend = factory(directory, settings, tokenizer.stop_ids)
        defaults = lm_defaults(directory, backend.spec.max_positions)
        max_input = min(settings.max_prompt_tokens, backend.spec.max_positions - 1)
    else:
        tokenizer = load_tokenizer(directory)
        backend = factory(directory, settings)
        generation = read_metadata(directory).get("generation", {})
        defaults = DecodingOptions.model_defaults(generation, backend.spec.max_positions)
        max_input = min(settings.max_input_tokens, backend.spec.max_positions)
    spec = backend.spec
    max_new = min(settings.max_new_tokens_limit, spec.max_positions)
    defaults = defaults.replace(
        beam_size=min(defaults.beam_size, settings.beam_limit),
        max_new_tokens=min(defaults.max_new_tokens, max_new),
    )
    limits = scheduler_limits(settings, max_new, generates)
    prefix_cache = None
    if generates and settings.prefix_cache_bytes and getattr(backend, "reuses_prefixes", False):
        prefix_cache = PrefixCache(settings.prefix_cache_bytes, settings.prefix_block)
    engine = EngineLoop(
        Scheduler(backend, limits, prefix_cache=prefix_cache),
        observer=lambda events, _: metrics.observe_step(name, events),
        trimmer=trimmer,
    )
    onnx = settings.backend == "onnx"
    model = ServedModel(
        name=name,
        directory=directory,
        backend=backend,
        tokenizer=tokenizer,
        defaults=defaults,
        engine=engine,
        backend_name=settings.backend,
        variant=str(getattr(backend, "variant", settings.variant)) if onnx else None,
        provider=str(getattr(backend, "provider", settings.provider)) if onnx else None,
        max_input_tokens=max_input,
        max_new_tokens=max_new,
        kind="generation" if generates else "translation",
        thinks=generates and _thinks(settings.reasoning_parser, tokenizer),
    )
    metrics.add_model(
        name,
        model.variant or settings.backend,
        model.provider or "torch",
        running=lambda: float(engine.running),
        waiting=lambda: float(engine.waiting),
        prefix_cache=prefix_cache,
        kv_usage=lambda: engine.kv_usage,
    )
    engine.start()
    log.info(
        "loaded model %s from %s (%s, variant %s, provider %s)",
        name,
        directory,
        settings.backend,
        model.variant,
        model.provider,
    )
    return model


async def warm_up(model: ServedModel) -> None:
    """One short translation or generation through the engine (first runs allocate and
    optimize)."""
    options = model.defaults.replace(max_new_tokens=min(4, model.max_new_tokens), min_new_tokens=0)
    if model.generates:
        prompt = model.encode(WARMUP_TEXT, None)[: model.max_input_tokens]
        request = lm_request(f"warmup-{model.name}", prompt, options)
    else:
        tags = model.tokenizer.target_languages
        source = model.encode(WARMUP_TEXT, tags[0] if tags else None)[: model.max_input_tokens]
        request = Request(id=f"warmup-{model.name}", source=source, options=options)
    done = await model.engine.submit(request)
    if done.outcome is not Outcome.DONE:
        raise RuntimeError(f"warm-up of {model.name} failed: {done.outcome} {done.error!r}")


class ModelRegistry:
    """Models by name; the first is the default."""

    def __init__(self, models: Sequence[ServedModel] = ()) -> None:
        self.models: dict[str, ServedModel] = {m.name: m for m in models}

    def add(self, model: ServedModel) -> None:
        self.models[model.name] = model

    @property
    def default(self) -> ServedModel | None:
        return next(iter(self.models.values()), None)

    def get(self, name: str | None) -> ServedModel | None:
        return self.default if name is None else self.models.get(name)

    def __iter__(self) -> Any:
        return iter(self.models.values())

    def __len__(self) -> int:
        return len(self.models)

    def idle(self) -> bool:
        return all(m.engine.idle for m in self.models.values())

    def stop(self, timeout: float | None = None) -> None:
        for model in self.models.values():
            model.engine.stop(timeout)


async def wait_idle(registry: ModelRegistry, seconds: float) -> bool:
    """Wait until no model has queued or running work, at most `seconds`; True if idle."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while not registry.idle():
        if loop.time() >= end:
            return False
        await asyncio.sleep(0.02)
    return True
