"""One thread with torch's parallel CPU kernels per process (``radixcache.compute_threads``).

libgomp gives each thread that runs a parallel region a worker pool of its own, for that thread's
life; with more workers than CPUs every pool sleeps between kernels (see the module). These tests
count OS threads around a parallel-sized matmul in a fresh interpreter: a thread kept serial makes
no pool, the compute thread makes one, and ``radixcache serve``'s loader leaves the loading thread
serial and hands torch's count to the engine's scheduler thread.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from serve_helpers import write_model_dir

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPUs for a parallel pool")

COUNT = """
import os, threading, torch
def threads():
    return len(os.listdir("/proc/self/task"))
def big_matmul():
    a = torch.randn(512, 512)
    for _ in range(3):
        a @ a
"""


def run(script: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # the defaults under test
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(COUNT) + textwrap.dedent(script)],
                          capture_output=True, text=True, timeout=300, cwd=os.path.dirname(__file__), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_serial_thread_makes_no_pool_and_the_compute_thread_makes_one():
    out = run("""
        from radixcache.compute_threads import serial_here, parallel_here
        chosen = serial_here()
        assert chosen >= 2 and torch.get_num_threads() == 1
        before = threads()
        big_matmul()
        assert threads() == before, (before, threads())  # no OpenMP pool for the serial thread
        seen = []
        def compute():
            parallel_here(chosen)
            big_matmul()
            seen.append((torch.get_num_threads(), threads()))
        worker = threading.Thread(target=compute)
        worker.start(); worker.join()
        assert seen[0][0] == chosen and seen[0][1] >= before + chosen, (seen, before)  # itself + its pool
        assert torch.get_num_threads() == 1  # the serial thread stays serial
        print("ok")
    """)
    assert out.strip() == "ok"


def test_parallel_here_refuses_a_bad_count():
    from radixcache.compute_threads import parallel_here

    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="threads must be an int >= 1"):
            parallel_here(bad)


def test_the_server_loads_serially_and_computes_on_the_scheduler_thread(tmp_path):
    model = write_model_dir(tmp_path / "tiny", weights=True)
    out = run(f"""
        import argparse
        from radixcache.app.cli import build_parser
        from radixcache.integrations.serve.options import ServeOptions
        from radixcache.integrations.serve.server import build_state, load_engine
        chosen = torch.get_num_threads()
        args = build_parser().parse_args(["serve", "--model", {str(model)!r}, "--max-cache-tokens", "512",
                                          "--dtype", "float32"])
        options = ServeOptions.from_args(args)
        state = build_state(options)
        seen = []
        engine = load_engine(options, state.info)
        step = engine.engine.step
        def recording_step():
            seen.append(torch.get_num_threads())
            return step()
        engine.engine.step = recording_step
        assert torch.get_num_threads() == 1  # the loading thread stays serial
        import asyncio
        from radixcache.engine import Request, SamplingParams
        async def one():
            events = [e async for e in engine.submit(Request("r", [1, 2, 3], SamplingParams(max_new_tokens=2)))]
            await engine.close()
            return events
        events = asyncio.run(one())
        assert events[-1].finished and seen and set(seen) == {{chosen}}, (seen, chosen)
        print("ok")
    """)
    assert out.strip() == "ok"


def test_available_cpus_is_the_affinity_capped_by_a_cgroup_quota(tmp_path):
    from radixcache.compute_threads import available_cpus

    allowed = len(os.sched_getaffinity(0))
    assert available_cpus(tmp_path) == allowed  # no quota files: the affinity
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert available_cpus(tmp_path) == allowed
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a CPU rounds up to one
    assert available_cpus(tmp_path) == 1
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")  # cgroup v1: one CPU
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert available_cpus(tmp_path) == 1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # v1's "no quota"
    assert available_cpus(tmp_path) == allowed


@pytest.mark.parametrize("value, expected", [("3", (3, "OMP_NUM_THREADS")), ("0", None), ("two", None),
                                             (None, None)])
def test_the_default_thread_count_follows_omp_num_threads_when_it_is_valid(monkeypatch, value, expected):
    from radixcache.compute_threads import available_cpus, default_threads

    if value is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", value)
    assert default_threads() == (expected or (available_cpus(), "the CPUs this process may use"))
