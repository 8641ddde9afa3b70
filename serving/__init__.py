"""Serving DeepSeek-V4.1 models: `LLM` (offline), `SamplingParams`, and `python -m serving.server`.

Imported lazily so that light tools (the benchmark client, the HF baseline) can live in this package without
pulling in JAX.
"""

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from serving.llm import LLM

        return LLM
    if name == "SamplingParams":
        from serving.runtime.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'serving' has no attribute {name!r}")
