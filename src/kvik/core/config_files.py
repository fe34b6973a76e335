"""Configuration files: YAML mappings turned into typed dataclasses, with errors that name the key.

Shared by the data pipeline and training (which may not import each other), so both accept the same
YAML conventions: unknown or missing keys are errors, nested mappings become nested dataclasses, and
numbers written like `3e-4` (a string to PyYAML) are read as floats.
"""

from __future__ import annotations

import dataclasses
import hashlib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from kvik.core.errors import ConfigError


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The YAML mapping in `path` (an empty file is an empty mapping)."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def build_dataclass(cls: type, data: Any, where: str) -> Any:
    """Build dataclass `cls` from plain YAML data, checking keys and converting nested types."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"{where or 'config'}: unknown key(s) {', '.join(map(str, unknown))}; "
                          f"known: {', '.join(sorted(known))}")
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where or 'config'}: missing required key(s) {', '.join(missing)}")
    values = {name: _convert(hints[name], value, f"{where}.{name}".lstrip("."))
              for name, value in data.items()}
    return cls(**values)


def _convert(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None:
            return None
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
        origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return build_dataclass(hint, value, where)
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list")
        return [_convert(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        key_type, value_type = typing.get_args(hint)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping")
        # Any stays as written; scalar types are coerced (YAML keys and values are often strings).
        return {(k if key_type is Any else key_type(k)): (v if value_type is Any else value_type(v))
                for k, v in value.items()}
    if hint is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:  # PyYAML reads "3e-4" (no dot) as a string
            return float(value)
        except ValueError:
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
    if hint in (int, float, str, bool) and not isinstance(value, hint):
        raise ConfigError(f"{where}: expected {hint.__name__}, got {value!r}")
    return value


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
