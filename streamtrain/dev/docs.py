"""The docs site's generated references, so that they cannot drift from the code: the
configuration reference from the pydantic models in ``streamtrain/config.py``, and the model
interface's from ``streamtrain/models/base.py`` (``ModelSpec``'s fields, members and checks).

    python -m streamtrain.dev.docs           # rewrite docs/configuration.md and docs/model-interface.md
    python -m streamtrain.dev.docs --check   # exit 1 if either is stale, or if a field has no description

``make docs`` rewrites them and builds the site; the test suite runs the check.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import re
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from streamtrain import config
from streamtrain.dev import CHECKOUT

REFERENCE = CHECKOUT / "docs" / "configuration.md"
MODEL_REFERENCE = CHECKOUT / "docs" / "model-interface.md"
REGENERATE = "python -m streamtrain.dev.docs"


class UndocumentedFields(ValueError):
    """Fields without a description (a config field's ``description=``, a ``ModelSpec`` field's
    entry in its docstring): the reference would show them blank."""


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
    if (field.json_schema_extra or {}).get("default_by_device"):  # batching.batch_size, set before validation
        return "by device: " + ", ".join(f"`{size}` on {device}" for device, size in config.DEFAULT_BATCH_SIZE.items())
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


def model_interface_reference(spec: type | None = None) -> str:
    """The model interface's reference page: the contract (``streamtrain/models/base.py``'s
    docstring), ``ModelSpec``'s fields and members, and what the worker checks of a model. Raises
    UndocumentedFields naming every ``ModelSpec`` field its docstring does not describe."""
    from streamtrain.models import base

    spec = spec or base.ModelSpec
    described = _described_fields(spec.__doc__ or "")
    fields = dataclasses.fields(spec)
    missing = [f.name for f in fields if f.name not in described]
    if missing:
        raise UndocumentedFields(
            f"{spec.__name__} fields without an entry ('- ``name``: ...') in its docstring "
            f"(streamtrain/models/base.py): " + ", ".join(missing)
        )
    hints = inspect.get_annotations(spec, eval_str=True)
    lines = [
        "# The model interface (reference)",
        "",
        f"<!-- Generated from streamtrain/models/base.py by `{REGENERATE}`; do not edit. -->",
        "",
        "What a factory named in `model.module` receives, what it must return, and what the worker checks. "
        "This page is generated from `streamtrain/models/base.py`, the interface in code: "
        f"`{REGENERATE}` (or `make docs`) rewrites it, and the test suite fails when it is stale. "
        "[Your own model](models.md) walks through an example and answers the common questions.",
        "",
        "## The contract",
        "",
        _markdown(base.__doc__ or "").split("\n", 2)[2].strip(),
        "",
        f"## `{spec.__name__}`",
        "",
        f"`{base.__name__}.{spec.__name__}({', '.join(f.name for f in fields)})`, a frozen dataclass, is all a "
        "factory is given: `Factory = Callable[[ModelSpec], nn.Module]`.",
        "",
        _markdown(_without_field_entries(spec.__doc__ or "")),
        "",
        "| field | type | what |",
        "|---|---|---|",
    ]
    lines += [f"| `{f.name}` | {_type_cell(hints[f.name])} | {_cell(_markdown(described[f.name]))} |" for f in fields]
    lines += ["", "| member | what |", "|---|---|"]
    for name, member in inspect.getmembers(spec):
        if name.startswith("_") or not (isinstance(member, property) or inspect.isfunction(member)):
            continue
        if isinstance(member, property):
            signature = f"`spec.{name}`"
            doc = member.fget.__doc__ if member.fget else None
        else:
            parameters = list(inspect.signature(member).parameters.values())[1:]
            signature = f"`spec.{name}({', '.join(str(p).split(':')[0] + _default_of(p) for p in parameters)})`"
            doc = member.__doc__
        lines.append(f"| {signature} | {_cell(_markdown(doc or ''))} |")
    lines += [
        "",
        "## What the worker checks",
        "",
        "Every build of the model (`streamtrain plan`, each rank's start, each export) imports the factory and "
        "builds the module; a failure exits 2 (`ModelInterfaceError`, a `ConfigError`) with the reason. A "
        "user's model is also run and exported once at the worker's start-up.",
        "",
    ]
    for check in (base.check_tables, base.check_logits, _check_exportable()):
        lines.append(f"- `{check.__name__}`: {_cell(_markdown(check.__doc__ or ''))}")
    return "\n".join(lines) + "\n"


def _described_fields(doc: str) -> dict[str, str]:
    """A docstring's ``- ``name``: text`` entries, each with its continuation lines."""
    entries: dict[str, str] = {}
    current = None
    for line in inspect.cleandoc(doc).splitlines():
        match = re.match(r"^- ``(\w+)``: (.*)$", line)
        if match:
            current = match.group(1)
            entries[current] = match.group(2)
        elif current and line.startswith("  "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


def _without_field_entries(doc: str) -> str:
    return "\n".join(
        line for line in inspect.cleandoc(doc).split("\n\n")[0].splitlines() if not line.startswith(("- ``", "  "))
    )


def _markdown(doc: str) -> str:
    """A docstring as markdown: ``literal`` as `literal`, and a ``::`` block as a fenced one."""
    text = inspect.cleandoc(doc).replace("``", "`")
    return re.sub(
        r"::\n\n((?:    .*\n?)+)",
        lambda m: ":\n\n```python\n" + inspect.cleandoc(m.group(1)) + "\n```\n",
        text,
    )


def _type_cell(annotation: Any) -> str:
    """A field's type, a config section linked to its part of the configuration reference."""
    sections = {model: _slug(_title(path)) for path, model in _sections(config.WorkerConfig, []) if path}
    inner = get_args(annotation)[0] if get_origin(annotation) is list else annotation
    if inner in sections:
        link = f"[`{inner.__name__}`](configuration.md#{sections[inner]})"
        return f"list of {link}" if inner is not annotation else link
    return f"`{_type_name(annotation)}`"


def _type_name(annotation: Any) -> str:
    """A field's type as a reader writes it: our classes by name, torch's with their module."""
    if isinstance(annotation, type):
        module = annotation.__module__.split(".")[0]
        return annotation.__qualname__ if module in ("streamtrain", "builtins") else f"{module}.{annotation.__name__}"
    return re.sub(r"\bstreamtrain\.(?:\w+\.)*", "", str(annotation))


def _default_of(parameter: inspect.Parameter) -> str:
    return "" if parameter.default is inspect.Parameter.empty else f"={parameter.default!r}"


def _check_exportable() -> Callable[..., None]:
    from streamtrain.delivery.artifact import check_exportable

    return check_exportable


# Each generated page, the function that makes it.
GENERATED: dict[Path, Callable[[], str]] = {
    REFERENCE: lambda: config_reference(),
    MODEL_REFERENCE: lambda: model_interface_reference(),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=REGENERATE, description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 when stale")
    args = parser.parse_args(argv)
    stale = []
    for page, make in GENERATED.items():
        try:
            text = make()
        except UndocumentedFields as error:
            print(error, file=sys.stderr)
            return 1
        if args.check:
            if not page.exists() or page.read_text() != text:
                stale.append(page)
            continue
        page.write_text(text)
        print(f"written: {page}")
    for page in stale:
        print(f"{page} is stale: run `{REGENERATE}` and commit it", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
