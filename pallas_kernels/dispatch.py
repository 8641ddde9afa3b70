"""Which implementation of a fused op runs: `impl="auto" | "reference" | "xla" | "pallas"`.

auto picks the Pallas kernel on a GPU backend and the XLA path elsewhere. "pallas" off a GPU runs the
kernel in interpret mode (slow; for tests), since XLA:CPU cannot compile a Triton custom call.
"""

from __future__ import annotations

import jax

IMPLS = ("auto", "reference", "xla", "pallas")


def resolve_impl(impl: str) -> str:
    """The concrete implementation ("reference", "xla" or "pallas") that `impl` names on this backend."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def interpret_default() -> bool:
    """Pallas kernels run interpreted unless the default backend is a GPU."""
    return jax.default_backend() != "gpu"
