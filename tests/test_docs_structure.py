"""The docs' shape: docs/library.md in sections a reader (and a link) can land on, the how-to for a model bigger
than RAM reachable from the README and the site, and no flag in the docs that the CLI does not take.

``tests/test_docs.py`` runs the ``sh`` blocks' commands; these check what it cannot: the ``text`` blocks'
command lines (a GPU's device map, which a machine without one cannot run) and flags named in prose.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from materialize_cli.main import main
from test_docs import PAGES, ROOT, fenced, slug

LIBRARY = ROOT / "docs" / "library.md"
HOW_TO = ROOT / "docs" / "bigger-than-ram.md"
FLAG = re.compile(r"(?<![\w./-])(--[a-z][\w-]*|-[a-z]\b)")


def cli_options() -> set[str]:
    """Every option the group and its commands take, both spellings of a flag pair (--strict/--no-strict)."""
    options: set[str] = set()
    for command in [main, *main.commands.values()]:
        for param in command.params:
            options.update(param.opts)
            options.update(getattr(param, "secondary_opts", []))
    return options


def anchors(page: Path) -> set[str]:
    return {slug(h) for h in re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)}


def test_the_library_page_has_a_section_for_each_verb_and_topic():
    expected = {"meta_init", "open_checkpoint-and-inspect", "deferred_init", "load", "sharded-models", "build",
                "load_model", "plan", "convert", "report", "errors", "exit-codes", "logging", "shell-completion",
                # linked from other pages and from within: kept as they were
                "mismatches-and-loads-that-are-not-the-checkpoints"}

    assert expected <= anchors(LIBRARY)


def test_each_call_of_the_library_page_opens_under_a_heading_of_its_own():
    # a top-level `mz.NAME(` bullet right under a heading: none is lost in another's list
    text = LIBRARY.read_text()
    for call in re.findall(r"^- `mz\.(\w+)\(", text, flags=re.M):
        assert re.search(rf"^##+ .+\n\n- `mz\.{call}\(", text, flags=re.M), call


def test_the_how_to_is_linked_from_the_readme_and_in_the_site_nav():
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with mkdocs, in the locked dev environment")
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    assert "bigger-than-ram.md" in [page for entry in nav for page in entry.values()]
    assert "](docs/bigger-than-ram.md)" in (ROOT / "README.md").read_text().split("## Documentation")[1]
    assert "](bigger-than-ram.md)" in (ROOT / "docs" / "index.md").read_text()


def test_every_flag_the_how_to_names_is_an_option_of_the_cli():
    named = set(FLAG.findall(HOW_TO.read_text()))

    assert {"--device", "--staging-size", "--device-map", "--max-memory", "--mmap", "--dtype", "-v"} <= named
    assert named - cli_options() == set()


def test_every_command_line_of_a_text_block_takes_only_options_of_the_cli():
    # the commands the docs show but cannot run here (a GPU's budget: --max-memory 0=70GiB)
    unknown = [f"{page.relative_to(ROOT)}: {flag} in {line.strip()}"
               for page in PAGES for block in fenced(page, "text") for line in block.splitlines()
               if line.startswith("materialize ") for flag in FLAG.findall(line) if flag not in cli_options()]

    assert unknown == []
