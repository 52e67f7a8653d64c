"""An evaluation's plan: every check of kvpress-eval's command line, made before any model or tokenizer loads
(`make_plan`), and the work it implies (`work_items`: this shard's samples; `make_sample`; `row_key`: what
identifies a finished row, so a rerun skips it). evals/cli.py runs the plan."""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvpress import arguments

SUITES = ("ruler", "longbench", "needle")

# ---------------------------------------------------------------------------- validation (no model loaded)
def _list(name: str, text: str) -> list[str]:
    return [x.strip() for x in (text or "").split(",") if x.strip()]


def _numbers(name: str, text: str, kind, low, high, what: str) -> list:
    values = []
    for item in _list(name, text):
        try:
            value = kind(item)
        except ValueError:
            raise ValueError(f"{name}={text!r}: {item!r} is not a number; allowed values: {what}") from None
        if not (low <= value < high if kind is float else low <= value <= high):
            raise ValueError(f"{name}={text!r}: {item} is out of range; allowed values: {what}")
        values.append(value)
    return values


@dataclass
class Plan:
    model: str  # as given
    model_path: Path
    context: int  # the model's max_position_embeddings
    suite: str
    subtasks: list[str]
    lengths: list[int]
    configs: list
    modes: list[str]
    n: int
    out: Path
    shard: tuple[int, int]
    depths: list[float] = field(default_factory=list)
    records: dict = field(default_factory=dict)  # longbench dataset -> records


def resolve_model(model: str) -> Path:
    return arguments.model_folder("--model", model)


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
        return True
    except ImportError:
        return False


def check_outputs(args) -> None:
    """Where the run writes, and what it needs to write it, before any work: the plots come last, after every
    sample was evaluated."""
    arguments.writable_folder("--out", args.out)
    if not args.no_plots and not _importable("matplotlib"):
        # plots are optional: the results and summary do not need them
        sys.stderr.write("kvpress-eval: matplotlib is not installed, so no plots (the summary is written without them;"
                         " pip install matplotlib for them, or pass --no-plots to silence this)\n")
        args.no_plots = True


def model_context(path: Path) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)  # reads config.json only
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return int(getattr(text, "max_position_embeddings"))


def shard_of(text: str | None) -> tuple[int, int]:
    if text is None:
        world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun / accelerate launch
        return (int(os.environ.get("RANK", "0")), world) if world > 1 else (0, 1)
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard={text!r}; allowed values: I/N with 0 <= I < N, e.g. 0/4") from None
    if not 0 <= i < n:
        raise ValueError(f"--shard={text!r}; allowed values: I/N with 0 <= I < N, e.g. 0/4")
    return i, n


def make_plan(args) -> Plan:
    """Every check of the command line, before any model (or tokenizer) is loaded."""
    from kvpress.policies.registry import get_policy_class, list_policies

    from . import longbench, ruler
    from .engine import Config, configs_for, parse_policy, takes_ratio
    from .runner import MODES

    if args.task not in SUITES:
        raise ValueError(f"--task={args.task!r} is unknown; allowed values: {list(SUITES)}")
    if args.threads is not None:
        arguments.at_least("--threads", args.threads, 1, " (torch CPU threads), or no --threads")
    arguments.device("--device", args.device)
    check_outputs(args)
    if args.tensor_parallel and args.shard is not None:
        raise ValueError("--tensor-parallel with --shard: the ranks share each sample's model; allowed: one of them")
    shard = (0, 1) if args.tensor_parallel else shard_of(args.shard)
    policies = _list("--policies", args.policies)
    if not policies:
        raise ValueError(f"--policies is empty; allowed values: a comma list of {list_policies()}")
    for policy in policies:
        name, _ = parse_policy(policy)
        for part in name.split("+"):
            try:
                get_policy_class(part.strip())
            except ValueError:
                raise ValueError(f"--policies: {policy!r} is unknown; allowed values: {list_policies()} "
                                 f"(or an eviction policy + a codec, e.g. snapkv+kivi; parameters after colons, "
                                 f"e.g. snapkv:budget_allocation=adaptive)") from None
        budgeted = {"compression_ratio", "budget"} & set(parse_policy(policy)[1])
        if budgeted and takes_ratio(policy):
            raise ValueError(f"--policies: {policy!r} sets {sorted(budgeted)[0]}, which --ratios sets for every policy "
                             f"that evicts; allowed: the ratio in --ratios, or another name for the config (a "
                             f"policy's own options after colons, e.g. snapkv:window_size=16)")
        Config(policy, 0.5).make()  # hyper-parameters are checked here, before any model loads
    ratios = _numbers("--ratios", args.ratios, float, 0.0, 1.0, "floats in [0, 1)")
    if not ratios and any(takes_ratio(p) for p in policies):
        raise ValueError("--ratios is empty; allowed values: a comma list of floats in [0, 1)")
    modes = _list("--modes", args.modes)
    if not modes or set(modes) - set(MODES):
        raise ValueError(f"--modes={args.modes!r}; allowed values: a comma list of {list(MODES)}")
    lengths = _numbers("--lengths", args.lengths, int, 1, 10**9, "positive token counts")
    if not lengths:
        raise ValueError("--lengths is empty; allowed values: a comma list of token counts, e.g. 2048,4096")
    if args.n < 1:
        raise ValueError(f"--n={args.n}; allowed values: an int >= 1")
    arguments.at_least("--seed", args.seed, 0)
    if args.page_tokens < 32 or args.page_tokens % 32:
        raise ValueError(f"--page-tokens={args.page_tokens}; allowed values: a positive multiple of 32 (vLLM's "
                         f"CPU attention)")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens={args.max_new_tokens}; allowed values: an int >= 1")
    if args.questions < 1:
        raise ValueError(f"--questions={args.questions}; allowed values: an int >= 1")
    depths = _numbers("--depths", args.depths, float, 0.0, 1.0 + 1e-9, "floats in [0, 1]")

    available = {"ruler": ruler.TASKS, "needle": ["needle"], "longbench": longbench.DATASETS}[args.task]
    if args.subtasks in (None, ""):
        subtasks = {"ruler": ruler.DEFAULT_TASKS, "needle": ["needle"], "longbench": None}[args.task]
        if subtasks is None:
            raise ValueError(f"--subtasks is required for longbench; allowed values: {available}")
    elif args.subtasks == "all":
        subtasks = list(available)
    else:
        subtasks = _list("--subtasks", args.subtasks)
        unknown = [s for s in subtasks if s not in available]
        if unknown:
            raise ValueError(f"--subtasks: {unknown} unknown for --task={args.task}; allowed values: {available}")
    if args.task == "ruler" and args.questions > 1:
        for s in subtasks:  # raises for single-question tasks
            ruler.tasks.builder(s, 0, lengths[0], questions=args.questions)
    if args.task == "needle" and not depths:
        raise ValueError("--depths is empty; allowed values: a comma list of floats in [0, 1]")

    path = resolve_model(args.model)
    context = model_context(path)
    too_long = [n for n in lengths if n > context]
    if too_long:
        raise ValueError(f"--lengths: {too_long} exceed the model's context ({context} tokens, "
                         f"max_position_embeddings); allowed values: lengths <= {context}")
    if "none" not in (parse_policy(p)[0] for p in policies):
        policies = ["none", *policies]  # the full cache: the reference of every bytes and score ratio in the summary
    configs = configs_for(policies, ratios)
    if args.engine == "vllm":
        from . import vllm_engine

        if args.tensor_parallel or args.kv_cache_gib <= 0:
            raise ValueError(f"--engine vllm runs on one process with a positive --kv-cache-gib; got "
                             f"--tensor-parallel={args.tensor_parallel}, --kv-cache-gib={args.kv_cache_gib}")
        vllm_engine.check(configs, modes, args.device)
    records = {}
    if args.task == "longbench":
        records = {d: longbench.load_records(d, args.data) for d in subtasks}
    return Plan(args.model, path, context, args.task, subtasks, lengths, configs, modes, args.n, Path(args.out), shard,
                depths, records)


# ---------------------------------------------------------------------------- work
def work_items(plan: Plan) -> list[tuple[str, int, int]]:
    """(subtask, length, index) for this shard, in a fixed order."""
    items = []
    for length in plan.lengths:
        for subtask in plan.subtasks:
            if plan.suite == "longbench":
                count = min(plan.n, len(plan.records[subtask]))
            elif plan.suite == "needle":
                count = plan.n * len(plan.depths)
            else:
                count = plan.n
            items += [(subtask, length, i) for i in range(count)]
    i, n = plan.shard
    return items[i::n]


def make_sample(plan: Plan, tokenizer, subtask: str, length: int, index: int, args):
    from . import longbench, needle, ruler

    if plan.suite == "ruler":
        return ruler.generate(subtask, tokenizer, length, index, args.seed, questions=args.questions)
    if plan.suite == "needle":
        return needle.generate(tokenizer, length, plan.depths[index % len(plan.depths)], index, args.seed)
    return longbench.to_sample(plan.records[subtask][index], subtask, index, max_tokens=length)


def row_key(model: str, row: dict) -> tuple:
    return (model, row["task"], row["length"], row["index"], row.get("depth"), row["mode"], row["policy"],
            float(row["ratio"]), row["question"], row.get("seed"))
