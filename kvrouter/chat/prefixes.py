"""``PrefixCache``: a conversation's earlier turns tokenized once, not at every turn.

A multi-turn conversation resends its whole history each turn, and tokenizing a long history dominates
the routing time (llm-d #1109 and #1289: a second of added TTFT at 220 KB prompts). Rules, each checked,
so the answer always equals a full encode:

1. **What is kept.** After a prompt is tokenized, the tokens of its conversation *without* the generation
   prompt (``add_generation_prompt``'s suffix, e.g. ``<|im_start|>assistant\\n``), under a digest of its
   messages (and of the tools and template variables, which change every rendering). The next turn's
   messages start with those same messages, so the next prompt starts with that text.
2. **When it is used.** The longest run of leading messages with an entry, when the new prompt starts
   with its kept text (a template may render a message differently once it is not the last: then the
   prompt is encoded whole).
3. **Where the split is safe.** The text after the kept prefix must start with one of the tokenizer's
   special tokens: those are cut out of the text before the tokenizer's normalizer and pre-tokenizer
   run, so nothing merges across the split. The generation prompt must start with one too, for the kept
   tokens to be cut from a prompt's tokens; and its tokens must end them (checked, else nothing is kept).
4. **Per model, once.** At load, :meth:`PrefixCache.verified` tokenizes a sample conversation both ways;
   a model whose template or tokenizer breaks the equality (a special token that strips the space before
   it, say) gets no cache and every prompt is encoded whole.
5. **Bounded.** Least recently used entries go once the kept tokens pass ``max_tokens`` (4 M by default:
   16 MB of token ids, and the texts).
6. **Arrays, not lists.** Kept tokens are ``uint32`` arrays and a prompt's tokens come out as one, what the
   router hashes: at 100k tokens, a list of Python ints cost about 1 ms to make from the kept array, 1 ms
   to keep again and 1.6 ms for the router to turn into an array, three times the tokenizer's own work on
   a turn's new text (``tools/bench_tokenize.py``).

Rejected: caching by text prefix (finding the longest cached prefix of a 400 KB text costs more than the
digests of its messages) and the tokenizer's own offsets to cut a prompt's tokens at any message (byte-level
offsets do not map to characters one to one).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import orjson

__all__ = ["DEFAULT_MAX_TOKENS", "PrefixCache"]

DEFAULT_MAX_TOKENS: Final = 4 << 20
"""Token ids kept at most (4 bytes each)."""


class PrefixCache:
    """Kept conversation prefixes of one model (see the module docstring).

    Args:
        encode: the model's text -> token ids, no special tokens added.
        specials: the tokenizer's special tokens' texts.
        generation: the text ``add_generation_prompt`` appends.
        max_tokens: the bound on the kept tokens.
    """

    def __init__(
        self,
        encode: Callable[[str], list[int]],
        specials: Sequence[str],
        generation: str,
        *,
        max_tokens: int = DEFAULT_MAX_TOKENS,
    ) -> None:
        self._encode = encode
        self._specials = tuple(s for s in specials if s)
        self._generation = generation
        self._generation_ids = _ids(encode(generation) if generation else [])
        self.max_tokens = max_tokens
        self._entries: OrderedDict[bytes, tuple[str, npt.NDArray[np.uint32]]] = OrderedDict()
        self.kept_tokens = 0
        self.hits = 0
        """Prompts that reused a kept prefix."""
        self.reused_tokens = 0

    def _splits_safely(self, text: str, at: int) -> bool:
        return any(text.startswith(special, at) for special in self._specials)

    def encode(
        self, messages: Sequence[Mapping[str, Any]], text: str, *, generation_prompt: bool, context: object = None
    ) -> npt.NDArray[np.uint32]:
        """The token ids of ``text``, the rendering of ``messages`` (with the generation prompt when
        ``generation_prompt``; ``context``: whatever else the rendering depended on, tools and variables),
        reusing the longest kept prefix, and keeping this conversation for its next turn."""
        digests = _digests(messages, context)
        ids: npt.NDArray[np.uint32] | None = None
        for k in range(len(digests) - 1, 0, -1):
            entry = self._entries.get(digests[k])
            if entry is None:
                continue
            kept_text, kept_ids = entry
            if text.startswith(kept_text) and self._splits_safely(text, len(kept_text)):
                self._entries.move_to_end(digests[k])
                ids = np.concatenate((kept_ids, _ids(self._encode(text[len(kept_text) :]))))
                self.hits += 1
                self.reused_tokens += len(kept_ids)
            break
        if ids is None:
            ids = _ids(self._encode(text))
        if generation_prompt:
            self._keep(digests[-1], text, ids)
        return ids

    def _keep(self, digest: bytes, text: str, ids: npt.NDArray[np.uint32]) -> None:
        """Keep the conversation's tokens without the generation prompt, when they can be cut off safely."""
        tail, tail_ids = self._generation, self._generation_ids
        if not tail or not text.endswith(tail) or not self._splits_safely(text, len(text) - len(tail)):
            return
        cut = len(ids) - len(tail_ids)
        if cut <= 0 or not np.array_equal(ids[cut:], tail_ids):
            return
        kept = ids[:cut].copy()  # its own memory: the prompt's array goes on to the router
        old = self._entries.pop(digest, None)
        if old is not None:
            self.kept_tokens -= len(old[1])
        self._entries[digest] = (text[: len(text) - len(tail)], kept)
        self.kept_tokens += len(kept)
        while self.kept_tokens > self.max_tokens and self._entries:
            _, (_, dropped) = self._entries.popitem(last=False)
            self.kept_tokens -= len(dropped)

    def verified(self, render: Callable[[list[dict[str, Any]], bool], str]) -> bool:
        """Whether incremental encoding equals a full encode on a sample conversation rendered with
        ``render(messages, generation_prompt)``, turn after turn (rule 4). The cache is left empty."""
        texts = ["Hello there.", " a  leading and trailing space ", "Line one\nline two\n\n", "tabs\tand\r\nnew"]
        messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant. "}]
        try:
            for turn, content in enumerate(texts):
                messages.append({"role": "user", "content": content})
                text = render(messages, True)
                if self.encode(messages, text, generation_prompt=True).tolist() != self._encode(text):
                    return False
                messages.append({"role": "assistant", "content": f"Answer {turn}, with a trailing space "})
            return self.hits > 0
        finally:
            self._entries.clear()
            self.kept_tokens = self.hits = self.reused_tokens = 0


def _ids(tokens: Sequence[int]) -> npt.NDArray[np.uint32]:
    return np.asarray(tokens, dtype=np.uint32)


def _digests(messages: Sequence[Mapping[str, Any]], context: object) -> list[bytes]:
    """``digests[k]``: the digest of the first ``k`` messages (and the context), chained."""
    digest = hashlib.blake2b(orjson.dumps(context, option=orjson.OPT_SORT_KEYS), digest_size=16).digest()
    out = [digest]
    for message in messages:
        digest = hashlib.blake2b(digest + orjson.dumps(message, option=orjson.OPT_SORT_KEYS), digest_size=16).digest()
        out.append(digest)
    return out
