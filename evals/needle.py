"""Needle in a haystack over (context length x depth), and its heatmap. The prompt is kvpress.needle's (the
demo's): filler sentences, one passcode sentence at `depth`, the question last; here split into context and
question so that both evaluation modes can run it."""

from __future__ import annotations

import random

from kvpress.needle import ANSWER_PREFIX, haystack_sentences

from .samples import Question, Sample, fit, seed_for

DEFAULT_DEPTHS = [0.0, 0.25, 0.5, 0.75, 1.0]
QUESTION = "What is the secret passcode mentioned in the document? Answer with the number only."


def build(seed: int, depth: float):
    def sample(n: int) -> Sample:
        answer = str(random.Random(seed).randint(10000, 99999))
        sentences = haystack_sentences(seed)
        units = [next(sentences) for _ in range(n)]
        units.insert(round(depth * n), f"The secret passcode is {answer}.")
        return Sample("needle", 0, "Document:\n" + " ".join(units), [Question(f"\n\nQUESTION: {QUESTION}", [answer],
                      ANSWER_PREFIX)], "string_match_all", 8)
    return sample


def generate(tokenizer, length: int, depth: float, index: int, seed: int = 0) -> Sample:
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth}; allowed values: a float in [0, 1]")
    sample = fit(build(seed_for("needle", length, depth, index, seed), depth), tokenizer, length)
    sample.index = index
    sample.meta.update(target_length=length, depth=depth, seed=seed)
    return sample


def heatmap(rows: list[dict], path) -> None:
    """One panel per (mode, policy, ratio): mean score over samples in each (context length, depth) cell."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["mode"], r["policy"], r["ratio"]) for r in rows}, key=lambda p: (p[0], p[1] != "none", p))
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(2.2 + 2.2 * len(panels), 0.9 + 0.45 * len(depths) + 0.6),
                             squeeze=False)
    for ax, (mode, policy, ratio) in zip(axes[0], panels):
        grid = [[_mean([r["score"] for r in rows if (r["mode"], r["policy"], r["ratio"], r["length"], r["depth"])
                        == (mode, policy, ratio, length, depth)]) for length in lengths] for depth in depths]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(l) for l in lengths], rotation=45, fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=7)
        ax.set_title(policy if policy == "none" else f"{policy} {ratio:.0%}", fontsize=8)
        ax.set_xlabel("context tokens", fontsize=7)
    axes[0][0].set_ylabel("needle depth", fontsize=7)
    fig.colorbar(image, ax=axes[0].tolist(), fraction=0.02)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _mean(values):
    return sum(values) / len(values) if values else float("nan")
