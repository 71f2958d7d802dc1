"""The drop-in wrapper: ``radixcache.wrap(model).generate(...)`` never recomputes a cached prefix.

One call of ``CachedLM.generate``:

1. check the inputs (nothing changes on bad input);
2. per batch row, match the row's tokens minus the last one in the radix tree, pin the match, and
   reserve blocks for the rest of the prompt and ``max_new_tokens`` (evicting LRU leaves if short);
3. bring every row's K/V up to the same column (the longest cached one) with a suffix prefill over
   a ``PagedCache`` (nothing to do for a single row);
4. run transformers' own ``generate`` over a ``PagedCache`` that claims those columns, so the rest of
   the prompt and the whole generation (sampling, streamers, processors, stopping) are transformers'
   own and a single cached prompt costs exactly one forward over its uncached suffix;
5. insert every token whose K/V was computed into the tree, unpin, release.

Anything this path cannot serve exactly (beam search, assisted decoding, right padding, models whose
attention does not go through the cache) falls back to plain ``model.generate`` with a one-time
warning and a ``fallbacks`` count in ``stats()``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from dataclasses import dataclass

import torch
import xxhash

from radixcache.blocks import BlockAllocator
from radixcache.errors import OutOfBlocks
from radixcache.kv.hf_cache import PagedCache
from radixcache.kv.pool import KVPool, resolve_kv_dtype
from radixcache.tree import RadixCache

logger = logging.getLogger("radixcache")

SUPPORTED_LAYER_TYPES = {"full_attention", "sliding_attention"}
CPU_MEMORY_SHARE = 0.25  # default pool size: this share of available RAM ...
GPU_MEMORY_SHARE = 0.5  # ... or of free GPU memory


def wrap(model, block_size: int = 16, max_cache_tokens: int | None = None, kv_dtype=None,
         attention: str = "auto") -> CachedLM:
    """Wrap a transformers causal LM so that ``generate`` reuses every cached prefix.

    ``max_cache_tokens`` sizes the KV pool (default: 25% of available RAM on CPU, 50% of free GPU
    memory on CUDA); ``kv_dtype`` is the pool's storage dtype (default the model's; "fp8" for e4m3);
    ``attention`` picks the backend of ``generate_batch`` ("auto", "torch" or "flashinfer").
    """
    return CachedLM(model, block_size=block_size, max_cache_tokens=max_cache_tokens,
                    kv_dtype=kv_dtype, attention=attention)


def kv_geometry(config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a transformers config (text part for multimodal configs)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return int(layers), int(kv_heads), int(head_dim)


def model_fingerprint(model) -> str:
    """A digest of the model's config, dtype and weights (an evenly strided sample of every tensor).

    It keys the namespace, so two different models (or a model and its fine-tune) never share a block.
    """
    h = xxhash.xxh3_128()
    h.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        sample = flat[::step][:4096].to("cpu", torch.float32).contiguous()
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()


def default_cache_tokens(bytes_per_token: int, device: torch.device) -> int:
    """Tokens that fit in the documented default share of memory on ``device``."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * GPU_MEMORY_SHARE
    else:
        budget = _available_ram() * CPU_MEMORY_SHARE
    return max(1, int(budget // bytes_per_token))


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@dataclass
class _Row:
    """One batch row's share of a request: its real tokens and the blocks it holds."""

    tokens: list
    pad: int
    cached: int = 0
    node: object = None
    blocks: tuple = ()  # matched (retained) blocks followed by freshly allocated ones


class CachedLM:
    """A causal LM whose ``generate`` matches, reuses and extends a radix tree of paged KV blocks.

    Thread-safe: tree and allocator operations run under one lock; forwards run outside it.
    """

    def __init__(self, model, *, block_size: int = 16, max_cache_tokens: int | None = None,
                 kv_dtype=None, attention: str = "auto"):
        if not hasattr(model, "generate") or not hasattr(model, "config"):
            raise TypeError("wrap() takes a transformers PreTrainedModel with a generate() method")
        if attention not in ("auto", "torch", "flashinfer"):
            raise ValueError(f"attention must be 'auto', 'torch' or 'flashinfer', got {attention!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.model = model
        self.block_size = block_size
        self.attention = attention
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        layers, kv_heads, head_dim = kv_geometry(model.config)
        storage = resolve_kv_dtype(kv_dtype, self.dtype)
        bytes_per_token = 2 * layers * kv_heads * head_dim * torch.empty((), dtype=storage).element_size()
        if max_cache_tokens is None:
            max_cache_tokens = default_cache_tokens(bytes_per_token, self.device)
        if not isinstance(max_cache_tokens, int) or max_cache_tokens < block_size:
            raise ValueError(f"max_cache_tokens must be an int >= block_size ({block_size}), "
                             f"got {max_cache_tokens!r}")
        num_blocks = max_cache_tokens // block_size
        self.allocator = BlockAllocator(num_blocks)
        self.cache = RadixCache(self.allocator, block_size)
        self.pool = KVPool(layers, num_blocks, block_size, kv_heads, head_dim, dtype=self.dtype,
                           device=self.device, kv_dtype=kv_dtype)
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.fingerprint = model_fingerprint(model)
        self._lock = threading.RLock()
        self._counters = {"requests": 0, "prompt_tokens": 0, "hit_tokens": 0,
                          "computed_prompt_tokens": 0, "generated_tokens": 0, "fallbacks": 0}
        self._fallback_reasons: dict[str, int] = {}
        self._warned: set = set()
        self._engine = None
        self.unsupported = _unsupported_reason(model)
        if self.unsupported is None:
            self.unsupported = self._self_test()

    # ------------------------------------------------------------------ public API
    def generate(self, input_ids=None, attention_mask=None, cache_salt: str | None = None, **kwargs):
        """``model.generate`` with prefix caching: same arguments, same return type, same tokens.

        ``cache_salt`` (any str) isolates tenants: different salts never share a block. Raises
        ``ValueError``/``TypeError`` on bad input and ``OutOfBlocks`` when the pool cannot hold the
        request even after eviction; in every failure the cache is left as it was.
        """
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {type(cache_salt).__name__}")
        if input_ids is None:
            if "inputs" in kwargs:
                input_ids = kwargs.pop("inputs")
            else:
                return self._fallback("no input_ids (inputs_embeds only)", attention_mask, kwargs)
        ids, mask = self._check_inputs(input_ids, attention_mask)
        reason = self.unsupported or self._unsupported_call(mask, kwargs)
        if reason:
            return self._fallback(reason, mask, dict(kwargs, input_ids=ids))
        max_new = self._max_new_tokens(ids.shape[1], kwargs)
        if max_new < 1:
            return self._fallback("max_new_tokens < 1", mask, dict(kwargs, input_ids=ids))
        namespace = (self.fingerprint, cache_salt)
        rows = [_Row(ids[r, pad:].tolist(), pad) for r, pad in enumerate(self._pads(mask))]
        self._acquire(rows, namespace, max_new)
        try:
            # generate() computes columns `filled`.. of every row; each row first catches up to it
            filled = max(row.pad + row.cached for row in rows)
            for row in rows:
                self._prefill(row, filled - row.pad)
            k_rows = self._batch_rows(rows, ids.shape[1] + max_new)
            cache = PagedCache(self.pool, k_rows, filled)
            with torch.no_grad():
                out = self.model.generate(input_ids=ids, attention_mask=mask, cache=cache,
                                          **kwargs)
            self._insert(rows, out, ids.shape[1], namespace, kwargs)
            return out
        finally:
            self._release(rows)

    def stats(self) -> dict:
        """Hit rate and sizes: queried/hit/computed prompt tokens, cached/pinned/free tokens, fallbacks."""
        with self._lock:
            c = dict(self._counters)
            bs = self.block_size
            return {
                **c,
                "queried_tokens": c["prompt_tokens"],
                "hit_rate": c["hit_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0,
                "cached_tokens": self.cache.cached_blocks * bs,
                "pinned_tokens": self.cache.pinned_blocks * bs,
                "evictable_tokens": self.cache.evictable_blocks * bs,
                "free_tokens": self.allocator.num_free * bs,
                "capacity_tokens": self.allocator.num_blocks * bs,
                "evicted_tokens": self.cache.stats.evicted_blocks * bs,
                "kv_bytes_per_token": self.pool.bytes_per_token,
                "kv_pool_bytes": self.pool.total_bytes,
                "fallback_reasons": dict(self._fallback_reasons),
            }

    def clear(self) -> None:
        """Drop every cached prefix that no running request holds."""
        with self._lock:
            self.cache.reset()

    def generate_batch(self, prompts, **kwargs):
        """Continuous-batching generation over shared blocks; see ``radixcache.engine.Engine.generate``."""
        from radixcache.engine import Engine

        with self._lock:
            if self._engine is None:
                self._engine = Engine(self)
        return self._engine.generate(prompts, **kwargs)

    # ------------------------------------------------------------------ steps
    def _check_inputs(self, input_ids, attention_mask):
        ids = _as_id_tensor(input_ids, "input_ids")
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {tuple(ids.shape)}")
        if ids.shape[0] == 0 or ids.shape[1] == 0:
            raise ValueError(f"empty prompt: input_ids has shape {tuple(ids.shape)}")
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"token id {bad} is outside the vocabulary 0..{self.vocab_size - 1}")
        if attention_mask is None:
            mask = torch.ones_like(ids)
        else:
            mask = _as_id_tensor(attention_mask, "attention_mask")
            if mask.dim() == 1:
                mask = mask[None]
            if tuple(mask.shape) != tuple(ids.shape):
                raise ValueError(f"attention_mask shape {tuple(mask.shape)} does not match "
                                 f"input_ids shape {tuple(ids.shape)}")
            if ((mask != 0) & (mask != 1)).any():
                raise ValueError("attention_mask must hold only 0 and 1")
            if (mask.sum(dim=1) == 0).any():
                raise ValueError("empty prompt: a row of attention_mask has no 1")
        return ids.to(self.device), mask.to(self.device)

    def _unsupported_call(self, mask, kwargs) -> str | None:
        config = kwargs.get("generation_config") or self.model.generation_config
        def setting(name, default=None):
            return kwargs.get(name, getattr(config, name, default))
        if (setting("num_beams", 1) or 1) > 1:
            return "beam search"
        if (setting("num_return_sequences", 1) or 1) > 1:
            return "num_return_sequences > 1"
        if kwargs.get("assistant_model") is not None or setting("prompt_lookup_num_tokens"):
            return "assisted decoding"
        if setting("penalty_alpha"):
            return "contrastive search"
        if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
            return "caller passed its own cache"
        if setting("use_cache", True) is False:
            return "use_cache=False"
        if kwargs.get("inputs_embeds") is not None:
            return "inputs_embeds"
        if setting("cache_implementation"):
            return "cache_implementation set"
        if (mask[:, 1:] < mask[:, :-1]).any():
            return "attention_mask is not left-padded"
        return None

    def _fallback(self, reason: str, mask, kwargs):
        with self._lock:
            self._counters["fallbacks"] += 1
            self._fallback_reasons[reason] = self._fallback_reasons.get(reason, 0) + 1
            first = reason not in self._warned
            self._warned.add(reason)
        if first:
            logger.warning("radixcache: %s; using plain model.generate (no prefix caching)", reason)
        if mask is not None:
            kwargs["attention_mask"] = mask
        with torch.no_grad():
            return self.model.generate(**kwargs)

    def _max_new_tokens(self, prompt_len: int, kwargs) -> int:
        config = kwargs.get("generation_config") or self.model.generation_config
        if kwargs.get("max_new_tokens") is not None:
            return int(kwargs["max_new_tokens"])
        if kwargs.get("max_length") is not None:
            return int(kwargs["max_length"]) - prompt_len
        if getattr(config, "max_new_tokens", None) is not None:
            return int(config.max_new_tokens)
        return int(getattr(config, "max_length", 20) or 20) - prompt_len

    @staticmethod
    def _pads(mask) -> list[int]:
        return (mask.shape[1] - mask.sum(dim=1)).tolist()

    def _acquire(self, rows: list[_Row], namespace, max_new: int) -> None:
        """Match, pin and reserve blocks for every row; on any failure undo all of it."""
        bs = self.block_size
        with self._lock:
            try:
                for row in rows:
                    m = self.cache.match(row.tokens[:-1], namespace)
                    self.cache.lock(m.node)
                    row.node = m.node
                    self.allocator.retain(m.blocks)
                    row.blocks, row.cached = m.blocks, m.length
                need = [math.ceil((len(r.tokens) + max_new) / bs) - len(r.blocks) for r in rows]
                short = sum(need) - self.allocator.num_free
                if short > self.cache.evictable_blocks:
                    raise OutOfBlocks(
                        f"request needs {sum(need)} blocks of {bs} tokens but only "
                        f"{self.allocator.num_free} are free after evicting every unpinned prefix "
                        f"(pool: {self.allocator.num_blocks} blocks); raise max_cache_tokens or "
                        f"lower max_new_tokens")
                if short > 0:
                    self.cache.evict(short)
                for row, n in zip(rows, need):
                    row.blocks = tuple(row.blocks) + tuple(self.allocator.allocate(n))
            except BaseException:
                self._release(rows)
                raise
            c = self._counters
            c["requests"] += 1
            c["prompt_tokens"] += sum(len(r.tokens) for r in rows)
            c["hit_tokens"] += sum(r.cached for r in rows)
            c["computed_prompt_tokens"] += sum(len(r.tokens) - r.cached for r in rows)

    def _prefill(self, row: _Row, n: int) -> None:
        """Compute K/V of the row's prompt tokens ``row.cached .. n-1`` (the rest is generate's)."""
        if n <= row.cached:
            return
        rows = self.pool.rows_for(row.blocks, 0, n)[None]
        cache = PagedCache(self.pool, rows, row.cached)
        ids = torch.tensor([row.tokens[row.cached:n]], device=self.device)
        with torch.no_grad():
            self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)

    def _batch_rows(self, rows: list[_Row], columns: int) -> torch.Tensor:
        out = []
        for row in rows:
            real = self.pool.rows_for(row.blocks, 0, columns - row.pad)
            out.append(torch.cat([self.pool.null_rows(row.pad), real]))
        return torch.stack(out)

    def _insert(self, rows: list[_Row], out, prompt_len: int, namespace, kwargs) -> None:
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        generated = sequences[:, prompt_len:].tolist()
        eos = self._eos_ids(kwargs)
        with self._lock:
            for row, gen in zip(rows, generated):
                fed = len(gen) - 1  # the last generated token was never fed back: no K/V
                first_eos = next((i for i, t in enumerate(gen) if t in eos), None)
                if first_eos is not None:
                    fed = min(fed, first_eos + 1)
                tokens = row.tokens + gen[:max(fed, 0)]
                nblocks = len(tokens) // self.block_size
                self.cache.insert(tokens, row.blocks[:nblocks], namespace)
                self._counters["generated_tokens"] += len(gen) if first_eos is None else first_eos + 1

    def _eos_ids(self, kwargs) -> set:
        config = kwargs.get("generation_config") or self.model.generation_config
        eos = kwargs.get("eos_token_id", getattr(config, "eos_token_id", None))
        if eos is None:
            return set()
        if isinstance(eos, torch.Tensor):
            eos = eos.tolist()
        return set(eos) if isinstance(eos, (list, tuple, set)) else {int(eos)}

    def _release(self, rows: list[_Row]) -> None:
        with self._lock:
            for row in rows:
                if row.node is not None:
                    self.cache.unlock(row.node)
                    row.node = None
                if row.blocks:
                    self.allocator.release(row.blocks)
                    row.blocks = ()

    # ------------------------------------------------------------------ support probe
    def _self_test(self) -> str | None:
        """Run a short prompt both plainly and through the paged path; any mismatch means fallback."""
        bs = self.block_size
        n = 2 * bs + 3
        if self.allocator.num_blocks < math.ceil(n / bs) + 1:
            return None  # too small a pool to probe; trust the architecture check
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.vocab_size, (1, n), generator=gen).to(self.device)
        blocks = self.allocator.allocate(math.ceil(n / bs))
        try:
            with torch.no_grad():
                want = self.model(input_ids=ids).logits[0, -1].float()
                rows = self.pool.rows_for(blocks, 0, n)[None]
                self.model(input_ids=ids[:, :bs], cache=PagedCache(self.pool, rows, 0))
                got = self.model(input_ids=ids[:, bs:],
                                 cache=PagedCache(self.pool, rows, bs)).logits[0, -1].float()
        except Exception as e:  # noqa: BLE001 - any failure of the paged path means: do not use it
            return f"paged KV path failed its self-test ({type(e).__name__}: {e})"
        finally:
            self.allocator.release(blocks)
        tol = 1e-3 if self.pool.storage_dtype == torch.float32 else 0.1 if self.pool.quantized else 3e-2
        err = float((want - got).abs().max() / want.abs().max().clamp(min=1e-6))
        if not err <= tol:
            return f"paged KV path disagrees with the model's own forward (relative error {err:.2e})"
        return None

    def __repr__(self) -> str:
        return (f"CachedLM({type(self.model).__name__}, block_size={self.block_size}, "
                f"capacity_tokens={self.allocator.num_blocks * self.block_size})")


def _unsupported_reason(model) -> str | None:
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None) or []
    other = sorted(set(layer_types) - SUPPORTED_LAYER_TYPES)
    if other:
        return f"layers of type {other} keep no paged K/V"
    return None


def _as_id_tensor(x, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(x)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"{name} must be a tensor or nested list of ints ({e})") from None
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got dtype {x.dtype}")
    return x.long()
