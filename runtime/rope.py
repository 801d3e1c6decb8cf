"""Rotary position embeddings (RoPE), rotate-half layout, as in Hugging Face Llama / Mistral / Qwen2.

Angles are computed in fp32 whatever the model dtype; cos/sin are then cast to the activation dtype, as
transformers does, so fp32 runs match it to rounding and bf16/fp16 runs round the same way.
"""

from __future__ import annotations

import math

import torch

from plugins.rowwise import native as rowwise
from runtime.config import ModelConfig, RopeScaling
from runtime.errors import ConfigError


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """# [head_dim // 2] float32 on CPU: theta^(-2i/head_dim), then the configured scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        # Position interpolation: angle(p) = p / factor * f, folded into the frequencies.
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    raise ConfigError(f"unsupported rope scaling type {scaling.rope_type!r}")


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling (same arithmetic, same order as transformers).

    Wavelengths shorter than original_max / high_freq_factor are kept; longer than original_max /
    low_freq_factor are divided by `factor`; in between, interpolated linearly in original_max / wavelength.
    """
    assert s.low_freq_factor is not None and s.high_freq_factor is not None
    assert s.original_max_position_embeddings is not None
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """positions -> (cos, sin), each # [B, N, head_dim], computed in float32, returned in `dtype`."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None) -> None:
        super().__init__()
        # Built on CPU explicitly so the module can be created under a meta-device context; moved by .to().
        self.register_buffer("inv_freq", inverse_frequencies(head_dim, theta, scaling), persistent=False)

    @classmethod
    def from_config(cls, config: ModelConfig) -> RotaryEmbedding:
        return cls(config.head_dim, config.rope_theta, config.rope_scaling)

    def forward(self, positions: torch.Tensor,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        # positions  # [B, N] int64
        angles = positions.to(torch.float32)[..., None] * self.inv_freq.to(positions.device)  # [B, N, D/2]
        angles = torch.cat([angles, angles], dim=-1)  # [B, N, D]: rotate-half layout pairs i with i + D/2
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    # x  # [..., D] -> [-x2, x1] with x1, x2 the two halves
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x # [B, H, N, D]; cos, sin # [B, N, D] (cast to x's dtype if they are not in it) -> rotated x in x's dtype."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    out = rowwise.rope(x, cos, sin)  # one native call on CPU, bit-identical (plugins/rowwise/native.py)
    if out is not None:
        return out
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, N, D]
    return x * cos + rotate_half(x) * sin


__all__ = ["inverse_frequencies", "RotaryEmbedding", "rotate_half", "apply_rope"]
