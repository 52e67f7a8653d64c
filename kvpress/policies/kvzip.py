"""KVzip (Kim et al. 2025, arXiv 2505.23416): query-agnostic selection by context reconstruction.

After the prompt is prefilled, the model is asked to repeat it: for each chunk of the prompt, the replay input
is a short instruction, the chat template's assistant header, then the chunk's own tokens (teacher-forced),
run over the whole prefilled cache (`ModelPass.probe`: nothing the replay appends is kept; `seen` and
positions are untouched). In every layer, each replay query's attention is recomputed over a RESTRICTED key set,
the row's first `n_sink` tokens + the chunk's slots + the replay tokens themselves (causal), softmax over that
set only; a chunk slot's score is the largest probability any replay query of its KV head's group gives it.
Sinks score +inf. Slots are then kept by `budget_allocation`: 'global' (default, the reference's
layerwise=False) runs one top-k over every (layer, KV head, slot) of a row, so layers and heads keep different
counts, stored flat (the bytes freed equal the tokens removed); 'uniform', 'pyramid', 'adaptive' cut per layer.
`kvzip_plus=True` scores KVzip+ (the KVzap paper's target): each probability x ||W_O v|| (what the value writes
into the residual stream, per query head) / ||h|| (the norm of the query row's attention input).

Cost: the replay is a second forward over the prompt (+ a few instruction tokens per chunk) whose queries read the
whole cache, and the restricted scores one more pass over chunk x (chunk + replay) logits: measured on CPU
(SmolLM2, 4K) 4.3x the plain prefill, 3.2x without the scoring (docs/results/kvzip_prefill). Peak memory: the full
prompt's cache + one replay chunk. With chunked prefill, each prompt chunk is replayed right after it is
prefilled and cut to its share of the budget (earlier survivors stay), so the cache holds budget + one chunk.
The chat prefix tokens are scored like the context (the reference leaves them unscored, evicting the system
prompt first). Generated tokens have no replay score, so there is no decode_budget.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..progress import tracked
from .budget import AllocatedBudgetPolicy
from .context import Context
from .protocol import ModelPass, Needs
from .selection import evict_after_prompt, first_slots
from .registry import register

_ROW_BLOCK_ELEMENTS = 1 << 22  # fp32 logits per block of replay rows (16 MB)
FIRST_INSTRUCTION = "\n\nRepeat the previous context exactly."
NEXT_INSTRUCTION = "\n\nRepeat the part of the previous context exactly, starting with"
NO_TEMPLATE_SUFFIX = "\n"  # models without a chat template: the chunk follows the instruction on a new line
PREVIOUS_TAIL = 8  # tokens of the previous chunk quoted in the next instruction


@dataclass(frozen=True)
class ReplayPrompt:
    """Token ids of the replay instructions, resolved from the model's tokenizer at patch time."""

    first: tuple  # "Repeat the previous context exactly."
    next: tuple  # "Repeat the part of the previous context exactly, starting with" (+ the previous chunk's tail)
    suffix: tuple  # the chat template's end of user turn + assistant header (NO_TEMPLATE_SUFFIX without one)

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "ReplayPrompt":
        def encode(text):
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        template = getattr(tokenizer, "chat_template", None)
        if template:
            marker = "\n" + "#" * 13
            text = tokenizer.apply_chat_template([{"role": "user", "content": "dummy context" + marker}],
                                                 add_generation_prompt=True, tokenize=False)
            suffix = text.split(marker)[1]
        else:
            suffix = NO_TEMPLATE_SUFFIX
        return cls(encode(FIRST_INSTRUCTION), encode(NEXT_INSTRUCTION), encode(suffix))


@register
@dataclass
class KVzip(AllocatedBudgetPolicy):
    name = "kvzip"
    budget_allocation: str = "global"
    chunk_size: int = 2048
    n_sink: int = 4
    kvzip_plus: bool = False
    # the model's tokenizer (any object with encode(text, add_special_tokens) and, optionally, a chat template);
    # None: loaded from the model's local folder when patching. Only the replay prompt's ids are kept from it.
    tokenizer: object = field(default=None, repr=False, compare=False)
    prompt: ReplayPrompt | None = field(default=None, repr=False, compare=False)
    allocations: ClassVar[tuple] = ("global", "uniform", "pyramid", "adaptive")

    def validate(self) -> None:
        super().validate()
        if self.chunk_size < 1:
            raise ValueError(f"kvzip: chunk_size={self.chunk_size!r}; allowed values: an int >= 1")
        if self.n_sink < 0:
            raise ValueError(f"kvzip: n_sink={self.n_sink!r}; allowed values: an int >= 0")
        if self.decode_budget is not None:
            raise ValueError(f"kvzip: decode_budget={self.decode_budget!r}: generated tokens get no replay score; "
                             f"allowed values: None")
        if self.tokenizer is not None and (isinstance(self.tokenizer, (str, bytes))  # str.encode is no tokenizer's
                                           or not callable(getattr(self.tokenizer, "encode", None))):
            raise ValueError(f"kvzip: tokenizer={self.tokenizer!r} has no encode(text, add_special_tokens=...); "
                             f"allowed values: None (loaded from the model's folder) or the model's tokenizer")

    def needs(self) -> Needs:
        return super().needs() | Needs(model_pass=True, hidden_states=self.kvzip_plus, prompt_ids=True)

    def for_model(self, model) -> "KVzip":
        if self.kvzip_plus and not all(isinstance(getattr(m, "o_proj", None), torch.nn.Linear) for m in model.modules):
            raise ValueError("kvzip: kvzip_plus=True weighs each value by ||W_O v|| and needs attention modules with an "
                             "o_proj linear layer; allowed values for this model: kvzip_plus=False")
        if self.prompt is not None:
            return self
        tokenizer = self.tokenizer if self.tokenizer is not None else _load_tokenizer(model.model)
        try:
            prompt = ReplayPrompt.from_tokenizer(tokenizer)
        except (TypeError, AttributeError) as e:  # an object with an encode() that is not a tokenizer's
            raise ValueError(f"kvzip: tokenizer={type(tokenizer).__name__} could not encode the replay instructions "
                             f"({type(e).__name__}: {e}); allowed values: None or the model's tokenizer") from None
        return dataclasses.replace(self, tokenizer=None, prompt=prompt)

    # -- per layer: the budget is fixed at prefill; nothing is evicted before the replay
    def on_prefill(self, ctx: Context) -> None:
        self.start_budget(ctx)

    # -- the model-level hook
    def after_prefill(self, run: ModelPass) -> None:
        key = ("kvzip", self.chunk_size, self.n_sink, self.kvzip_plus, self.prompt)
        if key not in run.memo:  # configs that differ only in budget share one replay (evals)
            run.memo[key] = self.replay_scores(run)
        self.evict(run, run.memo[key])

    def replay_scores(self, run: ModelPass) -> dict:
        """{layer_idx: [B, Hkv, T] fp32} replay score of every slot this prompt forward added (0 elsewhere,
        +inf for sinks)."""
        if run.input_ids is None:
            raise ValueError("kvzip replays the prompt's tokens; feed input_ids (not inputs_embeds)")
        cache = run.cache
        seen = cache.get_seq_length()
        n_new = run.input_ids.shape[1]
        device = run.input_ids.device
        mask = torch.ones(run.input_ids.shape[0], seen, dtype=torch.bool, device=device) \
            if run.attention_mask is None else run.attention_mask.bool()
        real = mask[:, seen - n_new:]  # this forward's real tokens, per row
        scores = {i: torch.zeros(*layer.key_valid().shape, device=device) for i, layer in run.layers()}
        replays = _replays(run.input_ids, real, seen - n_new, self.chunk_size, self.prompt, run.next_positions)
        n_replays = _replay_count(real, self.chunk_size)
        for replay_ids, replay_mask, positions, chunk in tracked(replays, "kvzip replay", n_replays, unit="chunk"):
            def on_layer(ctx: Context, chunk=chunk):
                s = scores[ctx.layer_idx]
                width = s.shape[-1]
                new = self._chunk_scores(ctx, chunk, seen)[..., :width]
                s.copy_(torch.maximum(s, new))

            run.probe(replay_ids, torch.cat([mask, replay_mask], 1).long(), positions, on_layer)
        return scores

    def _chunk_scores(self, ctx: Context, chunk: torch.Tensor, seen: int) -> torch.Tensor:
        """[B, Hkv, T] max restricted-softmax probability each chunk slot gets from the replay queries (0 for the
        others; +inf for sinks). chunk [B, 2]: raw position range [start, end) of each row's chunk (empty: none)."""
        layer = ctx.layer
        positions = layer.key_positions().long()
        valid = layer.key_valid()
        prompt = valid & (positions < seen)
        sinks = first_slots(layer, torch.full(prompt.shape[:2], self.n_sink, device=prompt.device), among=prompt)
        in_chunk = prompt & (positions >= chunk[:, 0, None, None]) & (positions < chunk[:, 1, None, None])
        replay = valid & (positions >= seen)
        chosen = sinks | in_chunk | replay
        count = chosen.sum(-1)
        width = int(count.max())
        order = (~chosen).long().argsort(dim=-1, stable=True)[..., :width]  # chosen slots, in slot order
        ok = torch.arange(width, device=order.device) < count[..., None]
        keys = _gather_rows(layer.keys_view(), order)  # logits in the model's dtype (as the reference); softmax fp32
        key_pos = positions.gather(-1, order)
        is_chunk = in_chunk.gather(-1, order) & ok

        batch, hq, rows, dim = ctx.query.shape
        hkv = layer.num_kv_heads
        group = hq // hkv
        q = ctx.query.reshape(batch, hkv, group, rows, dim) * ctx.scaling
        query_pos = ctx.query_positions()
        query_real = valid[:, 0, -rows:]  # the replay's own padding never votes
        weight = None
        if self.kvzip_plus:
            values = _gather_rows(layer.values_view(), order).float()  # [B, Hkv, K, D]
            # ||W_O,h v||^2 = v^T (W_O,h^T W_O,h) v with W_O,h [hidden, D] the output block of query head h
            w_o = ctx.module.o_proj.weight.float().view(-1, hkv, group, dim)  # [hidden, Hkv, g, D]
            gram = torch.einsum("ohgd,ohge->hgde", w_o, w_o)  # [Hkv, g, D, D]
            value_norm = torch.einsum("bhkd,hgde,bhke->bhgk", values, gram, values).clamp(min=0).sqrt()
            hidden_norm = ctx.hidden_states.float().norm(dim=-1)  # [B, rows]
            weight = (value_norm, hidden_norm)
        # Chosen slots are in slot order: the prompt's (sinks, chunk) first, then the replay's. A block of replay
        # rows reads the prompt's and the replay keys up to its last row (causal): the rest is never computed.
        n_prompt = int((key_pos < seen).sum(-1).max())
        best = torch.zeros(batch, hkv, n_prompt, device=keys.device)
        step = max(1, _ROW_BLOCK_ELEMENTS // max(1, batch * hq * width))
        for start in range(0, rows, step):
            end = min(rows, start + step)
            reach = int((key_pos <= query_pos[end - 1]).sum(-1).max())
            logits = torch.einsum("bhgrd,bhkd->bhgrk", q[:, :, :, start:end], keys[:, :, :reach]).float()
            if ctx.softcap is not None:
                logits = torch.tanh(logits / ctx.softcap) * ctx.softcap
            allowed = ok[:, :, None, :reach] & (key_pos[:, :, None, :reach] <= query_pos[start:end, None])
            logits.masked_fill_(~allowed[:, :, None], -math.inf)
            exp = logits.sub_(logits.amax(-1, keepdim=True)).exp_()  # softmax over the restricted set, in place
            probs = exp[..., :n_prompt] / exp.sum(-1, keepdim=True)  # only the prompt's columns are ever scored
            if weight is not None:
                probs = probs * weight[0][:, :, :, None, :n_prompt] / weight[1][:, None, None, start:end, None]
            probs.masked_fill_(~query_real[:, None, None, start:end, None], 0.0)
            best = torch.maximum(best, probs.amax(dim=(2, 3)))
        out = torch.zeros(batch, hkv, positions.shape[-1], device=keys.device)
        out.scatter_(-1, order[..., :n_prompt], torch.where(is_chunk[..., :n_prompt], best, 0.0))
        return out.masked_fill(sinks, math.inf)

    def evict(self, run: ModelPass, scores: dict) -> None:
        evict_after_prompt(run, scores, self.budget_allocation, self.head_floor)


def _gather_rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """tensor [B, H, T, D] at slots index [B, H, K] -> [B, H, K, D]."""
    return tensor.gather(2, index[..., None].expand(-1, -1, -1, tensor.shape[-1]))


def _replay_count(real: torch.Tensor, chunk_size: int) -> int:
    """Replay forwards over rows whose real tokens are `real` [B, T]: the longest row's chunks (at least one)."""
    return max(1, max(math.ceil(int(r.sum()) / chunk_size) for r in real))


def _replays(input_ids: torch.Tensor, real: torch.Tensor, first_position: int, chunk_size: int,
             prompt: ReplayPrompt, next_positions: torch.Tensor):
    """Yield (replay ids [B, R], replay mask [B, R], RoPE positions [B, R], chunk [B, 2]) for each replay forward:
    row b replays its own i-th chunk of real tokens (left-padded to the batch's longest replay; a row whose tokens
    are all replayed already sits the forward out as padding, with an empty chunk)."""
    batch = input_ids.shape[0]
    device = input_ids.device
    rows = [input_ids[b][real[b]].tolist() for b in range(batch)]
    starts = [first_position + int((~real[b]).sum()) for b in range(batch)]  # raw position of each row's first
    for i in range(_replay_count(real, chunk_size)):
        replays, chunks = [], []
        for b, tokens in enumerate(rows):
            part = tokens[i * chunk_size:(i + 1) * chunk_size]
            if not part:
                replays.append([])
                chunks.append((0, 0))
                continue
            instruction = list(prompt.first) if i == 0 else \
                list(prompt.next) + tokens[i * chunk_size - PREVIOUS_TAIL:i * chunk_size]
            replays.append(instruction + list(prompt.suffix) + part)
            start = starts[b] + i * chunk_size
            chunks.append((start, start + len(part)))
        width = max(len(r) for r in replays)
        ids = torch.zeros(batch, width, dtype=input_ids.dtype, device=device)
        mask = torch.zeros(batch, width, dtype=torch.bool, device=device)
        for b, r in enumerate(replays):
            if r:
                ids[b, width - len(r):] = torch.tensor(r, dtype=input_ids.dtype, device=device)
                mask[b, width - len(r):] = True
        positions = next_positions[:, None] + (mask.long().cumsum(-1) - 1).clamp(min=0)
        yield ids, mask, positions, torch.tensor(chunks, device=device)


def _load_tokenizer(model):
    from transformers import AutoTokenizer

    source = getattr(model.config, "_name_or_path", None) or getattr(model, "name_or_path", None)
    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any failure means: we cannot build the replay prompt
        raise ValueError(f"kvzip: tokenizer=None and no tokenizer could be loaded from the model's folder "
                         f"({source!r}: {type(e).__name__}); allowed values: tokenizer=<the model's tokenizer>") from None
