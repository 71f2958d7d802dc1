"""Request traces for ``trace_replay.py``: a Mooncake-format JSONL file, or a synthetic agent trace.

A trace is a set of flat numpy arrays, one entry per request, sorted by arrival; it holds no Python
object per request, so a garbage-collector pass during the replay measures the tree, not the trace.
Prompts are described by pages of ``PAGE_TOKENS`` tokens: ``pages[page_start[i]:page_start[i+1]]``
are the page ids of request ``i``, covering its first ``insert_len[i]`` tokens. Page ``p`` holds
the 512 distinct token ids ``p * 512 .. p * 512 + 511``, so two requests share exactly the tokens of
the pages they share, and a page seen with different prefixes gets a different id (ids are chained).

Mooncake traces (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``) carry no
sessions: each request inserts its prompt. The synthetic agent trace has sessions: each turn's
prompt is the session's whole history (a shared preamble, then every earlier turn's output and tool
result), and a turn inserts its prompt and its output, as an engine that caches generated tokens
does. Its parameters are fixed in ``AGENT_PARAMS`` and printed with every table.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

PAGE_TOKENS = 512
_OFFSETS = np.arange(PAGE_TOKENS, dtype=np.uint32)

# The synthetic agent trace, calibrated on published statistics of a coding agent: pauses between
# turns (tool runs) with a median of 5.2 s and a P99 of 81 s, about +2.2k tokens per turn, a 131:1
# input:output token ratio, and a reusable share of prompt tokens of about 94%.
AGENT_PARAMS = {
    "sessions": 400,                 # agent sessions in the trace
    "session_rate_per_s": 0.1,       # sessions start as a Poisson process at this rate
    "preamble_tokens": 4096,         # system prompt + tool definitions, shared by every session
    "turns_min": 4,                  # turns per session: uniform in [turns_min, turns_max]
    "turns_max": 36,
    "turn_tokens_mean": 2200,        # tokens appended per turn (previous output + tool result)
    "turn_tokens_sigma": 1.0,        # lognormal shape of the tool-result size
    "pause_median_s": 5.2,           # lognormal pause between a turn's end and the next turn
    "pause_p99_s": 81.0,
    "input_output_ratio": 131,       # mean prompt tokens per output token
    "seed": 0,
}
QUICK_AGENT_PARAMS = {**AGENT_PARAMS, "sessions": 12, "session_rate_per_s": 0.5, "turns_min": 3,
                      "turns_max": 8}
_Z99 = 2.3263478740408408  # standard normal quantile at 0.99


@dataclass(frozen=True)
class Trace:
    """Requests in arrival order (see the module docstring); ``session`` is -1 for none and
    ``continues`` says whether the same session sends another turn after this one."""

    name: str
    arrival_s: np.ndarray
    input_len: np.ndarray
    output_len: np.ndarray
    insert_len: np.ndarray
    session: np.ndarray
    continues: np.ndarray
    page_start: np.ndarray
    pages: np.ndarray
    num_pages: int
    params: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def has_sessions(self) -> bool:
        """Whether any request belongs to a session (retention is only compared when so)."""
        return bool((self.session >= 0).any())

    def tokens(self, i: int, length: int) -> np.ndarray:
        """The first ``length`` tokens of request ``i`` (uint32)."""
        pages = self.pages[self.page_start[i]:self.page_start[i] + -(-length // PAGE_TOKENS)]
        return (pages[:, None] * np.uint32(PAGE_TOKENS) + _OFFSETS).ravel()[:length]

    def page_lengths(self, i: int, length: int) -> np.ndarray:
        """How many of the first ``length`` tokens of request ``i`` fall in each of its pages."""
        n = -(-length // PAGE_TOKENS)
        out = np.full(n, PAGE_TOKENS, dtype=np.int64)
        if n:
            out[-1] = length - PAGE_TOKENS * (n - 1)
        return out

    def head(self, n: int) -> Trace:
        """The first ``n`` requests (for a bounded quick run)."""
        n = min(n, len(self))
        end = self.page_start[n]
        return Trace(self.name, self.arrival_s[:n], self.input_len[:n], self.output_len[:n],
                     self.insert_len[:n], self.session[:n], self.continues[:n],
                     self.page_start[:n + 1], self.pages[:end], self.num_pages,
                     {**self.params, "requests": f"first {n}"})


def load_mooncake(path: str) -> Trace:
    """A Mooncake FAST'25 trace: one JSON object a line with ``timestamp`` (ms), ``input_length``,
    ``output_length`` and ``hash_ids`` (one per 512-token page, chained), replayed in timestamp
    order. Raises ValueError naming the line for a malformed record."""
    chain: dict[tuple[int, int], int] = {}
    records = []  # (arrival s, line, input, output, chain ids)
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ts, n_in, n_out, hashes = (float(rec["timestamp"]), int(rec["input_length"]),
                                           int(rec["output_length"]), rec["hash_ids"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record ({exc})") from None
            if n_in < 1 or n_out < 0 or len(hashes) != -(-n_in // PAGE_TOKENS):
                raise ValueError(f"{path}:{lineno}: {len(hashes)} hash ids for {n_in} input tokens")
            parent, pages = -1, []
            for h in hashes:
                parent = chain.setdefault((parent, int(h)), len(chain))
                pages.append(parent)
            records.append((ts / 1000.0, lineno, n_in, n_out, pages))
    if not records:
        raise ValueError(f"{path}: no requests")
    if len(chain) * PAGE_TOKENS >= 2**32:
        raise ValueError(f"{path}: {len(chain)} distinct pages do not fit 32-bit token ids")
    records.sort(key=lambda r: (r[0], r[1]))
    n_in = np.asarray([r[2] for r in records], dtype=np.int64)
    starts = np.cumsum([0] + [len(r[4]) for r in records])
    return Trace(name=path.rsplit("/", 1)[-1], arrival_s=np.asarray([r[0] for r in records]), input_len=n_in,
                 output_len=np.asarray([r[3] for r in records], dtype=np.int64), insert_len=n_in.copy(),
                 session=np.full(len(n_in), -1, dtype=np.int64), continues=np.zeros(len(n_in), bool),
                 page_start=starts.astype(np.int64),
                 pages=np.asarray([p for r in records for p in r[4]], dtype=np.uint32),
                 num_pages=len(chain), params={"requests": len(n_in), "page tokens": PAGE_TOKENS})


def _lognormal(rng, median: float, sigma: float, size=None):
    return rng.lognormal(math.log(median), sigma, size)


def agent_trace(decode_tokens_per_s: float, params: dict = AGENT_PARAMS) -> Trace:
    """The synthetic agent trace (see ``AGENT_PARAMS``): sessions start as a Poisson process; turn
    k+1 of a session arrives when turn k has decoded its output (at ``decode_tokens_per_s``) and the
    tool has run (the pause); its prompt is turn k's prompt, turn k's output and the tool result."""
    p = params
    rng = np.random.default_rng(p["seed"])
    pre_pages = -(-p["preamble_tokens"] // PAGE_TOKENS)
    if p["preamble_tokens"] % PAGE_TOKENS:
        raise ValueError("preamble_tokens must be a whole number of pages")
    pause_sigma = math.log(p["pause_p99_s"] / p["pause_median_s"]) / _Z99
    # Tool results make up the per-turn growth that the previous output does not.
    turns = rng.integers(p["turns_min"], p["turns_max"] + 1, size=p["sessions"])
    mean_prompt = p["preamble_tokens"] + p["turn_tokens_mean"] * (turns.mean() - 1) / 2
    tool_mean = p["turn_tokens_mean"] - mean_prompt / p["input_output_ratio"]
    tool_median = tool_mean / math.exp(p["turn_tokens_sigma"] ** 2 / 2)
    starts = np.cumsum(rng.exponential(1.0 / p["session_rate_per_s"], size=p["sessions"]))
    rows = []  # (arrival, session, turn, input, output, continues)
    for s in range(p["sessions"]):
        first = int(_lognormal(rng, tool_median, p["turn_tokens_sigma"]))
        t, prompt = starts[s], p["preamble_tokens"] + first
        for k in range(turns[s]):
            out = max(1, int(round(rng.exponential(prompt / p["input_output_ratio"]))))
            rows.append((t, s, k, prompt, out, k + 1 < turns[s]))
            t += out / decode_tokens_per_s + _lognormal(rng, p["pause_median_s"], pause_sigma)
            prompt += out + max(1, int(_lognormal(rng, tool_median, p["turn_tokens_sigma"])))
    rows.sort()
    # Page ids: the preamble's pages are shared; each session's history has its own pages.
    final = {}
    for _, s, _, n_in, n_out, _ in rows:
        final[s] = max(final.get(s, 0), n_in + n_out)
    first_page, next_page = {}, pre_pages
    for s in sorted(final):
        first_page[s] = next_page
        next_page += -(-(final[s] - p["preamble_tokens"]) // PAGE_TOKENS)
    page_start, pages = [0], []
    for _, s, _, n_in, n_out, _ in rows:
        n = -(-(n_in + n_out) // PAGE_TOKENS)
        pages.extend(range(min(n, pre_pages)))
        pages.extend(range(first_page[s], first_page[s] + n - pre_pages))
        page_start.append(len(pages))
    col = list(zip(*rows))
    n_in = np.asarray(col[3], dtype=np.int64)
    n_out = np.asarray(col[4], dtype=np.int64)
    return Trace(name="synthetic agent trace", arrival_s=np.asarray(col[0], dtype=np.float64),
                 input_len=n_in, output_len=n_out, insert_len=n_in + n_out,
                 session=np.asarray(col[1], dtype=np.int64), continues=np.asarray(col[5], dtype=bool),
                 page_start=np.asarray(page_start, dtype=np.int64), pages=np.asarray(pages, dtype=np.uint32),
                 num_pages=next_page, params={**p, "decode_tokens_per_s": decode_tokens_per_s})


def describe(trace: Trace) -> dict:
    """Measured properties of a trace, printed beside its fixed parameters: requests, prompt tokens,
    input:output ratio and, for sessions, growth per turn and the pause distribution."""
    out = {"requests": len(trace), "mean prompt tokens": float(trace.input_len.mean()),
           "max prompt tokens": int(trace.input_len.max()),
           "input:output": float(trace.input_len.sum() / max(1, trace.output_len.sum())),
           "span s": float(trace.arrival_s[-1] - trace.arrival_s[0])}
    if trace.has_sessions:
        order = np.lexsort((trace.arrival_s, trace.session))
        same = trace.session[order][1:] == trace.session[order][:-1]
        growth = (trace.input_len[order][1:] - trace.input_len[order][:-1])[same]
        ends = trace.arrival_s + trace.output_len / trace.params["decode_tokens_per_s"]
        pauses = (trace.arrival_s[order][1:] - ends[order][:-1])[same]
        out.update({"sessions": int(trace.session.max() + 1), "mean growth per turn": float(growth.mean()),
                    "pause median s": float(np.median(pauses)),
                    "pause p99 s": float(np.percentile(pauses, 99))})
    return out
