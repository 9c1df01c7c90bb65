"""The docs site's configuration reference, generated from the pydantic models in
``streamtrain/config.py`` so that it cannot drift from the code.

    python -m streamtrain.dev.docs           # rewrite docs/configuration.md
    python -m streamtrain.dev.docs --check   # exit 1 if it is stale, or if a field has no description

``make docs`` rewrites it and builds the site; the test suite runs the check.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from streamtrain import config
from streamtrain.dev import CHECKOUT

REFERENCE = CHECKOUT / "docs" / "configuration.md"
REGENERATE = "python -m streamtrain.dev.docs"


class UndocumentedFields(ValueError):
    """Config fields without a ``description=``: the reference would show them blank."""


def config_reference(root: type[BaseModel] = config.WorkerConfig) -> str:
    """The reference page's markdown: one table per section, each field with its type, default,
    environment variable and description. Raises UndocumentedFields naming every field without one."""
    sections = list(_sections(root, []))
    missing = [
        ".".join([*path, name])
        for path, model in sections
        for name, field in model.model_fields.items()
        if not (field.description or "").strip()
    ]
    if missing:
        raise UndocumentedFields(
            "config fields without a description (add description= in streamtrain/config.py): " + ", ".join(missing)
        )
    lines = [
        "# Configuration reference",
        "",
        f"<!-- Generated from streamtrain/config.py by `{REGENERATE}`; do not edit. -->",
        "",
        "The worker reads one YAML file (`streamtrain worker --config FILE`); start from `deploy/worker.yaml`, "
        "the reference config. This page is generated from the pydantic models in `streamtrain/config.py`: "
        f"`{REGENERATE}` (or `make docs`) rewrites it, and the test suite fails when it is stale or a field has "
        "no description.",
        "",
        _docstring(config),
        "",
        "A variable `STREAMTRAIN_…__…` that names no field is refused, with the nearest field; a bad value "
        "is refused at start-up (exit code 2) with each bad field and what to do about it. `<i>` in a "
        "variable is a list index, from 0.",
        "",
    ]
    lines += [f"- [{_title(path)}](#{_slug(_title(path))}): {_cell(_docstring(model))}" for path, model in sections[1:]]
    for path, model in sections[1:]:
        lines += ["", f"## {_title(path)}", "", _cell(_docstring(model)), ""]
        lines += ["| field | type | default | description |", "|---|---|---|---|"]
        for name, field in model.model_fields.items():
            env = config.ENV_PREFIX + "__".join([*path, name]).upper().replace("[I]", "__<i>")
            if _origin(field.annotation) is dict:
                env += "__<property>"
            cell = f"`{name}`<br>`{env}`"
            lines.append(
                f"| {cell} | {_type(field.annotation, [*path, name])} | {_default(field)} | "
                f"{_cell(field.description or '')} |"
            )
    return "\n".join(lines) + "\n"


def _sections(model: type[BaseModel], path: list[str]):
    """Every model section under ``model``, parents first, in declaration order, with its path
    (a list's entries as ``name[i]``)."""
    yield path, model
    for name, field in model.model_fields.items():
        inner, is_list = _section_of(field.annotation)
        if inner is not None:
            yield from _sections(inner, [*path, f"{name}[i]" if is_list else name])


def _section_of(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    annotation = _without_none(annotation)
    if _origin(annotation) is list:
        inner, _ = _section_of(get_args(annotation)[0])
        return inner, True
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    return None, False


def _without_none(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _origin(annotation: Any) -> Any:
    return get_origin(_without_none(annotation))


def _type(annotation: Any, path: list[str]) -> str:
    optional = _without_none(annotation) is not annotation
    annotation = _without_none(annotation)
    origin = get_origin(annotation)
    if origin is Literal:
        text = "one of " + ", ".join(f"`{json.dumps(v)}`" for v in get_args(annotation))
    elif origin is list:
        inner = get_args(annotation)[0]
        section, _ = _section_of(inner)
        item = path[:-1] + [f"{path[-1]}[i]"]
        text = f"list of [{_title(item)}](#{_slug(_title(item))})" if section else f"list of {_type(inner, item)}"
    elif origin is dict:
        key, value = get_args(annotation)
        text = f"map of {_type(key, path)} to {_type(value, path)}"
    elif origin in (Union, types.UnionType):
        text = " or ".join(_type(a, path) for a in get_args(annotation))
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
        text = f"section [{_title(path)}](#{_slug(_title(path))})"
    elif annotation is Path:
        text = "path"
    else:
        text = getattr(annotation, "__name__", str(annotation))
    return text + (", optional" if optional else "")


def _default(field: Any) -> str:
    value = field.default
    if value is PydanticUndefined:
        return "required"
    if value is None:
        return "unset"
    if isinstance(value, BaseModel):
        return "its defaults"
    if isinstance(value, Path):
        return f"`{value}`"
    return f"`{json.dumps(value)}`"


def _docstring(obj: Any) -> str:
    return " ".join((obj.__doc__ or "").split())


def _title(path: list[str]) -> str:
    return ".".join(path)


def _slug(title: str) -> str:
    """The heading's anchor as both MkDocs (Python-Markdown's toc) and GitHub make it, for these
    headings: lower case, punctuation but ``_`` and ``-`` dropped."""
    return re.sub(r"[^a-z0-9_-]", "", title.lower().replace(" ", "-"))


def _cell(text: str) -> str:
    """One table cell: on one line, with pipes escaped and placeholders such as <id> shown, not read as HTML."""
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=REGENERATE, description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 when stale")
    args = parser.parse_args(argv)
    try:
        text = config_reference()
    except UndocumentedFields as error:
        print(error, file=sys.stderr)
        return 1
    if args.check:
        if not REFERENCE.exists() or REFERENCE.read_text() != text:
            print(f"{REFERENCE} is stale: run `{REGENERATE}` and commit it", file=sys.stderr)
            return 1
        return 0
    REFERENCE.write_text(text)
    print(f"written: {REFERENCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
