"""The context a slot gets by default, and read back from flags as the engine reads them:
policy without an engine (the engine's own truth is in ``test_context_integration``)."""

from __future__ import annotations

import pytest

from gezel_trio.config.schema import ModelConfig
from gezel_trio.engine.context import (
    SlotRequest,
    extension_flags,
    slot_context,
    slot_request,
    trained_context,
)
from gezel_trio.engine.gguf_meta import GGUFInfo
from gezel_trio.engine.planner import AUTO_PARALLEL, DEFAULT_CTX_PER_SLOT, engine_cost, plan_engine
from gezel_trio.host.runtime import ModelSetup

from .test_planner import GIB, synthetic

# --- the engine's rule, read from flags ------------------------------------------------


@pytest.mark.parametrize(
    ("args", "trained", "expected"),
    [
        (["-c", "2000", "-np", "2"], 8192, 1024),  # 2000 -> 2048 total, 1024 per slot
        (["-c", "65536", "-np", "2"], 8192, 8192),  # capped at the trained context
        (["-c", "0", "-np", "2"], 8192, 4096),  # 0: the trained context, shared
        (["-c", "16384", "-np", "2", "--kv-unified"], 8192, 8192),  # unified: whole, capped
        (["-c", "16384", "-np", "2", "-kvu", "-no-kvu"], 8192, 8192),
        (["--ctx-size", "8192", "--parallel", "2", "-c", "1024"], 8192, 512),  # last wins
        (
            ["-c", "32768", "-np", "2", "--override-kv", "llama.context_length=int:16384"],
            8192,
            16384,
        ),
        (["-c", "3000", "-np", "3"], None, 1024),  # 3072 / 3
        (["-np", "2"], None, None),  # nothing says
    ],
)
def test_slot_context_follows_the_engine_rules(
    args: list[str], trained: int | None, expected: int | None
) -> None:
    assert slot_context(args, n_ctx_train=trained) == expected


def test_trained_context_reads_the_last_override() -> None:
    args = [
        "--override-kv",
        "llama.context_length=int:9000",
        "--override-kv=x.context_length=int:7",
    ]
    assert trained_context(args, 8192) == 7
    assert trained_context(["--override-kv", "llama.vocab_size=int:3"], 8192) == 8192


def test_extension_flags_only_above_the_trained_context() -> None:
    assert extension_flags("llama", 8192, 8192) == []
    assert extension_flags("llama", None, 100_000) == []
    flags = extension_flags("qwen2", 32768, 131072)
    assert flags == [
        "--override-kv",
        "qwen2.context_length=int:131072",
        "--rope-scaling",
        "yarn",
        "--rope-scale",
        "4",
        "--yarn-orig-ctx",
        "32768",
    ]
    assert slot_context(["-c", str(2 * 131072), "-np", "2", *flags], n_ctx_train=32768) == 131072


# --- the planner's defaults --------------------------------------------------------------


def _cost(info: GGUFInfo, ctx: int, parallel: int) -> int:
    return engine_cost(
        info, ctx_per_slot=ctx, parallel=parallel, n_gpu_layers=0, gpu=False
    ).total_bytes


def test_default_is_the_trained_context_and_auto_slots() -> None:
    info = synthetic()  # trained on 8192
    plan = plan_engine(
        info, budget_bytes=4 * GIB, requested_ctx_per_slot=None, requested_parallel=None, gpu=False
    )
    assert plan.fits and (plan.parallel, plan.ctx_per_slot) == (AUTO_PARALLEL, 8192)
    assert plan.context_flags == ()


def test_auto_slots_give_way_before_the_context() -> None:
    info = synthetic()
    # Room for one whole slot of 8192, not two.
    budget = _cost(info, 8192, 1) + (_cost(info, 8192, 2) - _cost(info, 8192, 1)) // 2
    plan = plan_engine(
        info, budget_bytes=budget, requested_ctx_per_slot=None, requested_parallel=None, gpu=False
    )
    assert plan.fits and (plan.parallel, plan.ctx_per_slot) == (1, 8192)
    assert any("1 slot instead of 2" in r for r in plan.reasons)
    # A requested parallel is kept: the context shrinks instead.
    kept = plan_engine(
        info, budget_bytes=budget, requested_ctx_per_slot=None, requested_parallel=2, gpu=False
    )
    assert kept.parallel == 2 and kept.ctx_per_slot < 8192
    assert any("shrunk from 8192" in r for r in kept.reasons)


def test_when_one_whole_slot_does_not_fit_the_context_shrinks() -> None:
    info = synthetic()
    budget = _cost(info, 4096, 1)
    plan = plan_engine(
        info, budget_bytes=budget, requested_ctx_per_slot=None, requested_parallel=None, gpu=False
    )
    assert plan.fits and (plan.parallel, plan.ctx_per_slot) == (1, 4096)
    assert plan.total_bytes <= budget


def test_memory_still_rules_a_context_above_the_trained_one() -> None:
    info = synthetic()
    budget = _cost(info, 12288, 1)
    plan = plan_engine(
        info, budget_bytes=budget, requested_ctx_per_slot=32768, requested_parallel=1, gpu=False
    )
    assert plan.fits and plan.ctx_per_slot == 12288
    assert plan.context_flags == tuple(extension_flags("llama", 8192, 12288))


def test_a_model_that_says_no_context_gets_the_default() -> None:
    plan = plan_engine(
        synthetic(context_length=0), budget_bytes=4 * GIB, requested_ctx_per_slot=None, gpu=False
    )
    assert plan.ctx_per_slot == DEFAULT_CTX_PER_SLOT


# --- what a model's setup predicts before its engine runs -------------------------------


def test_setup_predicts_from_the_plan_extra_args_and_args() -> None:
    info = synthetic()
    setup = ModelSetup(config=ModelConfig(id="m", path="/m.gguf"), gguf=info)
    assert (setup.expected_parallel(), setup.expected_ctx_per_slot()) == (AUTO_PARALLEL, 8192)
    setup.replace_config(ModelConfig(id="m", path="/m.gguf", args=["-c", "2048"]), info)
    assert setup.expected_ctx_per_slot() == 1024  # 2048 over the 2 slots
    setup.replace_config(ModelConfig(id="m", path="/m.gguf", ctx_per_slot=32768), info)
    assert setup.expected_ctx_per_slot() == 32768  # run as asked, with its flags
    setup.extra_args = ("-np", "4")
    assert (setup.expected_parallel(), setup.expected_ctx_per_slot()) == (4, 16384)
    plan = plan_engine(info, budget_bytes=4 * GIB, requested_ctx_per_slot=1000, gpu=False)
    setup.planned = plan
    assert setup.expected_ctx_per_slot() == 256  # 1000 x 1 = 1024 total, / 4 slots
    setup.replace_config(ModelConfig(id="m", path="/m.gguf"), info)
    assert setup.planned is None  # a plan of other settings is forgotten


# --- a context the engine flags set ------------------------------------------------------


def _request(args: list[str], **config: int | None) -> SlotRequest:
    return slot_request(
        ctx_per_slot=config.get("ctx_per_slot"),
        parallel=config.get("parallel"),
        flags=args,
        n_ctx_train=8192,
        default_parallel=AUTO_PARALLEL,
    )


def test_flags_that_set_the_context_are_planned_as_the_engine_allocates() -> None:
    # No -c: the settings (a --parallel in the flags wins over parallel).
    assert _request([], ctx_per_slot=1024, parallel=4) == SlotRequest(1024, 4)
    assert _request(["-np", "3"], parallel=4) == SlotRequest(None, 3)
    # -c: each slot's KV holds the padded total over the slots, cap or not.
    assert _request(["-c", "65536", "-np", "2"], ctx_per_slot=512) == SlotRequest(32768, 2, True)
    assert _request(["-c", "2000"], parallel=2) == SlotRequest(1024, 2, True)
    assert _request(["-c", "3000"]) == SlotRequest(1536, AUTO_PARALLEL, True)
    assert _request(["-c", "0", "-np", "4"]) == SlotRequest(2048, 4, True)  # 0: the trained
    assert _request(["-c", "16384", "-np", "2", "-kvu"]) == SlotRequest(8192, 2, True)
    plan = plan_engine(
        synthetic(),
        budget_bytes=4 * GIB,
        requested_ctx_per_slot=32768,
        requested_parallel=2,
        fixed=True,
        gpu=False,
    )
    assert (plan.ctx_per_slot, plan.kv_bytes, plan.context_flags) == (32768, 4096 * 65536, ())
    assert any("caps a slot's context at the trained 8192" in r for r in plan.reasons)


def test_a_fixed_context_is_not_shrunk_to_fit() -> None:
    info = synthetic()
    budget = _cost(info, 4096, 2)
    plan = plan_engine(
        info,
        budget_bytes=budget,
        requested_ctx_per_slot=8192,
        requested_parallel=2,
        fixed=True,
        gpu=False,
    )
    assert not plan.fits and plan.ctx_per_slot == 8192  # the engine would allocate it anyway
    assert "does not fit" in plan.reasons[-1]
