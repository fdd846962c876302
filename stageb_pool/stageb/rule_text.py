"""Rule texts: their signature and the filters a candidate must pass, in upstream's order (3.5,
``ReflectionEngine``'s static validators). On purpose: no ``zhconv`` step, a wider leak filter
(docs/formats.md section 6), English word lists beside the Chinese, the profile's verdict words."""

from __future__ import annotations

import re
from typing import Iterable, Mapping

from .summaries import extract_summary_json, loads_or_none
from .text import CJK_CHAR, normalize_spaces

_SIGNATURE_PUNCT = re.compile(r"[，,。.!！？;；:：\-—_()（）\[\]{}<>《》“”\"'·~]")


def normalize_signature(text: str | None) -> str:
    """The identity of a rule text for de-duplication and targeting (upstream 3.5)."""
    value = normalize_spaces(text or "").lower()
    value = value.replace("如果", "若").replace("当", "若").replace("就", "则")
    value = _SIGNATURE_PUNCT.sub(" ", value)
    return normalize_spaces(value).strip()


# A digit run this long is an identifier (a date, a serial), never a reusable condition.
LONG_DIGIT_RUN = re.compile(r"\d{6,}")


def copied_identifier(text: str, *, ticket_keys: Iterable[str], examples_text: str) -> str | None:
    """Why a rule text copies a ticket key, group id or digit run out of the examples, or None."""
    folded = (text or "").casefold()
    for key in ticket_keys:
        for name in dict.fromkeys((key, key.split("::", 1)[0])):
            if name and name.casefold() in folded:
                return f"copies a ticket key from the examples: {name!r}"
    for digits in LONG_DIGIT_RUN.findall(text or ""):
        if digits in examples_text:
            return f"copies a digit run from the examples: {digits!r}"
    return None


def _check_form(text: str) -> str:
    value = normalize_spaces(text or "").lower().replace("_", " ").replace("-", " ")
    return normalize_spaces(value)


THIRD_STATE = (
    "复核", "人工复核", "第三态", "待定", "证据不足", "不应直接", "不建议直接", "不得直接", "佐证",
    "需进一步", "需要进一步", "进一步确认", "不写不通过", "通过但",
    "review needed", "needs review", "need review", "manual review", "human review", "further confirmation",
    "further verification", "further review", "uncertain", "undetermined", "to be determined", "third state",
    "insufficient evidence", "pass but", "should not directly",
)
HEDGED_NEGATION = (
    "不应判定为", "不应判断为", "不应判为", "不建议判定为", "不建议判断为", "不建议判为",
    "不要判定为", "不要判断为", "不得判定为", "不得判断为",
    "should not be judged", "should not be determined", "should not be marked", "should not be rated",
    "should not judge", "not recommended to judge", "do not judge", "must not be judged", "must not judge",
    "do not directly",
)
_LEAK_MARKERS = ("image_", "备注:", "标签/", "类别=", "remark:", "label/", "category=")
_OBJECT_CHAIN = (
    "显示完整", "只显示部分", "完整", "部分", "符合要求", "不符合要求", "符合", "不符合", "合格", "不合格",
    "无法判断", "复核", "complete", "partial", "compliant", "non compliant", "qualified", "unqualified",
    "cannot judge",
)
_IMAGE_REF = re.compile(r"image\s*_?\s*\d")
SCAFFOLD_ANCHORS = (
    "全局图", "局部图", "证据", "覆盖", "缺失", "必须", "不得", "禁止", "无法确认", "只显示部分", "显示完整",
    "可见性=部分", "可见性=完整", "关键点",
    "global view", "close up", "evidence", "coverage", "missing", "must", "forbidden", "cannot confirm",
    "partially visible", "fully visible", "key point",
)
_BRAND = ("brand", "品牌")
_EXTRA_FAIL = ("判不通过", "不能通过", "cannot pass", "not pass", "does not pass")


def _is_json_object(text: str) -> bool:
    return text.startswith("{") and isinstance(loads_or_none(text), dict)


def is_stage_a_leak(text: str) -> bool:
    """A summary object anywhere, any JSON object, ``标签/``, an image reference, object chains."""
    stripped = (text or "").strip()
    if extract_summary_json(stripped) is not None or _is_json_object(stripped):
        return True
    lowered = stripped.lower()
    if "标签/" in lowered or "image_" in lowered or _IMAGE_REF.search(lowered):
        return True
    slashes = lowered.count("/")
    chain = any(word in lowered.replace("-", " ") for word in _OBJECT_CHAIN)
    marked = any(marker in lowered for marker in _LEAK_MARKERS)
    return (slashes >= 2 and chain) or (marked and slashes >= 1 and chain)


def _first_hit(text: str, words: Iterable[str]) -> str | None:
    form = _check_form(text)
    return next((w for w in words if w in form), None)


def _has_word(form: str, word: str) -> bool:
    """Substring for CJK words; for Latin words the match must start a word (pass, passes)."""
    word = word.lower()
    if CJK_CHAR.search(word):
        return word in form
    return re.search(rf"(?<![a-z]){re.escape(word)}", form) is not None


def _verdict_words(vocab) -> tuple[list[str], list[str]]:
    if vocab is None:  # no profile given: accept either language
        return ["通过", "pass"], ["不通过", "fail"]
    return [vocab.pass_text], [vocab.fail_text]


def _polarity(text: str, vocab) -> tuple[bool, bool]:
    """(concludes fail, concludes pass)."""
    form = _check_form(text)
    pass_words, fail_words = _verdict_words(vocab)
    fail_terms = [w.lower() for w in fail_words] + list(_EXTRA_FAIL)
    says_fail = any(_has_word(form, w) for w in fail_terms)
    for term in sorted(fail_terms, key=len, reverse=True):
        form = form.replace(term, " ")
    says_pass = any(_has_word(form, w) for w in pass_words)
    return says_fail, says_pass


def is_binary(text: str, vocab=None) -> bool:
    """The rule concludes with a verdict word of the profile (通过/不通过 or pass/fail)."""
    form = _check_form(text)
    pass_words, fail_words = _verdict_words(vocab)
    return any(_has_word(form, w) for w in pass_words + fail_words)


def scaffold_conflict(text: str, scaffold: Mapping[str, str], vocab=None) -> str | None:
    """A scaffold rule sharing an anchor word with ``text`` but concluding only the opposite."""
    form = _check_form(text)
    anchors = {a for a in SCAFFOLD_ANCHORS if a in form}
    if not anchors:
        return None
    c_fail, c_pass = _polarity(text, vocab)
    for key, s_text in sorted(scaffold.items()):
        s_form = _check_form(s_text)
        if not any(a in s_form for a in anchors):
            continue
        s_fail, s_pass = _polarity(s_text, vocab)
        if (s_fail and c_pass and not c_fail) or (s_pass and c_fail and not c_pass):
            return key
    return None


def text_problem(text: str, *, scaffold: Mapping[str, str], vocab=None, dimension: str | None = None) -> str | None:
    """The first filter a rule text fails (upstream order), or None."""
    if is_stage_a_leak(text):
        return "Stage-A summary leak"
    hit = _first_hit(text, THIRD_STATE)
    if hit:
        return f"third-state wording {hit!r}"
    hit = _first_hit(text, HEDGED_NEGATION)
    if hit:
        return f"hedged negation {hit!r}"
    if not is_binary(text, vocab):
        pass_words, fail_words = _verdict_words(vocab)
        return f"no binary outcome (needs {'/'.join(pass_words + fail_words)})"
    key = scaffold_conflict(text, scaffold, vocab)
    if key:
        return f"conflicts with scaffold {key}"
    if dimension and any(b in _check_form(dimension) for b in _BRAND):
        return "brand dimension"
    return None
