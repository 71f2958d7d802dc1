"""One attention path: generate and the engine both attend through the backend over the block
tables; transformers builds no mask for those forwards, while every other forward keeps the
model's own attention and masks."""

import pytest
import torch
from transformers import masking_utils

import radixcache
from radixcache.attention.torch_backend import TorchBackend
from tiny_models import random_ids, tiny_model

BS = 4


@pytest.fixture(scope="module")
def model():
    return tiny_model("mistral")  # sliding window: both mask builders run for plain forwards


class Counting(TorchBackend):
    """The torch backend, counting its per-layer calls and the query rows it attends."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.rows = 0

    def attend(self, layer, query, plan, scale, sliding_window=None, softcap=None):
        self.calls += 1
        self.rows += query.shape[0]
        return super().attend(layer, query, plan, scale, sliding_window, softcap)


def count_calls(monkeypatch, module, name):
    calls = {"n": 0}
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls["n"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_generate_attends_through_the_backend_and_builds_no_mask(model, monkeypatch):
    """Every layer of every forward of lm.generate goes through the backend; the mask functions
    are never asked for a mask; plain model.generate still builds its masks and is unchanged."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=1024)
    lm.backend = Counting()
    name = model.config._attn_implementation
    mask_fn = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS[name]
    built = {"n": 0}

    def counting_mask(*args, **kwargs):
        out = mask_fn(*args, **kwargs)
        built["n"] += out is not None
        return out

    monkeypatch.setitem(masking_utils.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, name, counting_mask)
    ids = random_ids(30, 1)
    got = lm.generate(ids, max_new_tokens=5, do_sample=False)
    # one prefill forward + 4 decode forwards, 2 layers each; the query rows are the real tokens
    assert lm.backend.calls == 5 * 2 and lm.backend.rows == (30 + 4) * 2
    assert built["n"] == 0
    want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    assert torch.equal(got, want) and built["n"] > 0


def test_padded_rows_attend_only_their_real_tokens(model):
    """Left padding and cached columns are in no segment: only real uncached query rows reach the
    backend, and the padded batch still equals plain generate."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=1024)
    lm.backend = Counting()
    rows = [random_ids(9, 2)[0].tolist(), random_ids(14, 3)[0].tolist()]
    ids = torch.tensor([[0] * 5 + rows[0], rows[1]])
    mask = torch.tensor([[0] * 5 + [1] * 9, [1] * 14])
    got = lm.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False)
    assert lm.backend.rows == (9 + 14 + 2 * 2) * 2
    assert torch.equal(got, model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False))


def test_engine_steps_skip_transformers_mask_building(model, monkeypatch):
    """The engine's packed forwards never run transformers' packed-sequence detection or a mask
    builder (nothing would read them)."""
    lm = radixcache.wrap(model, block_size=BS, max_cache_tokens=1024)
    packed = count_calls(monkeypatch, masking_utils, "find_packed_sequence_indices")
    prompts = [random_ids(10 + i, 4 + i)[0].tolist() for i in range(3)]
    out = lm.generate_batch(prompts, max_new_tokens=3)
    assert packed["n"] == 0
    for p, o in zip(prompts, out):
        ids = torch.tensor([p])
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                              do_sample=False)[0, len(p):].tolist()
        assert o[0] == want
