"""kvpress-eval on the transformers path, computing what vLLM computes with pages of P tokens, so the engine and
the transformers path can be compared at the same kept counts (the kept sets are equal there: tests/vllm_plugin).
What remains between the two is the page rounding itself.
- Every budget is raised to whole pages (allocation.whole_pages: what a request keeps under `kvpress-eval --engine
  vllm --page-tokens P`).
- A sample's context ends where the engine's declared context does (query_agnostic: rounded down to whole pages,
  plans.py): its last `< P` tokens go with the question. (In query_aware mode the prompt is the same either way.)

    python benchmarks/eval_at_page_budgets.py 32 --model smollm2 --task ruler --lengths 2048 \\
        --policies kvzap:budget_allocation=uniform --ratios 0.75 --n 10 --out docs/results/vllm_ruler/transformers_pages32
"""

import sys

import evals.cli
import evals.runner
import kvpress.policies.budget as budget
from evals.samples import encode
from kvpress.integrations.vllm.plans import context_end
from kvpress.policies.allocation import whole_pages


def main(argv: list[str]) -> None:
    page = int(argv[0])
    # the transformers path builds every Context with page_size 1; this run gives the budget the engine's pages
    budget.whole_pages = lambda budget, n_real, _: whole_pages(budget, n_real, page)

    def engine_context(*args, **kwargs):
        head, tail = encode(*args, **kwargs)
        end = context_end(len(head), len(head) + len(tail), page)
        if end == 0:  # a context under a page: the engine evicts none of it, nor does a page-raised budget here
            return head, tail
        return head[:end], head[end:] + tail

    evals.runner.encode = engine_context
    evals.cli.main(argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
