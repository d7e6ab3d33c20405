"""DAPO's overlong reward shaping ("soft overlong punishment", Yu et al., arXiv 2503.14476, eq. 13).

Added to the scalar reward of each response of length |y| before advantages are computed, with
L_max = model.max_response_tokens and L_cache = buffer_len:
    R_length(y) = 0                                       if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache     if L_max - L_cache < |y| <= L_max
                = -1                                      if |y| > L_max
times penalty_factor (veRL's overlong_buffer.penalty_factor; the paper's value is 1).
Deviation: none. Responses never exceed L_max here (generation stops there), so the last case
only matters for data written by another engine.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # NOTE: the schema holds Config (configs/schema.py): loading it (--help) imports no torch
    import torch


@dataclasses.dataclass
class Config:
    """algorithm.overlong_reward."""

    enable: bool = False
    """Add the overlong penalty to every response's reward."""
    buffer_len: int = 16
    """L_cache: the last tokens before max_response_tokens over which the penalty grows from 0 to -1."""
    penalty_factor: float = 1.0
    """Scale of the penalty (the paper's is 1)."""


def penalty(lengths: torch.Tensor, max_len: int, cfg: Config) -> torch.Tensor:
    """The length reward [B] (0 or negative) for response lengths [B] (float)."""
    if not 0 < cfg.buffer_len <= max_len:
        raise ValueError(
            f"algorithm.overlong_reward.buffer_len must be in 1..{max_len} (max_response_tokens), got {cfg.buffer_len}"
        )
    start = max_len - cfg.buffer_len  # L_max - L_cache
    r = ((start - lengths) / cfg.buffer_len).clamp(max=0.0)  # [B] 0 up to start, then linear down to -1 at max_len
    r = r.masked_fill(lengths > max_len, -1.0)  # [B]
    return cfg.penalty_factor * r  # [B]
