"""Prompts for chat models."""

from __future__ import annotations

from typing import Optional, Union


def apply_chat_template(tokenizer, messages: Union[str, list[dict]], *, system: Optional[str] = None,
                        **template_kwargs) -> list[int]:
    """Token ids of a conversation rendered with the model's chat template, ready for a reply.

    `messages` is a user message or a list of {"role", "content"} dicts; extra keyword arguments
    reach the template (e.g. enable_thinking=False for Qwen3). A tokenizer without a chat template
    gets the plain text of the messages.
    """
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if system is not None:
        messages = [{"role": "system", "content": system}, *messages]
    if getattr(tokenizer, "chat_template", None) is None:
        return tokenizer.encode("\n".join(m["content"] for m in messages))
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **template_kwargs)
    # The template already writes any BOS token it wants.
    return tokenizer.encode(text, add_special_tokens=False)
