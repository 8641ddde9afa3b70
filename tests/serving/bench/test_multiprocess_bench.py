"""serving.bench.multiprocess's pieces that need no server: the server flags hold the waves' concurrency on every
layout, and the comparison of two check sets finds a changed token or logprob."""

from serving.bench import multiprocess as bench
from serving.engine.args import EngineArgs
from serving.server import parse_args


def test_the_flags_parse_and_hold_the_concurrency():
    for layout, flags in bench.LAYOUTS.items():
        args = parse_args(["--model", "tiny", *flags, *bench.server_flags(64)]).engine
        assert isinstance(args, EngineArgs)
        assert args.runtime.max_num_seqs == 64 and max(args.runtime.token_buckets) == 64, layout
        assert not args.runtime.swa_bounded_replay


def test_compare_finds_differences():
    one = [{"tokens": [1, 2], "logprobs": [-1.0, -2.0]}, {"tokens": [3], "logprobs": [-0.5]}]
    same = bench.compare(one, [dict(r) for r in one])
    assert same == {"tokens_equal": True, "max_logprob_diff": 0.0}
    moved = bench.compare(one, [{"tokens": [1, 2], "logprobs": [-1.0, -2.25]}, one[1]])
    assert moved["tokens_equal"] and moved["max_logprob_diff"] == 0.25
    assert not bench.compare(one, [one[0], {"tokens": [4], "logprobs": [-0.5]}])["tokens_equal"]
