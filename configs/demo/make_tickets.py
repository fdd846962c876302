#!/usr/bin/env python3
"""Generate the demo tickets and seed guidance (deterministic; the output is committed).

    python configs/demo/make_tickets.py            # rewrites tickets.jsonl and guidance.json here
    python configs/demo/make_tickets.py --out DIR  # writes them into DIR instead

Mission: "Rooftop antenna mount inspection". Each ticket is a photo group of 1-3 images;
each image has a Stage-A style one-line JSON summary with English keys
(``{"stats": [{"category": ..., <attribute>: {<value>: <count>}}], "notes": [...]}``,
the upstream Chinese keys are 统计/备注; ``notes`` only when there are any) or the literal
text ``irrelevant photo``. Summaries are compact so that a demo prompt stays near 250
tokens: on a CPU, reading the prompt is most of the cost of a verdict.

Hidden labelling rules (a reviewer's "fail" follows from any of them; they are NOT in the
seed guidance, which has the checklist G0, the scaffold rule S1 and one deliberately
unhelpful learnable rule G1 about blurry photos, a distractor the labels ignore, so that
the rule search always has an ablation candidate to test even when a weak model's
proposals are all rejected):
  1. fail if any photo shows a mounting bolt that is loose or missing;
  2. fail if no photo shows the grounding cable;
  3. fail if any photo shows a damaged (cracked or peeling) weatherproof seal.
The seed guidance's S1 (fail if no photo shows the antenna mount) also holds in the data.
About 5% of the labels are then flipped (label noise, as in real review data).
"""

from __future__ import annotations

import argparse
import json
import os
import random

MISSION = "Rooftop antenna mount inspection"
SEED = 20250301
N_TICKETS = 200
NOISE = 0.05
HERE = os.path.dirname(os.path.abspath(__file__))

GUIDANCE = {
    MISSION: {
        "step": 1,
        "updated_at": "2025-03-01T00:00:00+00:00",
        "experiences": {
            "G0": "Confirm that the antenna mount is installed securely and completely, with all of its fittings in order.",
            "S1": "If no photo shows the antenna mount, the verdict is fail.",
            "G1": "If any photo is slightly blurry, the verdict is fail.",
        },
    }
}

HEADER = "<DOMAIN=ROOF>, <TASK=SUMMARY>"


def _summary(stats: list[dict], notes: list[str], rng: random.Random) -> str:
    summary = {"stats": stats, "notes": notes} if notes else {"stats": stats}
    text = json.dumps(summary, ensure_ascii=False, separators=(",", ":"))
    return f"{HEADER}\n{text}" if rng.random() < 0.1 else text


def _ticket_state(rng: random.Random) -> dict:
    """The latent facts of one photo group: which defects exist and what is visible."""
    return {
        "mount_visible": rng.random() > 0.04,
        "bad_bolt": rng.random() < 0.2,
        "ground_visible": rng.random() > 0.15,
        "bad_seal": rng.random() < 0.15,
        "n_images": rng.randint(1, 3),
    }


def _images(state: dict, rng: random.Random) -> list[str]:
    """Per-image summaries consistent with the latent state: each fact shows in some photo."""
    n = state["n_images"]
    slots: list[list[dict]] = [[] for _ in range(n)]
    notes: list[list[str]] = [[] for _ in range(n)]
    irrelevant = {n - 1} if n >= 3 and rng.random() < 0.2 else set()
    usable = [i for i in range(n) if i not in irrelevant]

    if state["mount_visible"]:
        for i in rng.sample(usable, k=rng.randint(1, len(usable))):
            view = rng.choice(["complete", "complete", "partial"])
            slots[i].append({"category": "antenna mount", "visibility": {view: 1}})
    bolt_photos = rng.sample(usable, k=rng.randint(1, min(2, len(usable))))
    bad_photo = rng.choice(bolt_photos)
    for i in bolt_photos:
        tight = rng.randint(2, 6)
        condition = {"tight": tight}
        if state["bad_bolt"] and i == bad_photo:
            condition[rng.choice(["loose", "missing"])] = rng.randint(1, 2)
        slots[i].append({"category": "mounting bolt", "condition": condition})
    if state["ground_visible"]:
        for i in rng.sample(usable, k=rng.randint(1, min(2, len(usable)))):
            slots[i].append({"category": "grounding cable", "visibility": {"visible": 1}, "routing": {rng.choice(["neat", "neat", "slack"]): 1}})
    seal_photo = rng.choice(usable)
    if state["bad_seal"] or rng.random() < 0.6:
        seal = rng.choice(["cracked", "peeling"]) if state["bad_seal"] else "intact"
        slots[seal_photo].append({"category": "weatherproof seal", "condition": {seal: 1}})
    # Distractors that do not matter for the label.
    for i in usable:
        if rng.random() < 0.2:
            slots[i].append({"category": "cable tie", "condition": {rng.choice(["fastened", "loose"]): rng.randint(1, 4)}})
        if rng.random() < 0.1:
            slots[i].append({"category": "label", "text": {f"ANT-{rng.randint(1, 12):02d}": 1}})
        if rng.random() < 0.1:
            notes[i].append(rng.choice(["close-up", "photo slightly blurry", "taken from below", "partial view"]))
    out = []
    for i in range(n):
        if i in irrelevant:
            out.append("irrelevant photo")
        else:
            rng.shuffle(slots[i])
            out.append(_summary(slots[i], notes[i], rng))
    return out


def _true_label(state: dict) -> str:
    fails = (not state["mount_visible"]) or state["bad_bolt"] or (not state["ground_visible"]) or state["bad_seal"]
    return "fail" if fails else "pass"


def make_tickets(seed: int = SEED, n: int = N_TICKETS) -> list[dict]:
    """The demo tickets as Stage-A records, in file order."""
    rng = random.Random(seed)
    tickets = []
    for i in range(n):
        state = _ticket_state(rng)
        images = _images(state, rng)
        label = _true_label(state)
        if rng.random() < NOISE:
            label = "pass" if label == "fail" else "fail"
        day = 1 + i % 28
        tickets.append({
            "group_id": f"ROOF-DEMO-202503{day:02d}-{i + 1:07d}",
            "mission": MISSION,
            "label": label,
            "images": [f"roof_{i + 1:04d}_{k + 1}.jpg" for k in range(len(images))],
            "per_image": {f"image_{k + 1}": text for k, text in enumerate(images)},
            "label_source": "human",
            "label_timestamp": f"2025-03-{day:02d}T{8 + i % 10:02d}:{(7 * i) % 60:02d}:00",
        })
    return tickets


def render(out_dir: str) -> dict[str, bytes]:
    """The bytes of every generated file, by path."""
    tickets = b"".join(json.dumps(t, ensure_ascii=False).encode() + b"\n" for t in make_tickets())
    guidance = json.dumps(GUIDANCE, ensure_ascii=False, indent=2).encode() + b"\n"
    return {os.path.join(out_dir, "tickets.jsonl"): tickets, os.path.join(out_dir, "guidance.json"): guidance}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=HERE, help="output directory (default: next to this script)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for path, data in render(args.out).items():
        with open(path, "wb") as f:
            f.write(data)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
