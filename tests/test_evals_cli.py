"""kvpress-eval end to end on a tiny random model (with SmolLM2's tokenizer), resume, sharding, and bad input
rejected before any model loads."""

import json

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from evals import cli, longbench
from evals.report import read_rows
from kvpress.models import model_path


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tok = AutoTokenizer.from_pretrained(model_path("smollm2"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _run(*argv):
    return cli.run(cli.build_parser().parse_args(list(argv)))


@pytest.fixture
def no_model(monkeypatch):
    """Fail loudly if the CLI loads a model."""
    def refuse(*a, **k):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(cli, "load_model", refuse)


RULER = ["--max-new-tokens", "6", "--task", "ruler", "--subtasks", "niah_single_1,qa", "--lengths", "384", "--n", "2",
         "--policies", "none,snapkv,h2o,streaming_llm", "--ratios", "0.5", "--modes", "query_aware,query_agnostic"]


def test_end_to_end_then_resume_without_recomputing(tiny_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    counts = _run("--model", str(tiny_dir), *RULER, "--out", str(out))
    assert counts["evaluated"] == 2 * 2 * 2 and counts["skipped"] == 0  # tasks x samples x modes
    rows = read_rows(out)
    assert len(rows) == 2 * 2 * 2 * 4  # ... x configs (none once, three policies at one ratio)
    assert {(r["policy"], r["ratio"]) for r in rows} == {("none", 0.0), ("snapkv", 0.5), ("h2o", 0.5),
                                                         ("streaming_llm", 0.5)}
    for r in rows:
        assert abs(r["n_tokens"] - 384) <= 0.03 * 384 and 0.0 <= r["score"] <= 1.0 and r["kv_bytes"] > 0
    full = {(r["task"], r["index"], r["mode"]): r["kv_bytes"] for r in rows if r["policy"] == "none"}
    assert all(r["kv_bytes"] < full[(r["task"], r["index"], r["mode"])] for r in rows if r["policy"] != "none")
    summary = (out / "summary.csv").read_text().splitlines()
    assert summary[0].startswith("task,length,mode,policy,ratio,n,score") and len(summary) == 1 + 2 * 2 * 4
    assert "| policy | ratio |" in (out / "summary.md").read_text()
    for mode in ("query_aware", "query_agnostic"):
        assert (out / f"accuracy_vs_ratio_{mode}.png").read_bytes()[:4] == b"\x89PNG"

    def refuse(*a, **k):
        raise AssertionError("a finished run must not load the model")
    monkeypatch.setattr(cli, "load_model", refuse)
    again = _run("--model", str(tiny_dir), *RULER, "--out", str(out))
    assert again["evaluated"] == 0 and again["skipped"] == 8
    assert len(read_rows(out)) == len(rows)
    assert len((out / "runs.jsonl").read_text().splitlines()) == 2


def test_shards_cover_the_run_exactly_once(tiny_dir, tmp_path):
    out, whole = tmp_path / "sharded", tmp_path / "whole"
    args = ["--model", str(tiny_dir), *RULER[:-2], "--modes", "query_aware", "--policies", "none,snapkv"]
    _run(*args, "--out", str(whole))
    for i in range(2):
        _run(*args, "--out", str(out), "--shard", f"{i}/2")
    assert sorted(p.name for p in out.glob("results*.jsonl")) == ["results.shard-0-of-2.jsonl",
                                                                   "results.shard-1-of-2.jsonl"]

    def key(r):
        return r["task"], r["index"], r["policy"], r["ratio"], r["prediction"]
    sharded = sorted(map(key, read_rows(out)))
    assert sharded == sorted(map(key, read_rows(whole))) and len(set(sharded)) == len(sharded)
    assert _run(*args, "--out", str(out))["evaluated"] == 0  # an unsharded rerun finds everything done


def test_needle_and_longbench_runs(tiny_dir, tmp_path):
    out = tmp_path / "needle"
    _run("--model", str(tiny_dir), "--max-new-tokens", "4", "--task", "needle", "--lengths", "256,512", "--depths", "0,0.5,1", "--n", "1",
         "--policies", "none,snapkv", "--ratios", "0.5", "--out", str(out), "--no-progress")
    rows = read_rows(out)
    assert sorted({(r["length"], r["depth"]) for r in rows}) == [(l, d) for l in (256, 512) for d in (0, 0.5, 1)]
    assert (out / "needle_heatmap_query_aware.png").read_bytes()[:4] == b"\x89PNG"

    data, out = tmp_path / "lb", tmp_path / "lb_out"
    longbench.write_fixture(data)
    _run("--model", str(tiny_dir), "--max-new-tokens", "4", "--task", "longbench", "--subtasks", "narrativeqa,trec,lcc", "--data", str(data),
         "--lengths", "200", "--n", "2", "--policies", "none,tova", "--ratios", "0.5", "--out", str(out),
         "--no-progress")
    rows = read_rows(out)
    assert len(rows) == 3 * 2 * 2 and all(r["n_tokens"] <= 200 for r in rows)


@pytest.mark.parametrize("argv,message", [
    (["--task", "rulers"], "--task='rulers' is unknown; allowed values: ['ruler', 'longbench', 'needle']"),
    (["--task", "ruler", "--lengths", "1024,4096"], "--lengths: [4096] exceed the model's context (2048"),
    (["--task", "ruler", "--policies", ""], "--policies is empty; allowed values"),
    (["--task", "ruler", "--policies", "snapkv,h3o"], "--policies: 'h3o' is unknown"),
    (["--task", "ruler", "--subtasks", "niah_single_9"], "--subtasks: ['niah_single_9'] unknown"),
    (["--task", "ruler", "--ratios", "0.5,1.0"], "--ratios='0.5,1.0': 1.0 is out of range"),
    (["--task", "ruler", "--modes", "query_blind"], "--modes='query_blind'; allowed values"),
    (["--task", "longbench"], "--subtasks is required for longbench"),
    (["--task", "ruler", "--shard", "2/2"], "--shard='2/2'"),
])
def test_bad_input_fails_before_any_model_loads(tiny_dir, tmp_path, no_model, argv, message):
    with pytest.raises(ValueError) as err:
        _run("--model", str(tiny_dir), "--out", str(tmp_path / "x"), *argv)
    assert message in str(err.value)
    assert not (tmp_path / "x").exists()


def test_main_reports_errors_and_exits_2(tiny_dir, tmp_path, capsys, no_model):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--model", str(tiny_dir), "--task", "ruler", "--policies", "", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert "kvpress-eval: error: --policies is empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--model", str(tmp_path / "nowhere"), "--task", "ruler", "--out", str(tmp_path)])
    assert "--model=" in capsys.readouterr().err


def test_summarize_only_rebuilds_outputs(tiny_dir, tmp_path):
    out = tmp_path / "s"
    out.mkdir()
    row = dict(task="qa", length=1024, index=0, mode="query_aware", policy="none", ratio=0.0, question=0, score=1.0,
               kv_bytes=10, prefill_s=1.0, decode_s=1.0, new_tokens=3)
    (out / "results.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(dict(row, index=1, score=0.0)) + "\n")
    _run("--model", "unused", "--task", "ruler", "--out", str(out), "--summarize")
    lines = (out / "summary.csv").read_text().splitlines()
    assert lines[1].startswith("qa,1024,query_aware,none,0.0,2,50.0,")


@pytest.mark.parametrize("flags, message", [
    (["--engine", "vllm", "--policies", "snapkv", "--ratios", "0.5"], "vLLM is not installed"),
    (["--engine", "vllm", "--page-tokens", "48", "--policies", "snapkv", "--ratios", "0.5"],
     "--page-tokens=48; allowed values: a positive multiple of 32"),
    (["--engine", "tgi", "--policies", "snapkv", "--ratios", "0.5"], None),
])
def test_engine_flag_is_checked_before_any_model_loads(tiny_dir, tmp_path, no_model, flags, message):
    args = ["--model", str(tiny_dir), "--task", "ruler", "--lengths", "384", "--n", "1", "--out", str(tmp_path), *flags]
    if message is None:  # not a choice: argparse's own usage error
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args(args)
        return
    with pytest.raises(ValueError, match=message):
        _run(*args)


# ---------------------------------------------------------------------------- issue 30: every flag checked first
@pytest.mark.parametrize("argv,message", [
    (["--threads", "0"], "--threads=0; allowed values: an int >= 1"),
    (["--threads", "-3"], "--threads=-3; allowed values: an int >= 1"),
    (["--device", "cuda:99"], "--device='cuda:99': "),
    (["--device", "gpu0"], "--device='gpu0': "),
])
def test_machine_flags_fail_before_any_model_loads(tiny_dir, tmp_path, no_model, argv, message):
    """--threads 0 was ignored, --threads -3 a traceback, --device cuda:7 on a CPU-only torch failed after loading
    the model."""
    with pytest.raises(ValueError) as err:
        _run("--model", str(tiny_dir), "--task", "ruler", "--out", str(tmp_path / "x"), *argv)
    assert message in str(err.value) and "allowed values" in str(err.value)
    assert not (tmp_path / "x").exists()


def test_an_unwritable_out_fails_before_any_model_loads(tiny_dir, tmp_path, no_model, capsys):
    """An --out below a file was a pathlib traceback once the model was loaded."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    for out in (blocker, blocker / "out"):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["--model", str(tiny_dir), "--task", "ruler", "--out", str(out)])
        assert exit_.value.code == 2
        assert "kvpress-eval: error: --out=" in capsys.readouterr().err


def test_without_matplotlib_the_summary_is_written_without_plots(tiny_dir, tmp_path, monkeypatch, no_model, capsys):
    """Without matplotlib the run crashed after every sample was done (the plots are the last step); plots are
    optional: a one-line message, and the summary without them."""
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    out = tmp_path / "s"
    out.mkdir()
    row = dict(task="qa", length=1024, index=0, mode="query_aware", policy="none", ratio=0.0, question=0, score=1.0,
               kv_bytes=10, prefill_s=1.0, decode_s=1.0, new_tokens=3)
    (out / "results.jsonl").write_text(json.dumps(row) + "\n")
    written = _run("--model", "unused", "--task", "ruler", "--out", str(out), "--summarize")["written"]
    assert "kvpress-eval: matplotlib is not installed, so no plots" in capsys.readouterr().err
    assert sorted(p.rsplit("/", 1)[-1] for p in written) == ["summary.csv", "summary.md"]


def test_the_summary_says_which_decode_times_were_shared_and_decode_alone_times_each_config():
    from evals.engine import decode_batches
    from evals.report import markdown, summarize

    rows = [dict(task="qa", length=1024, index=0, mode="query_aware", policy=p, ratio=r, question=0, score=1.0,
                 kv_bytes=b, cache_bytes=b, prefill_s=1.0, decode_s=s, new_tokens=4, batch=n)
            for p, r, b, s, n in [("none", 0.0, 100, 2.0, 1), ("snapkv", 0.5, 50, 3.0, 2), ("h2o", 0.5, 50, 3.0, 2)]]
    text = markdown(summarize(rows))
    assert "| none | 0.00 | 2.00 | 4.0 | 2.0 | alone |" in text
    assert "| snapkv | 0.50 | 3.00 | 4.0 |  | shared: a batch of 2 configs (the batch's time) |" in text

    class Pre:  # decode_batches(separate=True) reads nothing of the prefill
        caches = {}
    from evals.engine import configs_for
    configs = configs_for(["none", "snapkv", "h2o"], [0.5])
    assert [len(b) for b, _ in decode_batches(Pre(), configs, separate=True)] == [1] * len(configs)


def test_the_full_cache_is_evaluated_even_when_not_asked_for(tiny_dir, tmp_path):
    """Without `none` the summary's bytes column and accuracy-per-byte section had nothing to divide by."""
    from evals.plan import make_plan
    args = cli.build_parser().parse_args(["--model", str(tiny_dir), "--task", "ruler", "--policies", "snapkv",
                                          "--ratios", "0.5", "--lengths", "256", "--out", str(tmp_path)])
    assert [(c.policy, c.ratio) for c in make_plan(args).configs] == [("none", 0.0), ("snapkv", 0.5)]
    args.policies = "snapkv,none"
    assert [(c.policy, c.ratio) for c in make_plan(args).configs] == [("snapkv", 0.5), ("none", 0.0)]
