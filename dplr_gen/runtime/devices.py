"""Which CUDA device a ``torch.device`` names."""

from __future__ import annotations

import torch


def cuda_index(device: torch.device) -> int:
    """The index of a CUDA ``device``; ``cuda`` without one means the current device, as torch reads it."""
    return torch.cuda.current_device() if device.index is None else device.index
