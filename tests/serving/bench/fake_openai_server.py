"""A stand-in for `python -m serving.server` in the side-by-side tests: takes issue #4's CLI flags, serves
/health, /v1/models and streaming /v1/completions (one 'x' per token, 10 ms apart, usage with cached tokens
= the longest prefix shared with an earlier prompt, at whole-prompt granularity)."""

import argparse
import asyncio
import json
import sys

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


# Paced so the client's TPOT has a known floor; 10 ms leaves room for a chunk that arrives late on a loaded
# machine (the measured gap between the first and the last token can only shrink by such jitter, not vanish).
TOKEN_INTERVAL_S = 0.010


def main(argv):
    if argv[:2] == ["-m", "serving.server"]:  # invoked as "<python> -m serving.server ..." via a wrapper
        argv = argv[2:]
    p = argparse.ArgumentParser()
    for flag in ("--model", "--served-model-name", "--host", "--dtype"):
        p.add_argument(flag)
    for flag in ("--port", "--max-num-seqs", "--max-num-batched-tokens", "--max-model-len", "--seed"):
        p.add_argument(flag, type=int)
    a = p.parse_args(argv)
    app = FastAPI()
    seen: list[list[int]] = []

    @app.get("/health")
    async def health():
        return {}

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": a.served_model_name, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        prompt, n = body["prompt"], body["max_tokens"]
        if len(prompt) + n > a.max_model_len:
            return JSONResponse({"error": {"message": f"prompt + max_tokens > max_model_len {a.max_model_len}"}},
                                status_code=400)
        cached = max((len(s) for s in seen if prompt[:len(s)] == s), default=0)
        seen.append(prompt)

        async def events():
            for _ in range(n):
                await asyncio.sleep(TOKEN_INTERVAL_S)
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': 'x'}]})}\n\n"
            usage = {"prompt_tokens": len(prompt), "completion_tokens": n,
                     "prompt_tokens_details": {"cached_tokens": cached}}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")


if __name__ == "__main__":
    main(sys.argv[1:])
