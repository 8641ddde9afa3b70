"""`python -m serving.bench.serve`: streaming load generator for any OpenAI-compatible server.

    python -m serving.bench.serve --base-url http://127.0.0.1:8000 --model NAME \
        --dataset random --input-len 512 --output-len 64 --num-prompts 32 --max-concurrency 8 --ignore-eos

Endpoints: `completions` (default; prompts are token-id lists, so lengths are exact) and `chat` (text
messages, see `workloads.Turn.chat_messages`). Datasets: `random` and `prefix-repetition` (with `--turns N`
a session's turn k re-sends the conversation so far plus a new suffix; turns of a session run in order,
sessions run concurrently, each with its own `X-Session-ID`). Load model: `--max-concurrency` lanes, each
running whole sessions one after another (AgentX's lanes; for one-turn sessions this is vLLM's in-flight
cap). Failed requests are counted and reported; the run goes on. Metric definitions: `metrics.py`.
`--profile` (as `vllm bench serve --profile`): the server traces the timed run - `POST /start_profile` after the
warm-ups, `POST /stop_profile` at the end (our server needs `--profile-dir`); the trace folder is reported.
`run(args) -> dict` is the whole benchmark without printing, for tests and `side_by_side.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path

import httpx

from serving.bench import workloads
from serving.bench.metrics import RequestRecord, summarize
from serving.bench.workloads import Session, Turn

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serving.bench.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (with or without /v1)")
    p.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
    p.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--dataset", choices=["random", "prefix-repetition"], default="random")
    p.add_argument("--num-prompts", type=int, default=32,
                   help="requests (random) or sessions (prefix-repetition; each has --turns requests)")
    p.add_argument("--input-len", type=int, default=512, help="random: prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens of every request")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in [L(1-r), L(1+r)] (vLLM's --random-range-ratio)")
    p.add_argument("--num-prefixes", type=int, default=4, help="prefix-repetition: distinct shared prefixes")
    p.add_argument("--prefix-len", type=int, default=256, help="prefix-repetition: shared prefix tokens")
    p.add_argument("--suffix-len", type=int, default=64, help="prefix-repetition: new user tokens per turn")
    p.add_argument("--turns", type=int, default=1, help="prefix-repetition: turns per session")
    p.add_argument("--token-id-range", default="10,8000", help="prompt ids drawn uniformly from [LOW, HIGH)")
    p.add_argument("--seed", type=int, default=0, help="dataset seed")
    p.add_argument("--max-concurrency", type=int, default=None, help="lanes (default: every session at once)")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos and min_tokens = max_tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--num-warmups", type=int, default=0,
                   help="random prompts sent first and left out of the metrics (own seed stream: they do not "
                        "prime the prefix cache for the measured prompts)")
    p.add_argument("--percentiles", default="50,90,99", help="latency percentiles to report")
    p.add_argument("--goodput", nargs="*", default=[], metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000")
    p.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")
    p.add_argument("--output-json", default=None, help="write the summary (and settings) here")
    p.add_argument("--save-requests", action="store_true", help="add every request's record to the JSON")
    p.add_argument("--profile", action="store_true",
                   help="have the server trace the timed run (POST /start_profile, /stop_profile; our server "
                        "needs --profile-dir)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    check_args(args)
    return args


def _floats(text: str, what: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated numbers, got {text!r}") from None


def token_id_range(args: argparse.Namespace) -> tuple[int, int]:
    parts = args.token_id_range.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--token-id-range: expected LOW,HIGH, got {args.token_id_range!r}")
    return int(parts[0]), int(parts[1])


def goodput_slos(args: argparse.Namespace) -> dict[str, float]:
    out = {}
    for item in args.goodput:
        name, _, ms = item.partition(":")
        try:
            out[name] = float(ms)
        except ValueError:
            raise ValueError(f"--goodput: expected METRIC:MS, got {item!r}") from None
    return out


def check_args(args: argparse.Namespace) -> None:
    """Fail early, naming the flag, instead of deep inside the run."""
    for name in ("num_prompts", "output_len", "input_len", "turns"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups must be >= 0, got {args.num_warmups}")
    if args.turns > 1 and args.dataset != "prefix-repetition":
        raise ValueError("--turns > 1 needs --dataset prefix-repetition")
    if args.temperature < 0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    bad = [q for q in _floats(args.percentiles, "--percentiles") if not 0 < q < 100]
    if bad:
        raise ValueError(f"--percentiles must lie in (0, 100), got {bad}")
    token_id_range(args)
    goodput_slos(args)


def make_sessions(args: argparse.Namespace) -> list[Session]:
    ids = token_id_range(args)
    if args.dataset == "random":
        return workloads.random_sessions(args.num_prompts, args.input_len, args.output_len,
                                         range_ratio=args.range_ratio, token_id_range=ids, seed=args.seed)
    return workloads.prefix_repetition_sessions(args.num_prompts, args.num_prefixes, args.prefix_len,
                                                args.suffix_len, args.output_len, turns=args.turns,
                                                token_id_range=ids, seed=args.seed)


def request_body(args: argparse.Namespace, model: str, turn: Turn) -> dict:
    body = {"model": model, "max_tokens": turn.output_len, "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.endpoint == "completions":
        body["prompt"] = turn.prompt_ids
    else:
        body["messages"] = turn.chat_messages()
    if args.ignore_eos:
        body.update(ignore_eos=True, min_tokens=turn.output_len)
    return body


def _error_message(status: int, raw: bytes) -> str:
    try:
        data = json.loads(raw)
        msg = data["error"]["message"] if isinstance(data.get("error"), dict) else data.get("detail", data)
    except (ValueError, AttributeError, KeyError, TypeError):
        msg = raw.decode("utf-8", "replace")
    return f"HTTP {status}: {str(msg)[:500]}"


def _has_output(choice: dict) -> bool:
    """A chunk that carries generated output (a completions text, or a chat delta that is not the
    opening role-only chunk), as vLLM's client decides."""
    if "text" in choice:
        return choice["text"] is not None
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return False
    if any(delta.get(k) for k in ("content", "reasoning_content", "reasoning", "tool_calls")):
        return True
    return delta.get("content") == "" and "role" not in delta


async def send_request(client: httpx.AsyncClient, url: str, headers: dict, body: dict, record: RequestRecord
                       ) -> RequestRecord:
    """Stream one request into `record` (times, usage, error)."""
    record.send_time = time.perf_counter()
    usage = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                record.error = _error_message(resp.status_code, await resp.aread())
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, ": ping" comments, event names
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    now = time.perf_counter()
                    data = json.loads(payload)
                    if data.get("error"):
                        err = data["error"]
                        record.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
                        break
                    if (choices := data.get("choices")) and _has_output(choices[0]):
                        record.chunk_times.append(now)
                    if data.get("usage"):
                        usage = data["usage"]
    except (httpx.HTTPError, ValueError) as e:
        record.error = f"{type(e).__name__}: {e}"
    record.end_time = time.perf_counter()
    if record.error is None and not record.chunk_times:
        record.error = "the stream carried no output chunk"
    if usage:
        record.prompt_tokens = int(usage.get("prompt_tokens") or record.prompt_tokens)
        record.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            record.cached_tokens = int(details["cached_tokens"])
    if not record.completion_tokens:
        record.completion_tokens = len(record.chunk_times)  # no usage: one token per chunk, as vLLM
    return record


async def run_sessions(client: httpx.AsyncClient, args: argparse.Namespace, model: str, sessions: list[Session],
                       lanes: int) -> list[RequestRecord]:
    """`lanes` workers; each takes the next session and runs its turns one after another."""
    url = args.base_url.rstrip("/").removesuffix("/v1") + ENDPOINTS[args.endpoint]
    base_headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    queue = deque(sessions)
    records: list[RequestRecord] = []

    async def lane() -> None:
        while queue:
            s = queue.popleft()
            headers = {**base_headers, "X-Session-ID": s.session_id}
            for k, turn in enumerate(s.turns):
                rec = RequestRecord(send_time=0.0, end_time=0.0, prompt_tokens=turn.prompt_len,
                                    session_id=s.session_id, turn=k)
                records.append(await send_request(client, url, headers, request_body(args, model, turn), rec))

    await asyncio.gather(*(lane() for _ in range(max(1, min(lanes, len(sessions))))))
    return records


async def _served_model(client: httpx.AsyncClient, args: argparse.Namespace) -> str:
    url = args.base_url.rstrip("/").removesuffix("/v1") + "/v1/models"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    resp = await client.get(url, headers=headers)
    if resp.status_code != 200 or not resp.json().get("data"):
        raise RuntimeError(f"--model not given and GET {url} gave no model ({resp.status_code}: {resp.text[:200]})")
    return resp.json()["data"][0]["id"]


async def _profile_call(client: httpx.AsyncClient, args: argparse.Namespace, route: str) -> dict:
    """POST a profiler route; a refusal is an error naming the route and the server's message."""
    url = args.base_url.rstrip("/").removesuffix("/v1") + route
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    resp = await client.post(url, headers=headers)
    if resp.status_code != 200:
        raise RuntimeError(f"--profile: POST {route} failed: {_error_message(resp.status_code, resp.content)}")
    try:
        return resp.json()
    except ValueError:  # vLLM answers with an empty body
        return {}


async def _benchmark(args: argparse.Namespace, transport: httpx.AsyncBaseTransport | None
                     ) -> tuple[str, list[RequestRecord], list[RequestRecord], dict | None]:
    sessions = make_sessions(args)
    lanes = args.max_concurrency or len(sessions)
    limits = httpx.Limits(max_connections=lanes + 1, max_keepalive_connections=lanes + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout, connect=30.0), limits=limits,
                                 transport=transport) as client:
        model = args.model or await _served_model(client, args)
        warm = []
        if args.num_warmups:
            first = sessions[0].turns[0]
            warm_sessions = workloads.warmup_sessions(args.num_warmups, first.prompt_len, first.output_len,
                                                      token_id_range=token_id_range(args), seed=args.seed)
            warm = await run_sessions(client, args, model, warm_sessions, min(lanes, args.num_warmups))
        profile = None
        if args.profile:
            await _profile_call(client, args, "/start_profile")
        try:
            records = await run_sessions(client, args, model, sessions, lanes)
        finally:
            if args.profile:
                profile = await _profile_call(client, args, "/stop_profile")
    return model, warm, records, profile


def run(args: argparse.Namespace, transport: httpx.AsyncBaseTransport | None = None) -> dict:
    """Run the benchmark; returns {"settings", "summary", "errors"[, "requests"][, "profile"]} and writes
    --output-json. `transport` replaces the network (tests pass an `httpx.MockTransport`)."""
    check_args(args)
    model, warm, records, profile = asyncio.run(_benchmark(args, transport))
    errors: dict[str, int] = {}
    for r in records:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    settings = {k: v for k, v in vars(args).items() if k != "api_key"}
    settings["model"] = model
    settings["lanes"] = args.max_concurrency or "all"
    result = {"settings": settings,
              "summary": summarize(records, _floats(args.percentiles, "--percentiles"), goodput_slos(args)),
              "warmup_failed": sum(1 for r in warm if not r.ok),
              "errors": [{"error": e, "count": n} for e, n in sorted(errors.items(), key=lambda x: -x[1])]}
    if args.save_requests:
        result["requests"] = [asdict(r) for r in records]
    if profile is not None:
        result["profile"] = profile  # the server's answer to /stop_profile (ours: the trace folder and files)
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(result, indent=1))
    return result


def format_report(result: dict) -> str:
    s, cfg = result["summary"], result["settings"]
    pcts = [k[: -len("_ttft_ms")] for k in s if k.startswith("p") and k.endswith("_ttft_ms")]
    lines = [f"{' Serving Benchmark Result ':=^64}",
             f"{'Model / endpoint / dataset:':<40} {cfg['model']} / {cfg['endpoint']} / {cfg['dataset']}",
             f"{'Lanes (max concurrency):':<40} {cfg['lanes']}"]

    def row(label, value, fmt="{:.2f}"):
        lines.append(f"{label:<40} {'n/a' if value is None else fmt.format(value)}")

    row("Successful requests:", s["completed"], "{}")
    row("Failed requests:", s["failed"], "{}")
    row("Benchmark duration (s):", s["duration"])
    row("Total input tokens (incl. cached):", s["total_input_tokens"], "{}")
    row("Total cached input tokens (usage):", s["total_cached_tokens"], "{}")
    row("Total generated tokens:", s["total_output_tokens"], "{}")
    row("Request throughput (req/s):", s["request_throughput"])
    if "request_goodput" in s:
        row("Request goodput (req/s):", s["request_goodput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Peak output token throughput (tok/s):", s["max_output_tokens_per_s"])
    row("Total token throughput (tok/s):", s["total_token_throughput"])
    row("Prefix-hit rate (cached / prompt):", s["prefix_hit_rate"], "{:.2%}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency (pooled gaps)"), ("e2el", "End-to-end Latency")):
        lines.append(f"{title:-^64}")
        for stat in ("mean", "median", *pcts):
            row(f"{stat.upper() if stat in pcts else stat.capitalize()} {name.upper()} (ms):", s[f"{stat}_{name}_ms"])
    lines.append(f"{'Interactivity (InferenceX: 1 / per-request ITL)':-^64}")
    for k in [k for k in s if k.endswith("_interactivity_tok_s")]:
        stat = k.split("_")[0]
        row(f"{stat.upper() if stat != 'mean' else 'Mean'} interactivity (tok/s/user):", s[k])
    for e in result["errors"][:10]:
        lines.append(f"error x{e['count']}: {e['error']}")
    lines.append("=" * 64)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        result = run(args)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_report(result))
    if "profile" in result:
        print(f"server trace of the timed run (/start_profile .. /stop_profile): "
              f"{result['profile'].get('trace_dir', 'written by the server')}")
    if args.output_json:
        print(f"wrote {args.output_json}")
    return 0 if result["summary"]["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
