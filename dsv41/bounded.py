"""The bounded-replay semantics (spec §3.3-3.4) expressed as masks over the exact full-sequence forward:
the oracle a serving runtime with replay on must match.

Decoder replay: layers after the CED cut run only on each chunk's last `window` rows, so a kept row at
position p of a chunk ending at S reads SWA rows >= max(replay_start, S - window) there; the cut layer and
everything before it see their normal windows. Encoder replay: after a prefix hit of H tokens the request
restarts at replay_start = H - window; its replayed and later rows read no SWA row below replay_start in
any layer, and the global rows / index keys the hit holds are the cold pass's, never recomputed.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from dsv41.api import Model


def decoder_floors(num_tokens: int, chunks: Sequence[tuple[int, int]], window: int, replay_start: int = 0
                   ) -> np.ndarray:
    """[T] floor of the decoder layers' SWA window for each position, from the chunk schedule (start, end)
    pairs covering [replay_start, T) (a decode step is a 1-token chunk). Positions outside: 0."""
    floor = np.zeros(num_tokens, np.int32)
    for start, end in chunks:
        floor[start:end] = max(replay_start, end - window)
    return floor


def bounded_logits(model: Model, input_ids, *, chunks: Sequence[tuple[int, int]], hit_tokens: int = 0,
                   replay_start: int = 0, decoder_replay: bool = True, fake_quant: bool = False) -> np.ndarray:
    """Logits [T, vocab] of a request run with bounded replay: prefix hit of `hit_tokens` (its rows from a
    cold pass over ids[:hit_tokens]), recomputed from `replay_start`, processed in `chunks`. Only rows a
    runtime actually computes (each chunk's kept rows) are meaningful."""
    ids = np.asarray(input_ids)
    c = model.config
    W = c.sliding_window
    frozen = None
    if hit_tokens:
        cold = model.published_rows(ids[:hit_tokens], fake_quant=fake_quant)
        frozen = {s: (rows, keys) for s, (rows, keys) in cold.items()}
    swa_floor = np.where(np.arange(len(ids)) >= replay_start, replay_start, 0).astype(np.int32)
    dec = decoder_floors(len(ids), chunks, W, replay_start) if decoder_replay else None
    return model.masked_logits(ids, swa_floor=swa_floor, decoder_floor=dec, frozen=frozen, fake_quant=fake_quant)
