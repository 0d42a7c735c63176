"""Hidden states to the store's dtype and back.

bfloat16 and float32 are stored as they are. float8 (e4m3) keeps one float32 scale per row
(token): each row is divided by its largest magnitude over the format's largest finite value
(448) before the cast, so every token uses the format's full range whatever its norm.
"""

from __future__ import annotations

import torch

__all__ = ["decode", "encode"]

_FP8 = torch.float8_e4m3fn
_FP8_MAX = float(torch.finfo(_FP8).max)


def encode(rows: torch.Tensor, storage_dtype: str) -> dict[str, torch.Tensor]:
    """``rows`` [N, D] as stored: ``{"values": ...}``, plus ``"scale"`` [N] for float8."""
    if storage_dtype != "float8_e4m3fn":
        return {"values": rows.to(getattr(torch, storage_dtype)).contiguous()}
    wide = rows.float()
    scale = wide.abs().amax(dim=-1).clamp_min(1e-12) / _FP8_MAX
    return {"values": (wide / scale[:, None]).to(_FP8).contiguous(), "scale": scale.contiguous()}


def decode(values: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows back in the compute ``dtype``."""
    if scale is None:
        return values.to(dtype)
    return (values.float() * scale[:, None]).to(dtype)
