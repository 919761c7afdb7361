"""The GPU tier (engine/tier/startup.py says what runs where); start it with GpuTier.start."""

from .startup import GpuTier, GpuTierError, TierOptions

__all__ = ["GpuTier", "GpuTierError", "TierOptions"]
