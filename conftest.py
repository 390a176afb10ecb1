"""README.md and docs/*.md as tests, collected by sybil (pyproject's testpaths names them).

Every ```python block runs, in order, in one namespace per page, on one process, in a scratch
folder; a block after ``<!-- launch: trainmesh run -n N -->`` runs instead as a script of its own
under that command. Every ```bash block runs with bash -e in the same scratch folder (the
repository's src/, tests/, examples/, benchmarks/ and docs/ linked in). A block that must not run is marked
``<!-- skip: next "the reason" -->``; a skip without a reason is an error, and so is a code block
in a language the docs do not use (tests/docs/test_blocks.py). See docs/contributing.md.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile

from sybil import Region, Sybil
from sybil.parsers.markdown import CodeBlockParser, PythonCodeBlockParser, SkipParser
from sybil.parsers.markdown.lexers import DirectiveInHTMLCommentLexer

ROOT = os.path.dirname(os.path.abspath(__file__))
# What a page's scratch folder links to, so commands read as they do from the repository root.
LINKED = ("src", "tests", "examples", "benchmarks", "docs", "README.md", "pyproject.toml")
BLOCK_TIMEOUT_S = 240


class ReasonedSkipParser(SkipParser):
    """sybil's skip directive, with the reason required: ``<!-- skip: next "why" -->``."""

    def __call__(self, document):
        for region in super().__call__(document):
            action, reason = region.parsed
            if action != "end" and not reason:
                raise ValueError(
                    f"{document.path}, {document.line_column(region.start)}: 'skip: {action}' "
                    "needs a reason, e.g. <!-- skip: next \"a fragment: `model` is not defined\" -->"
                )
            yield region


def _run(command: list[str], cwd: str, what: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    if proc.returncode != 0:
        out = (proc.stdout + proc.stderr)[-6000:]
        raise AssertionError(f"{what} exited {proc.returncode}:\n{out}")


class Launch:
    """``<!-- launch: trainmesh run -n 2 -->``: the next block is written to a file and run under
    that command (real processes, as a user runs it), not in this process."""

    def __init__(self):
        self.lexer = DirectiveInHTMLCommentLexer("launch")

    def __call__(self, document):
        for lexed in self.lexer(document):
            yield Region(lexed.start, lexed.end, lexed.lexemes["arguments"].strip(), self.evaluate)

    def evaluate(self, example):
        """The directive's evaluator and, pushed by it onto the page, the next block's."""
        if example.region.evaluator == self.evaluate:
            example.namespace["__launch__"] = shlex.split(example.parsed)
            example.document.push_evaluator(self.evaluate)
            return None
        example.document.pop_evaluator(self.evaluate)
        command = example.namespace.pop("__launch__")
        folder = example.namespace["__scratch__"]
        script = os.path.join(folder, f"test_block_line_{example.line}.py")  # pytest collects it too
        with open(script, "w") as fh:
            fh.write(str(example.parsed))
        _run(command + [script], folder, f"{' '.join(command)} (block at line {example.line})")
        return None


def _bash(example):
    _run(
        ["bash", "-euo", "pipefail", "-c", str(example.parsed)],
        example.namespace["__scratch__"],
        f"bash block at line {example.line}",
    )


def _setup(namespace):
    folder = tempfile.mkdtemp(prefix="trainmesh-docs-")
    for name in LINKED:
        os.symlink(os.path.join(ROOT, name), os.path.join(folder, name))
    namespace["__scratch__"] = folder
    namespace["__cwd__"] = os.getcwd()
    os.chdir(folder)


def _teardown(namespace):
    os.chdir(namespace["__cwd__"])
    shutil.rmtree(namespace["__scratch__"], ignore_errors=True)
    if "trainmesh" in sys.modules:  # a page that set a distribution or started a group leaves none behind
        import torch.distributed as dist

        import trainmesh as tm

        tm.set_distribution(None)
        if dist.is_initialized():
            tm.shutdown()


def make_sybil(path: str = ROOT, patterns=("README.md", "docs/*.md")) -> Sybil:
    return Sybil(
        parsers=[ReasonedSkipParser(), Launch(), PythonCodeBlockParser(), CodeBlockParser("bash", _bash)],
        path=path,
        patterns=list(patterns),
        setup=_setup,
        teardown=_teardown,
    )


pytest_collect_file = make_sybil().pytest()
