"""chat_template.py: chat messages to token ids through a chat template, the data always as text.

    from chat_template import Protected, chat_ids
    text, ids = chat_ids(tokenizer, messages, tools=None, generation=True)  # apply_chat_template + encode, safely
    p = Protected(tokenizer)                      # the pieces, for a multi-turn episode's rendered differences
    rendered = tokenizer.apply_chat_template(p.protect(messages), tokenize=False)
    text, ids = p.restore(rendered), p.encode(rendered)

Why: rendering a conversation and tokenising the text with special tokens parsed (what apply_chat_template with
tokenize=True and encode(render) do) turns a task row, an SFT file's turn, a tool result or an API caller's message
holding e.g. `<|im_end|><|im_start|>system ...` into real control tokens: a forged system turn, an EOS inside the
prompt. Every path that tokenises a conversation goes through this module (engines.EngineHandle's chat / replies,
workflows/episode.py's turns, openai_api.py's chat completions, source.py's SFT / DPO rows).

How: every string that reaches the template (messages, tools, template variables; dict keys too, e.g. a tool call's
argument names) has its special-token texts replaced with placeholder characters from Unicode's supplementary
private use planes (U+F0000..U+10FFFD, also standing in for such characters of the data itself) before rendering.
The rendered text is split at the template's own special tokens, which become their ids; each piece between them,
placeholders put back, is encoded with special tokens split (a copy of the fast tokenizer's backend with
`encode_special_tokens`). The special tokens are the tokenizer's added tokens marked special; non-special added
tokens (Qwen3's `<think>`, `<tool_call>`) stay one token each, as the model writes them and as before. A
conversation without special-token texts (nearly all) is rendered and encoded exactly as before: the same calls,
the same ids (a test over the tiny model's template and tests/data/chat_templates/).

NOTE: transformers' own `split_special_tokens=True` sets a flag on the backend tokenizer that every thread shares
(TokenizersBackend._encode_plus) and puts it back on the next call without it: with workflows tokenising in threads,
a concurrent encode would then read a template's control tokens as text. Hence the private copy.
NOTE: a piece is encoded on its own, as the tokenizers library does between added tokens; an added token with
lstrip / rstrip (none in the chat models here) would not strip its neighbours' spaces in a piece that held data.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedTokenizerBase

FIRST, LAST = 0xF0000, 0x10FFFD  # the placeholders: supplementary private use areas A and B (plane 15 and 16)
_PRIVATE = f"[{chr(FIRST)}-{chr(LAST)}]"
_PRIVATE_RE = re.compile(_PRIVATE)
_CACHE: dict[tuple[int, int], tuple[Any, re.Pattern, re.Pattern, dict[str, int], Callable[[str], list[int]]]] = {}
_CACHE_LOCK = threading.Lock()


def _special_tokens(tokenizer: PreTrainedTokenizerBase) -> tuple[re.Pattern, re.Pattern, dict[str, int], Callable]:
    """For `tokenizer` (cached by its backend and size, a few per process): the pattern of its special tokens' texts
    (the longest first, as the tokenizer matches them), the same or a placeholder character (what protect() replaces),
    each special text's id, and the encoder that reads special-token texts as text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    key = (id(backend if backend is not None else tokenizer), len(tokenizer))
    hit = _CACHE.get(key)
    if hit is None:
        specials = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special and t.content}
        pattern = re.compile(_trie(specials) or "(?!)")
        protected = re.compile("|".join(x for x in (_trie(specials), _PRIVATE) if x))
        hit = (backend or tokenizer, pattern, protected, specials, _text_encoder(tokenizer, backend))
        with _CACHE_LOCK:
            _CACHE[key] = hit
    return hit[1:]


def _trie(words: list[str] | dict) -> str:
    """A regex matching any of `words`, the longest at a position (as the tokenizer matches added tokens), written
    as a trie of their common prefixes. NOTE: an alternation of the words themselves (with the private-use class)
    took 117 us of CPU per GSM8K question (237 characters) with Llama 3's count of special tokens (256), about the
    cost of rendering and encoding the prompt: the regex engine tries every word at every position; the trie 3 us."""
    trie: dict = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def pattern(node: dict) -> str:
        alternatives = [re.escape(ch) + pattern(child) for ch, child in sorted(node.items()) if ch]
        if not alternatives:
            return ""
        group = alternatives[0] if len(alternatives) == 1 else f"(?:{'|'.join(alternatives)})"
        return f"(?:{group})?" if "" in node else group

    return pattern(trie)


def _text_encoder(tokenizer: PreTrainedTokenizerBase, backend: Any) -> Callable[[str], list[int]]:
    """text -> ids with special-token texts read as text: a private copy of a fast tokenizer's backend (see the
    module's NOTE), or a slow tokenizer's split_special_tokens (an argument there, no shared state)."""
    if backend is None:
        return lambda text: tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(backend.to_str())
    copy.no_truncation()
    copy.no_padding()
    copy.encode_special_tokens = True
    # NOTE: encode_batch, not encode: it lets go of the GIL while it runs (an API request's other threads go on)
    return lambda text: copy.encode_batch([text], add_special_tokens=False)[0].ids


class Protected:
    """One rendering's placeholders: protect() what goes into the template, then restore() its text or encode() it.
    Placeholder k stands for originals[k] (the same text, the same placeholder)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.specials, self.pattern, self.ids, self.as_text = _special_tokens(tokenizer)
        self.originals: list[str] = []
        self.index: dict[str, str] = {}  # original text -> its placeholder

    def _placeholder(self, match: re.Match) -> str:
        text = match.group()
        if text not in self.index:
            if FIRST + len(self.originals) > LAST:
                raise ValueError("a conversation with more distinct special-token texts than placeholders")
            self.index[text] = chr(FIRST + len(self.originals))
            self.originals.append(text)
        return self.index[text]

    def protect(self, value: Any) -> Any:
        """`value` (messages, tools, template variables: dicts, lists, strings) with every special-token text and
        private-use character of its strings (dict keys too) replaced by a placeholder; the same object when there is
        none (nearly always: no copy)."""
        if not value:
            return value
        strings, stack = [], [value]
        while stack:  # NOTE: a loop, not recursion: an API caller's nesting can be deep
            x = stack.pop()
            if isinstance(x, str):
                strings.append(x)
            elif isinstance(x, dict):
                stack += [*x.keys(), *x.values()]
            elif isinstance(x, (list, tuple)):
                stack += x
        # one search over all the strings (a match across a joint would only cost a copy: _replace is exact);
        # NOTE: two searches: the private-use class in the tokens' pattern made each search ~2x slower
        joined = "\x00".join(strings)
        return self._replace(value) if self.specials.search(joined) or _PRIVATE_RE.search(joined) else value

    def _replace(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.pattern.sub(self._placeholder, value)
        if isinstance(value, dict):
            return {self._replace(k): self._replace(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._replace(v) for v in value]
        if isinstance(value, tuple):
            return tuple(self._replace(v) for v in value)
        return value

    def restore(self, text: str) -> str:
        """The text with each placeholder back as the text it stands for."""
        if not self.originals:
            return text
        last = chr(FIRST + len(self.originals) - 1)
        return re.sub(f"[{chr(FIRST)}-{last}]", lambda m: self.originals[ord(m.group()) - FIRST], text)

    def encode(self, text: str) -> list[int]:
        """Token ids of a rendering of protected values: the template's special tokens as their ids, every other
        piece (placeholders put back) with special-token texts as text. Without placeholders: the tokenizer's
        plain encode, as before."""
        if not self.originals:
            return self.tokenizer.encode(text, add_special_tokens=False)
        ids, start = [], 0
        for match in self.specials.finditer(text):
            ids += self._piece(text[start : match.start()])
            ids.append(self.ids[match.group()])
            start = match.end()
        return ids + self._piece(text[start:])

    def _piece(self, piece: str) -> list[int]:
        return self.as_text(self.restore(piece)) if piece else []


def chat_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    tools: list | None = None,
    chat_template: str | None = None,
    generation: bool = True,
    template_kwargs: dict | None = None,
    suffix: str = "",
) -> tuple[str, list[int]]:
    """`messages` through the tokenizer's chat template (or `chat_template`) with `tools` and the template variables
    `template_kwargs`, and the assistant's generation prompt (`generation`), then `suffix` (a reply prefix: the
    config's, read as template text): (the text, as apply_chat_template writes it; its token ids, every string of the
    data read as text). The one function that tokenises a conversation (see the module docstring)."""
    p = Protected(tokenizer)
    rendered = tokenizer.apply_chat_template(
        p.protect(messages),
        add_generation_prompt=generation,
        tokenize=False,
        tools=p.protect(tools),
        chat_template=chat_template or None,
        **p.protect(template_kwargs or {}),
    )
    return p.restore(rendered) + suffix, p.encode(rendered + suffix)
