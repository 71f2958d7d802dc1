"""The in-process reference for the server's cached-turn TTFT: ``lm.generate`` on the same prompts.

``inprocess_ttft_ms(model_dir, work, turns, max_tokens, dtype)`` plays one session of the serve
workload in this process, with the model in ``dtype`` (the servers' dtype): per turn it renders the
conversation (the benchmark's ``Workload``), times ``lm.generate(prompt, max_new_tokens=1)`` (its
TTFT: prefill of what is not cached plus one token), generates the reply greedily, checks it against
plain ``model.generate`` on the same prompt, and computes the reply's history form into the cache,
as the server does while the client runs its tool. Returns ``InProcess``: the median TTFT in ms over
the turns after the first, the cached tokens of each timed call (so that a miss shows), each turn's
reply text, and whether each equals plain ``model.generate`` token for token.
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


def inprocess_ttft_ms(model_dir, work, turns: int, max_tokens: int, dtype: str = "float32") -> InProcess:
    """See the module docstring."""
    import torch

    import radixcache
    from radixcache.models import load_model

    model, tokenizer = load_model(model_dir, dtype=dtype)
    lm = radixcache.wrap(model, max_cache_tokens=POOL_TOKENS)
    stops = tokenizer.eos_token_id
    messages = [{"role": "system", "content": work.system}]
    times, cached, replies, plain_equal = [], [], [], []

    def generate(ids, new):
        tensor = torch.tensor([list(ids)])
        out = lm.generate(tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=new,
                          do_sample=False, eos_token_id=stops, pad_token_id=stops,
                          return_dict_in_generate=True)
        return out.sequences[0, len(ids):].tolist(), out.cached_tokens[0]

    for turn in range(turns):
        request, result = work.request(0, turn)
        messages.append({"role": "user", "content": request})
        _, ids = work.count(messages)
        started = time.perf_counter()
        _, hit = generate(ids, 1)
        cached.append(hit)
        if turn > 0:
            times.append((time.perf_counter() - started) * 1e3)
        generated = generate(ids, max_tokens)[0]
        tensor = torch.tensor([list(ids)])
        with torch.no_grad():
            plain = model.generate(tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=max_tokens,
                                   do_sample=False, eos_token_id=stops, pad_token_id=stops)
        plain_equal.append(plain[0, len(ids):].tolist() == generated)
        reply = tokenizer.decode([t for t in generated if t != stops], skip_special_tokens=True)
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply})
        generate(work.history(messages), 1)  # the history form, as the server precomputes it
        messages.append({"role": "tool", "tool_call_id": f"call_{turn + 1}", "content": result})
    lm.close()
    return InProcess(median(times), cached, replies, plain_equal)
