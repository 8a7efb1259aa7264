"""Bad input: a clear error naming the input and the fix, and nothing left applied or moved."""

from __future__ import annotations

import json
import pickle
import shutil
from dataclasses import replace

import pytest
import safetensors.torch
import torch

from test_tiers import hooks_of, request_for, storage_map
from vidmem.memory import MemoryStrategy, StrategyError, VaeTiling
from vidmem.memory.device import CpuBackend
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.configs.meta import ComponentConfig
from vidmem.pipelines.loader import load_pipeline, read_model_index
from vidmem.pipelines.weight_check import check_against_ram, implied_weights, ram_need
from vidmem.pipelines.sample import sample
from vidmem.pipelines.tiny import build_tiny_pipeline


def test_missing_folder(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        load_pipeline(tmp_path / "nope")


def test_folder_without_model_index(tmp_path):
    with pytest.raises(ModelError, match="no model_index.json"):
        load_pipeline(tmp_path)


def test_other_family_is_named_with_the_supported_ones(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    with pytest.raises(ModelError, match="StableDiffusionPipeline.*supported: CogVideoXPipeline"):
        load_pipeline(tmp_path)


def test_unsupported_dtype(tiny_folder):
    with pytest.raises(ModelError, match="dtype='int8' is not supported; use one of bf16, fp16, fp32"):
        load_pipeline(tiny_folder("wan2.1-t2v"), "int8")


def test_pickle_weights_are_refused(tmp_path, monkeypatch):
    build_tiny_pipeline("wan2.1-t2v").save_pretrained(tmp_path, safe_serialization=False)
    _refuse_unpickling(monkeypatch)
    with pytest.raises(ModelError, match=r"\.bin' is named like a PyTorch pickle, and vidmem never unpickles"):
        load_pipeline(tmp_path, "fp32")


def _shard(folder, component="transformer", second="part-2.safetensors", pickled=False):
    """The component's weights split in two shards with a diffusers index listing them (the second named
    `second`, written with torch.save when `pickled`); the single file removed."""
    weights = folder / component / "diffusion_pytorch_model.safetensors"
    tensors = safetensors.torch.load_file(str(weights))
    names = sorted(tensors)
    first, rest = names[: len(names) // 2], names[len(names) // 2:]
    safetensors.torch.save_file({n: tensors[n] for n in first}, str(folder / component / "part-1.safetensors"))
    if pickled:
        torch.save({n: tensors[n] for n in rest}, folder / component / second)
    else:
        safetensors.torch.save_file({n: tensors[n] for n in rest}, str(folder / component / second))
    weight_map = {**dict.fromkeys(first, "part-1.safetensors"), **dict.fromkeys(rest, second)}
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}
    (folder / component / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    weights.unlink()


def test_a_sharded_folder_loads_as_the_single_file_does(tiny_folder, tmp_path):
    folder = _copy(tiny_folder, tmp_path)
    _shard(folder)
    sharded = load_pipeline(folder, "fp32").pipe.transformer.state_dict()
    single = load_pipeline(tiny_folder("wan2.1-t2v"), "fp32").pipe.transformer.state_dict()
    assert sharded.keys() == single.keys() and all(torch.equal(sharded[k], single[k]) for k in single)


@pytest.mark.parametrize("library", ["diffusers", "diffusers.models"])
def test_a_shard_index_naming_a_pickle_is_refused_unread(tiny_folder, tmp_path, monkeypatch, library):
    """diffusers reads the shards an index lists by name and hands any not named .safetensors to torch.load; a
    library spelled as a module of diffusers once skipped the folder's checks altogether."""
    folder = _copy(tiny_folder, tmp_path)
    _shard(folder, second="part-2.dat", pickled=True)
    index = json.loads((folder / "model_index.json").read_text())
    index["transformer"][0] = library
    (folder / "model_index.json").write_text(json.dumps(index))
    _refuse_unpickling(monkeypatch)
    with pytest.raises(ModelError, match=r"'transformer': .*index.json' lists the shard 'part-2.dat', which is not a "
                                         r"\.safetensors file of this folder;.*never unpickles"):
        load_pipeline(folder, "fp32")


def test_a_stale_bin_index_nothing_reads_does_not_refuse_the_folder(tiny_folder, tmp_path):
    """A download of *.json and *.safetensors from a repo that also ships .bin shards brings their index along;
    with use_safetensors diffusers never reads it (a .bin file present is refused by its name)."""
    folder = _copy(tiny_folder, tmp_path)
    index = {"metadata": {}, "weight_map": {"a.weight": "diffusion_pytorch_model-00001-of-00002.bin"}}
    (folder / "vae" / "diffusion_pytorch_model.bin.index.json").write_text(json.dumps(index))
    load_pipeline(folder, "fp32")


def test_a_shard_index_naming_a_missing_or_outside_file_is_refused(tiny_folder, tmp_path):
    folder = _copy(tiny_folder, tmp_path)
    _shard(folder, component="vae")
    (folder / "vae" / "part-2.safetensors").unlink()
    with pytest.raises(ModelError, match=r"'vae': .* lists the shard 'part-2.safetensors', which is missing .*re-download"):
        load_pipeline(folder, "fp32")
    index_path = folder / "vae" / "diffusion_pytorch_model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {name: "../transformer/diffusion_pytorch_model.safetensors" for name in index["weight_map"]}
    index_path.write_text(json.dumps(index))
    with pytest.raises(ModelError, match=r"lists the shard '\.\./transformer/diffusion_pytorch_model\.safetensors'"):
        load_pipeline(folder, "fp32")
    index_path.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ModelError, match=r"'vae': .* is a shard index without a weight_map"):
        load_pipeline(folder, "fp32")


def _copy(tiny_folder, tmp_path, variant="wan2.1-t2v"):
    folder = tmp_path / variant
    shutil.copytree(tiny_folder(variant), folder)
    return folder


def _refuse_unpickling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a pickle was about to be unpickled")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)


def test_a_pickle_named_safetensors_in_a_folder_is_refused_by_content_unread(tiny_folder, tmp_path, monkeypatch):
    """diffusers picks weights by name: the folder's files are sniffed before it sees them."""
    folder = _copy(tiny_folder, tmp_path)
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    torch.save({"weight": torch.zeros(2, 2)}, weights)
    _refuse_unpickling(monkeypatch)
    with pytest.raises(ModelError, match="'transformer': .*diffusion_pytorch_model.safetensors is a PyTorch pickle"):
        load_pipeline(folder, "fp32")


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.pth", "model.ckpt", "extra.pkl"])
def test_a_file_named_like_a_pickle_is_refused_even_beside_safetensors(tiny_folder, tmp_path, name):
    folder = _copy(tiny_folder, tmp_path)
    (folder / "vae" / name).write_bytes(b"not read")
    with pytest.raises(ModelError, match=f"'vae': .*{name}' is named like a PyTorch pickle.*Convert it to .safetensors"):
        load_pipeline(folder, "fp32")


def test_a_safetensors_file_named_sft_in_a_folder_is_named_with_the_fix(tiny_folder, tmp_path):
    folder = _copy(tiny_folder, tmp_path)
    weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
    weights.rename(weights.with_suffix(".sft"))
    with pytest.raises(ModelError, match="'vae': .* has no .safetensors weights \\(it holds .*\\.sft\\).*named \\*.safetensors"):
        load_pipeline(folder, "fp32")


@pytest.mark.parametrize("variant", ["wan2.1-t2v", "wan2.1-i2v", "wan2.2-ti2v", "cogvideox-t2v"])
def test_the_weights_a_config_implies_are_the_weights_its_files_hold(tiny_folder, variant):
    """The count the absurd-size check rests on: equal to the saved files' elements, component by component."""
    folder = tiny_folder(variant)
    index = read_model_index(folder)
    for name in ("transformer", "text_encoder", "vae", "image_encoder"):
        if index.get(name, [None])[0] is None:
            continue
        config = json.loads((folder / name / "config.json").read_text())
        implied = implied_weights(ComponentConfig(name, index[name][0], index[name][1], config), torch.float32)
        stored = 0
        for path in (folder / name).glob("*.safetensors"):
            stored += sum(t.numel() for t in safetensors.torch.load_file(str(path)).values())
        assert implied.numel == stored, name


def test_block_extrapolation_counts_what_a_full_build_holds():
    """implied_weights builds one and two blocks and extrapolates; a full build on meta agrees."""
    from vidmem.pipelines.comfy_files import shipped_catalogue
    from vidmem.pipelines.configs.meta import build_meta

    entry = {e.name: e for e in shipped_catalogue()}["wan2.1-t2v-1.3b"]
    for name in ("transformer", "text_encoder"):
        full = build_meta(entry.components[name], torch.bfloat16)
        if hasattr(full, "tie_weights"):
            full.tie_weights()  # the text encoder's shared embedding, counted once
        implied = implied_weights(entry.components[name], torch.bfloat16)
        assert implied.numel == sum(p.numel() for p in full.parameters()), name
        assert implied.nbytes == sum(p.numel() * p.element_size() for p in full.parameters()), name


def test_an_absurd_block_count_is_refused_without_building_the_blocks(tiny_folder, tmp_path):
    folder = _copy(tiny_folder, tmp_path)
    config = folder / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "num_layers": 10**7}))
    with pytest.raises(ModelError, match="transformer: .*config.json describes .* weights .* hold only"):
        load_pipeline(folder, "fp32")


def test_a_config_implying_more_than_ram_and_swap_is_refused_from_the_config_alone(tiny_folder):
    config = json.loads((tiny_folder("wan2.1-t2v") / "transformer" / "config.json").read_text())
    implied = implied_weights(ComponentConfig("transformer", "diffusers", "WanTransformer3DModel",
                                              {**config, "ffn_dim": 2**40}, "transformer/config.json"), torch.bfloat16)
    assert implied.nbytes > 2 * 2**40 * config["num_layers"]  # two ffn matrices per block, counted on meta
    with pytest.raises(ModelError, match=r"needs .* TB of RAM .* this machine has .* of RAM .*blocks\.0\.ffn"):
        check_against_ram([ram_need(implied)], "model folder 'x'", "Fix the config.")
    check_against_ram([ram_need(replace(implied, numel=1, nbytes=1, buffer_bytes=0))], "model folder 'x'", "")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(offload="block_swap"), "needs blocks_to_swap >= 1"),
        (dict(offload="model", blocks_to_swap=4), "only applies to offload='block_swap'"),
        (dict(offload="swap"), "offload='swap' is not one of 'none', 'model', 'block_swap', 'sequential'"),
        (dict(text_encoder="gpu"), "text_encoder='gpu' is not one of"),
        (dict(prefetch_blocks=-1), "prefetch_blocks=-1 must be 0 or more"),
    ],
)
def test_strategy_combinations(kwargs, message):
    with pytest.raises(StrategyError, match=message):
        MemoryStrategy(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tile_size=100), "tile_size=100 must be a multiple of 32; use 96 or 128"),
        (dict(tile_size=128, overlap=64), "overlap=64 must be between 0 and tile_size/4 = 32"),
        (dict(overlap=12), "overlap=12 must be a multiple of 8"),
        (dict(temporal_size=16, temporal_overlap=12), "temporal_overlap=12 must be between 0 and temporal_size/2 = 8"),
        (dict(temporal_size=6), "temporal_size=6 must be between 8 and 4096"),
    ],
)
def test_tiling_values(kwargs, message):
    with pytest.raises(StrategyError, match=message):
        VaeTiling(**kwargs)


def test_more_blocks_than_the_model_has_leaves_nothing_applied(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    before, hooks_before = storage_map(loaded.pipe), hooks_of(loaded.pipe)
    with pytest.raises(StrategyError, match="blocks_to_swap=99 but this model's transformer has 2 blocks; use 1..2"):
        sample(loaded, MemoryStrategy(offload="block_swap", blocks_to_swap=99), request_for("wan2.1-t2v"),
               backend=CpuBackend())
    assert storage_map(loaded.pipe) == before
    assert hooks_of(loaded.pipe) == hooks_before


@pytest.mark.parametrize(
    "variant, change, message",
    [
        ("wan2.1-t2v", dict(width=40), "width=40 must be a multiple of 16 for wan; use 32 or 48"),
        ("wan2.1-t2v", dict(height=8), "height=8 must be a multiple of 16"),
        ("wan2.1-t2v", dict(frames=10), r"frames=10 is not valid for wan: use 4k\+1 frames \(e.g. 9 or 13\)"),
        ("cogvideox-t2v", dict(frames=13), r"frames=13 is not valid for cogvideox: use 8k\+1 frames \(e.g. 9 or 17\)"),
        ("wan2.2-ti2v", dict(width=48), "width=48 must be a multiple of 32"),
        ("wan2.1-t2v", dict(steps=0), "steps=0 must be at least 1"),
        ("wan2.1-i2v", dict(image=None), "image-to-video: connect an IMAGE"),
    ],
)
def test_request_errors_name_the_input(variant, change, message, tiny_loaded):
    import dataclasses

    loaded = tiny_loaded(variant)
    before = storage_map(loaded.pipe)
    with pytest.raises(ModelError, match=message):
        sample(loaded, MemoryStrategy(), dataclasses.replace(request_for(variant), **change), backend=CpuBackend())
    assert storage_map(loaded.pipe) == before


def test_text_to_video_refuses_an_image(tiny_loaded):
    import dataclasses

    import torch

    request = dataclasses.replace(request_for("wan2.1-t2v"), image=torch.zeros(1, 32, 32, 3))
    with pytest.raises(ModelError, match="text-to-video: disconnect the image input"):
        sample(tiny_loaded("wan2.1-t2v"), MemoryStrategy(), request, backend=CpuBackend())


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(cfg=NAN), "cfg=nan is not a finite number"),  # would run unguided: NaN > 1 is False
        (dict(cfg=INF), "cfg=inf is not a finite number"),  # would give NaN frames
        (dict(cfg=-INF), "cfg=-inf is not a finite number"),
        (dict(cfg=-2.0), "cfg=-2.0 must be 0 or more"),
        (dict(cfg="5"), "cfg='5' must be a number"),
        (dict(steps=2.5), "steps=2.5 must be a whole number"),
        (dict(steps=True), "steps=True must be a whole number"),
        (dict(width=64.0), "width=64.0 must be a whole number"),
        (dict(frames=NAN), "frames=nan must be a whole number"),
        (dict(seed=-1), "seed=-1 must be between 0 and 18446744073709551615"),
        (dict(seed=2**64), "seed=18446744073709551616 must be between 0"),
        (dict(prompt=None), "prompt must be text, not NoneType"),
        (dict(negative_prompt=["a"]), "negative_prompt must be text, not list"),
    ],
)
def test_numbers_that_can_only_be_mistakes_are_refused(change, message, tiny_loaded):
    import dataclasses

    loaded = tiny_loaded("wan2.1-t2v")
    before, hooks_before = storage_map(loaded.pipe), hooks_of(loaded.pipe)
    with pytest.raises(ModelError, match=message):
        sample(loaded, MemoryStrategy(), dataclasses.replace(request_for("wan2.1-t2v"), **change), backend=CpuBackend())
    assert storage_map(loaded.pipe) == before and hooks_of(loaded.pipe) == hooks_before


def _image(fill=0.5, shape=(1, 32, 32, 3), dtype=None):
    import torch

    image = torch.full(shape, fill) if dtype is None else torch.zeros(shape, dtype=dtype)
    return image


@pytest.mark.parametrize(
    "image, message",
    [
        (_image(float("nan")), "image contains NaN or infinite pixels"),
        (_image(float("inf")), "image contains NaN or infinite pixels"),
        (_image(shape=(32, 32, 3)), r"image has shape \(32, 32, 3\)"),
        (_image(shape=(1, 32, 32, 5)), "expected a ComfyUI IMAGE"),
        (_image(shape=(1, 32, 32, 1)), r"expected a ComfyUI IMAGE \[batch, height, width, 3\]: a mask or one-channel "
                                       "picture: convert it with core Convert Mask to Image first"),
        (_image(shape=(0, 32, 32, 3)), "expected a ComfyUI IMAGE"),
        (_image(dtype=__import__("torch").uint8), "image has dtype torch.uint8"),
        ("a picture", "image is a str, not an IMAGE"),
    ],
)
def test_bad_images_are_refused_naming_the_input(image, message, tiny_loaded):
    import dataclasses

    loaded = tiny_loaded("wan2.1-i2v")
    before = storage_map(loaded.pipe)
    with pytest.raises(ModelError, match=message):
        sample(loaded, MemoryStrategy(), dataclasses.replace(request_for("wan2.1-i2v"), image=image), backend=CpuBackend())
    assert storage_map(loaded.pipe) == before


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_pinned_ram_gb=NAN), "max_pinned_ram_gb=nan is not a finite number"),
        (dict(max_pinned_ram_gb=INF), "max_pinned_ram_gb=inf is not a finite number"),
        (dict(max_pinned_ram_gb="4"), "max_pinned_ram_gb='4' must be a number"),
        (dict(prefetch_blocks=1.5), "prefetch_blocks=1.5 must be a whole number"),
        (dict(offload="block_swap", blocks_to_swap=2.0), "blocks_to_swap=2.0 must be a whole number"),
        (dict(non_blocking="false"), "non_blocking='false' must be true or false"),
        (dict(vae_tiling="yes"), "vae_tiling='yes' must be a VaeTiling or None"),
    ],
)
def test_strategy_numbers_are_checked_before_the_engine_sees_them(kwargs, message):
    with pytest.raises(StrategyError, match=message):
        MemoryStrategy(**kwargs)


def test_tiling_numbers_must_be_whole():
    with pytest.raises(StrategyError, match="tile_size=256.0 must be a whole number"):
        VaeTiling(tile_size=256.0)
