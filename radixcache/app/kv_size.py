"""How many bytes of KV cache a model needs per token, per sequence and for a batch.

bytes per token = layers x kv_heads x (head_dim_k + head_dim_v) x bytes per element (for most
models K and V share a head dim: 2 x layers x kv_heads x head_dim x bytes). Multi-head latent
attention (MLA: DeepSeek-V2/V3, Kimi K2) is counted as radixcache's pool stores it: transformers
expands the compressed latent into per-head K (``qk_nope + qk_rope``) and V (``v_head_dim``) right
before attention, and the pool holds those. MLA-native servers cache the latent itself
(``latent_dim`` + ``rope_dim`` elements per token per layer, one "head"); ``KVShape.latent_bytes_per_token``
gives that figure through the same formula, for comparison.

Pure Python: importing this module does not import torch or transformers.

The checks of every argument (``validated_int``: an int with a minimum; a shape's sliding window,
MLA dims and head counts) raise ``TypeError`` / ``ValueError`` naming the field and the shape.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from radixcache.kv.geometry import kv_bytes_per_token

ATTENTION_KINDS = ("MHA", "GQA", "MQA", "MLA")

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


# ------------------------------------------------------------ argument checks
def validated_int(value, what: str, minimum: int) -> int:
    """``value`` when it is an int >= ``minimum``; TypeError/ValueError naming ``what`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return value


def _validate_window(shape) -> None:
    """``shape.sliding_layers`` is an int >= 0; without a ``sliding_window`` it is 0, with one
    (an int >= 1) it is 1..``shape.layers``."""
    validated_int(shape.sliding_layers, "sliding_layers", 0)
    if shape.sliding_window is None:
        if shape.sliding_layers:
            raise ValueError(f"{shape.name}: sliding_layers without a sliding_window")
        return
    validated_int(shape.sliding_window, "sliding_window", 1)
    if not 1 <= shape.sliding_layers <= shape.layers:
        raise ValueError(f"{shape.name}: a sliding window needs 1..{shape.layers} sliding_layers, "
                         f"got {shape.sliding_layers}")


def _validate_mla(shape) -> None:
    """An MLA shape has a latent (``latent_dim`` >= 1), keys wider than their rope part
    (``head_dim`` > ``rope_dim``) and no more KV heads than query heads (when those are given)."""
    if shape.latent_dim < 1:
        raise ValueError(f"{shape.name}: MLA needs latent_dim >= 1")
    if shape.head_dim <= shape.rope_dim:
        raise ValueError(f"{shape.name}: MLA keys are qk_nope + qk_rope ({shape.rope_dim}) wide, "
                         f"got head_dim {shape.head_dim}")
    if shape.query_heads is not None and shape.kv_heads > shape.query_heads:
        raise ValueError(f"{shape.name}: kv_heads ({shape.kv_heads}) exceeds "
                         f"query_heads ({shape.query_heads})")


def _validate_heads(shape) -> None:
    """A non-MLA shape has no latent or rope dims, one head dim for K and V, one KV head for
    MQA, and, when ``query_heads`` is given, head counts its ``attention`` kind means (MHA: as many
    KV heads as query heads; GQA: more than one and fewer than the query heads)."""
    if shape.latent_dim or shape.rope_dim:
        raise ValueError(f"{shape.name}: latent_dim/rope_dim apply only to MLA, not {shape.attention}")
    if shape.head_dim_v != shape.head_dim:
        raise ValueError(f"{shape.name}: K and V of different head dims ({shape.head_dim}, "
                         f"{shape.head_dim_v}) apply only to MLA, not {shape.attention}")
    if shape.attention == "MQA" and shape.kv_heads != 1:
        raise ValueError(f"{shape.name}: MQA means one KV head, got kv_heads={shape.kv_heads}")
    if shape.query_heads is None:
        return
    if shape.kv_heads > shape.query_heads:
        raise ValueError(f"{shape.name}: kv_heads ({shape.kv_heads}) exceeds "
                         f"query_heads ({shape.query_heads})")
    if shape.attention == "MHA" and shape.kv_heads != shape.query_heads:
        raise ValueError(f"{shape.name}: MHA means kv_heads == query_heads, "
                         f"got {shape.kv_heads} != {shape.query_heads}")
    if shape.attention == "GQA" and not 1 < shape.kv_heads < shape.query_heads:
        raise ValueError(f"{shape.name}: GQA means 1 < kv_heads < query_heads, "
                         f"got {shape.kv_heads} of {shape.query_heads}")


# ------------------------------------------------------------ shapes
def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a KV-cache dtype name: fp32 4, bf16 2, fp16 2, fp8 1 (case-insensitive).

    Raises TypeError for a non-string and ValueError for an unknown name.
    """
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a string such as 'bf16', got {type(dtype).__name__}")
    try:
        return DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPE_BYTES)}") from None


def classify_attention(query_heads: int, kv_heads: int) -> str:
    """The attention kind implied by head counts: "MQA" if one KV head, "MHA" if as many KV heads
    as query heads, else "GQA". Raises ValueError if kv_heads exceeds query_heads."""
    validated_int(query_heads, "query_heads", 1)
    validated_int(kv_heads, "kv_heads", 1)
    if kv_heads > query_heads:
        raise ValueError(f"kv_heads ({kv_heads}) cannot exceed query heads ({query_heads})")
    if kv_heads == 1:
        return "MQA"
    if kv_heads == query_heads:
        return "MHA"
    return "GQA"


@dataclass(frozen=True)
class KVShape:
    """The shape of one model's KV cache.

    ``kv_heads`` x ``head_dim`` elements are cached for K and ``kv_heads`` x ``head_dim_v``
    (default: ``head_dim``) for V in each of ``layers`` layers. MLA shapes (build one with
    ``KVShape.mla``) count the expanded per-head K and V the pool holds and also record the
    compressed latent (``latent_dim``, ``rope_dim``) MLA-native servers cache. ``query_heads`` is
    optional and, when given, must agree with ``attention``. ``sliding_window`` (tokens) and
    ``sliding_layers`` (how many layers attend only that far back) describe a sliding window; the
    byte counts still cover every token's K/V in every layer, as radixcache's pool holds them
    (``windowed_bytes_per_sequence`` gives the cap a cache that drops K/V outside the window would
    have). Invalid fields raise ValueError/TypeError at construction.
    """

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    attention: str
    latent_dim: int = 0
    rope_dim: int = 0
    query_heads: int | None = None
    sliding_window: int | None = None
    sliding_layers: int = 0
    head_dim_v: int | None = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise TypeError("name must be a non-empty string")
        validated_int(self.layers, "layers", 1)
        validated_int(self.kv_heads, "kv_heads", 1)
        validated_int(self.head_dim, "head_dim", 1)
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_KINDS)}, got {self.attention!r}")
        validated_int(self.latent_dim, "latent_dim", 0)
        validated_int(self.rope_dim, "rope_dim", 0)
        if self.query_heads is not None:
            validated_int(self.query_heads, "query_heads", 1)
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        validated_int(self.head_dim_v, "head_dim_v", 1)
        _validate_window(self)
        if self.attention == "MLA":
            _validate_mla(self)
        else:
            _validate_heads(self)

    @classmethod
    def mla(cls, name: str, layers: int, heads: int, nope_dim: int, rope_dim: int, v_dim: int,
            latent_dim: int, kv_heads: int | None = None) -> KVShape:
        """An MLA shape: per head, K of ``nope_dim + rope_dim`` and V of ``v_dim`` elements (what
        the pool holds), expanded from a ``latent_dim + rope_dim`` latent."""
        validated_int(nope_dim, "nope_dim", 1)
        validated_int(rope_dim, "rope_dim", 0)
        return cls(name, layers, heads if kv_heads is None else kv_heads, nope_dim + rope_dim, "MLA",
                   latent_dim=latent_dim, rope_dim=rope_dim, query_heads=heads, head_dim_v=v_dim)

    @property
    def elements_per_token(self) -> int:
        """Cached elements per token across all layers."""
        return kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, self.head_dim_v, 1)

    def latent_bytes_per_token(self, dtype: str = "bf16") -> int:
        """MLA only: bytes per token of the compressed latent MLA-native servers cache (one
        ``latent_dim`` "K" and one ``rope_dim`` "V" per layer, as transformers' own cache holds
        them); ``ValueError`` for other shapes."""
        if self.attention != "MLA":
            raise ValueError(f"{self.name} is {self.attention}, not MLA: it has no latent")
        return kv_bytes_per_token(self.layers, 1, self.latent_dim, self.rope_dim, dtype_bytes(dtype))

    def bytes_per_token(self, dtype: str = "bf16") -> int:
        """KV bytes for one token in every layer at ``dtype`` (see ``dtype_bytes``)."""
        return self.elements_per_token * dtype_bytes(dtype)

    def bytes_per_sequence(self, context: int, dtype: str = "bf16") -> int:
        """KV bytes for one sequence of ``context`` tokens."""
        return validated_int(context, "context", 0) * self.bytes_per_token(dtype)

    def bytes_for(self, sequences: int, context: int, dtype: str = "bf16") -> int:
        """KV bytes for ``sequences`` sequences of ``context`` tokens each."""
        return validated_int(sequences, "sequences", 0) * self.bytes_per_sequence(context, dtype)

    def windowed_bytes_per_sequence(self, context: int, dtype: str = "bf16") -> int:
        """KV bytes of one sequence of ``context`` tokens in a cache that keeps, in each sliding
        layer, only the last ``sliding_window`` tokens (``bytes_per_sequence`` without a window)."""
        per_layer = self.bytes_per_token(dtype) // self.layers
        kept = min(validated_int(context, "context", 0), self.sliding_window or context)
        return per_layer * ((self.layers - self.sliding_layers) * context + self.sliding_layers * kept)


PRESETS: dict[str, KVShape] = {
    shape.name: shape
    for shape in (
        KVShape("Llama-3-8B", 32, 8, 128, "GQA", query_heads=32),
        KVShape("Llama-3-8B-MQA", 32, 1, 128, "MQA", query_heads=32),  # hypothetical variant
        KVShape("Mistral-7B", 32, 8, 128, "GQA", query_heads=32),
        KVShape("LLaMA-7B", 32, 32, 128, "MHA", query_heads=32),
        KVShape.mla("DeepSeek-V3", 61, heads=128, nope_dim=128, rope_dim=64, v_dim=128, latent_dim=512),
        KVShape("SmolLM2-135M", 30, 3, 64, "GQA", query_heads=9),
    )
}


def _preset_key(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch not in "-_ .")


def preset(name: str) -> KVShape:
    """The preset named ``name``, ignoring case and the separators ``- _ .`` and spaces
    ("llama-3-8b", "LLAMA_3_8B"). Raises ValueError listing the presets when none matches."""
    if not isinstance(name, str):
        raise TypeError(f"preset name must be a string, got {type(name).__name__}")
    wanted = _preset_key(name)
    for key, shape in PRESETS.items():
        if _preset_key(key) == wanted:
            return shape
    raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")


def _field(config, *names):
    """The first of ``names`` set (not None) on a config object or dict, else None."""
    for field in names:
        value = config.get(field) if isinstance(config, Mapping) else getattr(config, field, None)
        if value is not None:
            return value
    return None


def _required(config, what: str, *names) -> int:
    value = _field(config, *names)
    if value is None:
        raise ValueError(f"config has no {what} (looked for {', '.join(names)})")
    return validated_int(value, names[0], 1)


def _sliding(config, layers: int) -> tuple[int | None, int]:
    """(sliding window in tokens, layers that use it) of a config, (None, 0) without a window:
    ``sliding_window`` unless ``use_sliding_window`` is false, on the layers ``layer_types`` marks
    "sliding_attention", else all but every ``sliding_window_pattern``-th, else (Gemma 2) every
    other one, else those from ``max_window_layers`` on (Qwen 2), else all."""
    window = _field(config, "sliding_window")
    if not window or _field(config, "use_sliding_window") is False:
        return None, 0
    window = validated_int(window, "sliding_window", 1)
    layer_types = _field(config, "layer_types")
    pattern = _field(config, "sliding_window_pattern")
    start = _field(config, "max_window_layers")
    if layer_types:
        sliding = sum(kind == "sliding_attention" for kind in layer_types)
    elif pattern:
        sliding = layers - layers // validated_int(pattern, "sliding_window_pattern", 1)
    elif _field(config, "model_type") == "gemma2":
        sliding = (layers + 1) // 2
    elif start is not None and _field(config, "use_sliding_window"):
        sliding = max(0, layers - validated_int(start, "max_window_layers", 0))
    else:
        sliding = layers
    return (window, sliding) if sliding else (None, 0)


def _window_fields(config, layers: int) -> dict:
    window, sliding = _sliding(config, layers)
    return dict(sliding_window=window, sliding_layers=sliding)


def from_config(config, name: str | None = None) -> KVShape:
    """Build a KVShape from a transformers config object or a config.json dict.

    Reads ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads`` (default: the
    attention heads), ``head_dim`` (default ``hidden_size // num_attention_heads``), the GPT-2
    names ``n_layer``/``n_head``/``n_embd``, DeepSeek MLA fields (``kv_lora_rank``,
    ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``) and a sliding window (see
    ``_sliding``). A multimodal config's ``text_config`` is used when present. ``name``
    defaults to the config's ``_name_or_path`` or ``model_type``. Missing fields raise ValueError.
    """
    if config is None or isinstance(config, (str, bytes, int, float, os.PathLike)):
        raise TypeError(f"config must be a transformers config or a dict, got {type(config).__name__}")
    if name is None:
        names = (_field(config, key) for key in ("_name_or_path", "name_or_path", "model_type"))
        name = next((str(n) for n in names if n), "model")
    text = _field(config, "text_config")
    if text is not None:
        config = text

    layers = _required(config, "layer count", "num_hidden_layers", "n_layer", "num_layers")
    latent = _field(config, "kv_lora_rank")
    if latent is not None:
        dims = {f: _field(config, f) for f in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
        missing = [f for f, v in dims.items() if v is None]
        if missing:
            raise ValueError(f"MLA config has kv_lora_rank but no {', '.join(missing)}")
        heads = _required(config, "attention head count", "num_attention_heads")
        shape = KVShape.mla(str(name), layers, heads, dims["qk_nope_head_dim"],
                            dims["qk_rope_head_dim"], dims["v_head_dim"], latent)
        return dataclasses.replace(shape, **_window_fields(config, layers))

    query_heads = _required(config, "attention head count", "num_attention_heads", "n_head")
    kv_heads = _field(config, "num_key_value_heads")
    if kv_heads is None and _field(config, "new_decoder_architecture"):
        kv_heads = _field(config, "num_kv_heads")  # Falcon's grouped layout caches its KV groups
    elif kv_heads is None and _field(config, "multi_query"):
        kv_heads = 1  # Falcon's original multi-query layout
    kv_heads = query_heads if kv_heads is None else validated_int(kv_heads, "num_key_value_heads", 1)
    head_dim = _field(config, "head_dim")
    if head_dim is None:
        hidden = _required(config, "hidden size", "hidden_size", "n_embd")
        if hidden % query_heads:
            raise ValueError(f"hidden size {hidden} is not divisible by {query_heads} attention heads")
        head_dim = hidden // query_heads
    attention = classify_attention(query_heads, kv_heads)
    return KVShape(str(name), layers, kv_heads, validated_int(head_dim, "head_dim", 1), attention,
                   query_heads=query_heads, **_window_fields(config, layers))


def from_model_dir(path: str | os.PathLike) -> KVShape:
    """KVShape of a local Hugging Face model directory (its config.json) or of a config.json file,
    named after the directory. Raises ValueError when the file is missing or is not JSON."""
    path = Path(path)
    config_file = path if path.is_file() else path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"no config.json at {path}")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_file} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} does not hold a JSON object")
    return from_config(config, name=config_file.resolve().parent.name)
