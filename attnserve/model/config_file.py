"""`ConfigFile`: what every architecture config shares: dict and JSON round trips, presets."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, ClassVar, Self


class ConfigFile:
    """A mixin for frozen dataclass configs; a subclass sets `PRESETS` after its definition."""

    PRESETS: ClassVar[dict[str, Any]] = {}

    def replace(self, **changes: Any) -> Self:
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Self:
        known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields: {', '.join(unknown)}")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Self:
        return cls.from_dict(json.loads(Path(path).read_text()))

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> Self:
        """A named preset of `PRESETS` with optional overrides."""
        try:
            base: Self = cls.PRESETS[name]
        except KeyError:
            raise ValueError(
                f"unknown preset {name!r}; choose from {sorted(cls.PRESETS)}"
            ) from None
        return base.replace(**overrides) if overrides else base
