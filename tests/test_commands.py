"""kvpress's own commands (`kvpress`, `kvpress compress / ask / eval / serve / calibrate / demo`, `kvpress-models`)
refuse bad input before any work, with a message naming the flag and the allowed values and exit status 2, never a
traceback (issue 30 item 16). Each command
runs once as the user runs it (a new interpreter, python -m, with this checkout first on the path); the many bad-flag
cases call the same `main(argv)` in this process, with model loading made to fail, so a refusal that comes too late
fails the test instead of starting a calibration or an eval (and no case pays a new interpreter's import time)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import evals.cli
import kvpress.calibration
import kvpress.cli
import kvpress.commands

ROOT = Path(__file__).resolve().parents[1]


def command(module, *argv, cwd=ROOT):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=300)


class NoModelLoads:
    """Stands in for the model loader while a command is expected to refuse its flags."""

    @staticmethod
    def from_pretrained(*args, **kwargs):
        raise AssertionError("the model started loading before the bad flag was refused")


def refused(main, argv, capsys) -> str:
    """Runs a command's main(argv) here; returns its stderr after checking it exited with status 2."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--help"], []])
def test_kvpress_and_its_help_list_the_commands_and_exit_0_without_loading_torch(argv):
    probe = ("import sys, runpy; sys.argv = ['kvpress', *sys.argv[1:]]\n"
             "try:\n    runpy.run_module('kvpress.cli', run_name='__main__')\n"
             "finally:\n    print('torch loaded' if 'torch' in sys.modules else 'no torch', file=sys.stderr)")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=60)
    assert done.returncode == 0 and done.stderr == "no torch\n", done.stderr[-2000:]
    assert all(name in done.stdout for name in ("compress", "ask", "eval", "serve", "calibrate", "demo"))


def test_every_public_name_of_the_package_loads():
    """kvpress's names load on first use (its __init__): each resolves, to what its module defines."""
    import kvpress
    for name in kvpress.__all__:
        assert getattr(kvpress, name) is not None, name
    assert callable(kvpress.combine) and callable(kvpress.compress) and kvpress.DEFAULT_POLICY == "kvzap+kivi"


def test_kvpress_models_refuses_an_unknown_name_before_any_download():
    done = command("kvpress.models", "smolm2")
    assert done.returncode == 2 and "'smolm2' is unknown; allowed values: gemma3, smollm2" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("argv,message", [
    (["--model", "no/such/folder"], "--model='no/such/folder': not a folder with config.json, nor a kvpress model"),
    (["--model", "smollm2", "--texts", "2", "--out", "{folder}/c.safetensors"],
     "--texts=2; allowed values: an int >= 5 (4 texts are held out"),
    (["--model", "smollm2", "--tokens", "0", "--out", "{folder}/c.safetensors"], "--tokens=0; allowed values: an int >= 64"),
    (["--model", "smollm2", "--out", "{file}/calibration.safetensors"], "--out="),
    (["--model", "smollm2", "--out", "{folder}"], "is a folder; allowed values: a file path you can write to"),
    (["--model", "smollm2", "--channels-only", "--out", "{folder}/none.kvpress"],
     "--channels-only adds label channels to an existing calibration file, and there is none"),
    (["--model", "smollm2", "--codebooks-only", "--out", "{folder}/none.kvpress"],
     "--codebooks-only adds CommVQ's codebooks to an existing calibration file, and there is none"),
    (["--model", "smollm2", "--codebook-stages", "0"], "--codebook-stages"),
    (["--model", "smollm2", "--tokens", str(10 ** 8), "--out", "{folder}/c.kvpress"],
     "--tokens=100000000: more tokens than the model reads (max_position_embeddings=8192)"),
    (["--model", "smollm2", "--out", "/proc/calibration.kvpress"], "'/proc' is not a folder you can write to"),
])
def test_kvpress_calibrate_checks_every_flag_before_the_model_loads(argv, message, tmp_path, monkeypatch, capsys):
    """A missing model folder gave a hub repo-id error, --texts 2 a traceback with internal names, --tokens 0 wrote
    a file, an unwritable --out failed after the whole calibration ran. (--out points into tmp_path wherever the
    case allows: code that does not refuse must not overwrite the calibration installed beside the model.)"""
    blocker = tmp_path / "file"
    blocker.write_text("")
    argv = [a.format(file=blocker, folder=tmp_path) for a in argv]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(kvpress.calibration, "AutoModelForCausalLM", NoModelLoads)
    stderr = refused(kvpress.calibration.main, argv, capsys)
    assert "kvpress calibrate: error: --" in stderr and message in stderr
    assert list(tmp_path.iterdir()) == [blocker]


def test_kvpress_refuses_an_unknown_command(capsys):
    assert "kvpress: error: 'calibrat'; allowed values: compress, ask, eval, serve, calibrate, demo" in refused(kvpress.cli.main, ["calibrat"], capsys)


def test_every_option_of_every_command_has_help_text(capsys):
    import argparse

    from evals.cli import build_parser as eval_parser
    from kvpress.calibration import build_parser as calibrate_parser
    from kvpress.demo import build_parser as demo_parser
    from kvpress.models import build_parser as models_parser

    commands = [parser() for parser in (kvpress.commands._compress_parser, kvpress.commands._ask_parser,
                                        kvpress.commands._serve_parser)]
    for parser in (eval_parser(), calibrate_parser(), demo_parser(), models_parser(), *commands):
        for action in parser._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help, f"{parser.prog}: {action.option_strings or action.dest} has no help text"
    with pytest.raises(SystemExit):
        kvpress.cli.main(["--help"])
    usage = capsys.readouterr().out
    assert "demo" in usage and "calibrate" in usage


def test_the_demo_refuses_a_bad_flag_in_one_line():
    done = command("kvpress.demo", "--tokens", "0")
    assert done.returncode == 2 and "--tokens=0; allowed values: an int >= 1" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.real_model
def test_the_demo_runs_and_answers_the_same_after_save_and_load():
    done = command("kvpress.demo", "--tokens", "500", "--new-tokens", "4")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "full cache" in done.stdout and "kvzap+kivi" in done.stdout
    assert "Asked again after loading: the same answers." in done.stdout


@pytest.mark.parametrize("argv,message", [
    (["--task", "rulr"], "--task"),
    (["--task", "ruler", "--ratios", "1.5"], "--ratios"),
    (["--task", "ruler", "--policies", "snapkv,nosuch"], "nosuch"),
    (["--task", "ruler", "--device", "cpu:3"], "--device='cpu:3': torch has one CPU device; allowed values: auto, cpu"),
    (["--task", "ruler", "--page-tokens", "0"], "--page-tokens=0; allowed values: a positive multiple of 32"),
    (["--task", "ruler", "--seed", "-1"], "--seed=-1; allowed values: an int >= 0"),
    (["--task", "ruler", "--policies", "snapkv:compression_ratio=0.5"],
     "--policies: 'snapkv:compression_ratio=0.5' sets compression_ratio, which --ratios sets"),
])
def test_kvpress_eval_refuses_bad_flags_in_one_line(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(evals.cli, "load_model", NoModelLoads.from_pretrained)
    stderr = refused(evals.cli.main, ["--model", "smollm2", "--out", str(tmp_path / "out"), *argv], capsys)
    lines = [l for l in stderr.splitlines() if l.strip()]
    assert lines[-1].startswith("kvpress-eval: error:") and message in lines[-1], stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_kvpress_eval_refuses_an_unwritable_out_and_a_summary_of_nothing(tmp_path, monkeypatch, capsys):
    """--out in a folder no file can be made in (root passes permission bits: /proc), and --summarize of a folder that
    does not exist (it exited 0, writing nothing)."""
    monkeypatch.setattr(evals.cli, "load_model", NoModelLoads.from_pretrained)
    stderr = refused(evals.cli.main, ["--model", "smollm2", "--task", "ruler", "--out", "/proc/kvpress-out"], capsys)
    assert "--out='/proc/kvpress-out': '/proc' is not a folder you can write to" in stderr
    stderr = refused(evals.cli.main, ["--model", "smollm2", "--task", "ruler", "--out", str(tmp_path / "missing"),
                                      "--summarize"], capsys)
    assert "holds no results*.jsonl to summarize" in stderr and not (tmp_path / "missing").exists()


def test_the_demo_refuses_a_document_longer_than_the_model_reads(capsys):
    import kvpress.demo

    for argv in (["--tokens", str(10 ** 8)], ["--new-tokens", str(10 ** 8)]):
        stderr = refused(kvpress.demo.main, argv, capsys)
        assert "with the questions that is more than SmolLM2 reads (8192 tokens)" in stderr


def test_every_benchmark_script_imports():
    """benchmarks/ use the library's public pieces; a name that moved (the demo's TokenClock) broke two of them
    without a failing test."""
    names = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'benchmarks'}")
    done = subprocess.run([sys.executable, "-c", f"import importlib\nfor m in {names!r}: importlib.import_module(m)"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("argv,message", [
    (["missing.txt", "--out", "x.kvpress"], "file='missing.txt': cannot be read as UTF-8 text"),
    (["{doc}", "--out", "x.kvpress", "--policy", "snapkv"], "give exactly one of compression_ratio"),
    (["{doc}", "--out", "x.kvpress", "--policy", "snapkv", "--ratio", "1.5"], "compression_ratio=1.5"),
    (["{doc}", "--out", "x.kvpress", "--param", "window_size"], "--param 'window_size'; allowed values: NAME=VALUE"),
    (["{doc}", "--out", "x.kvpress", "--param", "windw=3"], "unknown parameter(s) ['windw']"),
    (["{doc}", "--out", "{folder}"], "is a folder"),
    (["{doc}", "--out", "x.kvpress", "--model", "no/such/folder"], "--model='no/such/folder'"),
])
def test_kvpress_compress_checks_every_flag_before_the_model_loads(argv, message, tmp_path, monkeypatch, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text("A short document.")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(kvpress.commands, "AutoModelForCausalLM", NoModelLoads)
    stderr = refused(kvpress.commands.compress_main, [a.format(doc=doc, folder=tmp_path) for a in argv], capsys)
    assert stderr.startswith("kvpress compress: error: ") and message in stderr, stderr


@pytest.mark.parametrize("argv,message", [
    (["missing.kvpress", "q"], "context='missing.kvpress' is not a file"),
    (["{file}", "q", "--new-tokens", "0"], "--new-tokens=0; allowed values: an int >= 1"),
])
def test_kvpress_ask_checks_its_flags_before_the_model_loads(argv, message, tmp_path, monkeypatch, capsys):
    (tmp_path / "c.kvpress").write_bytes(b"not read before the flags are checked")
    monkeypatch.setattr(kvpress.commands, "AutoModelForCausalLM", NoModelLoads)
    stderr = refused(kvpress.commands.ask_main, [a.format(file=tmp_path / "c.kvpress") for a in argv], capsys)
    assert stderr.startswith("kvpress ask: error: ") and message in stderr, stderr


def test_kvpress_ask_refuses_a_file_that_is_not_a_context_before_the_model_loads(tmp_path, monkeypatch, capsys):
    (tmp_path / "c.kvpress").write_bytes(b"not a kvpress file")
    monkeypatch.setattr(kvpress.commands, "AutoModelForCausalLM", NoModelLoads)
    stderr = refused(kvpress.commands.ask_main, [str(tmp_path / "c.kvpress"), "q"], capsys)
    assert stderr.startswith("kvpress ask: error: ") and stderr.count("\n") == 1, stderr


@pytest.mark.real_model
def test_kvpress_compress_then_ask_answer_as_the_library_does(tmp_path):
    """The two commands, each a new interpreter as a user runs them, against compress / ask in this process."""
    import json

    from kvpress.models import load

    text = "The vault code is 5521. The vault is in Oslo. " + "Nothing happens here today. " * 60
    (tmp_path / "doc.txt").write_text(text)
    out = tmp_path / "doc.kvpress"
    done = command("kvpress.cli", "compress", str(tmp_path / "doc.txt"), "--out", str(out), "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    made = json.loads(done.stdout)
    questions = ["What is the vault code?", "Where is the vault?"]
    done = command("kvpress.cli", "ask", str(out), *questions, "--new-tokens", "8", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    asked = json.loads(done.stdout)

    model, tokenizer = load("smollm2")
    here = kvpress.compress(model, tokenizer, text)  # the default policy, as the command's
    assert made["context_bytes"] == here.nbytes() and made["kept_fraction"] == here.kept_fraction()
    assert made["policy"] == here.policy
    assert asked["answers"] == here.ask(tokenizer, questions, max_new_tokens=8).answers
    assert asked["context_bytes"] == made["context_bytes"] < made["full_cache_bytes"] / 5


def test_the_default_policy_compresses_without_any_argument():
    """`compress(model, tokenizer, document)` works as written: the measured default, kvzap+kivi at 0.75."""
    import kvpress.compressed as compressed
    assert compressed.default_policy(None, {}) == ("kvzap+kivi", compressed.DEFAULT_PARAMS)
    assert compressed.default_policy(None, {"budget": 64})[1] == dict(budget=64, bits=4, residual_length=32)
    assert compressed.default_policy(None, {"bits": 2})[1]["bits"] == 2  # a parameter given overrides it
    assert compressed.default_policy("snapkv", {"compression_ratio": 0.5}) == ("snapkv", {"compression_ratio": 0.5})


@pytest.mark.parametrize("argv,message", [
    (["no/such/folder", "--policy", "snapkv", "--ratio", "0.5"], "model='no/such/folder': not a folder with config.json"),
    (["smolm2", "--policy", "snapkv", "--ratio", "0.5"], "model='smolm2': not a folder with config.json, nor a kvpress"),
    (["{model}", "--policy", "kvzap+kivi", "--ratio", "0.5"], "low-bit codes"),
    (["{model}", "--policy", "kvzap", "--ratio", "0.5", "--param", "budget_allocation=global"], "model-level pass"),
    (["{model}", "--policy", "snapkv", "--ratio", "2"], "compression_ratio=2"),
])
def test_kvpress_serve_refuses_settings_the_engine_would_refuse_before_it_starts(argv, message, tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    stderr = refused(kvpress.commands.serve_main, [a.format(model=tmp_path) for a in argv], capsys)
    assert stderr.startswith("kvpress serve: error: ") and message in stderr, stderr


def test_kvpress_serve_hands_vllm_the_checked_settings(tmp_path, capsys):
    import json
    (tmp_path / "config.json").write_text("{}")
    kvpress.commands.serve_main([str(tmp_path), "--policy", "snapkv", "--ratio", "0.75", "--dry-run", "--",
                                 "--max-model-len", "4096"])
    command_line = json.loads(capsys.readouterr().out)
    assert command_line[:6] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tmp_path),
                                "--additional-config"]
    assert json.loads(command_line[6]) == {"kvpress": {"policy": "snapkv", "compression_ratio": 0.75}}
    assert command_line[7:] == ["--max-model-len", "4096"]


def test_kvpress_eval_is_kvpress_eval(monkeypatch):
    seen = []
    monkeypatch.setattr(evals.cli, "main", seen.append)
    kvpress.cli.main(["eval", "--task", "ruler"])
    assert seen == [["--task", "ruler"]]


def test_compress_and_ask_pass_no_progress_on(tmp_path, monkeypatch):
    """--no-progress reaches the library call (progress=False); without it the library's default (True) runs."""
    import kvpress.commands as commands

    class Stop(Exception):
        pass

    seen = []

    def recording(*args, **kwargs):
        seen.append(kwargs["progress"])
        raise Stop

    (tmp_path / "doc.txt").write_text("A document.")
    monkeypatch.setattr(commands, "_load", lambda args: (None, None))
    monkeypatch.setattr(commands.compressed, "compress", recording)
    for flags in ([], ["--no-progress"]):
        with pytest.raises(Stop):
            commands.compress_main([str(tmp_path / "doc.txt"), "--out", str(tmp_path / "d.kvpress"), *flags])
    assert seen == [True, False]
