"""Text in and out of a chat model, shared by the engines: rendering messages with the
tokenizer's chat template, the stop strings, and cleaning a decoded completion.

Stops follow upstream (docs/migrating.md, ``<sampler>.grid[].stop``): the end-of-turn
strings are always there, and ``model.stop`` adds to them; it never replaces them.

"""

from __future__ import annotations

from ..stageb import prompts

END_OF_TURN = ("<|im_end|>", "<|endoftext|>")


def render(tokenizer, messages: list[dict]) -> str:
    """The prompt text of ``messages`` with the generation prompt, thinking off where the
    template knows the switch (Qwen3)."""
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                             enable_thinking=False)
    except TypeError:  # a template (or tokenizer) that does not know enable_thinking
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def stop_strings(tokenizer, extra: list[str] | None = None) -> list[str]:
    """The tokenizer's eos, ``<|im_end|>`` and ``<|endoftext|>`` where the vocabulary has
    them, then the configured extra stops, without repeats."""
    vocab = tokenizer.get_vocab()
    defaults = [t for t in (tokenizer.eos_token, *END_OF_TURN) if t and t in vocab]
    return list(dict.fromkeys([*defaults, *(extra or [])]))


def clean(text: str, stops: list[str]) -> str:
    """The completion cut at the first stop string, stripped. A role marker the model echoes
    is left in: removing it is the verdict parser's business (stageb.verdicts), in one place."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut].strip()


def chat_messages(request, k: int) -> list[dict]:
    """The proposer's messages with the first ``k`` examples of a ``ChatRequest``."""
    user = "\n\n".join(p for p in [request.user_head, *request.examples[:k], request.user_tail] if p)
    return [{"role": "system", "content": request.system}, {"role": "user", "content": user}]


def fit_examples(request, encode) -> tuple[int, list[int], bool]:
    """``(k, prompt ids, fits)`` for the most examples whose prompt fits the request's
    ``max_prompt_tokens``, dropping examples from the end but never below one (upstream:
    the proposer is never asked without an example). When even that does not fit, ``fits``
    is False and ``k`` and the ids are those of the last try. ``encode(messages)`` gives
    the prompt's token ids."""
    limit = request.max_prompt_tokens
    lowest = 1 if request.examples else 0
    for k in range(len(request.examples), lowest - 1, -1):
        row = encode(chat_messages(request, k))
        if limit is None or len(row) <= limit:
            return k, row, True
    return lowest, row, False


def chunk_prompts(tokenizer, chunk, guidance: dict[str, str], profile) -> tuple[list[list[int]], list[int]]:
    """The prompt ids of every ticket of a ``RolloutChunk`` and the positions of the tickets
    kept (prompt within ``chunk.max_prompt_tokens``; longer ones are dropped, never cut)."""
    texts = [render(tokenizer, prompts.build_messages(profile, guidance, t)) for t in chunk.tickets]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    limit = chunk.max_prompt_tokens
    return ids, [i for i, row in enumerate(ids) if limit is None or len(row) <= limit]
