"""Run by tests/test_tensor_parallel.py: greedy tokens of every policy family on a saved tiny model, on one process
or, under torchrun, with transformers' tensor parallelism (tp_plan="auto", gloo); rank 0 prints one JSON line."""

import json
import os
import sys

import torch

import kvpress
from kvpress.heads import COLLECTIVES
from kvpress.policies.kvzip import ReplayPrompt

CODEC = dict(group_size=16, residual_length=16)
CONFIGS = [  # (label, policy, params)
    ("none", "none", {}),
    ("snapkv", "snapkv", dict(compression_ratio=0.5)),
    ("snapkv adaptive", "snapkv", dict(compression_ratio=0.5, budget_allocation="adaptive")),
    ("snapkv pyramid", "snapkv", dict(compression_ratio=0.5, budget_allocation="pyramid")),
    ("h2o", "h2o", dict(compression_ratio=0.5)),
    ("tova", "tova", dict(compression_ratio=0.5)),
    ("streaming_llm", "streaming_llm", dict(compression_ratio=0.5)),
    ("freqkv", "freqkv", dict(compression_ratio=0.5)),
    ("subgen", "subgen", dict(compression_ratio=0.5, recent=8)),
    ("knorm", "knorm", dict(compression_ratio=0.5)),
    ("random", "random", dict(compression_ratio=0.5)),
    ("expected_attention adaptive", "expected_attention", dict(compression_ratio=0.5, budget_allocation="adaptive")),
    ("keydiff", "keydiff", dict(compression_ratio=0.5)),
    ("kvzip global", "kvzip", dict(compression_ratio=0.5, chunk_size=16,
                                   prompt=ReplayPrompt(first=(5, 6, 7), next=(8, 9), suffix=(10,)))),
    ("kivi", "kivi", dict(bits=4, **CODEC)),
    ("gear", "gear", dict(bits=4, **CODEC)),
    ("snapkv+kivi", "snapkv+kivi", dict(compression_ratio=0.5, bits=2, **CODEC)),
    ("kvzap global", "kvzap", dict(compression_ratio=0.5)),
    ("less", "less", dict(compression_ratio=0.5)),
    ("commvq", "commvq", dict(key_stages=2, value_stages=2, block_size=16, residual_length=16)),
    ("quest", "quest", dict(budget=24)),
    ("retrieval", "retrieval", dict(budget=24)),
    ("topk", "topk", dict(budget=24)),
    ("sink_window", "sink_window", dict(budget=24)),
    ("keyformer", "keyformer", dict(compression_ratio=0.5)),
    ("token_select", "token_select", dict(budget=24, n_init=2, n_local=6)),
    ("recycled_attention", "recycled_attention", dict(budget=24, stride=3)),
    ("hip", "hip", dict(budget=24, n_sink=2, window=6)),
    ("tidal_decode", "tidal_decode", dict(budget=16, sparse_layer_start=0, correction_layer=None)),
]


def main(path):
    from transformers import AutoModelForCausalLM

    parallel = "WORLD_SIZE" in os.environ
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto" if parallel else None,
                                                 dtype=torch.float32).eval()
    torch.manual_seed(0)
    ids = torch.randint(3, 120, (2, 48))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    out = {}
    for label, policy, params in CONFIGS:
        before = sum(COLLECTIVES.values())
        with kvpress.patch_model(model, policy, **params):
            tokens = model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        out[label] = dict(tokens=tokens[:, 48:].tolist(), collectives=sum(COLLECTIVES.values()) - before)
    tokens = kvpress.speculative_generate(model, ids, mask, draft="sink_window", gamma=3, max_new_tokens=8,
                                          draft_budget=16, eos_token_id=[])
    out["speculative sink_window"] = dict(tokens=tokens[:, 48:].tolist(), collectives=0)
    if not parallel or int(os.environ["RANK"]) == 0:
        print("RESULT " + json.dumps(out), flush=True)
    if parallel:  # gloo's threads still running at interpreter exit abort the process now and then
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
