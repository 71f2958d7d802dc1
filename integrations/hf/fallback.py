"""Plain transformers for the ``lm.generate`` calls the paged path cannot serve.

``passed_cache_reason`` decides whether the caches a call passed keep it on the paged path (only a
``PagedCache`` of the same wrapper does); ``plain_generate`` runs ``model.generate`` without
prefix caching, records the reason in the manager's ledger (``fallbacks`` in ``stats()``) and
warns once per reason on the ``radixcache`` logger.
"""

from __future__ import annotations

import logging

import torch

from radixcache.integrations.hf.cache import PagedCache

logger = logging.getLogger("radixcache")


def passed_cache_reason(passed: list, owner) -> str | None:
    """Why the caches in ``passed`` (from ``passed_caches``) send the call to plain generate, or
    None when there are none or each is a ``PagedCache`` of ``owner`` (released when its call
    returned: the tree holds its prefix). ``ValueError`` for a ``PagedCache`` of another wrapper."""
    for cache in passed:
        if isinstance(cache, PagedCache):
            if cache.owner is not owner:
                raise ValueError("this PagedCache belongs to another radixcache wrapper; "
                                 "pass it to the lm.generate that returned it")
            continue  # ours, released when its call returned: the tree holds its prefix
        return "caller passed its own cache"
    return None


def plain_generate(model, manager, reason: str, kwargs: dict, passed: list, warned: set):
    """``model.generate(**kwargs)`` under ``torch.no_grad()``, with the caller's own cache (the
    first of ``passed`` that is not a ``PagedCache``) as ``cache=``. Records ``reason`` with
    ``manager.record_fallback``; warns when ``reason`` is not in ``warned`` yet (and adds it)."""
    manager.record_fallback(reason)
    if reason not in warned:
        warned.add(reason)
        logger.warning("radixcache: %s; using plain model.generate (no prefix caching)", reason)
    own = [c for c in passed if not isinstance(c, PagedCache)]
    if own:
        kwargs["cache"] = own[0]  # transformers' name (past_key_values is deprecated)
    with torch.no_grad():
        return model.generate(**kwargs)
