"""transformers as a FLOAT64 reference (BRIEF section 2, last trap).

`model.double()` is not enough: the modeling code casts back to float32 inside RMSNorm (`x.float()`),
the gated RMSNorm and the delta rule (`.to(torch.float32)`), the router softmax (`dtype=torch.float`),
the attention softmax (`dtype=torch.float32`) and the rotary angles (`inv_freq` made in float32).
`float64_model(model, module)` converts the model and, while the returned context is active,
makes every such cast in `module` (the modeling file) mean float64:

- the module's global `torch` is replaced by a proxy whose float32 / float are float64 (every
  function and method of the module looks `torch` up in the module's globals);
- `Tensor.float()` leaves a float64 tensor as it is;
- the rotary `inv_freq` buffers are recomputed in float64.

`check_float64_outputs(model)` registers hooks that fail on any module output that is not
float64, so a cast this list misses at a module boundary is caught, not silently kept.
"""

from __future__ import annotations

import contextlib
import types

import torch


class _Float64Torch(types.ModuleType):
    """`torch` with float32 and float meaning float64; everything else delegated."""

    float32 = torch.float64
    float = torch.float64

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def float64_casts(module):
    """While active, `module`'s float32 casts are float64 casts (see the module docstring)."""
    saved_torch, saved_float = module.torch, torch.Tensor.float
    saved_default = torch.get_default_dtype()

    def keep_float64(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else saved_float(self, *args, **kwargs)

    module.torch = _Float64Torch()
    torch.Tensor.float = keep_float64
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        module.torch = saved_torch
        torch.Tensor.float = saved_float
        torch.set_default_dtype(saved_default)


def float64_model(model, module):
    """Convert `model` to float64 in place and recompute its rotary frequencies in float64.

    Run it inside `float64_casts(module)`; returns the model."""
    model.double()
    for sub in model.modules():
        if hasattr(sub, "inv_freq") and hasattr(sub, "compute_default_rope_parameters"):
            inv_freq, _ = sub.compute_default_rope_parameters(sub.config)
            sub.inv_freq = inv_freq.to(torch.float64)
            sub.original_inv_freq = sub.inv_freq.clone()
    return model


def check_float64_outputs(model) -> list:
    """Hooks that raise on any floating-point module output that is not float64; returns the handles."""

    def hook(mod, _inputs, output):
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64:
                raise AssertionError(f"{type(mod).__name__} returned {t.dtype}: a float32 cast the float64 reference missed")

    return [m.register_forward_hook(hook) for m in model.modules()]
