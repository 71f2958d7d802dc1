"""Shared fixtures: the end-of-test leak check that every test runs under."""

import gc

import pytest

from radixcache.tree import LIVE_CACHES

pytest_plugins = ["redis_servers"]  # the redis-server fixtures


@pytest.fixture(autouse=True)
def no_leaked_blocks(request):
    """Fail any test that leaves a pinned node or a block held outside the tree of a cache it made."""
    before = set(id(c) for c in LIVE_CACHES)
    yield
    if request.node.get_closest_marker("allow_leaks"):
        return
    gc.collect()
    problems = []
    for cache in list(LIVE_CACHES):
        if id(cache) in before:
            continue
        found = cache.leaks()
        if found:
            problems.append(f"{cache!r}: " + "; ".join(found))
    assert not problems, "leaked cache state:\n" + "\n".join(problems)
