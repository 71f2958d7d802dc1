"""Issue 30: every failure stays with its request.

A mix of requests with extreme but valid sampling parameters, grammars, forced NaN / +inf / all -inf
logits and inputs that make the forward raise runs in one engine; every request must end exactly as
it ends alone (the same tokens, the same finish), the faulty ones with ``"error"``, and nothing may
leak. Checked over the stub runner (exact arithmetic, so any cross-talk shows) and over a real tiny
Llama (the HF runner, the torch attention backend).
"""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from radixcache.engine import FINISH_ERROR, Request, SamplingParams
from radixcache.engine.request import MIN_TEMPERATURE
from radixcache.engine.sampling import Row, StepChoice, choose, choose_step, sample_generator
from radixcache.engine.stub import StubRunner, stub_engine

V = 997
BS = 4
NAN, POSINF, NEGINF, BOMB = 990, 991, 992, 993  # a row whose own token is one of these is faulty
GRAMMAR_STOP = 996


class FaultyStubRunner(StubRunner):
    """The stub, with faults keyed on tokens: a step whose input holds ``BOMB`` raises; a logits row
    whose own input token is ``NAN`` / ``POSINF`` / ``NEGINF`` comes out NaN / with a +inf / all
    -inf (what an fp16 overflow or a broken head would give)."""

    def forward(self, tokens, positions, plan, logits_rows):
        if BOMB in tokens:
            raise RuntimeError("the model fell over on token 993")
        logits = super().forward(tokens, positions, plan, logits_rows)
        for out, row in enumerate(logits_rows):
            poison(logits, out, tokens[row])
        return logits


def poison(logits: torch.Tensor, out: int, token: int) -> None:
    if token == NAN:
        logits[out] = float("nan")
    elif token == POSINF:
        logits[out, 7] = float("inf")
    elif token == NEGINF:
        logits[out] = float("-inf")


@lru_cache(maxsize=None)
def digits_grammar(vocab_size: int):
    """A compiled grammar over a made-up vocabulary (ids 0-9 are the digits): 1 to 4 digits, then
    ``GRAMMAR_STOP``."""
    import xgrammar as xgr

    vocab = [str(i) if i < 10 else f"<t{i}>" for i in range(vocab_size)]
    info = xgr.TokenizerInfo(vocab, vocab_size=vocab_size, stop_token_ids=[GRAMMAR_STOP])
    return xgr.GrammarCompiler(info).compile_regex("[0-9]{1,4}")


EXTREME = dict(temperature=[1e-40, 1e-6, MIN_TEMPERATURE, 0.3, 2.0], top_p=[1e-300, 1e-7, 0.5, 1.0],
               top_k=[0, 1, 5, 2**40], min_p=[0.0, 0.5, 1 - 1e-12], repetition_penalty=[1.0, 1e-30, 1e30, 1.3],
               logprobs=[None, 0, 5])
KINDS = ["greedy", "extreme", "extreme", "grammar", "nan", "posinf", "neginf", "bomb"]


@st.composite
def request_specs(draw, vocab_size: int, lo: int, hi: int):
    """``(kind, prompt, params, grammar)``: prompts share a prefix half the time, so blocks are
    shared between good and faulty requests."""
    kind = draw(st.sampled_from(KINDS))
    prompt = draw(st.lists(st.integers(lo, hi), min_size=1, max_size=14))
    if draw(st.booleans()):
        prompt = [lo + 1, lo + 2, lo + 3, lo + 4, lo + 5] + prompt
    if kind in ("nan", "posinf", "neginf"):
        prompt.append({"nan": NAN, "posinf": POSINF, "neginf": NEGINF}[kind])
    if kind == "bomb":
        prompt.insert(draw(st.integers(0, len(prompt))), BOMB)
    new = draw(st.integers(1, 6))
    if kind == "extreme":
        knobs = {name: draw(st.sampled_from(values)) for name, values in EXTREME.items()}
        params = SamplingParams(max_new_tokens=new, do_sample=True, n=draw(st.integers(1, 3)),
                                seed=draw(st.integers(0, 2**32)), **knobs)
    else:
        params = SamplingParams(max_new_tokens=new, logprobs=draw(st.sampled_from([None, 2])))
    return kind, prompt, params, digits_grammar(vocab_size) if kind == "grammar" else None


def outcomes(engine, requests) -> dict:
    """``{(request id, sample): (tokens, finish reason)}`` of ``requests`` run together."""
    for request in requests:
        engine.add(request)
    out: dict = {}
    while engine.has_work:
        for event in engine.step():
            tokens, _ = out.get((event.request_id, event.sample), ([], None))
            if event.token is not None:
                tokens = tokens + [event.token]
            out[(event.request_id, event.sample)] = (tokens, event.finish_reason)
            assert event.token is None or 0 <= event.token < engine.runner.vocab_size
    return out


def check_mix(make_engine, specs) -> None:
    requests = [Request(i, prompt, params, constraint=grammar)
                for i, (_, prompt, params, grammar) in enumerate(specs)]
    engine = make_engine()
    together = outcomes(engine, requests)
    engine.manager.check()
    assert engine.manager.leases() == () and not engine.has_work
    for request, (kind, *_) in zip(requests, specs):
        alone = outcomes(make_engine(), [request])
        mine = {key: value for key, value in together.items() if key[0] == request.request_id}
        assert mine == alone, (kind, request)
        if kind in ("nan", "posinf", "neginf", "bomb"):
            assert all(reason == FINISH_ERROR for _, reason in mine.values()), (kind, mine)
        assert len(mine) == request.num_samples


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(request_specs(V, 3, 900), min_size=1, max_size=6), st.integers(24, 80))
def test_faulty_requests_never_touch_their_neighbours_on_the_stub(specs, blocks):
    def make_engine():
        engine = stub_engine(blocks, BS, vocab_size=V, max_step_tokens=24)
        engine.runner.__class__ = FaultyStubRunner
        return engine

    check_mix(make_engine, specs)


@lru_cache(maxsize=1)
def faulty_llama():
    """A tiny random float32 Llama (seed 0, vocabulary ``V``) with the same token-keyed faults."""
    import transformers as tf

    class FaultyLlama(tf.LlamaForCausalLM):
        armed = False  # off while ``wrap`` runs its self-tests (random ids may hold the fault tokens)

        def forward(self, input_ids=None, logits_to_keep=0, **kwargs):
            if not self.armed:
                return super().forward(input_ids=input_ids, logits_to_keep=logits_to_keep, **kwargs)
            if (input_ids == BOMB).any():
                raise RuntimeError("the model fell over on token 993")
            out = super().forward(input_ids=input_ids, logits_to_keep=logits_to_keep, **kwargs)
            rows = input_ids[0][logits_to_keep] if torch.is_tensor(logits_to_keep) else input_ids[0][-1:]
            for r, token in enumerate(rows.tolist()):
                poison(out.logits[0], r, token)
            return out

    config = tf.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    return FaultyLlama(config).eval()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(request_specs(V, 3, 900), min_size=2, max_size=5))
def test_faulty_requests_never_touch_their_neighbours_on_a_real_model(specs):
    lm = faulty_lm()

    def make_engine():
        lm.clear()  # each run starts from an empty cache: a block a faulty run left can not hide
        return lm.new_engine()

    check_mix(make_engine, specs)


@lru_cache(maxsize=1)
def faulty_lm():
    import radixcache

    model = faulty_llama()
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=400)
    assert not lm.engine_unsupported
    model.armed = True
    return lm


def test_a_tiny_temperature_is_greedy_and_never_an_impossible_token():
    """The reported crash: ``temperature=1e-40`` made every logit +inf, the softmax NaN and the
    draw id 49152, one past the vocabulary. Now every temperature under ``MIN_TEMPERATURE`` is the
    argmax, with or without top-p / top-k / min-p."""
    logits = torch.randn(6, 49152, generator=torch.Generator().manual_seed(0)) * 30
    for knobs in ({}, {"top_p": 0.9}, {"top_k": 40}, {"min_p": 0.1}):
        params = SamplingParams(do_sample=True, temperature=1e-40, **knobs)
        assert params.greedy
        rows = [Row(params, sample_generator(1, i)) for i in range(6)]
        assert choose(logits, rows) == logits.argmax(dim=-1).tolist()
    assert not SamplingParams(do_sample=True, temperature=MIN_TEMPERATURE).greedy


@pytest.mark.parametrize("knobs", [dict(top_p=1e-300), dict(min_p=1 - 1e-12), dict(top_k=2**40),
                                   dict(repetition_penalty=1e-300), dict(repetition_penalty=1e300),
                                   dict(temperature=MIN_TEMPERATURE)])
def test_every_extreme_knob_gives_a_token_of_the_vocabulary(knobs):
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)) * 1e3
    logits[:, 0] = 0.0  # a zero logit a penalty cannot move
    params = SamplingParams(do_sample=True, **knobs)
    rows = [Row(params, sample_generator(2, i), {0, 1, 2}) for i in range(4)]
    got = choose_step(logits.clone(), rows, masks=None)
    assert got.errors == [None] * 4 and all(0 <= t < 300 for t in got.tokens)


def test_a_faulty_row_is_an_error_of_its_own_and_leaves_the_others_alone():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    logits[1] = float("nan")
    logits[2, 3] = float("inf")
    logits[3] = float("-inf")
    params = SamplingParams(do_sample=True, temperature=0.7, top_p=0.9, seed=1)
    rows = [Row(params, sample_generator(5, i)) for i in range(5)]
    got = choose_step(logits, rows, masks=None)
    assert isinstance(got, StepChoice)
    assert got.errors[0] is None and got.errors[4] is None
    assert "NaN" in got.errors[1] and "NaN or +inf" in got.errors[2] and "no token is allowed" in got.errors[3]
    alone = [choose(before[i:i + 1], [Row(params, sample_generator(5, i))])[0] for i in (0, 4)]
    assert [got.tokens[0], got.tokens[4]] == alone


def test_a_padded_output_layer_never_yields_an_id_outside_the_vocabulary():
    logits = torch.zeros(2, 64)
    logits[:, 60] = 100.0  # a padding column the embedding has no row for
    rows = [Row(SamplingParams(), None), Row(SamplingParams(do_sample=True, seed=0), sample_generator(0, 0))]
    got = choose_step(logits, rows, masks=None, vocab_size=50)
    assert got.errors == [None, None] and all(t < 50 for t in got.tokens)
