"""The workers' side: vLLM's CPU attention backend, plus kvpress.

vLLM's own kernel computes every attention; kvpress adds two things around it.
- Metadata (once per step, `Builder`): a request that evicted its leading `d` prompt tokens reads its pages from
  logical slot d on: its block-table row starts d / P entries later and its sequence length is d shorter (positions,
  RoPE and the slots new tokens are written to stay vLLM's: the slot mapping is computed before, from the full row).
  The step's prompt tokens are planned for compression (requests.py).
- Each layer (`Impl`), after vLLM's attention: the prompt tokens of the step go to their request's compression
  (integrations/prompts.py: the transformers path's policy code); where the prompt ends, the tokens each KV head
  keeps are written, in position order, to the logical slots [d, L) through vLLM's own cache write, so the pages of
  [0, d) hold nothing needed and the scheduler frees them (pages.py). Keys are stored after RoPE, so a kept token
  needs no position; slot j of head h is head h's j-th kept token (attention never compares heads).
- Each layer, at a step that ends at a request's decode-time cut: its held tokens are read back from its pages
  (`read_pages`), cut by the policy (integrations/decoding.py), and written back behind the pages then freed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention import selector
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl, CPUAttentionMetadata,
                                                 CPUAttentionMetadataBuilder)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.kv_cache_interface import FullAttentionSpec

from ...positions import Rotary
from ..prompts import LayerFacts
from .pages import KVPressSpec
from .requests import requests_of
from .settings import EngineSettings

_ACTIVE: list[EngineSettings] = []  # the settings of this process's engine, once its worker activated kvpress


def activate(settings: EngineSettings) -> None:
    """Serve this worker process's attention through `Backend` (called by the kvpress worker, before the model is
    built: the model's attention layers pick their backend then). Engines without kvpress settings use the stock
    worker, which never calls this, so they never see kvpress."""
    _ACTIVE[:] = [settings]
    register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.Backend")
    _forget_selections()


def deactivate() -> None:
    """The next engine of this process has no kvpress settings: vLLM's own CPU_ATTN again (engines that share the
    process of an earlier kvpress engine's worker: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    if _ACTIVE:
        _ACTIVE.clear()
        AttentionBackendEnum.CPU_ATTN.clear_override()
        _forget_selections()


def _forget_selections() -> None:
    # vLLM remembers each backend it selected for the life of the process; an engine that starts in the process
    # of an earlier one (VLLM_ENABLE_V1_MULTIPROCESSING=0) must select again
    selector._cached_get_attn_backend.cache_clear()


class Backend(CPUAttentionBackend):
    """CPU_ATTN with kvpress: full-attention layers declare KVPressSpec (their requests give pages back)."""

    @classmethod
    def customize_spec(cls, spec):
        spec = super().customize_spec(spec)
        if type(spec) is not FullAttentionSpec or spec.sliding_window is not None:
            return spec  # sliding-window layers keep vLLM's behaviour
        return KVPressSpec(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)},
                           settings=_ACTIVE[0].text)

    @staticmethod
    def get_builder_cls():
        return Builder

    @staticmethod
    def get_impl_cls():
        return Impl


@dataclass
class Metadata(CPUAttentionMetadata):
    prompts: list = dataclasses.field(default_factory=list)  # requests.PromptWork of this step
    decodes: list = dataclasses.field(default_factory=list)  # requests.DecodeWork of this step
    requests: object = None  # the worker's requests.Requests (attention inputs; kept positions, when recording)


class Builder(CPUAttentionMetadataBuilder):
    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> Metadata:
        cm = common_attn_metadata
        requests = requests_of(self.vllm_config) if isinstance(self.kv_cache_spec, KVPressSpec) else None
        if requests is None:  # a layer group kvpress leaves alone (sliding windows of hybrid models)
            return Metadata(**vars(super().build(common_prefix_len, cm, fast_build)))
        plan = requests.plan(cm.block_table_tensor[:cm.num_reqs], cm.slot_mapping,
                             cm.query_start_loc_cpu[:cm.num_reqs + 1].tolist())
        if any(plan.offsets):
            cm = _read_from(cm, torch.tensor(plan.offsets, dtype=cm.seq_lens.dtype), self.block_size)
        return Metadata(**vars(super().build(common_prefix_len, cm, fast_build)), prompts=plan.prompts,
                        decodes=list(plan.decodes), requests=requests)


def _read_from(cm, offsets: torch.Tensor, page_size: int):
    """The step's metadata with each row reading from its logical slot offsets[r] on (a multiple of page_size)."""
    table = cm.block_table_tensor
    rows = offsets.shape[0]
    shifted = table.clone()
    columns = torch.arange(table.shape[1]) + (offsets // page_size)[:, None]
    shifted[:rows] = table[:rows].gather(1, columns.clamp(max=table.shape[1] - 1).to(table.device))
    seq_lens = cm.seq_lens.clone()
    seq_lens[:rows] -= offsets.to(seq_lens.device)
    return dataclasses.replace(cm, block_table_tensor=shifted, seq_lens=seq_lens, max_seq_len=int(seq_lens.max()))


class Impl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._config = get_current_vllm_config().model_config.hf_text_config
        self._facts: dict[bool, LayerFacts] = {}

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        for work in attn_metadata.prompts if attn_metadata is not None else ():
            facts = self._layer_facts(layer, work.compression.policy.needs().rotary)
            hidden = attn_metadata.requests.attention_inputs.get(facts.layer_idx)
            work.compression.add(facts, query[work.tokens], key[work.tokens], value[work.tokens],
                                 None if hidden is None else hidden[work.tokens])
            if work.slots is not None:
                kept = work.compression.finish(facts)
                if kept.keys.shape[0] != work.slots.shape[0]:
                    raise RuntimeError(f"kvpress: layer {facts.layer_idx} kept {kept.keys.shape[0]} tokens per head, "
                                       f"the scheduler frees pages for {work.slots.shape[0]}")
                self._write_kept(layer, kv_cache, kept, work.slots, work.request_id, facts, attn_metadata.requests)
                if work.decoding is not None:
                    work.decoding.started(facts.layer_idx, kept)
        for work in attn_metadata.decodes if attn_metadata is not None else ():
            facts = self._layer_facts(layer, work.decoding.policy.needs().rotary)
            keys, values = read_pages(layer, kv_cache, work.held, attn_metadata.requests.page_size, key[work.tokens],
                                      value[work.tokens])
            hidden = attn_metadata.requests.attention_inputs.get(facts.layer_idx)
            kept = work.decoding.step(facts, query[work.tokens], keys, values,
                                      None if hidden is None else hidden[work.tokens], work.seen,
                                      None if work.kept is None else work.kept.shape[0])
            if kept is not None:
                self._write_kept(layer, kv_cache, kept, work.kept, work.request_id, facts, attn_metadata.requests)
        return output

    def _write_kept(self, layer, kv_cache, kept, slots: torch.Tensor, request_id: str, facts: LayerFacts,
                    requests) -> None:
        """Each KV head's kept tokens to the physical `slots`, through vLLM's own cache write (and recorded)."""
        self.do_kv_cache_update(layer, kept.keys.contiguous(), kept.values.contiguous(), kv_cache, slots)
        requests.record(request_id, facts.layer_idx, kept.positions)

    def _layer_facts(self, layer, rotary: bool) -> LayerFacts:
        """The layer's facts, with its RoPE for the policies that read it (requests may run different policies)."""
        if rotary not in self._facts:
            index = extract_layer_index(layer.layer_name)
            layer_types = getattr(self._config, "layer_types", None)
            rope = Rotary.from_config(self._config, layer_types[index] if layer_types else None) if rotary else None
            self._facts[rotary] = LayerFacts(index, self.scale, self.logits_soft_cap or None, rope)
        return self._facts[rotary]


# The page layouts kvpress reads back (vLLM's CPU kernels, per instruction set): each page holds, per KV head, its
# keys as [D, P] (transposed), then its values as [P, D]. kvpress writes through vLLM's own cache write, so writing
# needs no layout; only a decode-time cut reads pages, and it checks what it reads (read_pages).
_READABLE_ISAS = ("vec", "vec16")


def read_pages(layer, kv_cache: torch.Tensor, slots: torch.Tensor, page_size: int, step_keys: torch.Tensor,
               step_values: torch.Tensor):
    """Keys and values [n, Hkv, D] at the physical `slots` of one layer's pages, whose last slots hold this step's
    `step_keys` / `step_values` [q, Hkv, D] (vLLM wrote them before its attention): checked against them, so a
    layout kvpress misreads stops the engine instead of moving wrong tokens."""
    isa = getattr(layer, "isa", None)
    if isa not in _READABLE_ISAS:
        raise RuntimeError(f"kvpress: decode-time eviction reads the engine's pages, whose layout under vLLM's "
                           f"{isa!r} attention kernels it does not know (it reads {_READABLE_ISAS}); allowed: a policy "
                           f"that cuts the prompt only (slack=0, no decode_budget)")
    pages, heads, dim = kv_cache.shape[0], kv_cache.shape[1], step_keys.shape[-1]
    region = kv_cache.flatten(2)  # [pages, Hkv, 2 * P * D]: each (page, head)'s keys, then its values
    keys_t = region[..., :page_size * dim].view(pages, heads, dim, page_size)
    values_p = region[..., page_size * dim:].view(pages, heads, page_size, dim)
    page, at = slots // page_size, slots % page_size
    keys, values = keys_t[page, :, :, at], values_p[page, :, at]  # [n, Hkv, D]
    n = step_keys.shape[0]
    if not (torch.equal(keys[-n:], step_keys.to(keys.dtype)) and
            torch.equal(values[-n:], step_values.to(values.dtype))):
        raise RuntimeError(f"kvpress: the pages read back under vLLM's {isa!r} attention kernels do not hold this "
                           f"step's keys and values: kvpress misreads their layout and stops rather than move tokens")
    return keys, values
