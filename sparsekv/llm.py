"""`LLM`: the offline batch API, shaped like vLLM's."""
from __future__ import annotations

from .config import EngineConfig
from .engine import LLMEngine
from .request import RequestOutput, SamplingParams


class LLM:
    """LLM(model, dtype=..., max_model_len=..., ...).generate(prompts, SamplingParams(...))."""

    def __init__(self, model: str | None = None, **engine_options):
        from .paths import default_model_path
        self.engine = LLMEngine(EngineConfig(model=model or default_model_path(), **engine_options))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [self.engine.add_request(None, p, sp).request_id for p, sp in zip(prompts, params)]
        finished: dict[str, RequestOutput] = {}
        progress = _progress(len(ids)) if use_tqdm else None
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        progress and progress.update(1)
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        finally:
            progress and progress.close()
        return [finished[rid] for rid in ids]

    def stats(self) -> dict:
        return self.engine.stats()


def _progress(total: int):
    from tqdm import tqdm
    return tqdm(total=total, desc="generate")
