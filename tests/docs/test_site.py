"""The docs site builds with `mkdocs build --strict` (a broken link, a missing page or a page
left out of the nav fails), and the strict build does fail on a broken link."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build(config_dir, site_dir):
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)],
        cwd=config_dir,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.timeout(150)
def test_the_site_builds_strictly(tmp_path):
    proc = build(ROOT, tmp_path / "site")
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.timeout(150)
def test_a_broken_link_fails_the_build(tmp_path):
    shutil.copytree(os.path.join(ROOT, "docs"), tmp_path / "docs")
    shutil.copy(os.path.join(ROOT, "mkdocs.yml"), tmp_path / "mkdocs.yml")
    with open(tmp_path / "docs" / "trainer.md", "a") as fh:
        fh.write("\nSee [the missing page](no_such_page.md).\n")
    proc = build(tmp_path, tmp_path / "site")
    assert proc.returncode != 0 and "no_such_page.md" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
