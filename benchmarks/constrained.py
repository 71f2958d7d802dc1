#!/usr/bin/env python
"""Constrained decoding overhead: an engine decode step of B grammar-constrained sequences against
the same step of B free ones, and the grammar work of a step measured on its own.

Workload: the embedded SmolLM2-135M-Instruct (fp32, CPU unless ``--device``), B = 16 sequences, each
a distinct P-token prompt (seeded random ids), greedy. Constrained rows follow a strict json_schema
grammar (xgrammar, compiled once by the server's compiler ``integrations/serve/requests/structured.py``) whose
documents are long (an object holding a 256-entry array of small objects), so no row ends within
the measured steps; free rows have EOS off. Per repetition, for each side in turn: a fresh engine
on a cleared cache, every prompt prefilled, then S decode steps timed one by one
(``engine.step()``, every row decoding). The two sides alternate within each repetition, so load
on the machine hits both alike.

Grammar work alone (the same B matchers, walking a valid document): per step, the batched mask
fill and apply on ``[B, V]`` logits (``radixcache.engine.grammar.GrammarMasks``) and B accepts.

Target (issue 16): constrained step - free step <= 10% of the free step. Nothing asserts.

    python benchmarks/constrained.py [--quick] [--batch 16] [--steps 12] [--reps 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.measure import random_ids  # noqa: E402
from benchmarks.report import fmt, met, table  # noqa: E402

SCHEMA = {"type": "object", "properties": {"rows": {
    "type": "array", "minItems": 256, "maxItems": 256, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                         "tag": {"enum": ["red", "green", "blue"]},
                                         "ok": {"type": "boolean"}},
        "required": ["id", "tag", "ok"]}}}, "required": ["rows"]}


def document(seed: int) -> str:
    """A valid document of ``SCHEMA`` as the grammar writes it (no free whitespace)."""
    rng = random.Random(seed)
    rows = [{"id": rng.randrange(10000), "tag": rng.choice(["red", "green", "blue"]), "ok": rng.random() < .5}
            for _ in range(256)]
    return json.dumps({"rows": rows}, separators=(", ", ": "))


def timed_steps(lm, prompts, steps: int, constraint) -> list[float]:
    """Seconds of each of ``steps`` decode steps of ``prompts`` (all prefilled first)."""
    from radixcache.engine import Request, SamplingParams

    lm.cache.reset()
    engine = lm.new_engine(max_running=len(prompts))
    for i, prompt in enumerate(prompts):
        engine.add(Request(i, prompt, SamplingParams(max_new_tokens=steps + 4), constraint=constraint))
    engine.step()  # admits and prefills (in chunks of max_step_tokens) until every row decodes
    while any(seq.in_prompt for seq in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        events = engine.step()
        times.append(time.perf_counter() - began)
        assert len(events) == len(prompts) and not any(e.finished for e in events)
    while engine.has_work:
        for i in range(len(prompts)):
            engine.abort(i)
        engine.step()
    return times


def grammar_work(grammar, tokenizer, batch: int, vocab: int, steps: int) -> dict:
    """Per-step seconds of the mask (fill + apply) and the accepts for ``batch`` matchers."""
    from radixcache.engine import grammar as engine_grammar

    paths = [tokenizer(document(i), add_special_tokens=False)["input_ids"] for i in range(batch)]
    matchers = [engine_grammar.new_matcher(grammar) for _ in range(batch)]
    masks = engine_grammar.GrammarMasks(vocab)
    logits = torch.randn(batch, vocab)
    rows = list(range(batch))
    mask_s, accept_s = [], []
    for step in range(steps):
        began = time.perf_counter()
        masks.mask_rows(logits, rows, matchers)
        mask_s.append(time.perf_counter() - began)
        began = time.perf_counter()
        for matcher, path in zip(matchers, paths):
            assert engine_grammar.accept(matcher, path[step])
        accept_s.append(time.perf_counter() - began)
    return {"mask": statistics.median(mask_s), "accept": statistics.median(accept_s)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is stable on shared cores)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.reps = 4, 1
    torch.set_num_threads(args.threads)

    import radixcache
    from radixcache.integrations.serve.requests.structured import json_constraint
    from radixcache.integrations.serve.requests.structured import Grammars
    from radixcache.models import load_model

    model, tokenizer = load_model(device=args.device)
    vocab = model.config.vocab_size
    lm = radixcache.wrap(model, block_size=16,
                         max_cache_tokens=args.batch * (args.prompt_tokens + args.steps + 64) + 256)
    began = time.perf_counter()
    grammar = Grammars(tokenizer, vocab, {tokenizer.eos_token_id}).compile_now(json_constraint(SCHEMA, strict=True))
    compile_s = time.perf_counter() - began
    rng = random.Random(0)
    specials = set(tokenizer.all_special_ids)
    prompts = [random_ids(rng, args.prompt_tokens, vocab, specials) for _ in range(args.batch)]

    free, constrained = [], []
    with torch.inference_mode():
        for _ in range(args.reps):
            free += timed_steps(lm, prompts, args.steps, None)
            constrained += timed_steps(lm, prompts, args.steps, grammar)
    work = grammar_work(grammar, tokenizer, args.batch, vocab, max(args.steps * args.reps, 32))
    free_s, constrained_s = statistics.median(free), statistics.median(constrained)
    overhead = constrained_s - free_s
    work_s = work["mask"] + work["accept"]
    rows = [
        ["free decode step", fmt(free_s * 1e3, ".1f"), "", ""],
        ["constrained decode step", fmt(constrained_s * 1e3, ".1f"), fmt(100 * overhead / free_s, "+.1f"),
         met(overhead / free_s, 0.10)],
        ["grammar work alone (mask + accept)", fmt(work_s * 1e3, ".2f"), fmt(100 * work_s / free_s, ".1f"),
         met(work_s / free_s, 0.10)],
        ["  mask fill + apply", fmt(work["mask"] * 1e3, ".2f"), fmt(100 * work["mask"] / free_s, ".1f"), ""],
        ["  accept", fmt(work["accept"] * 1e3, ".2f"), fmt(100 * work["accept"] / free_s, ".1f"), ""],
    ]
    print(f"constrained decoding at batch {args.batch}, {args.prompt_tokens}-token prompts, {args.device}, "
          f"{args.threads} torch thread(s); medians of {args.reps} x {args.steps} steps; "
          f"grammar compiled in {compile_s * 1e3:.0f} ms")
    print(table(["per step", "ms", "% of a free step", "target <= 10%"], rows))


if __name__ == "__main__":
    main()
