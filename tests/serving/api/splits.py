"""Ways to cut a text into streaming deltas: every single cut point, one char at a time, random chunks."""

import random


def chunkings(text: str, *, n_random: int = 20, seed: int = 0):
    """Yield lists of deltas whose concatenation is `text`."""
    yield [text]
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]
    rng = random.Random(seed)
    for _ in range(n_random):
        pieces, i = [], 0
        while i < len(text):
            n = rng.choice([1, 2, 3, 5, 8, 13, 40])
            pieces.append(text[i:i + n])
            i += n
        yield pieces
