"""``radixcache serve``: an OpenAI- and Anthropic-compatible server over the always-on engine.

Top down (imports point down only):

- ``server`` (the command: options, model facts, the engine, uvicorn, Ctrl-C) -> ``app`` (FastAPI
  routes, authentication, body bounds, error shapes, the OpenAPI document) and ``state`` (what one
  server holds);
- ``protocols``: one adapter per protocol, ``openai`` (chat completions, completions, Responses)
  and ``anthropic`` (Messages), each turning its request model into a ``requests.job.Job`` and the
  job's deltas into its JSON body and SSE events; ``protocols.schema`` is what their request
  models share;
- ``requests``: one request's way through the server, for any protocol: ``job`` (the one place the
  engine's ``Request`` is built), ``respond`` (slot, stream or body, disconnects), ``generation``
  (engine events -> per-choice deltas), ``detokenize``, ``tool_calls``, ``structured`` (output
  constraints and their grammars), ``chat_template`` and ``prefix_tokens`` (messages -> prompt
  tokens), ``render_thread`` (templates off the event loop, prompts first);
- ``history``: token-exact history (the next turn's prefix, why a hit stops short), the work after
  a reply that computes it, and the index of past history forms;
- ``engine``: the one interface to the engine (``client``) and its implementation over a wrapped
  model in this process (``local``: the scheduler thread, the only owner of the engine);
- ``telemetry``: Prometheus metrics, ``/v1/loads`` for routers, the token log;
- ``access`` (API keys, tenants, cache salts), ``admission`` (model, output budget, input bounds,
  the in-flight gate), ``options``, ``errors``.

Importing this package imports nothing heavy; FastAPI, uvicorn and transformers load with the
modules that need them.
"""
