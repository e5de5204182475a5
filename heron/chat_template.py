"""Chat templates: a conversation to prompt token ids, for the offline API and the server alike."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Conversation = list[dict[str, Any]]


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    conversation: Conversation,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of ``conversation`` through ``chat_template`` (a Jinja template) or, by
    default, the tokenizer's own; ``tools`` (OpenAI's tool definitions) go to the template,
    which decides how the model sees them; ``template_kwargs`` are more variables of the
    template (``enable_thinking`` of Qwen3's, say)."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
    taken = set(template_kwargs or ()) & set(
        inspect.signature(tokenizer.apply_chat_template).parameters
    )
    if taken:
        raise ValueError(
            f"chat_template_kwargs may not set {', '.join(sorted(taken))}: "
            "those are arguments of the template call, not template variables"
        )
    text = tokenizer.apply_chat_template(
        conversation,
        tools=tools,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        **(template_kwargs or {}),
    )
    # The template already wrote any BOS token; do not add a second one.
    return tokenizer.encode(text, add_special_tokens=False)


# What only a Jinja template holds, never a file name.
_JINJA_MARKS = ("{{", "{%", "\n")


def load_chat_template(value: str) -> str:
    """The template a file holds, or ``value`` itself when it is template text (vLLM's rule);
    ``ValueError`` when it is neither."""
    if any(mark in value for mark in _JINJA_MARKS):
        return value
    path = Path(value).expanduser()
    try:
        return path.read_text()
    except OSError as e:
        raise ValueError(
            f"--chat-template {value!r} is neither a readable file ({e.strerror}) nor a Jinja "
            "template"
        ) from None
