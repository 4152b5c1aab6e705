"""Deterministic random-weight demo models (GGUF) that a real llama-server can serve.

The host schedules tokens, it does not judge them: a random-weight model of the right
shape exercises every code path of the engine (prefill, KV cache, slots, streaming)
without a download. :func:`write_demo_model` writes one with the ``gguf`` package;
:func:`demo_model_path` returns the embedded default, generated on first use into the
user's cache directory.

Three properties make the model usable through llama-server's endpoints:

- an SPM vocabulary with all 256 byte tokens (``<0x0A>`` included, which chat
  templates need) plus ordinary ASCII pieces, and a ChatML-like chat template;
- fill-in-the-middle control tokens (Qwen2.5-Coder's spelling, :data:`FIM_TOKENS`) named
  by the ``tokenizer.ggml.fim_*_token_id`` keys, so ``POST /infill`` works, with
  ``input_extra`` laid out in the repo-level pattern (``<|fim_repo|>``, ``<|file_sep|>``);
- output weights whose rows for the bytes 0x80-0xFF (and ``<unk>``/``<s>`` and the FIM
  tokens) are zero while every other row has a large spread: their logit is exactly 0
  while the best other logit is tens of units above it, so the model can never emit a
  lone high byte (llama-server answers 500 on invalid UTF-8 output) or a FIM token, even
  at temperature 1.

The FIM tokens sit at the end of the vocabulary and their rows are drawn from a
generator of their own, so every other weight is the one format version 1 drew: the
models answer ordinary prompts as before.

:func:`write_demo_reranker` writes a tiny Qwen3-style reranker (rank pooling through a
two-label ``cls.output`` head) that ``llama-server --reranking`` serves on ``/v1/rerank``.

Everything here is synchronous file I/O; call it from Trio through
``trio.to_thread.run_sync``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, get_args

import numpy as np
from gguf import GGUFWriter, PoolingType, TokenType

__all__ = [
    "DEMO_MODEL_FORMAT_VERSION",
    "FIM_TOKENS",
    "FIM_TOKEN_IDS",
    "HIGH_BYTE_TOKEN_IDS",
    "RERANK_LABELS",
    "RERANK_TEMPLATE",
    "DemoArch",
    "DemoSize",
    "default_model_cache_dir",
    "demo_model_path",
    "demo_reranker_path",
    "write_demo_model",
    "write_demo_reranker",
    "write_gguf",
]

DemoSize = Literal["tiny", "small"]
DemoArch = Literal["llama", "mamba", "qwen35"]

#: Bumped whenever the generator's output changes, so cached files are regenerated.
DEMO_MODEL_FORMAT_VERSION = 2

UNK_ID = 0
BOS_ID = 1
EOS_ID = 2
_FIRST_BYTE_ID = 3
#: Token ids of the byte tokens ``<0x80>`` .. ``<0xFF>``; their output rows are zero.
HIGH_BYTE_TOKEN_IDS = range(_FIRST_BYTE_ID + 0x80, _FIRST_BYTE_ID + 0x100)

_SPACE = "\u2581"  # SentencePiece's word-boundary marker

#: The fill-in-the-middle control tokens by role: the ``<role>`` of llama.cpp's
#: ``tokenizer.ggml.fim_<role>_token_id`` GGUF key (``llama-vocab.cpp``). ``pre``, ``suf``
#: and ``mid`` are what ``/infill`` requires; ``rep`` and ``sep`` lay out ``input_extra``;
#: ``pad``, ``rep`` and ``sep`` are end-of-generation tokens to llama.cpp.
FIM_TOKENS: Final[dict[str, str]] = {
    "pre": "<|fim_prefix|>",
    "suf": "<|fim_suffix|>",
    "mid": "<|fim_middle|>",
    "pad": "<|fim_pad|>",
    "rep": "<|fim_repo|>",
    "sep": "<|file_sep|>",
}

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

#: The labels of the reranker's classifier head, as llama.cpp's converter writes them for
#: Qwen3-Reranker; the score llama-server reports is the first label's probability.
RERANK_LABELS: Final = ("yes", "no")

#: The reranker's ``rerank`` chat template: llama-server substitutes ``{query}`` and
#: ``{document}`` and tokenizes the result with special tokens parsed. Qwen3-Reranker's
#: own ends in a fixed assistant turn; this one ends with the document, because the score
#: is read at the last token and random weights barely carry earlier tokens that far: with
#: a fixed ending every document scored within 0.001 of the others.
RERANK_TEMPLATE: Final = (
    "<|im_start|>system\nJudge whether the Document meets the requirements of the Query."
    "<|im_end|>\n<|im_start|>user\n<Query>: {query}\n<Document>: {document}"
)

_WORD_TEXT = (
    "the be to of and a in that have I it for not on with he as you do at this but his "
    "by from they we say her she or an will my one all would there their what so up out "
    "if about who get which go me when make can like time no just him know take people "
    "into year your good some could them see other than then now look only come its "
    "over think also back after use two how our work first well way even new want "
    "because any these give day most us is are was were has had model token hello world "
    "slot engine cache prompt chat answer question request server host trio"
)
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True, slots=True)
class _Dims:
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx: int
    dtype: type[np.floating[Any]]


_LLAMA_DIMS: dict[str, _Dims] = {
    # ~0.6 MB: every matrix f32, two layers.
    "tiny": _Dims(
        n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=128, n_ctx=4096, dtype=np.float32
    ),
    # ~52 MB, f32: a 4k-token prefill takes seconds on two CPU cores.
    "small": _Dims(
        n_embd=384, n_layer=8, n_head=6, n_head_kv=2, n_ff=1024, n_ctx=8192, dtype=np.float32
    ),
}


@dataclass(frozen=True, slots=True)
class _Vocab:
    tokens: list[str]
    scores: list[float]
    types: list[int]


def _build_vocab() -> _Vocab:
    """Special tokens, the 256 byte tokens, then normal pieces (chars, ``▁x``, words).

    Every prefix of a word piece is itself a piece, so the SPM bigram merge can reach
    it; longer pieces score higher so they win the merge order.
    """
    tokens = ["<unk>", "<s>", "</s>"]
    types = [int(TokenType.UNKNOWN), int(TokenType.CONTROL), int(TokenType.CONTROL)]
    scores = [0.0, 0.0, 0.0]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(int(TokenType.BYTE))
        scores.append(0.0)
    for special in ("<|im_start|>", "<|im_end|>"):
        tokens.append(special)
        types.append(int(TokenType.CONTROL))
        scores.append(0.0)

    pieces: dict[str, None] = {_SPACE: None}
    for code in range(0x21, 0x7F):
        pieces[chr(code)] = None
    for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789":
        pieces[_SPACE + c] = None
    for word in _WORDS:
        piece = _SPACE + word
        for end in range(2, len(piece) + 1):
            pieces[piece[:end]] = None
    for piece in pieces:
        tokens.append(piece)
        types.append(int(TokenType.NORMAL))
        # Longer pieces first, ties broken by insertion order: deterministic merges.
        scores.append(float(len(piece)) - len(tokens) * 1e-4)
    # Last, so that every earlier id (and every weight row drawn for it) stays put.
    for special in FIM_TOKENS.values():
        tokens.append(special)
        types.append(int(TokenType.CONTROL))
        scores.append(0.0)
    return _Vocab(tokens=tokens, scores=scores, types=types)


_VOCAB: Final = _build_vocab()
#: Token id of each of :data:`FIM_TOKENS`, by role; their output rows are zero.
FIM_TOKEN_IDS: Final[dict[str, int]] = {
    role: _VOCAB.tokens.index(token) for role, token in FIM_TOKENS.items()
}
#: Tokens before the FIM tokens: the vocabulary of format version 1, whose weight rows
#: come from the main generator.
_N_BASE_VOCAB: Final = min(FIM_TOKEN_IDS.values())


class _Weights:
    """Deterministic tensor factory: one generator, tensors drawn in a fixed order."""

    def __init__(self, writer: GGUFWriter, seed: int, dtype: type[np.floating[Any]]) -> None:
        self._writer = writer
        self._rng = np.random.default_rng(seed)
        # Rows of the tokens added after format version 1 (the FIM tokens): drawn apart,
        # so that the main generator's stream, and every older tensor, stays the same.
        self._added_rows_rng = np.random.default_rng([seed, 1])
        self._dtype = dtype

    def normal(self, name: str, shape: tuple[int, ...], std: float, *, f32: bool = False) -> None:
        data = self._rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        self.add(name, data, f32=f32)

    def uniform(
        self, name: str, shape: tuple[int, ...], low: float, high: float, *, f32: bool = True
    ) -> None:
        data = self._rng.uniform(low, high, shape).astype(np.float32)
        self.add(name, data, f32=f32)

    def const(self, name: str, shape: tuple[int, ...], value: float) -> None:
        self.add(name, np.full(shape, value, dtype=np.float32), f32=True)

    def add(self, name: str, data: np.ndarray[Any, Any], *, f32: bool = False) -> None:
        out = data.astype(np.float32 if f32 else self._dtype)
        self._writer.add_tensor(name, np.ascontiguousarray(out))

    def embedding(self, n_vocab: int, n_embd: int, std: float) -> None:
        """``token_embd.weight``; the rows of the FIM tokens come from their own generator."""
        base = self._rng.standard_normal((_N_BASE_VOCAB, n_embd), dtype=np.float32)
        added = self._added_rows_rng.standard_normal(
            (n_vocab - _N_BASE_VOCAB, n_embd), dtype=np.float32
        )
        self.add("token_embd.weight", np.concatenate([base, added]) * np.float32(std))

    def output(self, n_vocab: int, n_embd: int) -> None:
        """``output.weight``: spiky logits, zero rows for tokens that must never win."""
        std = 30.0 / float(np.sqrt(n_embd))  # logit std ~30 for an RMS-normed hidden state
        rows = np.zeros((n_vocab, n_embd), dtype=np.float32)
        rows[:_N_BASE_VOCAB] = self._rng.standard_normal(
            (_N_BASE_VOCAB, n_embd), dtype=np.float32
        ) * np.float32(std)
        rows[list(HIGH_BYTE_TOKEN_IDS)] = 0.0
        rows[[UNK_ID, BOS_ID]] = 0.0
        rows[list(FIM_TOKEN_IDS.values())] = 0.0
        self.add("output.weight", rows)


def _write_llama(
    writer: GGUFWriter,
    dims: _Dims,
    n_vocab: int,
    seed: int,
    *,
    qk_norm: bool = False,
    rank_labels: Sequence[str] = (),
) -> None:
    """A llama block stack; ``qk_norm`` adds Qwen3's per-head Q/K RMS norms, and
    ``rank_labels`` a rank-pooling classifier head (``cls.output``, one row per label)."""
    head_dim = dims.n_embd // dims.n_head
    writer.add_context_length(dims.n_ctx)
    writer.add_embedding_length(dims.n_embd)
    writer.add_block_count(dims.n_layer)
    writer.add_feed_forward_length(dims.n_ff)
    writer.add_head_count(dims.n_head)
    writer.add_head_count_kv(dims.n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(0 if dims.dtype is np.float32 else 1)
    if rank_labels:
        writer.add_pooling_type(PoolingType.RANK)
        writer.add_classifier_output_labels(list(rank_labels))

    w = _Weights(writer, seed, dims.dtype)
    e, kv = dims.n_embd, dims.n_head_kv * head_dim
    w.embedding(n_vocab, e, 1.0)
    for i in range(dims.n_layer):
        p = f"blk.{i}"
        w.const(f"{p}.attn_norm.weight", (e,), 1.0)
        w.normal(f"{p}.attn_q.weight", (e, e), 1.0 / np.sqrt(e))
        w.normal(f"{p}.attn_k.weight", (kv, e), 1.0 / np.sqrt(e))
        w.normal(f"{p}.attn_v.weight", (kv, e), 1.0 / np.sqrt(e))
        w.normal(f"{p}.attn_output.weight", (e, e), 0.5 / np.sqrt(e))
        if qk_norm:
            w.const(f"{p}.attn_q_norm.weight", (head_dim,), 1.0)
            w.const(f"{p}.attn_k_norm.weight", (head_dim,), 1.0)
        w.const(f"{p}.ffn_norm.weight", (e,), 1.0)
        w.normal(f"{p}.ffn_gate.weight", (dims.n_ff, e), 1.0 / np.sqrt(e))
        w.normal(f"{p}.ffn_up.weight", (dims.n_ff, e), 1.0 / np.sqrt(e))
        w.normal(f"{p}.ffn_down.weight", (e, dims.n_ff), 0.5 / np.sqrt(dims.n_ff))
    w.const("output_norm.weight", (e,), 1.0)
    w.output(n_vocab, e)
    if rank_labels:
        # Applied to the RMS-normed last hidden state, then softmax over the labels: a
        # logit gap with a std of ~3.5 spreads the first label's probability (the score)
        # over (0, 1) (measured: 0.2 to 0.88 over a handful of documents).
        w.normal("cls.output.weight", (len(rank_labels), e), 2.5 / np.sqrt(e), f32=True)


def _write_mamba(writer: GGUFWriter, size: str, n_vocab: int, seed: int) -> None:
    """Mamba-1 (``src/models/mamba.cpp``): expansion factor 2, no attention, no FFN."""
    if size != "tiny":
        raise ValueError("the mamba demo model comes in size 'tiny' only")
    n_embd, n_layer, d_state, d_conv = 64, 2, 16, 4
    d_inner, dt_rank = 2 * n_embd, -(-n_embd // 16)
    writer.add_context_length(4096)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(0)
    writer.add_head_count(0)
    writer.add_ssm_conv_kernel(d_conv)
    writer.add_ssm_inner_size(d_inner)
    writer.add_ssm_state_size(d_state)
    writer.add_ssm_time_step_rank(dt_rank)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(0)

    w = _Weights(writer, seed, np.float32)
    w.embedding(n_vocab, n_embd, 0.3)
    # A = -exp(A_log) with the usual S4D-real init: row i is -(1, 2, ..., d_state).
    a = -np.tile(np.arange(1, d_state + 1, dtype=np.float32), (d_inner, 1))
    for i in range(n_layer):
        p = f"blk.{i}"
        w.const(f"{p}.attn_norm.weight", (n_embd,), 1.0)
        w.normal(f"{p}.ssm_in.weight", (2 * d_inner, n_embd), 1.0 / np.sqrt(n_embd))
        w.normal(f"{p}.ssm_conv1d.weight", (d_inner, d_conv), 0.5, f32=True)
        w.const(f"{p}.ssm_conv1d.bias", (d_inner,), 0.0)
        w.normal(f"{p}.ssm_x.weight", (dt_rank + 2 * d_state, d_inner), 1.0 / np.sqrt(d_inner))
        w.normal(f"{p}.ssm_dt.weight", (d_inner, dt_rank), 1.0 / np.sqrt(dt_rank))
        # softplus^-1 of a time step in [0.01, 0.1]: memory of tens of tokens. With no
        # D skip and a strong out projection the state decides the greedy answer, so a
        # corrupted state shows.
        w.uniform(f"{p}.ssm_dt.bias", (d_inner,), -4.6, -2.25)
        w.add(f"{p}.ssm_a", a, f32=True)
        w.const(f"{p}.ssm_d", (d_inner,), 0.0)
        w.normal(f"{p}.ssm_out.weight", (n_embd, d_inner), 10.0 / np.sqrt(d_inner))
    w.const("output_norm.weight", (n_embd,), 1.0)
    w.output(n_vocab, n_embd)


def _write_qwen35(writer: GGUFWriter, size: str, n_vocab: int, seed: int) -> None:
    """Qwen3.5-style hybrid (``src/models/qwen35.cpp``).

    Gated-delta-net (linear attention) blocks, with a gated full-attention block every
    4th block (``full_attention_interval``): blocks 0-2 recurrent, block 3 attention.
    """
    if size != "tiny":
        raise ValueError("the qwen35 demo model comes in size 'tiny' only")
    n_embd, n_layer, n_ff, interval = 64, 4, 128, 4
    n_head, n_head_kv, head_dim = 4, 2, 16
    d_state, n_group, dt_rank, d_conv = 16, 2, 4, 4  # head_k = head_v = d_state
    key_dim, value_dim = d_state * n_group, d_state * dt_rank
    conv_dim = 2 * key_dim + value_dim
    writer.add_context_length(4096)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_dimension_sections([3, 3, 2, 0])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_ssm_conv_kernel(d_conv)
    writer.add_ssm_inner_size(value_dim)
    writer.add_ssm_state_size(d_state)
    writer.add_ssm_time_step_rank(dt_rank)
    writer.add_ssm_group_count(n_group)
    writer.add_full_attention_interval(interval)
    writer.add_vocab_size(n_vocab)
    writer.add_file_type(0)

    w = _Weights(writer, seed, np.float32)
    e = n_embd
    w.embedding(n_vocab, e, 1.0)
    for i in range(n_layer):
        p = f"blk.{i}"
        w.const(f"{p}.attn_norm.weight", (e,), 1.0)
        w.const(f"{p}.post_attention_norm.weight", (e,), 1.0)
        if (i + 1) % interval == 0:
            w.normal(f"{p}.attn_q.weight", (2 * n_head * head_dim, e), 1.0 / np.sqrt(e))
            w.normal(f"{p}.attn_k.weight", (n_head_kv * head_dim, e), 1.0 / np.sqrt(e))
            w.normal(f"{p}.attn_v.weight", (n_head_kv * head_dim, e), 1.0 / np.sqrt(e))
            w.normal(f"{p}.attn_output.weight", (e, n_head * head_dim), 0.5 / np.sqrt(e))
            w.const(f"{p}.attn_q_norm.weight", (head_dim,), 1.0)
            w.const(f"{p}.attn_k_norm.weight", (head_dim,), 1.0)
        else:
            w.normal(f"{p}.attn_qkv.weight", (conv_dim, e), 1.0 / np.sqrt(e))
            w.normal(f"{p}.attn_gate.weight", (value_dim, e), 1.0 / np.sqrt(e))
            w.normal(f"{p}.ssm_conv1d.weight", (conv_dim, d_conv), 0.5, f32=True)
            w.uniform(f"{p}.ssm_dt.bias", (dt_rank,), -1.0, 1.0)
            w.uniform(f"{p}.ssm_a", (dt_rank,), -4.0, -0.5)  # -exp(A_log)
            w.normal(f"{p}.ssm_beta.weight", (dt_rank, e), 1.0 / np.sqrt(e))
            w.normal(f"{p}.ssm_alpha.weight", (dt_rank, e), 1.0 / np.sqrt(e))
            w.const(f"{p}.ssm_norm.weight", (d_state,), 1.0)
            w.normal(f"{p}.ssm_out.weight", (e, value_dim), 0.5 / np.sqrt(value_dim))
        w.normal(f"{p}.ffn_gate.weight", (n_ff, e), 1.0 / np.sqrt(e))
        w.normal(f"{p}.ffn_up.weight", (n_ff, e), 1.0 / np.sqrt(e))
        w.normal(f"{p}.ffn_down.weight", (e, n_ff), 0.5 / np.sqrt(n_ff))
    w.const("output_norm.weight", (e,), 1.0)
    w.output(n_vocab, e)


_Builder = Callable[[GGUFWriter, str, int, int], None]


def _llama(writer: GGUFWriter, size: str, n_vocab: int, seed: int) -> None:
    _write_llama(writer, _LLAMA_DIMS[size], n_vocab, seed)


_BUILDERS: dict[str, _Builder] = {"llama": _llama, "mamba": _write_mamba, "qwen35": _write_qwen35}


def _add_tokenizer(
    writer: GGUFWriter, vocab: _Vocab, chat_template: str | Sequence[Mapping[str, str]]
) -> None:
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocab.tokens)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    writer.add_unk_token_id(UNK_ID)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(True)
    for role, token_id in FIM_TOKEN_IDS.items():
        # gguf's Keys.Tokenizer.FIM_*_ID; spelled out, as older gguf releases lack them.
        writer.add_uint32(f"tokenizer.ggml.fim_{role}_token_id", token_id)
    writer.add_chat_template(chat_template)


@contextlib.contextmanager
def _atomic_target(path: Path) -> Iterator[Path]:
    """Yield a temp path beside ``path``; rename it over ``path`` on success."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with tmp.open("rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_demo_model(
    path: Path,
    *,
    size: DemoSize,
    arch: DemoArch = "llama",
    seed: int = 0,
) -> Path:
    """Write a random-weight GGUF model to ``path`` and return ``path``.

    Deterministic: the same arguments give a byte-identical file. The file is written
    beside ``path`` and renamed over it, so readers (and racing writers) only ever see
    a complete model.
    """
    if size not in get_args(DemoSize):
        raise ValueError(f"size must be one of {get_args(DemoSize)}, not {size!r}")
    builder = _BUILDERS.get(arch)
    if builder is None:
        raise ValueError(f"arch must be one of {sorted(_BUILDERS)}, not {arch!r}")
    vocab = _build_vocab()

    def build(writer: GGUFWriter) -> None:
        writer.add_name(f"gezel-trio demo {arch} {size} seed {seed}")
        _add_tokenizer(writer, vocab, CHAT_TEMPLATE)
        builder(writer, size, len(vocab.tokens), seed)

    return write_gguf(Path(path), arch, build)


def write_demo_reranker(path: Path, *, seed: int = 0) -> Path:
    """Write a random-weight reranker to ``path`` and return ``path``.

    Qwen3-style, like Qwen3-Reranker as llama.cpp converts it: architecture ``qwen3`` (a
    llama stack with Q/K norms), ``pooling_type`` rank, a ``cls.output`` head with the
    labels :data:`RERANK_LABELS`, and the ``rerank`` chat template
    :data:`RERANK_TEMPLATE`. llama.cpp pools the last token, projects it onto the labels
    and takes a softmax, so ``llama-server --reranking`` answers ``/v1/rerank`` with a
    score in (0, 1) per document, the same for the same query and document. It keeps the
    demo vocabulary (FIM tokens included), the chat template and the ``output.weight``
    of the tiny llama model, so it also generates text when started without
    ``--reranking``. Deterministic and atomic like :func:`write_demo_model`.
    """
    vocab = _build_vocab()

    def build(writer: GGUFWriter) -> None:
        writer.add_name(f"gezel-trio demo reranker seed {seed}")
        templates = [
            {"name": "default", "template": CHAT_TEMPLATE},
            {"name": "rerank", "template": RERANK_TEMPLATE},
        ]
        _add_tokenizer(writer, vocab, templates)
        _write_llama(
            writer,
            _LLAMA_DIMS["tiny"],
            len(vocab.tokens),
            seed,
            qk_norm=True,
            rank_labels=RERANK_LABELS,
        )

    return write_gguf(Path(path), "qwen3", build)


def write_gguf(path: Path, arch: str, build: Callable[[GGUFWriter], None]) -> Path:
    """Write a GGUF file whose keys and tensors ``build`` adds, atomically (beside
    ``path``, then renamed over it); returns ``path``."""
    with _atomic_target(path) as tmp:
        writer = GGUFWriter(tmp, arch)
        try:
            build(writer)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        finally:
            writer.close()
    return path


def default_model_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/gezel-trio/models``, else ``~/.cache/gezel-trio/models``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "gezel-trio" / "models"


def demo_model_path(
    size: DemoSize = "tiny",
    *,
    arch: DemoArch = "llama",
    cache_dir: Path | None = None,
) -> Path:
    """Path of the demo model, generated into the cache dir on first use.

    Cheap when the file exists. The file name carries the size and
    :data:`DEMO_MODEL_FORMAT_VERSION`, so a generator change regenerates it. Two
    processes racing both write complete identical files and rename them atomically.
    """
    directory = default_model_cache_dir() if cache_dir is None else Path(cache_dir)
    path = directory / f"gezel-demo-{arch}-{size}-v{DEMO_MODEL_FORMAT_VERSION}.gguf"
    if not path.is_file():
        write_demo_model(path, size=size, arch=arch, seed=0)
    return path


def demo_reranker_path(*, cache_dir: Path | None = None) -> Path:
    """Path of the demo reranker (:func:`write_demo_reranker`, seed 0), generated into
    the cache dir on first use, like :func:`demo_model_path`."""
    directory = default_model_cache_dir() if cache_dir is None else Path(cache_dir)
    path = directory / f"gezel-demo-reranker-tiny-v{DEMO_MODEL_FORMAT_VERSION}.gguf"
    if not path.is_file():
        write_demo_reranker(path, seed=0)
    return path
