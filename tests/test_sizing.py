"""KV-bytes calculator: the documented numbers (Llama-3-8B in bf16: 128 KiB per token), config
parsing, formatting and errors."""

import json
import subprocess
import sys

import pytest

from radixcache.app.kv_size import DTYPE_BYTES, PRESETS, KVShape, from_config, from_model_dir, preset
from radixcache.app.kv_size_table import format_bytes, kv_size_table, render_kv_table

KIB, MIB, GIB = 1024, 1024**2, 1024**3


def test_llama3_8b_bf16_is_128_kib_per_token():
    shape = preset("Llama-3-8B")
    assert shape.bytes_per_token("bf16") == 2 * 32 * 8 * 128 * 2 == 131_072 == 128 * KIB
    assert shape.attention == "GQA"


def test_llama_7b_mha_fp16_and_a_2048_token_conversation():
    shape = preset("LLaMA-7B")
    assert shape.attention == "MHA"
    assert shape.bytes_per_token("fp16") == 524_288
    assert shape.bytes_per_sequence(2048, "fp16") == GIB


def test_mistral_7b_2048_tokens_is_256_mib():
    assert preset("Mistral-7B").bytes_per_sequence(2048, "fp16") == 256 * MIB


@pytest.mark.parametrize("name", list(PRESETS))
def test_fp8_halves_every_variant_and_fp32_doubles(name):
    shape = PRESETS[name]
    assert shape.bytes_per_token("fp8") * 2 == shape.bytes_per_token("bf16") == shape.bytes_per_token("fp16")
    assert shape.bytes_per_token("fp32") == 2 * shape.bytes_per_token("bf16")


def test_mqa_variant_has_one_kv_head():
    shape = preset("llama-3-8b-mqa")
    assert (shape.kv_heads, shape.attention) == (1, "MQA")
    assert shape.bytes_per_token("bf16") == 16 * KIB
    assert preset("Llama-3-8B").bytes_per_token("bf16") == 8 * shape.bytes_per_token("bf16")


def test_mla_deepseek_v3_counts_the_expanded_per_head_k_and_v_the_pool_holds():
    """transformers expands DeepSeek-V3's latent into 128 heads of K (128 nope + 64 rope) and V
    (128) before attention; that is what radixcache's pool stores, and what kv-size counts. The
    latent an MLA-native server caches goes through the same formula: one 512 "K" and one 64 "V"."""
    shape = preset("deepseek-v3")
    assert shape.attention == "MLA"
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.head_dim_v) == (61, 128, 192, 128)
    assert (shape.latent_dim, shape.rope_dim) == (512, 64)
    assert shape.bytes_per_token("bf16") == 61 * 128 * (192 + 128) * 2 == 4_997_120
    assert shape.bytes_per_token("fp8") == 61 * 128 * 320
    assert shape.latent_bytes_per_token("bf16") == 61 * (512 + 64) * 2
    with pytest.raises(ValueError, match="not MLA"):
        preset("Llama-3-8B").latent_bytes_per_token()


def test_kv_bytes_per_token_counts_k_and_v_head_dims_apart():
    from radixcache.kv.geometry import kv_bytes_per_token

    assert kv_bytes_per_token(2, 4, 24, 12, 4) == 2 * 4 * 36 * 4
    assert kv_bytes_per_token(32, 8, 128, 128, 2) == 2 * 32 * 8 * 128 * 2


def test_smollm2_preset():
    shape = preset("SmolLM2-135M")
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.attention) == (30, 3, 64, "GQA")
    assert shape.bytes_per_token("bf16") == 2 * 30 * 3 * 64 * 2


def test_batch_bytes_scale_with_sequences_and_context():
    shape = preset("Llama-3-8B")
    assert shape.bytes_for(4, 8192, "bf16") == 4 * 8192 * 131_072 == 4 * GIB
    assert shape.bytes_for(0, 8192, "bf16") == 0


def test_preset_lookup_ignores_case_and_separators():
    assert preset("LLAMA-3-8B") is preset("llama_3_8b") is PRESETS["Llama-3-8B"]
    assert preset("llama-7b") is PRESETS["LLaMA-7B"]


def test_unknown_preset_and_bad_dtype_raise_value_error():
    with pytest.raises(ValueError, match="unknown preset 'gpt-5'.*Llama-3-8B"):
        preset("gpt-5")
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        preset("Llama-3-8B").bytes_per_token("int3")
    with pytest.raises(TypeError, match="dtype"):
        preset("Llama-3-8B").bytes_per_token(2)
    assert preset("Llama-3-8B").bytes_per_token("BF16") == 131_072


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="x", layers=0, kv_heads=1, head_dim=1, attention="MQA"), "layers"),
    (dict(name="x", layers=1, kv_heads=1, head_dim=1, attention="XYZ"), "attention"),
    (dict(name="x", layers=1, kv_heads=2, head_dim=1, attention="MQA"), "MQA"),
    (dict(name="x", layers=1, kv_heads=4, head_dim=1, attention="GQA", query_heads=4), "GQA"),
    (dict(name="x", layers=1, kv_heads=2, head_dim=1, attention="MHA", query_heads=4), "MHA"),
    (dict(name="x", layers=1, kv_heads=1, head_dim=8, attention="MLA"), "latent_dim"),
    (dict(name="x", layers=1, kv_heads=1, head_dim=8, attention="MLA", latent_dim=4, rope_dim=8), "qk_rope"),
    (dict(name="x", layers=1, kv_heads=2, head_dim=8, attention="GQA", head_dim_v=4), "only to MLA"),
    (dict(name="x", layers=1, kv_heads=2, head_dim=8, attention="GQA", latent_dim=4), "latent_dim"),
])
def test_inconsistent_shapes_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVShape(**kwargs)


def test_non_int_fields_and_counts_raise_type_error():
    with pytest.raises(TypeError, match="layers"):
        KVShape("x", 1.5, 1, 64, "MQA")
    with pytest.raises(TypeError, match="context"):
        preset("Llama-3-8B").bytes_per_sequence("8192", "bf16")
    with pytest.raises(ValueError, match="sequences"):
        preset("Llama-3-8B").bytes_for(-1, 8, "bf16")


def test_from_config_tiny_llama_gqa():
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=100)
    shape = from_config(config)
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.attention) == (2, 2, 16, "GQA")
    assert shape.name == "llama"
    assert shape.bytes_per_token("fp32") == 2 * 2 * 2 * 16 * 4


def test_from_config_llama_without_kv_heads_is_mha_and_with_one_is_mqa():
    from transformers import LlamaConfig

    assert from_config(LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4)).attention == "MHA"
    mqa = LlamaConfig(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=1)
    assert from_config(mqa).attention == "MQA"


def test_from_config_gpt2_names():
    from transformers import GPT2Config

    shape = from_config(GPT2Config(n_layer=3, n_embd=96, n_head=6), name="tiny-gpt2")
    assert (shape.name, shape.layers, shape.kv_heads, shape.head_dim, shape.attention) == \
        ("tiny-gpt2", 3, 6, 16, "MHA")


def test_from_config_dicts_including_explicit_head_dim_and_gpt2_names():
    qwen_like = {"model_type": "qwen3", "num_hidden_layers": 28, "hidden_size": 1024,
                 "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128}
    shape = from_config(qwen_like)
    assert (shape.name, shape.kv_heads, shape.head_dim, shape.attention) == ("qwen3", 8, 128, "GQA")
    gpt2 = from_config({"n_layer": 12, "n_head": 12, "n_embd": 768})
    assert (gpt2.layers, gpt2.kv_heads, gpt2.head_dim) == (12, 12, 64)
    assert gpt2.bytes_per_token("fp16") == 2 * 12 * 12 * 64 * 2


def test_from_config_deepseek_mla_dict_matches_preset():
    config = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128,
              "num_key_value_heads": 128, "hidden_size": 7168, "kv_lora_rank": 512,
              "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
    shape = from_config(config)
    assert shape.attention == "MLA"
    assert shape.bytes_per_token("bf16") == preset("DeepSeek-V3").bytes_per_token("bf16")
    assert (shape.head_dim, shape.head_dim_v, shape.kv_heads) == (192, 128, 128)


def test_from_config_falcon_kv_heads():
    """A Falcon config.json: the new decoder architecture caches its ``num_kv_heads`` KV groups
    (transformers >= 5.25; every query head when it has none), the original multi-query layout one
    head, the multi-head one every head; the config object agrees with the dict."""
    import transformers as tf

    base = {"model_type": "falcon", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    layouts = [(dict(new_decoder_architecture=True, num_kv_heads=2), 2),
               (dict(new_decoder_architecture=True), 4),
               (dict(new_decoder_architecture=False, multi_query=True), 1),
               (dict(new_decoder_architecture=False, multi_query=False), 4)]
    for fields, kv_heads in layouts:
        assert from_config(dict(base, **fields)).kv_heads == kv_heads, fields
        config = tf.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, **fields)
        assert from_config(config).kv_heads == kv_heads, fields


def test_from_config_rejects_missing_fields_and_wrong_types():
    with pytest.raises(ValueError, match="layer count"):
        from_config({"num_attention_heads": 4, "hidden_size": 64})
    with pytest.raises(ValueError, match="not divisible"):
        from_config({"num_hidden_layers": 2, "num_attention_heads": 5, "hidden_size": 64})
    with pytest.raises(ValueError, match="exceed"):
        from_config({"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 8,
                     "hidden_size": 64})
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        from_config({"num_hidden_layers": 2, "kv_lora_rank": 512})
    with pytest.raises(TypeError, match="config"):
        from_config("config.json")


def test_from_model_dir_reads_config_json(tmp_path):
    model_dir = tmp_path / "tiny-model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1, "hidden_size": 32}))
    shape = from_model_dir(model_dir)
    assert (shape.name, shape.attention, shape.head_dim) == ("tiny-model", "MQA", 8)
    with pytest.raises(ValueError, match="no config.json"):
        from_model_dir(tmp_path / "missing")


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1 KiB"), (131_072, "128 KiB"), (1536 * KIB, "1.5 MiB"),
    (GIB, "1 GiB"), (70_272, "68.62 KiB"), (3 * 1024 * GIB, "3 TiB"), (2**60, "1 EiB"),
])
def test_format_bytes_binary_units(n, text):
    assert format_bytes(n) == text


def test_format_bytes_rejects_bad_input():
    with pytest.raises(ValueError):
        format_bytes(-1)
    with pytest.raises(TypeError):
        format_bytes(1.5)


def test_kv_size_table_rows_and_rendering():
    rows = kv_size_table([preset("Llama-3-8B"), preset("DeepSeek-V3")], context=2048, sequences=3,
                         dtypes=["bf16", "fp8"])
    assert [(r["name"], r["dtype"]) for r in rows] == [
        ("Llama-3-8B", "bf16"), ("Llama-3-8B", "fp8"), ("DeepSeek-V3", "bf16"), ("DeepSeek-V3", "fp8")]
    first = rows[0]
    assert first["bytes_per_token"] == 131_072
    assert first["bytes_per_sequence"] == 2048 * 131_072
    assert first["bytes_total"] == 3 * 2048 * 131_072
    text = render_kv_table(rows)
    lines = text.splitlines()
    assert len(lines) == 2 + len(rows)
    assert "131,072" in lines[2] and "128 KiB" in lines[2] and "GQA" in lines[2]
    assert "MLA" in lines[4]


def test_kv_size_table_accepts_single_shape_and_dtype_and_rejects_garbage():
    rows = kv_size_table(preset("Mistral-7B"), 2048, 1, "fp16")
    assert len(rows) == 1 and rows[0]["bytes_per_sequence"] == 256 * MIB
    with pytest.raises(TypeError):
        kv_size_table(["Mistral-7B"], 2048)
    with pytest.raises(ValueError):
        kv_size_table(preset("Mistral-7B"), 2048, dtypes=["int4"])


def test_dtype_table_is_the_documented_one():
    assert DTYPE_BYTES == {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def test_sizing_import_stays_light():
    code = ("import sys, radixcache.app.kv_size, radixcache.app.cli; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_sequences_that_fit_and_the_memory_column():
    from radixcache.app.kv_size_table import sequences_that_fit

    assert sequences_that_fit(preset("Llama-3-8B"), 65 * GIB, 8192, "bf16") == 65
    assert sequences_that_fit(preset("LLaMA-7B"), 65 * GIB, 8192, "bf16") == 16
    assert sequences_that_fit(preset("LLaMA-7B"), 65 * GIB, 8192, "fp8") == 32
    assert sequences_that_fit(preset("LLaMA-7B"), 64 * GIB - 1, 131_072, "bf16") == 0
    assert sequences_that_fit(preset("LLaMA-7B"), 64 * GIB, 131_072, "bf16") == 1
    with pytest.raises(ValueError):
        sequences_that_fit(preset("LLaMA-7B"), -1, 8192)
    with pytest.raises(ValueError):
        sequences_that_fit(preset("LLaMA-7B"), GIB, 0)
    rows = kv_size_table(preset("Llama-3-8B"), 8192, dtypes="bf16", memory=65 * GIB)
    assert (rows[0]["memory"], rows[0]["fits"]) == (65 * GIB, 65)
    header = render_kv_table(rows).splitlines()[0]
    assert header.split()[-4:] == ["fit", "in", "65", "GiB"]
    assert "fits" not in kv_size_table(preset("Llama-3-8B"), 8192)[0]


@pytest.mark.parametrize("config, window", [
    (dict(sliding_window=4096), (4096, 2)),
    (dict(sliding_window=4096, use_sliding_window=False), (None, 0)),
    (dict(sliding_window=None), (None, 0)),
    (dict(sliding_window=512, layer_types=["sliding_attention", "full_attention"]), (512, 1)),
    (dict(sliding_window=512, layer_types=["full_attention", "full_attention"]), (None, 0)),
    (dict(sliding_window=1024, sliding_window_pattern=2), (1024, 1)),
    (dict(sliding_window=1024, model_type="gemma2"), (1024, 1)),
    (dict(sliding_window=1024, use_sliding_window=True, max_window_layers=1), (1024, 1)),
])
def test_from_config_reads_the_sliding_window(config, window):
    base = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64}
    shape = from_config({**base, **config})
    assert (shape.sliding_window, shape.sliding_layers) == window


def test_a_window_caps_only_its_layers_and_never_the_table():
    shape = KVShape("w", 4, 2, 16, "GQA", sliding_window=100, sliding_layers=3)
    per_layer = 2 * 2 * 16 * 2  # K and V, bf16
    assert shape.bytes_per_sequence(1000) == 4 * per_layer * 1000  # radixcache keeps every token
    assert shape.windowed_bytes_per_sequence(1000) == per_layer * (1 * 1000 + 3 * 100)
    assert shape.windowed_bytes_per_sequence(50) == shape.bytes_per_sequence(50)
    assert preset("Llama-3-8B").windowed_bytes_per_sequence(8192) == preset("Llama-3-8B").bytes_per_sequence(8192)


@pytest.mark.parametrize("kwargs", [dict(sliding_window=0, sliding_layers=1),
                                    dict(sliding_window=8, sliding_layers=0),
                                    dict(sliding_window=8, sliding_layers=5),
                                    dict(sliding_layers=1)])
def test_inconsistent_windows_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        KVShape("w", 4, 2, 16, "GQA", **kwargs)
