"""The README as a short front door, and the docs site: it builds strictly (a broken link or anchor
fails it), its configuration reference is the code's, its runnable blocks run, and every command's
help names its page."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from markdown.extensions.toc import slugify
from pydantic import Field

from schema_registry import stand_in_registry
from streamtrain.cli import DOCS_PAGES, build_parser
from streamtrain.config import BatchingConfig, WorkerConfig, _not_a_field, parse_config
from streamtrain.dev.docs import REFERENCE, UndocumentedFields, config_reference
from streamtrain.dev.kafka import free_port

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
RUNNABLE = re.compile(r"<!-- runnable -->\n```sh\n(.*?)\n```", re.DOTALL)


def build(config: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL), re.MULTILINE)
    return {slugify(h.replace("`", ""), "-") for h in headings}


def nav_pages() -> set[str]:
    def pages(node) -> list[str]:
        if isinstance(node, str):
            return [node]
        items = node.values() if isinstance(node, dict) else node
        return [page for item in items for page in pages(item)]

    return set(pages(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]))


def test_the_readme_is_a_short_front_door():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", readme)
    assert links, "the README points at the docs"
    for target, anchor in links:
        assert (REPO / target).is_file(), f"README links to {target}, which does not exist"
        assert not anchor or anchor in anchors(REPO / target), f"README links to {target}#{anchor}: no such heading"
    # Its config for your own cluster is a valid one.
    block = re.search(r"```yaml\n(kafka:.*?)```", readme, re.DOTALL)
    assert block is not None
    parse_config(yaml.safe_load(block.group(1)), environ={})


@pytest.mark.parametrize("page", ["README.md", "docs/models.md"])
def test_the_user_model_example_is_the_one_the_tests_train(page):
    """tests/test_architectures.py trains, kills, restores and serves tests/user_models/my_models.py:
    the example a user copies is that code, word for word."""
    (example,) = re.findall(r"```python\n(import torch\n.*?)```", (REPO / page).read_text(), re.DOTALL)
    assert example in (REPO / "tests" / "user_models" / "my_models.py").read_text()


def test_the_site_builds_strictly(tmp_path):
    result = build(REPO / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "site" / "configuration" / "index.html").exists()


def test_a_broken_link_or_anchor_fails_the_build(tmp_path):
    copy = tmp_path / "repo"
    shutil.copytree(DOCS, copy / "docs")
    shutil.copy(REPO / "mkdocs.yml", copy / "mkdocs.yml")
    page = copy / "docs" / "getting-started.md"
    text = page.read_text()

    page.write_text(text + "\nSee [the missing page](no-such-page.md).\n")
    result = build(copy / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0 and "no-such-page.md" in result.stderr, result.stderr[-3000:]

    page.write_text(text + "\nSee [a missing section](operating.md#no-such-section).\n")
    result = build(copy / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0 and "no-such-section" in result.stderr, result.stderr[-3000:]


def test_the_configuration_reference_is_the_codes():
    reference = config_reference()
    assert REFERENCE.read_text() == reference, "stale: run `python -m streamtrain.dev.docs` and commit it"
    # Every variable it names is one the worker reads.
    for name in set(re.findall(r"STREAMTRAIN_[A-Z][A-Za-z0-9_<>]*", reference)):
        if "<property>" not in name:
            path = name.removeprefix("STREAMTRAIN_").replace("<i>", "0").lower().split("__")
            assert _not_a_field(path) is None, name


def test_a_field_without_a_description_fails_the_reference():
    class Batching(BatchingConfig):
        new_knob: int = 1

    class Worker(WorkerConfig):
        batching: Batching = Field(default=Batching(), description="How batches are cut.")

    with pytest.raises(UndocumentedFields, match=r"batching\.new_knob"):
        config_reference(Worker)

    class DocumentedBatching(BatchingConfig):
        new_knob: int = Field(default=1, description="A knob.")

    class DocumentedWorker(WorkerConfig):
        batching: DocumentedBatching = Field(default=DocumentedBatching(), description="How batches are cut.")

    assert "| `new_knob`<br>`STREAMTRAIN_BATCHING__NEW_KNOB` | int | `1` | A knob. |" in config_reference(
        DocumentedWorker
    )


def run_blocks(page: str, cwd: Path = REPO, env: dict[str, str] | None = None) -> list[str]:
    """Runs a page's runnable blocks in order, each in ``bash -e`` from ``cwd`` with the project's
    environment on the PATH (and this checkout's streamtrain first); returns each one's output."""
    blocks = RUNNABLE.findall((DOCS / page).read_text())
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    environ = {**os.environ, "PATH": path, "PYTHONPATH": str(REPO), **(env or {})}
    outputs = []
    for block in blocks:
        result = subprocess.run(
            ["bash", "-e", "-c", block], cwd=cwd, env=environ, capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, f"{block}\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
        outputs.append(result.stdout)
    return outputs


def test_the_getting_started_pages_runnable_blocks_run():
    assert len(run_blocks("getting-started.md")) >= 2


def test_own_events_the_pages_runnable_blocks_train_a_users_schema_and_export_it(kafka, tmp_path):
    """docs/your-own-events.md from a schema of its own (not the bundled one) on a Confluent-framed
    topic, through plan, a worker, its metrics and an export, against the real broker; the registry
    is the suite's stand-in (tests/schema_registry.py), since it is not what the page shows. About
    a minute and a half on a loaded 2-core host, most of it the worker's start."""
    kafka.create_topic("page-views", 2)
    with stand_in_registry() as registry:
        outputs = run_blocks(
            "your-own-events.md",
            cwd=tmp_path,
            env={"KAFKA": kafka.bootstrap_servers, "REGISTRY": registry, "METRICS_PORT": str(free_port())},
        )
    assert len(outputs) == 5
    assert "sharding plan for 1 rank(s)" in outputs[2]
    metrics = dict(line.rsplit(" ", 1) for line in outputs[3].splitlines() if line.startswith("streamtrain_"))
    trained = sum(float(v) for k, v in metrics.items() if k.startswith("streamtrain_events_trained_total"))
    assert trained == 5000, outputs[3]
    assert sum(float(v) for k, v in metrics.items() if k.startswith("streamtrain_dead_letter_events_total")) == 0
    assert any(k.startswith("streamtrain_progressive_auc{") for k in metrics), outputs[3]
    assert "stopped after" in (tmp_path / "worker.log").read_text()
    base = tmp_path / "serving" / json.loads((tmp_path / "serving" / "current.json").read_text())["path"]
    manifest = json.loads((base / "manifest.json").read_text())
    assert manifest["reader_schema"]["name"] == "PageView" and manifest["tasks"] == ["clicked"]


def test_every_command_names_its_docs_page():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    pages = nav_pages()
    for name, command in {"streamtrain": parser, **commands}.items():
        page = DOCS_PAGES[name]
        assert f"docs/{page}" in command.format_help().replace("\n", " "), name
        assert page in pages, f"{name}'s page {page} is not in mkdocs.yml's nav"
