"""Helpers for tests that drive an ``Engine`` step by step and read its events."""


def drain(engine, limit=5000):
    """Step until the engine has no work; return every event (AssertionError after ``limit`` steps)."""
    events = []
    for _ in range(limit):
        if not engine.has_work:
            return events
        events.extend(engine.step())
    raise AssertionError("the engine did not finish")


def tokens_of(events, request_id, sample=0):
    """The tokens of one sample of one request, in order."""
    return [e.token for e in events if e.request_id == request_id and e.sample == sample
            and e.token is not None]
