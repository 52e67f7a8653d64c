"""kvpress-eval on the transformers path, with every budget raised to whole pages of P tokens, the way vLLM keeps
them (allocation.whole_pages: what a request keeps under `kvpress-eval --engine vllm --page-tokens P`). It
compares the engine and the transformers path at the same kept counts: the kept sets are equal there
(tests/vllm_plugin). What remains between the two is the page rounding itself.

    python benchmarks/eval_at_page_budgets.py 32 --model smollm2 --task ruler --lengths 2048 \
        --policies kvzap:budget_allocation=uniform --ratios 0.75 --n 10 --out docs/results/vllm_ruler/transformers_pages32
"""

import sys

import evals.cli
import kvpress.policies.budget as budget
from kvpress.policies.allocation import whole_pages


def main(argv: list[str]) -> None:
    page = int(argv[0])
    # the transformers path builds every Context with page_size 1; this run gives the budget the engine's pages
    budget.whole_pages = lambda budget, n_real, _: whole_pages(budget, n_real, page)
    evals.cli.main(argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
