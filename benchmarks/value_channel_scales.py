"""How much ZipCache's channel-separable value quantizer would save on a model's real values: relative error of
values quantized per token (KIVI's / kvpress's zipcache layout: one min/max per token over the head's channels)
against the same after dividing each channel by c_i = sqrt(max_t |V[t, i]|) (ZipCache's normalisation, undone after
dequantization), and of keys per channel over groups of 64 tokens, beside them. Captured from one prefill of a
needle prompt; every layer and KV head; no cache is compressed. Prints a table; asserts nothing.

    python benchmarks/value_channel_scales.py [--model smollm2] [--length 2048] [--bits 2,4]
"""

from __future__ import annotations

import argparse

import torch
from transformers import DynamicCache

from kvpress.formats.lowbit import quantize
from kvpress.models import load
from kvpress.needle import needle_prompt


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx - exact).norm() / exact.norm())


def dequantized(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    codes, scale, low = quantize(x, bits, dim)
    return codes.float() * scale.float().unsqueeze(dim) + low.float().unsqueeze(dim)


def errors(keys: torch.Tensor, values: torch.Tensor, bits: int, group: int = 64) -> tuple[float, float, float]:
    """(values per token, values per token after the channel scales, keys per channel) for one layer's
    keys / values [Hkv, T, D]."""
    per_token = relative_error(dequantized(values, bits, -1), values)
    scales = values.abs().amax(1, keepdim=True).sqrt().clamp(min=1e-4)  # [Hkv, 1, D]: per head and channel
    separable = relative_error(dequantized(values / scales, bits, -1) * scales, values)
    length = keys.shape[1] // group * group
    grouped = keys[:, :length].reshape(keys.shape[0], length // group, group, -1)
    return per_token, separable, relative_error(dequantized(grouped, bits, 2), grouped)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--bits", default="2,4")
    args = p.parse_args(argv)
    model, tok = load(args.model)
    ids = needle_prompt(tok, args.length, seed=1).input_ids
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    layers = [(layer.keys.float()[0], layer.values.float()[0]) for layer in cache.layers]
    print(f"{args.model}, {ids.shape[1]} tokens, mean over {len(layers)} layers of the relative error ||x' - x|| / ||x||")
    print("| bits | values per token | values per token, channel-separable | keys per channel (groups of 64) |")
    print("|---|---|---|---|")
    for bits in map(int, args.bits.split(",")):
        rows = [errors(k, v, bits) for k, v in layers]
        means = [sum(r[i] for r in rows) / len(rows) for i in range(3)]
        print(f"| {bits} | {means[0]:.3f} | {means[1]:.3f} | {means[2]:.3f} |")


if __name__ == "__main__":
    main()
