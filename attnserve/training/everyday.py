"""Twenty everyday sentences a newcomer types, fixed before the default model was trained on
modern text, and how a model translates them (`attnserve eval --split everyday`).

Directions, shopping, work, travel, weather and computers; ten English sentences to translate
into German, ten German ones into English, each with a reference translation. The list does not
change with the model: the model card and README show every output, right or wrong, so that
what a model gets right is not picked for luck. Twenty sentences are too few for BLEU to mean
much (it is reported, as with any split); chrF and reading the outputs say more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from attnserve.training.catalogs import dedup_key


@dataclass(frozen=True)
class Example:
    source_lang: str
    target_lang: str
    topic: str
    source: str
    reference: str


def _examples(
    source_lang: str, target_lang: str, rows: Sequence[tuple[str, str, str]]
) -> tuple[Example, ...]:
    return tuple(Example(source_lang, target_lang, *row) for row in rows)


EVERYDAY: tuple[Example, ...] = _examples(
    "en",
    "de",
    (
        ("work", "The meeting has been moved to Tuesday afternoon.",
         "Die Besprechung wurde auf Dienstagnachmittag verschoben."),
        ("work", "Could you send me the report by Friday?",
         "Könnten Sie mir den Bericht bis Freitag schicken?"),
        ("directions", "Turn left at the next traffic light and then go straight ahead.",
         "Biegen Sie an der nächsten Ampel links ab und gehen Sie dann geradeaus."),
        ("shopping", "How much does this jacket cost?", "Wie viel kostet diese Jacke?"),
        ("weather", "It will rain tomorrow, so take an umbrella.",
         "Morgen wird es regnen, also nimm einen Regenschirm mit."),
        ("computers", "My computer does not start anymore.", "Mein Computer startet nicht mehr."),
        ("directions", "Where is the nearest train station?", "Wo ist der nächste Bahnhof?"),
        ("travel", "I would like to book a room for two nights.",
         "Ich möchte ein Zimmer für zwei Nächte buchen."),
        ("computers", "Please save the file before you close the program.",
         "Bitte speichern Sie die Datei, bevor Sie das Programm schließen."),
        ("shopping", "The supermarket closes at eight o'clock in the evening.",
         "Der Supermarkt schließt um acht Uhr abends."),
    ),
) + _examples(
    "de",
    "en",
    (
        ("travel", "Der Zug nach Berlin fällt heute aus.",
         "The train to Berlin is cancelled today."),
        ("directions", "Ich suche eine Apotheke in der Nähe.",
         "I am looking for a pharmacy nearby."),
        ("directions", "Können Sie mir sagen, wie ich zum Flughafen komme?",
         "Can you tell me how to get to the airport?"),
        ("weather", "Heute ist es sonnig und warm.", "Today it is sunny and warm."),
        ("computers", "Ich habe mein Passwort vergessen.", "I have forgotten my password."),
        ("work", "Wir treffen uns um zehn Uhr im Büro.",
         "We are meeting at ten o'clock in the office."),
        ("shopping", "Haben Sie diese Schuhe auch in Größe 42?",
         "Do you also have these shoes in size 42?"),
        ("travel", "Der Bus fährt alle fünfzehn Minuten.", "The bus runs every fifteen minutes."),
        ("computers", "Bitte starten Sie den Rechner neu.", "Please restart the computer."),
        ("weather", "Am Wochenende soll es schneien.", "It is supposed to snow at the weekend."),
    ),
)  # fmt: skip


def examples(source_lang: str, target_lang: str) -> list[Example]:
    """The examples of one direction, in the list's order."""
    return [e for e in EVERYDAY if (e.source_lang, e.target_lang) == (source_lang, target_lang)]


def everyday_keys() -> set[str]:
    """Every source and reference of the list in `dedup_key` form: `attnserve data build` drops
    a training pair of any set with a side equal to one of them, so that the list stays unseen."""
    return {dedup_key(text) for e in EVERYDAY for text in (e.source, e.reference)}


def markdown(rows: Sequence[tuple[Example, str]]) -> str:
    """A table of every example and its translation (`|` in a text escaped)."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| # | direction | source | translation | reference |", "|---|---|---|---|---|"]
    for i, (example, output) in enumerate(rows, 1):
        lines.append(
            f"| {i} | {example.source_lang}->{example.target_lang} | {cell(example.source)} | "
            f"{cell(output)} | {cell(example.reference)} |"
        )
    return "\n".join(lines) + "\n"
