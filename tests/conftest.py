"""Fixtures shared by several test modules.

    one_thread   module scope: the kernels on 1 thread for the module (tiny matrices: a parallel
                 launch costs more than the work, and the CI has 2 shared cores); a module takes it
                 with `pytestmark = pytest.mark.usefixtures("one_thread")`
    rt           the GPU runtime under test, installed in engine.kernels.gpu for the test: "cuda"
                 (marked gpu, skipped with the reason without CuPy or a device; scripts/gpu_suite.sh
                 runs these) and "emu", the same CUDA source on the host (tests/gpu_emu.py)
"""

from __future__ import annotations

import pytest
from gpu_emu import EmuRuntime, unavailable_reason

from strata.engine.kernels import cpu, gpu

_CUDA_OK, _CUDA_WHY = gpu.available()
_EMU_WHY = unavailable_reason()
_RUNTIMES: dict[str, object] = {}  # one per process: CuPy's runtime, and the emulation's compiled kernels


@pytest.fixture(scope="module")
def one_thread():
    before = cpu.threads_cap()
    cpu.set_threads(1)
    yield
    cpu.set_threads(before)


@pytest.fixture(params=[
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not _CUDA_OK, reason=f"no GPU: {_CUDA_WHY}")]),
    pytest.param("emu", marks=pytest.mark.skipif(_EMU_WHY is not None, reason=f"no GPU emulation: {_EMU_WHY}")),
])
def rt(request):
    name = request.param
    if name not in _RUNTIMES:
        _RUNTIMES[name] = gpu.CupyRuntime() if name == "cuda" else EmuRuntime()
    before = gpu.use_runtime(_RUNTIMES[name])
    yield _RUNTIMES[name]
    gpu.use_runtime(before)
    # A registration (HostRegistry's cudaHostRegister of GGUF pages) must not outlive its test: the
    # runtime is the process's, and once the pages are unmapped a later allocation at the same
    # addresses is "registered" to the driver, whose copies from it then fail (cudaErrorInvalidValue
    # on the card, 2026-12-04: a second `strata generate` in one test, copying a weight at its
    # startup, after the first had left its registrations) or read stale pages.
    leaked = list(getattr(_RUNTIMES[name], "registered", ()))
    if leaked:
        for r0, _ in leaked:
            _RUNTIMES[name].unregister_host(r0)
        pytest.fail(f"{len(leaked)} host registration(s) outlived the test (HostRegistry not closed): "
                    f"{[(hex(a), b - a) for a, b in leaked[:4]]}")
