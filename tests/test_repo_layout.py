"""No tracked file sits where GitHub's standard Python .gitignore would drop it from a contributor's commits."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON_GITIGNORE = ROOT / "tests" / "data" / "github-python.gitignore"


@pytest.mark.skipif(
    not (ROOT / ".git").exists() or not shutil.which("git"), reason="not a git checkout"
)
def test_no_tracked_file_is_ignored_by_the_standard_python_gitignore():
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "pipeline/builder/builder.py" in tracked.splitlines()  # the check reads real paths
    check = ["git", "-c", f"core.excludesFile={PYTHON_GITIGNORE}", "check-ignore", "--no-index"]
    ignored = subprocess.run(
        [*check, "--stdin", "-v"], cwd=ROOT, input=tracked, capture_output=True, text=True
    ).stdout
    assert ignored == ""
    probe = subprocess.run([*check, "pipeline/build/x.py"], cwd=ROOT, capture_output=True)
    assert probe.returncode == 0  # and the list does catch the old package name
