"""Static check: pyflakes finds no unused import, undefined name or shadowed import in the
project's Python files (an undefined name is an error that only the path that reaches it shows)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ["radixcache", "integrations", "benchmarks", "examples", "tests"]


def test_pyflakes_finds_nothing():
    """pyflakes is in [dev] (make setup installs it): a missing one fails here, never skips."""
    paths = [str(ROOT / p) for p in CHECKED if (ROOT / p).exists()]
    run = subprocess.run([sys.executable, "-m", "pyflakes", *paths], capture_output=True, text=True)
    assert run.returncode == 0 and not run.stdout.strip(), run.stdout + run.stderr
