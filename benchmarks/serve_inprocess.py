"""The in-process reference for the server's cached-turn TTFT: ``lm.generate`` on the same prompts.

``inprocess_ttft_ms(model_dir, work, turns, max_tokens)`` plays one session of the serve workload
in this process: per turn it renders the conversation (the benchmark's ``Workload``), times
``lm.generate(prompt, max_new_tokens=1)`` (its TTFT: prefill of what is not cached plus one token),
generates the reply greedily, and computes the reply's history form into the cache, as the server
does while the client runs its tool. Returns the median TTFT in ms over the turns after the first.
"""

from __future__ import annotations

import time

from report import median


def inprocess_ttft_ms(model_dir, work, turns: int, max_tokens: int) -> float | None:
    """See the module docstring; None with fewer than two turns."""
    import torch

    import radixcache
    from radixcache.models import load_model

    model, tokenizer = load_model(model_dir)
    lm = radixcache.wrap(model)
    stops = tokenizer.eos_token_id
    messages = [{"role": "system", "content": work.system}]
    times = []

    def generate(ids, new):
        tensor = torch.tensor([list(ids)])
        out = lm.generate(tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=new,
                          do_sample=False, eos_token_id=stops, pad_token_id=stops)
        return out[0, len(ids):].tolist()

    for turn in range(turns):
        request, result = work.request(0, turn)
        messages.append({"role": "user", "content": request})
        _, ids = work.count(messages)
        started = time.perf_counter()
        generate(ids, 1)
        if turn > 0:
            times.append((time.perf_counter() - started) * 1e3)
        reply = [t for t in generate(ids, max_tokens) if t != stops]
        messages.append({"role": "assistant", "content": tokenizer.decode(reply, skip_special_tokens=True)})
        generate(work.history(messages), 1)  # the history form, as the server precomputes it
        messages.append({"role": "tool", "tool_call_id": f"call_{turn + 1}", "content": result})
    return median(times)
