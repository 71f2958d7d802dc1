"""``previous_response_id``'s append against the whole render, and the stored-responses bound.

``continued_prompt`` must never give a prompt whose text is not the conversation's whole render:
whenever it answers, the stored ids are its prefix and it decodes to exactly that render; when the
stored ids are the whole render's own tokens, it is the whole render, token for token. Where the
template writes the past differently from the stored tokens (a dropped ``<think>`` block, a call
written anew) it answers None and the server renders anew.
"""

import pytest
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from hypothesis import strategies as st

from radixcache.integrations.serve.requests.chat_template import ChatRenderer
from radixcache.integrations.serve.protocols.openai.responses import continued_prompt
from radixcache.integrations.serve.protocols.openai.response_store import ResponseStore, StoredResponse
from serve_helpers import DRIFT_STRIP_THINK, embedded_tokenizer, tokenizer_with_template

TEXT = st.lists(st.sampled_from(list("ab zé\n.!{}\"") + ["Hello", " world", "\n\n", "  "]), min_size=1,
                max_size=12).map("".join)
SMOL = ChatRenderer(embedded_tokenizer())
EOS = 2


def stored_ids(renderer, previous, reply_ids):
    return tuple(renderer.render(previous).token_ids) + tuple(reply_ids) + (EOS,)


@settings(max_examples=60, deadline=None)
@given(user=TEXT, reply=TEXT, nxt=TEXT, system=st.none() | TEXT, tool=st.booleans())
def test_the_append_is_the_whole_render_whenever_it_answers(user, reply, nxt, system, tool):
    previous = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    new = {"role": "tool", "tool_call_id": "c", "content": nxt} if tool else {"role": "user", "content": nxt}
    messages = previous + [{"role": "assistant", "content": reply}, new]
    whole = SMOL.render(messages)
    reply_ids = SMOL.tokenize(reply)
    stored = stored_ids(SMOL, previous, reply_ids)
    ids = continued_prompt(SMOL, stored, messages, None)
    if ids is not None:
        assert ids[:len(stored)] == stored
        assert SMOL.tokenizer.decode(list(ids), skip_special_tokens=False) == whole.text
    # the whole render's own tokens up to the reply's end: the append is the whole render exactly
    own = tuple(whole.token_ids[:whole.token_ids.index(EOS, len(SMOL.render(previous).token_ids)) + 1])
    assert continued_prompt(SMOL, own, messages, None) == whole.token_ids


def test_a_plain_reply_is_appended_not_rendered_again():
    previous = [{"role": "user", "content": "Greet me."}]
    messages = previous + [{"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "Again."}]
    odd = SMOL.tokenize("H") + SMOL.tokenize("ello there")  # not the tokenizer's own split
    stored = stored_ids(SMOL, previous, odd)
    ids = continued_prompt(SMOL, stored, messages, None)
    assert ids is not None and ids[:len(stored)] == stored and ids != SMOL.render(messages).token_ids


def test_a_past_the_template_writes_differently_is_refused():
    renderer = ChatRenderer(tokenizer_with_template(DRIFT_STRIP_THINK))
    previous = [{"role": "user", "content": "Think."}]
    reply = "<think>hmm</think>Done."
    messages = previous + [{"role": "assistant", "content": reply}, {"role": "user", "content": "More."}]
    stored = stored_ids(renderer, previous, renderer.tokenize(reply))
    assert continued_prompt(renderer, stored, messages, None) is None
    # a call the model wrote unlike the template's canonical call text
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = previous + [{"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "tool_call_id": "c", "content": "ok"}]
    stored = tuple(SMOL.render(previous, tools).token_ids) + tuple(SMOL.tokenize('<tool_call>{"name":"f","arguments":{}}</tool_call>')) + (EOS,)
    assert continued_prompt(SMOL, stored, messages, tools) is None


def test_a_boundary_inside_a_word_is_refused():
    """Stored ids that end mid-text (no stop token, no special token next) could merge with what
    follows in the whole render's tokenization: refused."""
    previous = [{"role": "user", "content": "Count."}]
    messages = previous + [{"role": "assistant", "content": "one two"}, {"role": "user", "content": "x"}]
    stored = tuple(SMOL.render(previous).token_ids) + tuple(SMOL.tokenize("one tw"))
    assert continued_prompt(SMOL, stored, messages, None) is None


def record(salt=None, n=10, text="x"):
    return StoredResponse({"id": text}, salt, None, None, [{"role": "user", "content": text}], tuple(range(n)), (1,))


def test_the_store_is_bounded_in_bytes_least_recently_used_first():
    size = record().nbytes
    store = ResponseStore(max_bytes=3 * size)
    for rid in "abc":
        assert store.put(rid, record())
    assert store.get("a", None) is not None  # a is now the most recently used
    store.put("d", record())
    assert store.get("b", None) is None and all(store.get(r, None) for r in "acd")
    assert store.bytes == 3 * size and len(store) == 3
    assert not store.put("huge", record(n=10_000)) and store.get("huge", None) is None and len(store) == 3


def test_the_store_forgets_after_its_ttl_and_by_salt():
    now = [0.0]
    store = ResponseStore(ttl_s=10, clock=lambda: now[0])
    store.put("a", record(salt="k1"))
    now[0] = 5
    store.put("b", record())
    assert store.get("a", "k2") is None and not store.delete("a", "k2") and store.get("a", "k1") is not None
    now[0] = 10
    assert store.get("a", "k1") is None and store.get("b", None) is not None
    now[0] = 15
    assert store.get("b", None) is None and store.bytes == 0 and len(store) == 0
    with pytest.raises(ValueError):
        ResponseStore(max_bytes=0)


class StoreMachine(RuleBasedStateMachine):
    """The store against a plain model: the newest puts that fit, least recently used first out,
    none older than the TTL, the byte count exact and within the bound."""

    def __init__(self):
        super().__init__()
        self.now = 0.0
        self.store = ResponseStore(max_bytes=4 * record().nbytes + 10, ttl_s=50, clock=lambda: self.now)
        self.model = {}  # id -> (salt, size, stored at), least recently used first

    def _expire(self):
        for rid in [r for r, (_, _, at) in self.model.items() if at <= self.now - 50]:
            del self.model[rid]

    @rule(rid=st.sampled_from("abcdef"), salt=st.sampled_from([None, "k"]), n=st.sampled_from([1, 10, 30]))
    def put(self, rid, salt, n):
        stored = record(salt=salt, n=n)
        self.model.pop(rid, None)  # a put replaces what the id held, whatever its salt
        self._expire()
        size = stored.nbytes
        kept = self.store.put(rid, stored)
        assert kept == (size <= self.store.max_bytes)
        if kept:
            while self.model and sum(s for _, s, _ in self.model.values()) + size > self.store.max_bytes:
                del self.model[next(iter(self.model))]
            self.model[rid] = (salt, size, self.now)

    @rule(rid=st.sampled_from("abcdef"), salt=st.sampled_from([None, "k"]))
    def get(self, rid, salt):
        self._expire()
        found = self.store.get(rid, salt)
        expected = rid in self.model and self.model[rid][0] == salt
        assert (found is not None) == expected
        if expected:
            self.model[rid] = self.model.pop(rid)

    @rule(rid=st.sampled_from("abcdef"), salt=st.sampled_from([None, "k"]))
    def delete(self, rid, salt):
        expected = rid in self.model and self.model[rid][0] == salt
        assert self.store.delete(rid, salt) == expected
        if expected:
            del self.model[rid]

    @rule(dt=st.sampled_from([1.0, 20.0, 60.0]))
    def wait(self, dt):
        self.now += dt

    @invariant()
    def bounded_and_exact(self):
        assert self.store.bytes <= self.store.max_bytes
        assert self.store.bytes == sum(s for _, s, _ in self.model.values())
        assert len(self.store) == len(self.model)


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
