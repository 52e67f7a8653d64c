"""LongBench (English tasks): records from local JSONL files (LongBench's own format) or from the `datasets`
cache when a user has THUDM/LongBench there (never downloaded here); the official prompts, generation lengths
and metrics; prompts longer than the budget are cut in the middle, as LongBench's pred.py does.

`write_fixture(directory)` writes a small synthetic JSONL set in LongBench's format (used by the tests)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from .samples import Question, Sample

# config/dataset2prompt.json (English tasks). The prompt is split where {context} ends: what comes before (and
# the context) is what query-agnostic mode compresses; the rest holds the question.
PROMPTS = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the question as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",  # noqa: E501
    "qasper": "You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",  # noqa: E501
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "2wikimqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "musique": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",  # noqa: E501
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",  # noqa: E501
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",  # noqa: E501
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}",  # noqa: E501
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",  # noqa: E501
    "passage_retrieval_en": "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like \"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: ",  # noqa: E501
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}
MAX_NEW = {"narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "hotpotqa": 32, "2wikimqa": 32, "musique": 32,
           "gov_report": 512, "qmsum": 512, "multi_news": 512, "trec": 64, "triviaqa": 32, "samsum": 128,
           "passage_count": 32, "passage_retrieval_en": 32, "lcc": 64, "repobench-p": 64}
METRIC = {**dict.fromkeys(["narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique",
                           "triviaqa"], "qa_f1"),
          **dict.fromkeys(["gov_report", "qmsum", "multi_news", "samsum"], "rouge_l"),
          "trec": "classification", "passage_count": "count", "passage_retrieval_en": "retrieval",
          "lcc": "code_sim", "repobench-p": "code_sim"}
FIRST_LINE = {"trec", "triviaqa", "samsum"}  # scored on the first line of the prediction
NO_CHAT = {"trec", "triviaqa", "samsum", "lcc", "repobench-p"}  # few-shot / completion: no chat template
DATASETS = list(PROMPTS)


def _check(dataset: str) -> None:
    if dataset not in PROMPTS:
        raise ValueError(f"dataset={dataset!r} is not supported; allowed values: {DATASETS} (English LongBench)")


def load_records(dataset: str, data: str | os.PathLike | None = None) -> list[dict]:
    """Records of one dataset: from `data` (a .jsonl file, or a folder holding `<dataset>.jsonl`), else from
    the local `datasets` cache of THUDM/LongBench (offline: nothing is downloaded)."""
    _check(dataset)
    if data is not None:
        path = Path(data)
        path = path / f"{dataset}.jsonl" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"data={str(data)!r}: no file {path}; allowed values: a LongBench .jsonl file or a "
                             f"folder with <dataset>.jsonl files")
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"  # a cache read, never a download
    try:
        import datasets
    except ImportError as e:
        raise ValueError("longbench without data=PATH reads the `datasets` cache; install `datasets` or pass "
                         "data=<folder of LongBench .jsonl files>") from e
    try:
        return list(datasets.load_dataset("THUDM/LongBench", dataset, split="test"))
    except Exception as e:  # not cached: say what to do instead
        raise ValueError(f"LongBench {dataset!r} is not in the local `datasets` cache; pass data=<folder of "
                         f"LongBench .jsonl files>") from e


def to_sample(record: dict, dataset: str, index: int, max_tokens: int | None = None) -> Sample:
    _check(dataset)
    before, after = PROMPTS[dataset].split("{context}")
    fields = {k: v for k, v in record.items() if k != "context"}
    sample = Sample(
        task=dataset, index=index, context=before.format(**fields) + record["context"],
        questions=[Question(after.format(**fields), list(record["answers"]))], metric=METRIC[dataset],
        max_new_tokens=MAX_NEW[dataset], chat=dataset not in NO_CHAT,
        meta=dict(all_classes=record.get("all_classes") or [], first_line=dataset in FIRST_LINE,
                  max_tokens=max_tokens, target_length=max_tokens, id=record.get("_id")),
    )
    return sample


# ---------------------------------------------------------------------------- fixture
def write_fixture(directory, n: int = 3, seed: int = 0) -> list[str]:
    """Small synthetic records in LongBench's JSONL format for four datasets (one per metric family:
    QA F1, ROUGE-L, classification, code edit similarity). Returns the dataset names written."""
    rng = random.Random(seed)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    names = ["Mara", "Tobin", "Elise", "Corin", "Anwen", "Hale"]
    places = ["the lighthouse", "the orchard", "the mill", "the harbour", "the old school", "the bridge"]
    classes = ["Description", "Entity", "Abbreviation", "Human", "Location", "Numeric Value"]

    def story(k):
        return " ".join(f"{rng.choice(names)} walked to {rng.choice(places)} and waited until evening."
                        for _ in range(k))

    records = {"narrativeqa": [], "gov_report": [], "trec": [], "lcc": []}
    for i in range(n):
        who, where = rng.choice(names), rng.choice(places)
        records["narrativeqa"].append(dict(
            context=story(20) + f" In the end, {who} buried the key under {where}. " + story(20),
            input=f"Where did {who} bury the key?", answers=[where]))
        summary = f"The agency reviewed {10 + i} programs and found that most lacked clear goals."
        records["gov_report"].append(dict(context=story(30) + " " + summary + " " + story(10), input="",
                                          answers=[summary]))
        shots = "\n".join(f"Question: What is the name of place {k}?\nType: {rng.choice(classes)}" for k in range(8))
        gold = rng.choice(classes)
        records["trec"].append(dict(context=shots, input="Question: Who built the mill?\nType:", answers=[gold],
                                    all_classes=classes))
        code = "\n".join(f"def f{k}(x):\n    return x + {k}\n" for k in range(12))
        records["lcc"].append(dict(context=code + "\ndef f12(x):\n", input="", answers=["    return x + 12"]))
    for dataset, rows in records.items():
        with open(directory / f"{dataset}.jsonl", "w", encoding="utf-8") as f:
            for i, row in enumerate(rows):
                row = dict(row, length=len(row["context"].split()), dataset=dataset, language="en",
                           all_classes=row.get("all_classes"), _id=f"{dataset}-{i}")
                f.write(json.dumps(row) + "\n")
    return list(records)


if __name__ == "__main__":
    import sys

    out = sys.argv[1] if len(sys.argv) > 1 else "longbench_fixture"
    print(f"wrote {write_fixture(out)} to {out}")
