"""The tables of ``benchmarks/serve.py``: per turn, per phase, and the issue's targets met or missed.

A phase is one server (``radixcache``, ``radixcache[TEMPLATE]`` with a drifting chat template,
``transformers``, ``transformers-cb``, ``llama-server``) at one number of concurrent sessions; its ``calls`` carry
``turn``, ``ttft_s``, ``started``/``done``, ``completion_tokens``, ``cached_tokens`` (None: not
reported), ``ideal_cached`` and ``ok``.
"""

from __future__ import annotations

from report import fmt, median, met, percentile, ratio

TARGET_TTFT_VS_CB = 0.5  # cached-turn TTFT at most this share of transformers serve --continuous-batching
TARGET_TTFT_VS_INPROCESS = 1.05  # ... and at most this multiple of radixcache's in-process generate
TARGET_THROUGHPUT_VS_CB = 2.0  # output tokens/s at the most sessions, at least this multiple
TARGET_CACHED_SHARE = 0.95  # cached tokens of the ideal on every turn after the first
TARGET_TAIL = 1.2  # cached-turn TTFT p99 at most this multiple of its p50, at the most sessions
TARGET_TTFT_VS_LLAMA = 1.0  # one session: cached-turn TTFT below llama-server's, every configuration
TARGET_DECODE_VS_LLAMA = 0.5  # one session: decode at least this share of llama-server's (the floor)
TARGET_TURN_VS_LLAMA = 1.0  # one session: a cached turn no slower than llama-server's (the goal)


def phase_rows(phase) -> list[tuple]:
    """Per turn: prompt tokens, TTFT p50/p95 (ms), output tokens/s, cached vs ideal."""
    rows = []
    for turn in sorted({c.turn for c in phase.calls}):
        calls = [c for c in phase.calls if c.turn == turn and c.ok]
        if not calls:
            continue
        span = max(c.done for c in calls) - min(c.started for c in calls)
        tokens = sum(c.completion_tokens for c in calls)
        ttft = [c.ttft_s * 1e3 if c.ttft_s is not None else None for c in calls]
        cached = [c.cached_tokens for c in calls]
        ideal = median([c.ideal_cached for c in calls])
        hit = median(cached) if all(v is not None for v in cached) else None
        share = None if hit is None or not ideal else hit / ideal
        rows.append((phase.server, str(phase.sessions), str(turn), fmt(median([c.prompt_tokens for c in calls]), ",.0f"),
                     fmt(median(ttft), ",.0f"), fmt(percentile(ttft, 95), ",.0f"), fmt(tokens / span if span else None, ".1f"),
                     fmt(hit, ",.0f"), fmt(ideal, ",.0f"), fmt(share, ".0%")))
    return rows


def cached_turn_ttfts_ms(phase) -> list:
    """TTFTs (ms) of the calls after the first turn."""
    if phase is None:
        return []
    return [c.ttft_s * 1e3 for c in phase.calls if c.ok and c.turn > 1 and c.ttft_s is not None]


def cached_turn_ttft_ms(phase):
    """Median TTFT (ms) over the turns after the first, or None."""
    return median(cached_turn_ttfts_ms(phase))


def tail_ratio(phase):
    """p99 / p50 of the cached-turn TTFTs, or None."""
    ttfts = cached_turn_ttfts_ms(phase)
    return ratio(percentile(ttfts, 99), percentile(ttfts, 50))


def throughput(phase):
    """Output tokens per second over the phase's wall time, or None."""
    if phase is None or not phase.wall_s:
        return None
    return sum(c.completion_tokens for c in phase.calls if c.ok) / phase.wall_s


def worst_cached_share(phase):
    """The lowest cached/ideal of any call after the first turn (None: nothing reported)."""
    shares = [c.cached_tokens / c.ideal_cached for c in phase.calls
              if c.ok and c.turn > 1 and c.ideal_cached and c.cached_tokens is not None]
    return min(shares) if shares else None


SUMMARY_HEADER = ("server", "sessions", "calls", "TTFT turn 1 ms", "TTFT turns 2+ ms", "p99 ms",
                  "decode tok/s per session", "turn 2+ s", "out tok/s", "wall s", "note")


def decode_rate(call):
    """A call's own decode rate: its tokens after the first over the time from the first to the end."""
    if not call.ok or call.ttft_s is None or call.completion_tokens < 2:
        return None
    span = call.done - call.started - call.ttft_s
    return (call.completion_tokens - 1) / span if span > 0 else None


def turn_seconds(call):
    """A cached turn's whole latency (sent to the last token), or None for turn 1 or a failed call."""
    return call.done - call.started if call.ok and call.turn > 1 and call.done is not None else None


def median_of(phase, measure):
    """The median of ``measure(call)`` over ``phase``'s calls (None values left out), or None."""
    if phase is None:
        return None
    return median([v for c in phase.calls if (v := measure(c)) is not None])


def summary_rows(phases) -> list[tuple]:
    """Per phase: turn-1 TTFT p50, cached-turn TTFT p50 and p99, the median call's decode rate, a
    cached turn's whole latency p50 (sent to the last token), total output tokens/s, wall time."""
    rows = []
    for p in phases:
        first = [c.ttft_s * 1e3 for c in p.calls if c.ok and c.turn == 1 and c.ttft_s is not None]
        rows.append((p.server, str(p.sessions), str(sum(c.ok for c in p.calls)), fmt(median(first), ",.0f"),
                     fmt(cached_turn_ttft_ms(p), ",.0f"), fmt(percentile(cached_turn_ttfts_ms(p), 99), ",.0f"),
                     fmt(median_of(p, decode_rate), ".1f"), fmt(median_of(p, turn_seconds), ".2f"),
                     fmt(throughput(p), ".1f"),
                     f"{p.wall_s:.1f}", p.note or "-"))
    return rows


def target_rows(phases, inprocess_ms) -> list[tuple]:
    """(target, measured, goal, met) for each of the issue's targets that this run measured."""
    def find(server, sessions):
        return next((p for p in phases if p.server == server and p.sessions == sessions), None)

    counts = sorted({p.sessions for p in phases})
    one, most = (counts[0], counts[-1]) if counts else (None, None)
    radix = cached_turn_ttft_ms(find("radixcache", one))
    versus_cb = ratio(radix, cached_turn_ttft_ms(find("transformers-cb", one)))
    versus_local = ratio(radix, inprocess_ms)
    speedup = ratio(throughput(find("radixcache", most)), throughput(find("transformers-cb", most)))
    rows = [(f"cached-turn TTFT vs transformers-cb ({one} session)", fmt(versus_cb, ".2f") + "x",
             f"<= {TARGET_TTFT_VS_CB}x", met(versus_cb, TARGET_TTFT_VS_CB)),
            (f"cached-turn TTFT vs in-process generate ({one} session)", fmt(versus_local, ".2f") + "x",
             f"<= {TARGET_TTFT_VS_INPROCESS}x", met(versus_local, TARGET_TTFT_VS_INPROCESS)),
            (f"output tok/s vs transformers-cb ({most} sessions)", fmt(speedup, ".2f") + "x",
             f">= {TARGET_THROUGHPUT_VS_CB}x", met(speedup, TARGET_THROUGHPUT_VS_CB, below=False))]
    tail = tail_ratio(find("radixcache", most))
    rows.append((f"cached-turn TTFT p99 / p50 ({most} sessions)", fmt(tail, ".2f") + "x", f"<= {TARGET_TAIL}x",
                 met(tail, TARGET_TAIL)))
    llama = find("llama-server", one)
    if llama is not None:  # the CPU anchor, one agent session: each radixcache configuration against it
        for config in sorted({p.server for p in phases if p.server.startswith("radixcache") and "[" not in p.server}):
            mine = find(config, one)
            versus = ratio(cached_turn_ttft_ms(mine), cached_turn_ttft_ms(llama))
            rows.append((f"cached-turn TTFT vs llama-server: {config} ({one} session)", fmt(versus, ".2f") + "x",
                         f"< {TARGET_TTFT_VS_LLAMA}x", met(versus, TARGET_TTFT_VS_LLAMA)))
            versus = ratio(median_of(mine, decode_rate), median_of(llama, decode_rate))
            rows.append((f"decode vs llama-server: {config} ({one} session)", fmt(versus, ".2f") + "x",
                         f">= {TARGET_DECODE_VS_LLAMA}x", met(versus, TARGET_DECODE_VS_LLAMA, below=False)))
            versus = ratio(median_of(mine, turn_seconds), median_of(llama, turn_seconds))
            rows.append((f"cached turn, sent to last token, vs llama-server: {config} ({one} session)",
                         fmt(versus, ".2f") + "x", f"<= {TARGET_TURN_VS_LLAMA}x (goal)",
                         met(versus, TARGET_TURN_VS_LLAMA)))
        rows.append((f"output tok/s vs llama-server ({most} sessions)",
                     fmt(ratio(throughput(find("radixcache", most)), throughput(find("llama-server", most))), ".2f")
                     + "x", "-", "-"))
    for phase in phases:
        if phase.server.startswith("radixcache"):
            share = worst_cached_share(phase)
            rows.append((f"cached/ideal every turn > 1: {phase.server} ({phase.sessions} sessions)",
                         fmt(share, ".1%"), f">= {TARGET_CACHED_SHARE:.0%}",
                         met(share, TARGET_CACHED_SHARE, below=False)))
    return rows


def greedy_line(phases, inprocess, dtype: str) -> str:
    """Greedy equality at ``dtype``: in-process ``lm.generate`` against plain ``model.generate``, and the
    server's 1-session replies against ``lm.generate`` (turns compared while the conversations agree)."""
    plain = f"{sum(inprocess.plain_equal)}/{len(inprocess.plain_equal)}"
    phase = next((p for p in phases if p.server == "radixcache" and p.sessions == 1), None)
    served = "-"
    if phase is not None:
        calls = sorted((c for c in phase.calls if c.ok), key=lambda c: c.turn)
        same = 0
        for call, reply in zip(calls, inprocess.replies):
            if call.reply != reply:
                break
            same += 1
        served = f"{same}/{min(len(calls), len(inprocess.replies))}"
    return (f"greedy at {dtype}: in-process lm.generate = plain model.generate on {plain} turns; "
            f"the server's replies (1 session) = in-process lm.generate on {served} turns")
