"""Row formats users bring, made into the columns a task reads: Alpaca's prompt over several columns
(`data.prompt_template`) and ShareGPT's `conversations` turns (`from`/`value`) as chat messages (`role`/`content`).

Both follow the conventions of Axolotl and TRL, declared in params, so neither needs code:
- A prompt template names columns in braces. Its paragraphs (text between blank lines) whose every field is empty are
  left out: `"{instruction}\\n\\n{input}"` on a row without input reads as its instruction alone, as Alpaca's
  no-input prompt does, and `"### Instruction:\\n{instruction}\\n\\n### Input:\\n{input}\\n\\n### Response:\\n"` drops
  its Input section there. A missing value (null in JSONL) counts as empty.
- A ShareGPT turn's `from` is mapped to a chat role (human, user -> user; gpt, assistant, model -> assistant;
  system; tool), and its `value` is the content. Rows already in `role`/`content` pass unchanged.
"""

from __future__ import annotations

import string
from collections.abc import Iterable, Sequence
from typing import Any

from pipelines.data.fingerprint import DataError
from pipelines.params.fields import template_fields

__all__ = ["as_messages", "cell_text", "render_prompt", "render_prompts", "template_fields"]

PARAGRAPH = "\n\n"
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "model": "assistant", "system": "system", "tool": "tool"}  # fmt: skip


def cell_text(value: Any) -> str:
    """A cell as text: a missing value (None, NaN) is empty."""
    if value is None or (isinstance(value, float) and value != value):
        return ""
    return str(value)


def render_prompt(template: str, row: dict[str, Any]) -> str:
    """`template` filled from `row`, leaving out each paragraph whose fields are all empty (see the module)."""
    kept = []
    for paragraph in template.split(PARAGRAPH):
        names = [name for _, name, _, _ in string.Formatter().parse(paragraph) if name is not None]
        values = {name: cell_text(row.get(name)) for name in names}
        if names and all(not v.strip() for v in values.values()):
            continue
        kept.append(paragraph.format_map(values))
    return PARAGRAPH.join(kept)


def render_prompts(template: str, rows: Iterable[dict[str, Any]]) -> list[str]:
    """`render_prompt` of every row."""
    return [render_prompt(template, row) for row in rows]


def as_messages(chat: Any, where: str, row: int) -> list[dict[str, str]]:
    """One chat as a list of {role, content}: ShareGPT turns ({from, value}) mapped, role/content ones kept; a turn in
    neither form is refused, naming the row (counted from 1) and what is allowed."""
    turns: Sequence[Any] = list(chat) if chat is not None and not isinstance(chat, str | bytes | dict) else []
    if not turns:
        raise DataError(f"{where}, row {row + 1}: the chat is not a list of turns ({chat!r:.80})")
    messages = []
    for turn in turns:
        if isinstance(turn, dict) and "role" in turn and "content" in turn:
            messages.append(turn)
            continue
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise DataError(
                f"{where}, row {row + 1}: a turn {turn!r:.80} has neither role/content nor ShareGPT's from/value"
            )
        role = SHAREGPT_ROLES.get(str(turn["from"]).strip().lower())
        if role is None:
            raise DataError(
                f"{where}, row {row + 1}: ShareGPT speaker {turn['from']!r} is not one of {sorted(SHAREGPT_ROLES)}"
            )
        messages.append({"role": role, "content": cell_text(turn["value"])})
    return messages
