"""``radixcache serve``: load the model's tokenizer and facts, build the app, run uvicorn.

``build_state(options, engine=None)`` loads what the server checks requests against (tokenizer,
chat template, context length, vocabulary, stop ids; no weights) and returns a ``ServerState``;
``load_engine(options, info)`` loads the weights, wraps them (``radixcache.wrap``) and returns the
``LocalEngine`` (an ``EngineClient``, see ``engine_client.py``) over the wrapper's always-on engine;
``main(args)`` runs both under uvicorn until interrupted: Ctrl-C aborts what runs, ends every
response, closes the engine (and the wrapper, which flushes a store) and exits within a bound; a
second Ctrl-C exits at once (``shutdown.py``).
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


def load_engine(options: ServeOptions, info):
    """The ``LocalEngine`` serving ``options.model`` (default: the embedded SmolLM2) on CUDA when
    there is one, else on the CPU, in ``--dtype`` (auto: ``radixcache.models.default_dtype``,
    bfloat16 on CUDA and on CPUs with native bf16 matrix units, float32 elsewhere);
    ``--max-cache-tokens``, ``--block-size``, ``--max-running``, ``--store`` (a shared Redis tier;
    unreachable: a warning, then the server runs without it) and ``--kv-events`` (a
    ``KVEventPublisher`` bound there with ``--kv-events-topic``, closed with the engine; an
    endpoint that cannot be bound raises ``ValueError``) apply. The model is loaded on this thread
    with torch's kernels serial, and the engine's scheduler thread gets the threads torch would have
    used (``radixcache.compute_threads``: a second OpenMP pool would slow every kernel)."""
    import torch

    import radixcache
    from radixcache.compute_threads import serial_here
    from radixcache.integrations.serve.local_engine import LocalEngine
    from radixcache.models import load_model

    threads = serial_here()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, _ = load_model(options.model, dtype=options.dtype, device=device)
    logger.info("model weights in %s on %s", model.dtype, device)
    publisher = None
    if options.kv_events is not None:
        from radixcache.kv_events import KVEventPublisher

        publisher = KVEventPublisher(options.kv_events, topic=options.kv_events_topic,
                                     allow_remote=options.kv_events_allow_remote)
    try:
        lm = radixcache.wrap(model, block_size=options.block_size, max_cache_tokens=options.max_cache_tokens,
                             store=store_url(options), kv_events=publisher)
    except BaseException:
        if publisher is not None:
            publisher.close()
        raise
    if publisher is not None:
        logger.info("KV events on %s (topic %r)", publisher.endpoint, publisher.topic)
    if lm.engine_unsupported:  # the self-tests ruled the engine out: refuse rather than risk a token
        lm.close()
        raise ValueError(f"{options.model or 'the model'} cannot run on radixcache's engine: "
                         f"{lm.engine_unsupported}")
    engine = lm.new_engine(max_running=options.max_running)
    # room for one history precompute per request in flight: those are never what a client waits on
    return LocalEngine(lm, engine, max_requests=2 * options.max_in_flight,
                       max_context_tokens=info.max_context_tokens, close_lm=True, compute_threads=threads)


def store_url(options: ServeOptions) -> str | None:
    """``--store`` with ``--store-secret-file`` carried as its ``secret_file`` query option."""
    if options.store is None or options.store_secret_file is None:
        return options.store
    from urllib.parse import quote

    return options.store + ("&" if "?" in options.store else "?") + "secret_file=" + quote(str(options.store_secret_file))


def main(args) -> int:
    """Run the server for parsed ``radixcache serve`` arguments; returns the exit status."""
    try:
        from radixcache.integrations.serve import shutdown
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
    if getattr(args, "isolate_cache_by_key", False):
        logger.warning("--isolate-cache-by-key is the default now (each API key is its own tenant); "
                       "the flag does nothing and will go")
    try:
        state = build_state(options)
        state.attach_engine(load_engine(options, state.info))
    except (OSError, ValueError) as exc:
        print(f"radixcache serve: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("radixcache serve: interrupted while loading the model", file=sys.stderr)
        return 130
    logger.info("serving %s as %s on http://%s:%d/v1", state.info.name, ", ".join(state.model_names),
                options.host, options.port)
    shutdown.run(create_app(state), state, options)
    return 0
