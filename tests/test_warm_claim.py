"""A device copy the warm store keeps is claimed for the compute stream before it is kept.

At a call's end the schedule has already started copying the first swapped group for a pass that
never comes. The next call takes that copy from the warm store with no copy token, so unless the
compute stream waited on it (and `record_stream` told the allocator it uses it) when it was kept, a
kernel could read it half-copied, and its memory could go to the next prefetch while a kernel reads
it. Checked on the fake CUDA backend's log (tests/cuda_fake.py): every module that computes on a
weight whose latest copy ran on the side stream has a record_stream on it since that copy."""
import pytest
import torch
from torch import nn

from cuda_fake import FakeCuda
from test_tiers import request_for
from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CpuBackend, CudaBackend
from vidmem.memory.hostpool import HostPool
from vidmem.memory.offload import StageComponents, apply_strategy
from vidmem.memory.warm import WarmStore
from vidmem.pipelines.decode import decode
from vidmem.pipelines.hooks import RunHooks
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.prompt_cache import PromptCache
from vidmem.pipelines.sample import sample


def _unclaimed_uses(log, uses) -> list:
    """Uses (label, data_ptr, log index) of a side-stream copy with no record_stream since it."""
    bad = []
    for label, ptr, at in uses:
        copies = [k for k in range(at) if log[k][0] == "copy" and log[k][2] == ptr]
        if not copies or log[copies[-1]][1] != "side":
            continue
        if not any(log[k][0] == "record_stream" and log[k][1] == ptr for k in range(copies[-1], at)):
            bad.append((label, ptr, at))
    return bad


def _spy(modules, fake, uses, call, after=False):
    """Record each module's weights and the log's length when it computes: before its forward (a
    pre-hook registered after the engine's, so the log holds the engine's wait) or, for leaves the
    engine hooks through a parent, after it."""
    def hook(module, name):
        for p in module.parameters(recurse=False):
            uses.append(((call, name), p.untyped_storage().data_ptr(), len(fake.log)))
    if after:
        return [m.register_forward_hook(lambda m, a, o, n=n: hook(m, n)) for n, m in modules]
    return [m.register_forward_pre_hook(lambda m, a, n=n: hook(m, n)) for n, m in modules]


def _leaves(module):
    return [(n, m) for n, m in module.named_modules()
            if next(m.children(), None) is None and list(m.parameters(recurse=False))]


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return x


def test_engine_adopted_prefetch_is_claimed(monkeypatch):
    fake = FakeCuda().install(monkeypatch)
    net = _Net()
    backend = CudaBackend(torch.device("cpu"))
    pool, warm = HostPool(), WarmStore("t")
    stage = StageComponents({"t": net}, {"t": net.blocks})
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=3, prefetch_blocks=1)
    uses = []
    for call in range(2):
        with warm.in_use(backend.device, backend):
            with apply_strategy(stage, strategy, backend, fake.observe, pool, warm=warm):
                spies = _spy(list(enumerate(net.blocks)), fake, uses, call)
                net(torch.ones(1, 8))
                net(torch.ones(1, 8))
                for s in spies:
                    s.remove()
    assert not _unclaimed_uses(fake.log, uses)


@pytest.mark.parametrize("tier", ["block_swap", "sequential"])
def test_sampler_same_prompt_new_call_is_claimed(tier, tiny_folder, tmp_path, monkeypatch):
    variant = "wan2.1-t2v"
    loaded = load_pipeline(tiny_folder(variant), "fp32")
    request = request_for(variant)
    hooks = RunHooks(prompt_cache=PromptCache(tmp_path))
    reference = sample(loaded, MemoryStrategy(offload="none"), request, backend=CpuBackend()).latent["samples"]
    fake = FakeCuda().install(monkeypatch)
    fake.device_bytes["free"] = 1 << 20
    backend = CudaBackend(torch.device("cpu"))
    extra = {"blocks_to_swap": 2} if tier == "block_swap" else {}
    strategy = MemoryStrategy(offload=tier, prefetch_blocks=1, **extra)
    uses = []
    for call in range(3):
        spies = _spy(_leaves(loaded.pipe.transformer), fake, uses, call, after=True)
        result = sample(loaded, strategy, request, hooks=hooks, backend=backend, observer=fake.observe)
        for s in spies:
            s.remove()
        assert torch.equal(result.latent["samples"], reference)  # bit-identical, warm or not
    assert not _unclaimed_uses(fake.log, uses)


def test_second_decode_is_claimed(tiny_folder, monkeypatch):
    loaded = load_pipeline(tiny_folder("wan2.1-t2v"), "fp32")
    fake = FakeCuda().install(monkeypatch)
    backend = CudaBackend(torch.device("cpu"))
    latent = sample(loaded, MemoryStrategy(offload="none"), request_for("wan2.1-t2v"), backend=backend).latent
    strategy = MemoryStrategy(offload="sequential", prefetch_blocks=1)
    uses, frames = [], []
    for call in range(2):
        spies = _spy(_leaves(loaded.pipe.vae), fake, uses, call, after=True)
        frames.append(decode(loaded, latent, strategy, backend=backend, observer=fake.observe).frames)
        for s in spies:
            s.remove()
    assert torch.equal(frames[0], frames[1])
    assert not _unclaimed_uses(fake.log, uses)
