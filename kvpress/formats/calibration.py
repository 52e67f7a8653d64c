"""The calibration file: per-layer predictors of KVzip scores and per-head streaming errors for one model, made once
by `kvpress calibrate` (kvpress/calibration.py) and read by kvzap and duo_attention.

The file is safetensors (tensors + JSON metadata: the model's identity, the settings, held-out metrics); it cannot
run code when loaded. Its default place is beside the model's weights, under a name that does not end in
`.safetensors`: serving engines (vLLM) load every `*.safetensors` file of a model folder as weights. A file made for
another model is refused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError

FORMAT = "kvpress-calibration-1"
FILE_NAME = "kvpress_calibration.kvpress"  # beside the model's weights: the default place policies look
LEGACY_FILE_NAME = "kvpress_calibration.safetensors"  # the name before 0.2; read where FILE_NAME is missing


def identity_of(config, embedding: torch.Tensor) -> dict:
    """What a calibration file must match: the architecture's shape (a transformers config) and a fingerprint of the
    weights (the first rows of the input embedding, rounded to bf16 so fp32 and bf16 loads of one checkpoint agree)."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    embedding = embedding.detach()
    if hasattr(embedding, "full_tensor"):  # a DTensor (tensor parallelism): every rank fingerprints the whole table
        embedding = embedding.full_tensor()
    rows = embedding[:256].to("cpu", torch.bfloat16).contiguous()
    digest = hashlib.sha256(rows.view(torch.int16).numpy().tobytes()).hexdigest()[:16]
    return dict(model_type=config.model_type, layers=config.num_hidden_layers, hidden_size=config.hidden_size,
                kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                weights=digest)


def model_identity(model) -> dict:
    """identity_of a transformers model."""
    return identity_of(model.config, model.get_input_embeddings().weight)


def default_path(folder) -> Path | None:
    """Where the calibration file of the model in `folder` lives by default (None when it has no local folder): the
    current name, or the legacy one when only that exists."""
    if folder is None or not Path(folder).is_dir():
        return None
    path = Path(folder) / FILE_NAME
    legacy = Path(folder) / LEGACY_FILE_NAME
    return legacy if not path.exists() and legacy.exists() else path


@dataclass
class Calibration:
    """A per-layer predictor of KVzip scores and a per-head streaming error, for one model."""

    layers: list  # layer indices (the layers kvpress compresses), in order
    kind: str  # 'linear' | 'mlp'
    tensors: dict  # linear: weight [L, H, K], bias [L, K]; mlp: w1 [L, H, M], b1 [L, M], w2 [L, M, K], b2 [L, K]
    head_error: torch.Tensor  # [L, K] relative change of each head's output when it reads sinks + window only
    identity: dict
    settings: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)
    # [L, Hq, D] Double Sparsity's label channels: each query head's channels, most important first (None: not
    # calibrated; `kvpress calibrate --channels-only` adds them to a file)
    channels: torch.Tensor | None = None
    # CommVQ's tables {"keys", "values"}: [L, Hkv, G, S, P, 64] complex per layer, KV head, group, stage and pair (None:
    # not calibrated; `kvpress calibrate --codebooks-only` adds them to a file; formats/commvq.py reads them)
    codebooks: dict | None = None
    # LESS's feature maps {name: [L, heads, ...]} (formats/less.py names them; None: not calibrated; `kvpress calibrate
    # --less-only` adds them to a file)
    less: dict | None = None
    # per-layer predictor weights per device, moved there on first use (not at every decode step)
    _placed: dict = field(default_factory=dict, repr=False, compare=False)

    def predict(self, layer_idx: int, hidden: torch.Tensor) -> torch.Tensor:
        """Predicted log KVzip score [B, K, T] (fp32) of tokens whose attention input is `hidden` [B, T, H]."""
        x = hidden.float()
        key = (layer_idx, x.device)
        if key not in self._placed:
            rank = self.layers.index(layer_idx)
            self._placed[key] = {name: value[rank].to(x.device) for name, value in self.tensors.items()}
        t = self._placed[key]
        if self.kind == "linear":
            out = x @ t["weight"] + t["bias"]
        else:
            out = torch.nn.functional.gelu(x @ t["w1"] + t["b1"]) @ t["w2"] + t["b2"]
        return out.transpose(1, 2)

    def streaming_heads(self, fraction: float) -> dict:
        """{layer_idx: [K] bool}: the `fraction` of all (layer, KV head) pairs with the smallest streaming error."""
        flat = self.head_error.flatten()
        n = int(round(fraction * flat.numel()))
        chosen = torch.zeros(flat.numel(), dtype=torch.bool)
        chosen[flat.argsort(stable=True)[:n]] = True
        chosen = chosen.view_as(self.head_error)
        return {layer: chosen[i] for i, layer in enumerate(self.layers)}

    def label_channels(self, layer_idx: int, count: int) -> torch.Tensor:
        """[Hq, count] the `count` most important channels of each query head of a layer (Double Sparsity)."""
        return self.channels[self.layers.index(layer_idx), :, :count]

    def save(self, path) -> None:
        from safetensors.torch import save_file

        tensors = {name: t.contiguous().float() for name, t in self.tensors.items()}
        tensors["head_error"] = self.head_error.contiguous().float()
        if self.channels is not None:
            tensors["label_channels"] = self.channels.contiguous().long()
        for kind, tables in (self.codebooks or {}).items():  # fp16 (the tables' size is what a user downloads)
            tensors[f"codebook_{kind}"] = torch.view_as_real(tables.contiguous()).half()
        tensors.update({f"less_{name}": t.contiguous().half() for name, t in (self.less or {}).items()})
        meta = dict(format=FORMAT, kind=self.kind, layers=self.layers, identity=self.identity,
                    settings=self.settings, metrics=self.metrics)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path), metadata={"kvpress": json.dumps(meta)})

    @classmethod
    def load(cls, path) -> "Calibration":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("kvpress", "{}"))
            if meta.get("format") != FORMAT:
                raise ValueError(f"calibration={str(path)!r} is not a kvpress calibration file ({FORMAT}); make one "
                                 f"with `kvpress calibrate --model <model> --out {path}`")
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        head_error, channels = tensors.pop("head_error"), tensors.pop("label_channels", None)
        codebooks = {kind: torch.view_as_complex(tensors.pop(f"codebook_{kind}").float().contiguous())
                     for kind in ("keys", "values") if f"codebook_{kind}" in tensors}
        less = {name[5:]: tensors.pop(name).float() for name in list(tensors) if name.startswith("less_")}
        return cls(meta["layers"], meta["kind"], tensors, head_error, meta["identity"], meta.get("settings", {}),
                   meta.get("metrics", {}), channels, codebooks or None, less or None)

    @classmethod
    def for_model(cls, model, path=None) -> "Calibration":
        """The calibration of `model` (a policies.ModelInfo) from `path` (default: beside its weights), checked
        against the model; a missing or mismatched file is a ValueError that names the command making the right
        one."""
        path = Path(path) if path is not None else default_path(model.folder)
        command = f"kvpress calibrate --model {model.folder or '<the model folder>'}" + (
            f" --out {path}" if path is not None else "")
        allowed = f"allowed values: this model's calibration file (make one with `{command}`, minutes on a CPU)"
        if path is None or not path.is_file():
            raise ValueError(f"calibration={None if path is None else str(path)!r}: no calibration file for this model; "
                             f"{allowed}, or None for the one beside its weights")
        try:
            calibration = cls.load(path)
        except (OSError, KeyError, json.JSONDecodeError, SafetensorError) as e:
            raise ValueError(f"calibration={str(path)!r} cannot be read as a calibration file ({type(e).__name__}); "
                             f"{allowed}") from None
        identity = model.identity()
        if calibration.identity != identity:
            raise ValueError(f"calibration={str(path)!r} was made for another model ({calibration.identity}, this one "
                             f"is {identity}); {allowed}")
        if list(model.layers) != calibration.layers:
            raise ValueError(f"calibration={str(path)!r} covers layers {calibration.layers}, the model compresses "
                             f"{list(model.layers)}; {allowed}")
        return calibration
