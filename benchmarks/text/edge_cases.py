"""Edge cases: astral/CJK offsets, repeated sentences, empty input, pathological lengths."""
import time

import segmenters as S

CASES = {
    "emoji": ("en", "I love it 😀. Do you? Yes 👍🏽! Ok."),
    "cjk": ("en", "这是一支笔。那是一本书！你好吗？"),
    "repeat": ("en", "Yes. Yes. Yes. No. Yes."),
    "empty": ("en", ""),
    "spaces": ("en", "   \n  "),
    "nopunct": ("de", "ein satz ohne punkt und ohne großbuchstaben"),
    "crlf": ("en", "One line.\r\nTwo line.\r\n\r\nThree."),
    "tabs": ("de", "Erster Satz.\t\tZweiter Satz.   Dritter."),
}
for name in S.SEGMENTERS:
    split, _ = S.make_segmenter(name)
    out = []
    for case, (lang, text) in CASES.items():
        try:
            spans = split(text, lang)
            ok = S.offsets_exact(text, spans)
            out.append(f"{case}:{'ok' if ok else 'BAD'}{len(spans)}")
        except Exception as e:
            out.append(f"{case}:EXC {type(e).__name__}: {str(e)[:60]}")
    # pathological: 50k chars without punctuation, and 5k tiny sentences in one string
    for label, text in (("50k-no-punct", "wort " * 10000), ("5k-sentences", "Ja. " * 5000),
                        ("dots", "a." * 5000 + " Ende.")):
        t = time.perf_counter()
        try:
            split(text, "de")
            out.append(f"{label}:{time.perf_counter() - t:.2f}s")
        except Exception as e:
            out.append(f"{label}:EXC {type(e).__name__}")
    print(name, " | ".join(out))
