"""Calibration, once per model: a small predictor of KVzip's scores, and a ranking of streaming vs retrieval heads.

`kvpress calibrate --model NAME_OR_PATH` (or `calibrate(model, tokenizer)`) runs KVzip (context replay,
kvpress/policies/kvzip.py) over local text: documents assembled from Python's own standard-library docstrings
and kvpress's needle haystack, with random facts (numbers, names, codes) inserted, none of it from the evals'
generators and nothing from a hub. It records, per compressed layer, each prompt token's attention input hidden
state and its KVzip score per KV head, then fits per layer a predictor h -> log(score) per KV head: ridge
regression ('linear', the default) or a 2-layer MLP ('mlp'). This is KVzap (NVIDIA, arXiv 2601.07891), fitted
to plain KVzip scores (the signal we measured best on SmolLM2, docs/results/query_agnostic_smollm2_bf16), or to
KVzip+ with target='kvzip_plus'.

The same replay also ranks heads (DuoAttention, arXiv 2410.10819, by measurement instead of optimisation): for a
sample of replay queries, the relative change of each KV head's attention output when it may read only the first
`sink` tokens and the `window` newest ones. Reconstructing the context needs the heads that look far back; heads
whose output barely changes are streaming heads. The same texts give Double Sparsity's label channels (channels.py),
CommVQ's codebooks (codebooks.py) and LESS's feature maps (less_fit.py).

The file itself (format, identity check, prediction) is kvpress/formats/calibration.py.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from . import arguments, cli
from .cache import KVPressCache
from .calibration_texts import calibration_texts
from .channels import label_channels
from .codebooks import fit_codebooks
from .formats.calibration import FILE_NAME, Calibration, model_identity  # noqa: F401 (this module's public names)
from .integrations import patch_model
from .integrations.hf import with_cache
from .less_fit import fit_maps
from .policies.base import Context, ModelPass, Needs
from .policies.kvzip import KVzip
from .progress import reporting, tracked

LOG_FLOOR = 1e-6  # KVzip scores are probabilities; log(score) is fitted, floored here

# ---------------------------------------------------------------------------- collecting KVzip's scores
def _streaming_error(query, keys, values, key_pos, query_pos, valid, scaling, sink, window) -> torch.Tensor:
    """[B, K] mean over query rows and each GQA group of ||o - o'||^2 / ||o||^2, where o is the causal attention
    output and o' the same query reading only its row's first `sink` positions and its `window` newest ones."""
    batch, hq, rows, dim = query.shape
    hkv = keys.shape[1]
    q = query.float().reshape(batch, hkv, hq // hkv, rows, dim) * scaling
    logits = torch.einsum("bhgrd,bhkd->bhgrk", q, keys.float())
    key_pos, query_pos = key_pos[:, :, None, None, :], query_pos[:, None, None, :, None]
    causal = valid[:, :, None, None, :] & (key_pos <= query_pos)
    near = (key_pos < sink) | (key_pos > query_pos - window)
    v = values.float()
    full = torch.einsum("bhgrk,bhkd->bhgrd", logits.masked_fill(~causal, -math.inf).softmax(-1), v)
    part = torch.einsum("bhgrk,bhkd->bhgrd", logits.masked_fill(~(causal & near), -math.inf).softmax(-1), v)
    error = (full - part).pow(2).sum(-1) / full.pow(2).sum(-1).clamp(min=1e-12)
    return error.mean(dim=(2, 3))


@dataclass
class KVzipRecorder(KVzip):
    """KVzip that evicts nothing and hands its evidence to `sink` (calibration only; never registered)."""

    name = "kvzip"
    sink: dict = field(default=None, repr=False, compare=False)
    sample_rows: int = 64
    head_sink: int = 4
    head_window: int = 256

    def needs(self) -> Needs:
        return super().needs() | Needs(hidden_states=True)

    def observe(self, ctx: Context) -> None:
        if ctx.phase == "prefill":
            self.sink["hidden"][ctx.layer_idx] = ctx.hidden_states[0].to("cpu", torch.bfloat16)

    def _chunk_scores(self, ctx: Context, chunk, seen: int):
        layer = ctx.layer
        rows = ctx.q_len
        pick = torch.linspace(0, rows - 1, min(rows, self.sample_rows), device=ctx.query.device).round().long()
        query_pos = ctx.query_positions()[pick][None].expand(ctx.query.shape[0], -1)
        error = _streaming_error(ctx.query[:, :, pick], layer.keys_view(), layer.values_view(),
                                 layer.key_positions().long(), query_pos, layer.key_valid(), ctx.scaling,
                                 self.head_sink, self.head_window)
        self.sink["head_error"].setdefault(ctx.layer_idx, []).append(error[0].cpu())
        return super()._chunk_scores(ctx, chunk, seen)

    def evict(self, run: ModelPass, scores: dict) -> None:
        self.sink["scores"] = {i: s[0].cpu() for i, s in scores.items()}


def collect(model, tokenizer, texts: list, target: str = "kvzip", chunk_size: int = 2048, head_sink: int = 4,
            head_window: int = 256, log=print) -> list:
    """Per text: {'hidden': {layer: [T, H] bf16}, 'scores': {layer: [K, T] fp32 KVzip scores},
    'head_error': {layer: [K]}}. The model is patched for the duration only."""
    out = []
    for n, ids in enumerate(tracked(texts, "calibration: KVzip", unit="text")):
        sink = {"hidden": {}, "head_error": {}}
        policy = KVzipRecorder(compression_ratio=0.0, chunk_size=chunk_size, kvzip_plus=target == "kvzip_plus",
                               tokenizer=tokenizer, sink=sink, head_sink=head_sink, head_window=head_window)
        device = next(model.parameters()).device
        with torch.no_grad(), patch_model(model, policy):
            model(**with_cache(model, KVPressCache(model.config), input_ids=torch.tensor([ids], device=device),
                               use_cache=True, logits_to_keep=1))
        sink["head_error"] = {i: torch.stack(e).mean(0) for i, e in sink["head_error"].items()}
        out.append(sink)
        log(f"  text {n + 1}/{len(texts)}: {len(ids)} tokens")
    return out


# ---------------------------------------------------------------------------- fitting
def _design(records, layer, n_sink, tokens_per_text, seed):
    xs, ys = [], []
    gen = torch.Generator().manual_seed(seed)
    for r in records:
        hidden, scores = r["hidden"][layer].float(), r["scores"][layer]
        length = hidden.shape[0]
        pick = n_sink + torch.randperm(length - n_sink, generator=gen)[:tokens_per_text]
        xs.append(hidden[pick])
        ys.append(scores[:, pick].clamp(min=LOG_FLOOR).log().T)
    return torch.cat(xs), torch.cat(ys)


def _fit_linear(x, y, ridge):
    ones = torch.ones(x.shape[0], 1)
    a = torch.cat([x, ones], 1).double()
    gram = a.T @ a
    penalty = ridge * gram.diagonal()[:-1].mean() * torch.eye(gram.shape[0], dtype=gram.dtype)
    penalty[-1, -1] = 0  # the bias is not shrunk
    w = torch.linalg.solve(gram + penalty, a.T @ y.double()).float()
    return {"weight": w[:-1], "bias": w[-1]}


def _fit_mlp(x, y, hidden, steps, seed):
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(x.shape[1], hidden), torch.nn.GELU(), torch.nn.Linear(hidden, y.shape[1]))
    with torch.no_grad():
        net[2].bias.copy_(y.mean(0))
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    batch = 2048
    gen = torch.Generator().manual_seed(seed)
    with torch.enable_grad():
        for step in range(steps):
            pick = torch.randint(0, x.shape[0], (min(batch, x.shape[0]),), generator=gen)
            loss = torch.nn.functional.mse_loss(net(x[pick]), y[pick])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {"w1": net[0].weight.detach().T.contiguous(), "b1": net[0].bias.detach(),
            "w2": net[2].weight.detach().T.contiguous(), "b2": net[2].bias.detach()}


def _rank(x: torch.Tensor) -> torch.Tensor:
    return x.argsort(-1).argsort(-1).float()


def _metrics(calibration: Calibration, records, n_sink: int, keep: float = 0.25) -> dict:
    """Held-out agreement with KVzip: Spearman rank correlation and top-`keep` overlap per (layer, KV head), and
    the overlap of one top-`keep` over every layer and head (the 'global' allocation)."""
    spearman, overlap, global_overlap = [], [], []
    for r in records:
        true_all, pred_all = [], []
        for layer in calibration.layers:
            true = r["scores"][layer][:, n_sink:].clamp(min=LOG_FLOOR).log()
            pred = calibration.predict(layer, r["hidden"][layer][None].float())[0][:, n_sink:]
            true_all.append(true.flatten())
            pred_all.append(pred.flatten())
            rt, rp = _rank(true), _rank(pred)
            rt, rp = rt - rt.mean(-1, keepdim=True), rp - rp.mean(-1, keepdim=True)
            spearman += ((rt * rp).sum(-1) / (rt.norm(dim=-1) * rp.norm(dim=-1)).clamp(min=1e-12)).tolist()
            k = max(1, int(keep * true.shape[-1]))
            top_t = torch.zeros_like(true, dtype=torch.bool).scatter_(-1, true.topk(k, -1).indices, True)
            top_p = torch.zeros_like(pred, dtype=torch.bool).scatter_(-1, pred.topk(k, -1).indices, True)
            overlap += ((top_t & top_p).sum(-1).float() / k).tolist()
        true_all, pred_all = torch.cat(true_all), torch.cat(pred_all)
        k = max(1, int(keep * true_all.numel()))
        top_t = set(true_all.topk(k).indices.tolist())
        global_overlap.append(len(top_t & set(pred_all.topk(k).indices.tolist())) / k)
    mean = lambda v: round(sum(v) / len(v), 4)  # noqa: E731
    return {"spearman": mean(spearman), f"top{int(keep * 100)}_overlap": mean(overlap),
            f"global_top{int(keep * 100)}_overlap": mean(global_overlap), "held_out_texts": len(records)}


def calibrate(model, tokenizer, kind: str = "linear", target: str = "kvzip", n_texts: int = 16,
              n_tokens: int = 2048, held_out: int = 4, tokens_per_text: int | None = None, mlp_hidden: int = 32,
              mlp_steps: int = 600, ridge: float = 1e-3, n_sink: int = 4, head_window: int = 256, seed: int = 0,
              codebook_stages: int | None = None, log=print, progress=True) -> Calibration:
    """Run KVzip over `n_texts` local texts of about `n_tokens` tokens, fit the predictor on all but the last
    `held_out` texts and report its agreement with KVzip on those. `tokens_per_text`: tokens of each text the fit
    samples (None: every token after the sinks; on SmolLM2 that fits better than 768 sampled ones: Spearman 0.768
    vs 0.757 held out; kvzap at ratio 0.75 on the query-agnostic suite, 120 samples: 54.4 vs 51.7). CommVQ's
    codebooks are fitted on the same texts, `codebook_stages` stages (None: about 2 bits per number,
    codebooks.default_stages). `progress`: True (each stage's texts / layers on stderr), False, or a callable
    (kvpress/progress.py)."""
    with reporting(progress):
        return _calibrate(model, tokenizer, kind, target, n_texts, n_tokens, held_out, tokens_per_text, mlp_hidden,
                          mlp_steps, ridge, n_sink, head_window, seed, codebook_stages, log)


def _calibrate(model, tokenizer, kind, target, n_texts, n_tokens, held_out, tokens_per_text, mlp_hidden, mlp_steps,
               ridge, n_sink, head_window, seed, codebook_stages, log) -> Calibration:
    if kind not in ("linear", "mlp"):
        raise ValueError(f"kind={kind!r}; allowed values: 'linear', 'mlp'")
    if target not in ("kvzip", "kvzip_plus"):
        raise ValueError(f"target={target!r}; allowed values: 'kvzip', 'kvzip_plus'")
    if not (isinstance(n_texts, int) and isinstance(held_out, int) and 1 <= held_out < n_texts):
        raise ValueError(f"n_texts={n_texts!r}, held_out={held_out!r}; allowed values: ints with 1 <= held_out < n_texts")
    start = time.perf_counter()
    texts = calibration_texts(tokenizer, n_texts, n_tokens, seed)
    source = getattr(model.config, "_name_or_path", "") or type(model).__name__
    log(f"calibrating {source}: KVzip over {n_texts} local texts of ~{n_tokens} tokens")
    records = collect(model, tokenizer, texts, target, head_sink=n_sink, head_window=head_window, log=log)
    settings = dict(target=target, texts=n_texts, tokens=n_tokens, head_window=head_window, seed=seed,
                    source="stdlib docstrings + needle haystack + random facts")
    calibration = fit(records, model_identity(model), kind, held_out, tokens_per_text, mlp_hidden, mlp_steps, ridge,
                      n_sink, seed, settings)
    calibration.channels = label_channels(model, texts, calibration.layers)  # Double Sparsity's, from the same texts
    add_codebooks(calibration, model, texts, codebook_stages, log)
    add_less(calibration, model, texts, log)
    calibration.metrics["seconds"] = round(time.perf_counter() - start, 1)
    log(f"held-out agreement with KVzip: {calibration.metrics}")
    return calibration


def add_codebooks(calibration: Calibration, model, texts: list, stages: int | None, log=print) -> None:
    """Fit CommVQ's codebooks (kvpress/codebooks.py) on `texts`, `stages` stages (None: default_stages of the model's
    heads), and put them in `calibration`."""
    fitted = fit_codebooks(model, texts, calibration.layers, stages, log=log)
    calibration.codebooks = {kind: fitted[kind] for kind in ("keys", "values")}
    calibration.settings["codebooks"] = dict(texts=len(texts), tokens=max(len(t) for t in texts),
                                             stages=fitted["keys"].shape[3])
    calibration.metrics["codebook_held_out_relative_error"] = {kind: round(float(fitted[f"{kind}_errors"].mean()), 4)
                                                               for kind in ("key", "value")}


def add_less(calibration: Calibration, model, texts: list, log=print) -> None:
    """Fit LESS's feature maps (kvpress/less_fit.py) on `texts` (the last one held out) and put them in `calibration`."""
    fitted = fit_maps(model, texts, calibration.layers, log=log)
    calibration.less = fitted["maps"]
    calibration.settings["less"] = dict(texts=len(texts), tokens=max(len(t) for t in texts), heavy_ratio=0.1,
                                        recent_ratio=0.1, steps=240, held_out=1)
    calibration.metrics["less_held_out_loss"] = {kind: round(sum(v) / len(v), 6) for kind, v in (
        ("less", fitted["held_out_loss"]), ("h2o_alone", fitted["h2o_loss"]))}


def fit(records: list, identity: dict, kind: str = "linear", held_out: int = 1, tokens_per_text: int | None = None,
        mlp_hidden: int = 32, mlp_steps: int = 600, ridge: float = 1e-3, n_sink: int = 4, seed: int = 0,
        settings: dict | None = None) -> Calibration:
    """Fit the per-layer predictors on `records` (collect's output) but the last `held_out`, and measure them on
    those."""
    layers = sorted(records[0]["scores"])
    train, test = records[:-held_out], records[-held_out:]
    per_layer = []
    for layer in layers:
        x, y = _design(train, layer, n_sink, tokens_per_text, seed)
        per_layer.append(_fit_linear(x, y, ridge) if kind == "linear" else _fit_mlp(x, y, mlp_hidden, mlp_steps, seed))
    tensors = {name: torch.stack([p[name] for p in per_layer]) for name in per_layer[0]}
    head_error = torch.stack([torch.stack([r["head_error"][layer] for r in records]).mean(0) for layer in layers])
    settings = dict(settings or {}, held_out=held_out, tokens_per_text=tokens_per_text, ridge=ridge,
                    mlp_hidden=mlp_hidden if kind == "mlp" else None, n_sink=n_sink)
    calibration = Calibration(layers, kind, tensors, head_error, identity, settings)
    calibration.metrics = _metrics(calibration, test, n_sink)
    return calibration


HELD_OUT = 4  # texts `kvpress calibrate` keeps apart to measure the fit (calibrate's held_out)
MIN_TOKENS = 64  # shorter texts leave a layer too few tokens after the sinks to fit a predictor


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpress calibrate", description=__doc__.split("\n\n")[0], formatter_class=cli.ShowDefaults)
    parser.add_argument("--model", required=True, help="a local model folder, or a name from kvpress.models "
                                                       "(smollm2, gemma3)")
    parser.add_argument("--out", default=None, help=f"output file (default: <model folder>/{FILE_NAME})")
    parser.add_argument("--kind", default="linear", choices=("linear", "mlp"),
                        help="the KVzap predictor: linear (default; answers best) or a 2-layer mlp")
    parser.add_argument("--target", default="kvzip", choices=("kvzip", "kvzip_plus"),
                        help="the scores the predictor learns: KVzip's (default) or KVzip+'s (normalised)")
    parser.add_argument("--texts", type=int, default=16, help=f"calibration texts ({HELD_OUT} of them held out)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per text")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the model's dtype while calibrating (default float32)")
    parser.add_argument("--channels-only", action="store_true",
                        help="add Double Sparsity's label channels to the existing file at --out (its KVzap predictor "
                             "and head errors stay as they are); a forward per text, seconds")
    parser.add_argument("--codebooks-only", action="store_true",
                        help="add CommVQ's codebooks (keys and values) to the existing file at --out (the rest stays "
                             "as it is); minutes per layer on a CPU")
    parser.add_argument("--codebook-stages", type=int, default=None,
                        help="residual stages of CommVQ's codebooks, the most commvq may use (default: about 2 bits "
                             "per number, 9 for 64-channel heads)")
    parser.add_argument("--less-only", action="store_true",
                        help="add LESS's feature maps to the existing file at --out (the rest stays as it is); minutes "
                             "on a CPU")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:  # every flag, before the model loads (a calibration runs for minutes)
        source = arguments.model_folder("--model", args.model)
        arguments.at_least("--texts", args.texts, HELD_OUT + 1, f" ({HELD_OUT} texts are held out to measure the fit)")
        arguments.at_least("--tokens", args.tokens, MIN_TOKENS, " (tokens per text)")
        arguments.within_context("--tokens", args.tokens, source, " (tokens per text)")
        out = arguments.writable_file("--out", Path(args.out) if args.out else source / FILE_NAME)
        if args.codebook_stages is not None:
            arguments.at_least("--codebook-stages", args.codebook_stages, 1, " (residual stages)")
        for flag, what in (("channels_only", "label channels"), ("codebooks_only", "CommVQ's codebooks"),
                           ("less_only", "LESS's feature maps")):
            if getattr(args, flag) and not out.is_file():
                option = "--" + flag.replace("_", "-")
                raise ValueError(f"--out {out}: {option} adds {what} to an existing calibration file, and there is "
                                 f"none; allowed: a file `kvpress calibrate` made (without {option})")
    except ValueError as e:
        parser.exit(2, f"kvpress calibrate: error: {e}\n")
    torch.set_grad_enabled(False)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, args.dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    calibration = None  # (a new one), or the file that --channels-only / --codebooks-only / --less-only extends
    if args.channels_only or args.codebooks_only or args.less_only:
        calibration = Calibration.load(out)
        if calibration.identity != model_identity(model):
            parser.exit(2, f"kvpress calibrate: error: --out {out} was made for another model; allowed: this model's "
                           f"calibration file\n")
    with reporting(not args.no_progress):
        calibration = _run(args, model, tokenizer, calibration)
    calibration.save(out)
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB)")


def _run(args, model, tokenizer, calibration: Calibration | None) -> Calibration:
    if args.less_only:
        add_less(calibration, model, calibration_texts(tokenizer, args.texts, args.tokens))
    elif args.codebooks_only:
        add_codebooks(calibration, model, calibration_texts(tokenizer, args.texts, args.tokens), args.codebook_stages)
    elif args.channels_only:
        calibration.channels = label_channels(model, calibration_texts(tokenizer, args.texts, args.tokens),
                                              calibration.layers)
        calibration.settings["channels"] = dict(mode="qk", texts=args.texts, tokens=args.tokens)
    else:
        calibration = calibrate(model, tokenizer, kind=args.kind, target=args.target, n_texts=args.texts,
                                n_tokens=args.tokens, held_out=HELD_OUT, codebook_stages=args.codebook_stages,
                                progress=not args.no_progress)
    return calibration


if __name__ == "__main__":
    main()
