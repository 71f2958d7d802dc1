"""``radixcache demo``: an agent loop run twice, plainly and through ``radixcache.wrap``, side by side.

The agent has a long system prompt (tool definitions, about 1,500 tokens). Every turn the model replies
(greedy, a couple of dozen tokens), a scripted tool result and the next user request are appended, and
the prompt grows at the token level only: ``prompt[t+1] = prompt[t] + reply[t] + new tokens``. That is
exactly the shape a prefix cache is for: after the first turn only the new tokens need a prefill.

The same loop runs once with plain ``model.generate`` and once with ``radixcache.wrap(model)``,
interleaved turn by turn so that both sides see the same machine load. For each turn it measures the
time to first token (a streamer timestamps the first generated token; identical on both sides) and
the whole ``generate`` call, checks the generated tokens are identical, prints a table and writes
``<out>/ttft_per_turn.png``. Returns 0, or 1 when any turn's tokens differ.

Hidden knobs for tests (extra attributes on ``args``): ``system_tokens`` (target size of the system
prompt, default 1500) and ``max_new_tokens`` (default 24).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_SYSTEM_TOKENS = 1500
MAX_NEW_TOKENS = 24
DEFAULT_MODEL_LABEL = "SmolLM2-135M-Instruct"
PLOT_NAME = "ttft_per_turn.png"
_MARK = "\x1eREPLY\x1e"  # placeholder content used to find the text that closes an assistant message

PREAMBLE = """You are Atlas, an autonomous assistant that completes tasks for the user by calling tools.
Rules:
1. Think about which tool answers the request, then call exactly one tool per message.
2. A tool call is one line of JSON: {"tool": "<name>", "arguments": {...}} and nothing else.
3. Tool results arrive in messages from the role "tool". Read them before you answer.
4. When you have enough information, answer the user in at most three sentences.
5. Never invent file contents, search results, dates or numbers: call a tool instead.
The current date is 2025-03-14 and the user's time zone is Europe/Berlin.
Available tools, one per line, with a JSON schema of their arguments:"""

TOOLS = [
    {"name": "web_search",
     "description": "Search the web and return the top results with title, url and a short snippet.",
     "parameters": {"type": "object", "properties": {
         "query": {"type": "string", "description": "The search query, in plain words."},
         "num_results": {"type": "integer", "minimum": 1, "maximum": 10, "default": 5}},
         "required": ["query"]}},
    {"name": "read_file",
     "description": "Read a text file from the user's workspace and return its contents.",
     "parameters": {"type": "object", "properties": {
         "path": {"type": "string", "description": "Path relative to the workspace root."},
         "start_line": {"type": "integer", "minimum": 1, "default": 1},
         "max_lines": {"type": "integer", "minimum": 1, "maximum": 2000, "default": 200}},
         "required": ["path"]}},
    {"name": "write_file",
     "description": "Create or overwrite a text file in the user's workspace.",
     "parameters": {"type": "object", "properties": {
         "path": {"type": "string", "description": "Path relative to the workspace root."},
         "content": {"type": "string", "description": "The full new contents of the file."},
         "overwrite": {"type": "boolean", "default": False}},
         "required": ["path", "content"]}},
    {"name": "list_directory",
     "description": "List the files and folders in a directory of the workspace.",
     "parameters": {"type": "object", "properties": {
         "path": {"type": "string", "default": "."},
         "recursive": {"type": "boolean", "default": False},
         "pattern": {"type": "string", "description": "Optional glob such as *.py"}},
         "required": []}},
    {"name": "run_python",
     "description": "Run a short Python 3 program in a sandbox and return its stdout, stderr and exit code.",
     "parameters": {"type": "object", "properties": {
         "code": {"type": "string", "description": "The program to run."},
         "timeout_seconds": {"type": "integer", "minimum": 1, "maximum": 60, "default": 10}},
         "required": ["code"]}},
    {"name": "calendar_list_events",
     "description": "List the user's calendar events between two dates.",
     "parameters": {"type": "object", "properties": {
         "start_date": {"type": "string", "format": "date"},
         "end_date": {"type": "string", "format": "date"},
         "calendar": {"type": "string", "enum": ["work", "personal", "all"], "default": "all"}},
         "required": ["start_date", "end_date"]}},
    {"name": "calendar_create_event",
     "description": "Create an event in the user's calendar and invite attendees.",
     "parameters": {"type": "object", "properties": {
         "title": {"type": "string"},
         "start": {"type": "string", "format": "date-time"},
         "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 1440, "default": 30},
         "attendees": {"type": "array", "items": {"type": "string", "format": "email"}},
         "location": {"type": "string"}},
         "required": ["title", "start"]}},
    {"name": "get_weather",
     "description": "Current weather and a forecast for a city.",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string", "description": "City name, optionally with country code."},
         "days": {"type": "integer", "minimum": 0, "maximum": 7, "default": 0},
         "units": {"type": "string", "enum": ["metric", "imperial"], "default": "metric"}},
         "required": ["city"]}},
    {"name": "calculator",
     "description": "Evaluate an arithmetic expression exactly (+ - * / ** % parentheses, sqrt, log).",
     "parameters": {"type": "object", "properties": {
         "expression": {"type": "string", "description": "For example: (1250 * 0.19) + 42"},
         "precision": {"type": "integer", "minimum": 0, "maximum": 20, "default": 6}},
         "required": ["expression"]}},
    {"name": "send_email",
     "description": "Send an email from the user's account. Ask the user before sending.",
     "parameters": {"type": "object", "properties": {
         "to": {"type": "array", "items": {"type": "string", "format": "email"}},
         "subject": {"type": "string"},
         "body": {"type": "string"}},
         "required": ["to", "subject", "body"]}},
    {"name": "convert_units",
     "description": "Convert a quantity between units (length, mass, temperature, currency).",
     "parameters": {"type": "object", "properties": {
         "value": {"type": "number"},
         "from_unit": {"type": "string", "description": "For example km, lb, degC, EUR."},
         "to_unit": {"type": "string"}},
         "required": ["value", "from_unit", "to_unit"]}},
    {"name": "translate",
     "description": "Translate text between languages.",
     "parameters": {"type": "object", "properties": {
         "text": {"type": "string"},
         "target_language": {"type": "string", "description": "ISO 639-1 code such as de or fr."},
         "source_language": {"type": "string", "default": "auto"}},
         "required": ["text", "target_language"]}},
]

# (user request, scripted result of the tool the agent is expected to call for it)
SCRIPT = [
    ("What's the weather in Berlin tomorrow? I need to know whether to bike to work.",
     '{"city": "Berlin", "forecast": [{"date": "2025-03-15", "high_c": 9, "low_c": 2, '
     '"rain_mm": 6.5, "wind_kmh": 31, "summary": "rain showers, windy"}]}'),
    ("Ok. What's on my work calendar tomorrow?",
     '{"events": [{"title": "Team standup", "start": "2025-03-15T09:30", "minutes": 15}, '
     '{"title": "Design review: cache eviction", "start": "2025-03-15T14:00", "minutes": 60}]}'),
    ("Read notes/eviction.md so I can prepare for the design review.",
     '{"path": "notes/eviction.md", "lines": 6, "content": "# Eviction\\n- LRU over leaves only\\n'
     '- pinned nodes never evicted\\n- open question: evict whole leaf or deepest blocks first?\\n'
     '- measure hit rate on the agent trace\\n"}'),
    ("Compute the hit rate if 9,450 of 11,200 prompt tokens were cached.",
     '{"expression": "9450 / 11200", "result": 0.84375}'),
    ("Search for recent benchmarks of prefix caching in LLM serving.",
     '{"results": [{"title": "Fast serving with RadixAttention", "url": "https://example.org/radix", '
     '"snippet": "Up to 5x throughput on agent workloads"}, {"title": "Automatic prefix caching", '
     '"url": "https://example.org/apc", "snippet": "Hash-chained blocks"}]}'),
    ("Check my Python: run print(sum(i*i for i in range(10))).",
     '{"stdout": "285\\n", "stderr": "", "exit_code": 0}'),
    ("Move the design review to 15:00 and invite ana@example.com.",
     '{"status": "created", "event_id": "evt_7731", "start": "2025-03-15T15:00", '
     '"attendees": ["ana@example.com"]}'),
    ("Translate 'see you at the review' into German for Ana.",
     '{"translation": "Wir sehen uns beim Review", "source_language": "en"}'),
]


# ---------------------------------------------------------------------- prompt construction
def build_system_prompt(tokenizer, target_tokens: int = DEFAULT_SYSTEM_TOKENS) -> tuple[str, int]:
    """The preamble plus as many tool specs as fit in about ``target_tokens``; returns (text, tools).

    The preamble is always there, so a small target gives a short prompt with few or no tools.
    """
    text, used = PREAMBLE, 0
    for tool in TOOLS:
        candidate = text + "\n" + json.dumps(tool)
        if _count(tokenizer, candidate) > target_tokens:
            break
        text, used = candidate, used + 1
    return text, used


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def script_step(i: int) -> tuple[str, str]:
    """The i-th (user request, tool result); cycles through SCRIPT for long runs."""
    request, result = SCRIPT[i % len(SCRIPT)]
    if i >= len(SCRIPT):
        request = f"(again, round {i // len(SCRIPT) + 1}) {request}"
    return request, result


class Conversation:
    """Builds prompts at the token level: a new turn only ever appends tokens to the last prompt.

    With a chat template, message boundaries come from the template itself (rendered once on a tiny
    conversation to learn the text that closes an assistant message and opens the next ones); without
    one, it falls back to plain ``User:`` / ``Assistant:`` text.
    """

    def __init__(self, tokenizer, system_prompt: str, eos_ids: set[int]):
        self.tok = tokenizer
        self.system = system_prompt
        self.eos_ids = eos_ids
        self.tool_role = "tool"
        self.chat = bool(getattr(tokenizer, "chat_template", None)) and self._probe()

    def _render(self, messages, generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False,
                                            add_generation_prompt=generation_prompt)

    def _probe(self) -> bool:
        """Check the template renders messages as a pure append (tool role or, failing that, user)."""
        for role in ("tool", "user"):
            self.tool_role = role
            try:
                self._delta_text("result", "next")
                return True
            except Exception:  # noqa: BLE001 - any template that cannot do this gets plain text
                continue
        return False

    def _messages_after_reply(self, tool_result: str, request: str) -> list[dict]:
        if self.tool_role == "tool":
            return [{"role": "tool", "content": tool_result}, {"role": "user", "content": request}]
        return [{"role": "user", "content": f"Tool result:\n{tool_result}\n\n{request}"}]

    def _delta_text(self, tool_result: str, request: str) -> str:
        """Text that closes the assistant's reply and appends the tool result and the next request."""
        head = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": _MARK}]
        base = self._render(head, False)
        full = self._render(head + self._messages_after_reply(tool_result, request), True)
        if _MARK not in base or not full.startswith(base):
            raise ValueError("chat template does not render a conversation as an append")
        return base[base.index(_MARK) + len(_MARK):] + full[len(base):]

    def first_prompt(self, request: str) -> list[int]:
        if self.chat:
            text = self._render([{"role": "system", "content": self.system},
                                 {"role": "user", "content": request}], True)
            return self.tok(text, add_special_tokens=False)["input_ids"]
        text = f"{self.system}\n\nUser: {request}\nAssistant:"
        return self.tok(text, add_special_tokens=True)["input_ids"]

    def next_prompt(self, prompt: list[int], reply: list[int], tool_result: str, request: str) -> list[int]:
        """``prompt + reply (up to and including its first end token) + closing/new message tokens``."""
        end = next((i for i, t in enumerate(reply) if t in self.eos_ids), None)
        reply = reply if end is None else reply[:end + 1]
        if self.chat:
            text = self._delta_text(tool_result, request)
            if end is not None:  # the model already emitted the end-of-message token: don't repeat it
                eos_text = self.tok.decode([reply[-1]])
                if eos_text and text.startswith(eos_text):
                    text = text[len(eos_text):]
        else:
            text = f"\nTool: {tool_result}\nUser: {request}\nAssistant:"
        return prompt + reply + self.tok(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------- measuring one call
class FirstTokenTimer:
    """A transformers streamer that timestamps the first generated token.

    ``generate`` first puts the prompt, then every new token; the second ``put`` is the first token.
    """

    def __init__(self):
        self.puts = 0
        self.first_token_at = None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2 and self.first_token_at is None:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


@dataclass
class Turn:
    prompt_tokens: int
    reply: list
    ttft_s: float
    turn_s: float
    cached_tokens: int = 0


@dataclass
class Session:
    """One side of the comparison: a generate function and its growing conversation."""

    name: str
    generate: object
    prompt: list = field(default_factory=list)
    turns: list = field(default_factory=list)


def timed_generate(generate, prompt: list[int], max_new_tokens: int, pad_id) -> Turn:
    import torch

    ids = torch.tensor([prompt])
    timer = FirstTokenTimer()
    start = time.perf_counter()
    out = generate(ids, attention_mask=torch.ones_like(ids), streamer=timer,
                   max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id)
    done = time.perf_counter()
    first = timer.first_token_at if timer.first_token_at is not None else done
    return Turn(len(prompt), out[0, len(prompt):].tolist(), first - start, done - start)


# ---------------------------------------------------------------------- output
def format_table(plain: list[Turn], cached: list[Turn]) -> str:
    header = ("turn", "prompt tok", "cached tok", "TTFT plain ms", "TTFT cached ms", "speedup",
              "turn plain ms", "turn cached ms", "identical")
    rows = []
    for i, (p, c) in enumerate(zip(plain, cached), 1):
        rows.append((str(i), f"{p.prompt_tokens:,}", f"{c.cached_tokens:,}", f"{p.ttft_s * 1e3:,.0f}",
                     f"{c.ttft_s * 1e3:,.0f}", f"{p.ttft_s / c.ttft_s:.1f}x",
                     f"{p.turn_s * 1e3:,.0f}", f"{c.turn_s * 1e3:,.0f}",
                     "yes" if p.reply == c.reply else "NO"))
    n_same = sum(p.reply == c.reply for p, c in zip(plain, cached))
    tp, tc = sum(p.ttft_s for p in plain), sum(c.ttft_s for c in cached)
    prompt_total = sum(c.prompt_tokens for c in cached)
    hit_total = sum(c.cached_tokens for c in cached)
    total = ("total", f"{sum(p.prompt_tokens for p in plain):,}",
             f"{hit_total:,} ({hit_total / max(prompt_total, 1):.0%})",
             f"{tp * 1e3:,.0f}", f"{tc * 1e3:,.0f}", f"{tp / tc:.1f}x",
             f"{sum(p.turn_s for p in plain) * 1e3:,.0f}", f"{sum(c.turn_s for c in cached) * 1e3:,.0f}",
             f"{n_same}/{len(plain)}")
    widths = [max(len(r[k]) for r in [header, *rows, total]) for k in range(len(header))]

    def line(cells):
        return "  ".join(c.rjust(w) for c, w in zip(cells, widths))

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *map(line, rows), rule, line(total)])


def write_plot(path: Path, plain: list[Turn], cached: list[Turn], title: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install 'radixcache[demo]'); no plot written",
              file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = range(1, len(plain) + 1)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(turns, [t.ttft_s * 1e3 for t in plain], "o-", label="plain model.generate")
    ax.plot(turns, [t.ttft_s * 1e3 for t in cached], "s-", label="radixcache.wrap(model)")
    ax.set_yscale("log")
    ax.set_xticks(list(turns))
    ax.set_xlabel("turn of the agent loop")
    ax.set_ylabel("time to first token (ms, log scale)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="agent loop", unit="call", file=sys.stderr, leave=False)


# ---------------------------------------------------------------------- main
def main(args) -> int:
    """Run the demo; ``args`` has ``model`` (None or a local directory), ``turns`` and ``out``."""
    import torch

    import radixcache
    from radixcache.models import load_model

    turns = int(args.turns)
    if turns < 1:
        raise ValueError(f"turns must be >= 1, got {turns}")
    system_tokens = int(getattr(args, "system_tokens", DEFAULT_SYSTEM_TOKENS))
    max_new = int(getattr(args, "max_new_tokens", MAX_NEW_TOKENS))
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(os.cpu_count() or 1)

    label = DEFAULT_MODEL_LABEL if args.model is None else Path(args.model).name
    print(f"radixcache demo: {label}, {turns} turns, {torch.get_num_threads()} torch thread(s)")
    start = time.perf_counter()
    model, tokenizer = load_model(args.model)
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    pad_id = model.generation_config.pad_token_id
    pad_id = pad_id if pad_id is not None else tokenizer.pad_token_id
    pad_id = pad_id if pad_id is not None else next(iter(eos_ids), 0)

    system, n_tools = build_system_prompt(tokenizer, system_tokens)
    convo = Conversation(tokenizer, system, eos_ids)
    how = "the chat template" if convo.chat else "plain text (no chat template)"
    print(f"system prompt: {_count(tokenizer, system):,} tokens ({n_tools} tool definitions); "
          f"prompts built with {how}")

    cached_lm = radixcache.wrap(model)  # 1. wrap
    print(f"loaded in {time.perf_counter() - start:.1f} s; {cached_lm!r}")
    plain = Session("plain", model.generate)
    cached = Session("radixcache", cached_lm.generate)  # 2. generate (same arguments as model.generate)

    # warm-up (not measured): one short call on each side so first-call overheads stay out of turn 1
    warm = tokenizer("Hello there.", add_special_tokens=False)["input_ids"] or [pad_id]
    for side in (plain, cached):
        timed_generate(side.generate, warm, 2, pad_id)
    hits_before = cached_lm.stats()["hit_tokens"]

    bar = _progress(2 * turns)
    for i in range(turns):
        request, _ = script_step(i)
        for side in (plain, cached):  # interleaved: both sides see the same machine load
            if i == 0:
                side.prompt = convo.first_prompt(request)
            else:
                last = side.turns[-1]
                side.prompt = convo.next_prompt(side.prompt, last.reply, script_step(i - 1)[1], request)
            if bar is not None:
                bar.set_postfix_str(f"turn {i + 1}/{turns} {side.name}, {len(side.prompt):,} tokens")
            turn = timed_generate(side.generate, side.prompt, max_new, pad_id)
            if side is cached:
                hits = cached_lm.stats()["hit_tokens"]  # 3. stats
                turn.cached_tokens, hits_before = hits - hits_before, hits
            side.turns.append(turn)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()

    print()
    print("model replies (radixcache side), first 70 characters:")
    previous = None
    for i, turn in enumerate(cached.turns, 1):
        text = tokenizer.decode(turn.reply, skip_special_tokens=True).replace("\n", " ").strip()
        print(f"  turn {i}: " + ("(same reply as the turn before)" if text == previous else repr(text[:70])))
        previous = text
    print()
    print(format_table(plain.turns, cached.turns))
    print(f"TTFT = wall time from the generate() call to its first generated token, timestamped by a "
          f"streamer (same on both sides);\nturn = the whole generate() call ({max_new} new tokens max, "
          f"greedy). Both loops run interleaved turn by turn, after one unmeasured warm-up call each.")
    stats = cached_lm.stats()
    print(f"radixcache stats: hit rate {stats['hit_rate']:.1%} over {stats['requests']} requests "
          f"(incl. warm-up), {stats['cached_tokens']:,} tokens cached, "
          f"{stats['fallbacks']} fallbacks")

    plot = Path(args.out) / PLOT_NAME
    if write_plot(plot, plain.turns, cached.turns, f"TTFT per turn: {label}, agent loop"):
        print(f"plot written to {plot}")
    print(f"done in {time.perf_counter() - start:.1f} s")

    differing = [i for i, (p, c) in enumerate(zip(plain.turns, cached.turns), 1) if p.reply != c.reply]
    if differing:
        print(f"MISMATCH: generated tokens differ on turn(s) {differing}", file=sys.stderr)
        return 1
    return 0
