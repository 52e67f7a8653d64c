"""How low-rank a model's pre-RoPE keys are: the error of ShadowKV's truncated SVD at each rank, measured from the
model itself, not through kvpress's cache. Hooks every layer's k_proj (its output is the pre-RoPE keys, every KV
head side by side, [T, Hkv * D]: the matrix ShadowKV factorises), runs one prefill of a needle prompt and prints per
rank: the share of the key width, the share of the full cache's bytes its coefficients take (T x r against T keys
and T values of Hkv * D each), and the relative error ||K - K_r|| / ||K|| (Frobenius): the median and the worst
layer. The paper's setting is rank 160 of Llama-3-8B's 1024 (15.6%).

    python benchmarks/shadowkv_rank.py --model smollm2 --length 8192 --ranks 30,48,64,96,128,160,192
"""

from __future__ import annotations

import argparse
import statistics

import torch

from kvpress.models import load
from kvpress.needle import needle_prompt


def key_matrices(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's pre-RoPE keys [T, Hkv * D] (fp32) on the prompt `ids` [1, T]."""
    keys, hooks = [], []
    for layer in model.model.layers:
        hooks.append(layer.self_attn.k_proj.register_forward_hook(
            lambda module, args, out: keys.append(out[0].detach().float())))
    try:
        with torch.no_grad():
            model.model(input_ids=ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return keys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="a prepared model (kvpress-models)")
    parser.add_argument("--length", type=int, default=8192, help="prompt tokens")
    parser.add_argument("--ranks", default="30,48,64,96,128,160,192", help="comma-separated ranks")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model, dtype=torch.float32)
    if getattr(model.model.layers[0].self_attn, "k_norm", None) is not None:
        raise SystemExit(f"--model={args.model!r}: its keys pass a norm after k_proj; this script reads k_proj")
    ids = needle_prompt(tokenizer, args.length, depth=0.5, seed=0).input_ids
    matrices = key_matrices(model, ids)
    width = matrices[0].shape[1]
    spectra = [torch.linalg.svdvals(k).double() ** 2 for k in matrices]
    print(f"{args.model}: {ids.shape[1]} tokens, {len(matrices)} layers, key width {width} (KV heads x head_dim)\n")
    print("| rank | of the key width | coefficients, of the full cache's bytes | error, median layer | worst layer |")
    print("|---|---|---|---|---|")
    for rank in (int(r) for r in args.ranks.split(",")):
        errors = [float((s[rank:].sum() / s.sum()).sqrt()) for s in spectra]
        print(f"| {rank} | {rank / width:.1%} | {rank / (2 * width):.1%} | {statistics.median(errors):.3f} | "
              f"{max(errors):.3f} |")


if __name__ == "__main__":
    main()
