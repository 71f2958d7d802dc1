"""The in-process reference for the server's cached-turn TTFT: ``lm.generate`` on the same prompts.

``InProcessSession(model_dir, work, max_tokens, dtype)`` plays one session of the serve workload in
this process, with the model in ``dtype`` (the servers' dtype), one ``turn(i)`` at a time, so that
``benchmarks/serve.py`` can interleave it turn by turn with the server's 1-session phase (both then
see the same machine load): per turn it renders the conversation (the benchmark's ``Workload``),
times ``lm.generate(prompt, max_new_tokens=1)`` (its TTFT: prefill of what is not cached plus one
token), generates the reply greedily, checks it against plain ``model.generate`` on the same
prompt, and computes the reply's history form into the cache, as the server does while the client
runs its tool. ``result()`` is an ``InProcess``: the median TTFT in ms over the turns after the
first, the cached tokens of each timed call (so that a miss shows), each turn's reply text, and
whether each equals plain ``model.generate`` token for token.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from report import median

POOL_TOKENS = 65536  # one session needs a few thousand; a default pool would take a quarter of RAM


class InProcess(NamedTuple):
    """Median TTFT (ms) of the turns after the first (None with one turn); per turn: cached tokens,
    the reply's text, whether it equals plain ``model.generate``."""

    ttft_ms: float | None
    cached: list
    replies: list
    plain_equal: list


class InProcessSession:
    """See the module docstring; ``close()`` frees the wrapper."""

    def __init__(self, model_dir, work, max_tokens: int, dtype: str):
        import radixcache
        from radixcache.models import load_model

        self.model, self.tokenizer = load_model(model_dir, dtype=dtype)
        self.lm = radixcache.wrap(self.model, max_cache_tokens=POOL_TOKENS)
        self.work, self.max_tokens = work, max_tokens
        self.stops = self.tokenizer.eos_token_id
        self.messages = [{"role": "system", "content": work.system}]
        self.times, self.cached, self.replies, self.plain_equal = [], [], [], []

    def _generate(self, ids, new: int, plain: bool = False):
        import torch

        tensor = torch.tensor([list(ids)])
        kwargs = dict(attention_mask=torch.ones_like(tensor), max_new_tokens=new, do_sample=False,
                      eos_token_id=self.stops, pad_token_id=self.stops)
        if plain:
            with torch.no_grad():
                return self.model.generate(tensor, **kwargs)[0, len(ids):].tolist(), 0
        out = self.lm.generate(tensor, return_dict_in_generate=True, **kwargs)
        return out.sequences[0, len(ids):].tolist(), out.cached_tokens[0]

    def turn(self, turn: int) -> None:
        """Play turn ``turn`` (0-based; turns go in order)."""
        request, result = self.work.request(0, turn)
        self.messages.append({"role": "user", "content": request})
        _, ids = self.work.count(self.messages)
        started = time.perf_counter()
        _, hit = self._generate(ids, 1)
        elapsed = (time.perf_counter() - started) * 1e3
        self.cached.append(hit)
        if turn > 0:
            self.times.append(elapsed)
        generated = self._generate(ids, self.max_tokens)[0]
        self.plain_equal.append(self._generate(ids, self.max_tokens, plain=True)[0] == generated)
        reply = self.tokenizer.decode([t for t in generated if t != self.stops], skip_special_tokens=True)
        self.replies.append(reply)
        self.messages.append({"role": "assistant", "content": reply})
        self._generate(self.work.history(self.messages), 1)  # the history form, as the server precomputes it
        self.messages.append({"role": "tool", "tool_call_id": f"call_{turn + 1}", "content": result})

    def result(self) -> InProcess:
        return InProcess(median(self.times), self.cached, self.replies, self.plain_equal)

    def close(self) -> None:
        self.lm.close()


def inprocess_ttft_ms(model_dir, work, turns: int, max_tokens: int, dtype: str = "float32") -> InProcess:
    """Every turn of one in-process session, one after the other (when no server phase to interleave
    with runs one session)."""
    session = InProcessSession(model_dir, work, max_tokens, dtype)
    try:
        for turn in range(turns):
            session.turn(turn)
        return session.result()
    finally:
        session.close()
