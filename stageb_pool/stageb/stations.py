"""The RRU per-station block of the user prompt: each photo's facts merged per 站点距离, by
upstream's ``_aggregate_rru_*_points`` rules (docs/formats.md section 3), one defect fixed below."""

from __future__ import annotations

import re

from .summaries import categories, entry_by_category, extract_summary_json, strip_summary_headers, summary_entries
from .text import normalize_spaces

STATION_MISSIONS = ("RRU安装检查", "RRU位置检查", "RRU线缆")
_NO_SLEEVE = ("没有保护", "无保护")
_DISTANCE_TEXT = re.compile(r"站点距离[=/](\d+)")
_RRU_WORD = re.compile(r"\bRRU\b")


def _json_distances(obj: dict) -> list[str]:
    entry = entry_by_category(summary_entries(obj), "站点距离")
    if not entry:
        return []
    distances = entry.get("站点距离")
    if not isinstance(distances, dict):
        distances = entry.get("距离")
    return [k for k in distances if k.strip().isdigit()] if isinstance(distances, dict) else []


def _json_readable_label(obj: dict) -> bool:
    entry = entry_by_category(summary_entries(obj), "标签")
    if not entry:
        return False
    texts = entry.get("文本")
    if isinstance(texts, dict) and any(k.strip() for k in texts):
        return True
    readability = entry.get("可读性")
    return isinstance(readability, dict) and any(k.strip() and k != "不可读" for k in readability)


def _text_readable_label(text: str) -> bool:
    text = normalize_spaces(text)
    return "标签/" in text and "无法识别" not in text and "没有标签" not in text


def _json_sleeve(entries: list[dict]) -> bool:
    # Stage-A's schema puts 套管保护 under the 尾纤 entry; upstream reads the first one only.
    sleeve = (entry_by_category(entries, "尾纤") or {}).get("套管保护")
    return isinstance(sleeve, dict) and any(k not in _NO_SLEEVE and c for k, c in sleeve.items())


def _json_facts(mission: str, obj: dict) -> dict[str, bool]:
    entries = summary_entries(obj)
    names = categories(entries)
    if mission == "RRU安装检查":
        return {"RRU": "RRU设备" in names, "紧固件": bool({"紧固件", "固定件"} & names)}
    if mission == "RRU位置检查":
        return {"RRU接地端": "RRU接地端" in names, "接地线(可读标签)": "接地线" in names and _json_readable_label(obj)}
    return {"尾纤": "尾纤" in names, "套管": _json_sleeve(entries), "标签文本": _json_readable_label(obj)}


def _text_facts(mission: str, text: str) -> dict[str, bool]:
    if mission == "RRU安装检查":
        return {"RRU": bool(_RRU_WORD.search(text)) or "RRU设备" in text,
                "紧固件": "紧固件" in text or "固定件" in text}
    if mission == "RRU位置检查":
        return {"RRU接地端": "RRU接地端" in text, "接地线(可读标签)": "接地线" in text and _text_readable_label(text)}
    # Upstream counted any mention of 套管 (a defect: its own JSON rule excludes 没有保护).
    sleeve = "套管" in text and not any(w in text for w in _NO_SLEEVE)
    return {"尾纤": "尾纤" in text, "套管": sleeve, "标签文本": _text_readable_label(text)}


def _photo_points(mission: str, summary: str) -> tuple[list[str], dict[str, bool]]:
    """(station distances, facts) of one photo; no distance: not part of any point."""
    obj = extract_summary_json(summary)
    if obj is not None:
        return _json_distances(obj), _json_facts(mission, obj)
    text = strip_summary_headers(summary)
    return _DISTANCE_TEXT.findall(text), _text_facts(mission, text)


def _distance_order(distance: str) -> int:
    try:
        return int(distance)
    except ValueError:
        return 0


def station_summary_lines(mission: str, summaries: list[str]) -> list[str]:
    """``- 站点距离=35: RRU=有, 紧固件=有`` per station distance, numerically sorted."""
    if mission not in STATION_MISSIONS:
        return []
    merged: dict[str, dict[str, bool]] = {}
    for summary in summaries:
        distances, facts = _photo_points(mission, summary)
        if mission != "RRU安装检查" and not any(facts.values()):
            continue
        for distance in distances:
            seen = merged.setdefault(distance, dict.fromkeys(facts, False))
            for name, value in facts.items():
                seen[name] = seen[name] or value
    return [
        f"- 站点距离={d}: " + ", ".join(f"{k}={'有' if v else '无'}" for k, v in facts.items())
        for d, facts in sorted(merged.items(), key=lambda item: _distance_order(item[0]))
    ]
