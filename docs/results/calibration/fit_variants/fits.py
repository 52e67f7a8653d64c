import torch, os, time, sys
from kvpress import models
from kvpress.calibration import fit, model_identity
torch.set_grad_enabled(False)
records = torch.load("/tmp/diag/records.pt")
from transformers import AutoConfig
ident = model_identity(models.load("smollm2")[0])
variants = [
    ("linear-768", dict(kind="linear")),
    ("linear-all", dict(kind="linear", tokens_per_text=2048)),
    ("linear-all-ridge1e-2", dict(kind="linear", tokens_per_text=2048, ridge=1e-2)),
    ("linear-all-ridge1e-1", dict(kind="linear", tokens_per_text=2048, ridge=1e-1)),
    ("mlp16-all", dict(kind="mlp", tokens_per_text=2048, mlp_hidden=16, mlp_steps=1500)),
    ("mlp32-all", dict(kind="mlp", tokens_per_text=2048, mlp_hidden=32, mlp_steps=1500)),
]
for name, kw in variants:
    t = time.perf_counter()
    c = fit(records, ident, held_out=4, **kw)
    path = f"/tmp/diag/cal-{name}.safetensors"
    c.save(path)
    print(name, {k: round(v, 4) if isinstance(v, float) else v for k, v in c.metrics.items()},
          f"{os.path.getsize(path)/1024:.0f} KiB", f"{time.perf_counter()-t:.0f}s", flush=True)
