"""The agent-loop benchmark's workload: sizes, scripted conversations of random token ids.

Workload (token-id level; random but fixed-seed token ids, drawn from the vocabulary minus the
tokenizer's special ids, so no text is tokenized): a 1,500-token system prompt; every turn appends a
fresh 60-token "user text" to the history and generates 16 tokens; the next prompt is the previous
prompt + the generated tokens + the next user text. Three variants:

linear       one conversation of 8 turns.
branching    8 turns; each turn is tried twice from the same history with two different user texts
             (both generated, one after the other); the conversation continues from the first try on
             odd turns and from the second on even turns.
interleaved  8 conversations sharing the system prompt, served round robin turn by turn, 3 turns
             each (fewer than 8 so that (a), which re-prefills ~1,600 tokens on each of its 24 calls,
             fits the run's time budget). radixcache gets a pool (``max_cache_tokens``) of 1.5x the
             tokens the 8 conversations need when they share the system prompt: it can hold all of
             them once, never twice (held unshared they would need several times more).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from benchmarks.measure import random_ids
from radixcache.tokens import common_prefix


@dataclass(frozen=True)
class Config:
    """Sizes of one run. ``budget_factor`` sizes the interleaved radixcache pool and every CB pool."""

    system_tokens: int = 1500
    user_tokens: int = 60
    new_tokens: int = 16
    linear_turns: int = 8
    branching_turns: int = 8
    branches: int = 2
    conversations: int = 8
    interleaved_turns: int = 3
    block_size: int = 16
    budget_factor: float = 1.5
    seed: int = 0


FULL = Config()
QUICK = Config(system_tokens=300, linear_turns=3, branching_turns=3, conversations=2,
               interleaved_turns=3)


# --------------------------------------------------------------------------- workload
@dataclass
class Call:
    """One generate call of a script: its label, conversation and full prompt (token ids)."""

    label: str
    conv: int
    prompt: list


class Workload:
    """Seeded random token ids: the shared system prompt and a fresh user text on each request."""

    def __init__(self, cfg: Config, vocab_size: int, special_ids, seed: int):
        self.cfg = cfg
        self.rng = random.Random(seed)
        self.vocab_size = vocab_size
        self.special = set(special_ids)
        self.system = self.ids(cfg.system_tokens)

    def ids(self, n: int) -> list:
        """``n`` fresh random ids."""
        return random_ids(self.rng, n, self.vocab_size, self.special)

    def user(self) -> list:
        return self.ids(self.cfg.user_tokens)


def linear_script(cfg: Config, w: Workload):
    prompt = w.system + w.user()
    for t in range(1, cfg.linear_turns + 1):
        generated = yield Call(str(t), 0, prompt)
        prompt = prompt + generated + w.user()


def branching_script(cfg: Config, w: Workload):
    history = list(w.system)
    for t in range(1, cfg.branching_turns + 1):
        keep = (t - 1) % cfg.branches
        kept = None
        for k in range(cfg.branches):
            prompt = history + w.user()
            generated = yield Call(f"{t}{'abcdefghij'[k]}", 0, prompt)
            if k == keep:
                kept = prompt + generated
        history = kept


def interleaved_script(cfg: Config, w: Workload):
    histories = [list(w.system) for _ in range(cfg.conversations)]
    for t in range(1, cfg.interleaved_turns + 1):
        for c in range(cfg.conversations):
            prompt = histories[c] + w.user()
            generated = yield Call(f"c{c + 1}t{t}", c, prompt)
            histories[c] = prompt + generated


SCRIPTS = {"linear": linear_script, "branching": branching_script, "interleaved": interleaved_script}


def unique_tokens(sequences) -> int:
    """Tokens of the trie holding every sequence (shared prefixes counted once)."""
    seqs = sorted(tuple(s) for s in sequences)
    total, prev = 0, ()
    for s in seqs:
        total += len(s) - common_prefix(s, prev)
        prev = s
    return total


def describe_variant(name: str, cfg: Config) -> str:
    if name == "linear":
        return (f"1 conversation x {cfg.linear_turns} turns")
    if name == "branching":
        return (f"{cfg.branching_turns} turns x {cfg.branches} tries from the same history "
                "(continues from try a on odd turns, b on even turns)")
    fewer = (f" (fewer turns than linear's {cfg.linear_turns}: (a) re-prefills every prompt in full)"
             if cfg.interleaved_turns < cfg.linear_turns else "")
    return (f"{cfg.conversations} conversations x {cfg.interleaved_turns} turns{fewer}, round robin, "
            "one shared system prompt")
