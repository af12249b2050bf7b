"""The configuration reference, docs/configuration.md, generated from the field docstrings and
the presets (``REFERENCE_COMMAND`` regenerates it; a test holds the file to what this makes)."""

from __future__ import annotations

import dataclasses
from typing import Any

from megaslide_ray.config.loading import describe_fields
from megaslide_ray.config.presets import PRESETS
from megaslide_ray.config.sections import SECTIONS, Config

REFERENCE_PATH = "docs/configuration.md"


REFERENCE_COMMAND = f"python -m megaslide_ray.config --write {REFERENCE_PATH}"


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def _preset_changes(cfg: Config) -> list[tuple[str, Any]]:
    """(SECTION.FIELD, value) of every field where ``cfg`` differs from ``Config()``."""
    base, out = Config(), []
    for section in SECTIONS:
        for f in dataclasses.fields(getattr(cfg, section)):
            value = getattr(getattr(cfg, section), f.name)
            if value != getattr(getattr(base, section), f.name):
                out.append((f"{section}.{f.name}", value))
    return out


def reference_markdown() -> str:
    """The configuration reference as Markdown: every section and field with its default and its
    docstring (``describe_fields``), then every preset with the fields it changes. This is
    ``docs/configuration.md``; ``REFERENCE_COMMAND`` regenerates it."""
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated from megaslide_ray/config/ by `{REFERENCE_COMMAND}`; do not edit by hand. -->",
        "",
        "Every field, as `--SECTION.FIELD VALUE` on the command line or `FIELD = VALUE` under `[SECTION]`",
        "in a TOML file (`--config`; a run's `config.toml` is one). Order of precedence: preset, then the",
        "`--config` file, then flags. Invalid values are refused before Ray starts, with the field and the",
        "value in the message. The defaults below are those of `Config()`, the `tiny` preset; the other",
        "presets change the fields listed under [Presets](#presets).",
        "",
    ]
    cfg = Config()
    for section in SECTIONS:
        sec = getattr(cfg, section)
        docs = describe_fields(type(sec))
        lines += [f"## [{section}]", "", "| field | default | meaning |", "|---|---|---|"]
        for f in dataclasses.fields(sec):
            lines.append(f"| `{section}.{f.name}` | `{getattr(sec, f.name)!r}` | {_md_cell(docs.get(f.name, ''))} |")
        lines.append("")
    lines += ["## Presets", "", "`--preset NAME` (default `tiny`) picks the starting point:", ""]
    for name, make in PRESETS.items():
        doc = " ".join((make.__doc__ or "").split())
        lines += [f"### `{name}`", "", doc, ""]
        changes = _preset_changes(make())
        if changes:
            lines += ["Fields that differ from the defaults above:", ""]
            lines += [f"- `{key}` = `{value!r}`" for key, value in changes if key != "preset"]
        else:
            lines.append("The defaults above.")
        lines.append("")
    return "\n".join(lines)


