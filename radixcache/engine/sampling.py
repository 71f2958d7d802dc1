"""Next-token choice for the engine: greedy, or temperature / top-p sampling with a per-sequence RNG."""

from __future__ import annotations

import torch


def check_sampling(do_sample: bool, temperature: float, top_p: float) -> None:
    """Raise ``ValueError`` for settings that do not define a distribution."""
    if not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be a bool, got {do_sample!r}")
    if do_sample and not temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def nucleus_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The temperature-scaled distribution over ``logits [vocab]`` restricted to the smallest top-p
    nucleus (unnormalised is fine for ``draw``), on the CPU."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs[before >= top_p] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs.cpu()


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id drawn from ``probs`` with ``generator`` (each sample has its own)."""
    return int(torch.multinomial(probs, 1, generator=generator))
