"""The user's vram_budget_gb bounds what the engine keeps on the GPU, and the prompt encoder's cache
goes back to the driver before the denoise.

The planner fits a run in the Memory Strategy's VRAM budget; at run time the Sampler's
`RunHooks.device_budget` decides how many streamed blocks stay on the device beyond that plan (and
auto chunks, and the out-of-memory ladder's rung). Free memory alone would let a run planned for
8 GiB on a 24 GiB card keep ~16 GiB of blocks. CUDA's figures are faked (tests/cuda_fake.py).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from cuda_fake import FakeCuda
from test_tiers import block_count, request_for
from test_warm_runs import block_bytes
from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CudaBackend
from vidmem.memory.plan.costs import CUDA_CONTEXT_BYTES
from vidmem.memory.plan.types import Attention
from vidmem.memory.telemetry import budgeted_free_bytes, free_device_bytes
from vidmem.memory.units import GiB, MiB
from vidmem.pipelines.hooks import RunHooks
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.prompt_cache import PromptCache
from vidmem.pipelines.sample import sample

VARIANT = "wan2.1-t2v"
CUDA = torch.device("cuda")


def card(fake: FakeCuda, *, free: int, allocated: int, reserved: int | None = None, total: int = 24 * GiB) -> None:
    """What the fake GPU reports: the driver's free memory, torch's allocated and reserved bytes."""
    fake.device_bytes = {"free": free, "allocated": allocated, "reserved": allocated if reserved is None else reserved,
                         "total": total}


def test_the_budgeted_figure_is_free_memory_within_what_the_budget_leaves(monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    card(fake, free=20 * GiB, allocated=2 * GiB, reserved=3 * GiB)
    free = free_device_bytes(CUDA)
    assert free == 21 * GiB  # the driver's free memory plus the allocator's unused cache
    assert budgeted_free_bytes(0) is free_device_bytes  # no budget of the user's: the plain free figure
    assert budgeted_free_bytes(8 * GiB)(CUDA) == 8 * GiB - CUDA_CONTEXT_BYTES - 2 * GiB
    assert budgeted_free_bytes(64 * GiB)(CUDA) == free  # a budget above the card: what is free
    assert budgeted_free_bytes(2 * GiB)(CUDA) == 0  # already over the budget: nothing, never below 0
    assert budgeted_free_bytes(8 * GiB)(torch.device("cpu")) is None  # host RAM is not budgeted here


class _Captured(Exception):
    """Stops the Sampler node once it has built its hooks: nothing runs."""


def sampler_hooks(loaded, vram_budget_gb: float, monkeypatch, tmp_path) -> RunHooks:
    """The RunHooks the Video Sampler node hands the engine on a (fake) CUDA device, under a Memory
    Strategy of block swap with `vram_budget_gb`."""
    from vidmem.nodes import sampler as sampler_node
    from vidmem.nodes.strategy import VidMemMemoryStrategy

    seen = []

    def capture(pipeline, strategy, request, hooks, device):
        seen.append(hooks)
        raise _Captured

    monkeypatch.setenv("VIDMEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sampler_node.host, "compute_device", lambda: CUDA)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")  # the speed figures ask
    monkeypatch.setattr(sampler_node, "check_before_planning",
                        lambda *args: SimpleNamespace(takes_chunks=True, planned_attention=Attention.FUSED))
    monkeypatch.setattr(sampler_node, "_strategy_for_run", lambda pipeline, choice, *args: (choice.strategy, ""))
    monkeypatch.setattr(sampler_node, "_sample", capture)
    (choice,) = VidMemMemoryStrategy().build(
        vram_budget_gb=vram_budget_gb, offload="block_swap", blocks_to_swap=block_count(loaded), prefetch_blocks=0,
        max_pinned_ram_gb=-1.0, non_blocking=True, text_encoder="offload_after_encoding", vae_slicing=False,
        vae_tiling=False, tile_size=256, overlap=64, temporal_size=64, temporal_overlap=8)["result"]
    with pytest.raises(_Captured):
        sampler_node.VidMemVideoSampler().sample(loaded, choice, "a cat", "", 32, 32, 9, 1, 1.0, 0)
    return seen[0]


def test_the_samplers_hooks_read_the_users_vram_budget(tiny_loaded, monkeypatch, tmp_path):
    fake = FakeCuda().install(monkeypatch)
    card(fake, free=20 * GiB, allocated=2 * GiB)
    loaded = tiny_loaded(VARIANT)
    budgeted = sampler_hooks(loaded, 8.0, monkeypatch, tmp_path)
    assert budgeted.device_budget(CUDA) == 8 * GiB - CUDA_CONTEXT_BYTES - 2 * GiB  # not the 20 GiB free
    unbudgeted = sampler_hooks(loaded, 0.0, monkeypatch, tmp_path)  # 0: the GPU's total, so what is free
    assert unbudgeted.device_budget(CUDA) == free_device_bytes(CUDA) == 20 * GiB


def test_streamed_blocks_kept_beyond_the_plan_stay_within_the_users_budget(monkeypatch, tiny_folder, tmp_path):
    """A 2 GiB budget on a card with 64 GiB free: the Sampler's hooks leave room for one kept block
    (beside the call's weights and the keep margin), so one stays, not every block free memory would allow."""
    from vidmem.pipelines.room import KEEP_MARGIN_BYTES

    fake = FakeCuda().install(monkeypatch)
    loaded = load_pipeline(tiny_folder(VARIANT), "fp32")
    blocks = block_count(loaded)
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=blocks, prefetch_blocks=0)
    backend, request = CudaBackend(torch.device("cpu")), request_for(VARIANT)
    prompts = PromptCache(tmp_path / "prompts")
    cold = sample(load_pipeline(loaded.folder, "fp32"), strategy, request, hooks=RunHooks(prompt_cache=prompts),
                  backend=backend)
    weights, one_block = cold.receipt["device_weight_bytes"], block_bytes(loaded, 0)
    budget = 2 * GiB  # torch has allocated what leaves the call its weights, the margin and one block
    allocated = budget - CUDA_CONTEXT_BYTES - weights - KEEP_MARGIN_BYTES - one_block
    card(fake, free=64 * GiB, allocated=allocated)
    assert 0 < allocated < 1 * GiB and one_block < 1 * MiB
    node = sampler_hooks(loaded, budget / GiB, monkeypatch, tmp_path)
    # The stand-in device is the CPU (tensors stay there): the figure is read as the CUDA device's.
    hooks = replace(node, device_budget=lambda device: node.device_budget(CUDA), prompt_cache=prompts)
    kept = sample(loaded, strategy, request, hooks=hooks, backend=backend)
    residency = kept.receipt["residency"]
    assert residency["limit_bytes"] == one_block and residency["kept_groups"] == 1 < blocks
    assert torch.equal(cold.latent["samples"], kept.latent["samples"])


def test_the_prompt_encoders_cache_goes_back_before_the_denoise(tiny_folder, monkeypatch):
    """offload_after_encoding: once the text encoder is evicted, the allocator's cache is emptied once, before
    the first denoiser pass (the plan replays the denoise from an empty allocator)."""
    import vidmem.pipelines.sample as sampling
    from vidmem.memory.offload import OffloadHandle

    loaded = load_pipeline(tiny_folder(VARIANT), "fp32")  # its own: a hook goes on its transformer
    log = []
    evict = OffloadHandle.evict
    monkeypatch.setattr(OffloadHandle, "evict", lambda handle, name: log.append(("evict", name)) or evict(handle, name))
    monkeypatch.setattr(sampling, "release_cached_segments", lambda device: log.append(("empty_cache", device.type)))
    loaded.pipe.transformer.register_forward_pre_hook(lambda module, args: log.append(("denoise",)))
    for text_encoder in ("offload_after_encoding", "device"):
        log.clear()
        sample(loaded, MemoryStrategy(offload="model", text_encoder=text_encoder), request_for(VARIANT))
        passes = log.index(("denoise",))
        if text_encoder == "device":  # kept on the device: nothing evicted, nothing emptied
            assert ("empty_cache", "cpu") not in log
            continue
        assert log[:passes] == [("evict", "text_encoder"), ("empty_cache", "cpu")]
        assert log.count(("empty_cache", "cpu")) == 1


def test_the_cache_is_emptied_on_cuda_only(monkeypatch):
    import vidmem.pipelines.sample as sampling

    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    sampling.release_cached_segments(torch.device("cpu"))  # a --cpu host never gets a CUDA context
    assert calls == []
    sampling.release_cached_segments(CUDA)
    assert calls == ["empty_cache"]


def test_the_decode_ladder_reads_the_users_vram_budget_too(tiny_loaded, monkeypatch):
    """The Decode node hands the same budgeted figure to the decode, whose ladder skips the rungs predicted to
    overrun it (pipelines/decode.py `_free_for_rungs`); without a Strategy, the device's free memory."""
    from vidmem.nodes import decode as decode_node
    from vidmem.nodes.strategy import VidMemMemoryStrategy
    from vidmem.pipelines.decode import _free_for_rungs

    fake = FakeCuda().install(monkeypatch)
    card(fake, free=20 * GiB, allocated=2 * GiB)
    seen = []

    def capture(pipeline, latent, strategy, hooks, device):
        seen.append(hooks)
        raise _Captured

    monkeypatch.setattr(decode_node, "decode", capture)
    monkeypatch.setattr(decode_node, "validate_latent", lambda pipeline, latent: latent["samples"])
    monkeypatch.setattr(decode_node.host, "compute_device", lambda: CUDA)
    (choice,) = VidMemMemoryStrategy().build(
        vram_budget_gb=8.0, offload="model", blocks_to_swap=0, prefetch_blocks=1, max_pinned_ram_gb=-1.0,
        non_blocking=True, text_encoder="offload_after_encoding", vae_slicing=False, vae_tiling=False, tile_size=256,
        overlap=64, temporal_size=64, temporal_overlap=8)["result"]
    latent = {"samples": torch.zeros(1, 16, 3, 4, 4)}
    for strategy in (choice, None):
        with pytest.raises(_Captured):
            decode_node.VidMemVAEDecode().decode(tiny_loaded(VARIANT), latent, strategy)
    assert _free_for_rungs(seen[0], CUDA) == 8 * GiB - CUDA_CONTEXT_BYTES - 2 * GiB  # not the 20 GiB free
    assert _free_for_rungs(seen[1], CUDA) == free_device_bytes(CUDA) == 20 * GiB
    assert _free_for_rungs(RunHooks(), CUDA) == 20 * GiB  # hooks without a budget: the device's free memory
