"""How a context and the questions asked about it become token ids: the context's ids are a prefix every question's
prompt shares, so the context is compressed once and each question extends it.

With a chat template, the prompt is the template applied to one user turn, "<context>\\n\\n<question>", with the
assistant's header after it; the context's ids are the rendered text up to the question, the question's ids the
rest (tokenized apart, so every question extends the very same context ids). Without one: the context's ids (with
the tokenizer's special tokens), then "\\n\\nQuestion: <question>\\nAnswer:".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

_MARK = "\u2063KVPRESS-QUESTION\u2063"  # stands for the question while the template is rendered (never tokenized)
SEPARATOR = "\n\n"


@dataclass(frozen=True)
class QuestionFormat:
    """The text around a question that follows the context (what the chat template puts there, or plain text)."""

    before: str
    after: str
    chat_template: bool

    def ids(self, tokenizer, question: str) -> list[int]:
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"question={question!r}; allowed values: a non-empty string")
        return list(tokenizer.encode(self.before + question + self.after, add_special_tokens=False))

    def to_dict(self) -> dict:
        return asdict(self)


def split_prompt(tokenizer, context: str, chat_template: bool | None = None) -> tuple[torch.Tensor, QuestionFormat]:
    """(the context's token ids [1, n], how questions follow it). `chat_template`: None uses the tokenizer's
    template when it has one; True requires one."""
    if not isinstance(context, str) or not context:
        raise ValueError(f"context={context!r:.60}; allowed values: a non-empty string (the document to compress)")
    if chat_template not in (None, True, False):
        raise ValueError(f"chat_template={chat_template!r}; allowed values: None (the tokenizer's, if it has one), "
                         f"True, False")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat_template and not has_template:
        raise ValueError("chat_template=True, but the tokenizer has no chat template; allowed values: None or False")
    if has_template and chat_template is not False:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": context + SEPARATOR + _MARK}], tokenize=False, add_generation_prompt=True)
        if rendered.count(_MARK) != 1:
            raise ValueError("the tokenizer's chat template does not keep the user's text as given; pass "
                             "chat_template=False")
        head, after = rendered.split(_MARK)
        context_text = head[:-len(SEPARATOR)]
        ids = tokenizer.encode(context_text, add_special_tokens=False)
        fmt = QuestionFormat(SEPARATOR, after, True)
    else:
        ids = tokenizer.encode(context, add_special_tokens=True)
        fmt = QuestionFormat(SEPARATOR + "Question: ", "\nAnswer:", False)
    return torch.tensor([list(ids)], dtype=torch.long), fmt


def stop_ids(model, tokenizer) -> set[int]:
    """Token ids that end an answer: the model's generation_config EOS (one or several) and the tokenizer's."""
    ids = model.generation_config.eos_token_id
    ids = set(ids if isinstance(ids, (list, tuple)) else [ids] if ids is not None else [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def left_padded(context_ids: torch.Tensor, questions: list[list[int]], pad_id: int) -> tuple:
    """(input ids [Q, n + L], attention mask) for questions of different lengths after one context: each question
    is left-padded to the longest (padding sits between the context and the question, masked out), so every
    question's last token is the last column and generation starts together."""
    longest = max(len(q) for q in questions)
    n = context_ids.shape[1]
    ids = torch.full((len(questions), n + longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    ids[:, :n], mask[:, :n] = context_ids[0], 1
    for row, q in enumerate(questions):
        ids[row, n + longest - len(q):] = torch.tensor(q, dtype=torch.long)
        mask[row, n + longest - len(q):] = 1
    return ids, mask
