"""The training planner's activation offload against what the run does (issue 28).

1. The pinned ceiling: `split_at_ceiling` is the pool's own rule, so the inputs the plan keeps on
   the device are the ones the run keeps there (a real run under a ceiling, on tiny models).
2. What moves: the planner traces the inputs `ActivationOffload.saving` moves, the first block's
   shared inputs included, and its bytes per step equal the bytes the run moved per step.
3. activation_offload off / on / auto: True/False still mean on/off (saved workflows), auto turns
   it on only where the step fits with it and not without, and says why.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from test_train_support import prepared_per_variant
from vidmem.memory import MemoryStrategy
from vidmem.memory.activation_offload import (ActivationOffload, ActivationPool, InlineCopies, OffloadMode,
                                              host_buffer_bytes, offload_mode, split_at_ceiling)
from vidmem.memory.device import CpuBackend
from vidmem.memory.plan.train_plan import TrainRequest
from vidmem.memory.residency import Slot
from vidmem.training import TrainOutputs, TrainSettings, train_lora
from vidmem.training import loop as loop_module
from vidmem.training.errors import TrainingError
from vidmem.training.plan import UNPINNED, resolve_activation_offload

STEPS = 2
ROOMY = 1 << 50  # budgets nothing tiny comes near


@pytest.fixture(scope="module")
def prepared(tiny_loaded, tmp_path_factory):
    return prepared_per_variant(tiny_loaded, tmp_path_factory.mktemp("offload-plan"), clips=2)


def settings(offload) -> TrainSettings:
    return TrainSettings(rank=4, alpha=4.0, learning_rate=1e-2, steps=STEPS, batch_size=1, seed=3,
                         activation_offload=offload)


def plan_for(loaded, data, strategy, offload="on", ceiling=UNPINNED, vram=ROOMY):
    """The plan of `strategy` for the run's settings; `ceiling`: the pinned ceiling the run will have."""
    pinned = ceiling != UNPINNED
    if pinned:
        strategy = replace(strategy, max_pinned_ram_gb=ceiling / (1 << 30))
    return resolve_activation_offload(loaded, data, settings(offload), strategy, vram, ROOMY, can_pin=pinned).plan


def run(loaded, data, strategy, tmp_path, name, monkeypatch, ceiling=None):
    """A CPU run with activation offload on; `ceiling`: the pinned ceiling the run's pool gets (a CPU
    backend pins nothing, so it has none of its own: the test hands it the planned one)."""
    if ceiling is not None:
        monkeypatch.setattr(loop_module, "_activation_cap", lambda ceiling_read, pool: ceiling)
    outputs = TrainOutputs(tmp_path / "loras" / f"{name}.safetensors", tmp_path / "checkpoints" / name)
    result = train_lora(loaded, data, strategy, settings("on"), outputs, CpuBackend())
    return result.receipt["activation_offload"]


# --- 1. the pinned ceiling: one rule -------------------------------------------------------------

def test_split_at_ceiling_answers_as_the_pool_takes():
    sizes = [3000, 100, 100, 5000, 100, 3000, 3000]
    for cap in (0, 4096, 4096 + 256, 16384, 1 << 20):
        pool = ActivationPool(lambda n: torch.empty(n, dtype=torch.uint8), cap)
        taken = [pool.take(n) is not None for n in sizes]
        split = split_at_ceiling(sizes, cap)
        assert split.kept_inputs == taken.count(False), cap
        assert split.moved_bytes == sum(n for n, ok in zip(sizes, taken) if ok)
        assert split.kept_bytes == sum(n for n, ok in zip(sizes, taken) if not ok)
        assert split.host_bytes == pool.pinned_bytes <= cap


def test_an_engine_run_keeps_what_the_split_keeps():
    from test_training_offload import _run_chain

    inputs = [3 * 8 * 4] * 5  # four carried inputs, and the shared one with the first block
    cap = 3 * host_buffer_bytes(inputs[0])
    pool = ActivationPool(lambda n: torch.empty(n, dtype=torch.uint8), cap)
    offload = ActivationOffload(InlineCopies(torch.device("cpu")), pool)
    _run_chain(offload)
    split = split_at_ceiling(inputs, cap)
    assert (offload.over_cap, offload.offloaded_bytes) == (split.kept_inputs, split.moved_bytes) == (2, 3 * inputs[0])
    offload.close()


# --- 2. plan and run move the same bytes ---------------------------------------------------------

@pytest.mark.parametrize("variant", ["wan2.1-t2v", "cogvideox-t2v"])
def test_planned_offloaded_bytes_are_what_the_run_moved(tiny_loaded, prepared, tmp_path, variant, monkeypatch):
    loaded, data = tiny_loaded(variant), prepared(variant)
    for strategy in (MemoryStrategy(offload="none"), MemoryStrategy(offload="block_swap", blocks_to_swap=1)):
        plan = plan_for(loaded, data, strategy)
        stats = run(loaded, data, strategy, tmp_path, f"{variant}-{strategy.offload.value}", monkeypatch)
        # tiny CogVideoX has one block: the resident tier keeps it unwrapped, so nothing moves there
        assert plan.activation_offload and (plan.activation_moved_bytes > 0 or not strategy.streams_blocks)
        assert stats["offloaded_bytes"] == STEPS * plan.activation_moved_bytes, (variant, strategy.offload.value)
        assert stats["over_cap"] == plan.activation_kept_inputs == 0


def test_the_first_block_moves_the_inputs_later_blocks_share(tiny_loaded, prepared):
    """Wan hands every block the same text embedding and timestep projection: the first block moves
    them (it has no previous block to share with), the later ones only their hidden state."""
    from vidmem.memory.plan.train import trace_offloaded_step
    from vidmem.pipelines.planning import planner_model
    from vidmem.training.plan import planned_shape
    from vidmem.memory.plan.types import Call
    from vidmem.pipelines.configs import workloads

    loaded, data = tiny_loaded("wan2.1-t2v"), prepared("wan2.1-t2v")
    model = planner_model(loaded)
    module = model.traced_module("transformer")
    blocks = getattr(module, model.spec.blocks_attr)
    call = workloads.workload_for(model, Call("denoise", "transformer", planned_shape(data, settings("on"))))
    before = {name: (m.gradient_checkpointing, dict(m.__dict__).get("_gradient_checkpointing_func", "absent"))
              for name, m in module.named_modules() if hasattr(m, "gradient_checkpointing")}
    _, (first, later) = trace_offloaded_step(module, blocks, call, 4, ("to_q", "to_v"))
    assert len(first) == 3 and len(later) == 1  # hidden, text, timestep projection; then hidden only
    assert later[0] == first[0]
    # the switch puts the module back as it was: diffusers sets the function to None on the instance
    assert before == {name: (m.gradient_checkpointing, dict(m.__dict__).get("_gradient_checkpointing_func", "absent"))
                      for name, m in module.named_modules() if hasattr(m, "gradient_checkpointing")}
    assert before[""] == (False, None)


# --- 1 again: plan and run under the same ceiling ------------------------------------------------

def test_inputs_past_the_ceiling_stay_on_the_device_in_plan_and_run(tiny_loaded, prepared, tmp_path, monkeypatch):
    loaded, data = tiny_loaded("wan2.1-t2v"), prepared("wan2.1-t2v")
    strategy = MemoryStrategy(offload="none")
    free = plan_for(loaded, data, strategy)
    hidden = free.activation_moved_bytes  # tiny Wan has 2 blocks: the resident tier moves the first block's 3
    ceiling = host_buffer_bytes(hidden)  # room for one buffer of the largest size only
    tight = plan_for(loaded, data, strategy, ceiling=ceiling)
    assert tight.activation_kept_inputs > 0 and tight.activation_ceiling_bytes == ceiling
    assert tight.peak_vram_bytes - free.peak_vram_bytes == tight.activation_kept_bytes > 0
    assert tight.activation_moved_bytes + tight.activation_kept_bytes == free.activation_moved_bytes
    stats = run(loaded, data, strategy, tmp_path, "ceiling", monkeypatch, ceiling=tight.activation_ceiling_bytes)
    assert stats["over_cap"] == STEPS * tight.activation_kept_inputs
    assert stats["offloaded_bytes"] == STEPS * tight.activation_moved_bytes
    assert stats["host_buffer_bytes"] == tight.activation_host_bytes


def plan_json(capsys, *extra: str, vram: str = "24") -> dict:
    from vidmem.cli import main

    main(["plan", "--model", "cogvideox-2b", "--size", "720x480", "--frames", "49", "--vram", vram,
          "--ram", "64", "--train", "--rank", "64", "--json", *extra])
    return json.loads(capsys.readouterr().out)


def test_cli_plans_the_pinned_ceiling_and_names_max_pinned_ram_gb(capsys):
    roomy = plan_json(capsys, "--activation-offload", "--max-pinned-ram-gb", "64")
    tight = plan_json(capsys, "--activation-offload", "--max-pinned-ram-gb", "0.5")
    none_roomy, none_tight = roomy["strategies"][0], tight["strategies"][0]
    assert none_roomy["activation_kept_inputs"] == 0 and none_tight["activation_kept_inputs"] > 0
    assert none_tight["peak_vram_bytes"] - none_roomy["peak_vram_bytes"] == none_tight["activation_kept_bytes"]
    assert none_tight["activation_host_bytes"] <= 0.5 * (1 << 30) < none_roomy["activation_host_bytes"]
    # block swap's streamed weights take their pinned homes first: nothing is left for the inputs
    swapped = plan_json(capsys, "--activation-offload", "--max-pinned-ram-gb", "2", "--prefetch", "1")["strategies"]
    sequential = swapped[3]
    assert sequential["activation_ceiling_bytes"] == 0 and sequential["activation_host_bytes"] == 0
    assert "max_pinned_ram_gb" in tight["advice"] and "stay on the GPU" in tight["advice"]
    assert "max_pinned_ram_gb" not in roomy["advice"]


def test_cli_refuses_a_negative_ceiling(capsys):
    from vidmem.cli import main

    assert main(["plan", "--model", "cogvideox-2b", "--vram", "24", "--ram", "64", "--train",
                 "--max-pinned-ram-gb", "-1"]) == 2
    assert "--max-pinned-ram-gb" in capsys.readouterr().err


# --- 3. off / on / auto -------------------------------------------------------------------------

@pytest.mark.parametrize("value, mode", [(True, "on"), (False, "off"), ("on", "on"), ("off", "off"), ("auto", "auto"),
                                         (OffloadMode.AUTO, "auto")])
def test_booleans_of_saved_workflows_still_mean_on_and_off(value, mode):
    assert offload_mode(value) is OffloadMode(mode)
    assert TrainSettings(activation_offload=value).activation_offload is OffloadMode(mode)
    assert TrainRequest(activation_offload=value).activation_offload is OffloadMode(mode)


def test_a_bad_mode_is_refused_by_name():
    with pytest.raises(TrainingError, match="activation_offload='sometimes' is not one of off, on, auto"):
        TrainSettings(activation_offload="sometimes")
    with pytest.raises(ValueError, match="--activation-offload"):
        TrainRequest(activation_offload=2)
    # auto without checkpointing is allowed (it stays off); on is not
    assert TrainSettings(activation_offload="auto", gradient_checkpointing=False).activation_offload is OffloadMode.AUTO
    with pytest.raises(TrainingError, match="needs gradient_checkpointing"):
        TrainSettings(activation_offload="on", gradient_checkpointing=False)


def test_auto_turns_offload_on_only_where_it_makes_the_step_fit(capsys):
    plain = plan_json(capsys)["strategies"][0]["peak_vram_bytes"]
    moved = plan_json(capsys, "--activation-offload")["strategies"][0]["peak_vram_bytes"]
    assert moved < plain
    between = f"{(plain + moved) / 2 / (1 << 30):.3f}"
    tight = plan_json(capsys, "--activation-offload", "auto", vram=between)
    assert tight["request"]["activation_offload"] == "auto"
    none = tight["strategies"][0]
    assert none["activation_offload"] and none["fits"] and none["activation_offload_reason"].startswith("auto: on")
    assert tight["recommended"] == 0
    roomy = plan_json(capsys, "--activation-offload", "auto")["strategies"][0]
    assert not roomy["activation_offload"] and roomy["fits"]
    assert roomy["activation_offload_reason"] == "auto: off (the step fits without it)"
    hopeless = plan_json(capsys, "--activation-offload", "auto", vram="1")["strategies"][0]
    assert not hopeless["activation_offload"] and not hopeless["fits"]
    assert "does not fit with it either" in hopeless["activation_offload_reason"]


def test_auto_on_a_hand_chosen_tier_is_resolved_before_the_run(tiny_loaded, prepared):
    loaded, data = tiny_loaded("wan2.1-t2v"), prepared("wan2.1-t2v")
    strategy = MemoryStrategy(offload="none")
    chosen = resolve_activation_offload(loaded, data, settings("auto"), strategy, ROOMY, ROOMY, can_pin=False)
    assert chosen.strategy == strategy and chosen.fixed
    assert chosen.settings(settings("auto")).activation_offload is OffloadMode.OFF  # fits without it
    assert "activation offload off (auto: off (the step fits without it))" in chosen.describe()
    hopeless = resolve_activation_offload(loaded, data, settings("auto"), strategy, 1, ROOMY, can_pin=False)
    assert hopeless.settings(settings("auto")).activation_offload is OffloadMode.OFF
    assert "does not fit with it either" in hopeless.receipt({})["activation_offload_reason"]


def test_an_unresolved_auto_is_refused_by_the_run_before_anything_moves(tiny_loaded, prepared, tmp_path):
    loaded, data = tiny_loaded("wan2.1-t2v"), prepared("wan2.1-t2v")
    outputs = TrainOutputs(tmp_path / "loras" / "auto.safetensors", tmp_path / "checkpoints" / "auto")
    with pytest.raises(TrainingError, match="resolve_activation_offload"):
        train_lora(loaded, data, MemoryStrategy(offload="none"), settings("auto"), outputs, CpuBackend())
    assert not outputs.lora_path.exists()


def test_train_node_takes_a_saved_boolean_and_auto(tiny_loaded, tmp_path, monkeypatch):
    from test_train_support import make_dataset
    from vidmem.nodes import host
    from vidmem.nodes.strategy import StrategyChoice
    from vidmem.nodes.train import VidMemPrepareTrainingData, VidMemTrainLoRA

    kind, options = VidMemTrainLoRA.INPUT_TYPES()["optional"]["activation_offload"]
    assert kind == ["off", "on", "auto"] and options["default"] == "off" and "max_pinned_ram_gb" in options["tooltip"]
    for value in (True, False, "auto", "on"):  # ComfyUI skips its list check: VALIDATE_INPUTS names the input
        assert VidMemTrainLoRA.VALIDATE_INPUTS(activation_offload=value) is True
    assert "not one of off, on, auto" in VidMemTrainLoRA.VALIDATE_INPUTS(activation_offload="sometimes")
    monkeypatch.setattr(host, "loras_folder", lambda: tmp_path / "models" / "loras")
    monkeypatch.setattr(host, "training_folder", lambda: tmp_path / "output" / "vidmem_training")
    loaded = tiny_loaded("wan2.1-t2v")
    strategy = StrategyChoice(MemoryStrategy(offload="none"), vram_budget_gb=1024.0, ram_budget_gb=1024.0)
    data = VidMemPrepareTrainingData().prepare(loaded, strategy, str(make_dataset(tmp_path / "clips", clips=1)),
                                               "32x32", "9")["result"][0]
    train = dict(lora_name="auto", rank=4, alpha=4.0, learning_rate=1e-3, steps=1, batch_size=1, seed=0,
                 target_modules="to_q,to_v", gradient_checkpointing=True, optimizer="adamw", checkpoint_every=0,
                 resume=False, expert="both")
    old = VidMemTrainLoRA().train(loaded, data, strategy, **train, activation_offload=True)  # a saved BOOLEAN
    assert old["ui"]["vidmem_receipt"][0]["activation_offload"]["offloaded_bytes"] > 0
    auto = VidMemTrainLoRA().train(loaded, data, strategy, **dict(train, lora_name="auto2"), activation_offload="auto")
    receipt = auto["ui"]["vidmem_receipt"][0]
    assert "activation_offload" not in receipt  # it fits without: auto left it off
    assert receipt["training_plan"]["activation_offload"] is False
    assert receipt["training_plan"]["activation_offload_reason"] == "auto: off (the step fits without it)"
    assert "activation offload off (auto: off (the step fits without it))" in auto["ui"]["text"][0]


def test_the_block_inputs_ceiling_is_less_what_the_pool_holds_once_the_tier_is_homed():
    """The run gives the block inputs the ceiling less every pinned byte its pipeline's pool holds once the
    tier's streamed weights have their homes (homes an earlier sampling or training call made are never
    freed), so the plan may not assume fewer; it pins new arenas only for streamed bytes without a home."""
    from vidmem.memory.hostpool import ARENA_BYTES
    from vidmem.memory.plan.train_plan import _activation_ceiling

    cap, streamed = 8 * ARENA_BYTES, 2 * ARENA_BYTES
    fresh = TrainRequest(rank=16, pinned_ceiling_bytes=cap)
    assert _activation_ceiling(fresh, 0, streamed) == cap - streamed  # this tier's homes come first
    # five arenas of homes: those of this tier's weights (after sequential sampling) are not pinned again ...
    after_sequential = TrainRequest(rank=16, pinned_ceiling_bytes=cap, pinned_already_bytes=5 * ARENA_BYTES)
    assert _activation_ceiling(after_sequential, 0, 0) == cap - 5 * ARENA_BYTES
    # ... those of tensors this tier keeps resident (another tier's, a text encoder's) stay beside its new ones
    assert _activation_ceiling(after_sequential, 0, streamed) == cap - 7 * ARENA_BYTES
    # new homes fill the room left in the newest arena before another is pinned
    roomy = replace(after_sequential, pinned_spare_bytes=ARENA_BYTES // 2)
    assert _activation_ceiling(roomy, 0, ARENA_BYTES // 2) == cap - 5 * ARENA_BYTES
    assert _activation_ceiling(roomy, 0, streamed) == cap - 7 * ARENA_BYTES
    # the pool pins no arena past the ceiling
    assert _activation_ceiling(after_sequential, 0, 10 * ARENA_BYTES) == 0
    full = TrainRequest(rank=16, pinned_ceiling_bytes=cap, pinned_already_bytes=cap + ARENA_BYTES)
    assert _activation_ceiling(full, 0, streamed) == 0


def test_a_request_names_a_bad_arena_size_and_homes_of_another_model():
    with pytest.raises(ValueError, match="pinned_arena_bytes 0"):
        TrainRequest(pinned_arena_bytes=0)
    from vidmem.memory.plan.train_plan import _homed_streamed

    request = TrainRequest(pinned_homed_block_bytes=[1, 2, 3], pinned_homed_leaf_bytes=7)
    assert request.pinned_homed_block_bytes == (1, 2, 3)  # a list is kept as a tuple: the request stays hashable
    assert _homed_streamed(request, MemoryStrategy(offload="block_swap", blocks_to_swap=2), 3) == 5  # the last two
    assert _homed_streamed(request, MemoryStrategy(offload="sequential"), 3) == 7
    assert _homed_streamed(request, MemoryStrategy(offload="model"), 3) == 0
    with pytest.raises(ValueError, match="3 entries for a denoiser of 2 blocks"):
        _homed_streamed(request, MemoryStrategy(offload="sequential"), 2)


class _PinningCpu(CpuBackend):
    """The CPU, pinning plain memory: the weights' homes are made as on a GPU, so the ceiling applies."""

    can_pin = True

    def pin_arena(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)


def test_the_run_reads_its_ceiling_before_the_weights_are_pinned(tiny_folder, prepared, tmp_path, monkeypatch):
    """Pinning the weights' homes can lower the free RAM the automatic ceiling is a share of. The plan
    reads the ceiling before they are pinned and subtracts the homes; the run must do the same, not
    read the lowered ceiling afterwards and subtract the homes a second time."""
    from vidmem.pipelines.loader import load_pipeline

    # a pipeline of its own: its weights move into the pool's arenas for good
    loaded, data = load_pipeline(tiny_folder("wan2.1-t2v"), "fp32"), prepared("wan2.1-t2v")
    pool = loaded.host_pool
    assert pool.pinned_bytes == 0
    free_before = 8 << 30
    # the automatic ceiling as RAM that pinning uses up would make it: each pinned byte is gone
    monkeypatch.setattr(loop_module, "pinned_cap_bytes", lambda gb, room: max(0, free_before - pool.pinned_bytes))
    caps = []
    real_cap = loop_module._activation_cap
    monkeypatch.setattr(loop_module, "_activation_cap", lambda ceiling, host_pool: caps.append(real_cap(ceiling, host_pool)) or caps[-1])
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=1)
    outputs = TrainOutputs(tmp_path / "loras" / "ceiling.safetensors", tmp_path / "checkpoints" / "ceiling")
    train_lora(loaded, data, strategy, settings("on"), outputs, _PinningCpu())
    homes = pool.pinned_bytes
    assert homes > 0  # the streamed block's weights were pinned
    assert caps == [free_before - homes]


SMALL_ARENA = 64 << 10  # bytes: a tiny Wan block (27 tensors, ~26 KiB) packs into one, a whole model into several


def _other_components_homes(pool, backend) -> None:
    """Homes of tensors the training tier does not stream (another component's weight, e.g. a text
    encoder's), filling the pool's newest arena to its end: the tier's own homes need a new one."""
    holder = torch.nn.Module()
    holder.register_buffer("weight", torch.ones(SMALL_ARENA, dtype=torch.uint8))
    assert holder.weight.data_ptr() % 64 == 0  # it starts an arena and fills it
    pool.adopt([[Slot(holder, "weight", False, holder.weight)]], backend, 1 << 30)
    assert pool.pinned_bytes == SMALL_ARENA and pool.spare_bytes == 0


def _sequential_sampling_homes(loaded, backend, ceiling_gb) -> None:
    """What sequential sampling leaves in the pool: a home for every leaf of the transformer."""
    from vidmem.memory import StageComponents, apply_strategy

    transformer = loaded.pipe.transformer
    stage = StageComponents({"transformer": transformer}, {"transformer": transformer.blocks})
    with apply_strategy(stage, MemoryStrategy(offload="sequential", max_pinned_ram_gb=ceiling_gb), backend,
                        host_pool=loaded.host_pool):
        pass


@pytest.mark.parametrize("homes", ["none", "another component's", "this tier's (sequential sampling)", "both"])
def test_the_planned_ceiling_is_what_the_run_gives_the_block_inputs(tiny_folder, prepared, tmp_path, monkeypatch, homes):
    """Issue 28: the plan's ceiling for the block inputs equals the cap the run gives them once the
    streamed weights have their homes, whatever homes the pipeline's pool held before. Homes of tensors
    the tier does not stream stay beside the tier's new ones (the plan once took only the larger of the
    two); homes the tier's tensors already have are not pinned twice."""
    from dataclasses import replace as renew

    from vidmem.memory.hostpool import HostPool
    from vidmem.pipelines.loader import load_pipeline

    # a pipeline of its own (its weights move into the pool's arenas for good), with small arenas so
    # tiny weights span several
    loaded = renew(load_pipeline(tiny_folder("wan2.1-t2v"), "fp32"), host_pool=HostPool(arena_bytes=SMALL_ARENA))
    data, backend, ceiling_gb = prepared("wan2.1-t2v"), _PinningCpu(), 1.0
    if homes in ("another component's", "both"):
        _other_components_homes(loaded.host_pool, backend)
    if homes in ("this tier's (sequential sampling)", "both"):
        _sequential_sampling_homes(loaded, backend, ceiling_gb)
    before = loaded.host_pool.pinned_bytes
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=1, max_pinned_ram_gb=ceiling_gb)
    plan = resolve_activation_offload(loaded, data, settings("on"), strategy, ROOMY, ROOMY, can_pin=True).plan
    caps = []
    real_cap = loop_module._activation_cap
    monkeypatch.setattr(loop_module, "_activation_cap", lambda ceiling, host_pool: caps.append(real_cap(ceiling, host_pool)) or caps[-1])
    outputs = TrainOutputs(tmp_path / "loras" / "homes.safetensors", tmp_path / "checkpoints" / "homes")
    train_lora(loaded, data, strategy, settings("on"), outputs, backend)
    assert plan.activation_offload and caps == [plan.activation_ceiling_bytes]
    served = homes in ("this tier's (sequential sampling)", "both")
    # the streamed block found its homes, or took one new arena beside whatever was there
    assert loaded.host_pool.pinned_bytes - before == (0 if served else SMALL_ARENA)
    assert caps[0] == int(ceiling_gb * (1 << 30)) - loaded.host_pool.pinned_bytes
