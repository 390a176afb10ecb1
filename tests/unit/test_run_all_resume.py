"""run_all.py --resume: a cut full run continues at the same commit, keeps what it finished, reruns what it
did not reach or what failed, and refuses a results file of another commit or mode instead of mixing code."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

pytestmark = [pytest.mark.timeout(120)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A stand-in benchmark: counts its runs in a file beside it, fails when told to, writes one figure.
SCRIPT = """
import json, os, sys
here = os.path.dirname(os.path.abspath(__file__))
name = os.path.basename(__file__)[:-3]
with open(os.path.join(here, name + ".runs"), "a") as fh:
    fh.write("run\\n")
if os.path.exists(os.path.join(here, name + ".fail")):
    sys.exit(3)
with open(sys.argv[sys.argv.index("--json") + 1], "w") as fh:
    json.dump({"figures": {name + "_figure": 1.5}}, fh)
"""


@pytest.fixture
def run_all(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("run_all_under_test", os.path.join(ROOT, "benchmarks", "run_all.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    registry = []
    for name in ("first", "second", "third"):
        script = tmp_path / f"{name}.py"
        script.write_text(SCRIPT)
        registry.append({"name": name, "script": str(script), "needs": []})  # an absolute path: join keeps it
    monkeypatch.setattr(module, "REGISTRY", registry)
    monkeypatch.setattr(module, "machine_info", lambda: {"cpu": "test"})
    monkeypatch.setattr(module, "versions", lambda: {})
    monkeypatch.setattr(module, "commit_info", lambda: {"commit": "aaaaaaaaaaaa", "dirty": False})
    return module


def _runs(tmp_path, name: str) -> int:
    path = tmp_path / f"{name}.runs"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_resume_runs_only_what_was_not_finished(run_all, tmp_path):
    out = str(tmp_path / "results.json")
    (tmp_path / "second.fail").write_text("")
    assert run_all.main(["--json", out, "--only", "first,second"]) == 1  # second failed; third not chosen
    first = json.load(open(out))
    assert first["failed"] == ["second"] and first["figures"] == {"first_figure": 1.5}

    (tmp_path / "second.fail").unlink()
    assert run_all.main(["--json", out, "--resume"]) == 0
    report = json.load(open(out))
    assert (_runs(tmp_path, "first"), _runs(tmp_path, "second"), _runs(tmp_path, "third")) == (1, 2, 1)
    assert report["figures"] == {"first_figure": 1.5, "second_figure": 1.5, "third_figure": 1.5}
    assert report["failed"] == [] and report["unfinished"] == []
    assert report["date"] == first["date"] and len(report["resumed"]) == 1  # the first run's stamp is kept
    assert report["benchmarks"]["first"] == first["benchmarks"]["first"]  # kept as measured, not rerun


def test_resume_refuses_another_commit_mode_or_dirty_tree(run_all, tmp_path, monkeypatch):
    out = str(tmp_path / "results.json")
    assert run_all.main(["--json", out, "--only", "first"]) == 0
    before = open(out).read()

    with pytest.raises(SystemExit, match="mode 'full', this run 'quick'"):
        run_all.main(["--json", out, "--resume", "--quick"])
    monkeypatch.setattr(run_all, "commit_info", lambda: {"commit": "bbbbbbbbbbbb", "dirty": False})
    with pytest.raises(SystemExit, match="commit 'aaaaaaaaaaaa', this run 'bbbbbbbbbbbb'"):
        run_all.main(["--json", out, "--resume"])
    monkeypatch.setattr(run_all, "commit_info", lambda: {"commit": "aaaaaaaaaaaa", "dirty": True})
    with pytest.raises(SystemExit, match="dirty tree"):
        run_all.main(["--json", out, "--resume"])
    with pytest.raises(SystemExit, match="does not exist"):
        run_all.main(["--json", str(tmp_path / "none.json"), "--resume"])
    assert open(out).read() == before  # a refused resume leaves the results file as it was
    assert _runs(tmp_path, "second") == 0


def test_refresh_measures_the_named_benchmarks_again_and_says_which_commit_measured_each(
    run_all, tmp_path, monkeypatch
):
    out = str(tmp_path / "results.json")
    assert run_all.main(["--json", out]) == 0
    first = json.load(open(out))
    assert {entry["commit"] for entry in first["benchmarks"].values()} == {"aaaaaaaaaaaa"}

    monkeypatch.setattr(run_all, "commit_info", lambda: {"commit": "bbbbbbbbbbbb", "dirty": False})
    monkeypatch.setattr(run_all, "changed_files", lambda old, new: ["src/trainmesh/ps/client_io.py"])
    assert run_all.main(["--json", out, "--refresh", "--only", "second"]) == 0
    report = json.load(open(out))
    assert [_runs(tmp_path, n) for n in ("first", "second", "third")] == [1, 2, 1]
    assert list(report["benchmarks"]) == ["first", "second", "third"]  # the registry's order, as merged
    assert {n: e["commit"] for n, e in report["benchmarks"].items()} == {
        "first": "aaaaaaaaaaaa",
        "second": "bbbbbbbbbbbb",
        "third": "aaaaaaaaaaaa",
    }
    assert report["commit"] == "aaaaaaaaaaaa" and report["date"] == first["date"]  # the full run's stamp
    (record,) = report["refreshed"]
    assert record["benchmarks"] == ["second"] and record["commit"] == "bbbbbbbbbbbb"
    assert record["changed_since"] == {"aaaaaaaaaaaa": ["src/trainmesh/ps/client_io.py"]}
    assert report["figures"] == {"first_figure": 1.5, "second_figure": 1.5, "third_figure": 1.5}


def test_refresh_refuses_without_only_another_mode_or_a_dirty_tree(run_all, tmp_path, monkeypatch):
    out = str(tmp_path / "results.json")
    assert run_all.main(["--json", out, "--only", "first"]) == 0
    before = open(out).read()
    with pytest.raises(SystemExit, match="needs --only"):
        run_all.main(["--json", out, "--refresh"])
    with pytest.raises(SystemExit, match="mode"):
        run_all.main(["--json", out, "--refresh", "--only", "first", "--quick"])
    with pytest.raises(SystemExit):
        run_all.main(["--json", out, "--refresh", "--resume", "--only", "first"])
    monkeypatch.setattr(run_all, "commit_info", lambda: {"commit": "aaaaaaaaaaaa", "dirty": True})
    with pytest.raises(SystemExit, match="dirty"):
        run_all.main(["--json", out, "--refresh", "--only", "first"])
    assert open(out).read() == before  # a refused refresh leaves the results file as it was
