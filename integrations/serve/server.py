"""``radixcache serve``: load the model's tokenizer and facts, build the app, run uvicorn.

``build_state(options, engine=None)`` loads what the server checks requests against (tokenizer,
chat template, context length, vocabulary, stop ids; no weights) and returns a ``ServerState``;
``main(args)`` runs it under uvicorn until interrupted. The engine is an ``EngineClient`` (see
``engine_client.py``); this version of radixcache has no always-on engine yet, so ``main`` starts
the server without one: ``/v1/models``, ``/metrics`` and every validation answer, ``/health`` and
the generation endpoints answer 503.
"""

from __future__ import annotations

import logging
import sys

from radixcache.integrations.serve.options import ServeOptions

logger = logging.getLogger("radixcache.serve")


def build_state(options: ServeOptions, engine=None):
    """The ``ServerState`` for ``options`` (default model: the embedded SmolLM2), with ``engine``."""
    from radixcache.integrations.serve.state import ServerState, load_model_info
    from radixcache.models import default_model_dir

    model_dir = options.model if options.model is not None else default_model_dir()
    tokenizer, info = load_model_info(model_dir)
    return ServerState(options, tokenizer, info, engine)


def main(args) -> int:
    """Run the server for parsed ``radixcache serve`` arguments; returns the exit status."""
    try:
        import uvicorn

        from radixcache.integrations.serve.app import create_app
    except ModuleNotFoundError as exc:
        print(f"radixcache serve needs {exc.name}: pip install 'radixcache[serve]'", file=sys.stderr)
        return 1
    try:
        options = ServeOptions.from_args(args)
    except ValueError as exc:
        print(f"radixcache serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=options.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        state = build_state(options)
    except (OSError, ValueError) as exc:
        print(f"radixcache serve: {exc}", file=sys.stderr)
        return 1
    if state.engine is None:
        logger.warning("no generation engine in this version: /v1/chat/completions and /v1/completions "
                       "answer 503; /v1/models, /metrics and request validation work")
    logger.info("serving %s as %s on http://%s:%d/v1", state.info.name, ", ".join(state.model_names),
                options.host, options.port)
    uvicorn.run(create_app(state), host=options.host, port=options.port,
                log_level=options.log_level, access_log=False)
    return 0
