"""Text in and out of a chat model, shared by the engines: rendering messages with the
tokenizer's chat template, the stop strings, and cleaning a decoded completion.

"""

from __future__ import annotations

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
    them, or the configured stops when given, without repeats."""
    if extra is not None:
        return list(dict.fromkeys(extra))
    vocab = tokenizer.get_vocab()
    defaults = [t for t in (tokenizer.eos_token, *END_OF_TURN) if t and t in vocab]
    return list(dict.fromkeys(defaults))


def clean(text: str, stops: list[str]) -> str:
    """The completion cut at the first stop string, stripped. A role marker the model echoes
    is left in: removing it is the verdict parser's business (stageb.verdicts), in one place."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut].strip()
