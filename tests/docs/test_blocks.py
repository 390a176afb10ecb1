"""The docs-example harness itself: every code block in README.md and docs/ is in a language it
handles, trainmesh commands are in bash blocks (which run), the README's links resolve, and the
harness fails on a broken example or a skip without a reason (the top-level conftest.py runs the
blocks themselves)."""

from __future__ import annotations

import glob
import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
# python and bash run (or carry a skip with its reason); text and yaml are shown, never run.
LANGUAGES = {"python", "bash", "text", "yaml"}
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")


def blocks(path):
    """(line number, language, lines) of each fenced block."""
    found, current = [], None
    with open(path) as fh:
        for number, line in enumerate(fh, 1):
            match = FENCE.match(line.rstrip("\n"))
            if current is None and match:
                current = (number, match.group(3).strip(), match.group(2), [])
            elif current is not None and match and match.group(2) == current[2] and not match.group(3).strip():
                found.append((current[0], current[1], current[3]))
                current = None
            elif current is not None:
                current[3].append(line)
    assert current is None, f"{path}: the block opened at line {current[0]} is never closed"
    return found


def _harness():
    spec = importlib.util.spec_from_file_location("docs_harness", os.path.join(ROOT, "conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_block_is_in_a_language_the_harness_handles(path):
    for line, language, body in blocks(path):
        assert language in LANGUAGES, (
            f"{os.path.relpath(path, ROOT)}, line {line}: a block in {language!r}; "
            f"use one of {sorted(LANGUAGES)} (python and bash blocks run)"
        )
        if language != "bash":
            commands = [b for b in body if b.lstrip().startswith("trainmesh ")]
            assert not commands, (
                f"{os.path.relpath(path, ROOT)}, line {line}: a trainmesh command in a "
                f"{language} block is never run; put it in a bash block: {commands[0].strip()}"
            )


@pytest.mark.timeout(30)
def test_the_readme_links_resolve():
    with open(os.path.join(ROOT, "README.md")) as fh:
        text = fh.read()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target:
            assert os.path.exists(os.path.join(ROOT, target)), f"README.md links to {target}, which does not exist"


@pytest.mark.timeout(30)
def test_the_readme_stays_short():
    with open(os.path.join(ROOT, "README.md")) as fh:
        assert len(fh.readlines()) <= 220, "README.md is the front door: move detail into a guide under docs/"


@pytest.mark.timeout(60)
def test_a_broken_example_fails_and_a_skip_needs_a_reason(tmp_path):
    harness = _harness()
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nimport trainmesh as tm\n\ndistribution = tm.DataParallel()\n```\n\n"
        "```python\ntm.DataParallel(no_such_argument=1)   # a renamed argument\n```\n\n"
        "```bash\ntrue\n```\n\n```bash\nfalse\n```\n"
    )
    [document] = [harness.make_sybil(str(tmp_path), ["page.md"]).parse(page)]
    examples = list(document)
    namespace = document.namespace
    harness._setup(namespace)
    outcomes = []
    try:
        for example in examples:
            try:
                example.evaluate()
                outcomes.append("ok")
            except Exception as error:  # noqa: BLE001 - the harness's failure is what is checked
                outcomes.append(type(error).__name__)
    finally:
        harness._teardown(namespace)
    assert outcomes == ["ok", "TypeError", "ok", "AssertionError"], outcomes

    page.write_text('<!-- skip: next -->\n```python\nraise SystemExit\n```\n')
    with pytest.raises(ValueError, match="needs a reason"):
        list(harness.make_sybil(str(tmp_path), ["page.md"]).parse(page))
