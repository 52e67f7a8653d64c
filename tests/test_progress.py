"""Progress reports (kvpress/progress.py): every long operation reports through the reporter its outermost call chose
(True: stderr; False: nothing; a callable), and a terminal gets a bar while a log file gets plain lines."""

import io

import pytest

import kvpress
from kvpress import progress
from kvpress.calibration import calibrate
from kvpress.integrations.registry import patch_of
from kvpress.progress import Printed, Report

from conftest import TOK as IDS_ONLY, tiny_model
from test_compressed import TOK

DOC = "The heron is named Pip. " * 12


def _tasks(reports, name):
    return [r for r in reports if r.task == name]


def test_compress_reports_each_layer_of_its_prefill_and_ask_each_decode_step():
    model, reports = tiny_model("llama"), []
    context = kvpress.compress(model, TOK, DOC, "snapkv", compression_ratio=0.5, progress=reports.append)
    prefill = _tasks(reports, "prefill")
    layers = model.config.num_hidden_layers
    assert [r.done for r in prefill] == [*range(1, layers + 1), layers] and prefill[-1].finished
    assert all(r.total == layers and r.unit == "layer" for r in prefill)
    reports.clear()
    answers = context.ask(TOK, ["Who?", "What is it?"], max_new_tokens=5, progress=reports.append)
    answering = _tasks(reports, "answering")
    assert answering[-1].finished and answering[-1].total == 5
    assert answering[-1].done == answers.decode_steps + 1  # every generated step (the first comes with the prompt)


def test_a_chunked_prefill_counts_every_chunks_layers():
    model, reports = tiny_model("llama"), []
    kvpress.compress(model, TOK, DOC, "snapkv", compression_ratio=0.5, window_size=8, prefill_chunk_size=100,
                     progress=reports.append)
    prefill = _tasks(reports, "prefill")
    chunks = -(-len(TOK.encode(DOC)) // 100)
    assert prefill[-1].total == prefill[-1].done == chunks * model.config.num_hidden_layers


def test_kvzips_replay_is_a_task_inside_the_prefill_and_its_forwards_are_not_counted_as_prefill_layers():
    model, reports = tiny_model("llama"), []
    kvpress.compress(model, TOK, DOC, "kvzip", compression_ratio=0.5, chunk_size=100, progress=reports.append)
    replay, prefill = _tasks(reports, "kvzip replay"), _tasks(reports, "prefill")
    chunks = -(-len(TOK.encode(DOC)) // 100)
    assert replay[-1].finished and replay[-1].done == replay[-1].total == chunks
    assert all(r.depth == 1 for r in replay) and all(r.depth == 0 for r in prefill)
    assert prefill[-1].done == model.config.num_hidden_layers  # the replay's forwards went to the replay's task


def test_calibration_reports_its_stages():
    reports = []
    calibrate(tiny_model("llama"), IDS_ONLY, n_texts=3, n_tokens=120, held_out=1, tokens_per_text=80, codebook_stages=2,
              log=lambda *a: None, progress=reports.append)
    names = {r.task for r in reports if r.finished}
    assert {"calibration: KVzip", "kvzip replay", "channels", "codebooks: fitting", "less: fitting"} <= names
    kvzip = [r for r in reports if r.task == "calibration: KVzip"]
    assert kvzip[-1].done == kvzip[-1].total == 3


def test_progress_false_is_silent_and_the_default_is_silent_for_short_work(capsys):
    model = tiny_model("llama")
    kvpress.ask(model, TOK, DOC, ["Who?"], "snapkv", compression_ratio=0.5, max_new_tokens=3, progress=False)
    kvpress.ask(model, TOK, DOC, ["Who?"], "snapkv", compression_ratio=0.5, max_new_tokens=3)  # < 2 s: no output
    assert capsys.readouterr().err == ""


def test_the_environment_turns_the_default_off(monkeypatch):
    monkeypatch.setenv("KVPRESS_PROGRESS", "0")
    assert progress.reporter_for(True) is None
    monkeypatch.setenv("KVPRESS_PROGRESS", "1")
    assert isinstance(progress.reporter_for(True), Printed)


def test_a_bad_progress_argument_is_refused_before_the_model_is_patched():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="progress='yes'; allowed values: True"):
        kvpress.compress(model, TOK, DOC, "snapkv", compression_ratio=0.5, progress="yes")
    assert patch_of(model) is None and model.config._attn_implementation == "sdpa"


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _run(printed: Printed, total=3):
    with progress.reporting(printed):
        for _ in progress.tracked(range(total), "work", unit="item"):
            pass


def test_a_log_file_gets_plain_lines_and_a_terminal_a_bar():
    log = io.StringIO()
    _run(Printed(stream=log, delay_s=0, every_s=0))
    lines = log.getvalue().splitlines()
    assert lines[0] == "kvpress work: 1/3 items, 0 s, ~0 s left (running)" and lines[-1].endswith("(done)")
    assert "\r" not in log.getvalue() and "\x1b" not in log.getvalue()
    terminal = _Terminal()
    _run(Printed(stream=terminal, delay_s=0))
    assert "\r" in terminal.getvalue() and "3/3" in terminal.getvalue()


def test_plain_lines_are_throttled_and_work_shorter_than_the_delay_prints_nothing():
    log = io.StringIO()
    _run(Printed(stream=log, delay_s=0, every_s=3600), total=50)
    assert len(log.getvalue().splitlines()) == 2  # the first line, and the finish
    quiet = io.StringIO()
    _run(Printed(stream=quiet, delay_s=3600), total=50)
    assert quiet.getvalue() == ""


def test_a_report_is_plain_data():
    r = Report("prefill", 3, 30, "layer", 1.5)
    assert (r.depth, r.finished, r.note) == (0, False, "")
