"""The bucket-padding benchmark times a step on each bucket that holds it, and only those."""

import pytest

from serving.bench.bucket_padding import build_parser, format_table, measure

pytestmark = pytest.mark.slow  # the second tier (`make test-slow`; tests/README.md)


def test_each_step_is_timed_on_every_bucket_that_holds_it():
    args = build_parser().parse_args(["--model", "tiny", "--token-buckets", "2,8", "--max-num-seqs", "2",
                                      "--decode-batches", "1,2", "--prefill-lengths", "8", "--context", "6",
                                      "--repeats", "1"])
    result = measure(args)
    assert sorted(result["decode_s"]) == ["1@2", "1@8", "2@2", "2@8"] and list(result["prefill_s"]) == ["8@8"]
    assert all(0 < s < 60 for s in [*result["decode_s"].values(), *result["prefill_s"].values()])
    table = format_table(result)
    assert "decode rows" in table and "prefill tokens" in table and len(table.splitlines()) == 6
