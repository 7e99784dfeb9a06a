"""Reading the deployment files as their tools would: Dockerfile stages, Compose defaults, PromQL.

The parsers cover what our own files use (they are tested on them), not every corner of the
formats: the real tools (hadolint, Compose's schema, promtool, Kubernetes' schemas) check those.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from attnserve.cli import build_parser
from attnserve.service.launch import settings_from_args
from attnserve.service.settings import Settings

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DOCKERFILE = REPO / "Dockerfile"
COMPOSE = REPO / "docker-compose.yml"
PROMETHEUS_DIR = DEPLOY / "prometheus"
GRAFANA_DIR = DEPLOY / "grafana"
DASHBOARD = GRAFANA_DIR / "dashboards" / "attnserve.json"
K8S_DIR = DEPLOY / "k8s"
REQUIREMENTS_DIR = DEPLOY / "docker"
ENV_PREFIX = "ATTNSERVE_"


def tool(name: str, package: str) -> str:
    """The path of a command-line tool (the venv's first), or skip saying how to get it."""
    found = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if found is None:
        pytest.skip(f"`{name}` is not installed: it comes with {package} (`make test` installs it)")
    return found


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def load_yaml_all(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")) if doc]


# ---- Dockerfile


@dataclass
class Stage:
    """One `FROM ... AS name` of a Dockerfile with its instructions, ARGs substituted."""

    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kind, args in self.instructions if kind == keyword]

    def last(self, keyword: str) -> str:
        found = self.all(keyword)
        assert found, f"stage {self.name} has no {keyword}"
        return found[-1]

    def env(self) -> dict[str, str]:
        values: dict[str, str] = {}
        for args in self.all("ENV"):
            for pair in shlex.split(args):
                key, _, value = pair.partition("=")
                values[key] = value
        return values

    def exec_form(self, keyword: str) -> list[str]:
        """CMD / HEALTHCHECK's command in JSON (exec) form."""
        args = self.last(keyword)
        if keyword == "HEALTHCHECK":
            args = args.split(" CMD ", 1)[1]
        command: list[str] = json.loads(args)
        return command

    def volumes(self) -> list[str]:
        return [path for args in self.all("VOLUME") for path in json.loads(args)]

    def copies_from(self) -> list[tuple[str, str, str]]:
        """(stage, source, destination) of every `COPY --from=stage source destination`."""
        copies = []
        for args in self.all("COPY"):
            words = args.split()
            if words[0].startswith("--from="):
                copies.append((words[0].removeprefix("--from="), words[1], words[-1]))
        return copies


def _logical_lines(text: str) -> Iterator[str]:
    """Instructions with their continuation lines joined; comments dropped."""
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        yield current + line
        current = ""
    if current:
        yield current


def _substitute(text: str, args: Mapping[str, str]) -> str:
    """${NAME} and $NAME of known ARGs; other variables ($PATH) stay as they are."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return args.get(name, match.group(0))

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, text)


def parse_dockerfile(path: Path = DOCKERFILE) -> list[Stage]:
    global_args: dict[str, str] = {}
    stage_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _logical_lines(path.read_text(encoding="utf-8")):
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            base, _, name = _substitute(args, global_args).partition(" AS ")
            stages.append(Stage(name.strip() or str(len(stages)), base.strip()))
            stage_args: dict[str, str] = {}
            continue
        if keyword == "ARG":
            name, _, default = args.partition("=")
            if not stages:
                global_args[name] = default
            else:  # a stage's ARG without a default inherits the global one
                stage_args[name] = default if default else global_args.get(name, "")
            continue
        if stages:
            stages[-1].instructions.append((keyword, _substitute(args, stage_args).strip()))
    return stages


def dockerfile_stages() -> dict[str, Stage]:
    return {stage.name: stage for stage in parse_dockerfile()}


# ---- Settings from images, Compose files and manifests


def settings_names(env: Mapping[str, str]) -> list[str]:
    """The ATTNSERVE_* variables of `env` that name no setting (there should be none)."""
    return [
        key
        for key in env
        if key.startswith(ENV_PREFIX)
        and key.removeprefix(ENV_PREFIX).lower() not in Settings.model_fields
    ]


def resolve_settings(
    monkeypatch: pytest.MonkeyPatch, env: Mapping[str, str], command: list[str]
) -> Settings:
    """What `command` (["attnserve", "serve", ...]) starts with `env`, nothing else, set."""
    assert command[:2] == ["attnserve", "serve"], command
    unknown = settings_names(env)
    assert not unknown, f"variables that no setting reads: {unknown}"
    for key in list(os.environ):
        if key.startswith(ENV_PREFIX):
            monkeypatch.delenv(key)
    for key, value in env.items():
        if key.startswith(ENV_PREFIX):
            monkeypatch.setenv(key, value)
    return settings_from_args(build_parser().parse_args(command[1:]))


def compose_defaults(text: str, variables: Mapping[str, str] | None = None) -> str:
    """Compose interpolation with `variables` set and every other one unset: ${X:-default}
    -> X's value or default, ${X} -> X's value or ""; $$ -> $."""
    given = variables or {}

    def value(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return given.get(match.group(1)) or match.group(2) or ""

    return re.sub(r"\$\$|\$\{(\w+)(?::?-([^}]*))?\}", value, text)


def load_compose(variables: Mapping[str, str] | None = None) -> dict[str, Any]:
    """docker-compose.yml as Compose reads it with `variables` set, no others (merge keys
    resolved)."""
    text = compose_defaults(COMPOSE.read_text(encoding="utf-8"), variables)
    loaded: dict[str, Any] = yaml.safe_load(text)
    return loaded


def duration_seconds(text: str) -> float:
    """A Compose / Go duration such as "40s", "1m30s" in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


# ---- PromQL

# Functions, aggregations and keywords that can stand where a metric name could.
_PROMQL_WORDS = """
    abs absent absent_over_time avg avg_over_time bool bottomk ceil changes clamp clamp_max
    clamp_min count count_over_time count_values delta deriv exp floor group group_left
    group_right histogram_quantile idelta ignoring increase irate label_join label_replace
    label_values last_over_time ln log2 log10 max max_over_time min min_over_time offset on
    predict_linear quantile quantile_over_time rate resets round scalar sgn sort sort_desc
    stddev stdvar sum sum_over_time time timestamp topk vector without by and or unless
"""
PROMQL_WORDS = frozenset(_PROMQL_WORDS.split())


def promql_metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: label matchers, ranges, grouping and string
    literals removed, then every identifier that is no function or keyword."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', " ", expr)  # strings (label values, legends)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range and subquery windows
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\$\w+", " ", text)  # Grafana variables
    names = re.findall(r"(?<![\w.])[a-zA-Z_:][\w:]*(?![\w.])", text)
    return {name for name in names if name not in PROMQL_WORDS}


# ---- Requirements of the runtime images


def read_requirements(path: Path) -> list[str]:
    """The requirement lines of a pip requirements file, `-r` files included."""
    lines: list[str] = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith("-r "):
            lines += read_requirements(path.parent / line.removeprefix("-r ").strip())
        elif line:
            lines.append(line)
    return lines
