"""The example chat datasets of docs/byo/ (the README's "Bring your own model and data"): problems of
`builtin:sample_math`, two per conversation, a system prompt first, in the two chat layouts the data
path reads: OpenAI `messages` (role / content) and ShareGPT `conversations` (from / value, its system
prompt in a `system` field, as LLaMA-Factory writes it).

Made from the bundled sample, so they are ours and reproducible byte for byte (a test compares the
shipped files with this code). Regenerate with `python -m megatrain_cli.data.sample_chat`.
"""

from __future__ import annotations

import json
from pathlib import Path

from megatrain_cli.data.sample_math import generate_sample_math

BYO_DIR = Path(__file__).resolve().parent.parent.parent / "docs" / "byo"
SYSTEM = "You are a careful math tutor. Show the working, then end with 'The answer is: N'."
FILES = {"chats.jsonl": (0, 120), "chats_sharegpt.jsonl": (120, 200)}  # sample_math records used by each
SHAREGPT_ROLES = {"user": "human", "assistant": "gpt"}


def chats(lo: int, hi: int) -> list[list[dict]]:
    """Conversations of two problems each, from sample_math records lo..hi-1."""
    records = generate_sample_math()[lo:hi]
    return [[{"role": "user", "content": a["query"]}, {"role": "assistant", "content": a["response"]},
             {"role": "user", "content": f"Another one: {b['query']}"}, {"role": "assistant", "content": b["response"]}]
            for a, b in zip(records[::2], records[1::2])]


def render(name: str) -> str:
    lo, hi = FILES[name]
    if name == "chats.jsonl":
        rows = [{"messages": [{"role": "system", "content": SYSTEM}, *turns]} for turns in chats(lo, hi)]
    else:
        rows = [{"conversations": [{"from": SHAREGPT_ROLES[t["role"]], "value": t["content"]} for t in turns],
                 "system": SYSTEM} for turns in chats(lo, hi)]
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def write_sample_chats(directory: Path = BYO_DIR) -> list[Path]:
    paths = []
    for name in FILES:
        (directory / name).write_text(render(name), encoding="utf-8")
        paths.append(directory / name)
    return paths


if __name__ == "__main__":
    print("wrote " + ", ".join(map(str, write_sample_chats())))
