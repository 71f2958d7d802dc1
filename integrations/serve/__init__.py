"""``radixcache serve``: an OpenAI-compatible server over the always-on engine.

Modules, top down: ``server`` (the command: options, model facts, uvicorn; ``shutdown``: Ctrl-C) ->
``app`` (FastAPI routes, auth, errors) -> a protocol adapter (``openai_completions``: its request
model from ``protocol`` -> a ``job.Conversation`` or a prompt -> ``job.new_job``, the one place the
engine's ``Request`` is built; deltas -> ``responses`` bodies and SSE chunks) -> ``respond`` (runs a
job for any protocol: slot, stream or body, disconnects) -> ``generation`` (engine ``Event``s ->
per-choice deltas: text, stop strings, tool calls) -> ``engine_client`` (the one interface to the
engine, in its own types; ``local_engine`` and ``routing`` implement it). Beside them, each a single
concern: ``chat_template`` (messages to prompt tokens, tools), ``render_thread`` (templates and
tokenizing off the event loop, prompts first), ``tool_calls``, ``detokenize`` (text as tokens
arrive, stop strings), ``history`` (token-exact history: the next turn's prefix and why it departs
from the cache), ``history_work`` (that work after a reply, in the background), ``history_index``
(past history forms by their tokens), ``metrics`` (Prometheus), ``limits`` (keys, tenant salts,
admission, prompt limits), ``options``, ``state``, ``errors``.

Importing this package imports nothing heavy; FastAPI, uvicorn and transformers load with the
modules that need them.
"""
