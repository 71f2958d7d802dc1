"""The history index: a token trie per tenant salt that finds a prompt's previous turn, bounded by
the tokens it holds (not by the number of forms), checked against a brute-force model."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixcache.integrations.serve.history.index import HistoryIndex
from radixcache.tokens import common_prefix


def test_finds_the_previous_turn_per_salt_and_forgets_the_oldest_by_tokens():
    index = HistoryIndex(capacity_tokens=160, min_shared=4)
    a, b = tuple(range(50)), tuple(range(30)) + (99,) * 20
    index.remember(a)
    index.remember(b)  # shares 30 tokens with a: 20 more held
    index.remember(a, salt="tenant")
    index.remember((1, 2))  # shorter than min_shared: not kept
    index.remember(b, computed=12)  # stored again: now the most recent
    assert index.computed(b) == 12 and index.computed(a) is None and index.computed(a + (1,)) is None
    assert index.computed(a[:40]) is None  # a prefix of a stored form is not stored
    assert len(index) == 3 and index.tokens == 120
    assert index.previous(a + (7, 8)) == a
    assert index.previous(b + (7,)) == b
    assert index.previous(a + (7,), salt="tenant") == a
    assert index.previous(a, salt="other") is None
    assert index.previous((5, 6, 7, 8, 9)) is None  # starts differently
    assert index.previous(a[:3] + (500,) * 10) is None  # shares fewer than min_shared tokens
    assert index.previous(a[:35] + (500,)) == a  # 35 shared with a, 30 with b
    assert index.previous(a[:30] + (500,)) == b  # 30 with both: b is the more recent
    index.remember(tuple(range(200, 260)))  # 180 tokens > 160: the oldest (a, no salt) goes
    assert len(index) == 3 and index.tokens == 160
    assert index.previous(a + (7,)) == b  # b shares 30 tokens with it; a is gone
    assert index.previous(a + (7,), salt="tenant") == a


def test_a_form_keeps_its_source_until_stored_again_or_forgotten():
    index = HistoryIndex(capacity_tokens=100, min_shared=4)
    a, b = tuple(range(40)), tuple(range(20)) + (99,) * 20
    index.remember(a, source="conversation a")
    index.remember(b)
    assert index.source(a) == "conversation a" and index.source(b) is None
    assert index.source(a[:30]) is None and index.source(a, salt="tenant") is None
    index.remember(a, computed=8, source="a again")
    assert index.source(a) == "a again" and index.computed(a) == 8
    index.remember(tuple(range(300, 380)))  # past the bound: b, then a, go
    assert index.source(a) is None and index.computed(a) is None


def test_the_bound_is_tokens_whatever_the_number_of_forms():
    """Many long forms behind one shared system prompt: the trie holds the prompt once, and what it
    holds never exceeds its token bound, however many forms are stored."""
    system = tuple(range(1000, 2500))
    index = HistoryIndex(capacity_tokens=4000, min_shared=16)
    for turn in range(300):
        index.remember(system + tuple(range(10_000 + 100 * turn, 10_000 + 100 * turn + 100)))
        assert index.tokens <= 4000
    assert index.tokens == 1500 + 25 * 100 and len(index) == 25  # the system prompt is held once
    newest = system + tuple(range(10_000 + 100 * 299, 10_000 + 100 * 300))
    assert index.previous(newest + (5,)) == newest
    assert index.previous(system + (3,)) == newest  # of the forms sharing as much, the newest
    with pytest.raises(ValueError):
        HistoryIndex(capacity_tokens=0)


class Model:
    """The index's contract, by brute force: every form stored, the least recently stored dropped
    while the distinct (salt, prefix) pairs of the forms kept exceed the bound."""

    def __init__(self, capacity, min_shared):
        self.capacity, self.min_shared, self.forms = capacity, min_shared, {}  # (salt, ids) -> computed
        self.order = []

    def tokens(self):
        return len({(salt, ids[:i]) for salt, ids in self.forms for i in range(1, len(ids) + 1)})

    def remember(self, ids, salt, computed):
        if len(ids) < self.min_shared:
            return
        key = (salt, ids)
        if key in self.forms:
            self.order.remove(key)
        self.forms[key] = computed
        self.order.append(key)
        while self.tokens() > self.capacity:
            del self.forms[self.order.pop(0)]

    def previous(self, prompt, salt):
        best, best_len = None, self.min_shared - 1
        for s, ids in reversed(self.order):
            shared = common_prefix(ids, prompt)
            if s == salt and shared > best_len:
                best, best_len = ids, shared
        return best


tokens = st.lists(st.integers(0, 3), min_size=0, max_size=12).map(tuple)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.sampled_from([None, "t"]), tokens,
                          st.none() | st.integers(0, 9)), max_size=40),
       st.integers(1, 40), st.integers(1, 4))
def test_matches_the_brute_force_model(steps, capacity, min_shared):
    index, model = HistoryIndex(capacity_tokens=capacity, min_shared=min_shared), Model(capacity, min_shared)
    for store, salt, ids, computed in steps:
        if store:
            index.remember(ids, salt, computed)
            model.remember(ids, salt, computed)
        assert index.previous(ids, salt) == model.previous(ids, salt)
        assert index.computed(ids, salt) == model.forms.get((salt, ids))
        assert index.tokens == model.tokens() <= capacity and len(index) == len(model.forms)
