"""The nano model's corpus: Jane Austen's six novels from Debian's `r-cran-janeaustenr` (public domain texts).

`python -m dsv41.train.data [--out DIR]` prepares DIR (default `DEFAULT_DATA_DIR`):

    1. `apt-get download r-cran-janeaustenr` into DIR/deb and `dpkg -x` it (run `apt-get update` first if apt
       cannot find the package);
    2. read the six novels out of the package's R lazy-load database (PyPI `rdata`, the `train` extra; no R);
    3. check each text against `NOVEL_SHA256` (one R character-vector element per line);
    4. write the split: `train.txt` (five novels) and `heldout.txt` (*Persuasion* only, never trained on);
    5. train the byte-level BPE tokenizer on the train split (`dsv41.train.tokenizer`) -> DIR/tokenizer;
    6. tokenize both splits: `train.tokens.npy`, `heldout.tokens.npy` (uint16; EOS between novels).

Nothing here runs at serving or test time; tests use `tests/fixtures/nano/` or skip when DIR is absent.
`Windows` draws the training batches: seq [B, T + 1] = BOS + T consecutive tokens at offsets drawn from
`default_rng([seed, step])`, so a batch depends only on (seed, step) and a resumed run sees the same data; `Rows`
draws the drafter's batches from fixed windows instead when a run names `dspark_data`.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import shutil
import struct
import subprocess
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_DATA_DIR = Path.home() / ".cache" / "dsv41-jax" / "austen"
DEB_PACKAGE = "r-cran-janeaustenr"
HELDOUT_NOVEL = "persuasion"
# sha256 of each novel's text: the R character vector's elements joined by "\n", plus a final "\n", UTF-8
# (r-cran-janeaustenr 1.0.0-1, read with rdata 1.1.0).
NOVEL_SHA256 = {
    "emma": "7c67b5985c6d0de1efaeb5d342d52cb82c38083c40e2295129e30e87ee690ebe",
    "mansfieldpark": "98bc90519cdf4ef663ad7de2734bb529435ef24f7abbde6bb1a50898871dafe9",
    "northangerabbey": "51f91bbe0517db8e65cff009b097ce0a1836124c4e0532ac19e6c0cad982abed",
    "persuasion": "8061549557aebd2fd6e353d18d9197cb707029112bd52d4d8b174583a925848a",
    "prideprejudice": "dfc684d4f857fa938268f9ab9c5567b64bd0691251eca959644adeabe6287a4d",
    "sensesensibility": "105e1651fe93bed7130078578efd31e0c557d68667ba672ddc876f735b30fe09",
}
TRAIN_NOVELS = tuple(sorted(n for n in NOVEL_SHA256 if n != HELDOUT_NOVEL))
SPLITS = ("train", "heldout")


class DataError(RuntimeError):
    """The corpus cannot be prepared or read; the message says which step and what to do."""


# ====================================================================== download and extract
def download_deb(deb_dir: Path) -> Path:
    """The package's .deb in `deb_dir` (downloaded with apt-get unless one is there) -> its extracted root."""
    deb_dir.mkdir(parents=True, exist_ok=True)
    debs = sorted(deb_dir.glob(f"{DEB_PACKAGE}_*.deb"))
    if not debs:
        done = subprocess.run(["apt-get", "download", DEB_PACKAGE], cwd=deb_dir, capture_output=True, text=True)
        debs = sorted(deb_dir.glob(f"{DEB_PACKAGE}_*.deb"))
        if done.returncode or not debs:
            raise DataError(f"apt-get download {DEB_PACKAGE} failed (run `apt-get update` first?):\n{done.stderr}")
    root = deb_dir / DEB_PACKAGE
    shutil.rmtree(root, ignore_errors=True)
    subprocess.run(["dpkg", "-x", str(debs[-1]), str(root)], check=True)
    return root


def _rdata():
    try:
        import rdata
    except ImportError as e:
        raise DataError("reading the R data needs the PyPI package rdata: pip install -e '.[train]'") from e
    return rdata


def extract_novels(package_root: Path) -> dict[str, str]:
    """{novel name: text} from the package's lazy-load DB (Rdata.rdx index + zlib blobs in Rdata.rdb)."""
    rdata = _rdata()
    data = package_root / "usr" / "lib" / "R" / "site-library" / "janeaustenr" / "data"
    if not (data / "Rdata.rdx").is_file():
        raise DataError(f"{data}: no Rdata.rdx (is {package_root} an extracted {DEB_PACKAGE}?)")

    def parse(raw: bytes):
        with warnings.catch_warnings():  # a lazy-load blob has no RDS header: rdata says it assumes RDS
            warnings.filterwarnings("ignore", message="Unknown file type")
            return rdata.conversion.convert(rdata.parser.parse_data(raw, expand_altrep=True))

    index = parse(gzip.decompress((data / "Rdata.rdx").read_bytes()))
    blob = (data / "Rdata.rdb").read_bytes()
    novels = {}
    for name, (offset, length) in index["variables"].items():
        if name not in NOVEL_SHA256:
            continue
        chunk = blob[int(offset): int(offset) + int(length)]
        struct.unpack(">I", chunk[:4])  # a lazy-load blob: 4-byte big-endian length, then a zlib stream
        lines = parse(zlib.decompress(chunk[4:]))
        lines = lines.tolist() if hasattr(lines, "tolist") else list(lines)
        novels[name] = "\n".join("" if x is None else str(x) for x in lines) + "\n"
    missing = sorted(set(NOVEL_SHA256) - set(novels))
    if missing:
        raise DataError(f"{data}: the package holds no {', '.join(missing)}")
    return novels


def check_hashes(novels: dict[str, str]) -> None:
    """Refuse texts that differ from `NOVEL_SHA256` (another package or rdata version would shift the split)."""
    for name, text in novels.items():
        got = hashlib.sha256(text.encode("utf-8")).hexdigest()
        if got != NOVEL_SHA256[name]:
            raise DataError(f"novel {name}: sha256 {got} differs from the reference {NOVEL_SHA256[name]}")


# ============================================================================ the split
def split_texts(novels: dict[str, str]) -> dict[str, list[str]]:
    """{"train": the five training novels in name order, "heldout": [Persuasion]}."""
    return {"train": [novels[n] for n in TRAIN_NOVELS], "heldout": [novels[HELDOUT_NOVEL]]}


def tokenize_documents(tok, documents: list[str], eos_id: int) -> np.ndarray:
    """uint16 [N]: each document's ids followed by EOS (the document boundary the model learns)."""
    ids: list[int] = []
    for doc in documents:
        ids += tok.encode(doc).ids + [eos_id]
    if max(ids) >= 2 ** 16:
        raise DataError("token ids exceed uint16")
    return np.asarray(ids, np.uint16)


def prepare(out: Path, *, package_root: Path | None = None, vocab_size: int = 8192) -> dict:
    """Steps 1-6 of the module docstring into `out`; returns the stats written to out/stats.json."""
    from dsv41.train.tokenizer import EOS_TOKEN, train_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    novels = extract_novels(package_root or download_deb(out / "deb"))
    check_hashes(novels)
    split = split_texts(novels)
    for name, docs in split.items():
        (out / f"{name}.txt").write_text("\n".join(docs), encoding="utf-8")
    tok = train_tokenizer(split["train"], out / "tokenizer", vocab_size=vocab_size)
    stats: dict = {"vocab_size": tok.get_vocab_size(with_added_tokens=True), "heldout_novel": HELDOUT_NOVEL,
                   "train_novels": list(TRAIN_NOVELS)}
    for name, docs in split.items():
        tokens = tokenize_documents(tok, docs, tok.token_to_id(EOS_TOKEN))
        np.save(out / f"{name}.tokens.npy", tokens)
        stats[name] = {"chars": sum(map(len, docs)), "tokens": int(tokens.size)}
    stats["unigram_heldout_ppl"] = unigram_perplexity(load_tokens(out, "train"), load_tokens(out, "heldout"),
                                                      stats["vocab_size"])
    (out / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    return stats


# ================================================================================ reading
def load_tokens(data_dir: Path, split: str) -> np.ndarray:
    """The token ids of `split` ("train" | "heldout") written by `prepare`."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    path = Path(data_dir) / f"{split}.tokens.npy"
    if not path.is_file():
        raise DataError(f"{path} is missing: prepare the corpus with `python -m dsv41.train.data --out {data_dir}`")
    return np.load(path)


def unigram_perplexity(train_ids: np.ndarray, eval_ids: np.ndarray, vocab_size: int) -> float:
    """exp(cross-entropy) of `eval_ids` under the add-one-smoothed unigram distribution of `train_ids`: the
    baseline a trained model must beat by far."""
    counts = np.bincount(train_ids.astype(np.int64), minlength=vocab_size)[:vocab_size] + 1.0
    logp = np.log(counts / counts.sum())
    return float(np.exp(-logp[eval_ids.astype(np.int64)].mean()))


@dataclass(frozen=True)
class Windows:
    """Training batches [batch, seq_len + 1]: BOS, then seq_len consecutive corpus tokens."""

    tokens: np.ndarray
    seq_len: int
    batch: int
    seed: int
    bos_id: int = 0

    def __post_init__(self) -> None:
        if self.tokens.size <= self.seq_len:
            raise ValueError(f"seq_len {self.seq_len} needs more than {self.tokens.size} corpus tokens")

    def batch_at(self, step: int) -> np.ndarray:
        """int32 [batch, seq_len + 1], a function of (seed, step) only."""
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, self.tokens.size - self.seq_len + 1, self.batch)
        body = np.stack([self.tokens[s: s + self.seq_len] for s in starts]).astype(np.int32)
        return np.concatenate([np.full((self.batch, 1), self.bos_id, np.int32), body], axis=1)


@dataclass(frozen=True)
class Rows:
    """Training batches [batch, seq_len + 1] drawn from fixed windows (`tools/target_outputs.py`: the target's own
    greedy continuations), rows chosen by `default_rng([seed, step])` as `Windows` draws its offsets."""

    rows: np.ndarray  # [n, seq_len + 1] int, each row BOS first
    batch: int
    seed: int

    @classmethod
    def load(cls, path: str | Path, seq_len: int, batch: int, seed: int, bos_id: int, vocab_size: int) -> Rows:
        """The windows in a .npy file, checked against the run (the error names the field dspark_data)."""
        path = Path(path)
        if not path.is_file():
            raise DataError(f"dspark_data {path} is not a file (write it with tools/target_outputs.py)")
        rows = np.load(path)
        if rows.ndim != 2 or rows.shape[1] != seq_len + 1 or not np.issubdtype(rows.dtype, np.integer):
            raise DataError(f"dspark_data {path} holds {rows.dtype} {rows.shape}, not integer rows of seq_len + 1 = "
                            f"{seq_len + 1} tokens")
        if not len(rows) or (rows[:, 0] != bos_id).any() or rows.min() < 0 or rows.max() >= vocab_size:
            raise DataError(f"dspark_data {path}: rows must be non-empty, begin with BOS {bos_id} and hold ids "
                            f"below {vocab_size}")
        return cls(rows.astype(np.int32), batch, seed)

    def batch_at(self, step: int) -> np.ndarray:
        """int32 [batch, seq_len + 1], a function of (seed, step) only."""
        return self.rows[np.random.default_rng([self.seed, step]).integers(0, len(self.rows), self.batch)]


def eval_windows(tokens: np.ndarray, seq_len: int, limit: int | None = None, bos_id: int = 0) -> np.ndarray:
    """int32 [n, seq_len + 1]: BOS + consecutive non-overlapping slices of `tokens` (the first `limit`)."""
    n = tokens.size // seq_len if limit is None else min(limit, tokens.size // seq_len)
    body = tokens[: n * seq_len].reshape(n, seq_len).astype(np.int32)
    return np.concatenate([np.full((n, 1), bos_id, np.int32), body], axis=1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m dsv41.train.data", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_DATA_DIR, help=f"output folder (default {DEFAULT_DATA_DIR})")
    ap.add_argument("--package-root", type=Path, default=None,
                    help="an already extracted r-cran-janeaustenr (skips apt-get download)")
    ap.add_argument("--vocab-size", type=int, default=8192, help="tokenizer ids, special tokens included")
    a = ap.parse_args(argv)
    try:
        stats = prepare(a.out, package_root=a.package_root, vocab_size=a.vocab_size)
    except DataError as e:
        raise SystemExit(f"error: {e}") from None
    print(json.dumps(stats, indent=1))
    print(f"prepared {a.out}")


if __name__ == "__main__":
    main()
