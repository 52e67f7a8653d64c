"""Helpers of the vLLM plugin's tests: engines on SmolLM2 and what to read from them."""

import pytest
from vllm import SamplingParams, TokensPrompt

from evals.vllm_engine import open_engine
from kvpress.models import is_available, model_path

PAGE = 128  # vLLM's default block size on CPU
KV_BYTES = 1 << 30


def smollm2_folder() -> str:
    return model_folder("smollm2")


def model_folder(name: str) -> str:
    if not is_available(name):
        pytest.fail(f"{name} is not prepared: run `make models`")
    folder = model_path(name)
    stray = [p.name for p in folder.glob("*.safetensors") if p.name != "model.safetensors"]
    if stray:  # vLLM would load them as weights
        pytest.fail(f"{folder} holds {stray} besides the weights; `make models` renames kvpress's calibration file")
    return str(folder)


def engine(kvpress: dict | None = None, model: str = "smollm2", **kwargs):
    """An LLM on SmolLM2 (or another prepared model; fp32, eager), with kvpress settings when given; shut down on
    exit."""
    settings = dict(dtype="float32", enforce_eager=True, max_model_len=4096, kv_cache_memory_bytes=KV_BYTES,
                    enable_prefix_caching=False, seed=0)
    return open_engine(model_folder(model), kvpress, **{**settings, **kwargs})


def greedy(llm, prompts, max_tokens=16, ignore_eos=True) -> list[list[int]]:
    """Greedy tokens; with ignore_eos=False a generation ends at the end-of-sequence token, as transformers' does."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def kv_manager(llm):
    (manager,) = scheduler(llm).kv_cache_manager.coordinator.single_type_managers
    return manager


def worker(llm):
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker


def ids(prompt) -> list[int]:
    return prompt.input_ids[0].tolist()
