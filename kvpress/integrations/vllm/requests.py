"""The worker's side of each request, from one step to the next.

vLLM's attention backend sees a step's rows, not its requests: the model runner's hook (worker.py) hands this
table each step's rows in batch order (request id, its plan: plans.py, tokens computed before the step, tokens
scheduled in it). Per request the table keeps the prompt's PromptCompression while the prompt is computed up to the
plan's `end` (one or several chunks). Once a request's computed tokens reach `end`, every step of it reads its pages
from the evicted count on (backend.py shifts its block-table row and sequence length): whether it compacted them
itself or was handed a context that an earlier request compacted (the scheduler's shared-context hit), which is
why the offset is a function of the row alone (Plan.evicted_at). A request that evicts while decoding keeps its
DecodeCuts (integrations/decoding.py) from its prompt's end: at each step that ends at one of its cuts, every layer
reads its held tokens back from its pages, cuts them and writes what stays behind the pages the scheduler frees. A
request that starts over (recomputed after preemption) starts here over too; a finished or aborted one is
forgotten.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..decoding import DecodeCuts
from ..prompts import PromptCompression
from .plans import Plan


@dataclass(frozen=True)
class Row:
    """One request's share of a step."""

    request_id: str
    plan: Plan
    computed: int  # tokens computed before this step
    scheduled: int  # tokens this step computes


@dataclass(frozen=True)
class PromptWork:
    """Prompt tokens of one request in this step: every layer adds them to the request's compression; when they
    end the prompt, every layer then writes its kept tokens to the physical `slots` of logical [evicted, L)."""

    request_id: str
    compression: PromptCompression
    tokens: slice  # this request's prompt tokens on the step's token axis
    slots: torch.Tensor | None  # None: more prompt chunks follow
    decoding: DecodeCuts | None = None  # where the prompt ends, for a request that also evicts while decoding


@dataclass(frozen=True)
class DecodeWork:
    """A decode step of a request that evicts while decoding, handed to its DecodeCuts: at a cut, or at every step
    for a policy that observes every one. Every layer reads the tokens at the physical `held` slots (logical
    [evicted before, seen)); at a cut it writes what stays to the `kept` slots (logical [evicted after, seen)), and
    the scheduler frees the pages in between."""

    request_id: str
    decoding: DecodeCuts
    tokens: slice  # this step's tokens of the request on the step's token axis
    held: torch.Tensor
    kept: torch.Tensor | None  # None: no cut in this step
    seen: int


@dataclass(frozen=True)
class StepPlan:
    offsets: list  # per row, the leading tokens its request evicted (0: read from the start)
    prompts: list  # PromptWork of the rows whose prompt is (partly) computed in this step
    decodes: list = ()  # DecodeWork of the rows whose step ends at a decode-time cut, or is observed


class Requests:
    def __init__(self, fitted, page_size: int):
        self.fitted = fitted  # Plan -> its policy fitted to the model (worker.py)
        self.page_size = page_size
        self._compressing: dict[str, PromptCompression] = {}
        self._decoding: dict[str, DecodeCuts] = {}  # requests that evict while decoding, from their prompt's end
        self._rows: list[Row] | None = None  # the step in flight's rows (None between steps)
        self._plan: StepPlan | None = None  # this step's, once made
        # {request id: {layer: [Hkv, n] kept positions}} while recording (tests and debugging: Worker.kvpress_record)
        self.recorded: dict | None = None
        # {layer: [tokens, hidden]} the attention inputs of the forward in flight, for policies that need them
        self.attention_inputs: dict = {}

    def begin_step(self, rows: list[Row], finished: set) -> None:
        """A new step: finished requests are forgotten; a request whose computed count is back at 0 (recomputed
        after preemption) starts over."""
        for request_id in finished:
            self._forget(request_id)
        for row in rows:
            if row.computed == 0:
                self._forget(row.request_id)
        self._rows = rows
        self._plan = None

    def end_step(self) -> None:
        """The step ran: forward passes until the next step (the runner's warm-up batches) get no kvpress work."""
        self._rows = None
        self._plan = None
        self.attention_inputs = {}

    def plan(self, block_table: torch.Tensor, slot_mapping: torch.Tensor, query_start: list) -> StepPlan:
        """This step's work, from its rows: offsets for requests that evicted, and the prompt tokens to compress.
        `block_table` [rows, blocks] and `slot_mapping` [tokens] are the step's own (unshifted). Made once per step:
        the model has one KV cache group that kvpress compresses (worker.py checks)."""
        if self._rows is None:
            return StepPlan([0] * block_table.shape[0], [])  # not a step of requests (a warm-up batch)
        if self._plan is None:
            self._plan = self._make_plan(block_table, slot_mapping, query_start)
        return self._plan

    def _make_plan(self, block_table, slot_mapping, query_start) -> StepPlan:
        if len(self._rows) != block_table.shape[0]:
            raise RuntimeError(f"kvpress: the step has {block_table.shape[0]} rows, the model runner announced "
                               f"{len(self._rows)}: the worker hook and the attention metadata disagree")
        offsets, prompts, decodes = [], [], []
        for r, row in enumerate(self._rows):
            plan = row.plan
            offsets.append(plan.evicted_at(row.computed))
            if row.computed >= plan.end:
                if plan.cut:
                    work = self._decode(row, block_table[r], query_start[r], offsets[-1])
                    decodes += [work] if work is not None else []
                continue  # otherwise compacted already, or nothing to move
            if not plan.evicted and not (plan.cut and self.fitted(plan).observes_decode):
                continue  # the whole prompt stays: nothing to score or move (nor to observe)
            if plan.shared and row.computed + row.scheduled > plan.end:
                raise RuntimeError(f"kvpress: request {row.request_id}'s step runs past its context's end ({plan.end}): "
                                   f"the scheduler cuts steps there (kvpress's scheduler class is not running?)")
            start = query_start[r]
            n = min(row.scheduled, plan.end - row.computed)
            self._check_slots(block_table[r], slot_mapping[start:start + n], row.computed)
            compression = self._compressing.get(row.request_id)
            if compression is None:
                compression = self._compressing[row.request_id] = PromptCompression(self.fitted(plan), self.page_size)
            slots, decoding = None, None
            if row.computed + row.scheduled >= plan.end:
                slots = self._slots(block_table[r], plan.evicted, plan.end)
                del self._compressing[row.request_id]  # every layer finishes it in this step
                decoding = self._decoding_of(row) if plan.cut else None
            prompts.append(PromptWork(row.request_id, compression, slice(start, start + n), slots, decoding))
        return StepPlan(offsets, prompts, decodes)

    def _decoding_of(self, row: Row) -> DecodeCuts:
        decoding = self._decoding.get(row.request_id)
        if decoding is None:
            decoding = self._decoding[row.request_id] = DecodeCuts(self.fitted(row.plan), row.plan.end,
                                                                   self.page_size)
        return decoding

    def _decode(self, row: Row, blocks: torch.Tensor, start: int, evicted: int) -> DecodeWork | None:
        """This step's work for a request that evicts while decoding: at its cut, or at every step if its policy
        observes every one; None: nothing to do in this step."""
        plan, seen = row.plan, row.computed + row.scheduled
        cuts = plan.evicted_at(seen) > evicted
        decoding = self._decoding_of(row)
        if not cuts and not decoding.every_step:
            return None
        if cuts and plan.next_stop(row.computed) != seen:
            raise RuntimeError(f"kvpress: request {row.request_id}'s step runs from {row.computed} to {seen} tokens, "
                               f"past its decode-time cut at {plan.next_stop(row.computed)} (the scheduler ends "
                               f"steps there: kvpress's scheduler class is not running?)")
        kept = self._slots(blocks, plan.evicted_at(seen), seen) if cuts else None
        return DecodeWork(row.request_id, decoding, slice(start, start + row.scheduled),
                          self._slots(blocks, evicted, seen), kept, seen)

    def record(self, request_id: str, layer_idx: int, positions: torch.Tensor) -> None:
        if self.recorded is not None:
            self.recorded.setdefault(request_id, {})[layer_idx] = positions.tolist()

    def _slots(self, blocks: torch.Tensor, first: int, end: int) -> torch.Tensor:
        """Physical slots of the logical token range [first, end) of a request whose block-table row is `blocks`."""
        logical = torch.arange(first, end, device=blocks.device)
        return blocks[logical // self.page_size].long() * self.page_size + logical % self.page_size

    def _check_slots(self, blocks, step_slots, computed) -> None:
        # The slots kvpress writes kept tokens to follow vLLM's own slot arithmetic: checked on the step's tokens
        ours = self._slots(blocks, computed, computed + step_slots.shape[0])
        if not torch.equal(ours, step_slots.long()):
            raise RuntimeError("kvpress: the block table's slots differ from the model runner's slot mapping (kernel "
                               "blocks split from scheduler blocks?); kvpress cannot place the kept tokens")

    def _forget(self, request_id: str) -> None:
        self._compressing.pop(request_id, None)
        self._decoding.pop(request_id, None)


_TABLES: dict[int, Requests] = {}  # id(vllm_config) -> that worker's requests (one worker per process here)


def requests_of(vllm_config) -> Requests | None:
    return _TABLES.get(id(vllm_config))


def attach(vllm_config, requests: Requests) -> None:
    _TABLES[id(vllm_config)] = requests
