"""What one server holds: options, tokenizer and renderer, model facts, engine, metrics, limits.

``load_model_info(model_dir)`` reads the tokenizer, config and generation config of a local model
directory (never the weights, never a hub) into a ``ModelInfo``. ``ServerState`` bundles it with
the grammar compiler of structured output (``requests/structured.py``), the ``EngineClient`` (None: no engine attached, generation answers 503), the metrics, the
admission gate, the history index, one worker thread for template rendering and tokenizing (so the
event loop never waits on it; prompts go ahead of history work), and the background tasks it
starts (history forms and their precomputes). ``shutdown()`` (Ctrl-C, or the app's lifespan)
aborts what runs, closes the engine and stops the render thread, once.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import NamedTuple

from radixcache.integrations.serve.requests.chat_template import ChatRenderer
from radixcache.models import context_length
from radixcache.integrations.serve.engine.client import EngineLimits, EngineOverloaded
from radixcache.integrations.serve.requests.structured import Grammars
from radixcache.integrations.serve.history.index import HistoryIndex
from radixcache.integrations.serve.history.work import PendingHistories
from radixcache.integrations.serve.requests.job import history_request
from radixcache.integrations.serve.admission import AdmissionGate
from radixcache.integrations.serve.telemetry.token_log import TokenLog
from radixcache.integrations.serve.telemetry.metrics import ServerMetrics
from radixcache.integrations.serve.requests.render_thread import RenderThread
from radixcache.integrations.serve.protocols.openai.response_store import ResponseStore

logger = logging.getLogger("radixcache.serve")


class ModelInfo(NamedTuple):
    """Facts the server checks requests against: directory name, context, vocabulary, stop ids."""

    name: str
    max_context_tokens: int
    vocab_size: int
    stop_token_ids: frozenset


def _ids(value) -> set:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple, set)) else {int(value)}


def load_model_info(model_dir) -> tuple:
    """``(tokenizer, ModelInfo)`` of a local model directory; reads no weights, contacts no hub."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    path = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    context = context_length(config)
    stops = _ids(getattr(text, "eos_token_id", None))
    try:
        stops |= _ids(GenerationConfig.from_pretrained(path, local_files_only=True).eos_token_id)
    except OSError:  # no generation_config.json
        pass
    stops |= _ids(tokenizer.eos_token_id)
    return tokenizer, ModelInfo(path.name, int(context), int(text.vocab_size), frozenset(stops))


class ServerState:
    """One server's state; see the module docstring. Built once, used from the event loop."""

    def __init__(self, options, tokenizer, info: ModelInfo, engine=None):
        self.options = options
        self.tokenizer = tokenizer
        self.info = info
        self.renderer = ChatRenderer(tokenizer, options.chat_template)
        self.grammars = Grammars(tokenizer, info.vocab_size, info.stop_token_ids)  # compiles on first use
        self.model_names = tuple(options.served_model_names) or (info.name,)
        self.max_request_bytes = options.request_bytes(info.max_context_tokens)
        self.metrics = ServerMetrics()
        self.attach_engine(engine)
        self.gate = AdmissionGate(options.max_in_flight)
        self.histories = HistoryIndex()
        self._render = RenderThread()
        self.pending_histories = PendingHistories(self._render.promote)
        self.responses = ResponseStore()  # stored /v1/responses (previous_response_id, GET)
        self._background: set = set()
        self._shutdown_task = None
        log_path = getattr(options, "log_token_ids", None)
        self.token_log = TokenLog(log_path) if log_path is not None else None

    def attach_engine(self, engine) -> None:
        """Serve generation with ``engine`` (an ``EngineClient``; None: generation answers 503)."""
        self.engine = engine
        self.metrics.attach(engine.counts if engine is not None else None,
                            getattr(engine, "store_stats", None), getattr(engine, "events_stats", None),
                            getattr(engine, "ledger_stats", None))

    @property
    def limits(self) -> EngineLimits:
        """The engine's limits; without an engine, the model's context and ``--max-cache-tokens``
        (``pool_tokens`` None when that was not given)."""
        if self.engine is not None:
            return self.engine.limits()
        return EngineLimits(self.info.max_context_tokens, self.options.max_cache_tokens,
                            self.options.block_size)

    @property
    def stopping(self) -> bool:
        """``shutdown()`` has begun: what runs is being aborted."""
        return self._shutdown_task is not None

    async def render(self, fn, *args):
        """``fn(*args)`` (a template, the tokenizer) on the render thread, ahead of history work."""
        return await self._render.run(fn, *args)

    async def render_later(self, fn, *args):
        """``fn(*args)`` on the render thread once no prompt waits for it (history work), unless a
        client waits on the calling task's work (``pending_histories``): then ahead of every prompt."""
        return await self._render.run_later(fn, *args)

    def spawn(self, coroutine) -> asyncio.Task:
        """Run ``coroutine`` as a background task of this server (cancelled by ``shutdown``; an
        exception it raises is logged)."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background_done)
        return task

    def _background_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("background task failed", exc_info=task.exception())

    def precompute(self, token_ids, salt: str | None, keep_s: float | None = None, on_done=None) -> bool:
        """Compute a history form's uncached blocks at low priority (prefill only), in the background;
        ``keep_s``: the request's retention hint, which its history form keeps; ``on_done()`` is
        called (on the event loop) once they are in the cache. Returns whether the work was
        submitted (False: the precompute is off or the engine refused it)."""
        if self.engine is None or not self.options.history_precompute or self.stopping:
            return False
        request = history_request(token_ids, salt, keep_s)
        try:
            stream = self.engine.submit(request)
        except (EngineOverloaded, ValueError) as exc:
            logger.debug("history precompute %s not submitted: %s", request.request_id, exc)
            return False
        self.metrics.observe_precompute(len(request.prompt))
        self.spawn(self._drain(request.request_id, stream, on_done))
        return True

    async def _drain(self, request_id: str, stream, on_done) -> None:
        try:
            async for event in stream:
                if event.finish_reason == "error":
                    logger.warning("history precompute %s failed: %s", request_id, event.error)
                elif event.finish_reason == "prefilled" and on_done is not None:
                    on_done()
        except asyncio.CancelledError:
            self.engine.abort(request_id)
            raise

    def begin_shutdown(self) -> asyncio.Task:
        """Start ``shutdown()`` now (on the event loop) without waiting for it; idempotent."""
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.get_running_loop().create_task(self._shutdown())
        return self._shutdown_task

    async def shutdown(self) -> None:
        """Abort what runs and stop, once: background work is cancelled, the engine closed (every
        running request ends with "abort", so its response ends at once with a 503 / an error
        event saying the server is shutting down; a store is flushed), the render thread stopped.
        A second call waits for the first."""
        await asyncio.shield(self.begin_shutdown())

    async def _shutdown(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self.engine is not None:
            await self.engine.close()
        self._render.close()
        self.grammars.close()
        if self.token_log is not None:
            self.token_log.close()
