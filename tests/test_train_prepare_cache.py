"""The training-data cache: keyed on everything that changes an entry, entries written durably and
checked before they are trusted, prompt embeddings encoded once per caption and kept on disk."""

from __future__ import annotations

import os
import stat

import pytest
import safetensors.torch
import torch

from test_train_support import make_dataset, prepare_tiny, write_video
from vidmem.memory import MemoryStrategy, VaeTiling
from vidmem.memory.device import CpuBackend
from vidmem.training import BucketSettings, TrainingError, prepare_training_data


def entries(cache):
    return sorted((cache / "wan").glob("*.safetensors"))


def test_a_clip_rewritten_under_the_same_name_is_encoded_again(tiny_loaded, tmp_path):
    loaded = tiny_loaded("wan2.1-t2v")
    folder = make_dataset(tmp_path / "data", clips=2)
    first = prepare_tiny(loaded, folder, tmp_path / "cache")
    write_video(folder / "clip0.mp4", 9, 48, 32, seed=7)  # new content; same name, caption and bucket
    again = prepare_tiny(loaded, folder, tmp_path / "cache")
    assert again.receipt["encoded"] == 1 and again.receipt["reused"] == 1
    assert again.samples[0].key != first.samples[0].key and again.samples[1] == first.samples[1]
    assert not torch.equal(again.load(again.samples[0])[0], first.load(first.samples[0])[0])


@pytest.mark.parametrize("change", ["dtype", "vae_tiling"])
def test_another_dtype_or_vae_tiling_is_encoded_again(tiny_loaded, tiny_folder, tmp_path, change):
    from vidmem.pipelines.loader import load_pipeline

    folder, cache = make_dataset(tmp_path / "data", clips=1), tmp_path / "cache"
    loaded, strategy, buckets = tiny_loaded("wan2.1-t2v"), MemoryStrategy(offload="model"), BucketSettings(((32, 32),), (9,))
    assert prepare_training_data(loaded, folder, buckets, strategy, cache, CpuBackend()).receipt["encoded"] == 1
    if change == "dtype":
        loaded = load_pipeline(tiny_folder("wan2.1-t2v"), "bf16")
    else:
        strategy = MemoryStrategy(offload="model", vae_tiling=VaeTiling(tile_size=64, overlap=16))
    data = prepare_training_data(loaded, folder, buckets, strategy, cache, CpuBackend())
    assert data.receipt["encoded"] == 1 and len(entries(cache)) == 2


def test_an_entry_cut_short_is_encoded_again_and_a_bad_one_is_named_on_load(tiny_loaded, tmp_path):
    loaded = tiny_loaded("wan2.1-t2v")
    folder = make_dataset(tmp_path / "data", clips=2)
    first = prepare_tiny(loaded, folder, tmp_path / "cache")
    cut = tmp_path / "cache" / "wan" / f"{first.samples[0].key}.safetensors"
    whole = cut.read_bytes()
    cut.write_bytes(whole[: len(whole) // 2])  # what a crash without fsync can leave under the final name
    with pytest.raises(TrainingError, match=rf"prepared entry .*{first.samples[0].key}\.safetensors cannot be read.*"
                                            "run Prepare Training Data again"):
        first.load(first.samples[0])
    again = prepare_tiny(loaded, folder, tmp_path / "cache")
    assert again.receipt["encoded"] == 1 and again.receipt["reused"] == 1
    assert cut.read_bytes() == whole
    safetensors.torch.save_file({"something": torch.zeros(1)}, str(cut))  # a foreign file under the name
    assert prepare_tiny(loaded, folder, tmp_path / "cache").receipt["encoded"] == 1
    assert cut.read_bytes() == whole


def test_atomic_writes_reach_the_disk_before_and_after_the_rename(tmp_path, monkeypatch):
    from vidmem.pipelines.atomic import write_bytes_atomically

    events = []
    fsync, replace = os.fsync, os.replace

    def record_fsync(handle):
        events.append("fsync folder" if stat.S_ISDIR(os.fstat(handle).st_mode) else f"fsync {os.fstat(handle).st_size} B")
        fsync(handle)

    def record_replace(source, target):
        events.append("rename")
        replace(source, target)
    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(os, "replace", record_replace)
    write_bytes_atomically(tmp_path / "entry.bin", b"12345")
    expected = ["fsync 5 B", "rename"] + (["fsync folder"] if hasattr(os, "O_DIRECTORY") else [])
    assert events == expected and (tmp_path / "entry.bin").read_bytes() == b"12345"


def counting_prompts(monkeypatch):
    """The captions the text encoder is asked for, in order."""
    import vidmem.training.prepare as prepare

    asked = []
    encode = prepare._encode_prompt

    def spy(loaded, caption, device):
        asked.append(caption)
        return encode(loaded, caption, device)
    monkeypatch.setattr(prepare, "_encode_prompt", spy)
    return asked


def test_each_caption_is_encoded_once_and_read_back_from_disk(tiny_loaded, tmp_path, monkeypatch):
    import vidmem.training.prepare as prepare

    loaded = tiny_loaded("wan2.1-t2v")
    folder = make_dataset(tmp_path / "data", clips=3)
    (folder / "clip2.txt").write_text((folder / "clip0.txt").read_text())
    asked = counting_prompts(monkeypatch)
    on_disk = []
    encode_clip = prepare._encode_clip

    def spy_clip(*args):  # the VAE phase: every caption's embedding is on disk, not in a dict
        on_disk.append(len(list((tmp_path / "cache" / "wan" / "prompts").glob("*.safetensors"))))
        return encode_clip(*args)
    monkeypatch.setattr(prepare, "_encode_clip", spy_clip)
    data = prepare_tiny(loaded, folder, tmp_path / "cache")
    assert sorted(asked) == sorted({(folder / f"clip{i}.txt").read_text() for i in range(3)}) and len(asked) == 2
    assert on_disk == [2, 2, 2] and data.receipt["captions_encoded"] == 2
    assert list((tmp_path / "cache" / "wan" / "prompts").glob("*")) == []  # removed once every sample is written
    embeds = [data.load(sample)[1] for sample in data.samples]
    assert torch.equal(embeds[0], embeds[2]) and not torch.equal(embeds[0], embeds[1])
    with torch.no_grad():
        direct = prepare._encode_prompt(loaded, data.samples[1].caption, torch.device("cpu"))
    assert torch.equal(embeds[1], direct)


class Interrupted(Exception):
    """What the host's interrupt check raises (ComfyUI's is an Exception too)."""


def test_an_interrupted_run_keeps_its_embeddings_and_the_next_skips_the_text_encoder(tiny_loaded, tmp_path, monkeypatch):
    loaded = tiny_loaded("wan2.1-t2v")
    folder = make_dataset(tmp_path / "data", clips=2)
    checks = []

    def interrupt_at_the_second_clip():
        checks.append(1)
        if len(checks) == 4:  # two captions, then the first clip, then the second
            raise Interrupted
    buckets = BucketSettings(((32, 32),), (9,))
    with pytest.raises(Interrupted):
        prepare_training_data(loaded, folder, buckets, MemoryStrategy(offload="model"), tmp_path / "cache", CpuBackend(),
                              check_interrupt=interrupt_at_the_second_clip)
    assert len(list((tmp_path / "cache" / "wan" / "prompts").glob("*.safetensors"))) == 2
    asked = counting_prompts(monkeypatch)
    resumed = prepare_tiny(loaded, folder, tmp_path / "cache")
    assert asked == [] and resumed.receipt["encoded"] == 1 and resumed.receipt["captions_encoded"] == 0
    fresh = prepare_tiny(loaded, folder, tmp_path / "fresh")
    for a, b in zip(resumed.samples, fresh.samples):
        assert all(torch.equal(x, y) for x, y in zip(resumed.load(a), fresh.load(b)))
