import torch, time
from kvpress import models
from kvpress.calibration import calibration_texts, collect
torch.set_grad_enabled(False)
model, tok = models.load("smollm2", dtype=torch.float32)
t = time.perf_counter()
texts = calibration_texts(tok, 16, 2048, 0)
records = collect(model, tok, texts, "kvzip", head_sink=4, head_window=256)
torch.save(records, "/tmp/diag/records.pt")
print("collected in", time.perf_counter() - t)
