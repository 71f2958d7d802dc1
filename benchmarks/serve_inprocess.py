"""The in-process reference for the server's cached-turn TTFT: ``lm.generate`` on the same prompts.

``inprocess_ttft_ms(model_dir, work, turns, max_tokens)`` plays one session of the serve workload
in this process: per turn it renders the conversation (the benchmark's ``Workload``), times
``lm.generate(prompt, max_new_tokens=1)`` (its TTFT: prefill of what is not cached plus one token),
generates the reply greedily, and computes the reply's history form into the cache, as the server
does while the client runs its tool. Returns ``InProcess``: the median TTFT in ms over the turns
after the first, and the cached tokens of each timed call (so that a miss shows).
"""

from __future__ import annotations

import time
from typing import NamedTuple

from report import median

POOL_TOKENS = 65536  # one session needs a few thousand; a default pool would take a quarter of RAM


class InProcess(NamedTuple):
    """Median TTFT (ms) of the turns after the first (None with one turn); cached tokens per turn."""

    ttft_ms: float | None
    cached: list


def inprocess_ttft_ms(model_dir, work, turns: int, max_tokens: int) -> InProcess:
    """See the module docstring."""
    import torch

    import radixcache
    from radixcache.models import load_model

    model, tokenizer = load_model(model_dir)
    lm = radixcache.wrap(model, max_cache_tokens=POOL_TOKENS)
    stops = tokenizer.eos_token_id
    messages = [{"role": "system", "content": work.system}]
    times, cached = [], []

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
        reply = [t for t in generate(ids, max_tokens)[0] if t != stops]
        messages.append({"role": "assistant", "content": tokenizer.decode(reply, skip_special_tokens=True)})
        generate(work.history(messages), 1)  # the history form, as the server precomputes it
        messages.append({"role": "tool", "tool_call_id": f"call_{turn + 1}", "content": result})
    lm.close()
    return InProcess(median(times), cached)
