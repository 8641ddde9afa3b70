"""Engram (spec §2.10): an n-gram memory written into every residual stream of layers 1 and 14.

Host side (NumPy, int64): every token id maps to a compressed id (normalized text); the 2..max-gram
ending at each position are hashed (rolling XOR of compressed id x per-layer odd multiplier) into
prime-sized bucket ranges, `n_heads` per n-gram order, giving `(max_ngram - 1) * n_heads` row ids. A row whose
token is still on the device (async scheduling) gets its ids there, from the host's look-back (`look_back`,
`device_hash_ids`).
Device side (`Engram`): look the rows up in the FP8 table (1x32 UE8M0 scales), project them with `wkv`
to one key per stream plus a shared value, and add the value to each stream through a signed-sqrt
sigmoid gate that compares the stream with its key.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41.layers.basic import Linear

_INT64_MAX = np.iinfo(np.int64).max


# ================================================================================ layout
def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (bases are the first 13 primes)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@functools.cache
def engram_primes(n_layers: int, max_ngram: int, n_heads: int, vocab: int) -> tuple[tuple[int, ...], ...]:
    """Per Engram layer, its (max_ngram - 1) * n_heads bucket sizes, n-gram order major.

    For each layer and n-gram order, start at vocab - 1 and take the next n_heads primes that were never
    used before (across all layers); the release's table sizes are the per-layer sums.
    """
    seen: set[int] = set()
    layers = []
    for _ in range(n_layers):
        sizes = []
        for _ in range(max_ngram - 1):
            current = vocab - 1
            for _ in range(n_heads):
                current += 1
                while not _is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                sizes.append(current)
        layers.append(tuple(sizes))
    return tuple(layers)


def hash_multipliers(layer_ids: tuple[int, ...], max_ngram: int, compressed_vocab: int) -> np.ndarray:
    """[n_layers, max_ngram] odd int64 multipliers from numpy's default_rng(10007 * layer_id)."""
    bound = max(1, (_INT64_MAX // compressed_vocab) // 2)
    rows = [np.random.default_rng(10007 * lid).integers(0, bound, size=max_ngram, dtype=np.int64) * 2 + 1
            for lid in layer_ids]
    return np.stack(rows).astype(np.int64)


class EngramLayout:
    """Primes, offsets and multipliers of a config's Engram layers (host side)."""

    def __init__(self, layer_ids: tuple[int, ...], max_ngram: int, n_heads: int, vocab: int,
                 compressed_vocab: int, pad_token_id: int):
        self.layer_ids, self.max_ngram, self.n_heads = layer_ids, max_ngram, n_heads
        self.primes = np.asarray(engram_primes(len(layer_ids), max_ngram, n_heads, vocab), np.int64)
        self.offsets = np.concatenate([np.zeros((len(layer_ids), 1), np.int64),
                                       np.cumsum(self.primes, axis=1)[:, :-1]], axis=1)
        self.rows = self.primes.sum(axis=1)
        self.multipliers = hash_multipliers(layer_ids, max_ngram, compressed_vocab)
        self.pad_token_id = pad_token_id

    @classmethod
    def from_config(cls, c) -> EngramLayout:
        return cls(c.engram_layer_ids, c.engram_max_ngram_size, c.engram_n_heads, c.engram_vocab_size,
                   c.engram_compressed_vocab_size, c.engram_pad_token_id)

    def hash_ids(self, token_ids: np.ndarray, token_map: np.ndarray, start: int = 0) -> np.ndarray:
        """Table row ids [T - start, n_layers, (max_ngram - 1) * n_heads] (int32) for positions start..T-1
        of the sequence `token_ids` (positions 0..T-1). Look-back past position 0 is padded."""
        return self.hash_windows(ngram_windows(token_ids, start, self.max_ngram), token_map)

    def hash_windows(self, windows_NK: np.ndarray, token_map: np.ndarray) -> np.ndarray:
        """Row ids [N, n_layers, (max_ngram - 1) * n_heads] (int32) of N rows from their n-gram windows [N, max_ngram]
        (`ngram_windows`: column s the token s positions back, -1 before position 0), in one vectorized pass: a
        step hashes all its rows at once."""
        L, S, H = len(self.layer_ids), self.max_ngram - 1, self.n_heads
        rolling = np.bitwise_xor.accumulate(self._terms(windows_NK, token_map, self.multipliers), axis=2)
        out = rolling[:, :, 1:, None] % self.primes.reshape(L, S, H) + self.offsets.reshape(L, S, H)
        return out.reshape(len(windows_NK), L, S * H).astype(np.int32)

    def _terms(self, windows: np.ndarray, token_map: np.ndarray, multipliers: np.ndarray) -> np.ndarray:
        """[N, n_layers, k] int64: each window token's compressed id (pad before position 0) x its multiplier
        (cannot overflow: the multipliers' bound is chosen from the compressed vocab)."""
        w = np.asarray(windows, np.int64)
        comp = np.asarray(token_map, np.int64)
        c = np.where(w < 0, comp[self.pad_token_id], comp[np.maximum(w, 0)])
        return c[:, None, :] * multipliers[None, :, :]

    # Async scheduling dispatches a step before the host has seen the token its decode rows read, so such a
    # row's hash ids are finished on the device. Its column of order s is (term XOR look_back_s) % prime +
    # offset: `token_terms` holds every token's term (its compressed id x the order-0 multiplier), the host
    # computes the look-back (the XOR of the earlier tokens' terms), the device the rest. XLA runs without
    # 64-bit types here, so both travel as (lo, hi) int32 pairs and the device reduces them in uint32.
    def token_terms(self, token_map: np.ndarray) -> np.ndarray:
        """[V, n_layers, 2] int32: each token id's 64-bit order-0 term, as (lo, hi) halves."""
        comp = np.asarray(token_map, np.int64)
        return _lo_hi(comp[:, None] * self.multipliers[None, :, 0])

    def look_back(self, back_NS: np.ndarray, token_map: np.ndarray) -> np.ndarray:
        """[N, n_layers, max_ngram - 1, 2] int32 (lo, hi): for N rows whose own token is not known yet, per
        n-gram order s the XOR of the terms of the tokens 1 .. s back. `back_NS`: their windows without column 0
        (`ngram_windows(...)[:, 1:]`)."""
        return _lo_hi(np.bitwise_xor.accumulate(self._terms(back_NS, token_map, self.multipliers[:, 1:]), axis=2))

    def device_hash_ids(self, term_L2: jax.Array, look_back_LS2: jax.Array) -> jax.Array:
        """Hash ids [..., n_layers, (max_ngram - 1) * n_heads] (int32, as `hash_ids`) of rows from their token's
        term [..., n_layers, 2] and look-back [..., n_layers, max_ngram - 1, 2] (traceable, 32-bit only)."""
        L, S, H = len(self.layer_ids), self.max_ngram - 1, self.n_heads
        if int(self.rows.max()) >= 2 ** 31:
            raise ValueError(f"Engram tables of {int(self.rows.max())} rows do not fit int32 row ids")
        u32 = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint32)  # noqa: E731
        x = u32(term_L2)[..., None, :] ^ u32(look_back_LS2)  # [..., L, S, 2]
        primes = jnp.asarray(self.primes.reshape(L, S, H), jnp.uint32)
        r = _mod_u64(x[..., 0, None], x[..., 1, None], primes, 32 - int(self.primes.max()).bit_length())
        ids = r.astype(jnp.int32) + jnp.asarray(self.offsets.reshape(L, S, H), jnp.int32)
        return ids.reshape(*ids.shape[:-2], S * H)


def ngram_windows(token_ids: np.ndarray, start: int, k: int) -> np.ndarray:
    """[T - start, k] int64 token ids: row i, column s = the token s positions before position start + i of the
    sequence `token_ids` (positions 0..T-1), -1 before position 0."""
    src = np.arange(start, len(token_ids))[:, None] - np.arange(k)[None, :]
    return np.where(src >= 0, np.asarray(token_ids, np.int64)[np.maximum(src, 0)], -1)


def _lo_hi(a: np.ndarray) -> np.ndarray:
    """int64 [...] -> int32 [..., 2] (low, high 32 bits)."""
    u = np.asarray(a, np.int64).view(np.uint64)
    return np.stack([u & 0xFFFFFFFF, u >> 32], axis=-1).astype(np.uint32).view(np.int32)


def _mod_u64(lo: jax.Array, hi: jax.Array, q: jax.Array, digit_bits: int) -> jax.Array:
    """(hi * 2**32 + lo) % q in uint32, for q < 2**(32 - digit_bits): Horner's rule over `digit_bits`-bit digits of
    lo keeps every intermediate below 2**32."""
    if digit_bits < 1:
        raise ValueError("Engram primes must be below 2**31 for the device hash")
    r, done = hi % q, 0
    while done < 32:
        w = min(digit_bits, 32 - done)
        digit = (lo >> np.uint32(32 - done - w)) & np.uint32((1 << w) - 1)
        r = ((r << np.uint32(w)) | digit) % q
        done += w
    return r


# ==================================================================== compressed token map
def _normalizer():
    """NFKC -> NFD -> strip accents -> lowercase -> collapse [ \t\r\n]+ -> strip, a lone space kept."""
    from tokenizers import Regex, normalizers

    lone_space = "\ue000"  # private-use stand-in so Strip() keeps a token that is exactly one space
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), lone_space),
        normalizers.Strip(), normalizers.Replace(lone_space, " "),
    ])


def build_compressed_token_map(tokenizer_json: str | Path, vocab_size: int, pad_token_id: int
                               ) -> tuple[np.ndarray, int]:
    """Map [vocab_size] token id -> compressed id (first-seen order of the normalized text) and its size.

    Partial UTF-8 byte tokens (decode to U+FFFD) are keyed by their raw token string. Ids past the
    tokenizer's own vocabulary (padding rows of the embedding) map to the pad token's compressed id.
    """
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    normalizer = _normalizer()
    n = tok.get_vocab_size(with_added_tokens=True)
    key_to_new: dict[str, int] = {}
    lookup = np.zeros(max(n, vocab_size), np.int64)
    for token_id in range(n):
        text = tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(token_id) or text
        else:
            key = normalizer.normalize_str(text) or text
        lookup[token_id] = key_to_new.setdefault(key, len(key_to_new))
    size = len(key_to_new)
    if vocab_size > n:
        lookup[n:] = lookup[pad_token_id]
    return lookup[:vocab_size], size


# ================================================================================ module
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EngramRows:
    """Table rows gathered on the host for a step (host-resident tables, `dsv41.engram_host`): the FP8 bytes
    `values` [..., L, C, hd] and UE8M0 exponent bytes `scales` [..., L, C, hd/32] (uint8) of each row's
    (Engram layer, hash column). What the forward takes in place of the hash ids [..., L, C]."""

    values: jax.Array
    scales: jax.Array

    def layer(self, i: int) -> EngramRows:
        return EngramRows(self.values[:, i], self.scales[:, i])


def decode_rows(values: jax.Array, scales: jax.Array | None, dtype: jnp.dtype) -> jax.Array:
    """Rows [..., hd] from FP8 (e4m3, or its bytes as uint8) values and UE8M0 bytes per 32 (or float rows)."""
    if values.dtype == jnp.uint8:
        values = jax.lax.bitcast_convert_type(values, jnp.float8_e4m3fn)
    rows = values.astype(jnp.float32)
    if scales is not None:
        s = scales.astype(jnp.int32) - 127
        rows = (rows.reshape(*rows.shape[:-1], -1, 32) * jnp.ldexp(1.0, s)[..., None]).reshape(rows.shape)
    return rows.astype(dtype)


class EngramTable(nnx.Module):
    """engram.embed.weight [rows, hd] (float8_e4m3fn, or the compute dtype for unquantized checkpoints)
    and engram.embed.scale [rows, hd/32] (UE8M0 exponent bytes; None when unquantized).

    `store_on_host()` drops both from the device parameters: the table then lives in host memory
    (`dsv41.engram_host`) and the forward receives each step's rows already gathered (`EngramRows`)."""

    def __init__(self, rows: int, head_dim: int, *, fp8: bool, dtype: jnp.dtype):
        self.on_host = False
        self.weight = nnx.Param(jnp.zeros((rows, head_dim), jnp.float8_e4m3fn if fp8 else dtype))
        self.scale = nnx.Param(jnp.zeros((rows, head_dim // 32), jnp.uint8)) if fp8 else nnx.data(None)

    def store_on_host(self) -> None:
        self.on_host = True
        self.weight = self.scale = nnx.data(None)

    def __call__(self, ids_or_rows: jax.Array | EngramRows, dtype: jnp.dtype) -> jax.Array:
        """Rows [T, C, hd] in `dtype` of hash ids [T, C] (device table) or of gathered rows (host table)."""
        if isinstance(ids_or_rows, EngramRows):
            return decode_rows(ids_or_rows.values, ids_or_rows.scales, dtype)
        if self.on_host:
            raise ValueError("this Engram table lives in host memory: pass the step's gathered rows (EngramRows)")
        ids = ids_or_rows
        scales = None if self.scale is None else jnp.take(self.scale[...], ids, axis=0)
        return decode_rows(jnp.take(self.weight[...], ids, axis=0), scales, dtype)


class Engram(nnx.Module):
    """embed (table), wkv [(n+1)*D, cols*hd], q_weight, k_weight [n, D]."""

    def __init__(self, *, rows: int, n_cols: int, head_dim: int, hc_mult: int, dim: int, eps: float,
                 table_fp8: bool, dtype: jnp.dtype):
        self.hc_mult, self.dim, self.eps = hc_mult, dim, eps
        self.embed = EngramTable(rows, head_dim, fp8=table_fp8, dtype=dtype)
        self.wkv = Linear(n_cols * head_dim, (hc_mult + 1) * dim, dtype=dtype)
        self.q_weight = nnx.Param(jnp.ones((hc_mult, dim), dtype))
        self.k_weight = nnx.Param(jnp.ones((hc_mult, dim), dtype))

    def __call__(self, R_TnD: jax.Array, hash_ids_TC: jax.Array) -> jax.Array:
        T, n, D = R_TnD.shape
        rows = self.embed(hash_ids_TC, R_TnD.dtype).reshape(T, -1)
        kv = self.wkv(rows, jnp.float32).reshape(T, n + 1, D)
        keys, value = kv[:, :n], kv[:, n]
        h = R_TnD.astype(jnp.float32)
        qk = self.q_weight[...].astype(jnp.float32) * self.k_weight[...].astype(jnp.float32)
        dot = jnp.sum(h * qk * keys, axis=-1)
        dot = dot * jax.lax.rsqrt(jnp.mean(h * h, -1) + self.eps) * jax.lax.rsqrt(jnp.mean(keys * keys, -1) + self.eps)
        dot = dot / np.sqrt(D)
        gate = jax.nn.sigmoid(jnp.where(dot < 0, -1.0, 1.0) * jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6)))
        return (h + gate[..., None] * value[:, None, :]).astype(R_TnD.dtype)
