"""GGUF metadata reading and the memory planner, against numbers computed by hand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from gezel_trio.engine.gguf_meta import (
    GGUFError,
    GGUFInfo,
    kv_bytes_per_token,
    read_gguf_info,
    recurrent_state_bytes_per_seq,
)
from gezel_trio.engine.planner import plan_engine
from gezel_trio.errors import ConfigError

MIB = 1024**2
GIB = 1024**3

# --- GGUF fixtures ----------------------------------------------------------------------


def write_tiny_llama(path: Path, *, head_count_kv: int | list[int] = 2) -> Path:
    """2 blocks, n_embd 64, 4 heads of 16, 2 KV heads, n_ff 128, vocab 256, ctx 2048 (f32)."""
    n_embd, n_ff, vocab, n_head = 64, 128, 256, 4
    n_kv = head_count_kv if isinstance(head_count_kv, int) else max(head_count_kv)
    head_dim = n_embd // n_head
    rng = np.random.default_rng(0)

    def t(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny-test")
    w.add_block_count(2)
    w.add_context_length(2048)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(head_count_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tensor("token_embd.weight", t(vocab, n_embd))
    for i in range(2):
        w.add_tensor(f"blk.{i}.attn_norm.weight", t(n_embd))
        w.add_tensor(f"blk.{i}.attn_q.weight", t(n_embd, n_embd))
        w.add_tensor(f"blk.{i}.attn_k.weight", t(n_kv * head_dim, n_embd))
        w.add_tensor(f"blk.{i}.attn_v.weight", t(n_kv * head_dim, n_embd))
        w.add_tensor(f"blk.{i}.attn_output.weight", t(n_embd, n_embd))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", t(n_embd))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", t(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_up.weight", t(n_ff, n_embd))
        w.add_tensor(f"blk.{i}.ffn_down.weight", t(n_embd, n_ff))
    w.add_tensor("output_norm.weight", t(n_embd))
    w.add_tensor("output.weight", t(vocab, n_embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_recurrent(path: Path, *, hybrid: bool) -> Path:
    """A mamba-style model (hybrid: block 1 is an attention block with 2 KV heads of 16)."""
    arch = "granitehybrid" if hybrid else "mamba"
    n_embd = 64
    w = GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_head_count(4 if hybrid else 0)
    w.add_head_count_kv([0, 2] if hybrid else 0)
    w.add_ssm_conv_kernel(4)
    w.add_ssm_inner_size(128)
    w.add_ssm_state_size(16)
    w.add_ssm_group_count(1 if hybrid else 0)
    z = np.zeros
    w.add_tensor("token_embd.weight", z((256, n_embd), dtype=np.float32))
    w.add_tensor("blk.0.attn_norm.weight", z(n_embd, dtype=np.float32))
    w.add_tensor("blk.0.ssm_in.weight", z((256, n_embd), dtype=np.float32))
    w.add_tensor("blk.0.ssm_conv1d.weight", z((128, 4), dtype=np.float32))
    w.add_tensor("blk.0.ssm_out.weight", z((n_embd, 128), dtype=np.float32))
    w.add_tensor("blk.1.attn_norm.weight", z(n_embd, dtype=np.float32))
    if hybrid:
        w.add_tensor("blk.1.attn_q.weight", z((n_embd, n_embd), dtype=np.float32))
        w.add_tensor("blk.1.attn_k.weight", z((32, n_embd), dtype=np.float32))
        w.add_tensor("blk.1.attn_v.weight", z((32, n_embd), dtype=np.float32))
    else:
        w.add_tensor("blk.1.ssm_in.weight", z((256, n_embd), dtype=np.float32))
    w.add_tensor("output_norm.weight", z(n_embd, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Hand-computed sizes of the tiny llama (f32, 4 bytes per value):
EMBD = 256 * 64 * 4  # 65,536
LAYER = (64 * 64 + 32 * 64 + 32 * 64 + 64 * 64 + 3 * 128 * 64 + 2 * 64) * 4  # 147,968
OUTPUT = (64 + 256 * 64) * 4  # 65,792
TOTAL = EMBD + 2 * LAYER + OUTPUT  # 427,264


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


# --- reading ----------------------------------------------------------------------------


def test_read_tiny_llama(tiny: Path) -> None:
    info = read_gguf_info(tiny)
    assert tiny.stat().st_size < 1024 * 1024
    assert (info.architecture, info.name) == ("llama", "tiny-test")
    assert (info.block_count, info.embedding_length, info.head_count) == (2, 64, 4)
    assert info.head_count_kv == (2, 2)
    assert (info.context_length, info.feed_forward_length, info.vocab_size) == (2048, 128, 256)
    assert (info.key_length, info.value_length, info.head_dim_k, info.head_dim_v) == (
        None,
        None,
        16,
        16,
    )
    assert (LAYER, TOTAL) == (147_968, 427_264)
    assert info.tensor_bytes == TOTAL
    assert info.layer_tensor_bytes == (LAYER, LAYER)
    assert (info.embedding_bytes, info.output_bytes, info.other_bytes) == (EMBD, OUTPUT, 0)
    assert not info.tied_embeddings
    assert info.file_size == tiny.stat().st_size > TOTAL
    assert info.attention_layers == (True, True) and not info.recurrent
    assert info.recurrent_layers == (False, False)


def test_kv_bytes_per_token(tiny: Path) -> None:
    info = read_gguf_info(tiny)
    # 2 (K, V) * 2 layers * 2 KV heads * 16 head dim * 2 bytes (f16) = 256
    assert kv_bytes_per_token(info) == 256
    assert kv_bytes_per_token(info, "f32") == 512
    # q8_0: a row of 32 values is one 34-byte block: (34 + 34) * 2 layers = 136
    assert kv_bytes_per_token(info, "q8_0") == 136
    with pytest.raises(ConfigError, match="unknown KV cache type 'q3'"):
        kv_bytes_per_token(info, "q3")


def test_head_count_kv_array(tmp_path: Path) -> None:
    info = read_gguf_info(write_tiny_llama(tmp_path / "arr.gguf", head_count_kv=[2, 1]))
    assert info.head_count_kv == (2, 1)
    # Layer 0: 2 heads * 16 * 2 B * (K + V) = 128; layer 1: 64.
    assert kv_bytes_per_token(info) == 192


def test_pure_recurrent_model(tmp_path: Path) -> None:
    info = read_gguf_info(write_tiny_recurrent(tmp_path / "mamba.gguf", hybrid=False))
    assert info.recurrent and info.architecture == "mamba"
    assert "ssm_" in info.recurrent_markers and "mamba.ssm." in info.recurrent_markers
    assert info.attention_layers == (False, False) and info.recurrent_layers == (True, True)
    assert kv_bytes_per_token(info) == 0
    # Mamba state in f32: conv (4 - 1) * (128 + 2 * 0 * 16) + ssm 16 * 128 = 2432 values.
    assert info.recurrent_state_bytes_per_layer == 2432 * 4
    assert recurrent_state_bytes_per_seq(info) == 2 * 2432 * 4


def test_hybrid_model_counts_only_attention_layers(tmp_path: Path) -> None:
    info = read_gguf_info(write_tiny_recurrent(tmp_path / "hybrid.gguf", hybrid=True))
    assert info.recurrent
    assert info.attention_layers == (False, True) and info.recurrent_layers == (True, False)
    assert info.head_count_kv == (0, 2)
    # One attention layer: 2 * 2 heads * 16 * 2 B = 128.
    assert kv_bytes_per_token(info) == 128
    # conv (4 - 1) * (128 + 2 * 1 * 16) + 16 * 128 = 480 + 2048 = 2528 values, one layer.
    assert recurrent_state_bytes_per_seq(info) == 2528 * 4
    assert info.tied_embeddings  # no output.weight


def test_bad_files_raise_a_clear_project_error(tmp_path: Path, tiny: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("this is not a model, just some text that is long enough\n" * 4)
    with pytest.raises(GGUFError, match=r"notes\.txt.*not a readable GGUF") as err:
        read_gguf_info(text)
    assert err.value.status == 400 and isinstance(err.value, ConfigError)
    truncated = tmp_path / "cut.gguf"
    data = tiny.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(GGUFError, match=r"cut\.gguf.*(truncated|not a readable GGUF)"):
        read_gguf_info(truncated)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(data[:100])
    with pytest.raises(GGUFError, match=r"header\.gguf"):
        read_gguf_info(header_only)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFError, match="too short"):
        read_gguf_info(empty)
    with pytest.raises(GGUFError, match="cannot be read"):
        read_gguf_info(tmp_path / "missing.gguf")


# --- planning against hand-computed numbers -------------------------------------------


def synthetic(**over: object) -> GGUFInfo:
    """4 blocks of 100 MiB, 8 heads, 2 KV heads of 128, vocab 32000, n_ff 4096."""
    fields: dict[str, object] = dict(
        path="synthetic",
        architecture="llama",
        name=None,
        file_size=520 * MIB,
        block_count=4,
        embedding_length=1024,
        head_count=8,
        head_count_kv=(2, 2, 2, 2),
        context_length=8192,
        key_length=128,
        value_length=128,
        feed_forward_length=4096,
        vocab_size=32000,
        tensor_bytes=510 * MIB,
        layer_tensor_bytes=(100 * MIB,) * 4,
        embedding_bytes=50 * MIB,
        output_bytes=60 * MIB,
        other_bytes=0,
        tied_embeddings=False,
        attention_layers=(True,) * 4,
        recurrent_layers=(False,) * 4,
        recurrent=False,
    )
    fields.update(over)
    return GGUFInfo(**fields)  # type: ignore[arg-type]


# Per token, per layer: 2 KV heads * 128 * 2 B * (K + V) = 1024; 4 layers = 4096.
# Compute buffer: 4 * 512 * (32000 + 4 * 4096) = 99,090,432.
COMPUTE = 99_090_432
CPU_OVERHEAD = 64 * MIB + COMPUTE  # 166,199,296
GPU_OVERHEAD = 384 * MIB + COMPUTE  # 501,743,616


def test_synthetic_kv_per_token() -> None:
    assert kv_bytes_per_token(synthetic()) == 4096


def test_cpu_plan_as_requested() -> None:
    plan = plan_engine(
        synthetic(),
        budget_bytes=GIB,
        requested_ctx_per_slot=4096,
        requested_parallel=2,
        gpu=False,
    )
    assert plan.fits and plan.device == "cpu"
    assert (plan.ctx_per_slot, plan.parallel, plan.n_gpu_layers) == (4096, 2, 0)
    assert plan.weight_bytes == 534_773_760  # 510 MiB
    assert plan.kv_bytes == 33_554_432  # 4096 B * 8192 tokens
    assert plan.overhead_bytes == 166_199_296
    assert plan.total_bytes == 734_527_488
    assert plan.ctx_total == 8192
    assert plan.argv() == ["--ctx-size", "8192", "--parallel", "2", "--n-gpu-layers", "0"]
    assert plan.reasons[0].startswith("as requested: 2 x 4096 tokens needs 700.5 MiB")


def test_cpu_plan_shrinks_context_in_256_token_steps() -> None:
    # Room for exactly 1500 tokens per slot (x 2 slots x 4096 B): rounded down to 1280.
    budget = 534_773_760 + 166_199_296 + 2 * 4096 * 1500  # 713,261,056
    plan = plan_engine(
        synthetic(),
        budget_bytes=budget,
        requested_ctx_per_slot=4096,
        requested_parallel=2,
        gpu=False,
    )
    assert plan.fits and (plan.ctx_per_slot, plan.parallel) == (1280, 2)
    assert plan.total_bytes == 534_773_760 + 166_199_296 + 2 * 4096 * 1280
    assert "context per slot shrunk from 4096 to 1280 tokens" in plan.reasons[0]
    # Exactly on a step boundary just below the request: 3840 fits to the byte.
    exact = 534_773_760 + 166_199_296 + 2 * 4096 * 3840
    at = plan_engine(
        synthetic(),
        budget_bytes=exact,
        requested_ctx_per_slot=4096,
        requested_parallel=2,
        gpu=False,
    )
    assert at.ctx_per_slot == 3840 and at.total_bytes == exact
    below = plan_engine(
        synthetic(),
        budget_bytes=exact - 1,
        requested_ctx_per_slot=4096,
        requested_parallel=2,
        gpu=False,
    )
    assert below.ctx_per_slot == 3584


def test_cpu_plan_subtracts_what_others_reserved_and_reports_no_fit() -> None:
    plan = plan_engine(
        synthetic(),
        budget_bytes=GIB,
        already_reserved_bytes=512 * MIB,
        requested_ctx_per_slot=4096,
        requested_parallel=1,
        gpu=False,
    )
    # 512 MiB available < 510 MiB weights + 158.5 MiB overhead: nothing fits.
    assert not plan.fits
    assert (plan.ctx_per_slot, plan.n_gpu_layers, plan.available_bytes) == (512, 0, 512 * MIB)
    assert plan.total_bytes == 534_773_760 + 166_199_296 + 4096 * 512
    assert "does not fit" in plan.reasons[-1]
    assert "minus 512.0 MiB reserved by other engines" in plan.reasons[-1]


def test_gpu_plan_offloads_everything_when_it_fits() -> None:
    plan = plan_engine(
        synthetic(),
        budget_bytes=2 * GIB,
        requested_ctx_per_slot=8192,
        requested_parallel=1,
        gpu=True,
    )
    assert plan.fits and plan.device == "gpu"
    assert (plan.n_gpu_layers, plan.ctx_per_slot) == (5, 8192)  # 4 blocks + output
    assert plan.weight_bytes == 4 * 100 * MIB + 60 * MIB  # 482,344,960; embedding stays home
    assert plan.kv_bytes == 4096 * 8192
    assert plan.overhead_bytes == GPU_OVERHEAD
    assert plan.host_bytes == 50 * MIB
    assert "all 4 layers and the output offloaded" in plan.reasons[0]


def test_gpu_plan_reduces_offload_when_the_floor_does_not_fit() -> None:
    # -ngl 4 (3 blocks + output) at 512 tokens: 60 + 300 MiB + overhead + 3 * 1024 * 512
    #   = 377,487,360 + 501,743,616 + 1,572,864 = 880,803,840 > 880,000,000.
    # -ngl 3 (2 blocks + output): 272,629,760 + 501,743,616 = 774,373,376 + 2048 B/token,
    #   room for 51,575 tokens, so the full 8192 comes back.
    plan = plan_engine(
        synthetic(),
        budget_bytes=880_000_000,
        requested_ctx_per_slot=8192,
        requested_parallel=1,
        gpu=True,
    )
    assert plan.fits
    assert (plan.n_gpu_layers, plan.ctx_per_slot) == (3, 8192)
    assert plan.weight_bytes == 272_629_760
    assert plan.kv_bytes == 2048 * 8192
    assert plan.total_bytes == 791_150_592
    # Host: embedding + 2 blocks, and the KV of the 2 blocks left on the CPU.
    assert plan.host_bytes == 50 * MIB + 200 * MIB + 2048 * 8192
    assert "offload reduced to 3 (-ngl)" in " ".join(plan.reasons)
    assert plan.argv()[-2:] == ["--n-gpu-layers", "3"]


def test_gpu_plan_that_cannot_fit_at_all() -> None:
    plan = plan_engine(
        synthetic(),
        budget_bytes=500_000_000,  # below the overhead alone
        requested_ctx_per_slot=8192,
        requested_parallel=4,
        gpu=True,
    )
    assert not plan.fits
    assert (plan.n_gpu_layers, plan.ctx_per_slot, plan.parallel) == (0, 512, 4)
    assert plan.total_bytes == GPU_OVERHEAD
    assert "does not fit" in plan.reasons[-1]


def test_context_above_training_is_planned_with_its_flags_and_ngl_clamped() -> None:
    plan = plan_engine(
        synthetic(),
        budget_bytes=4 * GIB,
        requested_ctx_per_slot=16384,
        requested_parallel=1,
        gpu=True,
        n_gpu_layers=999,
    )
    assert (plan.ctx_per_slot, plan.n_gpu_layers) == (16384, 5)
    assert plan.kv_bytes == 4096 * 16384
    assert plan.context_flags == (
        "--override-kv",
        "llama.context_length=int:16384",
        "--rope-scaling",
        "yarn",
        "--rope-scale",
        "2",
        "--yarn-orig-ctx",
        "8192",
    )
    assert plan.argv()[-8:] == list(plan.context_flags)
    assert "above the model's trained context 8192" in plan.reasons[0]
    partial = plan_engine(
        synthetic(), budget_bytes=4 * GIB, requested_ctx_per_slot=1024, gpu=True, n_gpu_layers=2
    )
    # -ngl 2: the last block and the output layer.
    assert partial.weight_bytes == 100 * MIB + 60 * MIB
    assert partial.kv_bytes == 1024 * 1024


def test_flash_attention_off_adds_the_kq_buffer() -> None:
    on = plan_engine(synthetic(), budget_bytes=4 * GIB, requested_ctx_per_slot=1024, gpu=False)
    off = plan_engine(
        synthetic(),
        budget_bytes=4 * GIB,
        requested_ctx_per_slot=1024,
        gpu=False,
        flash_attn=False,
    )
    # 4 B * 512 ubatch * 1024 ctx * 8 heads
    assert off.overhead_bytes - on.overhead_bytes == 16 * MIB


def test_quantized_cache_and_recurrent_state() -> None:
    q = plan_engine(
        synthetic(),
        budget_bytes=4 * GIB,
        requested_ctx_per_slot=1024,
        gpu=False,
        cache_type="q8_0",
    )
    # 2 * 4 layers * (256 values -> 8 blocks * 34 B) = 2176 B per token.
    assert q.kv_bytes == 2176 * 1024
    assert q.argv()[-4:] == ["--cache-type-k", "q8_0", "--cache-type-v", "q8_0"]
    hybrid = synthetic(
        attention_layers=(False, True, False, True),
        recurrent_layers=(True, False, True, False),
        head_count_kv=(0, 2, 0, 2),
        recurrent=True,
        recurrent_markers=("ssm_",),
        recurrent_state_bytes_per_layer=1000,
    )
    h = plan_engine(
        hybrid, budget_bytes=4 * GIB, requested_ctx_per_slot=1024, requested_parallel=3, gpu=False
    )
    # 2 attention layers * 1024 B * 3072 tokens + 2 recurrent layers * 1000 B * 3 sequences
    assert h.kv_bytes == 2 * 1024 * 3072 + 2 * 1000 * 3
    assert h.recurrent and any("recurrent state" in r for r in h.reasons)


def test_plan_for_the_real_tiny_file(tiny: Path) -> None:
    info = read_gguf_info(tiny)
    plan = plan_engine(
        info, budget_bytes=GIB, requested_ctx_per_slot=1024, requested_parallel=2, gpu=False
    )
    # weights 427,264 + KV 256 B * 2048 + overhead 64 MiB + 4 * 512 * (256 + 4 * 128)
    assert plan.weight_bytes == 427_264
    assert plan.kv_bytes == 524_288
    assert plan.overhead_bytes == 67_108_864 + 1_572_864
    assert plan.total_bytes == 69_633_280
    assert plan.fits
    d = plan.as_dict()
    assert d["ctx_total"] == 2048 and d["reasons"] == plan.reasons


def test_invalid_requests() -> None:
    with pytest.raises(ValueError):
        plan_engine(synthetic(), budget_bytes=GIB, requested_parallel=0, gpu=False)
    with pytest.raises(ValueError):
        plan_engine(synthetic(), budget_bytes=GIB, requested_ctx_per_slot=0, gpu=False)
    with pytest.raises(ConfigError):
        plan_engine(synthetic(), budget_bytes=GIB, gpu=False, cache_type="q2_k")


def test_plans_for_the_demo_models_match_hand_arithmetic(tmp_path: Path) -> None:
    """The generated demo models: weights are the file's tensor bytes, and the KV cache is
    2 (K and V) x layers x kv heads x head dim x 2 bytes (f16) per token and slot."""
    from gezel_trio.engine.demo_model import write_demo_model

    for size in ("tiny", "small"):
        path = write_demo_model(tmp_path / f"{size}.gguf", size=size)
        info = read_gguf_info(path)
        head_dim = info.embedding_length // info.head_count
        n_kv = info.head_count_kv[0]
        per_token = 2 * info.block_count * n_kv * head_dim * 2
        assert kv_bytes_per_token(info) == per_token
        plan = plan_engine(
            info,
            budget_bytes=8 * 1024**3,
            requested_ctx_per_slot=1024,
            requested_parallel=2,
            gpu=False,
        )
        assert plan.fits and plan.parallel == 2 and plan.ctx_per_slot == 1024
        assert plan.n_gpu_layers == 0  # a CPU-only host plans against RAM
        assert plan.kv_bytes == per_token * 1024 * 2
        assert plan.weight_bytes == info.tensor_bytes
        assert plan.weight_bytes <= path.stat().st_size
