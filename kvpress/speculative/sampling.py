"""Token picks and the lossless acceptance rule of speculative decoding, shared by speculative_generate
(generate.py) and rapid_generate (rapid.py)."""

from __future__ import annotations

import torch


def sampling_distribution(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Sampling distribution after temperature and top-p (transformers' conventions), fp32."""
    logits = logits.float() / temperature
    if top_p < 1.0:
        sorted_logits, order = logits.sort(-1)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        remove = cumulative <= 1 - top_p
        remove[..., -1] = False
        logits = logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))
    return logits.softmax(-1)


def accept(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor, generator=None):
    """Acceptance for one round. p [B, g+1, V] target distributions (or logits when q is None: greedy);
    q [B, g, V] draft distributions; drafts [B, g]. Returns (n accepted [B], next token [B]): the correction
    at the first rejection, or the bonus token when all g are accepted."""
    batch, g = drafts.shape
    rows = torch.arange(batch, device=drafts.device)
    if q is None:  # greedy: p holds target logits
        target = p.argmax(-1)  # [B, g+1]
        ok = drafts == target[:, :g]
        n = ok.long().cumprod(-1).sum(-1)
        return n, target[rows, n]
    p_d = p[:, :g].gather(-1, drafts[..., None]).squeeze(-1)
    q_d = q.gather(-1, drafts[..., None]).squeeze(-1)
    u = torch.rand(batch, g, generator=generator, device=p.device)
    n = (u * q_d <= p_d).long().cumprod(-1).sum(-1)
    at = n.clamp(max=g - 1) if g else n
    residual = (p[rows, at] - q[rows, at]).clamp(min=0) if g else p[:, 0]
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p[rows, at])  # p == q: never rejects
    final = torch.where((n == g)[:, None], p[:, g], residual)
    return n, torch.multinomial(final, 1, generator=generator).squeeze(-1)


def check_sampling(do_sample, temperature, top_p) -> None:
    if not isinstance(do_sample, bool):
        raise ValueError(f"do_sample={do_sample!r}; allowed values: True or False")
    if do_sample and not temperature > 0:
        raise ValueError(f"temperature={temperature!r}; allowed values: a float > 0")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r}; allowed values: a float in (0, 1]")


def pick_token(logits, do_sample, temperature, top_p, generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(next tokens, their distribution): the argmax (greedy, no distribution), or a draw from the tempered,
    top-p distribution."""
    if not do_sample:
        return logits.argmax(-1), None
    probs = sampling_distribution(logits, temperature, top_p)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1), probs
