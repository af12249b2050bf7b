"""A config from a preset, a TOML file and ``--section.field value`` overrides, and back to TOML.

``build_config(preset, file, overrides)`` is what every command calls: the preset's config,
the file's tables, then the overrides, each value coerced to its field's type, then
``validate``. ``to_toml`` writes a run's ``config.toml``, which ``--resume`` reads back.
Fields added after a run was saved take their old behaviour when the saved config lacks them
(``ADDED_LATER``)."""

from __future__ import annotations

import ast
import dataclasses
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

from megaslide_ray.config.presets import preset
from megaslide_ray.config.sections import SECTIONS, Config, ConfigError
from megaslide_ray.config.validate import validate

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib


def describe_fields(cls: type) -> dict[str, str]:
    """Field name -> docstring, read from the source of a config dataclass."""
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(section: str, name: str, tp: Any, value: Any) -> Any:
    """Convert ``value`` (a CLI string, or a TOML value) to the field's declared type."""
    where = f"{section}.{name}"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):  # e.g. ``int | Literal["auto"]``: the first that takes it
        for option in typing.get_args(tp):
            try:
                return _coerce(section, name, option, value)
            except ConfigError:
                continue
        kinds = [" or ".join(repr(c) for c in typing.get_args(a)) if typing.get_origin(a) is Literal
                 else {"int": "an integer", "float": "a number"}.get(a.__name__, a.__name__) for a in typing.get_args(tp)]
        raise ConfigError(f"{where}={value!r} is not {' or '.join(kinds)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{where}={value!r} is not one of {list(choices)}")
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if isinstance(value, str):
            parts = [p for p in value.replace("(", "").replace(")", "").replace("x", ",").split(",") if p.strip()]
        else:
            parts = list(value)
        if len(args) == 2 and args[1] is Ellipsis:  # ``tuple[int, ...]``: any number, "" none
            return tuple(_coerce(section, name, args[0], p) for p in parts)
        if len(parts) != len(args):
            raise ConfigError(f"{where}={value!r} needs {len(args)} values, e.g. "
                              f"--{where} {','.join('1' for _ in args)}")
        return tuple(_coerce(section, name, a, p) for a, p in zip(args, parts))
    try:
        if tp is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if tp is int:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            if isinstance(value, str):
                f = float(value)
                if not f.is_integer():
                    raise ValueError(value)
                return int(f)
            return int(value)
        if tp is float:
            return float(value)
        if tp is str:
            return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}={value!r} is not a valid {tp.__name__}") from None
    raise ConfigError(f"{where}: unsupported field type {tp}")  # pragma: no cover


def apply_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """Set dotted keys (``model.depth``) on ``cfg``; unknown keys are refused."""
    for key, value in overrides.items():
        if key == "preset":
            cfg.preset = str(value)
            continue
        if "." not in key:
            raise ConfigError(f"unknown config key {key!r}: use SECTION.FIELD with SECTION in {list(SECTIONS)}")
        section, name = key.split(".", 1)
        if section not in SECTIONS:
            raise ConfigError(f"unknown config section {section!r} in {key!r}; sections are {list(SECTIONS)}")
        sec = getattr(cfg, section)
        types = _field_types(type(sec))
        if name not in types:
            raise ConfigError(f"unknown config key {key!r}; {section} has {sorted(types)}")
        setattr(sec, name, _coerce(section, name, types[name], value))
    return cfg


def _flatten_toml(doc: dict[str, Any]) -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in doc.items():
        if isinstance(value, dict):
            for sub, v in value.items():
                if isinstance(v, dict):
                    raise ConfigError(f"config table [{key}.{sub}] is nested too deeply; use [{key}] with {sub} = ...")
                flat[f"{key}.{sub}"] = v
        else:
            flat[key] = value
    return flat


def load_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        with p.open("rb") as f:
            return _flatten_toml(tomllib.load(f))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid TOML: {e}") from None


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(v)  # pragma: no cover


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML; ``--config`` reads it back to the same Config. When the model
    is not the preset's (a diffusers folder's own shape, ``--model.*`` flags), a comment says so:
    the preset is only where the other fields started."""
    lines = [f"preset = {_toml_value(cfg.preset)}"]
    try:
        differs = preset(cfg.preset).model != cfg.model
    except ConfigError:
        differs = False
    if differs:
        lines.append(f"# [model] below is this run's own, not preset {cfg.preset}'s (the preset is where the other "
                     f"fields started)")
    for section in SECTIONS:
        lines.append(f"\n[{section}]")
        for f in dataclasses.fields(getattr(cfg, section)):
            lines.append(f"{f.name} = {_toml_value(getattr(getattr(cfg, section), f.name))}")
    return "\n".join(lines) + "\n"


ADDED_LATER: dict[str, Any] = {
    "model.caption_layers": 0,  # before it: a bag-of-bytes caption encoder
    "training.caption_dropout": 0.0,  # before it: captions were never dropped
    "model.cross_attention": False,  # before it: the pooled caption was the only condition
}
"""Fields added after runs were already being saved, with the behaviour of the time before them.
A saved config (a run's ``config.toml``, a checkpoint's state) records every field of its day, so
a field it lacks was not there yet: the run is continued, evaluated or sampled as it was trained
(its checkpoint holds that model), not with today's default."""


def _with_old_behaviour(values: dict[str, Any]) -> dict[str, Any]:
    return {**{k: v for k, v in ADDED_LATER.items() if k not in values}, **values}


def build_config(preset_name: str | None = None, config_file: str | None = None,
                 overrides: dict[str, Any] | None = None, saved_run: bool = False) -> Config:
    """Preset, then TOML file, then CLI overrides; validated. ``saved_run``: the file is a run's
    own ``config.toml``, so fields it lacks keep their old behaviour (``ADDED_LATER``)."""
    file_values = load_toml(config_file) if config_file else {}
    if saved_run:
        file_values = _with_old_behaviour(file_values)
    name = preset_name or file_values.pop("preset", None) or "tiny"
    file_values.pop("preset", None)
    cfg = preset(name)
    apply_overrides(cfg, file_values)
    apply_overrides(cfg, overrides or {})
    validate(cfg)
    return cfg


def config_from_dict(doc: dict[str, Any]) -> Config:
    """The config a ``Config.to_dict()`` describes (a checkpoint's ``state.json``): its preset,
    then every field it records; fields it lacks keep their old behaviour (``ADDED_LATER``). Not
    validated: the caller may still change the clip shape."""
    cfg = preset(doc.get("preset", "tiny"))
    apply_overrides(cfg, _with_old_behaviour({f"{section}.{name}": value for section in SECTIONS
                                              for name, value in doc.get(section, {}).items()}))
    return cfg


def parse_overrides(extra: list[str]) -> dict[str, str]:
    """``--section.field value`` / ``--section.field=value`` pairs -> {"section.field": "value"}."""
    out: dict[str, str] = {}
    i = 0
    while i < len(extra):
        tok = extra[i]
        if not tok.startswith("--") or "." not in tok:
            raise ConfigError(f"unrecognised argument {tok!r}; config fields are given as --SECTION.FIELD VALUE "
                              f"with SECTION in {list(SECTIONS)} (see --help-config)")
        key = tok[2:]
        if "=" in key:
            key, value = key.split("=", 1)
        else:
            if i + 1 >= len(extra):
                raise ConfigError(f"{tok} needs a value")
            i += 1
            value = extra[i]
        out[key] = value
        i += 1
    return out
