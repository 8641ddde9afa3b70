"""Text <-> token ids for serving: a checkpoint's `tokenizer.json`, or the built-in byte-level tokenizer.

`Tokenizer` wraps an HF `tokenizers.Tokenizer`. Special-token text inside a string maps to its id
(`encode("<｜User｜>hi")` -> `[id(<｜User｜>), id(h), id(i)]`), which is how the V4.1 prompt text from
`serving.text.encoding` becomes ids without a template engine.

`decode(ids, skip_special=True)` drops control tokens (BOS/EOS/pad/role/reserved) but never the
reasoning and tool-call markers (`<think>`, `</think>`, `｜DSML｜`): the output parsers read those, and a
real checkpoint may flag them special.

`byte_level_tokenizer(vocab_size)` is the tokenizer of the built-in tiny model (vocab 512):

    ids 0 .. 16    V4.1 special tokens (bos 0, eos 1, pad 2, roles, <think>, </think>, ｜DSML｜, ...)
    ids 17 .. 272  one token per byte value 0..255 (any UTF-8 text round-trips exactly)
    ids 273 ..     <｜reserved_K｜> up to vocab_size

It is a byte-level BPE with no merges, so it needs no corpus, no training and no network.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from dsv41.special_tokens import BOS_TOKEN, DSML_TOKEN, EOS_TOKEN, PAD_TOKEN, SPECIAL_TOKENS, THINK_END, THINK_START

# Markers the reasoning / tool-call parsers read from generated text: never skipped by decode.
PARSER_MARKERS = (THINK_START, THINK_END, DSML_TOKEN)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the ids serving needs (bos/eos/pad) and decode that keeps markers."""

    def __init__(self, hf: HFTokenizer, *, bos_token: str = BOS_TOKEN, eos_token: str = EOS_TOKEN,
                 pad_token: str | None = PAD_TOKEN, source: str = "tokenizer"):
        self._hf = hf
        self._source = source
        self._bos_token, self._eos_token = bos_token, eos_token
        self.bos_id = self._required_id(bos_token, "bos_token")
        self.eos_id = self._required_id(eos_token, "eos_token")
        pad = hf.token_to_id(pad_token) if pad_token is not None else None
        # A vocabulary without a pad token pads with EOS: pad rows are never read as text.
        self._pad_token = pad_token if pad is not None else eos_token
        self.pad_id = pad if pad is not None else self.eos_id
        self._special_ids = frozenset(
            token_id for token_id, added in hf.get_added_tokens_decoder().items() if added.special)
        marker_ids = {hf.token_to_id(m) for m in PARSER_MARKERS} - {None}
        self._skip_ids = self._special_ids - marker_ids
        self.byte_level = isinstance(hf.decoder, decoders.ByteLevel)  # token_bytes works
        self._bytes_cache: dict[int, bytes] = {}

    def _required_id(self, token: str, field: str) -> int:
        token_id = self._hf.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{self._source}: {field} {token!r} is not in the vocabulary")
        return token_id

    # ------------------------------------------------------------------ loading / saving
    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Read `tokenizer.json` (+ `tokenizer_config.json` for bos/eos/pad names, if present)."""
        folder = Path(path)
        tokenizer_json = folder / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder} (a checkpoint folder needs the tokenizer "
                                    "file next to config.json)")
        hf = HFTokenizer.from_file(str(tokenizer_json))
        names = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
        config_json = folder / "tokenizer_config.json"
        if config_json.is_file():
            config = json.loads(config_json.read_text(encoding="utf-8"))
            for field in names:
                value = config.get(field)
                if isinstance(value, dict):  # {"content": "...", "lstrip": ..} form of HF configs
                    value = value.get("content")
                if isinstance(value, str):
                    names[field] = value
        return cls(hf, **names, source=str(tokenizer_json))

    def write(self, path: str | Path) -> None:
        """Save `tokenizer.json` and `tokenizer_config.json` into folder `path` (created if missing)."""
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        self._hf.save(str(folder / "tokenizer.json"))
        config = {"bos_token": self._bos_token, "eos_token": self._eos_token, "pad_token": self._pad_token,
                  "add_bos_token": False, "add_eos_token": False}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n",
                                                      encoding="utf-8")

    # ------------------------------------------------------------------ text <-> ids
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token text inside it maps to the special id. No BOS is added."""
        return self._hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        """Text of `ids`; `skip_special` drops control tokens but keeps the parser markers."""
        if skip_special:
            ids = [i for i in ids if not self.is_skipped(i)]
        return self._hf.decode(list(ids), skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes `token_id` adds to the UTF-8 of decoded text (`b""` for skipped tokens is the caller's
        choice). Needs a byte-level decoder, as V4.1's tokenizer has: each char of the token string maps
        back to one byte, and chars outside that alphabet (in added tokens) stand for their own UTF-8. An id
        past the tokenizer's vocabulary (a padded model vocabulary) adds nothing.
        """
        cached = self._bytes_cache.get(token_id)
        if cached is None:
            if not self.byte_level:
                raise ValueError(f"{self._source}: token bytes need a ByteLevel decoder "
                                 f"(this tokenizer's is {type(self._hf.decoder).__name__})")
            piece = self._hf.id_to_token(token_id)
            if piece is None:  # a model vocabulary padded past the tokenizer's (e.g. 8192 rows, 8000 tokens)
                return b""  # no text, as HF's decode: a sampled padding id must not stop the engine
            cached = b"".join(bytes([_CHAR_TO_BYTE[c]]) if c in _CHAR_TO_BYTE else c.encode("utf-8")
                              for c in piece)
            self._bytes_cache[token_id] = cached
        return cached

    def is_skipped(self, token_id: int) -> bool:
        """Whether decode(skip_special=True) drops `token_id` (control tokens; not the parser markers)."""
        return token_id in self._skip_ids

    def token_id(self, name: str) -> int:
        """Id of the token spelled `name` (e.g. `"<｜User｜>"`); ValueError if the vocabulary lacks it."""
        token_id = self._hf.token_to_id(name)
        if token_id is None:
            raise ValueError(f"token {name!r} is not in the vocabulary of {self._source}")
        return token_id

    def is_special(self, token_id: int) -> bool:
        """Whether `token_id` is an added token flagged special (control tokens; markers may be too)."""
        return token_id in self._special_ids

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the model's embedding may have more rows)."""
        return self._hf.get_vocab_size(with_added_tokens=True)


# ====================================================================== built-in byte-level tokenizer
def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte -> printable char map, the alphabet of the ByteLevel pre-tokenizer and decoder."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return chars


_CHAR_TO_BYTE = {char: byte for byte, char in _byte_to_char().items()}


def byte_level_tokenizer(vocab_size: int = 512) -> Tokenizer:
    """The deterministic tokenizer of the built-in tiny model (layout in the module docstring)."""
    n_fixed = len(SPECIAL_TOKENS) + 256
    if vocab_size < n_fixed:
        raise ValueError(f"vocab_size must be >= {n_fixed} (specials + 256 bytes), got {vocab_size}")
    vocab: dict[str, int] = {text: i for i, (text, _) in enumerate(SPECIAL_TOKENS)}
    for byte, char in _byte_to_char().items():
        vocab[char] = len(SPECIAL_TOKENS) + byte
    reserved = [f"<｜reserved_{k}｜>" for k in range(n_fixed, vocab_size)]
    vocab.update({text: n_fixed + k for k, text in enumerate(reserved)})

    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: no word splitting, so every byte of the text is one token
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    # Registering tokens already in the model vocabulary keeps their ids (0.., 273..).
    hf.add_special_tokens([AddedToken(text, special=True, normalized=False)
                           for text, special in SPECIAL_TOKENS if special])
    hf.add_tokens([AddedToken(text, special=False, normalized=False)
                   for text, special in SPECIAL_TOKENS if not special])
    hf.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in reserved])
    return Tokenizer(hf, source="byte_level_tokenizer")
