from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import gguf
import httpx
import numpy as np
import pytest
import trio
from gguf import GGUFReader, TokenType

from gezel_trio.engine import demo_model
from gezel_trio.engine.demo_model import (
    DEMO_MODEL_FORMAT_VERSION,
    FIM_TOKEN_IDS,
    FIM_TOKENS,
    HIGH_BYTE_TOKEN_IDS,
    demo_model_path,
    write_demo_model,
)

from ._engine_bin import ENGINE_LIMITS, open_llama_server
from .gguf_tools import gguf_field, sha256_of


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("m") / "tiny.gguf", size="tiny")


def test_same_arguments_give_identical_bytes(tmp_path: Path, tiny: Path) -> None:
    again = write_demo_model(tmp_path / "again.gguf", size="tiny")
    other_seed = write_demo_model(tmp_path / "seed1.gguf", size="tiny", seed=1)
    assert sha256_of(again) == sha256_of(tiny)
    assert sha256_of(other_seed) != sha256_of(tiny)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.gguf", "seed1.gguf"]


@pytest.mark.parametrize("arch", ["mamba", "qwen35"])
def test_recurrent_archs_are_deterministic_and_tiny_only(tmp_path: Path, arch: str) -> None:
    a = write_demo_model(tmp_path / "a.gguf", size="tiny", arch=arch)  # type: ignore[arg-type]
    b = write_demo_model(tmp_path / "b.gguf", size="tiny", arch=arch)  # type: ignore[arg-type]
    assert sha256_of(a) == sha256_of(b)
    reader = GGUFReader(a)
    assert gguf_field(reader, "general.architecture") == arch
    assert gguf_field(reader, f"{arch}.ssm.state_size") > 0
    out = next(t for t in reader.tensors if t.name == "output.weight")
    rows = np.asarray(out.data, dtype=np.float32).reshape(-1, out.data.shape[-1])
    assert not rows[list(HIGH_BYTE_TOKEN_IDS)].any()
    assert not rows[list(FIM_TOKEN_IDS.values())].any()
    assert gguf_field(reader, "tokenizer.ggml.fim_mid_token_id") == FIM_TOKEN_IDS["mid"]
    with pytest.raises(ValueError, match="tiny"):
        write_demo_model(tmp_path / "c.gguf", size="small", arch=arch)  # type: ignore[arg-type]


def test_sizes(tmp_path: Path, tiny: Path) -> None:
    assert tiny.stat().st_size < 1_000_000
    small = write_demo_model(tmp_path / "small.gguf", size="small")
    assert 40_000_000 < small.stat().st_size < 60_000_000
    reader = GGUFReader(small)
    assert gguf_field(reader, "llama.context_length") >= 8192
    assert gguf_field(GGUFReader(tiny), "llama.context_length") >= 4096


def test_vocab_is_spm_with_all_byte_tokens(tiny: Path) -> None:
    reader = GGUFReader(tiny)
    assert gguf_field(reader, "general.architecture") == "llama"
    assert gguf_field(reader, "tokenizer.ggml.model") == "llama"
    tokens: list[str] = gguf_field(reader, "tokenizer.ggml.tokens")
    types: list[int] = gguf_field(reader, "tokenizer.ggml.token_type")
    index = {t: i for i, t in enumerate(tokens)}
    assert len(index) == len(tokens), "token strings must be unique"
    for b in range(256):
        assert types[index[f"<0x{b:02X}>"]] == TokenType.BYTE
    assert "<0x0A>" in index
    assert tokens[gguf_field(reader, "tokenizer.ggml.bos_token_id")] == "<s>"
    assert tokens[gguf_field(reader, "tokenizer.ggml.eos_token_id")] == "</s>"
    assert tokens[gguf_field(reader, "tokenizer.ggml.unknown_token_id")] == "<unk>"
    assert gguf_field(reader, "tokenizer.ggml.add_bos_token") is True
    assert "\u2581the" in index and "a" in index and "7" in index
    normal = sum(1 for t in types if t == TokenType.NORMAL)
    assert normal > 200
    assert "add_generation_prompt" in gguf_field(reader, "tokenizer.chat_template")


def test_fim_tokens_are_control_tokens_named_by_the_gguf_keys(tiny: Path) -> None:
    """llama-server's /infill needs the FIM prefix, suffix and middle tokens; it finds them
    through ``tokenizer.ggml.fim_*_token_id`` (llama-vocab.cpp), and lays ``input_extra``
    out with the repo and file-separator tokens."""
    reader = GGUFReader(tiny)
    tokens: list[str] = gguf_field(reader, "tokenizer.ggml.tokens")
    types: list[int] = gguf_field(reader, "tokenizer.ggml.token_type")
    assert set(FIM_TOKENS) == {"pre", "suf", "mid", "pad", "rep", "sep"}
    # The key names are gguf's own (where this gguf release has them).
    tokenizer_keys = gguf.Keys.Tokenizer
    for role, token in FIM_TOKENS.items():
        key = f"tokenizer.ggml.fim_{role}_token_id"
        assert getattr(tokenizer_keys, f"FIM_{role.upper()}_ID", key) == key
        token_id = gguf_field(reader, key)
        assert token_id == FIM_TOKEN_IDS[role]
        assert tokens[token_id] == token
        assert types[token_id] == TokenType.CONTROL
    assert FIM_TOKENS["pre"] == "<|fim_prefix|>" and FIM_TOKENS["sep"] == "<|file_sep|>"
    # Appended last: every older token keeps its id.
    assert sorted(FIM_TOKEN_IDS.values()) == list(range(len(tokens) - 6, len(tokens)))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    embd_rows = np.asarray(embd.data, dtype=np.float32).reshape(len(tokens), -1)
    assert (np.abs(embd_rows[list(FIM_TOKEN_IDS.values())]).sum(axis=1) > 0).all()


def test_high_byte_output_rows_are_zero_and_others_spiky(tiny: Path) -> None:
    reader = GGUFReader(tiny)
    tokens: list[str] = gguf_field(reader, "tokenizer.ggml.tokens")
    out = next(t for t in reader.tensors if t.name == "output.weight")
    rows = np.asarray(out.data, dtype=np.float32).reshape(len(tokens), -1)
    high = [tokens.index(f"<0x{b:02X}>") for b in range(0x80, 0x100)]
    assert high == list(HIGH_BYTE_TOKEN_IDS)
    assert not rows[high].any()
    never = set(high) | set(FIM_TOKEN_IDS.values())
    assert not rows[sorted(never)].any()
    others = np.array([i for i in range(len(tokens)) if i not in never and i > 2])
    # Any unit-RMS hidden state: the best other logit is far above the zero rows' 0.
    rng = np.random.default_rng(7)
    hidden = rng.standard_normal((64, rows.shape[1])).astype(np.float32)
    hidden /= np.sqrt((hidden**2).mean(axis=1, keepdims=True))
    best = (hidden @ rows[others].T).max(axis=1)
    assert best.min() > 30.0


def test_demo_model_path_generates_once_into_xdg_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    path = demo_model_path("tiny")
    assert path.parent == tmp_path / "xdg" / "gezel-trio" / "models"
    assert "tiny" in path.name and f"v{DEMO_MODEL_FORMAT_VERSION}" in path.name
    assert sha256_of(path) == sha256_of(write_demo_model(tmp_path / "ref.gguf", size="tiny"))

    def boom(*args: object, **kwargs: object) -> Path:
        raise AssertionError("regenerated an existing model")

    monkeypatch.setattr(demo_model, "write_demo_model", boom)
    assert demo_model_path("tiny") == path

    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert demo_model.default_model_cache_dir() == tmp_path / "home/.cache/gezel-trio/models"


def test_racing_writers_leave_one_complete_file(tmp_path: Path, tiny: Path) -> None:
    target = tmp_path / "race.gguf"
    errors: list[BaseException] = []

    def work() -> None:
        try:
            write_demo_model(target, size="tiny")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sha256_of(target) == sha256_of(tiny)
    assert [p.name for p in tmp_path.iterdir()] == ["race.gguf"]


def test_failed_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("generator broke")

    monkeypatch.setitem(demo_model._BUILDERS, "llama", broken)
    with pytest.raises(RuntimeError, match="generator broke"):
        write_demo_model(tmp_path / "x.gguf", size="tiny")
    assert list(tmp_path.iterdir()) == []


def test_rejects_unknown_size_and_arch(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="size"):
        write_demo_model(tmp_path / "x.gguf", size="huge")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="arch"):
        write_demo_model(tmp_path / "x.gguf", size="tiny", arch="gpt9")  # type: ignore[arg-type]


def _valid_utf8(body: bytes) -> str:
    return body.decode("utf-8", errors="strict")


@pytest.mark.engine
async def test_tiny_model_chats_through_real_llama_server(tiny: Path) -> None:
    with trio.fail_after(60):
        async with (
            open_llama_server(tiny, parallel=2, ctx=1024) as server,
            httpx.AsyncClient(limits=ENGINE_LIMITS, base_url=server.base_url, timeout=30) as client,
        ):
            for seed in range(6):
                r = await client.post(
                    "/v1/chat/completions",
                    json={
                        "messages": [{"role": "user", "content": f"hello world {seed}\nhow?"}],
                        "max_tokens": 200,
                        "temperature": 1.0,
                        "seed": seed,
                    },
                )
                assert r.status_code == 200, r.text
                body = json.loads(_valid_utf8(r.content))
                assert body["choices"][0]["message"]["content"]
                assert body["usage"]["completion_tokens"] > 0

            chunks: list[str] = []
            async with client.stream(
                "POST",
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "stream please"}],
                    "max_tokens": 32,
                    "temperature": 1.0,
                    "stream": True,
                },
            ) as resp:
                assert resp.status_code == 200
                raw = b""
                async for piece in resp.aiter_bytes():
                    raw += piece
            for line in _valid_utf8(raw).splitlines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    chunks.append(delta.get("content") or "")
            assert raw.rstrip().endswith(b"data: [DONE]")
            assert len(chunks) > 2 and "".join(chunks)

            for seed in (11, 12, 13):
                r = await client.post(
                    "/completion",
                    json={"prompt": "the model", "n_predict": 64, "temperature": 1.0, "seed": seed},
                )
                assert r.status_code == 200, r.text
                body = json.loads(_valid_utf8(r.content))
                assert body["tokens_predicted"] > 0
                assert isinstance(body["content"], str)
        assert server.returncode is not None, "llama-server outlived the test"


def _infill_fields(body: dict[str, Any]) -> None:
    """The engine's usual completion answer, as llama.vscode reads it."""
    assert isinstance(body["content"], str)
    for key in ("tokens_predicted", "tokens_evaluated", "tokens_cached", "id_slot"):
        assert isinstance(body[key], int), key
    for key in ("prompt_n", "predicted_n", "cache_n", "prompt_ms", "predicted_ms"):
        assert key in body["timings"], key
    assert body["stop"] is True


@pytest.mark.engine
async def test_infill_through_real_llama_server(tiny: Path) -> None:
    """``POST /infill`` answers 200 (a model without FIM tokens gets 501 "Infill is not
    supported by this model"), lays the request out in the repo-level FIM pattern, and
    takes llama.vscode's ``n_predict: 0`` warm-up, whose prompt the next request reuses."""
    extra = [
        {"filename": "util.py", "text": "def helper(x):\n    return x + 1\n"},
        {"filename": "notes.md", "text": "hello world\n"},
    ]
    request = {
        "input_prefix": "def answer(question):\n    ",
        "input_suffix": "\n    return result\n",
        "input_extra": extra,
        "prompt": "result = ",
        "temperature": 1.0,
        "seed": 3,
        "cache_prompt": True,
    }
    with trio.fail_after(90):
        async with (
            # /infill only takes input_extra into a slot context longer than a batch.
            open_llama_server(tiny, parallel=1, ctx=2048, extra_args=["-b", "256"]) as server,
            httpx.AsyncClient(limits=ENGINE_LIMITS, base_url=server.base_url, timeout=30) as client,
        ):
            warm = await client.post("/infill", json={**request, "n_predict": 0})
            assert warm.status_code == 200, warm.text
            body = json.loads(_valid_utf8(warm.content))
            _infill_fields(body)
            # b10435 samples the first token before it checks the budget: a warm-up
            # answers with at most one token, and leaves only the prompt in the slot.
            assert body["tokens_predicted"] <= 1 and body["stop_type"] == "limit"
            assert body["tokens_evaluated"] > 20
            assert body["tokens_cached"] == body["tokens_evaluated"]

            # The prompt as the engine built it (special tokens shown; SPM puts a space
            # before each tokenized piece): [repo] project [file] name, text, per extra
            # file, [file] filename, then <s>[pre] prefix prompt [suf] suffix [mid].
            prompt: str = body["prompt"]
            assert prompt.endswith(FIM_TOKENS["mid"])
            marks = [
                FIM_TOKENS["rep"],
                "myproject",
                FIM_TOKENS["sep"],
                "util.py",
                "return x + 1",
                FIM_TOKENS["sep"],
                "notes.md",
                "hello world",
                FIM_TOKENS["sep"],
                FIM_TOKENS["pre"],
                "def answer",
                "result =",
                FIM_TOKENS["suf"],
                "return result",
                FIM_TOKENS["mid"],
            ]
            at = -1
            for mark in marks:
                at = prompt.find(mark, at + 1)
                assert at >= 0, (mark, prompt)

            answers = []
            for _ in range(2):
                r = await client.post("/infill", json={**request, "n_predict": 24})
                assert r.status_code == 200, r.text
                body = json.loads(_valid_utf8(r.content))
                _infill_fields(body)
                assert body["tokens_predicted"] > 0 and body["content"]
                # The warm-up (then the first answer) left the prompt in the slot.
                assert body["timings"]["cache_n"] >= body["tokens_evaluated"] - 1 > 20
                assert body["tokens_cached"] >= body["tokens_evaluated"]
                assert not any(t in body["content"] for t in FIM_TOKENS.values())
                answers.append(body["content"])
            assert answers[0] == answers[1], "the same request and seed answer the same"

            # The bare shape: only the two required fields, no input_extra or prompt.
            bare = {"input_prefix": "x = ", "input_suffix": "", "n_predict": 4}
            r = await client.post("/infill", json=bare)
            assert r.status_code == 200, r.text
            assert json.loads(_valid_utf8(r.content))["tokens_evaluated"] > 3
        assert server.returncode is not None, "llama-server outlived the test"
