"""``radixcache serve``: an OpenAI-compatible server over the always-on engine.

Modules, top down: ``server`` (the command: options, model facts, uvicorn) -> ``app`` (FastAPI
routes, auth, JSON and SSE) -> ``generation`` (one request through the engine) -> ``engine_client``
(the one interface to the engine). Beside them, each a single concern: ``protocol`` (request models),
``responses`` (response bodies and chunks), ``chat_template`` (messages to prompt tokens, tools),
``tool_calls`` (tool calls in text), ``detokenize`` (text as tokens arrive, stop strings),
``history`` (token-exact history: the next turn's prefix and why it departs from the cache),
``metrics`` (Prometheus), ``limits`` (keys, tenant salts, admission, prompt checks), ``options``,
``state``, ``errors``.

Importing this package imports nothing heavy; FastAPI, uvicorn and transformers load with the
modules that need them.
"""
