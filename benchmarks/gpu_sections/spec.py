"""Section 6: self-speculation on SmolLM2 (every draft kind), acceptance, speedup, greedy identity."""

from __future__ import annotations

import time

import torch

import kvpress
from kvpress import KVPressCache
from kvpress.speculative import DRAFTS

from .common import attempt, free_memory, ints


def _retell_prompt(tok, n_tokens: int, device):
    """The document of the needle haystack's sentences, then a request to retell it (benchmarks/speculative.py)."""
    from kvpress.needle import haystack_sentences

    request = "\n\nRetell the document above in your own words, in detail, sentence by sentence."
    sentences, text, step = haystack_sentences(3), "", []

    def render(body):
        if getattr(tok, "chat_template", None):
            return tok.apply_chat_template([{"role": "user", "content": body + request}], add_generation_prompt=True,
                                           tokenize=False)
        return body + request

    while True:  # grow in batches of sentences, then trim: cheap enough at 32K tokens
        step = [next(sentences) for _ in range(64)]
        candidate = text + " " + " ".join(step)
        if len(tok(render(candidate), add_special_tokens=False).input_ids) > n_tokens:
            break
        text = candidate
    for sentence in step:
        candidate = text + " " + sentence
        if len(tok(render(candidate), add_special_tokens=False).input_ids) > n_tokens:
            break
        text = candidate
    return tok(render(text), return_tensors="pt", add_special_tokens=False).input_ids.to(device)


def spec_model(args, max_positions):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    dtype = getattr(torch, args.spec_dtype)
    if args.smollm2_dir:
        tok = AutoTokenizer.from_pretrained(args.smollm2_dir)
        model = AutoModelForCausalLM.from_pretrained(args.smollm2_dir, dtype=dtype, attn_implementation="sdpa")
        return model.to("cuda").eval(), tok
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=max_positions,
                         rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval(), None


def section_spec(args, device, report, sec, deadline):
    contexts = ints(args.spec_contexts or ("2048" if args.quick else "16384,32768"))
    gammas = ints(args.spec_gammas)
    new = 16 if args.quick else args.spec_new_tokens
    drafts = [d for d in (args.spec_drafts or ",".join(sorted(DRAFTS))).split(",") if d]
    model, tok = spec_model(args, max(contexts) + new + 64)
    real = tok is not None
    sec["notes"] += [
        (f"Real SmolLM2-135M-Instruct weights from {args.smollm2_dir}; prompt: haystack document + 'retell it'."
         if real else
         "RANDOM-INIT SmolLM2-shaped model (hidden 576, 30 layers, 9 heads / 3 KV heads, intermediate 1536, vocab "
         "49152, tied embeddings): acceptance rates and speedups are NOT meaningful for the real model (a random "
         "model's predictions barely depend on the context); the greedy-identity check and the timing of the "
         "machinery are. Pass --smollm2-dir for real weights."),
        f"{args.spec_dtype}, batch 1, greedy, {new} new tokens (fewer if EOS comes first, the same for both), draft "
        f"budget: speculative_generate's default (10% of the prompt, at least 64). Plain greedy = model.generate "
        f"under the same patch (none; quant4: kivi 8-bit, its lossless reference). Times include the prefill; "
        f"'decode speedup' subtracts one measured prefill from both.",
        "identical: speculative output == plain greedy output, token for token (the suite exits with status 1 when "
        "any row differs).",
    ]
    rows = report.table(sec, "self-speculation", [
        ("context", "prompt tokens"), ("draft", "draft"), ("gamma", "gamma"), ("acceptance", "accepted/drafted"),
        ("tokens_per_round", "tokens/verify"), ("new", "new tokens"), ("plain_s", "plain s"), ("spec_s", "spec s"),
        ("speedup", "speedup"), ("decode_speedup", "decode speedup"), ("identical", "identical"),
        ("status", "status")])
    try:
        for n in contexts:
            if real:
                ids = _retell_prompt(tok, n, "cuda")
            else:
                ids = torch.randint(2, model.config.vocab_size, (1, n), device="cuda",
                                    generator=torch.Generator("cuda").manual_seed(n))
            eos = tok.eos_token_id if real else None
            pad = tok.pad_token_id if real else None
            for draft in drafts:
                target = ("kivi", dict(bits=8)) if draft == "quant4" else ("none", {})
                for gamma in gammas:
                    deadline.check()
                    row = dict(context=ids.shape[1], draft=draft, gamma=gamma)
                    rows.append(row)
                    out, why = attempt(_spec_one, model, ids, draft, gamma, target, new, eos, pad)
                    row.update(out or {"status": why})
                    report.write()
    finally:
        del model
        free_memory()


def _spec_one(model, ids, draft, gamma, target, new, eos, pad):
    mask = torch.ones_like(ids)
    with torch.no_grad(), kvpress.patch_model(model, target[0], **target[1]):
        warm = ids[:, :512]  # compile kernels and warm allocators outside the timed runs
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=4, do_sample=False,
                       eos_token_id=eos, pad_token_id=pad)
        kvpress.speculative_generate(model, warm, draft=draft, gamma=gamma, max_new_tokens=8, eos_token_id=eos,
                                     pad_token_id=pad)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model(input_ids=ids, past_key_values=KVPressCache(model.config), logits_to_keep=1)
        torch.cuda.synchronize()
        prefill = time.perf_counter() - start
        free_memory()
        start = time.perf_counter()
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=eos,
                             pad_token_id=pad)
        torch.cuda.synchronize()
        plain = time.perf_counter() - start
        start = time.perf_counter()
        out, stats = kvpress.speculative_generate(model, ids, mask, draft=draft, gamma=gamma, max_new_tokens=new,
                                                  eos_token_id=eos, pad_token_id=pad, return_stats=True)
        torch.cuda.synchronize()
        spec = time.perf_counter() - start
    return dict(status="ok", acceptance=stats.acceptance_rate, tokens_per_round=stats.tokens_per_round,
                new=ref.shape[1] - ids.shape[1], plain_s=plain, spec_s=spec, prefill_s=prefill,
                speedup=plain / spec, decode_speedup=(plain - prefill) / max(1e-9, spec - prefill),
                identical=out.tolist() == ref.tolist())
