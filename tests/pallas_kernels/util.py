"""A fixed default seed for the kernel tests, named in every failure message and overridable with
`pytest --kernel-seed N` (tests/conftest.py), so a failure reproduces and other seeds can be explored."""

from __future__ import annotations

import numpy as np

DEFAULT_SEED = 0
_seed = DEFAULT_SEED


def set_seed(seed: int) -> None:
    global _seed
    _seed = int(seed)


def seeded_rng() -> tuple[np.random.Generator, str]:
    """A generator on the session's kernel seed and the message that names it."""
    return np.random.default_rng(_seed), f"seed={_seed} (rerun: pytest --kernel-seed {_seed})"


def assert_close(got, want, msg: str, *, rtol: float = 1e-5, atol: float = 1e-5) -> float:
    """Every element finite (interpret mode fills unwritten outputs with NaN) and close; returns max |diff|."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{msg}: shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all(), f"{msg}: {np.size(got) - np.isfinite(got).sum()} non-finite (unwritten?) elements"
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=msg)
    return float(np.max(np.abs(got - want), initial=0.0))
