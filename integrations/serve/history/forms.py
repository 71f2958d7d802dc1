"""Token-exact history: what the next turn's prompt will start with, and why it differs from the cache.

The prompt the model sees is always exactly what the chat template and tokenizer make of the
request. What the template writes for the *past* turns can still differ from the tokens the model
actually computed: the decoded reply is tokenized again (BPE may split it differently), a template
may put an empty ``<think></think>`` into the generation prompt but write past assistant turns
without it, strip reasoning from past turns, or write tool-call JSON anew. Each such difference
turns the rest of the next prompt into a cache miss. So when a response finishes the server calls
``history_after_reply``: it renders the conversation in its *history form* (the request's messages
plus the reply as the client will echo it, followed by the start of a next message) and returns the
token ids every continuation of that conversation starts with, how many of them the model already
computed, and where and why the two part (``Divergence``). The server then computes the rest into
the cache at low priority while the client runs its tool.

``classify_hit`` is the check on the next request: did its cache hit reach as far as the previous
turn's history form, and if not, why. ``history.index.HistoryIndex`` remembers recent history forms
to find the previous turn of a request.

Cost: the history form takes one template render and one tokenization of the conversation (the
next message's content is a marker the rendered text is cut at; only the text after the last special
token, a few tokens, is tokenized again with each probe content), plus, only when the form departs
from the prompt's own tokens, one more render to say why: at most two passes.
"""

from __future__ import annotations

from typing import NamedTuple

from radixcache.integrations.serve.requests.chat_template import ChatRenderer, RenderError
from radixcache.tokens import common_prefix

# Reasons a history form departs from the tokens the model computed (metric labels, log words).
GENERATION_PROMPT = "generation_prompt"  # the generation prompt differs from a past turn's opening
PAST_TURNS = "past_turns"  # earlier turns are written differently once the reply follows them
REASONING = "reasoning"  # the reply's <think>...</think> is dropped from its history form
TOOL_CALLS = "tool_calls"  # the reply's tool calls are written differently from the model's text
RETOKENIZATION = "retokenization"  # the same text tokenizes differently
REPLY = "reply"  # the reply's text is otherwise written differently
# Reasons a cache hit stops short of the previous turn's history form.
HISTORY_MISMATCH = "history_mismatch"  # the request does not continue the previous history form
EVICTED = "evicted"  # it does, but fewer of those tokens were still cached
NOT_PRECOMPUTED = "not_precomputed"  # it does, but the history form past the computed tokens was never
# computed (the precompute is off, was refused, or had not finished when the hit was taken)

# Next-message contents that differ at their first character, and start with the kinds of characters
# a tokenizer may merge with what comes before them (a letter, a digit, space, newline, punctuation).
_PROBES = ("A", "z", "7", " x", "\nx", "<x", "{")
# The next message's content while rendering: the text is cut where it appears (no whitespace, so
# that a template's trim keeps it; nothing a template would escape).
_MARKER = "RADIXCACHE_NEXT_MESSAGE_CONTENT_7f3a"


class Divergence(NamedTuple):
    """Where the history form leaves the computed tokens: first differing index and why."""

    token_index: int
    reason: str
    detail: str


class History(NamedTuple):
    """The history form after a reply.

    ``token_ids``: what every continuation of the conversation starts with (the prompt of the next
    turn begins with exactly these, when the client appends messages). ``computed``: how many of its
    leading tokens equal the tokens the model saw and produced (prompt + reply) and have K/V (the
    reply's last token is never fed back, so it has none). ``divergence``: None when the history
    form continues those tokens, else where and why it does not.
    """

    token_ids: tuple
    computed: int
    divergence: Divergence | None

    def blocks_to_compute(self, block_size: int) -> int:
        """Whole blocks of ``token_ids`` beyond what the model computed (what a precompute adds)."""
        return max(0, len(self.token_ids) // block_size - self.computed // block_size)


def _next_message(role: str, content: str) -> dict:
    message = {"role": role, "content": content}
    if role == "tool":
        message["tool_call_id"] = "call_next"
    return message


def history_tokens(renderer: ChatRenderer, conversation: list[dict], tools=None) -> tuple:
    """Token ids every continuation of ``conversation`` (which ends with the reply) starts with.

    The conversation is rendered once with a next message (a tool result after a reply with tool
    calls, else a user message) whose content is a marker; the text before the marker is what every
    next message follows. Its tokens, up to where a next content could merge with them, are the
    history form: the text after its last special token is tokenized with several contents that
    differ at their first character, and their common token prefix is kept (the text before a
    special token tokenizes the same whatever follows it). If the template refuses the next message,
    or writes the content other than verbatim, the conversation is rendered alone and its last token
    dropped (it may merge with what follows).
    """
    role = "tool" if conversation and conversation[-1].get("tool_calls") else "user"
    try:
        text = renderer.render_text(conversation + [_next_message(role, _MARKER)], tools)
        at = text.find(_MARKER)
        if at < 0 or text.find(_MARKER, at + 1) >= 0:
            raise RenderError("the template does not write the next message's content verbatim")
    except RenderError:
        alone = renderer.render(conversation, tools, add_generation_prompt=False).token_ids
        return alone[:-1]
    before = text[:at]
    cut = max(0, _last_special_start(renderer, before))
    head = tuple(renderer.tokenize(before[:cut])) if cut else ()
    tail, *others = (renderer.tokenize(before[cut:] + probe) for probe in _PROBES)
    return head + tuple(tail[:min(common_prefix(tail, other) for other in others)])


def _last_special_start(renderer: ChatRenderer, text: str) -> int:
    """Where the last special token that cuts the text starts in ``text`` (0: none)."""
    return max((text.rfind(special) for special in renderer.splitting_specials), default=0)


def history_after_reply(renderer: ChatRenderer, messages: list[dict], tools, prompt_ids,
                        generated_ids, reply: dict) -> History:
    """The history form of ``messages`` + ``reply`` and how it relates to what the model computed.

    ``prompt_ids`` is the prompt the model saw (``renderer.render(messages, tools)``),
    ``generated_ids`` what it generated (stop token included), ``reply`` the assistant message as the
    response returns it (and the client will echo it): ``{"role": "assistant", "content": ...,
    "tool_calls": [...]}``. Raises ``RenderError`` only if the template cannot render the reply.
    """
    prompt_ids, generated_ids = tuple(prompt_ids), tuple(generated_ids)
    tokens = history_tokens(renderer, list(messages) + [reply], tools)
    seen = prompt_ids + generated_ids
    shared = common_prefix(tokens, seen)
    computed = min(shared, len(seen) - 1)  # the last generated token was never fed back: no K/V
    if shared >= len(seen) or shared >= len(tokens):
        return History(tokens, computed, None)
    reason, detail = _why(renderer, messages, tools, prompt_ids, generated_ids, tokens, shared, reply)
    return History(tokens, computed, Divergence(shared, reason, detail))


def _why(renderer, messages, tools, prompt_ids, generated_ids, tokens, at, reply) -> tuple[str, str]:
    decode = renderer.tokenizer.decode
    if at < len(prompt_ids):
        opening = common_prefix(renderer.render(messages, tools, add_generation_prompt=False).token_ids,
                                prompt_ids)
        if at >= opening:
            return GENERATION_PROMPT, (f"the generation prompt {decode(prompt_ids[opening:])!r} is written "
                                       f"{decode(tokens[opening:len(prompt_ids)])!r} in a past turn")
        return PAST_TURNS, (f"token {at} of the prompt ({decode(prompt_ids[at:at + 8])!r}) is written "
                            f"{decode(tokens[at:at + 8])!r} once the reply follows")
    produced = decode(generated_ids)
    written = decode(tokens[len(prompt_ids):])
    if written.startswith(produced) or produced.startswith(written):
        return RETOKENIZATION, (f"the reply's text tokenizes differently at token {at}: "
                                f"{decode(tokens[at:at + 4])!r} vs {decode(generated_ids[at - len(prompt_ids):][:4])!r}")
    if reply.get("tool_calls"):
        return TOOL_CALLS, f"the tool calls are written {written[:80]!r}, the model wrote {produced[:80]!r}"
    if "<think>" in produced and "<think>" not in written:
        return REASONING, "the reply's <think>...</think> is dropped from its history form"
    return REPLY, f"the reply is written {written[:80]!r}, the model wrote {produced[:80]!r}"


class ShortHit(NamedTuple):
    """A cache hit that stopped before the previous turn's history form: how far, and why."""

    reason: str
    expected_tokens: int
    cached_tokens: int


def classify_hit(history_ids, prompt_ids, cached_tokens: int, block_size: int,
                 computed: int | None = None) -> ShortHit | None:
    """Whether a request's ``cached_tokens`` reached the previous turn's history form ``history_ids``.

    The engine can reuse at most the whole blocks of ``prompt_ids[:-1]`` (one token is always
    computed for logits), so the expected hit is the whole blocks of the part of the history form
    that the prompt repeats. Returns None when the hit reached that, else ``ShortHit`` with reason
    ``history_mismatch`` (the prompt departs from the history form before its end: the template
    renders the past differently once more follows, or the client sent the reply back changed;
    the server asks only of a request that continues the form's conversation) or
    ``evicted`` (the prompt continues it, but those blocks were no longer all cached) or, when
    only the first ``computed`` tokens of the history form were ever computed (no precompute ran
    for the rest) and the expected hit lies beyond them, ``not_precomputed``.
    """
    shared = common_prefix(history_ids, prompt_ids)
    expected = min(shared, len(prompt_ids) - 1) // block_size * block_size
    if shared < len(history_ids) and shared < len(prompt_ids):
        full = min(len(history_ids), len(prompt_ids) - 1) // block_size * block_size
        if cached_tokens < full:
            return ShortHit(HISTORY_MISMATCH, full, cached_tokens)
    if cached_tokens < expected:
        never = computed is not None and computed // block_size * block_size < expected
        return ShortHit(NOT_PRECOMPUTED if never else EVICTED, expected, cached_tokens)
    return None
