"""LayerScales: the fp8 (e4m3) K and V scales of a pool's layers, and the one lock that orders them.

A layer's scales are calibrated on the first K/V written to it (its absolute maximum, with
``FP8_HEADROOM`` to spare) or adopted from a stored block's, and fixed from then on, since the
blocks already written were quantized with them. They live on the device (``device_scales``, read
by the torch backend without a sync) and in a host mirror (``host``, passed to FlashInfer as
floats); calibrating a layer costs one device-to-host read, once. Later K/V beyond a layer's range
are clamped to it; ``clamped_writes`` counts the writes where that happened.

``lock`` orders everything that sets a layer's scales (a first write calibrating, an import adopting
a stored block's scales, a reset) against everything that decides on them (imports, exports): a
layer's scales are set exactly once, device first, host mirror second, so a writer that sees the
mirror set finds the device scales set, and a block is never quantized with one scale and read with
another.
"""

from __future__ import annotations

import threading

import torch

from radixcache.kv.payload import FP8_MAX

FP8_HEADROOM = 4.0  # calibration puts the first write's amax at FP8_MAX / FP8_HEADROOM


class LayerScales:
    """Per layer a K and a V scale (float32), unset (0.0) until calibrated or adopted."""

    def __init__(self, num_layers: int, device):
        self.num_layers = num_layers
        self.device_scales = torch.zeros(num_layers, 2, dtype=torch.float32, device=device)
        self._host: list = [None] * num_layers  # (k, v) floats once the layer's scales are set
        self._clamped = torch.zeros(num_layers, 2, dtype=torch.int64, device=device)
        self.lock = threading.Lock()

    def host(self, layer: int) -> tuple[float, float]:
        """The (K, V) scales of ``layer`` as host floats, (0.0, 0.0) while unset."""
        return self._host[layer] or (0.0, 0.0)

    def current(self) -> list:
        """Per layer its (K, V) pair, or None while unset (a copy; hold ``lock`` to act on it)."""
        return list(self._host)

    def calibrated_layers(self) -> int:
        """How many layers have their scales set."""
        return sum(pair is not None for pair in self._host)

    def ensure(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Calibrate ``layer`` on ``keys`` and ``values`` unless its scales are set (by then, or
        meanwhile by an import on another thread: the check is repeated under ``lock``)."""
        if self._host[layer] is None:
            with self.lock:
                if self._host[layer] is None:
                    self.calibrate(layer, keys, values)

    def calibrate(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Set ``layer``'s scales from its first real K/V (one host read); the caller holds ``lock``."""
        amax = torch.stack([keys.detach().abs().amax(), values.detach().abs().amax()]).float().tolist()
        self.adopt(layer, [max(a * FP8_HEADROOM / FP8_MAX, 1e-8) for a in amax])

    def adopt(self, layer: int, pair) -> None:
        """Set ``layer``'s (K, V) scales to ``pair``: the device scales, then their host mirror,
        equal to the last bit (float32). The caller holds ``lock``."""
        exact = torch.tensor(list(pair), dtype=torch.float32)
        self.device_scales[layer].copy_(exact)
        self._host[layer] = tuple(exact.tolist())

    def reset(self) -> None:
        """Forget every scale and the clamp counts: the next write to each layer calibrates it again."""
        with self.lock:
            self._host = [None] * self.num_layers
            self.device_scales.zero_()
            self._clamped.zero_()

    def clamped_writes(self) -> int:
        """Writes (per layer, K and V counted apart) clamped to the range; reads a device value."""
        return int(self._clamped.sum())

    def quantize(self, layer: int, kv: int, x: torch.Tensor) -> torch.Tensor:
        """``x`` (K for ``kv`` 0, V for 1) in ``layer``'s scale as fp8 bytes (uint8), clamped to
        the range (and counted when it had to be); the layer's scales must be set."""
        scaled = x.float() / self.device_scales[layer, kv]
        self._clamped[layer, kv] += scaled.abs().amax() > FP8_MAX
        return scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)

    def dequantize(self, layer: int, kv: int, q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """fp8 bytes ``q`` of ``layer``'s K (``kv`` 0) or V (1) back in ``dtype``."""
        return (q.view(torch.float8_e4m3fn).to(torch.float32) * self.device_scales[layer, kv]).to(dtype)
