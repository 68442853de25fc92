"""Chat-templated prompts reach the model with one BOS.

Why: SGLang tokenizes /generate's "text" with the tokenizer's defaults, adding the special
tokens (TokenizerManager: `tokenizer(texts)` / `tokenizer.encode(t)`), so a chat template
that writes the BOS itself (Llama 3's <|begin_of_text|>) would give the prompt two of them;
dvfs counts one (`apply_chat_template(tokenize=True)`). A fake tokenizer stands in for
transformers': nothing is downloaded.
"""

from __future__ import annotations

import re
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from dvfs.corpora import Prompt
from dvfs.corpora.model import Message
from dvfs.engines.sglang import ChatFormatter, without_bos

BOS = "<|begin_of_text|>"


class FakeTokenizer:
    """A Llama-3-like tokenizer: the template writes the BOS; encoding text adds one too
    (add_special_tokens=True, as SGLang calls it); one id per special token or word."""

    chat_template = "llama-3-like"

    def __init__(self, bos: str | None = BOS, template_bos: bool = True, adds: bool = True) -> None:
        self.bos_token = bos
        self.template_bos = template_bos
        self.adds = adds  # add_bos_token: whether encoding text adds the BOS

    def apply_chat_template(
        self, chat: list[dict[str, str]], *, tokenize: bool, add_generation_prompt: bool
    ) -> Any:
        text = (self.bos_token or "") if self.template_bos else ""
        for m in chat:
            text += f"<|start_header_id|>{m['role']}<|end_header_id|> {m['content']}<|eot_id|>"
        if add_generation_prompt:
            text += "<|start_header_id|>assistant<|end_header_id|>"
        return self.split(text) if tokenize else text

    def split(self, text: str) -> list[str]:
        return re.findall(r"<\|[a-z_]+\|>|[^\s<]+", text)

    def encode(self, text: str) -> list[str]:
        """What the server does with "text": its own BOS, then the text's tokens."""
        return ([self.bos_token] if self.bos_token and self.adds else []) + self.split(text)


def _prompt(*contents: str) -> Prompt:
    messages = tuple(Message("user", c) for c in contents)
    return Prompt(id="p", messages=messages, input_tokens=1)


def test_a_template_that_writes_the_bos_reaches_the_server_without_it() -> None:
    tokenizer = FakeTokenizer()
    text = ChatFormatter("m", tokenizer=tokenizer)(_prompt("hello there"))
    assert not text.startswith(BOS) and text.startswith("<|start_header_id|>user")
    served = tokenizer.encode(text)
    assert served.count(BOS) == 1 and served[0] == BOS
    # as many tokens as dvfs counts for the prompt (the template's ids, one BOS)
    counted = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello there"}], tokenize=True, add_generation_prompt=True
    )
    assert served == counted


def test_a_tokenizer_that_adds_no_bos_keeps_the_templates() -> None:
    """add_bos_token off: the server adds none, so the template's BOS is the only one."""
    tokenizer = FakeTokenizer(adds=False)
    text = ChatFormatter("m", tokenizer=tokenizer)(_prompt("hello there"))
    assert text.startswith(BOS)
    assert tokenizer.encode(text).count(BOS) == 1


def test_a_template_without_a_bos_is_sent_as_it_is() -> None:
    for tokenizer in (FakeTokenizer(bos=None), FakeTokenizer(template_bos=False)):
        chat = [{"role": "user", "content": "hi"}]
        want = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert ChatFormatter("m", tokenizer=tokenizer)(_prompt("hi")) == want


@given(st.text(max_size=30), st.sampled_from([BOS, "<s>", "", None]))
def test_one_leading_bos_is_stripped_and_nothing_else(body: str, bos: str | None) -> None:
    """Only a leading BOS goes, once: a second, or one inside the text, stays."""
    assert without_bos(body, bos) == (body[len(bos) :] if bos and body.startswith(bos) else body)
    if bos:
        assert without_bos(bos + body, bos) == body
        assert without_bos(bos + bos + body, bos) == bos + body
