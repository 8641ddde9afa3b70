"""The nano corpus: the held-out split is Persuasion alone, texts are hash-checked, batches depend on
(seed, step) only. With the corpus prepared (`python -m dsv41.train.data`) the real split is checked too."""

from pathlib import Path

import numpy as np
import pytest

from dsv41.train import data
from dsv41.train.data import DataError, Windows, check_hashes, eval_windows, split_texts, unigram_perplexity

FIXTURE = Path(__file__).parents[1] / "fixtures" / "nano" / "persuasion_excerpt.txt"
PREPARED = data.DEFAULT_DATA_DIR
needs_corpus = pytest.mark.skipif(not (PREPARED / "train.txt").is_file(),
                                  reason=f"corpus not prepared in {PREPARED} (python -m dsv41.train.data)")


def persuasion_passage() -> str:
    return FIXTURE.read_text(encoding="utf-8").split("====\n", 1)[1]


def test_split_holds_persuasion_out():
    novels = {name: f"text of {name}\n" for name in data.NOVEL_SHA256}
    split = split_texts(novels)
    assert split["heldout"] == ["text of persuasion\n"]
    assert len(split["train"]) == 5 and not any("persuasion" in t for t in split["train"])
    assert data.HELDOUT_NOVEL not in data.TRAIN_NOVELS


def test_hash_check_refuses_changed_text():
    with pytest.raises(DataError, match="novel persuasion: sha256"):
        check_hashes({"persuasion": persuasion_passage()})


def test_windows_depend_on_seed_and_step_only():
    tokens = np.arange(3, 1003, dtype=np.uint16)
    w = Windows(tokens, seq_len=16, batch=3, seed=7)
    a, b = w.batch_at(5), Windows(tokens, 16, 3, seed=7).batch_at(5)
    assert a.shape == (3, 17) and np.array_equal(a, b) and np.all(a[:, 0] == 0)
    assert np.all(np.diff(a[:, 1:], axis=1) == 1)  # consecutive corpus tokens after the BOS
    assert not np.array_equal(a, w.batch_at(6)) and not np.array_equal(a, Windows(tokens, 16, 3, seed=8).batch_at(5))
    ev = eval_windows(tokens, 100, limit=4)
    assert ev.shape == (4, 101) and np.array_equal(ev[1, 1:], tokens[100:200])


def test_unigram_perplexity():
    assert unigram_perplexity(np.array([0, 1] * 50), np.array([0, 1]), 2) == pytest.approx(2.0)
    assert unigram_perplexity(np.array([0] * 98), np.array([1]), 2) == pytest.approx(100.0)


def test_missing_corpus_names_the_prep_command(tmp_path):
    with pytest.raises(DataError, match="python -m dsv41.train.data"):
        data.load_tokens(tmp_path, "train")


@needs_corpus
def test_prepared_split_keeps_persuasion_out_of_training():
    train = (PREPARED / "train.txt").read_text(encoding="utf-8")
    heldout = (PREPARED / "heldout.txt").read_text(encoding="utf-8")
    passage = persuasion_passage()
    probe = passage.split("\n\n")[0]  # "Sir Walter Elliot, of Kellynch Hall, ..." (its first paragraph)
    assert probe in heldout and probe not in train
    assert heldout.startswith("Persuasion") and "Kellynch" not in train
    train_ids, heldout_ids = data.load_tokens(PREPARED, "train"), data.load_tokens(PREPARED, "heldout")
    assert train_ids.size > 5 * heldout_ids.size > 0
