"""Lower a function for CUDA on a host without a GPU (jax-notes §2.3), to catch shape/layout errors in CI.

Lowering under an abstract GPU device runs every Pallas lowering rule (Triton: `__gpu$xla.gpu.triton`
custom call with the TTIR embedded; Mosaic GPU: `mosaic_gpu_v2`). PTX/ptxas errors only show when XLA
compiles on a real GPU.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

H200 = "NVIDIA H200"
H100 = "NVIDIA H100 80GB HBM3"
TRITON_CALL = "__gpu$xla.gpu.triton"
MOSAIC_GPU_CALL = "mosaic_gpu_v2"


def abstract_gpu_mesh(device_kind: str = H200, num_cores: int = 132) -> AbstractMesh:
    """A device-less mesh whose abstract device is a CUDA GPU of `device_kind`."""
    return AbstractMesh((), (), abstract_device=AbstractDevice(device_kind=device_kind, platform="gpu",
                                                               num_cores=num_cores))


def lower_for_cuda(fn: Callable, *args: Any, device_kind: str = H200, **kwargs: Any) -> str:
    """StableHLO text of jit(fn)(*args, **kwargs) lowered for CUDA; args may be ShapeDtypeStructs.

    Keyword arguments are static (bound before tracing)."""
    with use_abstract_mesh(abstract_gpu_mesh(device_kind)):
        lowered = jax.jit(lambda *a: fn(*a, **kwargs)).trace(*args).lower(lowering_platforms=("cuda",))
    return lowered.as_text()


def count_gpu_kernels(hlo_text: str) -> int:
    """Number of Pallas GPU kernel custom calls (Triton or Mosaic GPU) in lowered StableHLO text."""
    return hlo_text.count(f"@{TRITON_CALL}(") + hlo_text.count(f"@{MOSAIC_GPU_CALL}(")
