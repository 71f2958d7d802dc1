"""Grammar-constrained sampling in the engine (properties over generated schemas) and logprobs.

A tiny random Llama over the embedded tokenizer's vocabulary; grammars from the server's compiler
(``integrations/serve/requests/structured.py``). Random weights write random text, so the schemas are bounded
(every document is short) and the outputs must end with the grammar; a scripted model writes a
chosen valid document to compare constrained and unconstrained greedy output.
"""

import json

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import radixcache
from grammar_cases import EOS, dumps, grammars, object_schema, scripted_model, tool_set
from radixcache.engine import BatchRun, Request, SamplingParams
from radixcache.integrations.serve.requests.structured import (json_constraint, tool_call_constraint,
                                                               tokenizer_info)
from radixcache.integrations.serve.requests.tool_calls import format_tool_call, parse_tool_calls
from serve_helpers import embedded_tokenizer

PROPERTY = settings(max_examples=12, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.reuse, Phase.generate],
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
PROMPT = [1, 9690, 198, 28120, 2]  # any ids: the model is random


@pytest.fixture
def model():
    m = scripted_model()
    m.script = {}
    yield m
    m.script = {}


@pytest.fixture
def lm(model):
    return radixcache.wrap(model, block_size=16, max_cache_tokens=8192)


def run(lm, requests):
    """Every request through one ``BatchRun`` on a new engine: (tokens, reason) per request."""
    out = BatchRun(lm.new_engine(max_running=32), requests).result()
    return [(samples[0], reasons[0]) for samples, reasons in zip(out, out.finish_reasons)]


def params(max_new=300, sample=None, **kw):
    if sample is not None:
        kw.update(do_sample=True, temperature=1.3, seed=sample)
    return SamplingParams(max_new_tokens=max_new, stop_token_ids={EOS}, **kw)


def text_of(tokens):
    assert tokens[-1] == EOS
    return embedded_tokenizer().decode(tokens[:-1])


def accepted_by(grammar, tokens) -> bool:
    """Whether a fresh matcher of ``grammar`` accepts ``tokens`` one by one."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(grammar)
    return all(matcher.accept_token(t) for t in tokens)


# ---------------------------------------------------------------------- every output is valid
@PROPERTY
@given(case=object_schema(), seeds=st.lists(st.integers(0, 2**30), min_size=1, max_size=3))
def test_json_schema_outputs_parse_and_validate(lm, case, seeds):
    """Greedy and sampled outputs of a strict json_schema grammar end with the grammar (EOS) and
    are documents valid for the schema, without free whitespace."""
    schema, _ = case
    grammar = grammars().compile_now(json_constraint(schema, strict=True))
    requests = [Request("greedy", PROMPT, params(), constraint=grammar)]
    requests += [Request(f"s{i}", PROMPT, params(sample=s), constraint=grammar) for i, s in enumerate(seeds)]
    for tokens, reason in run(lm, requests):
        assert reason == "stop"
        text = text_of(tokens)
        document = json.loads(text)
        jsonschema.validate(document, schema)
        assert text == dumps(document)  # no whitespace the separators do not write


@settings(PROPERTY, max_examples=4)
@given(seeds=st.lists(st.integers(0, 2**30), min_size=1, max_size=3))
def test_json_object_outputs_are_objects_or_valid_prefixes(lm, seeds):
    """json_object has no bound: what ends with EOS is one JSON object; what max_new_tokens cuts is
    still a prefix the grammar accepts."""
    grammar = grammars().compile_now(json_constraint())
    requests = [Request("greedy", PROMPT, params(max_new=60), constraint=grammar)]
    requests += [Request(f"s{i}", PROMPT, params(max_new=60, sample=s), constraint=grammar)
                 for i, s in enumerate(seeds)]
    for tokens, reason in run(lm, requests):
        assert accepted_by(grammar, tokens)
        if reason == "stop":
            assert isinstance(json.loads(text_of(tokens)), dict)
        else:
            assert reason == "length" and len(tokens) == 60


@PROPERTY
@given(case=tool_set(), parallel=st.booleans(), forced=st.booleans(), seed=st.integers(0, 2**30))
def test_tool_call_outputs_parse_back_and_match_the_schemas(lm, case, parallel, forced, seed):
    """A tool_calls grammar writes only calls in the template's format: they parse back, name an
    allowed tool, carry arguments valid for its parameter schema, and number one unless parallel
    (then a sample may reach max_new still calling: its complete calls must parse and validate)."""
    tools, _ = case
    name = tools[-1]["function"]["name"] if forced else None
    grammar = grammars().compile_now(tool_call_constraint(tools, name, parallel=parallel))
    allowed = {name} if forced else {t["function"]["name"] for t in tools}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    requests = [Request("greedy", PROMPT, params(max_new=600), constraint=grammar),
                Request("sampled", PROMPT, params(max_new=600, sample=seed), constraint=grammar)]
    for tokens, reason in run(lm, requests):
        # parallel calls have no bound on their number: a sample may still be calling at max_new,
        # and then its complete calls are what a server answers with (the cut one dropped)
        assert reason == "stop" or (parallel and reason == "length"), reason
        cut = reason == "length"
        text = embedded_tokenizer().decode(tokens) if cut else text_of(tokens)
        parsed = parse_tool_calls(text, allowed, complete_only=cut)
        assert parsed.content is None and parsed.tool_calls
        assert parallel or len(parsed.tool_calls) == 1
        for call in parsed.tool_calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])


# ---------------------------------------------------------------------- the mask changes nothing valid
@PROPERTY
@given(case=object_schema(), eos=st.booleans())
def test_greedy_constrained_equals_greedy_when_that_is_valid(lm, model, case, eos):
    """The scripted model writes a valid document: constrained greedy output is exactly the
    unconstrained one (then EOS). Without the scripted EOS the free run goes on with random text
    and the constrained one ends right after the document."""
    schema, instance = case
    ids = embedded_tokenizer()(dumps(instance), add_special_tokens=False)["input_ids"]
    model.script = {len(PROMPT) - 1 + i: t for i, t in enumerate(ids + ([EOS] if eos else []))}
    grammar = grammars().compile_now(json_constraint(schema, strict=True))
    (free, free_reason), (constrained, reason) = run(lm, [
        Request("free", PROMPT, params(max_new=len(ids) + 3)),
        Request("constrained", PROMPT, params(max_new=len(ids) + 3), constraint=grammar)])
    assert constrained == ids + [EOS] and reason == "stop"
    if eos:
        assert free == constrained and free_reason == "stop"
    else:
        assert free[:len(ids)] == ids and free != constrained


@PROPERTY
@given(case=tool_set())
def test_greedy_tool_calls_equal_greedy_when_that_is_valid(lm, model, case):
    """The same for a forced reply: the scripted model writes every tool's call, one per line."""
    tools, calls = case
    text = "\n".join(format_tool_call(name, dumps(arguments)) for name, arguments in calls)
    ids = embedded_tokenizer()(text, add_special_tokens=False)["input_ids"]
    model.script = {len(PROMPT) - 1 + i: t for i, t in enumerate(ids + [EOS])}
    grammar = grammars().compile_now(tool_call_constraint(tools))
    (free, _), (constrained, reason) = run(lm, [
        Request("free", PROMPT, params(max_new=len(ids) + 3)),
        Request("constrained", PROMPT, params(max_new=len(ids) + 3), constraint=grammar)])
    assert constrained == free == ids + [EOS] and reason == "stop"


# ---------------------------------------------------------------------- batches, logprobs, errors
def test_mask_is_per_row_in_a_mixed_batch(lm):
    """Constrained and free requests, greedy and sampled (n=2 too), in one batch: each gets exactly
    the tokens it gets alone."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "b": {"enum": ["x", "yy"]}}, "required": ["a", "b"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    json_grammar = grammars().compile_now(json_constraint(schema, strict=True))
    tool_grammar = grammars().compile_now(tool_call_constraint(tools, parallel=False))
    prompts = [PROMPT, PROMPT[:3], [5, 6, 7, 8] * 5, PROMPT + [44], [77] * 9]
    requests = [Request("json", prompts[0], params(max_new=40), constraint=json_grammar),
                Request("free", prompts[1], params(max_new=50)),
                Request("tools", prompts[2], params(max_new=60, sample=3), constraint=tool_grammar),
                Request("free-sampled", prompts[3], params(max_new=50, sample=4)),
                Request("two", prompts[4], params(max_new=40, sample=5, n=2), constraint=json_grammar)]
    together = BatchRun(lm.new_engine(max_running=32), requests).result()
    for request, samples in zip(requests, together):
        alone = BatchRun(lm.new_engine(), [request]).result()[0]
        assert samples == alone, request.request_id
    assert together[0][0][-1] == EOS and together[4][1][-1] == EOS


def reference_logprobs(model, prompt, generated):
    """log_softmax of plain transformers logits at each generated position."""
    ids = torch.tensor([list(prompt) + list(generated)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("constrained", [False, True])
def test_logprobs_are_raw_model_logprobs_for_every_token(lm, model, constrained):
    """One entry per generated token (EOS included): the chosen token's logprob and the top k of
    the raw logits (before the mask: a constrained token's probability is not renormalised);
    a request that asks for none gets None."""
    grammar = grammars().compile_now(json_constraint({"type": "object", "properties": {
        "k": {"type": "boolean"}}, "required": ["k"]}, strict=True)) if constrained else None
    engine = lm.new_engine()
    engine.add(Request("lp", PROMPT, params(max_new=8, logprobs=3), constraint=grammar))
    engine.add(Request("plain", PROMPT, params(max_new=8)))
    events = []
    while engine.has_work:
        events.extend(engine.step())
    mine = [e for e in events if e.request_id == "lp" and e.token is not None]
    assert all(e.logprobs is None for e in events if e.request_id == "plain")
    tokens = [e.token for e in mine]
    reference = reference_logprobs(model, PROMPT, tokens)
    assert len(mine) == len(tokens) and (not constrained or tokens[-1] == EOS)
    for row, event in zip(reference, mine):
        assert event.logprobs.logprob == pytest.approx(float(row[event.token]), abs=1e-4)
        top = row.topk(3)
        assert [i for i, _ in event.logprobs.top] == top.indices.tolist()
        assert [v for _, v in event.logprobs.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    if constrained:  # the grammar forced tokens the random model finds unlikely
        assert any(event.logprobs.top[0][0] != event.token for event in mine)


def test_special_tokens_are_never_allowed_inside_strings():
    """The hand-built TokenizerInfo: inside a JSON string no special token of SmolLM2's vocabulary
    is allowed (TokenizerInfo.from_huggingface allows <|endoftext|> and <|im_start|> there), and
    a finished document allows only EOS."""
    import xgrammar as xgr

    tokenizer = embedded_tokenizer()
    specials = {i for i, a in tokenizer.added_tokens_decoder.items() if a.special}
    assert len(specials) > 2
    info = tokenizer_info(tokenizer, len(tokenizer), {EOS})
    grammar = xgr.GrammarCompiler(info).compile_json_schema(
        '{"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}', any_whitespace=False)
    matcher = xgr.GrammarMatcher(grammar)
    bitmask = xgr.allocate_token_bitmask(1, len(tokenizer))

    def allowed():
        matcher.fill_next_token_bitmask(bitmask)
        bits = ((bitmask[0][:, None] >> torch.arange(32)) & 1).reshape(-1)[:len(tokenizer)]
        return set(bits.nonzero()[:, 0].tolist())

    for t in tokenizer('{"s": "', add_special_tokens=False)["input_ids"]:
        assert matcher.accept_token(t)
    assert not allowed() & specials
    for t in tokenizer('ab"}', add_special_tokens=False)["input_ids"]:
        assert matcher.accept_token(t)
    assert allowed() == {EOS}


def test_length_bounded_strings_allow_no_control_characters():
    """xgrammar 0.2.9 lets control characters (invalid in JSON) into a string with maxLength; the
    compiler's grammar does not (found by the property test above: a 0x1f token in a string)."""
    import xgrammar as xgr

    tokenizer = embedded_tokenizer()
    vocab = len(tokenizer)
    info = tokenizer_info(tokenizer, vocab, {EOS})
    control = {i for i, text in enumerate(info.decoded_vocab) if i < vocab and any(b < 0x20 for b in text)}
    assert 215 in control  # "ğ", the byte 0x1f
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 4}}, "required": ["s"]}
    matcher = xgr.GrammarMatcher(grammars().compile_now(json_constraint(schema, strict=True)))
    for t in tokenizer('{"s": "a', add_special_tokens=False)["input_ids"]:
        assert matcher.accept_token(t)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask)
    bits = ((bitmask[0][:, None] >> torch.arange(32)) & 1).reshape(-1)[:vocab]
    allowed = set(bits.nonzero()[:, 0].tolist())
    assert tokenizer("b", add_special_tokens=False)["input_ids"][0] in allowed and not allowed & control


def test_json_grammars_allow_no_free_whitespace():
    """Between JSON tokens only the separators' own spaces: no token that is only whitespace."""
    import xgrammar as xgr

    tokenizer = embedded_tokenizer()
    blank = {i for t, i in tokenizer.get_vocab().items() if tokenizer.decode([i]).strip() == "" and i != EOS}
    matcher = xgr.GrammarMatcher(grammars().compile_now(json_constraint()))
    bitmask = xgr.allocate_token_bitmask(1, len(tokenizer))
    for piece in ["{", '"a"', ": ", "1", ", ", '"b"', ": ", "[", "2", "]"]:
        matcher.fill_next_token_bitmask(bitmask)
        bits = ((bitmask[0][:, None] >> torch.arange(32)) & 1).reshape(-1)[:len(tokenizer)]
        assert not set(bits.nonzero()[:, 0].tolist()) & blank, piece
        for t in tokenizer(piece, add_special_tokens=False)["input_ids"]:
            assert matcher.accept_token(t)


def test_bad_constraints_are_refused_before_anything_runs(lm):
    """Not a compiled grammar, one compiled for another vocabulary, a prefill-only request with a
    constraint: each is refused by name; nothing is held."""
    import xgrammar as xgr

    engine = lm.new_engine()
    with pytest.raises(TypeError, match="CompiledGrammar"):
        engine.add(Request("a", PROMPT, params(), constraint='{"type": "object"}'))
    small = xgr.GrammarCompiler(xgr.TokenizerInfo(["a", "b"], vocab_size=2)).compile_builtin_json_grammar()
    with pytest.raises(ValueError, match="vocabulary of 2 tokens"):
        engine.add(Request("b", PROMPT, params(), constraint=small))
    with pytest.raises(ValueError, match="prefill_only"):
        Request("c", PROMPT, params(), prefill_only=True, constraint=small)
    with pytest.raises(ValueError, match="logprobs must be at most 20"):
        SamplingParams(logprobs=21)
    assert not engine.has_work


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_mask_equals_the_cpu_mask_per_row():
    """On CUDA logits the same rows get the same -inf entries as on CPU; other rows are untouched."""
    import xgrammar as xgr

    from radixcache.engine.grammar import GrammarMasks

    tokenizer = embedded_tokenizer()
    vocab = len(tokenizer)
    grammar = grammars().compile_now(json_constraint())
    matchers = [xgr.GrammarMatcher(grammar) for _ in range(2)]
    assert matchers[1].accept_token(tokenizer("{", add_special_tokens=False)["input_ids"][0])
    logits = torch.randn(5, vocab)
    on_cpu, on_cuda = logits.clone(), logits.cuda()
    GrammarMasks(vocab).mask_rows(on_cpu, [1, 3], matchers)
    GrammarMasks(vocab).mask_rows(on_cuda, [1, 3], matchers)
    assert torch.equal(on_cuda.cpu(), on_cpu)
    assert torch.equal(on_cpu[[0, 2, 4]], logits[[0, 2, 4]]) and torch.isinf(on_cpu[[1, 3]]).any()


def test_a_preempted_constrained_sample_resumes_its_grammar(model):
    """A pool too small for both samples preempts one mid-document; it resumes where its matcher
    stands and both end exactly as each does alone, valid."""
    schema = {"type": "object", "properties": {"xs": {"type": "array", "minItems": 12, "maxItems": 12, "items": {
        "type": "integer", "minimum": 100, "maximum": 999}}}, "required": ["xs"]}
    grammar = grammars().compile_now(json_constraint(schema, strict=True))
    small = radixcache.wrap(model, block_size=16, max_cache_tokens=16 * 9)
    requests = [Request(i, [3 + i] * 30, params(max_new=120), constraint=grammar) for i in range(2)]
    together = BatchRun(small.new_engine(), requests).result()
    assert small.manager.ledger.preemptions > 0
    for request, samples in zip(requests, together):  # alone: on a fresh pool of the same size
        alone = radixcache.wrap(model, block_size=16, max_cache_tokens=16 * 9)
        assert samples == BatchRun(alone.new_engine(), [request]).result()[0]
        jsonschema.validate(json.loads(text_of(samples[0])), schema)
