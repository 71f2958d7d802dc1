"""`import radixcache` must stay light: no torch, no transformers."""

import subprocess
import sys


def test_import_does_not_pull_torch_or_transformers():
    """The core (blocks, tree, manager) imports neither torch nor transformers."""
    code = ("import sys, radixcache, radixcache.manager; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
            "print(','.join(bad)); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, f"import radixcache imported: {result.stdout.strip()} {result.stderr}"


def test_wrap_is_exported_lazily():
    import radixcache

    assert "wrap" in radixcache.__all__
    assert callable(getattr(radixcache, "wrap"))
