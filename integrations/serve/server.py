"""``radixcache serve``: load the model's tokenizer and facts, build the app, run uvicorn.

``build_state(options, engine=None)`` loads what the server checks requests against (tokenizer,
chat template, context length, vocabulary, stop ids; no weights) and returns a ``ServerState``;
``load_engine(options, info)`` loads the weights, wraps them (``radixcache.wrap``) and returns the
``LocalEngine`` (an ``EngineClient``, see ``engine/client.py``) over the wrapper's always-on engine;
``main(args)`` runs both under uvicorn until interrupted: Ctrl-C aborts what runs, ends every
response, closes the engine (and the wrapper, which flushes a store) and exits within a bound; a
second Ctrl-C exits at once (below).

Ctrl-C for a busy server (``InterruptibleServer``): abort what runs, end every response, flush, exit
within a bound.

uvicorn, on SIGINT / SIGTERM, stops accepting connections and then waits for every open response
to end before it runs the app's lifespan shutdown, so a stream generating 2,000 tokens (or a client
waiting for a long non-streamed answer) would keep the server alive until it finished or the client
gave up. ``InterruptibleServer`` (a ``uvicorn.Server``) acts on the first signal at once:

1. ``ServerState.begin_shutdown()`` on the event loop: every running request is aborted in the
   engine, so each stream ends with an error event saying the server is shutting down and how many
   tokens it had generated (``code`` "server_shutting_down"), then ``[DONE]``, and each waiting
   non-streamed request gets that 503; the engine's scheduler thread stops and the shared store is
   flushed (``lm.close``, bounded by its own timeout);
2. uvicorn's own shutdown then finds the responses ended (it gives a client that does not read
   ``GRACE_S`` seconds), runs the lifespan shutdown (which waits for step 1) and returns; the
   command exits with status 0;
3. whatever hangs, the process is gone ``BOUND_S`` seconds after the signal (status 1).

A second signal exits at once (status 128 + the signal), without waiting for anything.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import sys
import threading
import time

import uvicorn

from radixcache import __version__
from radixcache.integrations.serve.options import ServeOptions


logger = logging.getLogger("radixcache.serve")

GRACE_S = 10  # open responses get this long to end after the abort (uvicorn's graceful timeout)
BOUND_S = 30.0  # the process is gone this long after the first signal, whatever hangs


class InterruptibleServer(uvicorn.Server):
    """uvicorn's server with the shutdown described in the module docstring; ``state`` is the
    app's ``ServerState``."""

    def __init__(self, config: uvicorn.Config, state, bound_s: float = BOUND_S):
        super().__init__(config)
        self.state = state
        self.bound_s = bound_s
        self.signals = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        """The signal handler uvicorn installs (runs in the main thread, between bytecodes)."""
        self.signals += 1
        name = signal.Signals(sig).name
        if self.signals > 1:
            sys.stderr.write(f"radixcache serve: second {name}: exiting now\n")
            sys.stderr.flush()
            os._exit(128 + sig)
        logger.warning("%s: aborting the running requests, then flushing and stopping (again to quit at once)",
                       name)
        self.should_exit = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.state.begin_shutdown)
        threading.Thread(target=self._exit_after_bound, name="radixcache-shutdown-bound", daemon=True).start()

    def _exit_after_bound(self) -> None:
        time.sleep(self.bound_s)
        sys.stderr.write(f"radixcache serve: not stopped {self.bound_s:.0f} s after the signal: exiting\n")
        sys.stderr.flush()
        os._exit(1)


def listen(options: ServeOptions) -> socket.socket:
    """A socket bound to ``--host``:``--port`` and listening, taken before the model loads, so that a
    port in use is refused at once; ``OSError`` naming the address otherwise."""
    family = socket.AF_INET6 if ":" in options.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((options.host, options.port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        why = "is in use (another server?)" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
        raise OSError(f"{options.host}:{options.port} {why}; pick another with --port") from None
    return sock


def run(app, state, options, sock: socket.socket | None = None) -> None:
    """Serve ``app`` (for ``state``) on ``sock`` (default: ``options.host:options.port``) until
    interrupted."""
    config = uvicorn.Config(app, host=options.host, port=options.port, log_level=options.log_level,
                            access_log=False, timeout_graceful_shutdown=GRACE_S)
    InterruptibleServer(config, state).run(sockets=[sock] if sock is not None else None)


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
    used (``radixcache.compute_threads``: a second OpenMP pool would slow every kernel); with
    ``--compile`` the scheduler thread compiles the step before its first (torch guards compiled
    graphs on the thread count they were traced with)."""
    import torch

    import radixcache
    from radixcache.compute_threads import default_threads, serial_here
    from radixcache.integrations.serve.engine.local import LocalEngine
    from radixcache.models import load_model

    serial_here()
    threads = options.threads or default_threads()[0]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, _ = load_model(options.model, dtype=options.dtype, device=device)
    if options.quantize is not None:
        from radixcache.quantize import quantize_weights

        logger.info("quantize: %s", quantize_weights(model, options.quantize).describe())
    publisher = None
    if options.kv_events is not None:
        from radixcache.kv_events import KVEventPublisher

        publisher = KVEventPublisher(options.kv_events, topic=options.kv_events_topic,
                                     allow_remote=options.kv_events_allow_remote)
    try:
        lm = radixcache.wrap(model, block_size=options.block_size, max_cache_tokens=options.max_cache_tokens,
                             store=store_url(options), kv_events=publisher, attention=options.attention)
    except BaseException:
        if publisher is not None:
            publisher.close()
        raise
    if lm.engine_unsupported:  # the self-tests ruled the engine out: refuse rather than risk a token
        lm.close()
        raise ValueError(f"{options.model or 'the model'} cannot run on radixcache's engine: "
                         f"{lm.engine_unsupported}")
    engine = lm.new_engine(max_running=options.max_running)
    # room for one history precompute per request in flight: those are never what a client waits on
    # --compile: on the scheduler thread, whose thread count torch guards the compiled graphs on
    return LocalEngine(lm, engine, max_requests=2 * options.max_in_flight,
                       max_context_tokens=info.max_context_tokens, close_lm=True, compute_threads=threads,
                       prepare=lm.compile_engine if options.compile else None)


def store_url(options: ServeOptions) -> str | None:
    """``--store`` with ``--store-secret-file`` carried as its ``secret_file`` query option."""
    if options.store is None or options.store_secret_file is None:
        return options.store
    from urllib.parse import quote

    return options.store + ("&" if "?" in options.store else "?") + "secret_file=" + quote(str(options.store_secret_file))


def main(args) -> int:
    """Run the server for parsed ``radixcache serve`` arguments; returns the exit status."""
    from radixcache.integrations.serve.app import create_app

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
        sock = listen(options)
    except OSError as exc:
        print(f"radixcache serve: {exc}", file=sys.stderr)
        return 1
    try:
        state = build_state(options)
        state.attach_engine(load_engine(options, state.info))
    except (OSError, ValueError, RuntimeError, ImportError) as exc:
        sock.close()
        print(f"radixcache serve: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        sock.close()
        print("radixcache serve: interrupted while loading the model", file=sys.stderr)
        return 130
    for line in startup_summary(state, options):
        logger.info("%s", line)
    run(create_app(state), state, options, sock)
    return 0


def startup_summary(state, options: ServeOptions) -> list[str]:
    """What the server runs, for the log at start-up: the model, its dtype, device and threads, the
    pool in tokens and bytes, the block size, the routes, the tenants, the store and the events."""
    lines = [f"radixcache {__version__} serving {state.info.name} as {', '.join(state.model_names)} "
             f"on http://{options.host}:{options.port}"]
    engine = state.engine
    lm = getattr(engine, "lm", None)
    if lm is not None:
        stats = lm.stats()
        lines.append(f"model: {type(lm.model).__name__}, {str(lm.model.dtype).removeprefix('torch.')} on {lm.device}, "
                     f"{engine.compute_threads or torch_threads()} thread(s), context {state.info.max_context_tokens:,} "
                     f"tokens")
        if lm.compile_failed is not None:
            lines.append(f"compile: failed ({lm.compile_failed}); the engine runs eagerly")
        elif lm.compile_s is not None:
            lines.append(f"compile: the engine's step compiled in {lm.compile_s:.1f} s")
        lines.append(f"KV pool: {stats['capacity_tokens']:,} tokens in blocks of {lm.manager.block_size} "
                     f"({stats['kv_pool_bytes'] / 2**20:,.0f} MiB, {stats['kv_bytes_per_token']:,} B per token; "
                     f"--max-cache-tokens sets it), {lm.backend.name} attention")
        store = lm.manager.store
        lines.append("store: " + ("none" if store is None else f"{store!r}, "
                                  + ("blocks sealed with a MAC" if getattr(store, "sealed", False)
                                     else "no secret: it trusts its Redis")))
        events = lm.manager.events
        if events is not None:
            lines.append(f"KV events: {events.endpoint} (topic {events.topic!r})")
    keys = len(options.api_keys)
    lines.append("API keys: " + ("none (anyone who reaches the port may use it)" if not keys else
                                 f"{keys}, " + ("sharing one cache" if options.share_cache_across_keys
                                                else "each its own tenant")))
    lines.append("routes: POST /v1/chat/completions /v1/completions /v1/responses /v1/messages "
                 "/v1/messages/count_tokens; GET /v1/models /v1/loads /v1/responses/{id} /health /metrics "
                 "/openapi.json")
    lines.append("one line per request at info: protocol, prompt (cached) and new tokens, TTFT, decode rate, "
                 "finish; --log-level debug for more")
    return lines


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()
