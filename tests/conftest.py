import contextlib
import functools
import os

import torch as _torch

if not _torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run in interpreter mode on CPU

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
    Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
)

torch.set_num_threads(2)

_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)

TINY = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**_COMMON)),
    "mistral": lambda: MistralForCausalLM(MistralConfig(**_COMMON, sliding_window=None)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**_COMMON)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**_COMMON, head_dim=16)),
    # hybrid: layer 0 sliding (stock transformers layer), layer 1 full attention (kvpress layer)
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(
        **_COMMON, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
    "phi3": lambda: Phi3ForCausalLM(Phi3Config(**_COMMON)),
}


def tiny_model(arch: str = "llama", attn: str = "sdpa", seed: int = 0):
    torch.manual_seed(seed)
    model = TINY[arch]()
    model.set_attn_implementation(attn)
    return model.eval()


@functools.lru_cache(maxsize=2)
def _real(name):
    from kvpress.models import load
    return load(name)


@pytest.fixture(scope="session")
def smollm2():
    return _real("smollm2")


def greedy(model, ids, n, **kw):
    kw.setdefault("attention_mask", torch.ones_like(ids))
    return model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)


@contextlib.contextmanager
def record_held_tokens():
    """Record, after every KVPressLayer.update, the most tokens any head of that layer holds (instrumentation
    for "the cache never holds more than ..." checks). Yields the list it appends to."""
    from kvpress import KVPressLayer

    held = []
    real_update = KVPressLayer.update

    def recording_update(self, *args, **kwargs):
        out = real_update(self, *args, **kwargs)
        held.append(int(self.tokens_per_head().max()))
        return out

    KVPressLayer.update = recording_update
    try:
        yield held
    finally:
        KVPressLayer.update = real_update
