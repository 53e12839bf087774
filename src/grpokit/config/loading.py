"""Building a Config: from nested dicts, TOML files and `--set section.key=value` overrides; and back to TOML."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from grpokit.config.algorithm import check_preset
from grpokit.config.checks import checked_value, did_you_mean, field_example, field_types, toml_value
from grpokit.config.presets import apply_preset
from grpokit.config.schema import SECTIONS, Config
from grpokit.errors import ConfigError, PresetError


def config_from_dict(raw: dict) -> Config:
    """Build a Config from nested dicts, rejecting unknown sections and keys; `algorithm.preset`'s
    fields (presets.py) are filled in under the values given."""
    for name, values in raw.items():  # names and types first: a preset merges into these values
        if name not in SECTIONS:
            raise ConfigError(f"unknown section [{name}]{did_you_mean(name, SECTIONS)}; known: {', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{name}] must be a table of key = value pairs")
        known = field_types(SECTIONS[name])
        for key, value in values.items():
            if key not in known:
                raise ConfigError(f"unknown key {name}.{key}{did_you_mean(key, known)}")
            checked_value(f"{name}.{key}", known[key], value, field_example(SECTIONS[name], key, f"{name}.{key}"))
    if isinstance(raw.get("algorithm"), dict):
        check_preset(raw["algorithm"].get("preset", ""))
        try:
            raw = apply_preset(raw)
        except PresetError as e:
            raise ConfigError(str(e)) from e
    sections = {name: SECTIONS[name](**values) for name, values in raw.items()}
    for required in ("model", "data"):
        if required not in sections:
            raise ConfigError(f"missing section [{required}]")
    return Config(**sections)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`section.key=value` → (["section", "key"], value); the value is read as TOML, else as a string.
    (`load_config` keeps the text itself for a string field: `output.dir=2024` means the folder "2024".)"""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    key, value = text.split("=", 1)
    path = key.strip().split(".")
    if len(path) != 2:
        raise ConfigError(f"--set {text!r}: the key must be section.key, e.g. train.steps=10")
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value
    return path, parsed


def load_config(path: str | Path | None = None, overrides: list[str] = (), base: dict | None = None) -> Config:
    """Read a TOML file (or start from `base`), apply `section.key=value` overrides, validate."""
    raw: dict = dict(base or {})
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        data = p.read_bytes()
        try:
            raw = tomllib.loads(data.decode("utf-8"))
        except UnicodeDecodeError as e:
            line = data[:e.start].count(b"\n") + 1
            raise ConfigError(f"{p}: line {line}: byte 0x{data[e.start]:02x} is not UTF-8; "
                              "re-save the file as UTF-8") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from e
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for text in overrides:
        (section, key), value = parse_override(text)
        if section in SECTIONS and field_types(SECTIONS[section]).get(key) is str and not isinstance(value, str):
            value = text.split("=", 1)[1]  # `--set output.dir=2024`: the shell user means the text "2024"
        if not isinstance(raw.setdefault(section, {}), dict):
            raise ConfigError(f"[{section}] must be a table of key = value pairs")
        raw[section][key] = value
    return config_from_dict(raw)


def to_toml(config: Config) -> str:
    """The resolved config as TOML, saved in the run folder."""
    lines = []
    for name, values in config.to_dict().items():
        lines.append(f"[{name}]")
        for key, value in values.items():
            lines.append(f"{key} = {toml_value(value)}")
        lines.append("")
    return "\n".join(lines)
