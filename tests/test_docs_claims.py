"""What the docs state, checked against the code that decides it: config fields, their defaults and
environment variables (config.py's pydantic models), command-line flags (cli.py's parsers, each
benchmark's, torchrun's), metric names, labels and types (the worker's and the server's Prometheus
registries, both ways), alerts (deploy/prometheus/alerts.yml, both ways), exit codes
(streamtrain/exitcodes.py), references to the README's sections, and the house rules: no issue
numbers, no paths outside the repository, no page over 400 lines, and the README's figures those
of the generated benchmark report.

Each check reads the claim where the docs make it (a code span, a code block, a table row) and
only claims it can attribute: a precise check, never a guess. No broker, no ranks: seconds."""

from __future__ import annotations

import functools
import re
import shlex
import tokenize
import types
from argparse import ArgumentParser
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import pytest
import yaml
from markdown.extensions.toc import slugify
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined

from streamtrain import config
from streamtrain.cli import build_parser
from streamtrain.exitcodes import ExitCode

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
# Generated pages are checked against their generators (tests/test_docs.py); the spec by its own test.
GENERATED = {DOCS / "configuration.md", DOCS / "model-interface.md"}
LONG_PAGES_ALLOWED = {DOCS / "configuration.md", DOCS / "delivery-format.md"}
SECTIONS = {"kafka", "features", "model", "batching", "metrics", "distributed", "checkpoint", "dead_letter", "delivery"}


# --- reading markdown ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    page: Path
    line: int
    text: str

    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def pages() -> list[Path]:
    """The pages a user reads: the docs site and the README."""
    return sorted(p for p in DOCS.rglob("*.md") if p not in GENERATED) + [REPO / "README.md"]


FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.DOTALL | re.MULTILINE)


def code_blocks(page: Path) -> Iterator[tuple[str, Claim]]:
    """Each fenced block's info string and text."""
    text = page.read_text()
    for match in FENCE.finditer(text):
        yield match.group(1).strip(), Claim(page, text.count("\n", 0, match.start(2)) + 1, match.group(2))


def prose(page: Path) -> str:
    """The page without its fenced blocks, each replaced by as many empty lines (line numbers hold)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text())


def code_spans(page: Path) -> Iterator[Claim]:
    """Every inline code span of the prose (one may run over a line break), whitespace collapsed."""
    text = prose(page)
    for match in re.finditer(r"(`+)(.+?)\1", text, re.DOTALL):
        yield Claim(page, text.count("\n", 0, match.start()) + 1, " ".join(match.group(2).split()))


def shell_lines(page: Path) -> Iterator[Claim]:
    """Every line of the code blocks that hold commands (sh, bash, or no language)."""
    for info, block in code_blocks(page):
        if info in ("", "sh", "bash", "console"):
            for offset, line in enumerate(block.text.splitlines()):
                yield Claim(page, block.line + offset, line)


def tables(page: Path) -> Iterator[tuple[list[str], list[tuple[Claim, list[str]]]]]:
    """Each table's header cells and rows (a row's cells, code spans kept whole)."""
    lines = prose(page).splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and re.match(r"^\|[\s:|-]+\|$", lines[i + 1]):
            header = cells(lines[i])
            rows = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append((Claim(page, i + 1, lines[i]), cells(lines[i])))
                i += 1
            yield header, rows
        else:
            i += 1


def cells(row: str) -> list[str]:
    parts, current, in_code = [], "", False
    for char in row.strip().strip("|"):
        if char == "`":
            in_code = not in_code
        if char == "|" and not in_code:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    return [*parts, current.strip()]


def sentence_around(text: str, start: int, end: int) -> str:
    """The sentence (or table cell) holding text[start:end]."""
    before = max(text.rfind(". ", 0, start), text.rfind("|", 0, start), text.rfind("\n\n", 0, start))
    after = [i for i in (text.find(". ", end), text.find("|", end), text.find("\n\n", end)) if i != -1]
    return " ".join(text[before + 1 : min(after, default=len(text))].split())


# --- the config's fields ------------------------------------------------------------------------


def _without_none(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _section(annotation: Any) -> type[BaseModel] | None:
    annotation = _without_none(annotation)
    if get_origin(annotation) is list:
        annotation = _without_none(get_args(annotation)[0])
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


@functools.cache
def section_models() -> dict[str, list[type[BaseModel]]]:
    """Every section's name (a field holding a model, or a list of them) and the models it names."""
    found: dict[str, list[type[BaseModel]]] = {}

    def walk(model: type[BaseModel]) -> None:
        for name, field in model.model_fields.items():
            inner = _section(field.annotation)
            if inner is not None:
                if inner not in found.setdefault(name, []):
                    found[name].append(inner)
                walk(inner)

    walk(config.WorkerConfig)
    return found


def resolve(dotted: str) -> tuple[Any, str | None]:
    """The field a dotted name (``checkpoint.keep_last``, ``eviction.policy``: a path from any
    section) names, and why not when it names none."""
    head, *rest = dotted.split(".")
    candidates: list[Any] = list(section_models()[head])
    for key in rest:
        if key.isdigit():  # a list index
            continue
        matches = []
        for model in candidates:
            if isinstance(model, type) and issubclass(model, BaseModel) and key in model.model_fields:
                matches.append(model.model_fields[key])
        if not matches:
            return None, f"{dotted}: no field {key!r}"
        field = matches[0]
        if get_origin(_without_none(field.annotation)) is dict:  # client properties, options: any key
            return field, None
        candidates = [_section(field.annotation) or field]
    return (candidates[0] if candidates else None), None


def field_default(field: Any) -> Any:
    return None if field.default is PydanticUndefined else field.default


# --- the claims ---------------------------------------------------------------------------------

FIELD_NAME = re.compile(r"^[a-z_][a-z0-9_]*(\.[a-z0-9_]+)+$")
# Dotted names that are not config fields although their first part names a section: the
# snapshot's stream state (delivery: {chain, next_sequence}), files and modules.
NOT_FIELDS = {"delivery.chain", "delivery.next_sequence", "model.state_dict"}
FILE_SUFFIXES = (".py", ".pt2", ".md", ".json", ".yaml", ".yml", ".avsc", ".npz")


def field_names(page: Path) -> Iterator[tuple[Claim, str]]:
    for span in code_spans(page):
        name = span.text.split(":")[0].split(" ")[0]
        if (
            FIELD_NAME.match(name)
            and name.split(".")[0] in section_models()
            and name not in NOT_FIELDS
            and not name.endswith(FILE_SUFFIXES)
        ):
            yield span, name


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_docs_claims_every_config_field_named_exists(page):
    wrong = [f"{span.where()}: {why}" for span, name in field_names(page) if (why := resolve(name)[1])]
    assert not wrong, "\n".join(wrong)


DEFAULT_AFTER_FIELD = re.compile(
    r"`([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)+)`,? \((?:default:? )?"  # `a.field` (default ...
    r"`?([0-9][0-9,.]*|true|false|null|\"?[a-z_]+\"?)`?"  # its value
    r"(?: ?[a-zA-Z]+)?[),;]"  # a unit, and the end
)


def number(text: str) -> Any:
    text = text.replace(",", "").strip('"')
    try:
        return float(text)
    except ValueError:
        return {"true": True, "false": False, "null": None}.get(text, text)


def stated_defaults(page: Path) -> Iterator[tuple[Claim, str, str]]:
    """``field` (default V)`, ``field` (V s)`: a field named, its default in parentheses after it."""
    text = prose(page)
    flat = " ".join(text.split())
    for match in DEFAULT_AFTER_FIELD.finditer(flat):
        line = text.count("\n", 0, text.find(match.group(1).split(".")[-1])) + 1
        yield Claim(page, line, match.group(0)), match.group(1), match.group(2)


# Defaults that depend on the host: batching.batch_size is 1,024 on the CPU and 16,384 on cuda.
BY_DEVICE = {"batching.batch_size": set(config.DEFAULT_BATCH_SIZE.values())}


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_docs_claims_every_default_stated_is_the_codes(page):
    wrong = []
    for claim, name, value in stated_defaults(page):
        if name.split(".")[0] not in section_models() or name in NOT_FIELDS:
            continue
        field, why = resolve(name)
        if why or field is None or not hasattr(field, "default"):
            continue  # named wrongly: the field test says so
        stated, actual = number(value), field_default(field)
        allowed = BY_DEVICE.get(name, {actual})
        if isinstance(actual, (BaseModel, list, dict)):
            continue
        if not any(
            stated == (float(a) if isinstance(a, (int, float)) and not isinstance(a, bool) else a) for a in allowed
        ):
            wrong.append(f"{claim.where()}: `{name}` is said to default to {value}; the code's default is {actual!r}")
    assert not wrong, "\n".join(wrong)


def config_blocks(page: Path) -> Iterator[tuple[Claim, dict]]:
    """YAML blocks that are worker configs or parts of one (their keys are config sections)."""
    for info, block in code_blocks(page):
        if info != "yaml":
            continue
        try:
            parsed = yaml.safe_load(block.text)
        except yaml.YAMLError:
            # An excerpt with "..." or a section shown indented (a table's entries): read what parses.
            parsed = None
        if isinstance(parsed, dict) and parsed and set(parsed) <= set(section_models()):
            yield block, parsed


def unknown_keys(model: type[BaseModel], values: Any, path: str) -> Iterator[str]:
    if not isinstance(values, dict):
        return
    for key, value in values.items():
        if key not in model.model_fields:
            yield f"{path}.{key}"
            continue
        annotation = _without_none(model.model_fields[key].annotation)
        if get_origin(annotation) is dict:
            continue
        inner = _section(annotation)
        if inner is None:
            continue
        for item in value if isinstance(value, list) else [value]:
            yield from unknown_keys(inner, item, f"{path}.{key}")


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_docs_claims_config_blocks_name_real_fields_with_valid_values(page):
    wrong = []
    for block, parsed in config_blocks(page):
        for section, values in parsed.items():
            (model,) = section_models()[section]
            for item in values if isinstance(values, list) else [values]:
                wrong += [f"{block.where()}: {name} is no field" for name in unknown_keys(model, item, section)]
            required = any(f.is_required() for f in model.model_fields.values())
            if not required and isinstance(values, dict):
                try:
                    model.model_validate(values)
                except ValidationError as error:
                    wrong.append(f"{block.where()}: {section}: {error}")
    assert not wrong, "\n".join(wrong)


# --- environment variables ----------------------------------------------------------------------

ENV_NAME = re.compile(r"STREAMTRAIN_[A-Z0-9_]*(?:<i>|<property>|[A-Z0-9_])*")


def read_in_the_repository(name: str) -> bool:
    """Whether a variable that is not config (no ``__``) is read by the code, the Makefile or CI."""
    sources = [*REPO.glob("streamtrain/**/*.py"), *REPO.glob("tests/**/*.py"), REPO / "Makefile"]
    sources += [p for p in (REPO / ".ci").glob("*") if p.is_file()] if (REPO / ".ci").is_dir() else []
    return any(re.search(rf"\b{name}\b", p.read_text()) for p in sources)


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_docs_claims_every_environment_variable_is_read(page):
    wrong = []
    for span in [*code_spans(page), *shell_lines(page)]:
        for match in ENV_NAME.finditer(span.text):
            name = match.group(0).rstrip("_")
            if name == "STREAMTRAIN":  # the prefix, named as such
                continue
            if "__" not in name:
                if not read_in_the_repository(name):
                    wrong.append(f"{span.where()}: {name} is read nowhere in streamtrain/, tests/, the Makefile or CI")
                continue
            path = name.removeprefix(config.ENV_PREFIX).replace("<i>", "0").replace("<property>", "x").lower()
            problem = config._not_a_field(path.split("__"))
            said = re.match(r": (.+?);? ?(?:did you mean (\S+?)\??)?$", span.text[match.end() :].strip())
            if problem is None:
                continue
            # A refused name quoted with its message: the message must be the worker's.
            if said is not None and problem.startswith(said.group(1).rstrip(";")):
                continue
            wrong.append(f"{span.where()}: {name}: {problem}")
    assert not wrong, "\n".join(wrong)


# --- command lines ------------------------------------------------------------------------------


@functools.cache
def parsers() -> dict[str, ArgumentParser]:
    """Each streamtrain command's parser, each benchmark's as ``bench NAME``, and torchrun's."""
    from torch.distributed.run import get_args_parser

    from streamtrain.bench import BENCHMARKS, parser_for

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    found = {"streamtrain": parser, **commands}
    found |= {f"bench {name}": parser_for(name) for name in [*BENCHMARKS, "all", "report"]}
    found["torchrun"] = get_args_parser()
    return found


def flags_of(parser: ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def words(text: str) -> list[str]:
    text = re.sub(r"[\[\]]", " ", text.split(" # ")[0])
    try:
        return shlex.split(text, comments=False)
    except ValueError:
        return text.split()


SEPARATORS = {"|", "||", "&&", ";", "2>&1", ">", "<"}


def commands_in(text: str) -> Iterator[tuple[str, list[str]]]:
    """Each command a line or code span runs: the parser's name and its words."""
    tokens = words(text)
    for i, token in enumerate(tokens):
        program = token.rsplit("/", 1)[-1]
        if program == "torchrun":
            rest = tokens[i + 1 :]
            cut = rest.index("-m") if "-m" in rest else len(rest)
            yield "torchrun", rest[:cut]
        elif program == "streamtrain" and i + 1 < len(tokens):
            rest = []
            for word in tokens[i + 1 :]:
                if word in SEPARATORS:
                    break
                rest.append(word)
            if not rest or rest[0] not in parsers():
                continue
            name = rest[0]
            if name == "bench" and len(rest) > 1 and f"bench {rest[1]}" in parsers():
                yield f"bench {rest[1]}", rest[2:]
            elif name != "bench":
                yield name, rest[1:]


def flags_in(words_: list[str]) -> list[str]:
    return [w.split("=")[0] for w in words_ if re.match(r"^--[a-z][a-z0-9-]*", w)]


# Flags of other tools the docs name alone in prose, and the tool.
OTHER_TOOLS_FLAGS = {"--strict": "mkdocs build", "--no-deps": "pip install"}


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_docs_claims_every_command_line_flag_exists(page):
    wrong = []
    every_flag = set().union(*(flags_of(p) for p in parsers().values())) | set(OTHER_TOOLS_FLAGS)
    for claim in [*code_spans(page), *shell_lines(page)]:
        commands = list(commands_in(claim.text))
        for name, args in commands:
            known = flags_of(parsers()[name])
            wrong += [f"{claim.where()}: `{name}` has no {flag}" for flag in flags_in(args) if flag not in known]
        if not commands and claim.text.startswith("--"):  # a flag named alone, in prose
            wrong += [
                f"{claim.where()}: no command has {flag}"
                for flag in flags_in(words(claim.text))
                if flag not in every_flag
            ]
    assert not wrong, "\n".join(wrong)


# --- metrics and alerts -------------------------------------------------------------------------


@dataclass(frozen=True)
class Metric:
    name: str  # as scraped: counters with _total, the info with _info
    kind: str
    labels: frozenset[str]


def metrics_of(registry: CollectorRegistry) -> dict[str, Metric]:
    """Every metric of a registry, as scraped: a counter with ``_total``, the info with ``_info``."""
    found: dict[str, Metric] = {}
    for collector in registry._collector_to_names:  # each collector registered, ours included
        if isinstance(collector, MetricWrapperBase):
            kind = collector._type
            name = collector._name + {"counter": "_total", "info": "_info"}.get(kind, "")
            found[name] = Metric(name, kind, frozenset(collector._labelnames))
        else:  # a collector of our own (BulkHistogram): its families say what it is
            for family in collector.collect():
                found[family.name] = Metric(family.name, family.type, frozenset())
    assert {m.removesuffix("_total").removesuffix("_info") for m in found} == {f.name for f in registry.collect()}
    return found


@functools.cache
def worker_metrics() -> dict[str, Metric]:
    from streamtrain.metrics import WorkerMetrics

    return metrics_of(WorkerMetrics().registry)


@functools.cache
def serve_metrics() -> dict[str, Metric]:
    from streamtrain.delivery.serve.metrics import ServeMetrics

    return metrics_of(ServeMetrics().registry)


METRIC = re.compile(r"`(streamtrain_[a-z0-9_]+|_[a-z0-9_]+)(\{([a-z_,]*)\})?`")


def metric_table(
    page: Path, header_start: str
) -> list[tuple[Claim, list[tuple[str, frozenset[str] | None]], list[str], str]]:
    """The rows of the page's metrics table: each row's metrics (a ``_suffix`` shorthand expanded
    from the name before it) with the labels it shows, the types it states, and the row's text."""
    rows = []
    for header, body in tables(page):
        if header[0] != header_start:
            continue
        for claim, row in body:
            names: list[tuple[str, frozenset[str] | None]] = []
            for match in METRIC.finditer(row[0]):
                name = match.group(1)
                if name.startswith("_"):
                    previous = names[-1][0].split("_")
                    name = "_".join(previous[: len(previous) - len(name.strip("_").split("_"))]) + name
                labels = frozenset(filter(None, match.group(3).split(","))) if match.group(2) else None
                names.append((name, labels))
            kinds = [k.strip() for k in row[1].split("/")] if len(row) > 2 else []
            rows.append((claim, names, kinds, " | ".join(row)))
    return rows


@pytest.mark.parametrize(
    ("page", "header", "registry"),
    [("docs/operating.md", "metric", worker_metrics), ("docs/model-delivery.md", "metric", serve_metrics)],
    ids=["worker", "serve"],
)
def test_docs_claims_the_metrics_tables_are_the_registries(page, header, registry):
    exported = registry()
    rows = metric_table(REPO / page, header)
    assert rows, f"{page} has a metrics table"
    wrong, documented = [], set()
    for claim, names, kinds, text in rows:
        documented |= set(re.findall(r"streamtrain_[a-z0-9_]+", text)) | {n for n, _ in names}
        for i, (name, labels) in enumerate(names):
            metric = exported.get(name)
            if metric is None:
                wrong.append(f"{claim.where()}: {name} is not exported")
                continue
            # An info metric's labels are the keys of what the worker sets, not declared names.
            if labels is not None and labels != metric.labels and metric.kind != "info":
                wrong.append(f"{claim.where()}: {name} has labels {sorted(metric.labels)}, not {sorted(labels)}")
            kind = kinds[i] if len(kinds) == len(names) else (kinds[0] if len(kinds) == 1 else None)
            if kind is not None and kind != metric.kind:
                wrong.append(f"{claim.where()}: {name} is a {metric.kind}, not a {kind}")
    wrong += [f"{page}: {name} is exported but not in the table" for name in sorted(set(exported) - documented)]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_docs_claims_every_metric_named_exists(page):
    exported = worker_metrics() | serve_metrics()
    scraped = set(exported)
    for metric in exported.values():  # a histogram's series
        if metric.kind == "histogram":
            scraped |= {metric.name + suffix for suffix in ("_bucket", "_count", "_sum")}
    wrong = []
    for claim in [*code_spans(page), *shell_lines(page)]:
        for name in re.findall(r"(?<![\w.])streamtrain_[a-z0-9_]*[a-z0-9]", claim.text):
            if name not in scraped:
                wrong.append(f"{claim.where()}: {name} is not a metric the worker or the server exports")
    assert not wrong, "\n".join(wrong)


def test_docs_claims_the_alerts_table_is_the_rules():
    rules = yaml.safe_load((REPO / "deploy" / "prometheus" / "alerts.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    documented = {
        row[0].strip("`")
        for header, body in tables(DOCS / "operating.md")
        if header[0] == "alert"
        for _claim, row in body
    }
    assert documented == alerts, f"only in the docs: {documented - alerts}; only in alerts.yml: {alerts - documented}"


# --- exit codes ---------------------------------------------------------------------------------

# Words one of which a sentence about each code holds: a code swapped for another reads wrong.
EXIT_WORDS = {
    ExitCode.OK: ("stop", "until-end", "max-events", "end", "sigterm", "succeed", "commit"),
    ExitCode.FAILED: ("peer", "unexpected", "traceback", "fail", "signal", "error"),
    ExitCode.CONFIG: ("config", "field", "invalid", "refuse", "missing", "needs", "without", "bad"),
    ExitCode.SHUTDOWN_TIMEOUT: ("grace", "outlast", "within", "stop"),
    ExitCode.KAFKA_UNREACHABLE: ("broker", "answer", "reach", "connect"),
    ExitCode.LOGIN_REFUSED: ("login", "sasl", "auth", "password"),
    ExitCode.SNAPSHOTS_FAILING: ("snapshot", "checkpoint", "in a row"),
    ExitCode.RESTORE_REFUSED: ("snapshot", "load", "restore", "refus"),
    ExitCode.OUTPUT_TOPIC_MISSING: ("topic",),
}
EXIT_MENTION = re.compile(
    r"\b(?:[Ee]xit(?:s|ed|ing)?(?: with)?(?: code| status)?|code) \**(\d+)\**(?! ?(?:ms|s|seconds|%|bytes|µs))"
)


def exit_code_meanings() -> dict[int, str]:
    """Each code's meaning, as streamtrain/exitcodes.py comments it."""
    source = REPO / "streamtrain" / "exitcodes.py"
    meanings, name = {}, None
    with source.open() as file:
        for token in tokenize.generate_tokens(file.readline):
            if token.type == tokenize.NAME and token.string in ExitCode.__members__:
                name = token.string
            elif token.type == tokenize.COMMENT and name:
                meanings[int(ExitCode[name])] = token.string.lstrip("# ")
                name = None
    return meanings


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_docs_claims_every_exit_code_is_the_codes(page):
    wrong = []
    text = prose(page)
    for match in EXIT_MENTION.finditer(text):
        code = int(match.group(1))
        line = text.count("\n", 0, match.start()) + 1
        if code not in ExitCode._value2member_map_:
            wrong.append(f"{page.relative_to(REPO)}:{line}: exit code {code} is not in streamtrain/exitcodes.py")
            continue
        sentence = sentence_around(text, match.start(), match.end()).lower()
        if not any(word in sentence for word in EXIT_WORDS[ExitCode(code)]):
            wrong.append(f"{page.relative_to(REPO)}:{line}: exit {code} ({ExitCode(code).name}) said of: {sentence}")
    for header, body in tables(page):
        if header[:2] != ["code", "means"]:
            continue
        codes = [int(row[0]) for _claim, row in body]
        for claim, row in body:
            code = ExitCode(int(row[0])) if int(row[0]) in ExitCode._value2member_map_ else None
            if code is None or not any(word in row[1].lower() for word in EXIT_WORDS[code]):
                wrong.append(f"{claim.where()}: code {row[0]} is not {row[1]!r}")
        if sorted(codes) != sorted(int(c) for c in ExitCode):
            missing = sorted({int(c) for c in ExitCode} - set(codes))
            wrong.append(f"{page.relative_to(REPO)}: its exit-code table lacks {missing}: {exit_code_meanings()}")
    assert not wrong, "\n".join(wrong)


# --- references and house rules -----------------------------------------------------------------


def headings(page: Path) -> set[str]:
    found = re.findall(r"^#+ (.+)$", prose(page), re.MULTILINE)
    return {slugify(h.replace("`", ""), "-") for h in found}


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_docs_claims_references_to_the_readme_name_its_sections(page):
    text = " ".join(prose(page).split())
    readme = headings(REPO / "README.md")
    wrong = []
    for section in re.findall(r"README's \"([^\"]+)\"|\(README, ([^)]+)\)|README\.md#([\w-]+)", text):
        name = next(s for s in section if s)
        if slugify(name, "-") not in readme:
            wrong.append(f"{page.relative_to(REPO)}: the README has no section {name!r}")
    # The README's own links to its sections, and to the pages' sections.
    if page.name == "README.md":
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text()):
            linked = REPO / target if target else page
            if linked.suffix == ".md" and anchor not in headings(linked):
                wrong.append(f"README.md links to {target}#{anchor}: no such heading")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    "page", [*pages(), REPO / "CHANGELOG.md", *sorted(GENERATED)], ids=lambda p: str(p.relative_to(REPO))
)
def test_docs_claims_no_issue_numbers_and_no_paths_outside_the_repository(page):
    text = page.read_text()
    wrong = [
        f"{page.relative_to(REPO)}: {m.group(0)!r}" for m in re.finditer(r"[Ii]ssues? #?[0-9]+|#[0-9]{2,}\b", text)
    ]
    wrong += [f"{page.relative_to(REPO)}: {m.group(0)!r}" for m in re.finditer(r"\.\./shared/|/work/\S+", text)]
    assert not wrong, "\n".join(wrong)


def test_docs_claims_no_page_is_over_400_lines():
    long = {
        str(p.relative_to(REPO)): n
        for p in DOCS.rglob("*.md")
        if p not in LONG_PAGES_ALLOWED and (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, f"split these pages, or move dated material to CHANGELOG.md: {long}"


# Folders of the repository a path in the docs may start with; generated ones (site/, .cache/,
# __pycache__) are made by the tools, not kept.
TOP = ("streamtrain/", "tests/", "deploy/", "docs/", "requirements/", "schemas/", "results/", ".ci/")
GENERATED_PATHS = ("site/", ".cache/", "streamtrain/__pycache__")


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_docs_claims_every_repository_path_exists(page):
    wrong = []
    for span in code_spans(page):
        for path in span.text.split():
            path = path.rstrip(",.;:)")
            if not path.startswith(TOP) or path.startswith(GENERATED_PATHS):
                continue
            pattern = re.sub(r"<[^>]+>|\b[A-Z]+\b", "*", path).rstrip("/")
            braces = re.search(r"\{([^}]*)\}", pattern)
            expanded = (
                [pattern.replace(braces.group(0), b) for b in braces.group(1).split(",")] if braces else [pattern]
            )
            if not all(any(REPO.glob(one)) for one in expanded):
                wrong.append(f"{span.where()}: {path} is not in the repository")
    assert not wrong, "\n".join(wrong)


def defined(module_path: Path, name: str) -> bool:
    return bool(
        re.search(
            rf"^\s*(?:class|def|async def) {name}\b|^\s*(?:self\.)?{name}\b[^=\n]*=", module_path.read_text(), re.M
        )
    )


@functools.cache
def classes() -> dict[str, Path]:
    found = {}
    for path in REPO.glob("streamtrain/**/*.py"):
        for name in re.findall(r"^class (\w+)", path.read_text(), re.M):
            found[name] = path
    return found


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_docs_claims_every_python_name_exists(page):
    """``streamtrain.x.y.Name`` imports (or is a dead letter's header); ``OurClass.method`` (a
    class of streamtrain's) has it."""
    import importlib

    from streamtrain import deadletter

    headers = {value for name, value in vars(deadletter).items() if name.startswith("HEADER_")}
    wrong = []
    for span in code_spans(page):
        dotted = re.match(r"^(streamtrain(?:\.\w+)+)", span.text)
        if dotted and dotted.group(1) in headers:  # a dead letter's header, not a Python name
            continue
        # Only a module's names: streamtrain.json (a marker), streamtrain.kafka (a logger) are not.
        if dotted and any(
            (REPO / "streamtrain" / dotted.group(1).split(".")[1]).with_suffix(s).exists() for s in (".py", "")
        ):
            parts = dotted.group(1).split(".")
            for cut in range(len(parts), 0, -1):
                try:
                    target: Any = importlib.import_module(".".join(parts[:cut]))
                except ImportError:
                    continue
                for attribute in parts[cut:]:
                    target = getattr(target, attribute, None)
                if target is None:
                    wrong.append(f"{span.where()}: {dotted.group(1)} does not exist")
                break
            continue
        method = re.match(r"^([A-Z]\w+)\.(\w+)\b", span.text)
        if method and method.group(1) in classes() and not defined(classes()[method.group(1)], method.group(2)):
            wrong.append(f"{span.where()}: {method.group(1)} has no {method.group(2)}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_docs_claims_every_make_target_exists(page):
    targets = set(re.findall(r"^([a-z][a-z-]*):", (REPO / "Makefile").read_text(), re.M))
    wrong = [
        f"{claim.where()}: the Makefile has no target {target}"
        for claim in [*code_spans(page), *shell_lines(page)]
        for target in re.findall(r"\bmake ([a-z][a-z-]*)", claim.text)
        if target not in targets
    ]
    assert not wrong, "\n".join(wrong)


# --- generated figures and references -----------------------------------------------------------


def test_docs_claims_the_readme_figures_and_the_results_page_are_the_reports():
    """Both are what ``streamtrain bench report`` makes of the results files in the repository."""
    from streamtrain.bench import report

    results = report.load(REPO / "results")
    assert report.headline(results) in (REPO / "README.md").read_text(), (
        "the README's headline table is not the report's: run `streamtrain bench report` and commit README.md"
    )
    assert (DOCS / "bench" / "report.md").read_text() == report.page(results), (
        "docs/bench/report.md is stale: run `streamtrain bench report` and commit docs/bench/"
    )


def test_docs_claims_a_figure_without_a_results_file_says_so(tmp_path):
    from streamtrain.bench import report

    (tmp_path / "e2e-20260101-000000.json").write_text(
        '{"benchmark": "e2e", "worker_over_naive": 2.5, "machine": {"cores": 8, "device": "cpu"}}'
    )
    table = report.figures_table(report.load(tmp_path), "docs/", headline_only=True)
    assert (
        "| **2.50** (goal ≥ 2: met) | 2026-01-01 00:00 UTC, 8 cores, cpu (`results/e2e-20260101-000000.json`) |"
        in table
    )
    assert "| throughput kept with an async snapshot every few seconds | no results file | |" in table


def test_docs_claims_the_model_interface_reference_is_the_codes():
    from streamtrain.dev.docs import MODEL_REFERENCE, model_interface_reference

    assert MODEL_REFERENCE.read_text() == model_interface_reference(), (
        "stale: run `python -m streamtrain.dev.docs` and commit docs/model-interface.md"
    )


def test_docs_claims_a_model_spec_field_without_an_entry_fails_the_reference():
    from dataclasses import make_dataclass

    from streamtrain.dev.docs import UndocumentedFields, model_interface_reference
    from streamtrain.models.base import ModelSpec

    grown = make_dataclass("ModelSpec", [("row_budget", int)], bases=(ModelSpec,), frozen=True)
    grown.__doc__ = ModelSpec.__doc__
    with pytest.raises(UndocumentedFields, match="row_budget"):
        model_interface_reference(grown)


def test_docs_claims_the_dead_letter_reasons_are_the_decoders():
    """operating.md's list and troubleshooting.md's table name every reason, and only those."""
    from streamtrain.avro_program import REASONS

    operating = " ".join(prose(DOCS / "operating.md").split())
    listed = re.search(r"Its reason is one of (.+?)\. A broken", operating)
    assert listed is not None, "docs/operating.md lists the dead-letter reasons"
    # the reasons, without what the parentheses say of them
    assert set(re.findall(r"`([a-z_]+)`", re.sub(r"\([^()]*\)", "", listed.group(1)))) == set(REASONS)
    tabled = {
        reason
        for header, body in tables(DOCS / "troubleshooting.md")
        if header[0] == "reason"
        for _claim, row in body
        for reason in re.findall(r"`([a-z_]+)`", row[0])
    }
    assert tabled == set(REASONS)
