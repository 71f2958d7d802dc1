"""The README's Python snippets run as written (slow: the embedded model)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)


def test_the_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for link in re.findall(r"\]\(([^)#:]+)\)", text):
        assert (ROOT / link).exists(), link


@pytest.mark.slow
def test_the_wrap_snippet_runs_and_its_second_call_hits_the_cache():
    snippet = python_blocks()[0]
    assert "radixcache.wrap(model)" in snippet
    result = subprocess.run([sys.executable, "-c", snippet], cwd=ROOT, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert float(result.stdout.strip().splitlines()[-1]) > 0
