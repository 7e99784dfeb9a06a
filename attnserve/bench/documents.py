"""`attnserve bench-documents`: documents through the HTTP API against the same sentences.

Three questions, one server (`attnserve serve --model M`, a subprocess):

- quality: `--paragraphs` paragraphs of `--verses` consecutive verses of the held-out test books
  (KJV / Elberfelder, as `attnserve data build` pairs them), each sent as ONE text, both
  directions: BLEU of the documents as attnserve splits them, of the same texts with
  `split_sentences: false` (every text one unit, as before documents), and of the verses sent one
  per text (sentence by sentence). References: the verses of a paragraph joined by spaces.
- speed: a document of about `--words` words (test verses, a paragraph break every `--verses`)
  as one request, against offline `attnserve translate` (the `Translator`) on the same sentences;
  target tokens/s, medians of `--repeats` runs taken in turn; then `--concurrent` such documents
  at once, with the mean rows per decoding step from the server's `batch_rows` histogram.
- overhead: the time to segment, detect and fit the document (what the server does before it
  queues anything), against the document's wall time.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from attnserve.defaults import DEFAULT_SENTENCE_TOKENS, DEFAULT_VARIANT, default_model_dir

log = logging.getLogger(__name__)

DIRECTIONS = (("en", "de"), ("de", "en"))


def paragraphs(count: int, verses: int, seed: int) -> list[list[tuple[str, str]]]:
    """`count` runs of `verses` consecutive verses (one chapter each) of the test books."""
    from attnserve.training.data import DEFAULT_PAIRINGS, TEST_BOOKS, default_bible_db, read_bible

    chapters: dict[tuple[int, int], list[tuple[str, str]]] = {}
    for v in read_bible(default_bible_db(), DEFAULT_PAIRINGS[0]):
        if v.book in TEST_BOOKS and v.en and v.de:
            chapters.setdefault((v.book, v.chapter), []).append((v.en, v.de))
    runs = [
        vs[i : i + verses]
        for vs in chapters.values()
        for i in range(0, len(vs) - verses + 1, verses)
    ]
    return random.Random(seed).sample(runs, min(count, len(runs)))


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    import httpx

    response = httpx.post(url + path, json=body, timeout=600.0)
    response.raise_for_status()
    out: dict[str, Any] = response.json()
    return out


def _texts(url: str, texts: list[str], target: str, **fields: Any) -> list[str]:
    """Translations of `texts`, 32 a request; a text the server refuses (over the model's
    input limit, unsplit) counts as an empty translation."""
    import httpx

    out: list[str] = []
    for i in range(0, len(texts), 32):
        body = {"text": texts[i : i + 32], "target_lang": target, **fields}
        try:
            out.extend(t["text"] for t in _post(url, "/v1/translate", body)["translations"])
        except httpx.HTTPStatusError:
            for text in texts[i : i + 32]:
                try:
                    out.extend(_texts(url, [text], target, **fields) if len(texts) > 1 else [""])
                except httpx.HTTPStatusError:
                    out.append("")
    return out


def quality(url: str, runs: list[list[tuple[str, str]]]) -> list[dict[str, Any]]:
    import sacrebleu

    rows = []
    for src, tgt in DIRECTIONS:
        side = {"en": 0, "de": 1}
        docs = [" ".join(v[side[src]] for v in run) for run in runs]
        refs = [" ".join(v[side[tgt]] for v in run) for run in runs]
        verses = [v[side[src]] for run in runs for v in run]
        split = _texts(url, docs, tgt)
        whole = _texts(url, docs, tgt, split_sentences=False)
        one_by_one = _texts(url, verses, tgt, split_sentences=False)
        at, joined = 0, []
        for run in runs:
            joined.append(" ".join(one_by_one[at : at + len(run)]))
            at += len(run)

        def bleu(hyps: list[str], _refs: list[str] = refs) -> float:
            return round(sacrebleu.corpus_bleu(hyps, [_refs]).score, 2)

        rows.append(
            {
                "direction": f"{src}-{tgt}",
                "paragraphs": len(runs),
                "documents": bleu(split),
                "unsplit": bleu(whole),
                "sentence_by_sentence": bleu(joined),
            }
        )
    return rows


def markup(url: str, runs: list[list[tuple[str, str]]], seed: int) -> dict[str, Any]:
    """Each English verse with 1-3 words in the middle wrapped in <b>, as html: how often the
    bold words of the answer are exactly the separate translation of the wrapped words (else
    the most similar window of the sentence's translation got the tags)."""
    import re

    rng = random.Random(seed)
    sources, inner = [], []
    for run in runs:
        for en, _ in run:
            words = en.split()
            if len(words) < 6:
                continue
            size = rng.randint(1, 3)
            at = rng.randint(1, len(words) - size - 1)
            wrapped = " ".join(words[at : at + size])
            inner.append(wrapped)
            sources.append(
                " ".join([*words[:at], f"<b>{wrapped}</b>", *words[at + size :]])
                .replace("&", "&amp;")
                .replace("<b>", "\x00")
                .replace("</b>", "\x01")
                .replace("<", "&lt;")
                .replace("\x00", "<b>")
                .replace("\x01", "</b>")
            )
    answers = _texts(url, sources, "de", format="html")
    alone = _texts(url, inner, "de", split_sentences=False)
    exact = kept = 0
    for answer, want in zip(answers, alone, strict=True):
        found = re.findall(r"<b>(.*?)</b>", answer)
        kept += len(found) == 1 and answer.count("<b>") == 1
        exact += bool(found) and found[0].strip().lower() == want.strip().lower()
    return {"sentences": len(sources), "tag_kept": kept, "exact_match": exact}


def long_document(words: int, verses: int, seed: int) -> str:
    runs = paragraphs(10_000, verses, seed)
    out: list[str] = []
    count = 0
    for run in runs:
        out.append(" ".join(v[0] for v in run))
        count += sum(len(v[0].split()) for v in run)
        if count >= words:
            break
    return "\n\n".join(out)


def _mean_rows(metrics: str) -> tuple[float, float]:
    """(sum, count) of the batch_rows histogram in a /metrics text."""
    total = count = 0.0
    for line in metrics.splitlines():
        if line.startswith("attnserve_batch_rows_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("attnserve_batch_rows_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


def speed(url: str, model: Path, document: str, args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    from attnserve.provision import Runtime, load_translator
    from attnserve.text.detect import detector_for
    from attnserve.text.document import split_document
    from attnserve.text.segment import default_segmenter

    runtime = Runtime(variant=args.variant, provider="cpu", threads=args.threads)
    translator = load_translator(model, runtime)  # the server provisioned it already
    tokenizer, limit = translator.tokenizer, translator.backend.spec.max_positions

    def plan() -> list[str]:
        detector_for(["en", "de"]).detect(document)

        def fits(unit: str) -> bool:
            return len(tokenizer.encode_source(unit, target_lang="de")) <= limit

        def prefer(unit: str) -> bool:  # the server's default sentence_tokens
            return len(tokenizer.encode_source(unit, target_lang="de")) <= DEFAULT_SENTENCE_TOKENS

        return split_document(document, default_segmenter(), "en", fits, prefer).units

    units = plan()
    http_tps, offline_tps, http_seconds, plan_seconds = [], [], [], []
    alone_rows = [0.0, 0.0]
    for _ in range(args.repeats):
        before = _mean_rows(httpx.get(url + "/metrics").text)
        start = time.perf_counter()
        answer = _post(url, "/v1/translate", {"text": document, "target_lang": "de"})
        seconds = time.perf_counter() - start
        after = _mean_rows(httpx.get(url + "/metrics").text)
        alone_rows = [alone_rows[0] + after[0] - before[0], alone_rows[1] + after[1] - before[1]]
        http_seconds.append(seconds)
        http_tps.append(answer["usage"]["output_tokens"] / seconds)
        start = time.perf_counter()
        results = translator.translate(units, target_lang="de", max_batch_size=args.batch_size)
        offline_tps.append(sum(r.output_tokens for r in results) / (time.perf_counter() - start))
        start = time.perf_counter()
        plan()
        plan_seconds.append(time.perf_counter() - start)
    rows_before = _mean_rows(httpx.get(url + "/metrics").text)
    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrent) as pool:
        body = {"text": document, "target_lang": "de"}

        def timed() -> tuple[dict[str, Any], float]:
            began = time.perf_counter()
            return _post(url, "/v1/translate", body), time.perf_counter() - began

        jobs = [pool.submit(timed) for _ in range(args.concurrent)]
        answers = [job.result()[0] for job in jobs]
        latencies = sorted(job.result()[1] for job in jobs)
    together = time.perf_counter() - start
    rows_after = _mean_rows(httpx.get(url + "/metrics").text)
    steps = rows_after[1] - rows_before[1]
    return {
        "words": len(document.split()),
        "sentences": len(units),
        "http_tokens_per_second": round(statistics.median(http_tps), 1),
        "offline_tokens_per_second": round(statistics.median(offline_tps), 1),
        "http_vs_offline": round(statistics.median(http_tps) / statistics.median(offline_tps), 3),
        "plan_seconds": round(statistics.median(plan_seconds), 4),
        "document_seconds": round(statistics.median(http_seconds), 3),
        "plan_share": round(statistics.median(plan_seconds) / statistics.median(http_seconds), 4),
        "mean_rows_per_step": round(alone_rows[0] / alone_rows[1], 1) if alone_rows[1] else None,
        "concurrent_documents": args.concurrent,
        "concurrent_tokens_per_second": round(
            sum(a["usage"]["output_tokens"] for a in answers) / together, 1
        ),
        "concurrent_mean_rows_per_step": round((rows_after[0] - rows_before[0]) / steps, 1)
        if steps
        else None,
        # sharing batches, the documents finish together; one after another, at 1x, 2x, ... 4x
        "concurrent_seconds": [round(x, 3) for x in latencies],
        "max_batch_rows": args.max_batch_rows,
    }


def cmd_bench_documents(args: argparse.Namespace) -> int:
    from attnserve.bench.lm_http import running
    from attnserve.loadtest.runner import free_port

    model = Path(args.model)
    port = free_port()
    command = [
        sys.executable, "-m", "attnserve.cli", "serve", "--model", str(model),
        "--variant", args.variant,
        "--host", "127.0.0.1", "--port", str(port), "--max-batch-rows", str(args.max_batch_rows),
        *(["--threads", str(args.threads)] if args.threads else []),
    ]  # fmt: skip
    out_dir = Path(args.output_dir) if args.output_dir else Path(tempfile.mkdtemp())
    out_dir.mkdir(parents=True, exist_ok=True)
    with running(command, port, out_dir / "server.log", timeout=600) as url:
        runs = paragraphs(args.paragraphs, args.verses, args.seed)
        result: dict[str, Any] = {"quality": quality(url, runs)}
        result["markup"] = markup(url, runs, args.seed)
        document = long_document(args.words, args.verses, args.seed)
        result["speed"] = speed(url, model, document, args)
    (out_dir / "documents.json").write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    return 0


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| direction | paragraphs | BLEU documents | BLEU unsplit | BLEU sentence by sentence |",
        "|---|---|---|---|---|",
    ]
    for q in result["quality"]:
        lines.append(
            f"| {q['direction']} | {q['paragraphs']} | {q['documents']} | {q['unsplit']} | "
            f"{q['sentence_by_sentence']} |"
        )
    m = result["markup"]
    lines += [
        "",
        f"html: {m['sentences']} verses with 1-3 words in <b>: the tag kept once in "
        f"{m['tag_kept']}, around exactly the separate translation of its words in "
        f"{m['exact_match']} ({m['exact_match'] / max(m['sentences'], 1):.0%}).",
    ]
    s = result["speed"]
    lines += [
        "",
        "| words | sentences | HTTP tokens/s | offline tokens/s | ratio | plan s | document s | "
        f"plan share | rows per step | {s['concurrent_documents']} at once tokens/s | "
        "rows per step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {s['words']} | {s['sentences']} | {s['http_tokens_per_second']} | "
        f"{s['offline_tokens_per_second']} | {s['http_vs_offline']} | {s['plan_seconds']} | "
        f"{s['document_seconds']} | {s['plan_share']:.2%} | {s['mean_rows_per_step']} | "
        f"{s['concurrent_tokens_per_second']} | {s['concurrent_mean_rows_per_step']} |",
        "",
        f"{s['concurrent_documents']} documents at once finished after "
        + ", ".join(f"{x:.2f}" for x in s["concurrent_seconds"])
        + f" s (one alone: {s['document_seconds']:.2f} s).",
    ]
    return "\n".join(lines)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "bench-documents",
        help="documents through HTTP: paragraph BLEU, speed against offline translate, overhead",
    )
    p.add_argument("--model", type=Path, default=default_model_dir())
    p.add_argument("--variant", default=DEFAULT_VARIANT)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--paragraphs", type=int, default=20)
    p.add_argument("--verses", type=int, default=6, help="verses a paragraph")
    p.add_argument("--words", type=int, default=2000, help="words of the long document")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--concurrent", type=int, default=4, help="documents at once")
    p.add_argument("--batch-size", type=int, default=32, help="offline sentences a batch")
    p.add_argument("--max-batch-rows", type=int, default=128, help="the server's")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-dir", default=None)
    p.set_defaults(func=cmd_bench_documents)
