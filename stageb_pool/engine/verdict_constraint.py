"""Constrained decoding of the verdict protocol (the sampler option ``constrain_verdict``).

A small model often breaks the two-line protocol (``Verdict: pass`` / ``Reason: ...``), so
a rollout measures parse failures more than judgement. With the option on, the first line
of every sample is held to exactly ``Verdict: <pass word>`` or ``Verdict: <fail word>`` (the
profile's ``pass_text`` / ``fail_text``) and one newline, the second line starts with
``Reason: ``, and the reason's words run free up to the end of the line, where the only way
on is the end-of-turn token. Holding the first line alone was not enough: on the demo the
135M model then went on writing more lines after its reason in about 4 samples out of 10,
which the protocol (exactly two lines) counts as invalid.

The token masks come from llguidance (the Rust structured-generation library that vLLM also
uses as a backend): it matches the grammar on the bytes of the generated tokens, so it does
not matter how the tokenizer splits ``Verdict: 不通过`` or whether a leading space merges
into the next token. A mask depends only on the tokens a row has generated, so seeded
results stay identical for any number of workers.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch is imported where it is used, not here: the vLLM engine imports verdict_line_regex
# from this module before its worker sets OMP_NUM_THREADS, which must precede torch's import
# for the thread pinning (model.vllm.cpu_threads) to hold.

VERDICT_LABEL = "Verdict: "


REASON_LABEL = "Reason: "


def verdict_line_regex(vocab) -> str:
    """The two lines a constrained sample must produce, as a regex: the verdict line exactly,
    then a one-line reason that does not start with white space (the parser strips it and
    needs something left)."""
    words = "|".join(_literal(w) for w in (vocab.pass_text, vocab.fail_text))
    return f"{_literal(VERDICT_LABEL)}({words})\\n{_literal(REASON_LABEL)}[^\\s]{_ONE_LINE}*"


# Not a line break to Python's str.splitlines (what the verdict parser splits on).
_ONE_LINE = "[^\\n\\r\\x0b\\x0c\\x1c\\x1d\\x1e\\x85\\u2028\\u2029]"


def _literal(text: str) -> str:
    """``text`` as a regex that both Python's re and llguidance's (Rust) syntax read as a
    literal: only the metacharacters escaped (``re.escape`` also escapes spaces, which Rust
    regex refuses)."""
    return re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", text)


class VerdictLineConstraint:
    """Builds, per generate call, a transformers logits processor that holds each row to the
    protocol. ``vocab_size`` is the width of the model's logits."""

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance

        self._llguidance = llguidance
        self._tokenizer = llguidance.LLTokenizer(
            _tokenizer_json(tokenizer), n_vocab=vocab_size, eos_token=tokenizer.eos_token_id
        )
        self._grammars: dict[str, str] = {}

    def processor(self, vocab, rows: int, prompt_length: int):
        regex = verdict_line_regex(vocab)
        grammar = self._grammars.get(regex)
        if grammar is None:
            grammar = self._grammars[regex] = self._llguidance.LLMatcher.grammar_from_regex(regex)
        matchers = [self._llguidance.LLMatcher(self._tokenizer, grammar, log_level=0) for _ in range(rows)]
        if matchers[0].is_error():
            raise ValueError(f"verdict grammar {regex!r}: {matchers[0].get_error()}")
        return ProtocolProcessor(matchers, prompt_length)


def _tokenizer_json(tokenizer) -> str:
    """The fast tokenizer's full definition (added tokens included), without padding or
    truncation, which llguidance rebuilds in Rust."""
    from copy import copy

    backend = copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


class ProtocolProcessor:
    """A transformers logits processor: row ``i`` may only sample tokens its matcher allows;
    once the matcher has stopped (it took the end-of-turn token) the row is finished and only
    pads follow. Runs before temperature and top-p (generate puts custom processors ahead of
    its warpers)."""

    def __init__(self, matchers: list, prompt_length: int):
        self.matchers = matchers
        self.prompt_length = prompt_length
        self.free = [False] * len(matchers)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids.shape[1] - self.prompt_length
        for row, matcher in enumerate(self.matchers):
            if self.free[row]:
                continue
            if generated > 0:
                token = int(input_ids[row, -1])
                if not matcher.consume_token(token):
                    raise RuntimeError(f"verdict constraint: token {token} was not allowed: {matcher.get_error()}")
                if matcher.is_stopped():  # it took the end-of-turn token: the row is done
                    self.free[row] = True
                    continue
            allowed = allowed_tokens(matcher.compute_bitmask(), scores.shape[1])
            scores[row].masked_fill_(~allowed.to(scores.device), float("-inf"))
        return scores


def allowed_tokens(bitmask: bytes, width: int) -> torch.Tensor:
    """llguidance's mask (one bit per token, 32-bit little-endian words) as booleans."""
    import torch

    raw = torch.frombuffer(bytearray(bitmask), dtype=torch.uint8)
    bits = ((raw.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten().bool()[:width]
    out = torch.zeros(width, dtype=torch.bool)
    out[: len(bits)] = bits
    return out
