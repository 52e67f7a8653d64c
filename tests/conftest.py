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


class CharTokenizer:
    """A tokenizer without a chat template, for tiny random models (vocab 128)."""

    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [3 + ord(c) % 120 for c in text]


TOK = CharTokenizer()


@pytest.fixture(scope="session")
def llama_file(tmp_path_factory):
    """A calibration file of the tiny Llama (KVzap's predictors, the head ranking, CommVQ's codebooks with 3 stages,
    Double Sparsity's channels, LESS's maps), made once for the whole run."""
    from kvpress.calibration import calibrate

    calibration = calibrate(tiny_model("llama"), TOK, n_texts=3, n_tokens=120, held_out=1, tokens_per_text=80,
                            codebook_stages=3, log=lambda *a: None)
    path = tmp_path_factory.mktemp("calibration") / "tiny.safetensors"
    calibration.save(path)
    return path


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


def reachable_storage_bytes(obj) -> int:
    """Bytes of the distinct allocations behind every tensor reachable from `obj` through kvpress and transformers
    cache objects' attributes, dataclass fields, dicts, lists and tuples: what a cache really holds, found without
    asking the cache (its nbytes() must account for all of it)."""
    import dataclasses

    seen, storages = set(), {}

    def walk(o):
        if id(o) in seen:
            return
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            storage = o.untyped_storage()
            if storage.nbytes():  # an empty tensor may sit at another allocation's address
                storages[(storage.device, storage.data_ptr())] = storage.nbytes()
            return
        if isinstance(o, dict):
            children = list(o.values())
        elif isinstance(o, (list, tuple, set)):
            children = list(o)
        elif dataclasses.is_dataclass(o) and not isinstance(o, type):
            children = [getattr(o, f.name) for f in dataclasses.fields(o)] + list(getattr(o, "__dict__", {}).values())
        elif hasattr(o, "__dict__") and type(o).__module__.startswith(("kvpress", "transformers.cache_utils")):
            children = list(vars(o).values())
        else:
            return
        for child in children:
            walk(child)

    walk(obj)
    return sum(storages.values())


def counter_bytes(layer) -> int:
    """Bytes of a layer's per-row counters ([B] tokens of padding, [B] budget), which nbytes() counts with its
    storage."""
    return sum(t.numel() * t.element_size() for t in (layer.padding, layer.row_budget) if t is not None)
