"""Incremental detokenization with stop strings, on the embedded SmolLM2 tokenizer."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixcache.integrations.serve.requests.detokenize import TextAssembler
from serve_helpers import embedded_tokenizer

EOS = 2


def run(ids, stops=(), stop_ids=(EOS,)):
    asm = TextAssembler(embedded_tokenizer(), stops, stop_ids)
    pieces = [asm.push(t) for t in ids]
    pieces.append(asm.finish())
    return asm, pieces


@pytest.mark.parametrize("text", [
    "The capital of France is Paris.",
    "naïve café, crème brûlée — 東京タワー 🚀🚀 ok",
    "  leading spaces and\nnew\n\nlines\ttabs",
    '{"city": "Berlin", "days": 3}',
])
def test_pieces_add_up_to_the_decoded_text(text):
    tok = embedded_tokenizer()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    asm, pieces = run(ids)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == asm.text
    assert all("\ufffd" not in p for p in pieces)  # a multi-byte character is sent once it is whole


def test_emoji_split_over_byte_tokens_waits_until_whole():
    tok = embedded_tokenizer()
    ids = tok("🚀", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1  # byte-level BPE: the rocket is several tokens
    _, pieces = run(ids)
    assert pieces[:len(ids) - 1] == [""] * (len(ids) - 1)  # nothing until the last byte
    assert pieces[len(ids) - 1] == "🚀" and "".join(pieces) == "🚀"


def test_stop_token_ids_are_never_decoded():
    tok = embedded_tokenizer()
    ids = tok("Hello", add_special_tokens=False)["input_ids"] + [EOS]
    _, pieces = run(ids)
    assert "".join(pieces) == "Hello"


def test_stop_string_ends_the_text_before_it():
    tok = embedded_tokenizer()
    ids = tok("Answer: 42.\nUser: next question", add_special_tokens=False)["input_ids"]
    asm, pieces = run(ids, stops=["\nUser:"])
    assert "".join(pieces) == "Answer: 42." and asm.stopped
    assert asm.push(ids[0]) == ""  # nothing more after a stop


def test_a_possible_stop_start_is_held_back_then_released():
    tok = embedded_tokenizer()
    asm = TextAssembler(tok, ["STOP"], [EOS])
    out = "".join(asm.push(t) for t in tok("go ST", add_special_tokens=False)["input_ids"])
    assert out == "go "  # "ST" may become "STOP"
    out += "".join(asm.push(t) for t in tok("ILL here", add_special_tokens=False)["input_ids"])
    out += asm.finish()
    assert out == "go STILL here" and not asm.stopped


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab c.\n:é🚀")), max_size=40),
       st.lists(st.text(alphabet=st.sampled_from(list("ab c.\n:")), min_size=1, max_size=4), max_size=3))
def test_stop_strings_match_a_plain_search_of_the_decoded_text(text, stops):
    tok = embedded_tokenizer()
    ids = tok(text, add_special_tokens=False)["input_ids"]
    decoded = tok.decode(ids, skip_special_tokens=True)
    want, hit = decoded, False
    for end in range(1, len(decoded) + 1):  # reading left to right, the first stop string completed
        starts = [end - len(s) for s in stops if decoded[:end].endswith(s)]
        if starts:
            want, hit = decoded[:min(starts)], True
            break
    asm, pieces = run(ids, stops=stops)
    assert "".join(pieces) == want
    assert asm.stopped == hit
