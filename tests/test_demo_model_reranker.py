"""The demo reranker: a tiny Qwen3-style model with rank pooling that a real
``llama-server --reranking`` serves on ``/v1/rerank``."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import trio
from gguf import GGUFReader, PoolingType

from gezel_trio.engine import demo_model
from gezel_trio.engine.demo_model import (
    DEMO_MODEL_FORMAT_VERSION,
    FIM_TOKEN_IDS,
    HIGH_BYTE_TOKEN_IDS,
    RERANK_LABELS,
    RERANK_TEMPLATE,
    demo_reranker_path,
    write_demo_reranker,
)

from ._engine_bin import ENGINE_LIMITS, open_llama_server
from .gguf_tools import gguf_field, sha256_of


@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_reranker(tmp_path_factory.mktemp("r") / "reranker.gguf")


def test_reranker_is_deterministic_and_small(tmp_path: Path, reranker: Path) -> None:
    again = write_demo_reranker(tmp_path / "again.gguf")
    other = write_demo_reranker(tmp_path / "seed1.gguf", seed=1)
    assert sha256_of(again) == sha256_of(reranker)
    assert sha256_of(other) != sha256_of(reranker)
    assert reranker.stat().st_size < 1_000_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.gguf", "seed1.gguf"]


def test_reranker_has_what_llama_cpp_rank_pooling_reads(reranker: Path) -> None:
    """qwen3 loads ``cls.output`` ({n_embd, n_cls_out}, n_cls_out = the number of
    classifier labels) and, under rank pooling, pools the last token and takes a softmax
    over the labels (llama-graph.cpp); the server reads the ``rerank`` chat template."""
    reader = GGUFReader(reranker)
    assert gguf_field(reader, "general.architecture") == "qwen3"
    assert gguf_field(reader, "qwen3.pooling_type") == PoolingType.RANK
    assert gguf_field(reader, "qwen3.classifier.output_labels") == list(RERANK_LABELS)
    template = gguf_field(reader, "tokenizer.chat_template.rerank")
    assert template == RERANK_TEMPLATE and "{query}" in template and "{document}" in template
    assert gguf_field(reader, "tokenizer.chat_templates") == ["rerank"]
    assert "add_generation_prompt" in gguf_field(reader, "tokenizer.chat_template")
    tensors = {t.name: t for t in reader.tensors}
    n_embd = gguf_field(reader, "qwen3.embedding_length")
    cls = tensors["cls.output.weight"]
    assert cls.shape.tolist() == [n_embd, len(RERANK_LABELS)]
    for i in range(gguf_field(reader, "qwen3.block_count")):
        assert f"blk.{i}.attn_q_norm.weight" in tensors
        assert f"blk.{i}.attn_k_norm.weight" in tensors
    # Generation stays as safe as the demo model's: no lone high byte, no FIM token.
    tokens: list[str] = gguf_field(reader, "tokenizer.ggml.tokens")
    out = tensors["output.weight"]
    rows = np.asarray(out.data, dtype=np.float32).reshape(len(tokens), -1)
    assert not rows[list(HIGH_BYTE_TOKEN_IDS)].any()
    assert not rows[list(FIM_TOKEN_IDS.values())].any()


def test_demo_reranker_path_generates_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reranker: Path
) -> None:
    path = demo_reranker_path(cache_dir=tmp_path)
    assert path.parent == tmp_path
    assert "reranker" in path.name and f"v{DEMO_MODEL_FORMAT_VERSION}" in path.name
    assert sha256_of(path) == sha256_of(reranker)

    def boom(*args: object, **kwargs: object) -> Path:
        raise AssertionError("regenerated an existing reranker")

    monkeypatch.setattr(demo_model, "write_demo_reranker", boom)
    assert demo_reranker_path(cache_dir=tmp_path) == path


@pytest.mark.engine
async def test_reranker_through_real_llama_server(reranker: Path) -> None:
    query = "which slot holds the cache"
    documents = ["the engine cache slot", "hello world", "a b c d e f g", "the server is good"]
    with trio.fail_after(60):
        async with (
            open_llama_server(reranker, parallel=2, ctx=1024, extra_args=["--reranking"]) as srv,
            httpx.AsyncClient(limits=ENGINE_LIMITS, base_url=srv.base_url, timeout=30) as client,
        ):
            r = await client.post("/v1/rerank", json={"query": query, "documents": documents})
            assert r.status_code == 200, r.text
            body = r.json()
            results = body["results"]
            assert sorted(x["index"] for x in results) == [0, 1, 2, 3]
            scores = {x["index"]: x["relevance_score"] for x in results}
            # A softmax over the two labels: the first label's probability.
            assert all(0.0 < s < 1.0 for s in scores.values()), scores
            # The score is read at the document's last token: documents differ.
            assert max(scores.values()) - min(scores.values()) > 0.1, scores
            assert [x["relevance_score"] for x in results] == sorted(scores.values())[::-1]
            assert body["usage"]["prompt_tokens"] > 3 * len(documents)

            # Deterministic, whatever slot or batch a document lands in.
            r = await client.post(
                "/v1/rerank", json={"query": query, "documents": documents, "top_n": 1}
            )
            assert r.status_code == 200, r.text
            (best,) = r.json()["results"]
            assert best["index"] == max(scores, key=lambda i: scores[i])
            assert best["relevance_score"] == pytest.approx(scores[best["index"]], abs=1e-4)

            # The llama.cpp spelling of the route and the TEI body shape.
            r = await client.post("/rerank", json={"query": query, "texts": documents[:2]})
            assert r.status_code == 200, r.text
            tei = json.loads(r.content)
            assert sorted(x["index"] for x in tei) == [0, 1]
            assert {x["index"]: x["score"] for x in tei} == pytest.approx(
                {i: scores[i] for i in (0, 1)}, abs=1e-4
            )
        assert srv.returncode is not None, "llama-server outlived the test"
