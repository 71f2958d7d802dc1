"""Shared pieces of the structured-output tests: a tiny model over the embedded tokenizer's
vocabulary, the grammar compiler for it, and hypothesis strategies of bounded JSON schemas drawn
together with an instance of each (so a scripted model can be made to write a valid document)."""

from __future__ import annotations

import json
from functools import lru_cache

from hypothesis import strategies as st

from serve_helpers import embedded_tokenizer, scripted_llama_class

EOS = 2
SEPARATORS = (", ", ": ")


@lru_cache(maxsize=1)
def scripted_model():
    """A tiny random ``ScriptedLlama`` (seed 0) whose vocabulary is the embedded tokenizer's."""
    import torch
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=len(embedded_tokenizer()), hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=2048, bos_token_id=1, eos_token_id=EOS)
    torch.manual_seed(0)
    model = scripted_llama_class()(config).eval()
    model.script = {}
    return model


@lru_cache(maxsize=1)
def grammars():
    """The server's grammar compiler for the embedded tokenizer (EOS stops every grammar)."""
    from radixcache.integrations.serve.requests.structured import Grammars

    tokenizer = embedded_tokenizer()
    return Grammars(tokenizer, len(tokenizer), {EOS})


def dumps(value) -> str:
    """JSON text as the grammars write it: no free whitespace, ", " and ": " separators."""
    return json.dumps(value, separators=SEPARATORS, ensure_ascii=False)


NAMES = st.text("abcdefghij_", min_size=1, max_size=6)
SHORT_TEXT = st.text("abcdefgh XYZ", max_size=4)


@st.composite
def leaf(draw):
    """``(schema, instance)`` of a bounded scalar: every document of the schema is short."""
    kind = draw(st.sampled_from(["integer", "boolean", "enum", "string", "null"]))
    if kind == "integer":
        low = draw(st.integers(-50, 50))
        high = low + draw(st.integers(0, 60))
        return {"type": "integer", "minimum": low, "maximum": high}, draw(st.integers(low, high))
    if kind == "boolean":
        return {"type": "boolean"}, draw(st.booleans())
    if kind == "enum":
        options = draw(st.lists(SHORT_TEXT, min_size=1, max_size=3, unique=True))
        return {"enum": options}, draw(st.sampled_from(options))
    if kind == "string":
        most = draw(st.integers(0, 5))
        return {"type": "string", "maxLength": most}, draw(st.text("abcxyz", max_size=most))
    return {"type": "null"}, None


@st.composite
def value_schema(draw, depth=0):
    """``(schema, instance)``: a leaf, a short array of one leaf schema, or (at ``depth`` 0) an object."""
    choice = draw(st.integers(0, 4 if depth < 1 else 3))
    if choice == 3:
        item, value = draw(leaf())
        most = draw(st.integers(0, 2))
        return {"type": "array", "items": item, "maxItems": most}, [value] * draw(st.integers(0, most))
    if choice == 4:
        return draw(object_schema(depth + 1))
    return draw(leaf())


@st.composite
def object_schema(draw, depth=0):
    """``(schema, instance)`` of a closed object with 1 to 3 properties, some optional; the
    instance lists its keys in the schema's order (the order the grammar writes them)."""
    names = draw(st.lists(NAMES, min_size=1, max_size=3, unique=True))
    properties, instance, required = {}, {}, []
    for name in names:
        schema, value = draw(value_schema(depth))
        properties[name] = schema
        needed = draw(st.booleans())
        if needed:
            required.append(name)
        if needed or draw(st.booleans()):
            instance[name] = value
    return {"type": "object", "properties": properties, "required": required}, instance


@st.composite
def tool_set(draw):
    """``(tools, calls)``: 1 to 3 OpenAI function tools with object parameter schemas, and one
    valid call ``(name, arguments)`` of each."""
    names = draw(st.lists(NAMES, min_size=1, max_size=3, unique=True))
    tools, calls = [], []
    for name in names:
        params, arguments = draw(object_schema(1))
        tools.append({"type": "function", "function": {"name": name, "parameters": params}})
        calls.append((name, arguments))
    return tools, calls
