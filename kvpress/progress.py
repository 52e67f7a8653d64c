"""Progress of long work, reported to whoever asked for it.

A call that can run for more than a few seconds (a document's prefill, KVzip's replay, calibration, eval samples,
benchmark requests) opens a `task` and advances it. Where the reports go is chosen by the public call's `progress=`
argument and carried down by a context variable, so the code in between needs no parameter (a public call made
inside another sets its own: kvpress's nested calls, e.g. ask's compress, pass theirs on):

  True        on stderr (`Printed`), once a task has run 2 s, so short calls stay silent: a tqdm bar on a terminal,
              a plain line every 10 s elsewhere (a log file gets no escape codes). KVPRESS_PROGRESS=0 in the
              environment turns it off.
  False       nothing.
  a callable  called with every `Report` (a GUI, a log, a test).

A task opened outside any such call (a policy's replay inside a user's own patched `generate`) reports as True does.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import sys
import threading
import time
from typing import Callable, Iterable, Iterator


@dataclasses.dataclass(frozen=True)
class Report:
    task: str  # what runs, e.g. "prefill"
    done: int
    total: int | None  # None: not known in advance
    unit: str  # what `done` counts, e.g. "layer"
    elapsed_s: float
    depth: int = 0  # 0 for an outermost task, 1 for one opened inside it, ...
    finished: bool = False  # the task's last report (sent whether or not it ran to its total)
    note: str = ""  # what runs now, e.g. "snapkv 0.75: 40 samples"


Reporter = Callable[[Report], None]


class Printed:
    """Reports on a stream (stderr by default), shown once a task has run `delay_s`."""

    def __init__(self, stream=None, delay_s: float = 2.0, every_s: float = 10.0):
        self.stream = stream
        self.delay_s = delay_s
        self.every_s = every_s
        self._bars = {}  # (task, depth) -> tqdm bar, on a terminal
        self._printed = {}  # (task, depth) -> when its last line was printed, elsewhere

    def __call__(self, report: Report) -> None:
        stream = self.stream if self.stream is not None else sys.stderr
        key = (report.task, report.depth)
        if report.elapsed_s < self.delay_s and key not in self._bars and key not in self._printed:
            return  # short work stays silent (including its finish)
        if getattr(stream, "isatty", lambda: False)():
            self._bar(stream, key, report)
        else:
            self._line(stream, key, report)

    def _bar(self, stream, key, report: Report) -> None:
        from tqdm import tqdm  # (tqdm is a dependency; imported on first display so `import kvpress` stays light)

        bar = self._bars.get(key)
        if bar is None:
            bar = self._bars[key] = tqdm(total=report.total, desc=f"kvpress {report.task}", unit=report.unit,
                                         file=stream, position=report.depth, leave=report.depth == 0,
                                         dynamic_ncols=True)
        if report.note:
            bar.set_postfix_str(report.note, refresh=False)
        bar.update(report.done - bar.n)
        if report.finished:
            bar.close()
            del self._bars[key]

    def _line(self, stream, key, report: Report) -> None:
        now = time.monotonic()
        if not report.finished and now - self._printed.get(key, -self.every_s) < self.every_s:
            return
        self._printed[key] = now
        of = f"/{report.total}" if report.total else ""
        left = ""
        if report.total and 0 < report.done < report.total:
            left = f", ~{report.elapsed_s * (report.total - report.done) / report.done:.0f} s left"
        state = "done" if report.finished else report.note or "running"
        print(f"kvpress {report.task}: {report.done}{of} {report.unit}s, {report.elapsed_s:.0f} s{left} ({state})",
              file=stream, flush=True)
        if report.finished:
            del self._printed[key]


def reporter_for(progress) -> Reporter | None:
    """The reporter a `progress=` argument names (see the module docstring); ValueError for anything else."""
    if progress is True:
        return None if os.environ.get("KVPRESS_PROGRESS", "1") == "0" else Printed()
    if progress is False:
        return None
    if callable(progress):
        return progress
    raise ValueError(f"progress={progress!r:.60}; allowed values: True (on stderr), False (silent), or a callable "
                     f"taking a kvpress.progress.Report")


@dataclasses.dataclass
class _Scope:
    reporter: Reporter | None
    open: list  # the tasks open now, outermost first


_SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("kvpress_progress", default=None)


@contextlib.contextmanager
def reporting(progress) -> Iterator[None]:
    """Send the reports of the tasks opened inside the block to what `progress` names."""
    token = _SCOPE.set(_Scope(reporter_for(progress), []))
    try:
        yield
    finally:
        _SCOPE.reset(token)


class Task:
    def __init__(self, name: str, total: int | None, unit: str, scope: _Scope):
        self.name, self.total, self.unit = name, total, unit
        self.done = 0
        self.note = ""
        self._scope = scope
        self._depth = len(scope.open)
        self._start = time.monotonic()

    def advance(self, n: int = 1, note: str | None = None) -> None:
        """`n` more done (0: only a new `note`, what runs now)."""
        if note is not None:
            self.note = note
        self.done += n
        if self.total is not None:
            self.done = min(self.done, self.total)
        self._send(finished=False)

    @property
    def innermost(self) -> bool:
        """No other task is open inside this one (what a hook that counts forwards checks: a replay's forwards
        belong to the replay's task)."""
        return bool(self._scope.open) and self._scope.open[-1] is self

    def _send(self, finished: bool) -> None:
        if self._scope.reporter is not None:
            self._scope.reporter(Report(self.name, self.done, self.total, self.unit, time.monotonic() - self._start,
                                        self._depth, finished, self.note))


@contextlib.contextmanager
def task(name: str, total: int | None = None, unit: str = "step") -> Iterator[Task]:
    """A task the block advances (`.advance()`); its last report says finished."""
    scope = _SCOPE.get()
    if scope is None:  # outside any kvpress call that chose: the default
        scope = _Scope(reporter_for(True), [])
    opened = Task(name, total, unit, scope)
    scope.open.append(opened)
    try:
        yield opened
    finally:
        scope.open.remove(opened)
        opened._send(finished=True)


def tracked(items: Iterable, name: str, total: int | None = None, unit: str = "step") -> Iterator:
    """The items, advancing a task after each is consumed: `for text in tracked(texts, "calibration", unit="text")`.
    The task closes when the loop ends or is left (the generator is closed then)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)
    with task(name, total, unit) as t:
        for item in items:
            yield item
            t.advance()


@contextlib.contextmanager
def per_forward(modules, opened: Task) -> Iterator[None]:
    """Advance `opened` after each forward of any of `modules` (torch modules, e.g. a model's attention layers) run
    while it is the innermost task."""
    thread = threading.get_ident()

    def advance(*_):
        if opened.innermost and threading.get_ident() == thread:  # (a forward of another thread's call: not ours)
            opened.advance()

    handles = [m.register_forward_hook(advance) for m in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
