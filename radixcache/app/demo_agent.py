"""The demo's agent: a tool-using system prompt, a scripted conversation, token-level prompts.

``build_system_prompt`` fills about ``target_tokens`` with a preamble and JSON tool specs;
``SCRIPT`` holds (user request, tool result) pairs; ``Conversation`` turns them into prompts that
only ever grow by appending tokens (the shape a prefix cache is for).
"""

from __future__ import annotations

import json

DEFAULT_SYSTEM_TOKENS = 1500
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
        if count_tokens(tokenizer, candidate) > target_tokens:
            break
        text, used = candidate, used + 1
    return text, used


def count_tokens(tokenizer, text: str) -> int:
    """Tokens of ``text`` without special tokens."""
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
