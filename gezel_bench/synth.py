"""Prompt synthesis: token ids from hash block ids, with the trace's prefix sharing intact.

The invariant, at the token level: two blocks with the same hash id get the same
tokens, two blocks with different ids get different token sequences. A prompt is its
blocks' tokens concatenated, cut to ``prompt_tokens``; where the blocks do not cover
``prompt_tokens`` (Weka hashes only whole blocks) the rest is a tail unique to that
turn. Token ids come from a keyed hash of ``(seed, block id)`` (BLAKE2b), drawn from a
safe id range ``[vocab_lo, vocab_hi)`` that skips a model's control and byte tokens;
a rare collision between two ids is resolved by redrawing the later one with a salt,
so the mapping is a bijection over the trace's ids and deterministic for a seed.

Requests go out as token-array prompts, so no tokenizer stands between the trace and
the engine: llama.cpp's ``/completion`` (``api="llama"``) or ``/v1/completions``
(``api="openai"``), with ``n_predict``/``max_tokens`` and ``ignore_eos`` forcing the
output length, ``cache_prompt`` on, and the session in ``prompt_cache_key`` and the
``X-Session-Id`` header. Pure and synchronous.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any, Literal

from .errors import BenchError
from .traces import Trace, Turn

__all__ = [
    "API_STYLES",
    "DEFAULT_VOCAB_LO",
    "Api",
    "PromptSynthesizer",
    "endpoint_path",
    "request_body",
    "request_headers",
]

Api = Literal["llama", "openai"]
API_STYLES: tuple[Api, ...] = ("llama", "openai")

#: Below this id sit the control and byte tokens of the demo model (and of most
#: SentencePiece vocabularies); prompts never use them.
DEFAULT_VOCAB_LO = 300


class PromptSynthesizer:
    """Deterministic token ids for a set of hash block ids.

    Construction draws every block up front (the collision check needs them all);
    :meth:`prompt` is then a concatenation. Raises :class:`BenchError` when the id
    range cannot give enough distinct blocks (``(vocab_hi - vocab_lo) ** block_size``
    must be at least twice the number of ids): raise ``tokens_per_block``.
    """

    def __init__(
        self,
        *,
        block_size: int,
        vocab_hi: int,
        vocab_lo: int = DEFAULT_VOCAB_LO,
        seed: int = 0,
        block_ids: Iterable[int] = (),
    ) -> None:
        if block_size < 1:
            raise BenchError(f"block_size must be >= 1, not {block_size}")
        if vocab_lo < 0 or vocab_hi - vocab_lo < 2:
            raise BenchError(
                f"token id range [{vocab_lo}, {vocab_hi}) is too small: "
                "check the model's vocabulary size and --vocab-lo"
            )
        self.block_size = block_size
        self.vocab_lo = vocab_lo
        self.vocab_hi = vocab_hi
        self.seed = seed
        ids = sorted(set(block_ids))
        width = vocab_hi - vocab_lo
        if width**block_size < 2 * len(ids):
            raise BenchError(
                f"{len(ids)} distinct blocks do not fit {width} token ids ** {block_size} "
                "tokens per block: raise tokens_per_block"
            )
        self._blocks: dict[int, tuple[int, ...]] = {}
        used: set[tuple[int, ...]] = set()
        self.collisions = 0
        for block_id in ids:
            salt = 0
            seq = self._draw(b"block", str(block_id), salt, block_size)
            while seq in used:
                self.collisions += 1
                salt += 1
                seq = self._draw(b"block", str(block_id), salt, block_size)
            used.add(seq)
            self._blocks[block_id] = seq

    @classmethod
    def for_trace(
        cls, trace: Trace, *, vocab_hi: int, vocab_lo: int = DEFAULT_VOCAB_LO, seed: int = 0
    ) -> PromptSynthesizer:
        return cls(
            block_size=trace.block_size,
            vocab_hi=vocab_hi,
            vocab_lo=vocab_lo,
            seed=seed,
            block_ids=trace.block_ids(),
        )

    def _draw(self, kind: bytes, key: str, salt: int, n: int) -> tuple[int, ...]:
        width = self.vocab_hi - self.vocab_lo
        out: list[int] = []
        counter = 0
        while len(out) < n:
            h = hashlib.blake2b(digest_size=64, person=b"gezel-bench")
            h.update(b"%d\x00%s\x00%s\x00%d\x00%d" % (self.seed, kind, key.encode(), salt, counter))
            digest = h.digest()
            for i in range(0, 64, 4):
                out.append(self.vocab_lo + int.from_bytes(digest[i : i + 4], "little") % width)
            counter += 1
        return tuple(out[:n])

    def block_tokens(self, block_id: int) -> tuple[int, ...]:
        """The tokens of one block; ``KeyError`` for an id the synthesizer was not given."""
        return self._blocks[block_id]

    def tail_tokens(self, turn: Turn, n: int) -> tuple[int, ...]:
        """``n`` tokens unique to ``turn`` (for the part of a prompt its blocks miss)."""
        return self._draw(b"tail", f"{turn.session}\x00{turn.index}", 0, n)

    def prompt(self, turn: Turn) -> list[int]:
        """The token ids of ``turn``'s prompt, exactly ``turn.prompt_tokens`` long."""
        tokens: list[int] = []
        for block_id in turn.blocks:
            if len(tokens) >= turn.prompt_tokens:
                break
            tokens.extend(self._blocks[block_id])
        del tokens[turn.prompt_tokens :]
        missing = turn.prompt_tokens - len(tokens)
        if missing > 0:
            tokens.extend(self.tail_tokens(turn, missing))
        return tokens

    def statistics(self) -> dict[str, Any]:
        return {
            "blocks": len(self._blocks),
            "block_size": self.block_size,
            "vocab_lo": self.vocab_lo,
            "vocab_hi": self.vocab_hi,
            "seed": self.seed,
            "collisions_redrawn": self.collisions,
        }

    def __repr__(self) -> str:
        return (
            f"<PromptSynthesizer blocks={len(self._blocks)} block_size={self.block_size} "
            f"ids=[{self.vocab_lo}, {self.vocab_hi}) seed={self.seed}>"
        )


def endpoint_path(api: Api) -> str:
    """``/completion`` for llama.cpp's native API, ``/v1/completions`` for OpenAI style."""
    if api == "llama":
        return "/completion"
    if api == "openai":
        return "/v1/completions"
    raise BenchError(f"api must be one of {API_STYLES}, not {api!r}")


def request_body(
    *,
    api: Api,
    prompt: list[int],
    output_tokens: int,
    session: str,
    model: str | None = None,
    seed: int | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON body of one streamed completion with a token-array prompt."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "stream": True,
        "ignore_eos": True,
        "cache_prompt": True,
        "prompt_cache_key": session,
    }
    if api == "llama":
        body["n_predict"] = output_tokens
        body["return_tokens"] = True
    elif api == "openai":
        body["max_tokens"] = output_tokens
        body["stream_options"] = {"include_usage": True}
    else:
        raise BenchError(f"api must be one of {API_STYLES}, not {api!r}")
    if model is not None:
        body["model"] = model
    if seed is not None:
        body["seed"] = seed
    if extra:
        body.update(extra)
    return body


def request_headers(session: str) -> dict[str, str]:
    return {"X-Session-Id": session}
