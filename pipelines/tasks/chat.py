"""Chat rows → (prompt, response) strings with the tokenizer's own chat template."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pipelines.data.sources import DataError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def render_chats(tokenizer: PreTrainedTokenizerBase, chats: Sequence[Any]) -> tuple[list[str], list[str]]:
    """Split each chat into the prompt (every turn before the last, plus the assistant's header) and the response.

    The response is the rendered text after that prompt: the last assistant message and the
    template's end-of-turn marker, which is what generation must learn to write and stop on.
    """
    if not tokenizer.chat_template:
        raise DataError("data.messages_column: the tokenizer has no chat template; use prompt/response columns")
    prompts, responses = [], []
    for row, messages in enumerate(chats):
        messages = list(messages)
        if not messages or not isinstance(messages[-1], dict) or messages[-1].get("role") != "assistant":
            raise DataError(f"data.messages_column, row {row}: the last message must be the assistant's answer")
        prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template(messages, tokenize=False)
        if not full.startswith(prompt):
            raise DataError(
                f"data.messages_column, row {row}: the chat template renders the conversation differently from its "
                "prompt (it rewrites earlier turns), so the answer cannot be separated from the prompt"
            )
        prompts.append(prompt)
        responses.append(full[len(prompt) :])
    return prompts, responses
