"""The drop-in wrapper: ``radixcache.wrap(model)`` -> ``CachedLM``, whose ``generate`` and
``generate_batch`` never recompute a cached prefix.

Both entry points share one ``CacheManager`` (allocator, tree, lock, statistics), one KV pool, one
attention backend (torch on CPU, FlashInfer on CUDA) and the attention registration of
``attention.install``; ``generate`` runs transformers' own generate over a ``PagedCache``
(``generate.py``), ``generate_batch`` runs the continuous-batching ``Engine`` through an
``HFModelRunner``. Whatever a path cannot serve exactly falls back to plain transformers with a
one-time warning and a ``fallbacks`` count in ``stats()``.
"""

from __future__ import annotations

import logging
import os
import time

from radixcache.attention import resolve_backend
from radixcache.attention.select import check_name as check_attention_name
from radixcache.errors import CacheError
from radixcache.engine import Engine
from radixcache.engine.request import request_namespace
from radixcache.integrations.hf import batch as batch_path
from radixcache.integrations.hf.attention import UnsupportedAttention, install
from radixcache.integrations.hf.cache import hooked
from radixcache.integrations.hf.generate import (generate_paged, passed_cache_reason, passed_caches,
                                                 plain_generate, prompt_tensors, split_mapping, unsupported_call,
                                                 validated_generation_config)
from radixcache.integrations.hf.identity import cached_kv_geometry, model_identity
from radixcache.integrations.hf.resources import (Fp8ClampWarning, open_store, pool_blocks, pool_maker,
                                                  pool_stats, unsupported_reason)
from radixcache.integrations.hf.runner import HFModelRunner
from radixcache.integrations.hf.selftest import run_self_tests
from radixcache.kv.pool import resolve_kv_dtype
from radixcache.kv_events import open_publisher
from radixcache.lifecycle.manager import CacheManager

logger = logging.getLogger("radixcache")



def validate_wrap_arguments(model, block_size, max_cache_tokens, attention, model_id) -> None:
    """``TypeError``/``ValueError`` naming the first bad argument of ``wrap()``, before any work."""
    if not hasattr(model, "generate") or not hasattr(model, "config"):
        raise TypeError("wrap() takes a transformers PreTrainedModel with a generate() method")
    check_attention_name(attention)
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if model_id is not None and (not isinstance(model_id, str) or not model_id):
        raise TypeError(f"model_id must be a non-empty str or None, got {model_id!r}")
    if max_cache_tokens is not None and (not isinstance(max_cache_tokens, int)
                                         or isinstance(max_cache_tokens, bool)
                                         or max_cache_tokens < block_size):
        raise ValueError(f"max_cache_tokens must be an int >= block_size ({block_size}), "
                         f"got {max_cache_tokens!r}")


def wrap(model, block_size: int = 16, max_cache_tokens: int | None = None, kv_dtype=None,
         attention: str = "auto", model_id: str | None = None, store=None,
         kv_events=None, compile: bool = False) -> CachedLM:
    """Wrap a transformers causal LM so that ``generate`` reuses every cached prefix.

    ``max_cache_tokens`` sizes the KV pool (default: 25% of available RAM on CPU, 50% of free GPU
    memory on CUDA); ``kv_dtype`` is the pool's storage dtype (default the model's; "fp8" for
    e4m3); ``attention`` picks the backend ("torch": gather + SDPA, the reference;
    "torch-inplace": decodes read the pool in place on CPU, tokens may part from plain generate's
    in the last bits; "flashinfer"; "auto": ``radixcache.attention.resolve_backend``'s choice,
    torch-inplace for a half-precision model on CPU, torch in float32, FlashInfer on CUDA); ``model_id`` names
    the weights (default: a digest of config and sampled weights, see ``model_identity``).
    ``store``: a shared KV tier, a ``redis://`` / ``rediss://`` URL (password or ACL user in the
    URL; ``?ttl=`` seconds) or any ``radixcache.store.BlockStore``; blocks committed here are
    written to it in the background and prompts load what it holds after the local match. A store
    that is down or slow is a miss, never an error. Call ``lm.close()`` (or use ``with``) to flush.
    ``kv_events``: publish the tree's whole blocks as vLLM's KV events for KV-aware routers, an
    endpoint to bind (``tcp://HOST:PORT``) or a ``radixcache.kv_events.KVEventPublisher``;
    ``lm.close()`` closes it.
    ``compile=True``: the engine's steps (``generate_batch``, ``lm.engine``, the server) run the
    model through ``torch.compile``, compiled here, at wrap time (minutes on a CPU;
    ``lm.compile_s``), and checked against the model's own forward like the eager path; where it
    cannot compile or disagrees, the engine stays eager and ``lm.compile_failed`` says why.
    ``generate``'s forwards then run as the same compiled packed steps (transformers still samples,
    streams and stops); a call with inputs a packed step does not take runs them eagerly.

    A model the paged path can never serve (non-attention layers such as Mamba's, an ALiBi bias,
    an encoder-decoder) or that fails both self-tests gets no pool: ``lm.unsupported`` names why,
    ``generate`` / ``generate_batch`` are plain transformers and ``new_engine`` refuses.
    """
    return CachedLM(model, block_size=block_size, max_cache_tokens=max_cache_tokens,
                    kv_dtype=kv_dtype, attention=attention, model_id=model_id, store=store,
                    kv_events=kv_events, compile=compile)


def validated_keep(keep_s) -> float | None:
    """``keep_s`` as float seconds (>= 0, finite) or None; ``TypeError``/``ValueError`` otherwise."""
    if keep_s is None:
        return None
    if isinstance(keep_s, bool) or not isinstance(keep_s, (int, float)):
        raise TypeError(f"keep_s must be a number of seconds or None, got {keep_s!r}")
    if not 0 <= keep_s < float("inf"):
        raise ValueError(f"keep_s must be finite and >= 0, got {keep_s!r}")
    return float(keep_s)


class CachedLM:
    """A causal LM whose ``generate`` and ``generate_batch`` match, reuse and extend a radix tree of
    paged KV blocks. Thread-safe: cache bookkeeping runs under the manager's lock, forwards outside
    it. ``cache`` is the ``RadixCache``, ``manager`` its ``CacheManager``, ``model`` the model."""

    def __init__(self, model, *, block_size: int = 16, max_cache_tokens: int | None = None,
                 kv_dtype=None, attention: str = "auto", model_id: str | None = None, store=None,
                 kv_events=None, compile: bool = False):
        validate_wrap_arguments(model, block_size, max_cache_tokens, attention, model_id)
        if not isinstance(compile, bool):
            raise TypeError(f"compile must be True or False, got {compile!r}")
        self.model = model
        self.block_size = block_size
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        storage = resolve_kv_dtype(kv_dtype, self.dtype)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self._explicit_id = model_id is not None
        self.model_id = model_id or model_identity(model)
        self._warned: set = set()
        self._fp8_clamps = Fp8ClampWarning()
        self._engine = None
        self.pool = self.backend = self.runner = None
        self.compile_s = self.compile_failed = None
        self._make_pool = None  # probe pools of this wrapper's geometry (the self-tests')
        # decided before any pool exists: a model no path can serve gets none
        self.unsupported = self.engine_unsupported = unsupported_reason(model)
        if self.unsupported is None:
            self.backend = resolve_backend(attention, self.device, self.dtype, storage)
            self.runner = HFModelRunner(model, self.vocab_size, self.device, self.model_id)
            install(model)
            try:
                geometry = cached_kv_geometry(model)
            except ValueError as e:
                reason = f"the paged KV path cannot serve this model: {e}"
                self.unsupported = self.engine_unsupported = reason
            else:
                make_pool = self._make_pool = pool_maker(geometry, block_size, self.dtype, self.device, kv_dtype)
                self.unsupported, self.engine_unsupported = run_self_tests(self, make_pool)
                if compile and self.engine_unsupported is None:
                    self.compile_engine()
        if self.unsupported and self.engine_unsupported:
            self.manager = CacheManager(1, block_size)  # the ledger (fallbacks) only: no pool
        else:
            self.pool = make_pool(pool_blocks(geometry, block_size, max_cache_tokens, storage,
                                              self.device))
            self.manager = CacheManager(self.pool.num_blocks, block_size, pool=self.pool)
        self.cache = self.manager.tree
        if self.pool is not None:
            self.manager.use_store(open_store(store, self.pool, self.model_id))
        elif store is not None:
            logger.warning("radixcache: %s; the store is not used (plain model.generate)",
                           self.unsupported)
        try:
            self.manager.use_events(open_publisher(kv_events))
        except BaseException:  # a bad kv_events: nothing stays open
            self.manager.close()
            raise

    def compile_engine(self) -> None:
        """Compile the engine's step now, on the self-test's probe (every shape class it meets in
        service), and keep it only where the engine's self-test passes through it (else
        ``compile_failed`` says why and the engine stays eager); ``compile_s`` is the time it took.
        torch guards compiled graphs on the calling thread's thread count: call it on the thread
        that will step the engine (``wrap(compile=True)`` calls it on the wrapping thread; the
        server on its scheduler thread). Precondition: the engine can serve this model."""
        if self.engine_unsupported is not None:
            raise CacheError(f"nothing to compile: the engine cannot serve this model ({self.engine_unsupported})")
        make_pool = self._make_pool
        if not hooked(self.model):
            self.compile_failed = "its attention does not reach radixcache's hook (it runs dense): nothing to compile"
            logger.warning("radixcache: compile=True: %s; the engine runs eagerly", self.compile_failed)
            return
        self.runner.compile()
        started = time.perf_counter()
        _, failed = run_self_tests(self, make_pool)
        self.compile_s = time.perf_counter() - started
        if failed is not None:
            self.runner.eager()
            self.compile_failed = failed
            logger.warning("radixcache: compile=True: %s; the engine runs eagerly", failed)
        else:
            logger.info("radixcache: compiled the engine's step in %.1f s", self.compile_s)

    # ------------------------------------------------------------------ identity
    def namespace(self, cache_salt: str | None = None) -> tuple:
        """The tree namespace of requests with ``cache_salt`` (``request_namespace``: the model's
        identity and the salt)."""
        return request_namespace(self.model_id, cache_salt)

    def invalidate(self, model_id: str | None = None) -> None:
        """Call after the model's weights changed (fine-tuning step, adapter swap, reload): no
        later request is served K/V computed with the old weights. The identity is recomputed from
        the weights (or set to ``model_id``); when the new digest equals the old one (a change the
        weight sample cannot see) a process-local id is used. Every cached prefix is dropped;
        requests running now finish under the old identity."""
        old = self.model_id
        if model_id is not None:
            if not isinstance(model_id, str) or not model_id:
                raise TypeError(f"model_id must be a non-empty str, got {model_id!r}")
            new, self._explicit_id = model_id, True
        else:
            new = old if self._explicit_id else model_identity(self.model)
        if new == old:
            new = f"{old}+local-{os.getpid()}-{id(self)}-{self.manager.stats()['requests']}"
        self.model_id = new
        if self.runner is not None:
            self.runner.model_id = new
        self.manager.clear()

    # ------------------------------------------------------------------ generate
    def generate(self, input_ids=None, attention_mask=None, cache_salt: str | None = None,
                 keep_s: float | None = None, **kwargs):
        """``model.generate`` with prefix caching: same arguments, same return type, same tokens.

        ``input_ids`` may also be a mapping such as a ``BatchEncoding`` (its ``input_ids`` and
        ``attention_mask``); masks may be int, bool or float. ``cache_salt`` (a str) isolates
        tenants. ``keep_s`` (seconds) hints that the conversation comes back within that time (an
        agent waiting on a tool): its prefix is then evicted only after every prefix without a live
        hint (soft: never refused for it, tokens never change). The ``PagedCache`` in a dict
        output's ``cache`` is released when the call returns: pass it back here as ``cache=`` or
        ``past_key_values=`` (both accepted, neither warns; the tree serves its prefix) or drop it;
        any other use raises ``CacheError``. ``output_attentions`` / ``output_hidden_states`` in a
        dict output fall back to plain generate (a cached prefix has none to return). With ``return_dict_in_generate=True`` the output also has
        ``cached_tokens`` (per row: prompt tokens served from the cache). Raises ``TypeError`` /
        ``ValueError`` on bad input, before anything changes, and ``OutOfBlocks`` when even
        eviction cannot supply the next block (what was computed stays cached).
        """
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
        keep_s = validated_keep(keep_s)
        if input_ids is None:
            input_ids = kwargs.pop("inputs", None)
        input_ids, attention_mask = split_mapping(input_ids, attention_mask)
        passed = passed_caches(kwargs)
        config = validated_generation_config(self.model, kwargs)
        if input_ids is None:
            return self._fallback("no input_ids (inputs_embeds only)",
                                  dict(kwargs, attention_mask=attention_mask), passed)
        ids, mask = prompt_tensors(input_ids, attention_mask, self.vocab_size, self.device)
        reason = (self.unsupported or passed_cache_reason(passed, self)
                  or unsupported_call(config, mask, kwargs))
        if reason:
            return self._fallback(reason, dict(kwargs, input_ids=ids, attention_mask=mask), passed)
        try:
            out = generate_paged(self, ids, mask, config, kwargs, self.namespace(cache_salt),
                                 keep_s)
        except UnsupportedAttention as e:  # e.g. dropout in training mode: this call only
            return self._fallback(f"the paged KV path cannot serve this call: {e}",
                                  dict(kwargs, input_ids=ids, attention_mask=mask), passed)
        self._fp8_clamps.warn_new(self.pool)
        return out

    def _fallback(self, reason: str, kwargs: dict, passed: list):
        return plain_generate(self.model, self.manager, reason, kwargs, passed, self._warned)

    # ------------------------------------------------------------------ generate_batch
    def generate_batch(self, prompts, *, max_new_tokens: int | None = None,
                       do_sample: bool | None = None, temperature: float | None = None,
                       top_p: float | None = None, top_k: int | None = None,
                       min_p: float | None = None, repetition_penalty: float | None = None,
                       stop_token_ids=None, eos_token_id=batch_path.FROM_MODEL,
                       seed: int | None = None, n: int = 1, cache_salt: str | None = None,
                       priority: int = 0, keep_s: float | None = None, stream: bool = False,
                       progress: bool = False, engine: Engine | None = None):
        """Continuous-batching generation for ``prompts`` over shared blocks: a list of prompts,
        each a list (or 1-D tensor) of token ids. A 2-D tensor is refused (``TypeError``): it cannot
        say which of its ids are padding, so pass its rows as a list when none is padded.

        Unset settings come from ``model.generation_config`` and transformers' defaults
        (``max_new_tokens`` 20, ``top_k`` 50, ...); ``temperature`` and the other sampling knobs
        without ``do_sample`` are ignored with transformers' warning. ``eos_token_id=None`` turns
        EOS off; ``stop_token_ids`` add more ids that end a sample. ``seed`` gives each prompt the
        same samples wherever it sits in the batch. ``n`` samples per prompt share its blocks.
        ``keep_s``: the conversations come back within that many seconds (soft retention: their
        prefixes are evicted after those without a live hint; tokens never change).
        ``progress=True`` shows a tqdm bar. ``engine``: an ``Engine`` from ``new_engine`` to run
        on (default: a fresh one); this call steps it, so no other loop may step it meanwhile.

        Returns a ``BatchOutput``: per prompt, ``n`` lists of generated ids (a stop token
        included), with ``cached_tokens`` per prompt and ``finish_reasons``. With ``stream=True``:
        a ``BatchRun``, an iterator of ``StreamToken(prompt, sample, token)`` and a context
        manager; closing it (or dropping it, e.g. by breaking out of the loop) aborts what is still
        running and releases its blocks. Bad arguments raise before anything changes.
        """
        explicit = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature,
                        top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty)
        settings, total, stops = batch_path.resolve_settings(self.model, explicit, eos_token_id,
                                                             stop_token_ids, self.vocab_size)
        requests = batch_path.build_requests(self, prompts, settings, total, stops, n, seed,
                                             cache_salt, priority, keep_s)
        if self.engine_unsupported:
            self.manager.record_fallback(self.engine_unsupported)
            return batch_path.plain_batch(self, requests, stream)
        engine = engine or self.new_engine()
        valid = [engine.validate(request) for request in requests]
        # a shared store's blocks after the local match (the network), loaded by the engine's step
        fetched = [self.manager.fetch(r.prompt, engine.namespace(r.cache_salt)) for r in requests]
        if stream:
            return batch_path.run_requests(engine, valid, fetched, True, progress)
        try:
            out = batch_path.run_requests(engine, valid, fetched, False, progress)
        except UnsupportedAttention as e:  # e.g. dropout in training mode: this call only
            self.manager.record_fallback(f"the paged KV path cannot serve this call: {e}")
            return batch_path.plain_batch(self, requests, False)
        self._fp8_clamps.warn_new(self.pool)
        return out

    def new_engine(self, **options) -> Engine:
        """A fresh ``Engine`` over this wrapper's manager, pool, backend and model; ``options``:
        ``max_running``, ``max_step_tokens``, ``schedule`` ("lpm"/"fcfs"), ``starvation_rounds``.
        ``ValueError`` naming the reason when the engine cannot serve this model (``wrap`` decided
        it: ``engine_unsupported``); ``generate_batch`` then falls back to plain transformers."""
        if self.engine_unsupported:
            raise ValueError(f"this model cannot run on radixcache's engine: {self.engine_unsupported}")
        return Engine(self.manager, self.pool, self.runner, self.backend, **options)

    @property
    def engine(self) -> Engine:
        """The wrapper's always-on engine (created on first use), for front ends such as the
        server: ``add`` requests any time, ``step`` in one loop, ``abort`` any time."""
        if self._engine is None:
            self._engine = self.new_engine()
        return self._engine

    # ------------------------------------------------------------------ state
    def stats(self) -> dict:
        """The manager's ledger (``requests``, ``queried_tokens``, ``hit_tokens``, ``hit_rate``,
        ``computed_prompt_tokens``, ``generated_tokens``, ``fallbacks``, ``fallback_reasons``,
        ``preemptions``; sizes in tokens: ``cached_tokens``, ``pinned_tokens``,
        ``evictable_tokens``, ``free_tokens``, ``capacity_tokens``, ``evicted_tokens``) plus
        ``kv_bytes_per_token``, ``kv_pool_bytes``, ``fp8_clamped_writes`` and, with a store, its
        counters (``store_hit_tokens``, ``store_miss_blocks``, ``store_written_blocks``,
        ``store_dropped_blocks``, ``store_bytes_read``, ``store_bytes_written``, ``store_errors``,
        ...), which stay readable after ``close()``."""
        out = self.manager.stats()
        out.update(pool_stats(self.pool))
        return out

    def close(self, timeout: float = 10.0) -> dict:
        """Flush the shared store: wait up to ``timeout`` s for queued block writes, then stop
        using it, and close the KV event publisher (what is queued is sent first); returns their
        final counters (``store_written_blocks``, ``store_dropped_blocks``, ``kv_events_batches``,
        ...; also in ``stats()`` afterwards). The cache stays usable, without them. Idempotent."""
        return self.manager.close(timeout)

    def __enter__(self) -> CachedLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def reset_stats(self) -> None:
        """Zero the counters of ``stats()`` (sizes are not counters and stay)."""
        self.manager.reset_stats()

    def clear(self) -> None:
        """Drop every cached prefix that no running request holds."""
        self.manager.clear()

    def __repr__(self) -> str:
        if self.pool is None:
            return (f"CachedLM({type(self.model).__name__}, plain model.generate: "
                    f"{self.unsupported})")
        return (f"CachedLM({type(self.model).__name__}, block_size={self.block_size}, "
                f"capacity_tokens={self.pool.num_blocks * self.block_size}, "
                f"backend={self.backend.name})")
