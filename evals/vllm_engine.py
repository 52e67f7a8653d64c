"""kvpress-eval --engine vllm: the same samples, prompts and rows as the transformers path, answered by vLLM serving
kvpress (kvpress/integrations/vllm).

Each (policy, ratio) config gets an engine of its own with those settings (eager: an engine starts in seconds
instead of the ~90 s a compiled one takes), and every pending sample of the run goes through it as one batch of
requests, scheduled by vLLM. Greedy answers end at the model's stop tokens or the task's token budget, as
`evals.engine.answer` does. Both modes:
- query_aware: each prompt (context and question) is compressed where it ends;
- query_agnostic: each request declares its sample's context (`context_tokens`, docs/serving.md): the context is
  compressed where it ends (rounded down to whole pages; its last tokens are computed with the question), without
  the question, and the sample's other questions are handed the compacted context by the prefix cache.

Per row: kv_bytes = the K/V bytes of the tokens each layer keeps after the prompt, or after the context in
query_agnostic mode (as the transformers path counts them); cache_bytes = the engine's pages held then (whole
pages); prefill_s / decode_s = the request's own first-token and decode times in the shared engine (requests
overlap: `batch` says how many ran together); cached_tokens = prompt tokens handed from the prefix cache.
"""

from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import dataclass

from .metrics import score_prediction
from .samples import encode

PAGE = 128  # vLLM's default block size on CPU (its CPU attention takes multiples of 32)


@dataclass(frozen=True)
class Pending:
    """One prompt to answer: a sample's question under one config."""

    sample: object
    question: int
    length: int
    head: list
    tail: list


def settings_of(config) -> dict:
    """The engine's kvpress settings for an evals Config (policy spec + ratio)."""
    from .engine import parse_policy, takes_ratio

    name, params = parse_policy(config.policy)
    return {"policy": name, **params, **({"compression_ratio": config.ratio} if takes_ratio(config.policy) else {})}


def check(configs, modes, device: str) -> None:
    """Every --engine vllm check, before any model or engine loads (ValueError naming the flag)."""
    import importlib.util

    from kvpress.integrations.vllm.settings import EngineSettings

    if importlib.util.find_spec("vllm") is None:
        raise ValueError("--engine vllm: vLLM is not installed in this environment; run kvpress-eval from the "
                         "environment `make vllm` builds (.venv-vllm/bin/kvpress-eval)")
    if device not in ("auto", "cpu"):
        raise ValueError(f"--engine vllm with --device={device}: kvpress serves vLLM's CPU build; allowed: cpu")
    for config in configs:
        EngineSettings.parse(settings_of(config))


@contextlib.contextmanager
def open_engine(path, kvpress: dict | None, **llm_kwargs):
    """vLLM's LLM on the model folder `path`, with kvpress settings when given; its engine shut down on exit (an
    engine that runs in this process keeps its memory until it is shut down)."""
    from vllm import LLM

    llm = LLM(str(path), additional_config={"kvpress": kvpress} if kvpress else {}, **llm_kwargs)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def evaluate(path, tokenizer, work: list, config, dtype: str, kv_bytes: int, stop: list,
             page: int = PAGE, mode: str = "query_aware") -> list[dict]:
    """Rows (one per pending prompt) of `config` through one engine with pages of `page` tokens, in `mode`. `work`:
    (sample, length) pairs."""
    from vllm import SamplingParams, TokensPrompt

    from kvpress.integrations.vllm.plans import plan_of
    from kvpress.integrations.vllm.settings import EngineSettings

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: faster on few cores
    dtype = "float32" if dtype == "auto" else dtype
    pending = [Pending(sample, qi, length, *encode(tokenizer, sample, q, sample.meta.get("max_tokens")))
               for sample, length in work for qi, q in enumerate(sample.questions)]
    longest = max(len(p.head) + len(p.tail) + p.sample.max_new_tokens for p in pending)
    settings = settings_of(config)
    engine_text = EngineSettings.parse(settings).text
    text = _text_config(path)
    token_bytes = 2 * text.num_hidden_layers * text.num_key_value_heads * _head_dim(text) * (4 if dtype == "float32"
                                                                                               else 2)
    agnostic = mode == "query_agnostic"
    with open_engine(path, settings, dtype=dtype, enforce_eager=True, max_model_len=-(-longest // page) * page,
                     block_size=page, kv_cache_memory_bytes=kv_bytes, enable_prefix_caching=agnostic,
                     disable_log_stats=False, seed=0) as llm:
        prompts = [TokensPrompt(prompt_token_ids=p.head + p.tail) for p in pending]
        extra_args = [{"kvpress": {"context_tokens": len(p.head)}} if agnostic else None for p in pending]
        params = [SamplingParams(max_tokens=p.sample.max_new_tokens, temperature=0, stop_token_ids=stop,
                                 **({"extra_args": extra} if extra else {})) for p, extra in zip(pending, extra_args)]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    rows = []
    for p, out, extra in zip(pending, outputs, extra_args):
        sample, question = p.sample, p.sample.questions[p.question]
        completion = out.outputs[0]
        prediction = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        n = len(p.head) + len(p.tail)
        evicted = plan_of(engine_text, extra, n, page).evicted  # what the engine evicts, where it compresses
        # what the cache holds once the compressed part is computed, as the transformers path counts it: the prompt
        # (query_aware), or the context, before any question (query_agnostic)
        counted = len(p.head) if agnostic else n
        kept = counted - evicted
        pages = -(-counted // page) - evicted // page
        timing = out.metrics
        rows.append(dict(
            task=sample.task, index=sample.index, length=sample.meta.get("target_length"), n_tokens=n,
            mode=mode, policy=config.policy, ratio=config.ratio, question=p.question, prediction=prediction,
            answers=question.answers,
            score=score_prediction(sample.metric, prediction, question.answers, sample.meta.get("all_classes"),
                                   sample.meta.get("first_line", False)),
            kv_bytes=kept * token_bytes, cache_bytes=pages * page * token_bytes, page_tokens=page,
            prefill_s=round(timing.first_token_ts - timing.scheduled_ts, 4),
            decode_s=round(timing.last_token_ts - timing.first_token_ts, 4), batch=len(pending),
            new_tokens=len(completion.token_ids), engine="vllm", cached_tokens=out.num_cached_tokens,
            **{k: v for k, v in sample.meta.items() if k in ("depth", "seed")},
        ))
    return rows


def _text_config(path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
