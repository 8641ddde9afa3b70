"""`python -m serving.bench.spec_server`: DSpark on against off through the server, as a user starts it.

Two servers on the built-in nano-austen with default flags, one of them with `--speculative-config '{"method":
"dspark"}'` (adaptive k, the default), both measured once every program is compiled (the banner's "all programs
compiled"). At each concurrency c: waves of max(2c, 8) held-out *Persuasion* passages (64 tokens, fresh ones each
wave: no prefix hits), 64 greedy tokens each (ignore_eos, no min_tokens), c lanes; one warm-up wave per server
(the speculation policy measures its arms there), then `--repeats` pairs of waves, off / on, then on / off, and so
on. Output tok/s of a wave = its output tokens / its wall time; medians. For the speculating server: the steps it ran
by k and its acceptance during the measured waves (`/metrics`), and how many outputs equal the plain server's.

    python -m serving.bench.spec_server [--concurrency 1,2,4,8,16,32] [--repeats 3] [--json spec_server.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
from pathlib import Path

import httpx

from serving.bench.server_process import free_port, server_process, wait_until_all_compiled

SPEC = '{"method": "dspark"}'


def _command(port: int, spec: str | None, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "serving.server", "--port", str(port), *extra]
    return cmd + (["--speculative-config", spec] if spec else [])


async def _wave(url: str, prompts: list[list[int]], c: int, max_tokens: int) -> tuple[float, list[list[int]]]:
    """(output tok/s, each request's output ids) of the prompts sent over c lanes."""
    outs: list[list[int] | None] = [None] * len(prompts)
    todo = iter(range(len(prompts)))

    async def lane(client: httpx.AsyncClient):
        for i in todo:
            r = await client.post(url + "/v1/completions", json={
                "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            r.raise_for_status()
            outs[i] = r.json()["choices"][0]["token_ids"]

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(lane(client) for _ in range(c)))
    return sum(map(len, outs)) / (time.perf_counter() - start), outs


def _counters(url: str) -> dict[str, float]:
    """The speculating server's step and acceptance counters, by name{label}."""
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        m = re.match(r'(vllm:spec_decode_num_\w+_total|dsv41:spec_decode_steps_total)\{([^}]*)\} (\S+)', line)
        if m:
            k = re.search(r'k="(\d+)"', m.group(2))
            out[m.group(1) + (f"[{k.group(1)}]" if k else "")] = float(m.group(3))
    return out


def measure(urls: dict[str, str], c: int, args, passages) -> dict:
    n = max(2 * c, 8)
    waves = iter(range(10_000))

    def prompts():
        w = next(waves)
        return [list(map(int, p)) for p in passages[w * n:(w + 1) * n]]

    for url in urls.values():  # warm-up: the policy's trials at this concurrency
        asyncio.run(_wave(url, prompts(), c, args.max_tokens))
    before = _counters(urls["on"])
    rates, equal, total = {"off": [], "on": []}, 0, 0
    for r in range(args.repeats):
        batch, got = prompts(), {}
        for name in ("off", "on") if r % 2 == 0 else ("on", "off"):  # a VM slowing or speeding favours neither
            rate, got[name] = asyncio.run(_wave(urls[name], batch, c, args.max_tokens))
            rates[name].append(rate)
        equal += sum(a == b for a, b in zip(got["off"], got["on"]))
        total += len(batch)
    after = _counters(urls["on"])
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    steps = {int(k[k.index("[") + 1:-1]): int(v) for k, v in delta.items() if k.startswith("dsv41:spec_decode_steps")}
    drafts = delta.get("vllm:spec_decode_num_drafts_total", 0.0)
    med = {name: statistics.median(v) for name, v in rates.items()}
    row = {"concurrency": c, "requests_per_wave": n, "tok_s_off": med["off"], "tok_s_on": med["on"],
           "on_over_off": med["on"] / med["off"], "waves": rates, "steps_by_k": dict(sorted(steps.items())),
           "acceptance_length": 1 + delta.get("vllm:spec_decode_num_accepted_tokens_total", 0.0) / drafts
           if drafts else None, "outputs_equal": f"{equal}/{total}"}
    print(f"c={c}: off {med['off']:.1f} on {med['on']:.1f} tok/s (x{row['on_over_off']:.2f}); steps by k "
          f"{row['steps_by_k']}; acceptance {row['acceptance_length']}; equal {row['outputs_equal']}", flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m serving.bench.spec_server", description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--server-arg", action="append", default=[], help="an extra flag of both servers (repeatable)")
    ap.add_argument("--startup-timeout", type=float, default=1800.0)
    ap.add_argument("--log-dir", type=Path, default=Path("bench-logs/spec_server"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    from dsv41 import nano

    levels = [int(x) for x in args.concurrency.split(",")]
    need = sum((args.repeats + 2) * max(2 * c, 8) for c in levels)
    passages = nano.passages(args.prompt_len, need)
    ports = {"off": free_port(), "on": free_port()}
    logs = {name: args.log_dir / f"server-{name}.log" for name in ports}
    with server_process(_command(ports["off"], None, args.server_arg), ports["off"], logs["off"],
                        args.startup_timeout) as off_url:
        wait_until_all_compiled(logs["off"], args.startup_timeout)
        with server_process(_command(ports["on"], SPEC, args.server_arg), ports["on"], logs["on"],
                            args.startup_timeout) as on_url:
            wait_until_all_compiled(logs["on"], args.startup_timeout)
            urls = {"off": off_url, "on": on_url}
            offset = 0
            rows = []
            for c in levels:
                n = max(2 * c, 8)
                rows.append(measure(urls, c, args, passages[offset:]))
                offset += (args.repeats + 2) * n
    print("\n| concurrency | off tok/s | on (adaptive) tok/s | on / off | steps by k | acceptance length | equal |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        acc = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "-"
        print(f"| {r['concurrency']} | {r['tok_s_off']:.1f} | {r['tok_s_on']:.1f} | {r['on_over_off']:.2f} | "
              f"{r['steps_by_k']} | {acc} | {r['outputs_equal']} |")
    if args.json:
        args.json.write_text(json.dumps({"prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                                         "repeats": args.repeats, "server_args": args.server_arg, "rows": rows},
                                        indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
