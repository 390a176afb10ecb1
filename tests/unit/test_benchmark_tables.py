"""The benchmark tables in the READMEs and docs/benchmarks.md are exactly what benchmarks/render_tables.py renders from
benchmarks/results/latest.json: a figure edited by hand, or a results file committed without
re-rendering, fails here."""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _render_module():
    spec = importlib.util.spec_from_file_location("render_tables", os.path.join(ROOT, "benchmarks", "render_tables.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def render():
    return _render_module()


@pytest.fixture(scope="module")
def results(render):
    with open(render.RESULTS) as fh:
        return json.load(fh)


@pytest.mark.timeout(30)
def test_results_file_has_the_fixed_fields(results):
    for key in ("commit", "date", "machine", "versions", "benchmarks", "figures", "mode"):
        assert key in results, key
    assert results["figures"], "no figures in the results file"
    assert all(isinstance(v, (int, float)) for v in results["figures"].values())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("which", ["benchmarks/README.md", "docs/benchmarks.md", "README.md"])
def test_readme_tables_match_the_results_file(render, results, which):
    path = os.path.join(ROOT, which)
    with open(path) as fh:
        current = fh.read()
    expected = render.rendered(path, results)
    assert current == expected, f"{which} is stale: run python benchmarks/render_tables.py"


@pytest.mark.timeout(30)
def test_a_changed_figure_is_caught(render, results, tmp_path):
    """The check can fail: one figure changed in the results renders a different table."""
    name = next(iter(results["figures"]))
    changed = {**results, "figures": {**results["figures"], name: results["figures"][name] * 1.5 + 1}}
    path = os.path.join(ROOT, "benchmarks", "README.md")
    assert render.rendered(path, changed) != render.rendered(path, results)


@pytest.mark.timeout(30)
def test_every_figure_in_the_tables_comes_from_the_file(render, results):
    for body in (render.render_bench(results), render.render_docs(results)):
        for name, value in results["figures"].items():
            assert f"| `{name}` | {render._fmt_against_target(name, value)} |" in body, name
    top = render.render_top(results)
    for name in render.TOP_FIGURES:
        if name in results["figures"]:
            assert f"| `{name}` | {render._fmt_against_target(name, results['figures'][name])} |" in top, name


@pytest.mark.timeout(30)
def test_a_value_is_shown_with_the_digits_its_verdict_needs(render):
    # four significant digits would show 1.0004 as 1, which reads as meeting "<= 1.00"
    assert render._fmt_against_target("zero2_step_vs_deepspeed", 1.0003640640018983) == "1.0004"
    assert render._fmt_against_target("zero2_step_vs_deepspeed", 0.98854) == "0.9885"  # four suffice
    assert render._fmt_against_target("ps_push_1mb_vs_raw_zmq", 0.59996) == "0.59996"  # goal >= 0.60
    assert (
        render._fmt_against_target("ps_sparse_push_vs_raw_zmq", 0.0680123) == "0.06801"
    )  # far from its goal (>= 0.50): four digits
    rows = "\n".join(
        render.figure_rows(
            {"figures": {"zero2_step_vs_deepspeed": 1.0003640640018983}, "mode": "full"}, ["zero2_step_vs_deepspeed"]
        )
    )
    assert "| 1.0004 |" in rows and "NOT MET" in rows


@pytest.mark.timeout(30)
def test_the_stamp_names_what_a_refresh_measured_again_and_what_changed_since(render):
    results = {
        "commit": "aaaaaaaaaaaa",
        "date": "2026-11-28T00:00:00Z",
        "mode": "full",
        "refreshed": [
            {
                "commit": "bbbbbbbbbbbb",
                "date": "2026-11-30T00:00:00Z",
                "benchmarks": ["ps"],
                "changed_since": {
                    "aaaaaaaaaaaa": ["benchmarks/ps.py", "src/trainmesh/ps/client_io.py", "src/trainmesh/ps/server.py"]
                },
            }
        ],
    }
    text = render.stamp(results)
    assert text.startswith("From `benchmarks/results/latest.json`: commit aaaaaaaaaaaa, 2026-11-28"), text
    assert (
        "Re-run at commit bbbbbbbbbbbb (2026-11-30T00:00:00Z): ps; files of src/ and benchmarks/ changed "
        "since aaaaaaaaaaaa: `benchmarks/ps.py`, `src/trainmesh/ps/` (2 files)." in text
    ), text
    assert "Re-run" not in render.stamp({**results, "refreshed": []})
