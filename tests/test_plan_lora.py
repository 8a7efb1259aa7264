"""The planner counts a pipeline's LoRAs where the engine holds them.

memory.lora registers each LoRA tensor as a buffer on its layer, so the tensors move with the
layer's block (block_swap) or leaf (sequential) and stay on the device under none / model. The
plan for a LoRA'd pipeline (pipelines/planning.py) must hold the same device bytes as the engine
does, measured with the DeviceLedger of tests/test_stages.py.
"""

from __future__ import annotations

import pytest

from test_lora import WAN_LAYERS, peft_keys, random_lora, write
from test_stages import engine_residency
from vidmem.memory import MemoryStrategy
from vidmem.memory.plan.planner import PlanOptions, VideoShape
from vidmem.memory.plan.schedule import SlotTable
from vidmem.pipelines.lora import load_lora, with_lora
from vidmem.pipelines.planning import plan_strategy
from vidmem.pipelines.tiny import tiny_spec

VARIANT = "wan2.1-t2v"
TIERS = {
    "none": dict(offload="none"),
    "block_swap:1:0": dict(offload="block_swap", blocks_to_swap=1, prefetch_blocks=0),
    "block_swap:all:1": dict(offload="block_swap", blocks_to_swap="all", prefetch_blocks=1),
    "sequential:1": dict(offload="sequential", prefetch_blocks=1),
}


@pytest.fixture(scope="module")
def lora_path(tmp_path_factory):
    return tmp_path_factory.mktemp("lora") / "every-block.safetensors"


def _with_a_lora(loaded, path):
    """A rank-16 LoRA on every block linear of the tiny Wan (the pipeline value is a copy)."""
    transformer = loaded.pipe.transformer
    blocks = {str(i) for i in range(len(transformer.blocks))}
    layers = [name for name in WAN_LAYERS if name.split(".")[1] in blocks]
    if not path.exists():
        write(path, peft_keys(random_lora(transformer, layers, rank=16), None))
    return with_lora(loaded, load_lora(path, loaded.pipe))


@pytest.mark.parametrize("tier", TIERS)
def test_planned_denoise_weights_equal_the_engines_residency_with_a_lora(tier, tiny_loaded, lora_path):
    loaded = _with_a_lora(tiny_loaded(VARIANT), lora_path)
    blocks = len(loaded.pipe.transformer.blocks)
    strategy = MemoryStrategy(**{k: blocks if v == "all" else v for k, v in TIERS[tier].items()})
    engine = engine_residency(loaded, VARIANT, strategy).peak["transformer"]
    spec = tiny_spec(VARIANT)
    plan = plan_strategy(loaded, VideoShape(spec.width, spec.height, spec.frames), strategy, None, None,
                         PlanOptions(steps=2), device="cuda")
    assert max(phase.weights_bytes for phase in plan.stage("denoise").phases) == engine


def test_a_resident_transformer_holds_every_lora_byte(tiny_loaded, lora_path):
    loaded = _with_a_lora(tiny_loaded(VARIANT), lora_path)
    spec, strategy = tiny_spec(VARIANT), MemoryStrategy(offload="none")

    def planned(pipeline) -> int:
        plan = plan_strategy(pipeline, VideoShape(spec.width, spec.height, spec.frames), strategy, None, None,
                             PlanOptions(steps=2), device="cuda")
        return max(phase.weights_bytes for phase in plan.stage("denoise").phases)

    assert planned(loaded) - planned(tiny_loaded(VARIANT)) == loaded.loras[0].nbytes > 0


def test_a_tensor_shared_by_two_layers_is_one_tensor_and_an_unknown_layer_is_named():
    table = SlotTable(sizes=(10, 20), modules=("a", "b"), slots=((0,), (1,)), leaf=(True, True), block=(0, 1),
                      block_count=2, workspace=(0, 0))
    grown = table.with_tensors({"a": [("down", 4), ("up", 3)], "b": [("down", 4)]})
    assert grown.sizes == (10, 20, 4, 3) and grown.slots == ((0, 2, 3), (1, 2))
    assert table.sizes == (10, 20)  # the table it grew from is unchanged
    with pytest.raises(ValueError, match="'c'"):
        table.with_tensors({"c": [("x", 1)]})


def test_the_runs_own_fit_checks_plan_with_the_loras(tiny_loaded, lora_path, monkeypatch):
    """activation_chunks=auto and the out-of-memory ladder's fit check plan the run as it holds its weights:
    with the LoRA tensors on their layers (they planned without them)."""
    from vidmem.memory.plan import candidates, stages
    from vidmem.pipelines import sample_chunks, sample_ladder
    from vidmem.pipelines.planning import WithLoras

    loaded = _with_a_lora(tiny_loaded(VARIANT), lora_path)
    spec, seen = tiny_spec(VARIANT), []
    real_stage, real_fewest = stages.denoise_stage, candidates.fewest_chunks
    monkeypatch.setattr(stages, "denoise_stage", lambda model, *a, **k: seen.append(model) or real_stage(model, *a, **k))
    monkeypatch.setattr(candidates, "fewest_chunks", lambda model, *a, **k: seen.append(model) or real_fewest(model, *a, **k))
    shape = VideoShape(spec.width, spec.height, spec.frames)
    sample_ladder.planner_fits(loaded, shape, 2, 2**40)(MemoryStrategy(offload="none"))
    from vidmem.pipelines.family import denoiser_blocks
    from vidmem.memory.accounting import Attention

    sample_chunks._auto_count(loaded, MemoryStrategy(offload="none", activation_chunks="auto"),
                              VideoShape(spec.width, spec.height, spec.frames, cfg=True), 2**40,
                              denoiser_blocks(loaded.pipe, loaded.spec), Attention.FUSED, {})
    assert len(seen) == 2 and all(isinstance(model, WithLoras) for model in seen)
