"""C kernels on CPU: a source file of kernels/ compiled once per machine with the system C compiler into
~/.cache/kvpress/native (the file name holds a hash of the source, the headers beside it and the flags, so an edit
rebuilds) and loaded with ctypes. The libraries link the libgomp that torch has already loaded, so their OpenMP loops
run on torch's thread pool. Each kernel's module keeps a torch version of the same computation for where no compiler
works."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

# fast reductions (sums reassociated for vectors), but infinities kept: masked slots are -inf
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fno-signed-zeros",
         "-fassociative-math", "-shared", "-fPIC"]


def compile_library(source: Path) -> ctypes.CDLL:
    """`source` compiled (once per machine and version of the source) and loaded; OSError where no compiler works."""
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # what the sources include
    digest = hashlib.sha256(source.read_bytes() + headers + " ".join(FLAGS).encode()).hexdigest()[:16]
    folder = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvpress" / "native"
    target = folder / f"{source.stem}-{digest}.so"
    if not target.exists():
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise OSError("no C compiler (cc, gcc or $CC) on PATH")
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:  # another process may build at the same time
            built = Path(tmp) / target.name
            command = [compiler, *FLAGS, str(source), "-o", str(built)]
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise OSError(f"{' '.join(command)} failed: {done.stderr[-2000:]}")
            os.replace(built, target)
    return ctypes.CDLL(str(target))


class NativeLibrary:
    """One kernel source, built and loaded on first use (thread-safe). `get()` is the library, or None where no
    compiler works: a warning then says once what runs instead (`fallback`: the torch version of the same
    computation). `declare(library)` sets the ctypes signatures."""

    def __init__(self, source: Path, declare, what: str, fallback: str):
        self.source, self.declare, self.what, self.fallback = source, declare, what, fallback
        self._lock = threading.Lock()
        self._library: ctypes.CDLL | None | bool = False  # False: not tried yet

    def get(self) -> ctypes.CDLL | None:
        with self._lock:
            if self._library is False:
                try:
                    library = compile_library(self.source)
                    self.declare(library)
                    self._library = library
                except OSError as error:
                    warnings.warn(f"kvpress: {self.what} could not be built ({error}); {self.fallback}",
                                  stacklevel=3)
                    self._library = None
            return self._library or None
