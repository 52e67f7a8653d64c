"""kvpress's own commands (`kvpress`, `kvpress calibrate`, `kvpress-models`) refuse bad input before any work, with a
message naming the flag and the allowed values and exit status 2, never a traceback (issue 30 item 16). Run as the
user runs them: a new interpreter (python -m), with this checkout first on the path."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def command(module, *argv, cwd=ROOT):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=300)


def test_kvpress_help_lists_the_commands_and_exits_0():
    done = command("kvpress.cli", "--help")
    assert done.returncode == 0 and "calibrate" in done.stdout and done.stderr == ""
    done = command("kvpress.cli", "calibrat")
    assert done.returncode == 2 and "kvpress: error: 'calibrat'; allowed values: calibrate" in done.stderr


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
])
def test_kvpress_calibrate_checks_every_flag_before_the_model_loads(argv, message, tmp_path):
    """A missing model folder gave a hub repo-id error, --texts 2 a traceback with internal names, --tokens 0 wrote
    a file, an unwritable --out failed after the whole calibration ran. (--out points into tmp_path wherever the
    case allows: code that does not refuse must not overwrite the calibration installed beside the model.)"""
    blocker = tmp_path / "file"
    blocker.write_text("")
    argv = [a.format(file=blocker, folder=tmp_path) for a in argv]
    done = command("kvpress.cli", "calibrate", *argv, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "kvpress calibrate: error: --" in done.stderr and message in done.stderr
    assert "Traceback" not in done.stderr and list(tmp_path.iterdir()) == [blocker]


def test_every_option_of_every_command_has_help_text():
    import argparse

    from evals.cli import build_parser as eval_parser
    from kvpress.calibration import build_parser as calibrate_parser
    from kvpress.demo import build_parser as demo_parser
    from kvpress.models import build_parser as models_parser

    for parser in (eval_parser(), calibrate_parser(), demo_parser(), models_parser()):
        for action in parser._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help, f"{parser.prog}: {action.option_strings or action.dest} has no help text"
    done = command("kvpress.cli", "--help")
    assert "demo" in done.stdout and "calibrate" in done.stdout


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
])
def test_kvpress_eval_refuses_bad_flags_in_one_line(argv, message, tmp_path):
    done = command("evals.cli", "--model", "smollm2", "--out", str(tmp_path / "out"), *argv)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [l for l in done.stderr.splitlines() if l.strip()]
    assert lines[-1].startswith("kvpress-eval: error:") and message in lines[-1], done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_every_benchmark_script_imports():
    """benchmarks/ use the library's public pieces; a name that moved (the demo's TokenClock) broke two of them
    without a failing test."""
    names = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py"))
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'benchmarks'}")
    done = subprocess.run([sys.executable, "-c", f"import importlib\nfor m in {names!r}: importlib.import_module(m)"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
