"""The configuration reference, rendered from the schema: every setting, its type, default
and description, so the document cannot drift from the code.

``python -m configs.reference`` (``make config-docs``) rewrites ``docs/configuration.md``;
``tests/configs/test_reference.py`` fails while the file differs from ``render()``.
"""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, NamedTuple, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from configs.schema import HybridServeConfig

REFERENCE_PATH = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"

_HEADER = """# Configuration reference

Generated from `configs/schema.py` by `make config-docs` (`python -m configs.reference`);
`tests/configs/test_reference.py` fails when this file is out of date. Edit the schema's
`Field(description=...)`, not this file.

Every setting is reachable the same three ways: a YAML file (`--config FILE`, nested keys),
`--set section.key=value` on every `hybridserve` command (values parsed as YAML), and the
`set` (or `router` / `replica` / `ingress`) args of `cluster.app:build_app`
(`deploy/serve.yaml`). Unknown keys and bad values are refused with the key named.
`hybridserve serve MODEL_DIR` also takes vLLM's flags for the common settings (`--port`,
`--tensor-parallel-size`, ...; `hybridserve serve --help`).
"""


class Setting(NamedTuple):
    key: str  # dotted, as ``--set`` takes it
    type: str
    default: str
    description: str


class Section(NamedTuple):
    name: str  # "" for the top-level settings
    description: str
    settings: list[Setting]


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def type_text(annotation: Any) -> str:
    """A field's type in YAML words (``int or null``, ``list of int``, ``auto | cpu``)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_text(a) for a in args)
    if origin is tuple:
        return f"list of {type_text(args[0])}"
    if origin is dict:
        return f"map of {type_text(args[0])} to {type_text(args[1])}"
    return {str: "string", bool: "bool"}.get(annotation, getattr(annotation, "__name__", str(annotation)))


def default_text(field: FieldInfo) -> str:
    """The default as YAML would spell it; a computed default shows its ``shown_default``."""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if "shown_default" in extra:
        return str(extra["shown_default"])
    value = field.default
    if value is PydanticUndefined:
        value = field.default_factory()  # type: ignore[call-arg,misc]
    return json.dumps(list(value) if isinstance(value, tuple) else value)


def settings_of(model: type[BaseModel], prefix: str = "") -> Iterator[Setting]:
    """Every leaf setting of ``model`` in declaration order (sections excluded)."""
    for name, field in model.model_fields.items():
        if not _is_section(field.annotation):
            yield Setting(prefix + name, type_text(field.annotation), default_text(field), field.description or "")


def sections() -> list[Section]:
    """The top-level settings, then one section per sub-model of the schema."""
    out = [Section("", "the model and the engine as a whole", list(settings_of(HybridServeConfig)))]
    for name, field in HybridServeConfig.model_fields.items():
        if _is_section(field.annotation):
            settings = list(settings_of(field.annotation, name + "."))
            out.append(Section(name, field.description or "", settings))
    return out


def setting(key: str) -> Setting:
    """The setting with dotted ``key``; KeyError names it when the schema has none."""
    found = {s.key: s for section in sections() for s in section.settings}
    if key not in found:
        raise KeyError(f"no config setting {key!r}")
    return found[key]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;")


def render() -> str:
    lines = [_HEADER]
    for section in sections():
        lines += [
            f"## {f'`{section.name}`' if section.name else 'Top level'}: {section.description}",
            "",
            "| key | type | default | description |",
            "| --- | --- | --- | --- |",
        ]
        lines += [f"| `{s.key}` | {_cell(s.type)} | `{s.default}` | {_cell(s.description)} |" for s in section.settings]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Write the reference (or the path given as the one argument)."""
    path = Path(argv[0]) if argv else REFERENCE_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render())
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
