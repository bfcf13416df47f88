#!/usr/bin/env python3
"""Writes docs/config.md, the reference of every key of the cluster YAML, from its schema.

The schema is ``ClusterConfig`` in deploy/config.py and the sections it holds. Each key's meaning is the
docstring under its field; its type, bounds and default are read from the model, so the reference says
what the loader accepts. ``--check`` compares instead of writing; tests/deploy/test_config_reference.py
does the same in the test suite, and also fails when a field has no docstring.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import annotated_types
import yaml
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as `python3 scripts/config_reference.py` from a checkout
    sys.path.insert(0, str(REPO))

from deploy.config import INSTANCE_ENGINE_KEYS, ClusterConfig, Instance  # noqa: E402

OUT = REPO / "docs" / "config.md"
COMMAND = "python3 scripts/config_reference.py"
INSTANCE_LISTS = ("prefill", "decode", "colocated")
INSTANCE_PATH = "<role>[]"  # the key prefix of an instance's keys: prefill[], decode[] or colocated[]
INSTANCE_TITLE = "prefill, decode, colocated: the instances"
YAML_END = "\n..."  # what yaml.safe_dump ends a lone scalar with

HEADER = f"""\
# Cluster config reference

<!-- Generated from the schema (deploy/config.py) by `{COMMAND}`: edit the schema, not this file. -->

One YAML file describes a cluster: `pdserve launch`, each `pdserve prefill|decode|router` and
`pdserve render k8s` read the same file. It is loaded strictly: an unknown key or a bad value stops
the start with one line naming the file, the key and the value. A key left out takes its default;
the defaults are those of the process that uses the key. `null` is YAML's empty value; where a key
may be null, its meaning says what null stands for. Keys of type secret are never shown, logged or
echoed in an error. The shipped clusters are in [configs/](../configs/); the README's
"Configure" section shows the keys most often set.
"""


@dataclass
class Row:
    key: str  # the dotted path
    type: str
    default: str
    meaning: str
    link: str | None = None  # the anchor of the section the key holds

    def cells(self) -> list[str]:
        key = f"[`{self.key}`](#{self.link})" if self.link else f"`{self.key}`"
        return [key, _cell(self.type), _cell(self.default), _cell(self.meaning)]


@dataclass
class Section:
    title: str
    doc: str
    rows: list[Row] = field(default_factory=list)


def anchor(title: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def _clean(text: str | None) -> str:
    """One paragraph of Markdown from a docstring (reST ``code`` becomes `code`)."""
    return " ".join(inspect.cleandoc(text or "").split()).replace("``", "`")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _model_of(annotation: object) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def type_text(annotation: object) -> str:
    """A reader's name for a type: int, list of str, one of `a`, `b`, int or null."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_text(args[0])
    if origin in (types.UnionType, typing.Union):
        present = [a for a in args if a is not type(None)]
        text = " or ".join(type_text(a) for a in present)
        return f"{text} or null" if len(present) < len(args) else text
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin is list:
        return "list of instances" if args == (Instance,) else f"list of {type_text(args[0])}"
    if origin is dict:
        return f"map of {type_text(args[0])} to {type_text(args[1])}"
    if annotation is dict:
        return "map"
    if annotation is SecretStr:
        return "secret"
    if _model_of(annotation) is not None:
        return "section"
    if annotation in (int, float, bool, str):
        return annotation.__name__
    raise TypeError(f"no name for the type {annotation!r}: teach scripts/config_reference.py one")


def _constraints(annotation: object, metadata: list[object]) -> list[object]:
    """The bounds of a field, also those inside an ``Annotated`` type of a union (``AtLeastOne | None``)."""
    found = list(metadata)
    for arg in typing.get_args(annotation):
        if isinstance(arg, FieldInfo):
            found += arg.metadata
        elif typing.get_args(arg):
            found += _constraints(arg, [])
    return found


def bounds_text(info: FieldInfo) -> str:
    """What a value must keep beyond its type: `1 to 256`, `> 0`, `>= 1`, `16+ characters`, a pattern."""
    lo = hi = None
    parts = []
    for c in _constraints(info.annotation, info.metadata):
        if isinstance(c, annotated_types.Ge):
            lo = f"{c.ge}"
        elif isinstance(c, annotated_types.Gt):
            lo = f"> {c.gt}"
        elif isinstance(c, annotated_types.Le):
            hi = f"{c.le}"
        elif isinstance(c, annotated_types.Lt):
            hi = f"< {c.lt}"
        elif isinstance(c, annotated_types.MinLen):
            parts.append(f"{c.min_length}+ characters")
        elif isinstance(c, annotated_types.MaxLen):
            parts.append(f"at most {c.max_length} characters")
        elif pattern := getattr(c, "pattern", None):
            parts.append(f"matching `{pattern}`")
    if lo is not None and hi is not None:
        parts.insert(0, f"{lo} to {hi}" if not lo.startswith(">") else f"{lo}, <= {hi}")
    elif lo is not None:
        parts.insert(0, lo if lo.startswith(">") else f">= {lo}")
    elif hi is not None:
        parts.insert(0, hi if hi.startswith("<") else f"<= {hi}")
    return ", ".join(parts)


def _is_secret(annotation: object) -> bool:
    return annotation is SecretStr or any(_is_secret(a) for a in typing.get_args(annotation))


def default_text(model: type[BaseModel], name: str, info: FieldInfo) -> str:
    """The default as YAML writes it; `required`; or, for an instance's engine key, the key it inherits."""
    if info.is_required():
        return "required"
    if model is Instance and name in INSTANCE_ENGINE_KEYS:
        return f"`engine.{name}`"
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return ""
    if _is_secret(info.annotation) and value not in (None, [], ()):
        return "(hidden)"
    dumped = yaml.safe_dump(value, default_flow_style=True, width=1000).removesuffix("\n")
    return f"`{dumped.removesuffix(YAML_END).strip()}`"


def _walk(model: type[BaseModel], prefix: str, title: str, out: list[Section]) -> None:
    section = Section(title, _clean(model.__doc__))
    out.append(section)
    later: list[tuple[type[BaseModel], str]] = []
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        meaning = _clean(info.description)
        nested = _model_of(info.annotation)
        link = None
        if nested is not None:
            later.append((nested, key))
            link = anchor(key)
        elif model is ClusterConfig and name in INSTANCE_LISTS:
            link = anchor(INSTANCE_TITLE)
        bounds = bounds_text(info)
        kind = type_text(info.annotation) + (f" ({bounds})" if bounds else "")
        section.rows.append(Row(key, kind, default_text(model, name, info), meaning, link))
    for nested, key in later:
        _walk(nested, f"{key}.", key, out)


def sections() -> list[Section]:
    """Every section of the schema, the top level first, then each nested one, then the instances."""
    out: list[Section] = []
    _walk(ClusterConfig, "", "Top level", out)
    _walk(Instance, f"{INSTANCE_PATH}.", INSTANCE_TITLE, out)
    out[-1].doc += (
        f" Each item of `prefill`, `decode` and `colocated` takes these keys (`{INSTANCE_PATH}` "
        "below stands for any of them); an engine key left out (null) takes the value of the "
        "`engine` section, named in the default column."
    )
    return out


def missing_descriptions(root: type[BaseModel] = ClusterConfig) -> list[str]:
    """The dotted keys, under ``root`` and every section it holds, whose field has no docstring."""
    missing: list[str] = []
    seen: set[type[BaseModel]] = set()

    def visit(model: type[BaseModel], prefix: str) -> None:
        if model in seen:
            return
        seen.add(model)
        for name, info in model.model_fields.items():
            if not _clean(info.description):
                missing.append(f"{prefix}{name}")
            if (nested := _model_of(info.annotation)) is not None:
                visit(nested, f"{prefix}{name}.")
            for item in filter(None, map(_model_of, typing.get_args(info.annotation))):  # list[Instance]
                visit(item, f"{prefix}{name}[].")

    visit(root, "")
    return missing


def render() -> str:
    missing = missing_descriptions()
    if missing:
        raise SystemExit(f"config_reference.py: these keys have no docstring in the schema: {', '.join(missing)}")
    parts = [HEADER]
    all_sections = sections()
    parts.append(
        "Sections: " + ", ".join(f"[{s.title.split(':')[0]}](#{anchor(s.title)})" for s in all_sections) + ".\n"
    )
    for section in all_sections:
        parts.append(f"## {section.title}\n")
        if section.doc:
            parts.append(section.doc + "\n")
        lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
        lines += ["| " + " | ".join(r.cells()) + " |" for r in section.rows]
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


def count_keys() -> int:
    """Keys documented: every row but those that only name a section."""
    return sum(1 for s in sections() for r in s.rows if r.type != "section")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Write docs/config.md, the reference of every cluster YAML key, from the schema in "
        "deploy/config.py (each field's docstring is its meaning)."
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 when the file differs from what would be written"
    )
    parser.add_argument("--out", type=Path, default=OUT, help=f"the file (default {OUT.relative_to(REPO)})")
    args = parser.parse_args(argv)
    text = render()
    shown = args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out
    if args.check:
        current = args.out.read_text() if args.out.exists() else None
        if current != text:
            print(f"{shown} is stale: run {COMMAND} and commit it", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {shown}: {count_keys()} keys in {len(sections())} sections")
    return 0


if __name__ == "__main__":
    sys.exit(main())
