"""`import radixcache` must stay light: no torch, no transformers."""

import subprocess
import sys


def test_import_does_not_pull_torch_or_transformers():
    """The core (blocks, tree, manager) imports neither torch nor transformers."""
    code = ("import sys, radixcache, radixcache.lifecycle.manager; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
            "print(','.join(bad)); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, f"import radixcache imported: {result.stdout.strip()} {result.stderr}"


def test_wrap_is_exported_lazily():
    import radixcache

    assert "wrap" in radixcache.__all__
    assert callable(getattr(radixcache, "wrap"))


def test_engine_and_core_import_nothing_from_integrations():
    """Arrows point down: the engine, attention and kv layers never import an integration."""
    code = ("import sys, radixcache.engine, radixcache.attention, radixcache.kv.pool; "
            "bad = [m for m in sys.modules if m.startswith('radixcache.integrations') "
            "or m == 'transformers']; print(','.join(bad)); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, f"imported: {result.stdout.strip()} {result.stderr}"


def test_the_built_wheel_ships_every_package(tmp_path):
    """A wheel built from pyproject.toml contains radixcache.integrations.hf (package-dir mapping)
    and every module of the source tree; the editable install imports it too."""
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(tmp_path), str(root)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = next(tmp_path.glob("radixcache-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = [p.relative_to(root) for d in ("radixcache", "integrations") for p in (root / d).rglob("*.py")]
    for src in sources:
        packaged = ("radixcache/integrations" / src.relative_to("integrations")
                    if src.parts[0] == "integrations" else src)
        assert packaged.as_posix() in names, f"{src} is missing from the wheel"
    code = "import radixcache.integrations.hf as hf; print(hf.wrap.__module__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and "radixcache.integrations.hf" in result.stdout, result.stderr
