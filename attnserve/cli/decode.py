"""`attnserve translate` and `attnserve generate`: stdin lines -> stdout lines, a JSON summary on
stderr."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from attnserve.cli.flags import (
    add_decoding_flags,
    add_model_flag,
    add_runtime_flags,
    decoding_options,
    load_generator,
    load_translator,
)
from attnserve.defaults import DEFAULT_SENTENCE_TOKENS, default_lm_dir
from attnserve.engine.translator import MAX_BATCH_ROWS, Translator
from attnserve.text.document import Document, UnitTooLong, split_document, whole
from attnserve.text.segment import default_segmenter


def register(sub: Any) -> None:
    p = sub.add_parser("translate", help="translate stdin lines to stdout")
    add_model_flag(p)
    add_runtime_flags(p)
    p.add_argument("--max-batch-size", type=int, default=32, help="sentences per batch")
    p.add_argument(
        "--max-batch-rows",
        type=int,
        default=MAX_BATCH_ROWS,
        help="decoder rows (sentences x beam size) per batch; the smaller limit wins",
    )
    p.add_argument(
        "--source-lang",
        default=None,
        help="source language: the model's code or ISO 639-1 (NLLB, M2M100, mBART-50 put it in "
        "the source; default the tokenizer's); informational for Marian",
    )
    p.add_argument(
        "--target-lang", default=None, help="target language, e.g. de (or deu_Latn for NLLB)"
    )
    p.add_argument(
        "--split-sentences",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="translate each sentence of a line on its own (a line's spacing kept); a sentence "
        "longer than the model takes is cut at clauses, then between words",
    )
    p.add_argument(
        "--sentence-tokens",
        type=int,
        default=DEFAULT_SENTENCE_TOKENS,
        help="cut a sentence of more tokens at its clause ends (0: only at the model's limit)",
    )
    add_decoding_flags(p)
    p.set_defaults(func=cmd_translate)

    g = sub.add_parser(
        "generate",
        help="complete stdin lines with a language model (one JSON object per line)",
        description="Each stdin line is a prompt (with --chat: a user message rendered through "
        "the model's chat template); each stdout line is a JSON object with text, token_ids, "
        "finish_reason and prompt_tokens (and completions, when there are several). Greedy "
        "unless --sampling or the model's generation config says otherwise.",
    )
    add_model_flag(
        g, help="decoder-only model directory (attnserve import)", default=default_lm_dir()
    )
    add_runtime_flags(g)
    g.add_argument("--chat", action="store_true", help="lines are user messages of a chat")
    g.add_argument("--system", default=None, help="with --chat: a system message first")
    g.add_argument(
        "--stop", action="append", default=[], help="stop string (repeatable; not in the output)"
    )
    g.add_argument("--max-batch-size", type=int, default=32, help="prompts per batch")
    add_decoding_flags(g, generation=True)
    g.set_defaults(func=cmd_generate)


def cmd_translate(args: argparse.Namespace) -> int:
    translator = load_translator(args)
    options = decoding_options(args, translator.defaults)
    options.validate(max_new_tokens_limit=translator.backend.spec.max_positions)
    lines = [line.rstrip("\n") for line in sys.stdin]
    source_lang = args.source_lang if translator.tokenizer.multilingual_source else None
    try:
        documents, targets = _documents(lines, translator, args, source_lang)
    except UnitTooLong as exc:
        sys.stderr.write(f"attnserve translate: {exc}\n")
        return 2
    # every line's sentences, translated together per target language (one, usually)
    units = [(t, u) for d, t in zip(documents, targets, strict=True) for u in d.units]
    results: list[Any] = [None] * len(units)
    start = time.perf_counter()
    for target in dict.fromkeys(t for t, _ in units):
        chosen = [i for i, (t, _) in enumerate(units) if t == target]
        done = translator.translate(
            [units[i][1] for i in chosen],
            options,
            target_lang=target,
            source_lang=source_lang,
            max_batch_size=args.max_batch_size,
            max_batch_rows=args.max_batch_rows,
            typed=False,
        )
        for i, result in zip(chosen, done, strict=True):
            results[i] = result
    seconds = time.perf_counter() - start
    out = sys.stdout
    at = 0
    for document in documents:
        done = results[at : at + len(document.spans)]
        at += len(document.spans)
        if options.num_hypotheses > 1:
            nbest = []
            for k in range(options.num_hypotheses):
                kth = [r.hypotheses[min(k, len(r.hypotheses) - 1)] for r in done]
                score = sum(s for _, s in kth) / len(kth) if kth else 0.0
                nbest.append(f"{document.join([t for t, _ in kth])} ({score:.4f})")
            out.write(" ||| ".join(nbest) + "\n")
        else:
            out.write(document.join([r.text for r in done]) + "\n")
    out.flush()
    target_tokens = sum(r.output_tokens for r in results)
    summary = {
        "lines": len(lines),
        "sentences": len(results),
        "source_tokens": sum(r.input_tokens for r in results),
        "target_tokens": target_tokens,
        "seconds": round(seconds, 4),
        "tokens_per_second": round(target_tokens / seconds, 2) if seconds > 0 else None,
        "backend": args.backend,
        "variant": args.variant if args.backend == "onnx" else None,
        "beam_size": options.beam_size,
        "max_batch_size": args.max_batch_size,
        "max_batch_rows": args.max_batch_rows,
    }
    sys.stderr.write(json.dumps(summary) + "\n")
    return 0


def _documents(
    lines: list[str], translator: Translator, args: argparse.Namespace, source_lang: str | None
) -> tuple[list[Document], list[str | None]]:
    """Each line as a document of sentences (each fitting the model), and its target: the
    flag's, else a language token typed at the line's start (`>>de<<`: not part of the text)."""
    tokenizer = translator.tokenizer
    limit = translator.backend.spec.max_positions
    segmenter = default_segmenter()
    documents: list[Document] = []
    targets: list[str | None] = []
    for line in lines:
        try:
            typed = tokenizer.typed_target(line)
        except ValueError:
            typed = None
        _, rest = tokenizer.split_typed_target(line) if typed else ("", line)
        target = args.target_lang or typed
        counts: dict[str, int] = {}

        def tokens(
            unit: str, _target: str | None = target, _counts: dict[str, int] = counts
        ) -> int:
            if unit not in _counts:
                ids = tokenizer.encode_source(
                    unit, target_lang=_target, source_lang=source_lang, typed=False
                )
                _counts[unit] = len(ids)
            return _counts[unit]

        def fits(unit: str) -> bool:
            return tokens(unit) <= limit

        def prefer(unit: str) -> bool:
            return tokens(unit) <= args.sentence_tokens

        if args.split_sentences:
            language = args.source_lang or tokenizer.source_lang
            soft = prefer if args.sentence_tokens else None
            documents.append(split_document(rest, segmenter, language, fits, soft))
        else:
            documents.append(whole(rest))
        targets.append(target)
    return documents, targets


def cmd_generate(args: argparse.Namespace) -> int:
    generator = load_generator(args)
    options = decoding_options(args, generator.defaults)
    lines = [line.rstrip("\n") for line in sys.stdin]
    prompts = []
    for line in lines:
        if args.chat:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            messages.append({"role": "user", "content": line})
            prompts.append(generator.prompt_ids(messages=messages))
        else:
            prompts.append(generator.prompt_ids(line))
    start = time.perf_counter()
    results = generator.generate(
        prompts, options, stop=args.stop, max_batch_size=args.max_batch_size
    )
    seconds = time.perf_counter() - start
    out = sys.stdout
    for result in results:
        best = result.completions[0]
        record: dict[str, Any] = {
            "text": best.text,
            "token_ids": best.token_ids,
            "finish_reason": best.finish_reason,
            "prompt_tokens": result.prompt_tokens,
        }
        if best.logprobs is not None:
            record["logprobs"] = [
                {"token_id": e.token, "logprob": e.logprob, "top": [list(t) for t in e.top]}
                for e in best.logprobs
            ]
        if len(result.completions) > 1:
            record["completions"] = [
                {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                for c in result.completions
            ]
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
    out.flush()
    generated = sum(len(c.token_ids) for r in results for c in r.completions)
    summary = {
        "prompts": len(results),
        "prompt_tokens": sum(r.prompt_tokens for r in results),
        "generated_tokens": generated,
        "seconds": round(seconds, 4),
        "tokens_per_second": round(generated / seconds, 2) if seconds > 0 else None,
        "backend": args.backend,
        "variant": args.variant if args.backend == "onnx" else None,
        "beam_size": options.beam_size,
        "sampling": options.sampling,
    }
    sys.stderr.write(json.dumps(summary) + "\n")
    return 0
