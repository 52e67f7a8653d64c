"""What every section shares: the 8B attention shape, tolerances, deadlines, timing, bandwidth, system facts."""

from __future__ import annotations

import gc
import os
import platform
import subprocess
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch

import kvpress


HQ, HKV, D = 32, 8, 128  # Llama-3.1-8B attention shape
KIVI_GROUP = 32
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}
GIB = 2 ** 30


class TimeLimit(Exception):
    pass


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def expired(self) -> bool:
        return time.monotonic() > self.end

    def check(self) -> None:
        if self.expired():
            raise TimeLimit("time limit reached")


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def attempt(fn, *args, **kwargs):
    """(result, None), or (None, why) when CUDA runs out of memory or anything else fails; memory is freed either
    way. TimeLimit propagates."""
    why = None
    try:
        return fn(*args, **kwargs), None
    except TimeLimit:
        raise
    except torch.cuda.OutOfMemoryError:
        why = "does not fit (CUDA out of memory)"
    except Exception as e:  # a failing configuration is a result, not the end of the suite
        traceback.print_exc()
        why = f"error: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    free_memory()
    return None, why


class Timer:
    """Median seconds of fn() over reps, each rep timed with CUDA events; cold=True flushes the L2 cache (a 256 MiB
    write) before every rep, outside the timed interval, so small working sets are not read from cache."""

    def __init__(self, device):
        self.flush = torch.empty(256 * 2 ** 20, dtype=torch.int8, device=device)

    def __call__(self, fn, reps: int, warmup: int = 2, cold: bool = True) -> float:
        for _ in range(warmup):
            fn()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for s, e in zip(starts, ends):
            if cold:
                self.flush.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
        return times[len(times) // 2] / 1e3


_COPY_BW = None


def measured_copy_bandwidth() -> float | None:
    """copy_bandwidth() if a section has measured it, else None."""
    return _COPY_BW


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device torch copy of 1 GiB, counting bytes read and written (median of 20)."""
    global _COPY_BW
    if _COPY_BW is None:
        x = torch.empty(GIB, dtype=torch.uint8, device="cuda")
        y = torch.empty_like(x)
        seconds = Timer(torch.device("cuda"))(lambda: y.copy_(x), reps=20, warmup=3, cold=False)
        _COPY_BW = 2 * x.numel() / seconds
        del x, y
        free_memory()
    return _COPY_BW


def _run(cmd) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip() or None
    except Exception:
        return None


def _git_revision() -> str | None:
    root = str(Path(__file__).resolve().parents[1])
    head = _run(["git", "-C", root, "rev-parse", "--short", "HEAD"])
    if head and _run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"]):
        head += " + uncommitted changes"
    return head


def system_info(device) -> dict:
    import transformers

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    info = dict(date_utc=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"), host=platform.node(),
                python=platform.python_version(), torch=torch.__version__, triton=triton_version,
                transformers=transformers.__version__, kvpress=kvpress.__version__,
                kvpress_git=_git_revision(), device=str(device))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / GIB, 1),
                    multiprocessors=props.multi_processor_count, cuda_runtime=torch.version.cuda,
                    nvidia_smi=_run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                     "--format=csv,noheader"]))
    else:
        info.update(gpu=None, triton_interpret=os.environ.get("TRITON_INTERPRET"), threads=torch.get_num_threads())
    return info


def ints(text: str) -> list[int]:
    return [int(x) for x in str(text).split(",") if x]
