"""Structured output: what a request's output must satisfy, in the one form every protocol builds,
and the grammar the engine enforces it with.

Each protocol adapter maps its own fields to an ``OutputConstraint`` (or None for free text) and
hands it to ``job.new_job``:

- chat: ``response_format`` json_object / json_schema, ``tool_choice`` "required" or a named function
  (with ``parallel_tool_calls``);
- Responses: ``text.format``, ``tool_choice`` "required" or a named function;
- Anthropic Messages: ``tool_choice`` any / tool (with ``disable_parallel_tool_use``).

``tool_choice`` "auto" and "none" are not constraints (None): the model may answer in text.

``OutputConstraint`` -> a compiled xgrammar grammar, off the event loop and the scheduler thread:

``Grammars(tokenizer, vocab_size, stop_token_ids)`` belongs to one server (one model). Its
``compile(constraint)`` (a coroutine) runs on one worker thread and returns the
``xgrammar.CompiledGrammar`` the engine's ``Request.constraint`` takes; results are cached (LRU) by
(kind, canonical schema JSON, options), and concurrent requests for the same key share one compile.
A schema xgrammar cannot compile raises ``ConstraintError`` (a ValueError) naming it.

Why compile in the server, before submit: a bad schema is then a 400 before any response starts,
the scheduler thread never waits on a compile (tens of ms for a tool set), and the engine stays a
consumer of compiled grammars with no "compiling" state of its own.

The grammars:

- JSON allows no free whitespace: only the separators ``", "`` and ``": "`` (a small model cannot
  loop on blanks). ``json_object`` is any object; ``json_schema`` follows the schema, ``strict``
  closing objects that do not say ``additionalProperties`` (xgrammar's strict mode).
- ``tool_calls``: one or more calls in the template's format (``tool_calls.format_tool_call``),
  joined by a newline (exactly one unless ``parallel``), each naming one of ``tool_names`` with
  arguments valid for that tool's parameter schema, then the stop token: nothing before, between
  or after the calls.

The tokenizer's vocabulary is given to xgrammar by hand (``tokenizer_info``): its special added
tokens (SmolLM2's ``<|im_start|>`` and the like) get an empty text, which xgrammar treats as
special, so no grammar ever allows one; ``TokenizerInfo.from_huggingface`` lets them into strings.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

from radixcache.engine.grammar import XGRAMMAR_INSTALL
from radixcache.integrations.serve.requests.tool_calls import CLOSE, OPEN


class OutputConstraint(NamedTuple):
    """``kind`` is "json_object" (any JSON object), "json_schema" (a document valid for ``schema``;
    ``strict`` as OpenAI's flag), or "tool_calls" (only tool calls in the template's format, each
    naming one of ``tool_names`` with arguments valid for that tool's parameter schema in
    ``tools``; at most one call unless ``parallel``). ``param`` names the request field it came
    from, for the 400 a schema the compiler refuses gets."""

    kind: str
    schema: dict | None = None
    strict: bool = False
    tools: tuple = ()  # OpenAI function-tool dicts, for "tool_calls"
    tool_names: tuple = ()  # the names a call may use: every tool's, or the one that is forced
    parallel: bool = True
    param: str | None = None


def json_constraint(schema: dict | None = None, strict: bool = False,
                    param: str = "response_format") -> OutputConstraint:
    """A JSON object (``schema`` None) or a document valid for ``schema``, asked for by ``param``."""
    if schema is None:
        return OutputConstraint("json_object", param=param)
    return OutputConstraint("json_schema", schema=schema, strict=strict, param=param)


def tool_call_constraint(tools, forced: str | None = None, parallel: bool = True,
                         param: str = "tools") -> OutputConstraint:
    """Only tool calls to ``tools`` (OpenAI function-tool dicts, the request's ``param``): any of
    them, or only ``forced``."""
    tools = tuple(tools)
    names = tuple(t["function"]["name"] for t in tools)
    if forced is not None and forced not in names:
        raise ValueError(f"the forced tool {forced!r} is not among the tools")
    return OutputConstraint("tool_calls", tools=tools, tool_names=(forced,) if forced else names,
                            parallel=parallel, param=param)


SEPARATORS = (", ", ": ")
CACHE_SIZE = 256  # compiled grammars kept (a tool set's grammar is some hundreds of KB)
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class ConstraintError(ValueError):
    """The constraint cannot be compiled into a grammar (an invalid or unsupported schema)."""


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise ConstraintError(f"structured output needs xgrammar: {XGRAMMAR_INSTALL}") from None
    return xgrammar


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids):
    """xgrammar's ``TokenizerInfo`` for ``tokenizer`` with logits ``vocab_size`` wide, built by hand
    (module docstring): ids past the tokenizer's vocabulary and special added tokens are special;
    ``stop_token_ids`` end every grammar."""
    xgr = _xgrammar()
    vocab = [""] * vocab_size
    for text, i in tokenizer.get_vocab().items():
        if i < vocab_size:
            vocab[i] = text
    for i, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if added.special and i < vocab_size:
            vocab[i] = ""
    return xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                             stop_token_ids=sorted(stop_token_ids))


def constraint_key(constraint: OutputConstraint) -> tuple:
    """What identifies a compiled grammar: kind, canonical schema JSON and the options."""
    canon = json.dumps(constraint.schema, sort_keys=True, separators=(",", ":"))
    tools = tuple((t["function"]["name"], json.dumps(_parameters(t), sort_keys=True, separators=(",", ":")))
                  for t in constraint.tools if t["function"]["name"] in constraint.tool_names)
    return (constraint.kind, canon, constraint.strict, tools, constraint.parallel)


def _parameters(tool: dict) -> dict:
    params = tool["function"].get("parameters")
    return params if params is not None else {"type": "object", "properties": {}}


def _message(exc: Exception) -> str:
    return _CPP_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))


def json_ebnf(schema: dict, strict: bool, what: str) -> str:
    """The EBNF of ``schema``'s documents without free whitespace (``ConstraintError`` naming
    ``what`` when xgrammar refuses the schema). xgrammar 0.2.9 writes a string with ``minLength`` /
    ``maxLength`` as characters ``[^"\\\r\n]``, which lets control characters in and makes invalid
    JSON: they are excluded here, as in its unbounded strings."""
    xgr = _xgrammar()
    try:
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=SEPARATORS,
                                               strict_mode=strict)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ConstraintError(f"{what} is invalid or unsupported: {_message(exc)}") from None
    return str(grammar).replace(_BOUNDED_STRING_CHARACTER, _JSON_STRING_CHARACTER)


_BOUNDED_STRING_CHARACTER = r'[^\"\\\r\n]'
_JSON_STRING_CHARACTER = r'[^\0-\x1f\"\\]'


class Grammars:
    """The grammar compiler of one model (see the module docstring). Thread-safe."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = frozenset(stop_token_ids)
        self._compiler = None
        self._lock = threading.Lock()
        self._cache: OrderedDict = OrderedDict()  # key -> Future of a CompiledGrammar
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="radixcache-grammar")

    async def compile(self, constraint: OutputConstraint):
        """The compiled grammar of ``constraint`` (from the cache, or compiled on the worker thread);
        raises ``ConstraintError``."""
        # shielded: a client that goes away must not cancel a compile other requests wait for
        return await asyncio.shield(asyncio.wrap_future(self._future(constraint)))

    def compile_now(self, constraint: OutputConstraint):
        """``compile`` from a plain thread (blocks until compiled)."""
        return self._future(constraint).result()

    def close(self) -> None:
        """Stop the worker thread (compiles in flight finish)."""
        self._worker.shutdown(wait=False, cancel_futures=True)

    def _future(self, constraint: OutputConstraint) -> Future:
        key = constraint_key(constraint)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._worker.submit(self._build, constraint)
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f: (f.cancelled() or f.exception() is not None) and self._forget(key, f))
        return future

    def _forget(self, key, future) -> None:
        with self._lock:
            if self._cache.get(key) is future:
                del self._cache[key]  # a failed compile is not cached: the error names it each time

    def _build(self, constraint: OutputConstraint):
        xgr = _xgrammar()
        if self._compiler is None:
            info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        if constraint.kind == "json_object":
            return self._json({"type": "object"}, True, "the JSON object grammar")
        if constraint.kind == "json_schema":
            if not isinstance(constraint.schema, dict):
                raise ConstraintError("the JSON schema must be an object")
            return self._json(constraint.schema, constraint.strict, "the JSON schema")
        if constraint.kind == "tool_calls":
            return self._tool_calls(constraint)
        raise ConstraintError(f"unknown constraint kind {constraint.kind!r}")

    def _json(self, schema: dict, strict: bool, what: str):
        ebnf = json_ebnf(schema, strict, what)
        try:
            return self._compiler.compile_grammar(ebnf)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ConstraintError(f"{what} could not be compiled: {_message(exc)}") from None

    def _tool_calls(self, constraint: OutputConstraint):
        from xgrammar.structural_tag import GrammarFormat, StructuralTag, TagFormat, TagsWithSeparatorFormat

        tags = []
        for tool in constraint.tools:
            name = tool["function"]["name"]
            if name not in constraint.tool_names:
                continue
            # the arguments' grammar without free whitespace (a JSONSchemaFormat tag allows it)
            arguments = json_ebnf(_parameters(tool), True, f"the parameters schema of tool {name!r}")
            begin = f'{OPEN}{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
            tags.append(TagFormat(begin=begin, content=GrammarFormat(grammar=arguments), end="}" + CLOSE))
        if not tags:
            raise ConstraintError("no tool to call")
        calls = TagsWithSeparatorFormat(tags=tags, separator="\n", at_least_one=True,
                                        stop_after_first=not constraint.parallel)
        try:
            return self._compiler.compile_structural_tag(StructuralTag(format=calls))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ConstraintError(f"the tool-call grammar could not be compiled: {_message(exc)}") from None
