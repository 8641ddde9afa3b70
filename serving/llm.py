"""The offline API for notebooks and scripts (vLLM's shape):

    from serving import LLM, SamplingParams
    llm = LLM()                                   # built-in nano-austen; or LLM("path/to/checkpoint", max_num_seqs=16)
    out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
    print(out[0].outputs[0].text)

All prompts are queued at once and run through the same continuous-batching engine as the server.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import dsv41
from serving.engine.args import EngineArgs, field_names, route_keywords
from serving.engine.engine import Engine
from serving.engine.request import TokenLogprob
from serving.model_source import ModelArgs, ModelSource, load_model
from serving.runtime.exe_cache import DEFAULT_CACHE_DIR, ExecutableCacheSettings
from serving.runtime.sampling_params import SamplingParams
from serving.text.encoding import encode_messages


@dataclass
class Completion:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[TokenLogprob] | None


@dataclass
class GenerateResult:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[Completion]
    num_cached_tokens: int
    prompt_logprobs: list[TokenLogprob | None] | None


Prompt = str | Sequence[int] | dict


class LLM:
    def __init__(self, model: str | dsv41.Model | None = None, *, tokenizer=None, progress: bool = True,
                 compilation_cache_dir: str | None = str(DEFAULT_CACHE_DIR), **config):
        """`model`: a checkpoint folder, a preset name, None (the built-in nano-austen, `dsv41.nano`) or a
        `dsv41.Model`. `compilation_cache_dir`: where the compiled step programs are kept, the server's
        `--compilation-cache-dir` and default, so a new LLM or a server with the same configuration loads them
        instead of compiling ('' or None: nowhere).
        `config`: flat keywords, each a field of `ModelArgs` (dtype, served_model_name) or of a section of
        `EngineArgs` (max_num_seqs=16, block_size=8, seed=..., tensor_parallel_size=...); an unknown one is a
        TypeError naming it."""
        routed = route_keywords(config, {"model": field_names(ModelArgs) - {"model"},
                                         "engine": EngineArgs.field_names()}, "LLM")
        model_args = ModelArgs(model if isinstance(model, str) else None, **routed["model"])
        engine_args = EngineArgs.of(**routed["engine"])
        engine_args.parallel.use_cpu_devices()  # before the model is loaded: JAX's backends start then
        if isinstance(model, dsv41.Model):
            src = ModelSource(model, tokenizer, model_args.served_model_name or "dsv41", "in-memory model")
        else:
            src = load_model(model_args, engine_args.runtime.seed, engine_args.parallel, progress=progress)
            src.tokenizer = tokenizer or src.tokenizer
        self.source = src
        self.tokenizer = src.tokenizer
        self.engine = Engine(src.model, src.tokenizer, engine_args, model_name=src.name, progress=progress,
                             executable_cache=ExecutableCacheSettings.in_cache_dir(compilation_cache_dir))
        self._counter = 0

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[GenerateResult]:
        """Prompts: text, token ids, or {"prompt_token_ids": [...]} - one or a list; results in input order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, Sequence) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        results, owners = [], {}
        for prompt, p in zip(prompts, params):
            text, ids = self._prompt_ids(prompt)
            rid = f"offline-{self._counter}"
            self._counter += 1
            res = GenerateResult(rid, text, ids, [], 0, None)
            for i in range(p.n):
                sub = dataclasses.replace(p, n=1, seed=None if p.seed is None else p.seed + i)
                self.engine.add_request(f"{rid}-{i}", ids, sub)
                owners[f"{rid}-{i}"] = (res, i)
                res.outputs.append(Completion(i, "", [], None, None, [] if p.logprobs is not None else None))
            results.append(res)
        while self.engine.has_unfinished():
            for o in self.engine.step():
                res, i = owners[o.request_id]
                c = res.outputs[i]
                c.text += o.new_text
                c.token_ids += o.new_token_ids
                if o.new_logprobs:
                    c.logprobs += o.new_logprobs
                if o.prompt_logprobs is not None:
                    res.prompt_logprobs = o.prompt_logprobs
                res.num_cached_tokens = o.num_cached_tokens
                if o.finished:
                    c.finish_reason, c.stop_reason = o.finish_reason, o.stop_reason
        return results

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None, *,
             tools: list[dict] | None = None, thinking: bool | None = None,
             reasoning_effort: str | int | None = None) -> list[GenerateResult]:
        """Chat conversations encoded in the V4.1 prompt format (thinking on at effort 50 by default)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [encode_messages(m, tools=tools, thinking=thinking, reasoning_effort=reasoning_effort)
                   for m in convs]
        return self.generate(prompts, sampling_params)

    def _prompt_ids(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError("a dict prompt needs 'prompt_token_ids'")
            return None, [int(t) for t in prompt["prompt_token_ids"]]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; this model has none (pass token ids)")
            return prompt, [self.tokenizer.bos_id] + self.tokenizer.encode(prompt)  # BOS once, as V4.1 expects
        return None, [int(t) for t in prompt]
