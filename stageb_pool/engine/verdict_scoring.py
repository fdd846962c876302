"""Scoring the two verdict answers by teacher forcing (the judge-headroom check), shared by
the engines. An answer, ``Verdict: <pass_text|fail_text>``, is tokenized on its own and scored
by the sum of ALL its tokens' log-probabilities after the rollout's prompt: the shared
``Verdict:`` tokens cancel in the softmax, and a tokenizer that merges the label's space into
the word is still scored right. No torch: the vLLM engine imports this before torch.
"""

from __future__ import annotations

import math

from .constrained import VERDICT_LABEL

# Rounded so that float noise in the last bits (another kernel, another batch shape) never
# reaches a JSON artifact; six decimals still tell 0.008 from 0.009.
P_PASS_DECIMALS = 6


def answer_ids(tokenizer, vocab) -> tuple[list[int], list[int]]:
    encode = lambda word: tokenizer(VERDICT_LABEL + word, add_special_tokens=False)["input_ids"]  # noqa: E731
    return encode(vocab.pass_text), encode(vocab.fail_text)


def p_pass(logprob_pass: float, logprob_fail: float) -> float:
    """The softmax over the two answers' log-probabilities, rounded: the probability of the
    pass answer given that the judge answers one of the two."""
    if math.isnan(logprob_pass) or math.isnan(logprob_fail):
        raise ValueError(f"verdict log-probabilities are not numbers: {logprob_pass}, {logprob_fail}")
    if logprob_pass == logprob_fail:  # also both -inf: no evidence either way
        return 0.5
    # 1 / (1 + e^(lf - lp)), written so that neither exp overflows.
    d = logprob_fail - logprob_pass
    p = 1.0 / (1.0 + math.exp(d)) if d <= 0 else math.exp(-d) / (1.0 + math.exp(-d))
    return round(p, P_PASS_DECIMALS)
