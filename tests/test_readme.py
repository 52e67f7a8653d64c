"""The README runs as written: its Python blocks, top to bottom in one session, on the SmolLM2 that `make models`
prepared, without a warning; the command lines it shows parse with the CLIs' own parsers. (The vLLM block runs
in the vLLM environment: tests/vllm_plugin/test_readme_vllm.py.)"""

import contextlib
import io
import re
import shlex
import warnings
from pathlib import Path

import pytest

README = (Path(__file__).parent.parent / "README.md").read_text()
PYTHON = re.findall(r"```python\n(.*?)```", README, re.S)
BASH = re.findall(r"```bash\n(.*?)```", README, re.S)


def vllm_blocks() -> list[str]:
    return [b for b in PYTHON if "from vllm" in b]


@pytest.mark.real_model
def test_every_python_block_runs_top_to_bottom_without_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)  # the blocks write doc.kvpress
    namespace: dict = {}
    blocks = [b for b in PYTHON if "from vllm" not in b]
    assert len(blocks) >= 6
    printed = io.StringIO()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, block in enumerate(blocks):
            with contextlib.redirect_stdout(printed if i == 0 else io.StringIO()):
                exec(compile(block, f"README.md python block {i}", "exec"), namespace)
    # the output the README shows under its first block is what it prints (but the first line's time)
    shown = re.findall(r"```python\n.*?```\n.*?```text\n(.*?)```", README, re.S)[0].splitlines()
    got = printed.getvalue().splitlines()
    assert len(got) == len(shown) and got[0].rsplit(" ", 1)[0] == shown[0].rsplit(" ", 1)[0] and got[1:] == shown[1:]
    ours = [w for w in caught if not issubclass(w.category, ResourceWarning)]
    assert not ours, [f"{w.category.__name__}: {w.message}" for w in ours]
    assert not [r for r in caplog.records if r.levelname == "WARNING" and r.name.startswith(("transformers", "kvpress"))]
    assert (tmp_path / "doc.kvpress").is_file()
    assert "past_key_values=" not in README.replace("`past_key_values=` still works", "")


def _commands(program: str) -> list[list[str]]:
    """Each `program ...` command of the bash blocks (continuation lines joined, comments and shell tails cut)."""
    out = []
    for block in BASH:
        text = re.sub(r"\\\n\s*", " ", block)
        for line in text.splitlines():
            line = line.split("#")[0].split("&")[0].split(";")[0].strip()
            words = shlex.split(line) if line else []
            for k, word in enumerate(words):
                if word.endswith(program) and (k + 1 == len(words) or words[k + 1].startswith("-")):
                    out.append(words[k + 1:])
                    break
    return out


def test_the_kvpress_eval_commands_shown_parse():
    from evals.cli import build_parser
    commands = _commands("kvpress-eval")
    assert len(commands) >= 3
    for args in commands:
        args = [a.replace("$i", "0") for a in args if a != "..."]
        if "--out" not in args:
            args += ["--out", "x"]
        build_parser().parse_args(args)  # exits (SystemExit 2) on an option the CLI lacks


def test_the_kvpress_commands_shown_parse():
    """`kvpress compress / ask / serve ...` as the README writes them parse with the commands' own parsers."""
    import kvpress.commands as commands
    parsers = dict(compress=commands._compress_parser, ask=commands._ask_parser, serve=commands._serve_parser)
    shown = []
    for block in BASH:
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            words = shlex.split(line.split("#")[0]) if line.split("#")[0].strip() else []
            if words and words[0].endswith("kvpress") and len(words) > 1 and words[1] in parsers:
                args = words[2:]
                parsers[words[1]]().parse_args(args[:args.index("--")] if "--" in args else args)
                shown.append(words[1])
    assert set(shown) == set(parsers), shown
