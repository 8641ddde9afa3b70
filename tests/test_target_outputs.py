"""`tools/target_outputs.py`: the drafter's training windows from the target's own greedy continuations - each row
BOS, a slice of the training split, then the model's continuation, and the file `dsv41.train`'s `dspark_data` reads.
The real tool runs the served engine (docs/benchmarks/spec-decode.md); here a fake LLM stands in for it."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from dsv41.train.data import DataError, Rows

_spec = importlib.util.spec_from_file_location("target_outputs",
                                               Path(__file__).resolve().parents[1] / "tools" / "target_outputs.py")
target_outputs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(target_outputs)


class _CountingLLM:
    """Continues each prompt with its last token + 1, + 2, ...: a continuation that depends on its prompt."""

    def generate(self, prompts, params):
        assert params.temperature == 0 and params.ignore_eos
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[p["prompt_token_ids"][-1] + i + 1
                                                                    for i in range(params.max_tokens)])])
                for p in prompts]


def test_rows_are_prompt_slices_then_their_continuations_and_load_as_dspark_data(tmp_path):
    train = np.arange(5, 2005, dtype=np.uint16)  # token t sits at offset t - 5
    prompts = target_outputs.prompts(train, n=6, prompt_len=8, seed=3, bos_id=0)
    assert prompts == target_outputs.prompts(train, n=6, prompt_len=8, seed=3, bos_id=0)
    assert prompts != target_outputs.prompts(train, n=6, prompt_len=8, seed=4, bos_id=0)
    for p in prompts:  # BOS, then 7 consecutive training tokens
        assert p[0] == 0 and len(p) == 8 and p[1:] == list(range(p[1], p[1] + 7))
    rows = target_outputs.generate(_CountingLLM(), prompts, new_tokens=9)
    assert rows.shape == (6, 17) and rows.dtype == np.int32
    for p, row in zip(prompts, rows):
        assert list(row[:8]) == p and list(row[8:]) == [p[-1] + i + 1 for i in range(9)]
    np.save(tmp_path / "rows.npy", rows)
    drawn = Rows.load(tmp_path / "rows.npy", seq_len=16, batch=4, seed=0, bos_id=0, vocab_size=4096)
    assert drawn.batch_at(0).shape == (4, 17)
    with pytest.raises(DataError, match="seq_len"):
        Rows.load(tmp_path / "rows.npy", seq_len=32, batch=4, seed=0, bos_id=0, vocab_size=4096)
