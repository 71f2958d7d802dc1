"""Problem 9 of issue 8: an explicit, deterministic model identity, and invalidate() after weights
change, so K/V of other weights is never served."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import radixcache
from radixcache.integrations.hf import model_identity
from tiny_models import random_ids, tiny_model

BS = 4
TESTS = Path(__file__).resolve().parent


def plain(model, ids, **kw):
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **kw)


def test_same_weights_same_id_in_another_process():
    """The id depends on the weights only: a deep copy and a fresh process agree."""
    model = tiny_model("llama")
    here = model_identity(model)
    assert model_identity(copy.deepcopy(model)) == here
    code = (f"import sys; sys.path.insert(0, {str(TESTS)!r}); from tiny_models import tiny_model; "
            "from radixcache.integrations.hf import model_identity; "
            "print(model_identity(tiny_model('llama')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == here


def test_other_weights_other_id_and_no_shared_namespace():
    """Different weights or dtype give different ids, so their namespaces never meet."""
    a, b = tiny_model("llama"), tiny_model("llama", seed=1)
    ids = {model_identity(a), model_identity(b), model_identity(copy.deepcopy(a).to(torch.bfloat16))}
    assert len(ids) == 3
    la = radixcache.wrap(a, block_size=BS, max_cache_tokens=256)
    lb = radixcache.wrap(b, block_size=BS, max_cache_tokens=256)
    assert la.namespace() != lb.namespace() and la.namespace()[0] == la.model_id


def test_model_id_can_be_set():
    """wrap(model, model_id=...) names the weights explicitly; it roots every namespace."""
    lm = radixcache.wrap(tiny_model("llama"), block_size=BS, max_cache_tokens=256, model_id="tiny@v1")
    assert lm.model_id == "tiny@v1" and lm.namespace("alice") == ("tiny@v1", "alice")
    ids = random_ids(9, 1)
    lm.generate(ids, max_new_tokens=2)
    assert lm.cache.match(ids[0].tolist(), ("tiny@v1", None)).length == 8
    with pytest.raises(TypeError):
        radixcache.wrap(tiny_model("llama"), max_cache_tokens=256, model_id="")


def test_weights_changed_in_place_then_invalidate_never_serves_stale_kv():
    """After loading other weights into the wrapped model, invalidate() drops the old K/V: the
    same prompt hits nothing and equals plain generate with the new weights."""
    model = tiny_model("llama")
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=1024)
    ids = random_ids(25, 2)
    lm.generate(ids, max_new_tokens=4)
    old = lm.model_id
    model.load_state_dict(tiny_model("llama", seed=3).state_dict())
    lm.invalidate()
    assert lm.model_id != old and lm.stats()["cached_tokens"] == 0
    lm.reset_stats()
    assert torch.equal(lm.generate(ids, max_new_tokens=4), plain(model, ids, max_new_tokens=4))
    assert lm.stats()["hit_tokens"] == 0
    assert lm.generate_batch([ids[0].tolist()], max_new_tokens=4)[0][0] == \
        plain(model, ids, max_new_tokens=4)[0, 25:].tolist()


def test_invalidate_after_a_change_the_sample_cannot_see():
    """A weight edit between the sampled entries leaves the digest alone; invalidate() still moves
    to a new (process-local) id, so the old K/V is never served."""
    model = tiny_model("llama")
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=512)
    ids = random_ids(17, 4)
    lm.generate(ids, max_new_tokens=2)
    old = lm.model_id
    with torch.no_grad():
        model.model.embed_tokens.weight[ids[0, 0], 1] += 5.0  # entry 1 of a row: not sampled
    assert model_identity(model) == old
    lm.invalidate()
    assert lm.model_id != old and lm.model_id.startswith(old)
    lm.reset_stats()
    assert torch.equal(lm.generate(ids, max_new_tokens=3), plain(model, ids, max_new_tokens=3))
    assert lm.stats()["hit_tokens"] == 0
    lm.invalidate(model_id="tiny@v2")
    assert lm.model_id == "tiny@v2"


def test_kv_geometry_of_a_config_without_attention_heads_names_it():
    """Mamba's config has no attention heads: a ValueError that says so, not an AttributeError."""
    import transformers as tf

    from radixcache.integrations.hf.identity import kv_geometry

    with pytest.raises(ValueError, match="MambaConfig has no attention heads"):
        kv_geometry(tf.MambaConfig(hidden_size=64, num_hidden_layers=2))
    assert kv_geometry(tiny_model("llama").config) == (2, 2, 16, 16)


def test_a_model_without_attention_heads_gets_an_identity():
    """The digest needs no attention geometry (a Mamba wrapper still roots its namespaces)."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.MambaForCausalLM(tf.MambaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                               state_size=4))
    lm = radixcache.wrap(model)
    assert lm.model_id == model_identity(model) and lm.namespace("t") == (lm.model_id, "t")
