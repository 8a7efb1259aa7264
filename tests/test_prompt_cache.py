"""Prompt embeddings cached on disk: a repeated prompt never runs or onloads the text encoder and
gives the same latents bit for bit; the key follows the encoder's weights, dtype, length and text;
corrupt entries are rewritten; the folder stays under its cap; long prompts are reported."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time

import pytest
import torch

from backends import Recorder, StrictBackend
from test_tiers import hooks_of, request_for, storage_map
from vidmem.memory import MemoryStrategy
from vidmem.memory.device import CpuBackend
from vidmem.pipelines.hooks import RunHooks
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.prompt_cache import PromptCache, encoder_identity, prompt_key
from vidmem.pipelines.sample import sample


class EncoderCalls:
    def __init__(self, encoder: torch.nn.Module) -> None:
        self.count = 0
        self.handle = encoder.register_forward_hook(self._seen)

    def _seen(self, *args) -> None:
        self.count += 1

    def __enter__(self) -> "EncoderCalls":
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def cached(folder, **kwargs) -> RunHooks:
    return RunHooks(prompt_cache=PromptCache(folder, **kwargs))


@pytest.mark.parametrize("variant", ["wan2.1-t2v", "cogvideox-t2v"])
@pytest.mark.parametrize("offload", ["none", "model", "block_swap"])
def test_a_repeated_prompt_never_runs_or_onloads_the_encoder(variant, offload, tiny_loaded, tmp_path):
    loaded = tiny_loaded(variant)
    strategy = MemoryStrategy(offload=offload, blocks_to_swap=1 if offload == "block_swap" else 0,
                              text_encoder="device")
    plain = sample(loaded, strategy, request_for(variant), backend=CpuBackend())
    assert plain.receipt["text_encode"]["cache"] == "off"
    first = sample(loaded, strategy, request_for(variant), cached(tmp_path), backend=CpuBackend())
    assert first.receipt["text_encode"]["cache"] == "encoded, stored"
    assert len(list(tmp_path.glob("*.safetensors"))) == 2  # the prompt and the negative prompt (cfg > 1)
    before, hooks_before = storage_map(loaded.pipe), hooks_of(loaded.pipe)
    recorder = Recorder()
    with EncoderCalls(loaded.pipe.text_encoder) as calls:
        again = sample(loaded, strategy, request_for(variant), cached(tmp_path), backend=StrictBackend(),
                       observer=recorder)
    assert calls.count == 0, "the text encoder ran although both embeddings were cached"
    assert not [event for event in recorder.events if event[1].startswith("text_encoder")]
    assert again.receipt["text_encode"]["cache"] == "used"
    assert again.receipt["text_encode"]["cache_folder"] == str(tmp_path)
    for result in (first, again):
        assert torch.equal(result.latent["samples"], plain.latent["samples"])
    assert storage_map(loaded.pipe) == before and hooks_of(loaded.pipe) == hooks_before
    assert not list(tmp_path.glob(".*.part")), "a temp file was left behind"


def test_only_the_missing_text_is_encoded(tiny_loaded, tmp_path):
    loaded = tiny_loaded("wan2.1-t2v")
    sample(loaded, MemoryStrategy(), request_for("wan2.1-t2v"), cached(tmp_path), backend=CpuBackend())
    request = dataclasses.replace(request_for("wan2.1-t2v"), negative_prompt="blurry")
    with EncoderCalls(loaded.pipe.text_encoder) as calls:
        result = sample(loaded, MemoryStrategy(), request, cached(tmp_path), backend=CpuBackend())
    assert calls.count == 1
    assert result.receipt["text_encode"]["cache"] == "used for 1 of 2 texts; the rest encoded, stored"
    unguided = dataclasses.replace(request_for("wan2.1-t2v"), cfg=1.0)  # no negative prompt is encoded
    with EncoderCalls(loaded.pipe.text_encoder) as calls:
        result = sample(loaded, MemoryStrategy(), unguided, cached(tmp_path), backend=CpuBackend())
    assert calls.count == 0 and result.receipt["text_encode"]["cache"] == "used"
    assert "negative_prompt" not in result.receipt["text_encode"]


def test_the_key_follows_weights_dtype_length_and_text(tiny_loaded, tiny_folder):
    encoder = tiny_loaded("wan2.1-t2v").pipe.text_encoder
    identity = encoder_identity(encoder)
    reloaded = load_pipeline(tiny_folder("wan2.1-t2v"), "fp32").pipe.text_encoder
    assert encoder_identity(reloaded) == identity, "the same weights loaded again must hit"
    tuned = copy.deepcopy(encoder)
    with torch.no_grad():
        tuned.encoder.block[1].layer[1].DenseReluDense.wo.weight.add_(1e-3)  # a fine-tune moves every value
    assert encoder_identity(tuned) != identity
    assert encoder_identity(copy.deepcopy(encoder).to(torch.bfloat16)) != identity
    key = prompt_key(identity, torch.float32, 512, "a cat", [1, 2])
    assert len({key, prompt_key(identity, torch.bfloat16, 512, "a cat", [1, 2]),
                prompt_key(identity, torch.float32, 226, "a cat", [1, 2]),
                prompt_key(identity, torch.float32, 512, "a cat ", [1, 2]),
                prompt_key(identity, torch.float32, 512, "a cat", [1, 3])}) == 5


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "other_key", "nan"])
def test_a_corrupt_entry_is_ignored_and_rewritten(damage, tiny_loaded, tmp_path):
    loaded = tiny_loaded("wan2.1-t2v")
    reference = sample(loaded, MemoryStrategy(), request_for("wan2.1-t2v"), cached(tmp_path), backend=CpuBackend())
    entries = sorted(tmp_path.glob("*.safetensors"))
    for entry in entries:
        good = entry.read_bytes()
        if damage == "garbage":
            entry.write_bytes(b"\x80\x03}q\x00." * 10)  # a pickle, say: it must never be unpickled
        elif damage == "truncated":
            entry.write_bytes(good[: len(good) // 2])
        elif damage == "empty":
            entry.write_bytes(b"")
        elif damage == "other_key":
            entry.write_bytes(good.replace(entry.stem.encode(), b"0" * 64))
        else:
            PromptCache(tmp_path).store(entry.stem, torch.full((1, 512, 32), float("nan")))
    with EncoderCalls(loaded.pipe.text_encoder) as calls:
        result = sample(loaded, MemoryStrategy(), request_for("wan2.1-t2v"), cached(tmp_path), backend=CpuBackend())
    assert calls.count == 2 and result.receipt["text_encode"]["cache"] == "encoded, stored"
    assert torch.equal(result.latent["samples"], reference.latent["samples"])
    assert all(PromptCache(tmp_path).load(entry.stem) is not None for entry in entries), "rewritten intact"


def test_an_unwritable_folder_costs_the_cache_not_the_run(tiny_loaded, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    loaded = tiny_loaded("wan2.1-t2v")
    result = sample(loaded, MemoryStrategy(), request_for("wan2.1-t2v"), cached(blocker / "cache"), backend=CpuBackend())
    assert result.receipt["text_encode"]["cache"] == "encoded, not stored (the cache folder cannot be written)"
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]


def test_the_folder_is_bounded_least_recently_used_first(tmp_path):
    tensor = torch.zeros(1, 8, 32)
    PromptCache(tmp_path).store("probe", tensor)
    size = (tmp_path / "probe.safetensors").stat().st_size
    (tmp_path / "probe.safetensors").unlink()
    cache = PromptCache(tmp_path, max_bytes=2 * size)
    for age, key in enumerate(["old", "middle"]):
        cache.store(key, tensor)
        os.utime(tmp_path / f"{key}.safetensors", (time.time() - 100 + age, time.time() - 100 + age))
    assert cache.load("old") is not None  # a hit makes "old" the most recently used
    cache.store("new", tensor)
    assert sorted(p.stem for p in cache.entries()) == ["new", "old"]
    stale = tmp_path / ".crashed.safetensors.x1.part"
    stale.write_bytes(b"x")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    fresh = tmp_path / ".writing.safetensors.x2.part"
    fresh.write_bytes(b"x")
    cache.prune()
    assert not stale.exists() and fresh.exists(), "only temp files a crash left behind are removed"


def test_cache_arguments_are_checked(tmp_path):
    for bad in (-1, 1.5, True, "2GB"):
        with pytest.raises(ValueError, match="max_bytes"):
            PromptCache(tmp_path, max_bytes=bad)


def test_a_prompt_longer_than_the_encoder_reads_is_reported(tiny_loaded, caplog):
    loaded = tiny_loaded("wan2.1-t2v")
    request = dataclasses.replace(request_for("wan2.1-t2v"), prompt="a cat " * 400, negative_prompt="dog")
    with caplog.at_level(logging.WARNING, logger="vidmem"):
        receipt = sample(loaded, MemoryStrategy(), request, backend=CpuBackend()).receipt["text_encode"]
    tokens = len(loaded.pipe.tokenizer(request.prompt)["input_ids"])
    assert tokens > 512
    assert receipt["prompt"] == {"tokens": tokens, "kept": 512, "cut": tokens - 512, "max_sequence_length": 512}
    assert receipt["negative_prompt"]["cut"] == 0
    assert f"the last {tokens - 512} are cut" in caplog.text
    short = sample(loaded, MemoryStrategy(), request_for("wan2.1-t2v"), backend=CpuBackend()).receipt["text_encode"]
    assert short["prompt"]["cut"] == 0 and short["prompt"]["tokens"] < 512


def test_host_folder_explicit_env_and_default(monkeypatch, tmp_path):
    from vidmem.nodes import host

    assert host.prompt_cache_folder(tmp_path / "mine") == tmp_path / "mine"
    if host.in_comfyui():
        pytest.skip("inside ComfyUI the folder is ComfyUI's")
    monkeypatch.setenv("VIDMEM_CACHE_DIR", str(tmp_path / "env"))
    assert host.prompt_cache_folder() == tmp_path / "env" / "prompt_embeddings"
    monkeypatch.delenv("VIDMEM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(host.sys, "platform", "linux")
    assert host.prompt_cache_folder() == tmp_path / "xdg" / "vidmem" / "prompt_embeddings"


@pytest.mark.parametrize("storage", ["fp8_scaled", "gguf_q8_0"])
def test_the_cache_works_for_stored_weights_on_disk(storage, tmp_path):
    """Encoder weights kept as fp8 / GGUF buffers, memory-mapped from their files: the identity
    reads them where they rest, and a hit still skips the encoder."""
    from fuzz_support import tiny_comfy_module
    from vidmem.pipelines.comfy_files import LoadOptions, load_model_files

    tiny = tiny_comfy_module()
    files = tiny.save_tiny_comfy_files("wan2.1-t2v", tmp_path / "models", storage).files
    loaded = load_model_files(files, LoadOptions(dtype="fp32", weights_on_disk=True), tiny.tiny_catalogue())
    request = request_for("wan2.1-t2v")
    first = sample(loaded, MemoryStrategy(), request, cached(tmp_path / "cache"), backend=CpuBackend())
    with EncoderCalls(loaded.pipe.text_encoder) as calls:
        again = sample(loaded, MemoryStrategy(offload="block_swap", blocks_to_swap=1), request,
                       cached(tmp_path / "cache"), backend=CpuBackend())
    assert calls.count == 0 and again.receipt["text_encode"]["cache"] == "used"
    assert torch.equal(first.latent["samples"], again.latent["samples"])


def test_encoder_identity_samples_stay_in_range_past_float32_precision():
    """A table of 2**24 + 3 values: a float32 linspace would round the last index past the end."""
    from vidmem.pipelines.prompt_cache import _sampled_bytes

    table = torch.arange(2**24 + 3, dtype=torch.int32)
    sampled = torch.frombuffer(bytearray(_sampled_bytes("shared.weight", table)), dtype=torch.int32)
    assert sampled[0] == 0 and sampled[-1] == 2**24 + 2 and bool((sampled[1:] > sampled[:-1]).all())


def test_encoder_identity_reads_fp8_weights_by_their_bits():
    """Indexing a float8 tensor is not implemented on the CPU: the identity must not need it."""
    from vidmem.pipelines.prompt_cache import _sampled_bytes

    weights = torch.linspace(-2, 2, 100).to(torch.float8_e4m3fn)
    sampled = _sampled_bytes("encoder.block.0.weight", weights)
    assert len(sampled) == 16 and sampled != _sampled_bytes("other", weights.to(torch.float32).mul(2).to(torch.float8_e4m3fn))
