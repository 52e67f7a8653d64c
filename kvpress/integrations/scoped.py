"""A kvpress call's own patch: the one-call API (compress, ask, speculative_generate) patches an unpatched model for
the time it runs, and for itself alone.

`patched_for_call(model, policy, ...)` is a context manager. Inside it, this thread's calls on the model run under a
`ScopedPatch`; on every other thread the model runs as if unpatched (a plain `generate` with a stock cache, started
before or during the call, is served by the model's own attention, hooks and generate). Calls on several threads
that need the same policy and settings share one patch, which comes off when the last of them returns; a call that
needs another waits until then (and calls that arrive while one waits queue behind it, so none waits for ever). A
model the caller patched itself is the caller's: the call is refused (CallerPatched), and speculative_generate runs
on that patch instead.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

from ..policies import resolve_policy
from .patch import Patch
from .patching import install
from .registry import patch_of


class ScopedPatch(Patch):
    """A Patch that serves only the threads inside a patched_for_call block."""

    def serves_this_thread(self) -> bool:
        return self.live.scopes > 0

    def _patch_copy(self, twin) -> None:
        """A copy of the model taken during a call is the model as it was: unpatched (the scope is the call's)."""


class CallerPatched(ValueError):
    """The model is patched by its caller (patch_model): a kvpress call does not patch it again."""


class _Shared:
    def __init__(self, patch: Patch, key):
        self.patch, self.key, self.calls = patch, key, 0


_CHANGED = threading.Condition()
_SHARED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> _Shared (its ScopedPatch in use)
_WAITING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> calls waiting for another policy


@contextlib.contextmanager
def patched_for_call(model, policy, prefill_chunk_size: int | None = None, question_tokens: int | None = None):
    """`model` patched with `policy` (and these settings) for this thread while the block runs; yields the Patch."""
    policy = resolve_policy(policy)
    key = (policy, prefill_chunk_size, question_tokens)
    shared = _join(model, policy, key, prefill_chunk_size, question_tokens)
    live = shared.patch.live
    live.scopes += 1
    try:
        yield shared.patch
    finally:
        live.scopes -= 1
        with _CHANGED:
            shared.calls -= 1
            if shared.calls == 0:
                del _SHARED[model]
                shared.patch.unpatch()
                _CHANGED.notify_all()


def _join(model, policy, key, prefill_chunk_size, question_tokens) -> _Shared:
    with _CHANGED:
        queued = False
        try:
            while True:
                shared = _SHARED.get(model)
                existing = patch_of(model)
                if existing is not None and (shared is None or existing is not shared.patch):
                    raise CallerPatched(
                        f"model is already patched by kvpress with {existing.policy.describe()} (its caller's patch); "
                        f"allowed: an unpatched model (this call patches it for itself), or patch.unpatch() first")
                if shared is None:
                    if _WAITING.get(model, 0) and not queued:
                        pass  # calls that waited first go first
                    else:
                        shared = _SHARED[model] = _Shared(install(ScopedPatch, model, policy, prefill_chunk_size,
                                                                  question_tokens), key)
                        shared.calls = 1
                        return shared
                elif shared.key == key and (shared.patch.live.scopes or not _WAITING.get(model, 0)):
                    shared.calls += 1  # (a call nested in one this thread runs joins at once: waiting would deadlock)
                    return shared
                elif shared.patch.live.scopes:
                    raise ValueError(f"a kvpress call on this thread already runs this model with "
                                     f"{shared.patch.policy.describe()}; a call inside it cannot use "
                                     f"{policy.describe()}; allowed: the same policy, or the call after it returns")
                if not queued:
                    _WAITING[model] = _WAITING.get(model, 0) + 1
                    queued = True
                _CHANGED.wait()
        finally:
            if queued:
                _WAITING[model] -= 1
