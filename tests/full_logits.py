"""The tests' full-sequence reference logits, computed at few lengths.

`dsv41.Model.logits` compiles one program per sequence length (2-3 s each for tiny on XLA:CPU), and the runtime
tests compare against requests of many lengths. The model is causal: a row's logits do not depend on later tokens.
So a reference is computed at the length rounded up to a multiple of `PAD_TO`, the tail filled with the last
token, and cut back; every reference of up to 64 tokens shares one program, and so on. The rows differ from an
unpadded call only by float32 rounding (a matmul's blocking may depend on its row count), far below the tests'
tolerances; bitwise comparisons call `Model.logits` itself."""

import numpy as np

PAD_TO = 64


def full_logits(model, tokens, length: int | None = None) -> np.ndarray:
    """model.logits of tokens [T] -> [T, vocab], computed at `length` >= T tokens (default: T rounded up to a
    multiple of PAD_TO)."""
    ids = np.asarray(tokens)
    T = ids.shape[0]
    length = T + -T % PAD_TO if length is None else length
    if length < T:
        raise ValueError(f"length {length} is shorter than the {T} tokens")
    padded = np.concatenate([ids, np.full(length - T, ids[-1], ids.dtype)])
    return model.logits(padded)[:T]
