"""The CUDA sources compile with NVRTC, as the card compiles them, on this machine without a GPU.

Every module the runtime builds (engine/kernels/gpu.py `_module`: one per GGML type and "actq";
engine/tier/device.py's device_kernels.cu) with its options and name expressions, for the card's
architecture (compute_90, the H100 and H200). The host emulation runs the same C++ through the host
compiler, which accepts what NVRTC may not; a session lent no card found nothing else that would
catch it, and on the card a refused module fails every launch of the GPU tier.
"""

from __future__ import annotations

import pytest

from nvrtc_compile import NvrtcError, compile_source, library

from strata.engine.kernels import gpu
from strata.engine.tier import device
from strata.index_format.ggml_types import TYPES

LIB = library()
ARCH = "--gpu-architecture=compute_90"

# NVRTC comes as a wheel of the test extras (pyproject.toml): without it these tests cannot run,
# and say so (a CI that installed the extras has it)
pytestmark = pytest.mark.skipif(LIB is None, reason="NVRTC is not installed (pip install nvidia-cuda-nvrtc: the test extras)")

MODULES = ["actq"] + [t.name for t in TYPES if t.quantized or t.name in gpu._FLOAT_KIND]


def test_the_device_kernels_compile():
    ptx = compile_source(LIB, device.KERNELS.read_text(), device.KERNELS.name, gpu.OPTIONS + (ARCH,), device._NAMES)
    for name in device._NAMES:  # every extern "C" kernel the tier launches is in the PTX
        assert f".entry {name}(" in ptx, name


@pytest.mark.parametrize("module", MODULES)
def test_the_kernels_of_each_type_compile(module):
    names = ["actq", "actq16", "combine16", "to_h"] if module == "actq" else gpu._names(gpu.ggml_type(module))
    compile_source(LIB, gpu.SOURCE.read_text(), gpu.SOURCE.name, gpu.OPTIONS + (ARCH,), names)


def test_a_source_nvrtc_refuses_is_reported_with_its_log():
    """The check can fail: a kernel the host compiler takes (a variable-length array, a GNU
    extension) that NVRTC refuses is reported with NVRTC's own message."""
    bad = 'extern "C" __global__ void k(float* x, int n) { float a[n]; a[0] = 1.0f; x[0] = a[0] + undefined_name; }'
    with pytest.raises(NvrtcError, match="undefined_name"):
        compile_source(LIB, bad, "bad.cu", gpu.OPTIONS + (ARCH,), ["k"])
