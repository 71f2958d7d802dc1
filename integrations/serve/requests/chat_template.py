"""OpenAI chat messages to prompt token ids, through the model's chat template.

``ChatRenderer(tokenizer, chat_template=None)`` uses the tokenizer's own template, or the Jinja text
given (``--chat-template FILE``), and renders it with ``tokenizer.apply_chat_template`` (transformers'
sandboxed Jinja environment), then tokenizes the text without adding special tokens (the template
writes them). The prompt the model sees is exactly that: the cache never changes a token.

Tools go through the template's own tools support when it has one (the template reads ``tools``;
past calls are passed as ``tool_calls`` with their arguments as objects, as HF templates expect).
A template without it (the embedded SmolLM2's has none, and it concatenates ``content``, which an
assistant turn with ``tool_calls`` and ``content: null`` breaks) still works: the schemas are written
into the system message, with an instruction to answer in ``<tool_call>`` blocks, and every past call
is written into its message's content in that same shape (``tool_calls.format_tool_call``). A
template that cannot render a ``tool`` message gets tool results as user messages instead.
Rendering failures raise ``RenderError`` (a ValueError) naming the template's complaint.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

import jinja2
from jinja2 import meta

from radixcache.integrations.serve.requests.prefix_tokens import PrefixTokenizer, cutting_specials
from radixcache.integrations.serve.requests.tool_calls import CLOSE, OPEN, format_tool_call

TOOLS_HEADER = ("# Tools\n\nYou may call one or more functions to assist with the user query. "
                "The functions, one JSON schema per line:\n<tools>\n")
TOOLS_FOOTER = ("\n</tools>\n\nTo call a function, answer with one line per call and nothing else:\n"
                + OPEN + '{"name": <function-name>, "arguments": <arguments-json-object>}' + CLOSE)


class RenderError(ValueError):
    """The chat template refused or failed to render the messages."""


@dataclass(frozen=True)
class RenderedPrompt:
    """A rendered prompt: the template's text and its token ids (what the model will see)."""

    text: str
    token_ids: tuple


def _template_text(tokenizer, chat_template: str | None) -> str:
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default") or (next(iter(template.values())) if len(template) == 1 else None)
    if not isinstance(template, str) or not template.strip():
        raise ValueError("the tokenizer has no chat template; pass one with --chat-template FILE")
    return template


def _reads_variable(template: str, name: str) -> bool:
    try:
        return name in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template is not valid Jinja: {exc}") from None


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content)


class ChatRenderer:
    """Renders OpenAI-shaped message dicts into a ``RenderedPrompt``; see the module docstring.

    ``native_tools``: the template reads ``tools``; ``native_tool_calls``: it reads ``tool_calls``;
    ``tool_role``: it renders a message of role ``tool``; ``splitting_specials``: the texts of the
    special tokens that cut a text in two for the tokenizer (the tokens before one never depend on
    what follows it); ``thinking_switch``: the template reads ``enable_thinking`` (Qwen3's and
    others' reasoning switch). ``template_args``: extra variables every render passes to the
    template (empty; ``with_args`` makes a renderer with others).
    """

    def __init__(self, tokenizer, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.template = _template_text(tokenizer, chat_template)
        self.native_tools = _reads_variable(self.template, "tools")
        self.native_tool_calls = "tool_calls" in self.template
        self.tool_role = self._renders_tool_role()
        self.splitting_specials = _splitting_specials(tokenizer)
        self.thinking_switch = _reads_variable(self.template, "enable_thinking")
        self.template_args: dict = {}
        self.prefix_tokens = PrefixTokenizer(self._encode, cutting_specials(tokenizer, self.splitting_specials))
        self._verify_prefix_tokens()

    def with_args(self, args) -> "ChatRenderer":
        """This renderer with the extra template variables ``args`` (a dict or pairs) on every render
        (itself when they are the ones it has)."""
        args = dict(args)
        if args == self.template_args:
            return self
        view = copy.copy(self)
        view.template_args = args
        return view

    # ------------------------------------------------------------------ public
    def render(self, messages: list[dict], tools: list[dict] | None = None,
               add_generation_prompt: bool = True) -> RenderedPrompt:
        """The prompt for ``messages`` (OpenAI dicts) and ``tools`` (OpenAI tool dicts or None)."""
        text = self.render_text(messages, tools, add_generation_prompt)
        return RenderedPrompt(text, tuple(self.tokenize(text)))

    def render_text(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True) -> str:
        """The template's text for ``messages`` and ``tools``; raises ``RenderError``."""
        converted = self.template_messages(messages, tools)
        native = tools if tools and self.native_tools else None
        try:
            text = self.tokenizer.apply_chat_template(
                converted, tools=native, chat_template=self.template, tokenize=False,
                add_generation_prompt=add_generation_prompt, **self.template_args)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise RenderError(f"the chat template could not render these messages: "
                              f"{type(exc).__name__}: {exc}") from None
        if not isinstance(text, str):
            raise RenderError(f"the chat template rendered {type(text).__name__}, not text")
        return text

    def tokenize(self, text: str) -> list[int]:
        """Token ids of rendered text (no special tokens added: the template wrote them), the same as
        tokenizing it whole; a text that starts with an earlier one is tokenized from where they
        part (``prefix_tokens.PrefixTokenizer``)."""
        return self.prefix_tokens.tokenize(text)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _verify_prefix_tokens(self) -> None:
        """Tokenize a sample chat whole and from each cut; any difference disables the prefixes."""
        sample = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                  {"role": "assistant", "content": " Hello!\n"}, {"role": "user", "content": "2+2?"}]
        try:
            text = ChatRenderer.render_text(self, sample)  # not a subclass hook: not built yet
        except RenderError:
            text = "".join(f"{s} x {s}\n y" for s in self.prefix_tokens.specials)
        self.prefix_tokens.check(text)

    def template_messages(self, messages: list[dict], tools: list[dict] | None = None) -> list[dict]:
        """The message dicts the template sees (see the module docstring for the conversions)."""
        out = [self._convert(m) for m in messages]
        if tools and not self.native_tools:
            block = TOOLS_HEADER + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + TOOLS_FOOTER
            if out and out[0]["role"] == "system":
                out[0] = {**out[0], "content": (out[0]["content"] + "\n\n" if out[0]["content"] else "") + block}
            else:
                out.insert(0, {"role": "system", "content": block})
        return out

    # ------------------------------------------------------------------ conversions
    def _convert(self, message: dict) -> dict:
        role = message["role"]
        out = {"role": "system" if role == "developer" else role, "content": _text(message.get("content"))}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if message.get(key) is not None:
                out[key] = message[key]
        calls = message.get("tool_calls") or []
        if calls and self.native_tool_calls:
            out["tool_calls"] = [_template_call(c) for c in calls]
        elif calls:
            written = "\n".join(format_tool_call(c["function"]["name"], c["function"]["arguments"])
                                for c in calls)
            out["content"] = (out["content"] + "\n" if out["content"] else "") + written
        if role == "tool" and not self.tool_role:
            out = {"role": "user", "content": f"<tool_response>\n{out['content']}\n</tool_response>"}
        return out

    def _renders_tool_role(self) -> bool:
        probe = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
                 {"role": "tool", "content": "\x1eTOOL\x1e", "tool_call_id": "call_0"}]
        try:
            text = self.tokenizer.apply_chat_template(probe, chat_template=self.template, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - any refusal means: this template has no tool role
            return False
        return isinstance(text, str) and "\x1eTOOL\x1e" in text


def _template_call(call: dict) -> dict:
    """An OpenAI tool call as HF templates read it: arguments as an object when they are JSON."""
    function = dict(call["function"])
    try:
        function["arguments"] = json.loads(function["arguments"])
    except (TypeError, ValueError):
        pass
    return {"id": call.get("id"), "type": call.get("type", "function"), "function": function}


def _splitting_specials(tokenizer) -> tuple:
    """Texts of the tokenizer's special added tokens that strip no whitespace and are not
    normalized: the tokenizer splits them out first, so they cut a text in two."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return tuple(t.content for t in added.values()
                 if getattr(t, "special", False) and t.content
                 and not any(getattr(t, flag, False) for flag in ("lstrip", "rstrip", "single_word", "normalized")))
