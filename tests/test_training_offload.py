"""Activation offload for training (memory/activation_offload.py): checkpointed block inputs wait
in host buffers from the run's pool and come back ahead of the backward on the side stream.

On the CPU: the trained LoRA is bit-identical with offload on and off, on resident and streamed
tiers. Under the recording CUDA fake (tests/cuda_fake.py): copies to the host wait on a compute
event and fill pinned buffers, copies back are non_blocking from pinned memory on the side stream,
one block ahead of the re-run that needs them; nothing in the block loop waits on the host; the
pool pins nothing new after the first step and every buffer is back after the run, or an error.
The planner: device activations drop to one block plus the prefetched input, RAM rises by the moved
inputs, and the advice (and offload=auto's refusal) names offload when it is what makes a tier fit.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from dataclasses import replace

import pytest
import safetensors.torch
import torch
from torch import nn

from cuda_fake import FakeCuda
from test_train_backward_prefetch import BLOCKS, deep, logging_runs  # noqa: F401 (deep: a fixture)
from test_train_support import prepared_per_variant
from vidmem.memory import MemoryStrategy
from vidmem.memory import activation_offload as offload_module
from vidmem.memory.activation_offload import ActivationOffload, ActivationPool, InlineCopies, host_buffer_bytes
from vidmem.memory.device import CpuBackend, CudaBackend
from vidmem.training import TrainOutputs, TrainSettings, train_lora
from vidmem.training.errors import TrainingError

STEPS = 2


@pytest.fixture(scope="module")
def prepared(tiny_loaded, tmp_path_factory):
    return prepared_per_variant(tiny_loaded, tmp_path_factory.mktemp("train-offload"), clips=2)


def train(loaded, data, strategy, tmp_path, name, offload, backend=None, **kwargs):
    settings = TrainSettings(rank=4, alpha=4.0, learning_rate=1e-2, steps=STEPS, batch_size=1, seed=3,
                             activation_offload=offload)
    outputs = TrainOutputs(tmp_path / "loras" / f"{name}.safetensors", tmp_path / "checkpoints" / name)
    result = train_lora(loaded, data, strategy, settings, outputs, backend or CpuBackend(), **kwargs)
    return safetensors.torch.load_file(str(result.lora_path)), result.receipt


@pytest.fixture
def pools(monkeypatch):
    """Every ActivationPool a run makes, to look at after it."""
    made = []
    original = ActivationPool.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)
    monkeypatch.setattr(ActivationPool, "__init__", spy)
    return made


@pytest.mark.parametrize("variant", ["wan2.1-t2v", "cogvideox-t2v"])
def test_offloaded_training_is_bit_identical(tiny_loaded, prepared, tmp_path, variant, pools):
    loaded, data = tiny_loaded(variant), prepared(variant)
    for strategy in (MemoryStrategy(offload="none"), MemoryStrategy(offload="block_swap", blocks_to_swap=1)):
        plain, receipt = train(loaded, data, strategy, tmp_path, "plain", False)
        assert "activation_offload" not in receipt
        moved, receipt = train(loaded, data, strategy, tmp_path, "moved", True)
        assert all(torch.equal(moved[k], plain[k]) for k in plain), (variant, strategy.offload.value)
        stats = receipt["activation_offload"]
        blocks = len(getattr(loaded.pipe.transformer, loaded.spec.blocks_attr))
        checkpointed = blocks - (0 if strategy.streams_blocks else 1)  # resident tiers keep the last one
        assert (stats["offloaded_bytes"] > 0) == (checkpointed > 0) and stats["on_demand_blocks"] == 0, stats
        assert stats["unreturned_buffers"] == 0
    assert pools and all(pool.in_use == 0 and pool.pinned_bytes == 0 for pool in pools)


def test_activation_offload_needs_checkpointing():
    with pytest.raises(TrainingError, match="activation_offload needs gradient_checkpointing"):
        TrainSettings(activation_offload=True, gradient_checkpointing=False)
    with pytest.raises(TrainingError, match="activation_offload='yes' is not one of off, on, auto"):
        TrainSettings(activation_offload="yes")
    assert "activation_offload" not in TrainSettings(activation_offload=True).as_record()  # resumable either way


class Chain(nn.Module):
    """Blocks called as diffusers' loops call them: the carried state and a shared tensor."""

    def __init__(self, count: int, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(count))

    def forward(self, hidden, shared, run):
        for block in self.blocks:
            hidden = run(block, hidden, shared)
        return hidden


def _run_chain(offload: ActivationOffload | None, count: int = 4):
    from torch.utils.checkpoint import checkpoint

    chain = Chain(count)
    x = torch.randn(3, 8, requires_grad=True)
    shared = torch.randn(3, 8)

    def run(block, hidden, shared):
        def body(h, s):
            return torch.tanh(block(h)) + s
        if offload is None:
            return checkpoint(body, hidden, shared, use_reentrant=False)
        with offload.saving((hidden, shared)):
            return checkpoint(body, hidden, shared, use_reentrant=False)

    loss = chain(x * 2, shared, run).square().sum()
    if offload is not None:
        offload.begin_backward()
    loss.backward()
    return x.grad, [b.weight.grad for b in chain.blocks]


def test_engine_offloads_the_carried_input_and_keeps_shared_ones():
    pool = ActivationPool(lambda n: torch.empty(n, dtype=torch.uint8), 1 << 20)
    offload = ActivationOffload(InlineCopies(torch.device("cpu")), pool, prefetch=1)
    grad, weights = _run_chain(offload)
    reference_grad, reference_weights = _run_chain(None)
    assert torch.equal(grad, reference_grad) and all(torch.equal(a, b) for a, b in zip(weights, reference_weights))
    # the shared tensor is offloaded once (with the first block, before it is known to be shared)
    assert offload.offloaded_bytes == (4 + 1) * 3 * 8 * 4
    assert offload.on_demand == 0 and offload.prefetched == 4
    offload.close()
    assert pool.in_use == 0 and pool.release() == 0


def test_block_inputs_are_freed_on_the_device_between_forward_and_backward():
    """What the planner counts as leaving the device really is released: after the forward, no
    block's output (the next block's input) is still alive except the last one, which the loss holds."""
    from torch.utils.checkpoint import checkpoint

    def alive_after_forward(offload):
        chain, outputs = Chain(4), []
        hidden, shared = torch.randn(3, 8, requires_grad=True) * 2, torch.randn(3, 8)
        for block in chain.blocks:
            with offload.saving((hidden, shared)) if offload else contextlib.nullcontext():
                hidden = checkpoint(lambda h, s, b=block: torch.tanh(b(h)) + s, hidden, shared, use_reentrant=False)
            outputs.append(weakref.ref(hidden))
        loss = hidden.square().sum()
        del hidden
        gc.collect()
        alive = sum(ref() is not None for ref in outputs)
        if offload:
            offload.begin_backward()
        loss.backward()
        if offload:
            offload.close()
        return alive

    pool = ActivationPool(lambda n: torch.empty(n, dtype=torch.uint8), 1 << 20)
    assert alive_after_forward(None) == 4
    assert alive_after_forward(ActivationOffload(InlineCopies(torch.device("cpu")), pool)) == 1
    assert pool.in_use == 0


def test_over_the_ceiling_tensors_stay_on_the_device():
    pool = ActivationPool(lambda n: torch.empty(n, dtype=torch.uint8), 0)
    offload = ActivationOffload(InlineCopies(torch.device("cpu")), pool)
    grad, _ = _run_chain(offload)
    assert torch.equal(grad, _run_chain(None)[0])
    assert offload.offloaded_bytes == 0 and offload.over_cap == 4 + 1
    offload.close()


def test_a_block_input_changed_in_place_after_it_was_saved_is_refused_as_autograd_refuses_it():
    """Saved-tensor hooks switch autograd's version check off: an offloaded copy (or a kept reference) would hand
    the backward stale or changed values silently. The offload checks the version itself, as autograd does."""
    from torch.utils.checkpoint import checkpoint

    def changed_in_place(offload, ceiling=1 << 20):
        block = torch.nn.Linear(8, 8)
        hidden, shared = torch.randn(3, 8, requires_grad=True) * 2, torch.randn(3, 8)
        with offload.saving((hidden, shared)) if offload else contextlib.nullcontext():
            out = checkpoint(lambda h, s: torch.tanh(block(h)) + s, hidden, shared, use_reentrant=False)
        shared.mul_(2)  # after the block saved it
        if offload:
            offload.begin_backward()
        out.sum().backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        changed_in_place(None)  # plain checkpointing
    for ceiling in (1 << 20, 0):  # offloaded, and kept on the device over the ceiling
        pool = ActivationPool(lambda n: torch.empty(n, dtype=torch.uint8), ceiling)
        offload = ActivationOffload(InlineCopies(torch.device("cpu")), pool)
        with pytest.raises(RuntimeError, match=r"modified by an inplace operation: a checkpointed block's input of "
                                               r"shape \[3, 8\] is at version 1; expected version 0"):
            changed_in_place(offload)
        offload.close()


def test_past_the_ceiling_the_backward_prefetches_the_blocks_that_moved_their_inputs():
    """The pool runs out in forward order: the last blocks keep their inputs on the device. The backward's first
    copies are those of the last blocks that did move theirs, so none is copied back on demand (in line)."""
    pool = ActivationPool(lambda n: torch.empty(n, dtype=torch.uint8), 3 * host_buffer_bytes(3 * 8 * 4))
    offload = ActivationOffload(InlineCopies(torch.device("cpu")), pool, prefetch=1)
    grad, _ = _run_chain(offload, count=6)
    assert torch.equal(grad, _run_chain(None, count=6)[0])
    assert offload.over_cap > 0 and offload.on_demand == 0
    offload.close()


def test_a_refused_pin_is_asked_once_and_named_in_the_warning(caplog):
    asked = []

    def pin(nbytes):
        asked.append(nbytes)
        if len(asked) > 2:
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        return torch.empty(nbytes, dtype=torch.uint8)

    pool = ActivationPool(pin, 1 << 20)
    offload = ActivationOffload(InlineCopies(torch.device("cpu")), pool)
    with caplog.at_level("WARNING", logger="vidmem"):
        grad, _ = _run_chain(offload, count=6)
    assert torch.equal(grad, _run_chain(None, count=6)[0])
    assert len(asked) == 3 and offload.over_cap == 6 + 1 - 2
    assert "the driver refused to pin more host memory (CUDA error: out of memory (cudaHostAlloc))" in caplog.text
    assert "raise max_pinned_ram_gb" not in caplog.text
    offload.close()


def test_a_buffer_filled_again_before_the_step_settles_waits_for_its_copy_back(monkeypatch):
    """A buffer goes back to the pool once its copy to the device is queued on the side stream; a fill of it on the
    copies' own stream before the host settles must wait for that read (the trainer settles between steps, so
    only a second forward in one step, or another user of the pool, would meet it)."""
    from vidmem.memory.activation_offload import SideStreamCopies

    with monkeypatch.context() as patch:
        fake = FakeCuda().install(patch)
        copies = SideStreamCopies(torch.device("cpu"), torch.cuda.Stream())
        host = torch.empty(64, dtype=torch.uint8, pin_memory=True)
        filled = copies.to_host(torch.ones(16), host.view(torch.float32))
        _, read = copies.to_device(host.view(torch.float32), filled)
        copies.to_host(torch.full((16,), 2.0), host.view(torch.float32))
        fill = max(i for i, entry in enumerate(fake.log) if entry[0] == "stage")
        assert ("wait_event", copies.down.name, read.id) in fake.log[:fill]
        copies.settle()
        assert {("event_sync", read.id)} <= set(fake.log)


def _side_copies(fake: FakeCuda) -> list:
    return [t for t in fake.transfers if t.stream == "side"]


def test_copies_under_the_cuda_fake(deep, tmp_path, monkeypatch, pools):  # noqa: F811
    """Tier none (no weight streaming), so every side-stream copy and host wait is the offload's."""
    loaded, data = deep
    reference, _ = train(loaded, data, MemoryStrategy(offload="none"), tmp_path, "ref", False)
    with monkeypatch.context() as patch:
        fake = FakeCuda().install(patch)
        hooks = logging_runs(loaded.pipe.transformer.blocks, fake.log)
        try:
            weights, receipt = train(loaded, data, MemoryStrategy(offload="none"), tmp_path, "fake", True,
                                     CudaBackend(torch.device("cpu")))
        finally:
            for hook in hooks:
                hook.remove()
    assert all(torch.equal(weights[k], reference[k]) for k in reference)
    log = fake.log
    # back to the device: from pinned memory, non_blocking, on the side stream; one per offloaded tensor
    side = _side_copies(fake)
    assert side and all(t.source_pinned and t.non_blocking for t in side), side
    assert sum(t.nbytes for t in side) == receipt["activation_offload"]["offloaded_bytes"]  # every step's
    assert not fake.pageable_async()
    # to the host: on a stream of its own (a wait for compute on the weights' side stream would hold their
    # prefetches), after the compute stream's event, into a pinned buffer; the input kept for that stream
    fills = [i for i, e in enumerate(log) if e[0] == "stage" and log[i - 1][0] == "wait_event"]  # not the setup's
    assert len(fills) == len(side)
    down = {log[i - 1][1] for i in fills}
    assert len(down) == 1 and not down & {"side", "compute"}, down
    (down,) = down
    recorded = {e[1]: e[2] for e in log if e[0] == "record"}  # event -> the stream it was recorded on
    for i in fills:
        waits = [e for e in log[max(0, i - 3):i] if e[:2] == ("wait_event", down)]
        assert "compute" in {recorded[e[2]] for e in waits}, log[i - 3:i]
        assert ("record_stream", down) in {e[::2] for e in log[i:i + 3]}, log[i:i + 3]
    # to the device: the side stream waits for the buffer's fill; compute waits for the copy when the re-run
    # unpacks it (before it reads it), and keeps the tensor for itself (record_stream)
    backs = [i for i, e in enumerate(log) if e[:2] == ("copy", "side")]
    for i in backs:
        assert log[i - 1][:2] == ("wait_event", "side") and recorded[log[i - 1][2]] == down, log[i - 1]
        copied = [e[1] for e in log[i + 1:] if e[0] == "record" and e[2] == "side"][0]
        after = log[i + 1:]
        waited = after.index(("wait_event", "compute", copied))
        assert ("record_stream", log[i][2], "compute") in after[waited:waited + 2]
    # inside the block loop (first forward run to last re-run of a step): event waits only, no host waits
    runs = [i for i, e in enumerate(log) if e[0] == "run"]
    per_step = len(runs) // STEPS
    for step in range(STEPS):
        first, last = runs[step * per_step], runs[(step + 1) * per_step - 1]
        assert not [e for e in log[first:last] if e[0] in ("event_sync", "device_sync", "stream_sync")]
    # each re-run (blocks 2, 1, 0: the last block is kept, not checkpointed) finds its input copied
    # ahead, before the re-run of the block after it began
    stats = receipt["activation_offload"]
    assert stats["on_demand_blocks"] == 0 and stats["prefetched_blocks"] == (BLOCKS - 1) * STEPS
    # pinned once in the first step, reused in the second, all returned and dropped after the run
    pins = [i for i, e in enumerate(log) if e[0] == "pin"]
    second_step = runs[per_step]
    assert not [i for i in pins if i > second_step]
    assert pools and all(pool.in_use == 0 and pool.pinned_bytes == 0 for pool in pools)
    # dropping the buffers is not enough: torch's caching host allocator keeps them locked until emptied
    assert ("host_empty_cache",) in log[runs[-1]:]


def test_buffers_come_back_after_an_error(deep, tmp_path, monkeypatch, pools):  # noqa: F811
    loaded, data = deep
    calls = []

    def interrupt():
        calls.append(1)
        if len(calls) == BLOCKS + 2:  # inside the first backward's re-runs
            raise KeyboardInterrupt("cancelled")

    with monkeypatch.context() as patch:
        fake = FakeCuda().install(patch)
        with pytest.raises(KeyboardInterrupt, match="cancelled"):
            train(loaded, data, MemoryStrategy(offload="block_swap", blocks_to_swap=2), tmp_path, "err", True,
                  CudaBackend(torch.device("cpu")), check_interrupt=interrupt)
    assert pools and all(pool.in_use == 0 and pool.pinned_bytes == 0 for pool in pools)
    pins = [i for i, e in enumerate(fake.log) if e[0] == "pin"]
    assert pins and ("host_empty_cache",) in fake.log[pins[-1]:]  # unlocked on the way out, not only dropped


def test_a_sticky_cuda_error_while_settling_does_not_hide_the_cancel(deep, tmp_path, monkeypatch, pools):  # noqa: F811
    from vidmem.memory import activation_offload

    loaded, data = deep
    calls = []

    def interrupt():
        calls.append(1)
        if len(calls) == BLOCKS + 2:
            raise KeyboardInterrupt("cancelled")

    def sticky(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with monkeypatch.context() as patch:
        FakeCuda().install(patch)
        patch.setattr(activation_offload.SideStreamCopies, "settle", sticky)
        with pytest.raises(KeyboardInterrupt, match="cancelled"):
            train(loaded, data, MemoryStrategy(offload="none"), tmp_path, "sticky", True,
                  CudaBackend(torch.device("cpu")), check_interrupt=interrupt)
    assert pools and all(pool.in_use == 0 and pool.pinned_bytes == 0 for pool in pools)


def test_offload_follows_the_weights_schedule_on_block_swap(deep, tmp_path, monkeypatch):  # noqa: F811
    """With streamed weights the inputs' copies share the side stream with the weights' prefetch."""
    loaded, data = deep
    reference, _ = train(loaded, data, MemoryStrategy(offload="none"), tmp_path, "ref", False)
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=BLOCKS, prefetch_blocks=1)
    with monkeypatch.context() as patch:
        fake = FakeCuda().install(patch)
        weights, receipt = train(loaded, data, strategy, tmp_path, "swap", True, CudaBackend(torch.device("cpu")),
                                 observer=fake.observe)
    assert all(torch.equal(weights[k], reference[k]) for k in reference)
    side = _side_copies(fake)
    assert all(t.source_pinned and t.non_blocking for t in side)
    streamed = sum(sum(p.numel() * p.element_size() for p in block.parameters())
                   for block in loaded.pipe.transformer.blocks)
    # the blocks' weights (streamed every pass, some kept across a pass boundary) and the offloaded inputs
    assert sum(t.nbytes for t in side) >= STEPS * streamed + receipt["activation_offload"]["offloaded_bytes"]
    assert receipt["activation_offload"]["on_demand_blocks"] == 0
    assert not fake.pageable_async()


def test_module_has_no_host_imports():
    source = offload_module.__file__
    text = open(source).read()
    assert "comfy" not in text and "pipelines" not in text


# --- the planner ------------------------------------------------------------------------------

def test_offloaded_peak_keeps_one_block_and_the_prefetched_inputs():
    from vidmem.memory.plan.train import ActivationPeaks

    # one block 100, the second adds 30 (its input 10 and a one-time input gradient 20), each further one 10
    peaks = ActivationPeaks(one_block=100, two_blocks=130, three_blocks=140, kept_per_block=5)
    assert (peaks.per_block, peaks.once) == (10, 20)
    assert peaks.offloaded_at(40, 1) == 100 + 20 + 10 + 40 * 5
    assert peaks.offloaded_at(40, 2) == 100 + 20 + 20 + 40 * 5
    assert peaks.offloaded_at(1, 2) == 100 + 5  # one block: nothing to prefetch
    assert peaks.offloaded_at(40, 1) < peaks.at(40)
    # traced inputs: the first block's come back whole (a shared 50 whose original is still alive)
    traced = replace(peaks, offloaded=((10, 1, 50), (10,)))
    assert traced.offloaded_at(40, 1) == 100 + 20 + 61 + 40 * 5
    assert traced.offloaded_at(40, 3) == 100 + 20 + 61 + 2 * 10 + 40 * 5


def plan_json(capsys, *extra: str, vram: str = "24") -> tuple[int, dict]:
    import json

    from vidmem.cli import main

    status = main(["plan", "--model", "cogvideox-2b", "--size", "720x480", "--frames", "49", "--vram", vram,
                   "--ram", "64", "--train", "--rank", "64", "--json", *extra])
    return status, json.loads(capsys.readouterr().out)


def test_cli_plans_activation_offload(capsys):
    _, plain = plan_json(capsys)
    _, moved = plan_json(capsys, "--activation-offload")
    assert moved["request"]["activation_offload"] == "on"
    for before, after in zip(plain["strategies"], moved["strategies"]):
        assert after["activation_offload"] and not before["activation_offload"]
        assert after["activation_bytes"] < before["activation_bytes"], after["tier"]
        dropped = before["activation_bytes"] - after["activation_bytes"]
        assert before["peak_vram_bytes"] - after["peak_vram_bytes"] == dropped
        assert after["peak_ram_bytes"] - before["peak_ram_bytes"] == after["activation_host_bytes"] > 0
        assert after["activation_copy_seconds"] > 0 and before["activation_copy_seconds"] == 0
    # every tier re-runs blocks in full with offload: the same device activations (one block + one prefetched input)
    assert len({s["activation_bytes"] for s in moved["strategies"]}) == 1
    # streamed, without offload: one block + 29 inputs; with it: one block + 1 input; the host holds all 30
    # (CogVideoX hands each block a new hidden state and a new text state; the first block also the timestep
    # embedding: tests/test_training_offload_plan.py checks those against a run)
    blocks = 30
    streamed_before, streamed_after = plain["strategies"][3], moved["strategies"][3]
    per_block = (streamed_before["activation_bytes"] - streamed_after["activation_bytes"]) // (blocks - 2)
    moved_bytes = streamed_after["activation_moved_bytes"]
    # the traced inputs (hidden and text states, the first block's embedding) against the peaks' difference
    assert moved_bytes == pytest.approx(blocks * per_block, rel=0.01)
    assert moved_bytes <= streamed_after["activation_host_bytes"] <= 2 * moved_bytes  # power-of-two buffers
    assert streamed_after["activation_copy_seconds"] == pytest.approx(2 * moved_bytes / 22e9, rel=1e-3)


def test_advice_names_activation_offload_when_it_makes_training_fit(capsys):
    _, plain = plan_json(capsys)
    _, moved = plan_json(capsys, "--activation-offload")
    none_plain, none_moved = plain["strategies"][0]["peak_vram_bytes"], moved["strategies"][0]["peak_vram_bytes"]
    between = f"{(none_plain + none_moved) / 2 / (1 << 30):.3f}"
    _, tight = plan_json(capsys, vram=between)
    assert not tight["strategies"][0]["fits"] and tight["strategies"][0]["fits_with_offload"]
    assert tight["advice"].startswith("activation offload makes none fit"), tight["advice"]
    _, roomy = plan_json(capsys)
    assert roomy["advice"] == ""  # none fits already: offload is not what makes it fit


def test_cli_activation_offload_needs_checkpointing(capsys):
    from vidmem.cli import main

    assert main(["plan", "--model", "cogvideox-2b", "--vram", "24", "--ram", "64", "--train", "--no-checkpointing",
                 "--activation-offload"]) == 2
    assert "needs checkpointing" in capsys.readouterr().err


# --- the node ---------------------------------------------------------------------------------

def test_train_node_takes_activation_offload_and_shows_it(tiny_loaded, tmp_path, monkeypatch):
    from test_train_support import make_dataset
    from vidmem.nodes import host
    from vidmem.nodes.strategy import StrategyChoice
    from vidmem.nodes.train import VidMemPrepareTrainingData, VidMemTrainLoRA

    optional = VidMemTrainLoRA.INPUT_TYPES()["optional"]
    kind, options = optional["activation_offload"]
    assert kind == ["off", "on", "auto"] and options["default"] == "off"
    assert "gradient_checkpointing" in options["tooltip"]
    monkeypatch.setattr(host, "loras_folder", lambda: tmp_path / "models" / "loras")
    monkeypatch.setattr(host, "training_folder", lambda: tmp_path / "output" / "vidmem_training")
    loaded = tiny_loaded("wan2.1-t2v")
    strategy = StrategyChoice(MemoryStrategy(offload="block_swap", blocks_to_swap=1))
    data = VidMemPrepareTrainingData().prepare(loaded, strategy, str(make_dataset(tmp_path / "clips", clips=1)),
                                               "32x32", "9")["result"][0]
    train = dict(lora_name="offloaded", rank=4, alpha=4.0, learning_rate=1e-3, steps=1, batch_size=1, seed=0,
                 target_modules="to_q,to_v", gradient_checkpointing=True, optimizer="adamw", checkpoint_every=0,
                 resume=False, expert="both")
    out = VidMemTrainLoRA().train(loaded, data, strategy, **train, activation_offload=True)
    assert "activation offload:" in out["ui"]["text"][0]
    assert out["ui"]["vidmem_receipt"][0]["activation_offload"]["offloaded_bytes"] > 0
    with pytest.raises(TrainingError, match="activation_offload needs gradient_checkpointing"):
        VidMemTrainLoRA().train(loaded, data, strategy, **dict(train, gradient_checkpointing=False),
                                activation_offload=True)


def test_auto_refusal_names_activation_offload_when_it_would_fit():
    from vidmem.memory.plan.train import training_bytes
    from vidmem.memory.plan.train_plan import TrainPlan
    from vidmem.memory.plan.types import VideoShape
    from vidmem.training.plan import _nothing_fits

    lora = training_bytes([(64, 64)], 4, "adamw")
    plans = [TrainPlan(tier, 2 if tier == "block_swap" else 0, 1 << 30, lora, 8 << 30, 10 << 30, 4 << 30, False,
                       fits_with_offload=tier == "block_swap") for tier in ("none", "model", "block_swap", "sequential")]
    message = _nothing_fits(plans, VideoShape(64, 64, 9, cfg=False), 6 << 30, 32 << 30)
    assert "activation offload makes block_swap 2 fit" in message
    plans = [TrainPlan(p.tier, p.blocks_to_swap, p.weights_bytes, lora, p.activation_bytes, p.peak_vram_bytes,
                       p.peak_ram_bytes, False) for p in plans]
    assert "activation offload" not in _nothing_fits(plans, VideoShape(64, 64, 9, cfg=False), 6 << 30, 32 << 30)


def test_a_second_backward_over_offloaded_inputs_is_refused_by_name():
    from torch.utils.checkpoint import checkpoint

    from vidmem.memory.activation_offload import ActivationOffloadError

    pool = ActivationPool(lambda n: torch.empty(n, dtype=torch.uint8), 1 << 20)
    offload = ActivationOffload(InlineCopies(torch.device("cpu")), pool)
    block = nn.Linear(8, 8)
    hidden = torch.randn(3, 8, requires_grad=True) * 2
    with offload.saving((hidden,)):
        out = checkpoint(block, hidden, use_reentrant=False)
    loss = out.square().sum()
    offload.begin_backward()
    loss.backward(retain_graph=True)
    with pytest.raises(ActivationOffloadError, match="asked for twice"):
        loss.backward()
    offload.close()
    assert pool.in_use == 0


def test_a_failing_unlock_does_not_hide_the_runs_own_error(deep, tmp_path, monkeypatch, pools, caplog):  # noqa: F811
    """The unlock runs in a finally: under a sticky CUDA error it may raise too, and the user must see the
    run's own error (here the cancel), with the unlock's failure logged, not the other way round."""
    from vidmem.training import loop

    loaded, data = deep

    def interrupt():
        raise KeyboardInterrupt("cancelled")

    def sticky():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with monkeypatch.context() as patch:
        FakeCuda().install(patch)
        patch.setattr(loop, "release_cached_pinned", sticky)
        with pytest.raises(KeyboardInterrupt, match="cancelled"):
            train(loaded, data, MemoryStrategy(offload="none"), tmp_path, "sticky", True,
                  CudaBackend(torch.device("cpu")), check_interrupt=interrupt)
    assert "not unlocked" in caplog.text and "illegal memory access" in caplog.text
