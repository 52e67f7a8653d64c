"""The worker of an engine with kvpress settings: vLLM's CPU worker, plus what kvpress needs in its process.

- At start: kvpress's attention backend replaces CPU_ATTN in this process (backend.activate), before the model is
  built.
- Once the model is loaded: the engine's policy is fitted to it (Policy.for_model, e.g. kvzap's calibration file
  checked against the weights: a mismatch stops the engine before any request runs); a request's own policy is
  fitted when it first comes (`fitted`, once per setting).
- Once the KV cache is laid out: the request table (requests.py) learns the page size.
- Every step: the model runner's rows (request, its plan, tokens computed, tokens scheduled), in batch order,
  go to the request table before the attention metadata is built; they are valid only while that step runs, so
  the runner's warm-up batches (fake requests) get no kvpress work.
The hooks are instance-level wrappers of this worker's model runner; nothing is patched in the vllm package.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.worker.cpu_worker import CPUWorker

from ...formats.calibration import identity_of
from ...policies.base import ModelInfo
from ...policies.params import check_context
from ...positions import Rotary
from .backend import activate
from .pages import KVPressSpec
from .plans import Plan, plan_of
from .requests import Requests, Row, attach
from .settings import EngineSettings


class Worker(CPUWorker):
    def __init__(self, vllm_config, *args, **kwargs):
        self.kvpress = EngineSettings.of(vllm_config)  # checked when the engine's config was made (configure)
        activate(self.kvpress)
        super().__init__(vllm_config, *args, **kwargs)
        self._fitted: dict[str, object] = {}  # a policy's settings (Plan.policy_text) -> that policy fitted
        self._info: ModelInfo | None = None
        self.requests: Requests | None = None  # once the KV cache is laid out

    def init_device(self) -> None:
        super().init_device()
        _watch_steps(self.model_runner, self)

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        model = self.model_runner.model
        self._info = _model_info(model, self.vllm_config)
        self._fitted[self.kvpress.text] = self._fit(self.kvpress.policy)
        if self.kvpress.policy.needs().hidden_states:
            _watch_attention_inputs(model, self)

    def _fit(self, policy):
        check_context(policy, getattr(self._info.config, "max_position_embeddings", None))
        return policy.for_model(self._info)

    def fitted(self, plan: Plan):
        """A request's policy fitted to this model (once per setting)."""
        if plan.policy_text not in self._fitted:
            if plan.policy.needs().hidden_states and not self.kvpress.policy.needs().hidden_states:
                # checked when the request came (__init__.check_request); here for a request that bypassed it
                raise ValueError(f"kvpress: {plan.policy.name} reads each layer's attention input, which this engine "
                                 f"does not record (its policy is {self.kvpress.policy.name})")
            self._fitted[plan.policy_text] = self._fit(plan.policy)
        return self._fitted[plan.policy_text]

    def initialize_from_config(self, kv_cache_config) -> None:
        super().initialize_from_config(kv_cache_config)
        specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups if isinstance(g.kv_cache_spec, KVPressSpec)]
        if len(specs) != 1:
            raise ValueError(f"kvpress: the model has {len(specs)} KV cache groups of compressed layers; kvpress "
                             f"serves models whose full-attention layers form one group")
        self.requests = Requests(self.fitted, specs[0].block_size)
        attach(self.vllm_config, self.requests)

    # -- called through LLM.collective_rpc (tests, debugging)
    def kvpress_record(self, on: bool = True) -> None:
        """Record the positions every layer keeps of each prompt from now on (off: stop and forget them)."""
        self.requests.recorded = {} if on else None

    def kvpress_recorded(self) -> dict:
        """{request id: {layer: [Hkv][kept positions]}} recorded so far."""
        return dict(self.requests.recorded or {})


def _watch_steps(runner, worker: Worker) -> None:
    """Hand each step's rows to the worker's request table while the step runs (instance-level wrappers)."""
    update_states, execute_model = runner._update_states, runner.execute_model

    def updated_states(scheduler_output):
        out = update_states(scheduler_output)
        if worker.requests is None:
            return out
        batch, page = runner.input_batch, worker.requests.page_size
        rows = [Row(request_id,
                    plan_of(worker.kvpress.text, _extra_args(runner.requests[request_id]),
                            int(batch.num_prompt_tokens[r]), page),
                    int(batch.num_computed_tokens_cpu[r]), int(scheduler_output.num_scheduled_tokens[request_id]))
                for r, request_id in enumerate(batch.req_ids)]
        worker.requests.begin_step(rows, scheduler_output.finished_req_ids)
        return out

    def executed_model(*args, **kwargs):
        try:
            return execute_model(*args, **kwargs)
        finally:
            if worker.requests is not None:
                worker.requests.end_step()

    runner._update_states, runner.execute_model = updated_states, executed_model


def _extra_args(state) -> dict | None:
    params = state.sampling_params  # None for pooling requests
    return None if params is None else params.extra_args


def _watch_attention_inputs(model, worker: Worker) -> None:
    """Keep each layer's attention input (the hidden states its attention module is called with) for the forward in
    flight, for policies that declare the need (kvzap predicts its scores from them). Forward pre-hooks on the
    modules that own vLLM's attention layers; configure() runs such engines eagerly, where hooks run as written."""
    owners = {name.rsplit(".", 1)[0]: extract_layer_index(name)
              for name, m in model.named_modules() if isinstance(m, Attention)}
    for name, module in model.named_modules():
        if name in owners:
            signature = inspect.signature(module.forward)

            def keep(module, args, kwargs, layer_idx=owners[name], signature=signature):
                if worker.requests is not None:  # None while vLLM profiles memory, before the KV cache exists
                    hidden = signature.bind(*args, **kwargs).arguments["hidden_states"]
                    worker.requests.attention_inputs[layer_idx] = hidden

            module.register_forward_pre_hook(keep, with_kwargs=True)


def _model_info(model, vllm_config) -> ModelInfo:
    """What policies see of the model an engine runs (no transformers modules: its config and its weights)."""
    config = vllm_config.model_config.hf_text_config
    layer_types = getattr(config, "layer_types", None)
    layers = sorted({extract_layer_index(name) for name, m in model.named_modules() if isinstance(m, Attention)}
                    - {i for i, kind in enumerate(layer_types or []) if kind == "sliding_attention"})
    embedding = next(m for m in model.modules() if isinstance(m, VocabParallelEmbedding)).weight
    folder = Path(vllm_config.model_config.model)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelInfo(config=config, layers=layers, head_dim=head_dim, identity=lambda: identity_of(config, embedding),
                     folder=folder if folder.is_dir() else None,
                     rotary=lambda i: Rotary.from_config(config, layer_types[i] if layer_types else None))
