"""A chat's text is tokenized once: later turns tokenize only what follows the kept prefix, and the
ids are always those of tokenizing the text whole."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_helpers import embedded_tokenizer

from radixcache.integrations.serve.requests.chat_template import ChatRenderer
from radixcache.integrations.serve.requests.prefix_tokens import PrefixTokenizer, cutting_specials

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
PIECES = list("ab Z9\n\t.{}<|>_é字") + [" the", "<|im_start|>", "<|im_end|>", "\n\n", "<|endoftext|>", "  "]
TEXT = st.lists(st.sampled_from(PIECES), max_size=20).map("".join)
MESSAGE = st.tuples(st.sampled_from(["user", "assistant", "tool"]), TEXT)


class CountingEncode:
    """The embedded tokenizer's encode, counting the characters it is given."""

    def __init__(self):
        self.tokenizer = embedded_tokenizer()
        self.chars = 0

    def __call__(self, text):
        self.chars += len(text)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def whole(text):
    return embedded_tokenizer()(text, add_special_tokens=False)["input_ids"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.lists(MESSAGE, min_size=1, max_size=3), min_size=1, max_size=5), st.booleans())
def test_every_turn_of_a_growing_chat_tokenizes_as_the_whole_text(turns, system):
    renderer = ChatRenderer(embedded_tokenizer())
    messages = [{"role": "system", "content": "You are terse. " * 20}] if system else []
    for new in turns:
        messages += [{"role": role, "content": content} for role, content in new]
        text = renderer.render_text(messages)
        assert renderer.tokenize(text) == whole(text)
        history = renderer.render_text(messages, add_generation_prompt=False)
        assert renderer.tokenize(history) == whole(history)


def test_a_later_turn_tokenizes_only_its_new_messages():
    encode = CountingEncode()
    tokens = PrefixTokenizer(encode, cutting_specials(encode.tokenizer, (IM_START, IM_END)))
    renderer = ChatRenderer(embedded_tokenizer())
    messages = [{"role": "system", "content": "A long preamble. " * 200}, {"role": "user", "content": "Hi"}]
    first = renderer.render_text(messages)
    assert tokens.tokenize(first) == whole(first)
    messages += [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Next?"}]
    second = renderer.render_text(messages)
    encode.chars = 0
    assert tokens.tokenize(second) == whole(second)
    assert encode.chars < 100 < len(second) // 20  # the preamble was not tokenized again


def test_a_text_that_shares_no_kept_prefix_is_tokenized_whole():
    encode = CountingEncode()
    tokens = PrefixTokenizer(encode, cutting_specials(encode.tokenizer, (IM_START, IM_END)))
    a = f"{IM_START}system\nAlpha{IM_END}\n{IM_START}user\nx{IM_END}\n"
    b = f"{IM_START}system\nBeta{IM_END}\n{IM_START}user\nx{IM_END}\n"
    assert tokens.tokenize(a) == whole(a)
    encode.chars = 0
    assert tokens.tokenize(b) == whole(b)
    assert encode.chars == len(b)


def test_an_added_token_that_can_straddle_a_cut_rules_that_special_out():
    import copy

    tokenizer = copy.deepcopy(embedded_tokenizer())
    from tokenizers import AddedToken

    tokenizer.add_tokens([AddedToken("ok<|im_s", normalized=False)])  # would start before a cut and run into it
    assert IM_START not in cutting_specials(tokenizer, (IM_START, IM_END))
    assert IM_END in cutting_specials(tokenizer, (IM_START, IM_END))
    renderer = ChatRenderer(tokenizer)
    text = renderer.render_text([{"role": "user", "content": "ok<|im_start|>x"}, {"role": "assistant", "content": "ok"}])
    for _ in range(2):
        assert renderer.tokenize(text) == tokenizer(text, add_special_tokens=False)["input_ids"]
    unsafe = PrefixTokenizer(renderer._encode, {IM_START: tokenizer.convert_tokens_to_ids(IM_START)})
    assert not unsafe.check(text)  # why it is ruled out: cut there, the text tokenizes differently


def test_a_slow_tokenizer_gets_no_cuts():
    class Slow:
        is_fast = False

    assert cutting_specials(Slow(), (IM_START,)) == {}


def test_a_piece_that_does_not_start_with_its_special_falls_back_to_the_whole_text():
    """An encode that writes a marker before every text (as a prefix space would): every piece
    from a cut starts with it, not with the special's id, so nothing is cut or kept."""
    tokenizer = embedded_tokenizer()
    specials = cutting_specials(tokenizer, (IM_START, IM_END))

    def marked(text):
        return [7] + tokenizer(text, add_special_tokens=False)["input_ids"]

    tokens = PrefixTokenizer(marked, specials)
    text = f"{IM_START}user\nHi{IM_END}\n{IM_START}assistant\n"
    for _ in range(2):
        assert tokens.tokenize(text) == marked(text)
    assert not tokens.check(text) and tokens.specials == {}  # the check rules the cuts out too
    assert tokens.tokenize(text + "more") == marked(text + "more")


def test_the_kept_prefixes_are_bounded_least_recently_used_first():
    tokenizer = embedded_tokenizer()
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    tokens = PrefixTokenizer(encode, cutting_specials(tokenizer, (IM_START, IM_END)), max_entries=3,
                             max_chars=10_000)
    texts = [f"{IM_START}user\nsession {i}{IM_END}\n{IM_START}assistant\n" for i in range(5)]
    for text in texts:
        assert tokens.tokenize(text) == encode(text)
    kept = tokens.kept()
    assert len(kept) == 3 and all(t.startswith(f"{IM_START}user\nsession {i}") for t, i in zip(kept, (2, 3, 4)))
    big = f"{IM_START}user\n" + "x" * 20_000 + f"{IM_END}\n{IM_START}assistant\n"
    assert tokens.tokenize(big) == encode(big)
    assert sum(map(len, tokens.kept())) <= 10_000  # too long to keep: the others stay


@pytest.mark.parametrize("content", ["", "<|im_start|>", "a<|im_end|>b", "\n"])
def test_special_texts_inside_messages_tokenize_as_the_whole_text(content):
    renderer = ChatRenderer(embedded_tokenizer())
    messages = [{"role": "user", "content": content}, {"role": "assistant", "content": content},
                {"role": "user", "content": content + "?"}]
    for n in range(1, 4):
        text = renderer.render_text(messages[:n])
        assert renderer.tokenize(text) == whole(text)
