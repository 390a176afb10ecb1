"""Every example in trainmesh's docstrings runs (the ones marked ``+SKIP`` are fragments that need a
model or a process group, and say so): a docstring that shows a wrong number fails here, as the
pages in docs/ do under sybil."""

from __future__ import annotations

import doctest
import importlib
import pathlib

import pytest

pytestmark = [pytest.mark.timeout(120)]

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"
MODULES = sorted(
    ".".join(path.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
    for path in (SRC / "trainmesh").rglob("*.py")
    if ">>>" in path.read_text()
)


def test_modules_with_examples_are_found():
    assert len(MODULES) > 50, MODULES  # the glob did not silently find nothing


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in finder.find(module, name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} docstring examples failed (above)"
