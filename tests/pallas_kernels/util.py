"""Fresh randomness per run with the seed in every failure message, so a failure can be replayed."""

from __future__ import annotations

import numpy as np


def fresh_rng(seed: int | None = None) -> tuple[np.random.Generator, str]:
    """A generator on a new seed (or `seed`) and the message that names it."""
    seed = int(np.random.SeedSequence().entropy) if seed is None else seed
    return np.random.default_rng(seed), f"seed={seed}"


def assert_close(got, want, msg: str, *, rtol: float = 1e-5, atol: float = 1e-5) -> float:
    """Every element finite (interpret mode fills unwritten outputs with NaN) and close; returns max |diff|."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{msg}: shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all(), f"{msg}: {np.size(got) - np.isfinite(got).sum()} non-finite (unwritten?) elements"
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=msg)
    return float(np.max(np.abs(got - want), initial=0.0))
