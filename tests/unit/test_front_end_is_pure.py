"""The front end (``trainmesh.distribution``) is description only: it never imports the engine
(``trainmesh._torch``) or torch.distributed; the engine reads it, and the package root connects them."""

import ast
import importlib
import pathlib

import pytest

FRONT_END = pathlib.Path(importlib.import_module("trainmesh.distribution").__file__).parent
pytestmark = pytest.mark.usefixtures("no_process_group_left_behind")


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(("." * node.level) + node.module)
    return names


def test_no_front_end_module_imports_the_engine_or_torch_distributed():
    offenders = {}
    for path in sorted(FRONT_END.glob("*.py")):
        bad = {
            name
            for name in _imports(path)
            if "_torch" in name or name.startswith("torch.distributed") or name.startswith("trainmesh.trainer")
        }
        if bad:
            offenders[path.name] = sorted(bad)
    assert not offenders, f"front-end modules import the engine: {offenders}"


def test_distribute_model_still_applies_through_the_registered_engine():
    import torch

    import trainmesh as tm

    model = torch.nn.Linear(3, 2)
    out = tm.DataParallel(devices=["cpu:0"]).distribute_model(model)  # one process: nothing to average
    assert isinstance(out, torch.nn.Module) and out(torch.zeros(1, 3)).shape == (1, 2)
