"""CudaBackend through every tier, under the recording CUDA fake: the call order the README promises.

- streamed copies run on the side stream, whole components on the compute stream;
- compute waits only on the copy event of the block it is about to run (`wait_event` on the
  compute stream), never with a device-wide synchronize inside the loop;
- compute waits for a streamed block's latest side copy before the block's forward runs (the audit
  logs each streamed module's forward, after the engine's own pre-hook: `log_forwards`);
- every side-stream copy compute used is `record_stream`-ed on the compute stream before its
  block is evicted (so the allocator cannot hand its memory to the next prefetch too early);
- at most prefetch + 2 streamed groups of a component hold device memory at once (prefetch + 1
  on the device, one evicted whose compute the host has not yet seen finish), and as many of Wan
  2.2 A14B's two experts together: the expert that finished has drained before the next one copies;
and the latents equal the CPU backend's, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from cuda_fake import FakeCuda
from test_tiers import block_count, request_for, storage_map
from vidmem.memory import MemoryStrategy
from vidmem.memory import offload
from vidmem.memory.device import CpuBackend, CudaBackend
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.sample import sample


def tiers(blocks: int) -> dict[str, MemoryStrategy]:
    found = {"none": MemoryStrategy(offload="none"), "model": MemoryStrategy(offload="model")}
    for prefetch in (0, 1, 2):
        for swap in sorted({1, blocks}):
            found[f"block_swap:{swap}:{prefetch}"] = MemoryStrategy(offload="block_swap", blocks_to_swap=swap,
                                                                   prefetch_blocks=prefetch)
        found[f"sequential:{prefetch}"] = MemoryStrategy(offload="sequential", prefetch_blocks=prefetch)
    return found


@dataclass
class Copy:
    event: int
    stream: str
    pointers: list[int]
    group: str | None = None
    waited: bool = False


EXPERTS = ("transformer", "transformer_2")  # Wan 2.2 A14B: one hands off to the other mid-call


def log_forwards(patch, fake: FakeCuda) -> None:
    """Each streamed module's forward goes into the fake's log as ("forward", group name) when it starts:
    a pre-hook registered after the engine's own (`hook_group`), so it runs after the engine's waits."""
    original = offload.hook_group

    def hook_group(module, group, schedule, computes=None):
        handles = original(module, group, schedule, computes)
        return handles + [module.register_forward_pre_hook(lambda m, args: fake.log.append(("forward", group.name)))]

    patch.setattr(offload, "hook_group", hook_group)


@dataclass
class Audit:
    """The fake's log read back: copy groups, and what the README promises about them."""

    log: list[tuple]
    problems: list[str] = field(default_factory=list)
    peak_streamed: int = 0
    peak_experts: int = 0  # streamed groups of both experts holding device memory at once

    def run(self, prefetch: int) -> "Audit":
        copies: dict[int, Copy] = {}
        pending, unclaimed, current = [], [], {}  # current: group -> its latest Copy
        on_device, in_flight, markers = set(), [], {}  # in_flight: (group, log index of its eviction)
        streamed_loop = [i for i, e in enumerate(self.log) if e[0] in ("onload", "prefetch", "evict") and "." in e[1]]
        loop = range(streamed_loop[0], streamed_loop[-1] + 1) if streamed_loop else range(0)
        for index, entry in enumerate(self.log):
            kind = entry[0]
            if kind == "copy":
                pending.append(entry)
            elif kind == "oom":
                pending = []  # that copy group was abandoned
            elif kind == "record":
                if pending:
                    streams = {c[1] for c in pending}
                    if streams != {entry[2]}:
                        self.problems.append(f"copies on {streams} but their event recorded on {entry[2]}")
                    copies[entry[1]] = Copy(entry[1], entry[2], [c[2] for c in pending])
                    unclaimed.append(copies[entry[1]])
                    pending = []
                else:
                    markers[entry[1]] = (entry[2], index)
            elif kind in ("onload", "prefetch"):
                streamed = "." in entry[1]
                copy = unclaimed.pop() if unclaimed else None
                unclaimed.clear()
                if copy is None:
                    self.problems.append(f"{entry[1]} {kind} without a copy")
                    continue
                copy.group, current[entry[1]] = entry[1], copy
                want = "side" if streamed else "compute"
                if copy.stream != want:
                    self.problems.append(f"{entry[1]} copied on the {copy.stream} stream, expected {want}")
                if streamed:
                    on_device.add(entry[1])
            elif kind == "wait_event":
                copy = copies.get(entry[2])
                if entry[1] != "compute" or copy is None or copy.stream != "side" or copy.group not in on_device:
                    self.problems.append(f"wait_event {entry} is not compute waiting on a resident block's side copy")
                else:
                    copy.waited = True
            elif kind == "forward":
                copy = current.get(entry[1])
                if copy is not None and copy.stream == "side" and not copy.waited:
                    self.problems.append(f"{entry[1]} ran before compute waited for its copy (event {copy.event})")
            elif kind == "record_stream":
                if entry[2] != "compute":
                    self.problems.append(f"record_stream on {entry[2]}")
            elif kind == "evict" and "." in entry[1]:
                copy = current.get(entry[1])
                on_device.discard(entry[1])
                if copy is not None and copy.waited:
                    marked = {e[1] for e in self.log[:index] if e[0] == "record_stream"}
                    missing = [p for p in copy.pointers if p not in marked]
                    if missing:
                        self.problems.append(f"{entry[1]} evicted before record_stream of {len(missing)} tensors")
                    # the engine records its compute-done marker just before it reports the eviction
                    previous = self.log[index - 1]
                    marked_at = markers[previous[1]][1] - 0.5 if previous[0] == "record" and previous[1] in markers else index
                    in_flight.append((entry[1], marked_at))
            elif kind == "event_sync" and entry[1] in markers:
                stream, recorded = markers[entry[1]]
                if stream == "compute":
                    in_flight = [(g, at) for g, at in in_flight if at > recorded]
            elif kind == "device_sync" and index in loop:
                self.problems.append(f"device-wide synchronize at log entry {index}, inside the streaming loop")
            held = [n.split(".")[0] for n in on_device] + [g.split(".")[0] for g, _ in in_flight]
            for component in set(held):
                self.peak_streamed = max(self.peak_streamed, held.count(component))
            self.peak_experts = max(self.peak_experts, sum(held.count(expert) for expert in EXPERTS))
        if self.peak_streamed > prefetch + 2:
            self.problems.append(f"{self.peak_streamed} streamed groups held device memory at once; at most {prefetch + 2}")
        if self.peak_experts > prefetch + 2:
            self.problems.append(f"{self.peak_experts} streamed groups of both experts held device memory at once; "
                                 f"at most {prefetch + 2}")
        return self


def own_pipeline(tiny_folder, variant: str):
    """A pipeline of this test's own: a pinning backend gives streamed tensors pinned homes for good."""
    return load_pipeline(tiny_folder(variant), "fp32")


def points_at_a_device_copy(pipe, fake: FakeCuda) -> list[str]:
    copied = {entry[2] for entry in fake.calls("copy")}
    return [name for name, (pointer, _) in storage_map(pipe).items() if pointer in copied]


@pytest.mark.parametrize("variant", ["wan2.1-t2v", "wan2.2-a14b", "cogvideox-t2v", "wan2.1-i2v"])
def test_cuda_backend_keeps_the_promised_order_in_every_tier(variant, tiny_folder, monkeypatch):
    loaded = own_pipeline(tiny_folder, variant)
    request = request_for(variant)
    reference = sample(loaded, MemoryStrategy(offload="none"), request, backend=CpuBackend()).latent["samples"]
    for label, strategy in tiers(block_count(loaded)).items():
        with monkeypatch.context() as patch:
            fake = FakeCuda().install(patch)
            log_forwards(patch, fake)
            result = sample(loaded, strategy, request, backend=CudaBackend(torch.device("cpu")), observer=fake.observe)
        assert torch.equal(result.latent["samples"], reference), f"{variant} {label}"
        assert not points_at_a_device_copy(loaded.pipe, fake), f"{variant} {label} left a tensor on the device"
        audit = Audit(fake.log).run(strategy.prefetch_blocks)
        assert not audit.problems, f"{variant} {label}: " + "; ".join(audit.problems[:5])
        if strategy.streams_blocks:
            assert fake.calls("wait_event") and fake.calls("record_stream") and fake.side_streams, label
            assert fake.calls("forward"), label  # the forward-order check had something to check
            assert any(c[1] == "side" for c in fake.calls("copy")), label
        else:
            assert not fake.calls("wait_event", "record_stream"), label


def test_the_audit_catches_a_backend_that_breaks_the_promises(tiny_folder, monkeypatch):
    """The checks can fail: copies on the compute stream, no record_stream, a synchronize per wait."""

    class Careless(CudaBackend):
        def copy_group(self, hosts, non_blocking, side_stream, timed):
            return super().copy_group(hosts, non_blocking, False, timed)  # never the side stream

        def wait(self, token, tensors):
            torch.cuda.synchronize()

    loaded = own_pipeline(tiny_folder, "wan2.1-t2v")
    with monkeypatch.context() as patch:
        fake = FakeCuda().install(patch)
        sample(loaded, MemoryStrategy(offload="block_swap", blocks_to_swap=1, prefetch_blocks=1), request_for("wan2.1-t2v"),
               backend=Careless(torch.device("cpu")), observer=fake.observe)
    problems = " ".join(Audit(fake.log).run(1).problems)
    assert "expected side" in problems and "device-wide synchronize" in problems


def test_the_audit_catches_a_block_that_runs_before_compute_waited_for_its_copy(tiny_folder, monkeypatch):
    class NoWait(CudaBackend):
        def wait(self, token, tensors):
            pass  # compute never waits on the copy's event

    loaded = own_pipeline(tiny_folder, "wan2.1-t2v")
    with monkeypatch.context() as patch:
        fake = FakeCuda().install(patch)
        log_forwards(patch, fake)
        sample(loaded, MemoryStrategy(offload="block_swap", blocks_to_swap=1, prefetch_blocks=1), request_for("wan2.1-t2v"),
               backend=NoWait(torch.device("cpu")), observer=fake.observe)
    assert "ran before compute waited for its copy" in " ".join(Audit(fake.log).run(1).problems)


def test_an_out_of_memory_error_in_a_copy_climbs_the_ladder(tiny_folder, monkeypatch):
    loaded = own_pipeline(tiny_folder, "wan2.1-t2v")
    request = request_for("wan2.1-t2v")
    reference = sample(loaded, MemoryStrategy(offload="none"), request, backend=CpuBackend()).latent["samples"]
    with monkeypatch.context() as patch:
        fake = FakeCuda(oom_at=3, oom_stream="side").install(patch)  # a prefetch inside the first step
        result = sample(loaded, MemoryStrategy(offload="block_swap", blocks_to_swap=2, prefetch_blocks=1), request, backend=CudaBackend(torch.device("cpu")),
                        observer=fake.observe)
    assert len(result.receipt["oom_ladder"]) == 1, "the injected out-of-memory error was not met by the ladder"
    assert not Audit(fake.log).run(2).problems
    assert torch.equal(result.latent["samples"], reference)
    assert not points_at_a_device_copy(loaded.pipe, fake)


@pytest.mark.parametrize("name", ["gguf_q8_0", "fp8_scaled"])
def test_the_disk_tier_streams_through_the_staging_ring_under_cuda(name, tmp_path, monkeypatch):
    """Weights memory-mapped from their file copy file -> pinned slot -> device on the side stream;
    a slot is reused only once its copy is done (as the fake's events report it), so the ring stays
    at prefetch + 2 slots."""
    from test_storage import inputs, load, tiers as storage_tiers, wan_state, write_model_file
    from vidmem.memory import StageComponents, apply_strategy
    from vidmem.memory.hostpool import HostPool

    write_model_file(tmp_path / f"wan.{name}", wan_state(), name)
    reference, _ = load(tmp_path / f"wan.{name}", torch.float32, dequantize_first=True)
    with torch.no_grad():
        expected = reference(**inputs(torch.float32))[0]
    blocks = len(load(tmp_path / f"wan.{name}", torch.float32)[0].blocks)
    for label, strategy in storage_tiers(blocks).items():
        if not strategy.streams_blocks:
            continue
        model, _ = load(tmp_path / f"wan.{name}", torch.float32)
        stage = StageComponents({"transformer": model}, {"transformer": model.blocks})
        with monkeypatch.context() as patch:
            fake = FakeCuda().install(patch)
            log_forwards(patch, fake)
            backend = CudaBackend(torch.device("cpu"))
            with torch.no_grad(), apply_strategy(stage, strategy, backend, fake.observe, HostPool(1 << 20)) as handle:
                handle.activate("transformer")
                got = model(**inputs(torch.float32))[0]
        assert torch.equal(got, expected), f"{name} {label}"
        assert backend.staging.staged_bytes > 0 and 0 < backend.staging.slots <= strategy.prefetch_blocks + 2, label
        assert len([e for e in fake.log if e[0] == "pin"]) >= backend.staging.slots, label
        audit = Audit(fake.log).run(strategy.prefetch_blocks)
        assert not audit.problems, f"{name} {label}: " + "; ".join(audit.problems[:5])


class _Pair(torch.Tensor):
    """A wrapper tensor subclass holding two inner tensors, as torchao's quantized tensors do."""

    @staticmethod
    def __new__(cls, a, b):
        return torch.Tensor._make_wrapper_subclass(cls, a.shape, dtype=a.dtype, device=a.device)

    def __init__(self, a, b):
        self.a, self.b = a, b

    def __tensor_flatten__(self):
        return ["a", "b"], None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} is not needed here")


def test_record_stream_reaches_the_inner_tensors_of_a_wrapper_subclass(monkeypatch):
    """The allocator tracks the inner tensors' memory: recording only the wrapper would free it for
    the next copy while a kernel still reads it."""
    from vidmem.memory.device import record_stream

    recorded = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, stream: recorded.append(t))
    plain, a, b = torch.zeros(2), torch.zeros(2), torch.ones(2)
    record_stream(plain, "compute")
    record_stream(_Pair(a, b), "compute")
    assert [id(t) for t in recorded] == [id(plain), id(a), id(b)]
