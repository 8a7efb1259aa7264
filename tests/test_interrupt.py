"""Cancel within one block: an interrupt raised after block k stops the run before block k+1
(counted with forward hooks), during sampling, text encoding and decoding, under every tier; it
leaves nothing applied, and the run repeated afterwards is bit-identical to an uninterrupted one."""

from __future__ import annotations

import pytest
import torch

from backends import StrictBackend
from test_tiers import hooks_of, request_for, storage_map
from vidmem.memory import MemoryStrategy, VaeTiling
from vidmem.memory.device import CpuBackend
from vidmem.pipelines.decode import decode
from vidmem.pipelines.family import denoiser_blocks
from vidmem.pipelines.hooks import RunHooks, outer_blocks
from vidmem.pipelines.sample import SampleRequest, sample


class Cancelled(Exception):
    """Stands in for ComfyUI's InterruptProcessingException."""


class ForwardCounter:
    """Counts completed forwards of the given modules (hooks removed by `close`)."""

    def __init__(self, modules) -> None:
        self.count = 0
        self.handles = [m.register_forward_hook(self._seen) for m in modules]

    def _seen(self, module, args, output) -> None:
        self.count += 1

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def cancel_when(condition) -> RunHooks:
    def check() -> None:
        if condition():
            raise Cancelled()

    return RunHooks(check_interrupt=check)


def all_blocks(loaded) -> list[torch.nn.Module]:
    return [b for blocks in denoiser_blocks(loaded.pipe, loaded.spec).values() for b in blocks]


def assert_restored(loaded, before, hooks_before) -> None:
    assert storage_map(loaded.pipe) == before, "a tensor was left off its original storage"
    assert hooks_of(loaded.pipe) == hooks_before, "a hook was left registered"
    assert not hasattr(loaded.pipe, "vidmem_execution_device")


@pytest.mark.parametrize("variant, strategy, stop_after", [
    ("wan2.1-t2v", MemoryStrategy(offload="block_swap", blocks_to_swap=1, prefetch_blocks=0), 5),
    ("wan2.1-t2v", MemoryStrategy(offload="block_swap", blocks_to_swap=1, prefetch_blocks=1), 5),
    ("wan2.1-t2v", MemoryStrategy(offload="block_swap", blocks_to_swap=2, prefetch_blocks=2), 3),
    ("wan2.1-t2v", MemoryStrategy(offload="sequential"), 1),
    ("wan2.1-t2v", MemoryStrategy(offload="model"), 6),
    ("wan2.2-a14b", MemoryStrategy(offload="block_swap", blocks_to_swap=1), 13),  # in the second expert
], ids=["swap1-p0", "swap1-p1", "swap2-p2", "sequential", "model", "a14b-expert2"])
def test_cancel_mid_step_stops_before_the_next_block(variant, strategy, stop_after, tiny_loaded):
    loaded = tiny_loaded(variant)
    request = request_for(variant, steps=4)
    reference = sample(loaded, strategy, request, backend=CpuBackend()).latent["samples"]
    before, hooks_before = storage_map(loaded.pipe), hooks_of(loaded.pipe)
    counter = ForwardCounter(all_blocks(loaded))
    try:
        uninterrupted = sample(loaded, strategy, request, backend=CpuBackend())
        per_run = counter.count
        counter.count = 0
        assert stop_after < per_run
        with pytest.raises(Cancelled):
            sample(loaded, strategy, request, cancel_when(lambda: counter.count >= stop_after), backend=StrictBackend())
        stopped_at = counter.count
    finally:
        counter.close()
    assert stopped_at == stop_after, f"ran {stopped_at - stop_after} block(s) after Cancel"
    assert_restored(loaded, before, hooks_before)
    again = sample(loaded, strategy, request, backend=StrictBackend()).latent["samples"]
    assert torch.equal(again, reference) and torch.equal(uninterrupted.latent["samples"], reference)


def test_cancel_is_checked_inside_a_step_not_only_between_steps(tiny_loaded):
    """The old behaviour (a check per step) would have run the whole step: 2 passes x 2 blocks."""
    loaded = tiny_loaded("wan2.1-t2v")
    counter = ForwardCounter(all_blocks(loaded))
    steps_done = []
    hooks = RunHooks(on_step=lambda done, total: steps_done.append(done),
                     check_interrupt=lambda: (_ for _ in ()).throw(Cancelled()) if counter.count == 1 else None)
    try:
        with pytest.raises(Cancelled):
            sample(loaded, MemoryStrategy(offload="none"), request_for("wan2.1-t2v"), hooks, backend=CpuBackend())
    finally:
        counter.close()
    assert counter.count == 1 and steps_done == []


@pytest.mark.parametrize("offload", ["none", "model", "sequential"])
def test_cancel_during_text_encoding_stops_before_the_next_encoder_block(offload, tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    strategy = MemoryStrategy(offload=offload, text_encoder="device")
    reference = sample(loaded, strategy, request_for("wan2.1-t2v"), backend=CpuBackend()).latent["samples"]
    before, hooks_before = storage_map(loaded.pipe), hooks_of(loaded.pipe)
    encoder_blocks = outer_blocks(loaded.pipe.text_encoder)
    assert len(encoder_blocks) == 2
    encoder, denoiser = ForwardCounter(encoder_blocks), ForwardCounter(all_blocks(loaded))
    try:
        with pytest.raises(Cancelled):
            sample(loaded, strategy, request_for("wan2.1-t2v"), cancel_when(lambda: encoder.count >= 1),
                   backend=StrictBackend())
        assert encoder.count == 1 and denoiser.count == 0
    finally:
        encoder.close()
        denoiser.close()
    assert_restored(loaded, before, hooks_before)
    assert torch.equal(sample(loaded, strategy, request_for("wan2.1-t2v"), backend=CpuBackend()).latent["samples"],
                       reference)


@pytest.fixture
def tiled_latent(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    request = SampleRequest("a cat", "", width=128, height=96, frames=17, steps=1, cfg=5.0)
    return loaded, sample(loaded, MemoryStrategy(), request, backend=CpuBackend()).latent


@pytest.mark.parametrize("offload", ["none", "model", "sequential"])
def test_cancel_between_decode_pieces(offload, tiled_latent):
    loaded, latent = tiled_latent
    strategy = MemoryStrategy(offload=offload, vae_tiling=VaeTiling(64, 16, 8, 4))
    reference = decode(loaded, latent, strategy, backend=CpuBackend())
    total = reference.receipt["decode"]["decode_calls"]
    assert total > 2
    before, hooks_before = storage_map(loaded.pipe), hooks_of(loaded.pipe)
    pieces = []

    def check() -> None:
        if pieces and pieces[-1] >= 2:
            raise Cancelled()

    with pytest.raises(Cancelled):
        decode(loaded, latent, strategy, backend=StrictBackend(),
               hooks=RunHooks(on_step=lambda done, total: pieces.append(done), check_interrupt=check))
    assert pieces == [1, 2], f"decoded {len(pieces)} of {total} pieces"
    assert_restored(loaded, before, hooks_before)
    assert torch.equal(decode(loaded, latent, strategy, backend=CpuBackend()).frames, reference.frames)


def test_cancel_inside_one_decode_piece_stops_before_the_next_vae_block(tiled_latent):
    loaded, latent = tiled_latent
    blocks = outer_blocks(loaded.pipe.vae)
    reference = decode(loaded, latent, backend=CpuBackend())
    assert reference.receipt["decode"]["decode_calls"] == 1  # untiled: the whole video is one piece
    before, hooks_before = storage_map(loaded.pipe), hooks_of(loaded.pipe)
    counter = ForwardCounter(blocks)
    try:
        with pytest.raises(Cancelled):
            decode(loaded, latent, MemoryStrategy(offload="model"), backend=StrictBackend(),
                   hooks=cancel_when(lambda: counter.count >= 3))
        assert counter.count == 3
    finally:
        counter.close()
    assert_restored(loaded, before, hooks_before)
    assert torch.equal(decode(loaded, latent, backend=CpuBackend()).frames, reference.frames)


def test_cancel_while_image_to_video_encodes_its_conditioning(tiny_loaded):
    """Wan I2V runs the CLIP image encoder and VAE-encodes a video of conditioning frames before
    the first step: Cancel there stops before the next encoder block too."""
    from test_tiers import request_for as request_with_image

    loaded = tiny_loaded("wan2.1-i2v")
    request = request_with_image("wan2.1-i2v")
    strategy = MemoryStrategy(offload="model")
    reference = sample(loaded, strategy, request, backend=CpuBackend()).latent["samples"]
    before, hooks_before = storage_map(loaded.pipe), hooks_of(loaded.pipe)
    for module, stop_after in ((loaded.pipe.image_encoder, 1), (loaded.pipe.vae, 2)):
        counter, denoiser = ForwardCounter(outer_blocks(module)), ForwardCounter(all_blocks(loaded))
        try:
            with pytest.raises(Cancelled):
                sample(loaded, strategy, request, cancel_when(lambda: counter.count >= stop_after), backend=StrictBackend())
            assert counter.count == stop_after and denoiser.count == 0
        finally:
            counter.close()
            denoiser.close()
        assert_restored(loaded, before, hooks_before)
        # diffusers' Wan VAE clears its causal-conv caches at the end of an encode the cancel never reached: on a
        # GPU they would hold a GiB or more of frames (720p) that nothing counts until the next encode
        vae = loaded.pipe.vae
        assert not [t for t in vae._enc_feat_map + vae._feat_map if isinstance(t, torch.Tensor)]
    assert torch.equal(sample(loaded, strategy, request, backend=CpuBackend()).latent["samples"], reference)
