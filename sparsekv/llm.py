"""`LLM`: the offline batch API, shaped like vLLM's."""
from __future__ import annotations

import threading
from dataclasses import replace

from .config import EngineConfig
from .engine import LLMEngine
from .input_processor import TEMPLATE_RESERVED
from .request import InvalidRequest, RequestOutput, SamplingParams
from .sampling_params import choice_seed


def build_engine(config: EngineConfig):
    """The engine for `config`: an `LLMEngine`, or with data_parallel_size > 1 the front end over that
    many data-parallel ranks (parallel/data_parallel.py), which answers the same calls."""
    if config.data_parallel_size > 1:
        from .parallel.data_parallel import DataParallelEngine
        return DataParallelEngine(config)
    return LLMEngine(config)


def _prompt_list(prompts) -> list:
    """`generate`'s prompts as a list: one prompt (text, token ids or a dict prompt) or a list of them."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts and _is_token(prompts[0])):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts: a prompt (text, token ids, {{'prompt': ...}} or {{'prompt_token_ids': ...}}) "
                        f"or a list of them, got {type(prompts).__name__}")
    return list(prompts)


def _is_token(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _params_list(sampling_params, num_prompts: int) -> list[SamplingParams]:
    if isinstance(sampling_params, (list, tuple)):
        params = list(sampling_params)
        if len(params) != num_prompts:
            raise ValueError(f"{num_prompts} prompts but {len(params)} sampling params")
    else:
        params = [sampling_params or SamplingParams()] * num_prompts
    for sp in params:
        if not isinstance(sp, SamplingParams):
            raise TypeError(f"sampling_params: a SamplingParams or a list of them, got {type(sp).__name__}")
    return params


def _choices(prompts: list, params: list[SamplingParams]) -> tuple[list, list[SamplingParams]]:
    """Each prompt once per choice, with that choice's params (n = 1, its own seed)."""
    flat_prompts, flat_params = [], []
    for prompt, sp in zip(prompts, params):
        for i in range(sp.n):
            flat_prompts.append(prompt)
            flat_params.append(sp if sp.n == 1 else replace(sp, n=1, seed=choice_seed(sp.seed, i)))
    return flat_prompts, flat_params


def _by_prompt(outputs: list[RequestOutput], params: list[SamplingParams]) -> list[RequestOutput]:
    """The choices' outputs grouped back per prompt: the first choice's output, holding all of them."""
    grouped, at = [], 0
    for sp in params:
        choices = outputs[at:at + sp.n]
        at += sp.n
        for i, choice in enumerate(choices):
            choice.index = i
        choices[0].other_choices = choices[1:]
        grouped.append(choices[0])
    return grouped


def _conversation_list(messages) -> list[list]:
    """`chat`'s messages as a list of conversations: one conversation (a list of message dicts) or a
    list of them."""
    if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], dict):
        return [list(messages)]
    if isinstance(messages, (list, tuple)) and all(isinstance(c, (list, tuple)) for c in messages):
        return [list(c) for c in messages]
    raise InvalidRequest("messages: a conversation (a list of {'role': ..., 'content': ...} dicts) or a list of "
                         "conversations", "messages")


def _template_messages(conversation: list) -> list[dict]:
    """A conversation as chat templates read it: each message a dict with a role, its content a string
    (OpenAI's text parts joined, as the server does; other parts are refused)."""
    out = []
    for message in conversation:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidRequest(f"messages: each message is a dict with a 'role', got {message!r:.80}", "messages")
        content = message.get("content")
        if isinstance(content, (list, tuple)):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise InvalidRequest("messages: only text content parts ({'type': 'text', 'text': ...}) are "
                                     "supported", "messages")
            message = {**message, "content": "".join(p["text"] for p in content)}
        out.append(message)
    return out


def _prompt_of(prompt):
    """A prompt as the engine takes it: text or token ids, also given as vLLM's TextPrompt
    ({"prompt": text}) or TokensPrompt ({"prompt_token_ids": ids})."""
    if not isinstance(prompt, dict):
        return prompt
    if set(prompt) == {"prompt"}:
        return prompt["prompt"]
    if set(prompt) == {"prompt_token_ids"}:
        return prompt["prompt_token_ids"]
    raise InvalidRequest(f"a dict prompt is {{'prompt': text}} or {{'prompt_token_ids': [ids]}}, got keys "
                         f"{sorted(prompt)}", "prompt")


class LLM:
    """LLM(model, dtype=..., max_model_len=..., ...).generate(prompts, SamplingParams(...))."""

    def __init__(self, model: str | None = None, **engine_options):
        from .paths import default_model_path
        self.engine = build_engine(EngineConfig(model=model or default_model_path(), **engine_options))
        self._generating = threading.Lock()  # one generate at a time: each steps the engine to its end

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order; with `n` > 1 its `outputs` hold the n choices (each
        a request of its own, seeded `choice_seed(seed, i)` as the server seeds them)."""
        prompts = [_prompt_of(p) for p in _prompt_list(prompts)]
        params = _params_list(sampling_params, len(prompts))
        with self._generating:  # NOTE: two threads stepping one engine at once corrupt its counts
            outputs = self._generate(*_choices(prompts, params), use_tqdm)
        return _by_prompt(outputs, params)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = False, chat_template: str | None = None, add_generation_prompt: bool = True,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: a conversation (a list of {"role", "content"} messages), or a list of them,
        rendered with the tokenizer's chat template (or `chat_template`), then generated. The reply's
        text is the model's, unparsed (the server splits reasoning and tool calls out of it)."""
        conversations = [_template_messages(c) for c in _conversation_list(messages)]
        if continue_final_message and add_generation_prompt:
            raise InvalidRequest("continue_final_message and add_generation_prompt cannot both be true",
                                 "continue_final_message")
        taken = sorted(TEMPLATE_RESERVED & set(chat_template_kwargs or {}))
        if taken:
            raise InvalidRequest(f"chat_template_kwargs: {', '.join(taken)} cannot be set there (an argument of "
                                 f"chat() or decided by it)", "chat_template_kwargs")
        options = {**(chat_template_kwargs or {}), "continue_final_message": continue_final_message}
        prompts = [self._chat_prompt(c, chat_template, add_generation_prompt, tools, options) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _chat_prompt(self, conversation: list[dict], template: str | None, add_generation_prompt: bool,
                     tools, kwargs: dict) -> list[int]:
        tokenizer = self.tokenizer
        if tokenizer is None:
            raise InvalidRequest("chat needs the checkpoint's tokenizer; this one has none", "messages")
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise InvalidRequest("the tokenizer has no chat template; pass chat_template=", "messages")
        text = tokenizer.apply_chat_template(conversation, tools=tools, chat_template=template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **kwargs)
        return tokenizer.encode(text, add_special_tokens=False)  # the template wrote the special tokens

    def _generate(self, prompts: list, params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        if getattr(self.engine, "paused", False):
            raise RuntimeError("generation is paused (pause_generation): continue_generation first")
        requests = self._add_all(prompts, params)
        ids = [r.request_id for r in requests]
        finished: dict[str, RequestOutput] = {}
        progress = GenerateProgress(self.engine, requests) if use_tqdm else None
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                progress and progress.update(len(finished))
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        finally:
            progress and progress.close(len(finished))
        return [finished[rid] for rid in ids]

    def _add_all(self, prompts: list, params: list[SamplingParams]) -> list:
        """Every prompt's request, or none: one refused (InvalidRequest) takes back those added before it."""
        requests = []
        try:
            for prompt, sp in zip(prompts, params):
                requests.append(self.engine.add_request(None, prompt, sp))
        except BaseException:
            for request in requests:
                self.engine.abort(request.request_id)
            raise
        return requests

    # -- for RL trainers (docs/rl.md) ----------------------------------------------------------
    def update_weights(self, named_tensors, policy: str = "drain") -> int:
        """Load (Hugging Face name, tensor) pairs into the running model (FP8 weights with their
        `weight_scale_inv`; names left out keep their values), checked whole first: a bad update raises
        `WeightUpdateError` and the old weights keep serving. The prefix cache forgets what the old
        weights computed. Returns the new `weights_version`."""
        self.engine.update_weights(named_tensors, policy)
        return self.engine.weights_version

    def update_weights_from_disk(self, path: str, policy: str = "drain") -> int:
        """`update_weights` from a checkpoint directory of the same architecture."""
        self.engine.update_weights_from_disk(path, policy)
        return self.engine.weights_version

    @property
    def weights_version(self) -> int:
        """How many weight updates this engine has loaded (0: the weights it started with)."""
        return self.engine.weights_version

    def flush_cache(self) -> int:
        """Forget every prefix-cache page in every tier; returns how many."""
        return self.engine.flush_cache()

    def stats(self) -> dict:
        return self.engine.stats()

    def close(self) -> None:
        """Save the prefix cache's pages to its disk tier and let go of it (`LLMEngine.close`)."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class GenerateProgress:
    """`use_tqdm`: one bar over the prompts' tokens, since a long prompt's prefill is most of the wait
    (a 1M-token prompt is hours on a CPU), with requests finished and tokens generated alongside.

    It reads the engine's counters after each step. Prompt tokens served by the prefix cache are never
    computed, so the bar may stop short of its total; recomputation after a preemption counts again,
    clamped to the total. tqdm's rate and ETA assume a steady pace, and a long sparse prefill slows
    down as the context grows (the indexer's scan is linear in it per token)."""

    def __init__(self, engine, requests):
        from tqdm import tqdm
        self.engine, self.num_requests = engine, len(requests)
        self.start = dict(engine.counters)
        total = sum(r.num_prompt_tokens for r in requests)
        self.bar = tqdm(total=total, unit="tok", unit_scale=True, desc="prefill", mininterval=1.0)

    def _since_start(self, name: str) -> int:
        return self.engine.counters[name] - self.start[name]

    def update(self, finished: int) -> None:
        done = min(self._since_start("prompt_tokens"), self.bar.total)
        self.bar.set_postfix(finished=f"{finished}/{self.num_requests}",
                             generated=self._since_start("generation_tokens"), refresh=False)
        self.bar.update(done - self.bar.n)

    def close(self, finished: int) -> None:
        self.update(finished)
        self.bar.close()
