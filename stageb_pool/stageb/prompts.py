"""Prompt profiles: the verdict prompt as data (upstream 2.1).

A profile is a directory with ``system.txt`` (or ``system_<domain>.txt``), ``user.txt``
(the user-message layout) and ``profile.yaml`` (verdict vocabulary, block labels,
options). ``load_profile`` resolves it for one mission into a self-contained, frozen
``PromptProfile`` that the parent sends to the workers; ``build_messages`` renders one
ticket's chat messages from it. Pure Python: no torch, no tokenizer.

User layout: ``{name}`` placeholders are replaced by text. A line that holds only a
block placeholder (``{scaffold}``, ``{rules}``, ``{image_stats}``, ``{station_summary}``,
``{image_summaries}``) is replaced by the block's lines; an empty block removes its line
and the blank line after it, so optional blocks leave no gap.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import yaml

from .errors import InputError
from .hashing import content_hash
from .tickets import (  # the same rules at ingest and at prompt time
    IRRELEVANT,
    strip_header_lines,
)

PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"  # the built-in profiles (package data)
PROPOSER_FILE = "proposer.txt"  # a profile's default proposer system prompt
INLINE_FIELDS = ("mission", "focus")
BLOCK_FIELDS = ("scaffold", "rules", "image_stats", "station_summary", "image_summaries")
RULES_ORDERS = ("key", "g0_first")
_PLACEHOLDER = re.compile(r"\{(\w+)\}")
_TRAILING_INT = re.compile(r"(\d+)$")


class VerdictVocab(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Words accepted after ``Verdict:`` (compared in upstream's form: spaces normalised,
    ASCII spaces removed, lower-cased; see ``verdicts.normalize_verdict_word``), and the two
    words the prompt asks for. ``loose`` also ignores any whitespace and trailing 。/. (off:
    upstream's grammar, so invalid rates compare with upstream's)."""

    pass_words: list[str]
    fail_words: list[str]
    pass_text: str
    fail_text: str
    loose: bool = False


class ProfileLabels(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Headings of the user-message blocks. ``image_stats`` is a line template with
    ``{items}`` (``Image1(obj=4), ...``) and ``{count}`` (number of images)."""

    scaffold: str = "Fixed rules:"
    rules: str = "Rules:"
    image_stats: str = "Statistics: {items}; images: {count}"
    station_summary: str = "Install points (merged by station distance):"
    image_summaries: str = "Image summaries:"


class ProfileOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    rules_order: str = "key"  # "key": by key string (G10 before G2, upstream); "g0_first": G0, then natural order
    object_stats: bool = False  # render the ImageN(obj=...) statistics line
    station_aggregation: bool = False  # render the RRU station-distance blocks (three RRU missions)
    bbu_cleanup: bool = False  # ingest: upstream's BBU summary clean-up for non-RRU missions


class ProfileFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The schema of ``profile.yaml``."""

    verdict: VerdictVocab
    language: str = "en"
    domain_prefixes: dict[str, str] = {}  # mission prefix -> domain (picks system_<domain>.txt)
    default_domain: str | None = None
    labels: ProfileLabels = ProfileLabels()
    options: ProfileOptions = ProfileOptions()


class PromptProfile(msgspec.Struct, frozen=True):
    """A resolved profile: everything a worker needs to render prompts, nothing on disk."""

    name: str
    domain: str | None
    language: str
    system: str
    user_template: str
    verdict: VerdictVocab
    labels: ProfileLabels = ProfileLabels()
    options: ProfileOptions = ProfileOptions()

    @property
    def hash(self) -> str:
        return content_hash(self)


# --------------------------------------------------------------------------- loading

def _profile_dir(name_or_path: str, base_dir: str | Path | None) -> Path:
    is_name = "/" not in name_or_path and "\\" not in name_or_path and not name_or_path.startswith(".")
    directory = Path(base_dir or PROFILES_DIR) / name_or_path if is_name else Path(name_or_path)
    if not directory.is_dir():
        known = sorted(p.parent.name for p in Path(base_dir or PROFILES_DIR).glob("*/profile.yaml"))
        hint = f" (profiles there: {', '.join(known)})" if is_name and known else ""
        raise InputError(f"prompt profile not found{hint}", str(directory))
    return directory


def _read_text(path: Path) -> str:
    if not path.is_file():
        raise InputError("missing profile file", str(path))
    try:
        text = path.read_bytes().decode("utf-8-sig").replace("\r\n", "\n")
    except UnicodeDecodeError:
        raise InputError("not valid UTF-8", str(path)) from None
    if not text.strip():
        raise InputError("empty profile file", str(path))
    return text.rstrip("\n")


def _read_profile_yaml(path: Path) -> ProfileFile:
    try:
        raw = yaml.safe_load(_read_text(path))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise InputError(f"invalid YAML: {getattr(exc, 'problem', exc)}", where) from None
    try:
        profile = msgspec.convert(raw, ProfileFile)
    except msgspec.ValidationError as exc:
        message, _, keypath = str(exc).partition(" - at `$")
        keypath = keypath.rstrip("`").lstrip(".")
        raise InputError(message, f"{path}: {keypath}" if keypath else str(path)) from None
    if profile.options.rules_order not in RULES_ORDERS:
        raise InputError(f"must be one of {', '.join(RULES_ORDERS)}", f"{path}: options.rules_order")
    if not profile.verdict.pass_words or not profile.verdict.fail_words:
        raise InputError("pass_words and fail_words must be non-empty", f"{path}: verdict")
    return profile


def _check_template(template: str, path: Path) -> None:
    known = INLINE_FIELDS + BLOCK_FIELDS
    for number, line in enumerate(template.split("\n"), start=1):
        for name in _PLACEHOLDER.findall(line):
            if name not in known:
                raise InputError(f"unknown placeholder {{{name}}}; known: {', '.join(known)}", f"{path}:{number}")


def resolve_domain(profile: ProfileFile, mission: str) -> str | None:
    for prefix, domain in profile.domain_prefixes.items():
        if mission.startswith(prefix):
            return domain
    return profile.default_domain


def load_profile(
    name_or_path: str, *, mission: str, base_dir: str | Path | None = None, domain: str | None = None
) -> PromptProfile:
    """Resolve a profile for ``mission``. A bare name is looked up under ``base_dir``
    (default: the built-in profiles, ``stageb_pool/profiles``); anything with a path
    separator is a directory.
    ``domain`` overrides the domain derived from the mission prefix."""
    directory = _profile_dir(str(name_or_path), base_dir)
    spec = _read_profile_yaml(directory / "profile.yaml")
    domain = domain or resolve_domain(spec, mission)
    system_path = directory / f"system_{domain}.txt" if domain else directory / "system.txt"
    if domain and not system_path.is_file() and (directory / "system.txt").is_file():
        system_path = directory / "system.txt"
    user_path = directory / "user.txt"
    user_template = _read_text(user_path)
    _check_template(user_template, user_path)
    return PromptProfile(
        name=directory.name,
        domain=domain,
        language=spec.language,
        system=_read_text(system_path),
        user_template=user_template,
        verdict=spec.verdict,
        labels=spec.labels,
        options=spec.options,
    )


def load_proposer_prompt(profile: str, path: str | None, *, base_dir: str | Path | None = None) -> str:
    """The proposer's system prompt: the file at ``path``, or the profile's ``proposer.txt``."""
    file = Path(path) if path is not None else _profile_dir(str(profile), base_dir) / PROPOSER_FILE
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as err:
        raise InputError(f"cannot read the proposer prompt: {err.strerror or err}", str(file)) from err
    except UnicodeDecodeError:
        raise InputError("the proposer prompt is not valid UTF-8", str(file)) from None
    if not text.strip():
        raise InputError("the proposer prompt is empty", str(file))
    return text


# --------------------------------------------------------------------------- summaries

def _image_index(key: str) -> int:
    m = _TRAILING_INT.search(key)
    return int(m.group(1)) if m else 0


def ordered_summaries(per_image: dict[str, str]) -> list[str]:
    """Summaries sorted by the trailing integer of their key, header lines removed."""
    return [strip_header_lines(per_image[k]) for k in sorted(per_image, key=_image_index)]


def _as_stats_object(value) -> dict | None:
    return value if isinstance(value, dict) and isinstance(value.get("统计"), list) else None


def _try_json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def extract_summary_json(text: str) -> dict | None:
    """The summary's ``{"统计": [...]}`` object: direct parse, else the last line that
    parses, else the widest ``{...}`` span, else a repaired ``统计=[...]`` assignment."""
    text = text.strip()
    found = _as_stats_object(_try_json(text))
    if found is None:
        for line in reversed(text.split("\n")):
            found = _as_stats_object(_try_json(line.strip()))
            if found is not None:
                break
    if found is None and "{" in text and "}" in text:
        found = _as_stats_object(_try_json(text[text.find("{"): text.rfind("}") + 1]))
    if found is None:
        m = re.search(r"统计\s*[=:：]\s*(\[.*\])", text, re.S)
        items = _try_json(m.group(1)) if m else None
        found = {"统计": items} if isinstance(items, list) else None
    return found


def _attr_total(value) -> int:
    if isinstance(value, dict):
        return sum(c for c in value.values() if type(c) is int and c > 0)
    if isinstance(value, list):
        return sum(1 for item in value if item is not None)
    return 0 if value is None else 1


def _entry_objects(entry) -> int:
    if not isinstance(entry, dict):
        return 1
    best = max((_attr_total(v) for k, v in entry.items() if k != "类别"), default=0)
    count = max(1, best)
    if entry.get("类别") == "标签":
        count = max(count, _attr_total(entry.get("文本")) + _attr_total(entry.get("可读性")))
    return count


def estimate_objects(summary: str) -> int:
    """Upstream's ``obj`` estimate for one photo summary (see docs/formats.md)."""
    text = summary.strip()
    if text.startswith(IRRELEVANT):
        return 0
    obj = extract_summary_json(text)
    if obj is not None:
        return sum(_entry_objects(e) for e in obj["统计"])
    if not text:
        return 0
    return max(1, sum(1 for part in text.split("，") if part.strip()))


# --------------------------------------------------------------------------- RRU blocks

_NO_SLEEVE = {"没有保护", "无保护"}
_UNREADABLE = {"", "无", "无法识别", "不可识别", "模糊"}
_DISTANCE_TEXT = re.compile(r"站点距离[=/](\d+)")


def _categories(obj: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for entry in obj["统计"]:
        if isinstance(entry, dict) and isinstance(entry.get("类别"), str):
            out.setdefault(entry["类别"], []).append(entry)
    return out


def _distances(obj: dict | None, text: str) -> list[int]:
    if obj is None:
        return sorted({int(d) for d in _DISTANCE_TEXT.findall(text)})
    found = set()
    for entry in _categories(obj).get("站点距离", []):
        for attr in ("站点距离", "距离"):
            if isinstance(entry.get(attr), dict):
                found.update(int(k.strip()) for k in entry[attr] if k.strip().isdigit())
    return sorted(found)


def _readable_label(cats: dict[str, list[dict]]) -> bool:
    for entry in cats.get("标签", []):
        texts = entry.get("文本")
        if isinstance(texts, dict) and any(k.strip() not in _UNREADABLE and c for k, c in texts.items()):
            return True
    return False


def _sleeve(cats: dict[str, list[dict]]) -> bool:
    for entries in cats.values():
        for entry in entries:
            values = entry.get("套管保护")
            if isinstance(values, dict) and any(k not in _NO_SLEEVE and c for k, c in values.items()):
                return True
    return False


def _features(mission: str, obj: dict | None, text: str) -> dict[str, bool]:
    """The per-install-point facts each RRU mission pairs across photos. Non-JSON text
    falls back to looking for the category names in the text."""
    if obj is None:
        has = lambda *words: any(w in text for w in words)  # noqa: E731
        readable = has("标签")
        sleeve = has("套管") and not has(*_NO_SLEEVE)
    else:
        cats = _categories(obj)
        has = lambda *words: any(w in cats for w in words)  # noqa: E731
        readable = _readable_label(cats)
        sleeve = _sleeve(cats)
    if mission == "RRU安装检查":
        return {"RRU": has("RRU设备"), "紧固件": has("紧固件", "固定件")}
    if mission == "RRU位置检查":
        return {"RRU接地端": has("RRU接地端"), "接地线(可读标签)": has("接地线") and readable}
    return {"尾纤": has("尾纤"), "套管": sleeve, "标签文本": readable}


STATION_MISSIONS = ("RRU安装检查", "RRU位置检查", "RRU线缆")


def station_summary_lines(mission: str, summaries: list[str]) -> list[str]:
    """``- 站点距离=35: RRU=有, 紧固件=有`` per station distance, numerically sorted; for
    RRU位置检查 and RRU线缆, distances where nothing was seen are left out."""
    if mission not in STATION_MISSIONS:
        return []
    merged: dict[int, dict[str, bool]] = {}
    for text in summaries:
        if text.strip().startswith(IRRELEVANT):
            continue  # irrelevant photos never take part in pairing
        obj = extract_summary_json(text)
        facts = _features(mission, obj, text)
        for distance in _distances(obj, text):
            seen = merged.setdefault(distance, dict.fromkeys(facts, False))
            for name, value in facts.items():
                seen[name] = seen[name] or value
    keep_empty = mission == "RRU安装检查"
    return [
        f"- 站点距离={d}: " + ", ".join(f"{k}={'有' if v else '无'}" for k, v in facts.items())
        for d, facts in sorted(merged.items())
        if keep_empty or any(facts.values())
    ]


# --------------------------------------------------------------------------- rendering

def _natural_key(key: str) -> tuple:
    m = re.match(r"^([A-Za-z]*)(\d+)$", key)
    return (m.group(1), int(m.group(2)), "") if m else (key, -1, key)


def _rule_lines(guidance: dict[str, str], prefix: str, order: str) -> list[str]:
    keys = [k for k in guidance if k.startswith(prefix)]
    if order == "key":
        keys.sort()
    else:
        keys.sort(key=lambda k: (k != "G0", _natural_key(k)))
    return [f"{i}. {guidance[k]}" for i, k in enumerate(keys, start=1)]


def _block(label: str, lines: list[str]) -> str:
    return "\n".join([label, *lines]) if lines else ""


def _blocks(profile: PromptProfile, guidance: dict[str, str], mission: str, summaries: list[str]) -> dict[str, str]:
    labels, options = profile.labels, profile.options
    values = {
        "mission": mission,
        "focus": guidance.get("G0") or mission,
        "scaffold": _block(labels.scaffold, _rule_lines(guidance, "S", options.rules_order)),
        "rules": _block(labels.rules, _rule_lines(guidance, "G", options.rules_order)),
        "image_stats": "",
        "station_summary": "",
        "image_summaries": _block(labels.image_summaries, [f"{i}. {s}" for i, s in enumerate(summaries, start=1)]),
    }
    if options.object_stats:
        items = ", ".join(f"Image{i}(obj={estimate_objects(s)})" for i, s in enumerate(summaries, start=1))
        values["image_stats"] = labels.image_stats.replace("{items}", items).replace("{count}", str(len(summaries)))
    if options.station_aggregation:
        values["station_summary"] = _block(labels.station_summary, station_summary_lines(mission, summaries))
    return values


def render_template(template: str, values: dict[str, str]) -> str:
    """Fill the user layout (see the module docstring for the block-line rule)."""
    out: list[str] = []
    drop_blank = False
    for line in template.split("\n"):
        whole = _PLACEHOLDER.fullmatch(line.strip())
        if whole and whole.group(1) in BLOCK_FIELDS:
            block = values[whole.group(1)]
            drop_blank = not block
            if block:
                out.extend(block.split("\n"))
            continue
        if drop_blank and not line.strip():
            drop_blank = False
            continue
        drop_blank = False
        out.append(_PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), line))
    return "\n".join(out).strip("\n")


def build_messages(profile: PromptProfile, guidance: dict[str, str], ticket) -> list[dict]:
    """``[{"role": "system", ...}, {"role": "user", ...}]`` for one ticket (a TicketText,
    Ticket or dict with ``mission`` and ``per_image``). The label is never shown."""
    if not guidance:
        raise ValueError("guidance has no experiences: nothing to put in the prompt")
    mission = ticket["mission"] if isinstance(ticket, dict) else ticket.mission
    per_image = ticket["per_image"] if isinstance(ticket, dict) else ticket.per_image
    values = _blocks(profile, guidance, mission, ordered_summaries(per_image))
    return [
        {"role": "system", "content": profile.system},
        {"role": "user", "content": render_template(profile.user_template, values)},
    ]
