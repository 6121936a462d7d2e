"""JSON-lines prompt files (whiflash-run --prompts-file, whiflash-bench --prompts-file): one object per line with a
"prompt" string; blank lines are skipped."""
from __future__ import annotations

import json

from whiflash_trt.errors import WhiflashError


def parse_prompt_lines(lines: list[str], where: str, non_empty: bool = False) -> list[tuple[int, dict]]:
    """(line number, object) for every non-blank line; `where` names the file in errors. Raises WhiflashError on a
    line that is not JSON, an object without a string "prompt" (a non-empty one if `non_empty`), or no prompts."""
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise WhiflashError(f"{where}:{n}: not valid JSON ({e})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or (
                non_empty and not record["prompt"]):
            kind = "a non-empty string" if non_empty else "a string"
            raise WhiflashError(f'{where}:{n}: expected an object with {kind} "prompt"')
        records.append((n, record))
    if not records:
        raise WhiflashError(f"{where} holds no prompts")
    return records
