"""LTX-2's sound (issue 27): the sampler keeps the audio latents in the LATENT on every tier, the
video unchanged; Decode Audio makes ComfyUI's AUDIO from them as diffusers' LTX2Pipeline does, loading
the audio VAE and vocoder for its own call only (from the folder, or the single checkpoint's audio VAE);
a video-only graph never loads them; bad input is refused naming the input and the fix."""

from __future__ import annotations

import json
import shutil

import diffusers
import pytest
import torch
from safetensors.torch import load_file, save_file

from test_ltx2 import STEPS, TIERS, VARIANT, request
from vidmem.memory.device import CpuBackend
from vidmem.pipelines.decode import decode
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.hooks import RunHooks
from vidmem.pipelines.loader import load_pipeline
from vidmem.pipelines.ltx2 import AUDIO_PARTS
from vidmem.pipelines.ltx2_audio import AUDIO_KEY, audio_latents, decode_audio
from vidmem.pipelines.sample import sample
from vidmem.pipelines.tiny import tiny_call_kwargs

CPU = torch.device("cpu")


def plain(folder, output_type: str):
    """diffusers' own LTX2Pipeline on the folder, audio VAE and vocoder loaded: (video, audio)."""
    pipe = diffusers.LTX2Pipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    output = pipe(**dict(tiny_call_kwargs(VARIANT, steps=STEPS, output_type=output_type), prompt="a cat", guidance_scale=5.0))
    return output.frames, output.audio, pipe.vocoder.config.output_sampling_rate


def no_audio_parts(pipe) -> bool:
    return all(getattr(pipe, name, None) is None for name in AUDIO_PARTS) and \
        not any(isinstance(m, (diffusers.AutoencoderKLLTX2Audio,)) for m in pipe.components.values())


@pytest.fixture
def audio_stats_folder(tiny_folder, tmp_path):
    """The tiny folder with audio statistics that are not 0 and 1, so a decode that skips the
    denormalisation (or applies it twice) gives another sound."""
    folder = tmp_path / "ltx2"
    shutil.copytree(tiny_folder(VARIANT), folder)
    weights = next((folder / "audio_vae").glob("*.safetensors"))
    tensors = load_file(str(weights))
    features = tensors["latents_mean"].numel()
    tensors["latents_mean"] = torch.linspace(-0.5, 0.5, features)
    tensors["latents_std"] = torch.linspace(0.5, 2.0, features)
    save_file(tensors, str(weights))
    return folder


def test_every_tier_keeps_the_audio_latents_and_the_video_is_unchanged(tiny_loaded, tiny_folder):
    loaded = tiny_loaded(VARIANT)
    video, audio, _ = plain(tiny_folder(VARIANT), "latent")
    assert no_audio_parts(loaded.pipe)
    for label, strategy in TIERS.items():
        latent = sample(loaded, strategy, request(), backend=CpuBackend()).latent
        assert torch.equal(latent["samples"], video), f"{label}: the video changed"
        # The tiny audio VAE's statistics are 0 and 1: normalised and denormalised latents are the same bits.
        assert torch.equal(latent[AUDIO_KEY], audio), f"{label}: the audio latents differ from diffusers'"
        assert latent[AUDIO_KEY].device.type == "cpu" and latent["vidmem"]["audio"]["normalised"]
    assert no_audio_parts(loaded.pipe)


def test_the_sound_equals_diffusers_own_and_the_audio_parts_are_dropped(audio_stats_folder):
    _, expected, rate = plain(audio_stats_folder, "pt")
    loaded = load_pipeline(audio_stats_folder, "fp32")
    latent = sample(loaded, TIERS["block_swap:1"], request(), backend=CpuBackend()).latent
    assert no_audio_parts(loaded.pipe)
    asked = []
    hooks = RunHooks(make_room=lambda nbytes, device, warm=None, weight_bytes=0: asked.append((nbytes, device)))
    result = decode_audio(loaded, latent, device=CPU, hooks=hooks)
    assert torch.equal(result.waveform, expected.float())
    parts = [diffusers.AutoencoderKLLTX2Audio.from_pretrained(audio_stats_folder / "audio_vae"),
             diffusers.pipelines.ltx2.vocoder.LTX2Vocoder.from_pretrained(audio_stats_folder / "vocoder")]
    assert asked == [(sum(t.numel() * 4 for part in parts for t in part.state_dict().values()), CPU)]  # their fp32 bytes
    assert result.waveform.shape[:2] == (1, 2) and result.waveform.device.type == "cpu"
    assert result.sample_rate == rate and isinstance(result.sample_rate, int)
    assert result.as_comfy() == {"waveform": result.waveform, "sample_rate": rate}
    assert no_audio_parts(loaded.pipe)  # loaded for the decode only, never hung on the pipeline
    skipped = dict(latent, vidmem=dict(latent["vidmem"], audio=dict(latent["vidmem"]["audio"], normalised=False)))
    assert not torch.equal(decode_audio(loaded, skipped, device=CPU).waveform, expected.float())


def test_a_video_only_graph_never_loads_the_audio_parts(tiny_folder, monkeypatch):
    """Load, sample on two tiers, decode the video: no audio VAE or vocoder is ever built."""
    from diffusers.pipelines.ltx2 import vocoder

    built = []
    for cls in (diffusers.AutoencoderKLLTX2Audio, vocoder.LTX2Vocoder):
        for verb in ("from_pretrained", "from_config"):  # how diffusers (and vidmem) build a component
            original = getattr(cls, verb).__func__
            monkeypatch.setattr(cls, verb, classmethod(
                lambda c, *a, _o=original, **k: (built.append(c), _o(c, *a, **k))[1]))
    loaded = load_pipeline(tiny_folder(VARIANT), "fp32")
    for tier in ("model", "sequential"):
        latent = sample(loaded, TIERS[tier], request(), backend=CpuBackend()).latent
    frames = decode(loaded, latent, backend=CpuBackend()).frames
    assert frames.shape[0] == 9 and not built and no_audio_parts(loaded.pipe)
    decode_audio(loaded, latent, device=CPU)
    assert set(built) == {diffusers.AutoencoderKLLTX2Audio, vocoder.LTX2Vocoder}  # the test can see a load


def test_the_single_checkpoints_audio_vae_is_used(tiny_folder, tmp_path):
    """A folder without audio VAE weights under a checkpoint that carries them: the file's audio VAE."""
    from test_comfy_files_ltx2 import EXTRAS, parts_of
    from vidmem.pipelines.comfy_files.write import write_ltx2_checkpoint
    from vidmem.pipelines.tiny import build_tiny_pipeline

    folder = tmp_path / "ltx2"
    shutil.copytree(tiny_folder(VARIANT), folder)
    reference = load_pipeline(tiny_folder(VARIANT), "fp32")
    latent = sample(reference, TIERS["model"], request(), backend=CpuBackend()).latent
    expected = decode_audio(reference, latent, device=CPU).waveform
    for weights in (folder / "audio_vae").glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(ModelError, match="no weights for audio_vae"):
        decode_audio(load_pipeline(folder, "fp32"), latent, device=CPU)
    checkpoint = write_ltx2_checkpoint(parts_of(build_tiny_pipeline(VARIANT)), tmp_path / "ltx-2-tiny.safetensors", EXTRAS)
    loaded = load_pipeline(folder, "fp32", checkpoint)
    assert loaded.transformer_file == str(checkpoint) and no_audio_parts(loaded.pipe)
    result = decode_audio(loaded, latent, device=CPU)
    assert torch.equal(result.waveform, expected) and result.receipt["audio_vae"] == checkpoint.name
    from_file = sample(loaded, TIERS["block_swap:1"], request(), backend=CpuBackend()).latent  # sampled from the file
    assert torch.equal(from_file[AUDIO_KEY], latent[AUDIO_KEY]) and torch.equal(from_file["samples"], latent["samples"])
    assert torch.equal(decode_audio(loaded, from_file, device=CPU).waveform, expected)


def test_a_gguf_transformer_over_a_folder_without_the_audio_vae_names_what_to_copy(tiny_folder, tmp_path):
    """A GGUF file is no safetensors file: its header is read by the loader's reader, which finds no
    audio VAE in it, and the folder's missing weights are named."""
    from vidmem.pipelines.comfy_files.write import store_tensors, write_ltx2_checkpoint
    from vidmem.pipelines.tiny import build_tiny_pipeline

    folder = shutil.copytree(tiny_folder(VARIANT), tmp_path / "ltx2")
    for weights in (folder / "audio_vae").glob("*.safetensors"):
        weights.unlink()
    stored = store_tensors(build_tiny_pipeline(VARIANT).transformer, "gguf_q8_0")
    path = write_ltx2_checkpoint({"transformer": stored}, tmp_path / "ltx-2-19b-dev-Q8_0.gguf")
    loaded = load_pipeline(folder, "fp32", path)
    latent = sample(loaded, TIERS["none"], request(steps=2), backend=CpuBackend()).latent
    with pytest.raises(ModelError, match=r"has no weights for audio_vae.*copy audio_vae/ \(config.json and weights\)"):
        decode_audio(loaded, latent, device=CPU)


def test_a_latent_without_sound_names_the_input_and_the_fix(tiny_loaded):
    loaded = tiny_loaded(VARIANT)
    latent = sample(loaded, TIERS["none"], request(steps=2), backend=CpuBackend()).latent
    video_only = {"samples": latent["samples"]}  # as core Load Latent gives it back
    with pytest.raises(ModelError, match="latent: it has no 'audio_samples'.*sample again"):
        decode_audio(loaded, video_only, device=CPU)
    with pytest.raises(ModelError, match="latent: it came from a wan model, which makes no sound"):
        decode_audio(loaded, dict(latent, vidmem={"family": "wan"}), device=CPU)
    with pytest.raises(ModelError, match="NaN"):
        decode_audio(loaded, dict(latent, audio_samples=torch.full_like(latent[AUDIO_KEY], float("nan"))), device=CPU)
    with pytest.raises(ModelError, match="3 channels x 2 mel bins, but this pipeline's audio VAE decodes 2 x 2"):
        decode_audio(loaded, dict(latent, audio_samples=torch.zeros(1, 3, 9, 2)), device=CPU)
    with pytest.raises(ModelError, match="not audio latents"):
        audio_latents(loaded, dict(latent, audio_samples=torch.zeros(1, 2, 9)))


def test_a_mismatched_pipeline_is_named(tiny_loaded):
    latent = sample(tiny_loaded(VARIANT), TIERS["none"], request(steps=2), backend=CpuBackend()).latent
    with pytest.raises(ModelError, match="pipeline: Decode Audio decodes LTX-2's sound, but the pipeline is wan"):
        decode_audio(tiny_loaded("wan2.1-t2v"), latent, device=CPU)


def test_a_folder_without_a_vocoder_names_what_to_copy(tiny_folder, tmp_path):
    folder = tmp_path / "ltx2"
    shutil.copytree(tiny_folder(VARIANT), folder)
    shutil.rmtree(folder / "vocoder")
    loaded = load_pipeline(folder, "fp32")  # video needs no vocoder
    latent = sample(loaded, TIERS["none"], request(steps=2), backend=CpuBackend()).latent
    with pytest.raises(ModelError, match=r"has no weights for vocoder.*copy vocoder/ \(config.json and weights\)"):
        decode_audio(loaded, latent, device=CPU)
    assert no_audio_parts(loaded.pipe)


def test_the_audio_parts_folders_are_checked_for_pickles_before_diffusers_reads_them(tiny_folder, tmp_path, monkeypatch):
    """The loader's folder check skips the audio VAE and vocoder (the pipeline never loads them): Decode Audio
    checks their folders itself, so an index naming a pickled shard is refused unread."""
    folder = tmp_path / "ltx2"
    shutil.copytree(tiny_folder(VARIANT), folder)
    loaded = load_pipeline(folder, "fp32")
    latent = sample(loaded, TIERS["none"], request(steps=2), backend=CpuBackend()).latent
    weights = next((folder / "vocoder").glob("*.safetensors"))
    tensors = load_file(str(weights))
    names = sorted(tensors)
    save_file({name: tensors[name] for name in names[:1]}, str(folder / "vocoder" / "part-1.safetensors"))
    torch.save({name: tensors[name] for name in names[1:]}, folder / "vocoder" / "weights.dat")
    weights.unlink()
    weight_map = {name: "part-1.safetensors" if name in names[:1] else "weights.dat" for name in names}
    (folder / "vocoder" / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: pytest.fail("a pickle was about to be unpickled"))
    with pytest.raises(ModelError, match=r"'vocoder': .* lists the shard 'weights.dat', which is not a \.safetensors"):
        decode_audio(loaded, latent, device=CPU)
    assert no_audio_parts(loaded.pipe)


def test_the_node_returns_comfy_audio(tiny_loaded):
    from vidmem.nodes.decode_audio import VidMemDecodeAudio

    loaded = tiny_loaded(VARIANT)
    latent = sample(loaded, TIERS["none"], request(), backend=CpuBackend()).latent
    out = VidMemDecodeAudio().decode(loaded, latent)
    (audio,) = out["result"]
    assert set(audio) == {"waveform", "sample_rate"} and audio["waveform"].ndim == 3
    assert audio["waveform"].device.type == "cpu" and audio["waveform"].dtype == torch.float32
    assert "Hz" in out["ui"]["text"][0]
    with pytest.raises(ModelError, match="pipeline \\(Decode Audio\\) got"):
        VidMemDecodeAudio().decode("not a pipeline", latent)
    assert json.dumps(out["ui"]["vidmem_receipt"])  # the receipt is plain data


def test_a_run_resumed_after_out_of_memory_keeps_its_sound(tiny_loaded):
    """The audio latents resume with the video's (test_ltx2 checks both bit for bit against an
    uninterrupted run): the LATENT keeps them and Decode Audio decodes them."""
    from test_oom_ladder import InjectOOM, run
    from vidmem.memory import MemoryStrategy

    loaded = tiny_loaded(VARIANT)
    with InjectOOM(loaded.pipe.transformer.transformer_blocks[-1], [2]) as oom:  # step 3: cfg is one batch
        result = run(loaded, MemoryStrategy(offload="model"), request(steps=4))
    assert oom.raised == 1 and result.receipt["oom_ladder"][0]["resumed_from_step"] == 1
    assert result.latent[AUDIO_KEY].ndim == 4 and "dropped" not in result.latent["vidmem"]["audio"]
    assert decode_audio(loaded, result.latent, device=CPU).waveform.ndim == 3


@pytest.mark.parametrize("metadata, words", [
    ("x", "its 'vidmem' metadata is str, not the dict"),
    ({"family": "ltx2", "audio": None}, "its vidmem 'audio' entry is NoneType, not the dict"),
    ({"family": "ltx2", "audio": [1]}, "its vidmem 'audio' entry is list, not the dict")])
def test_malformed_metadata_is_refused_by_name(tiny_loaded, metadata, words):
    """Used to be a raw AttributeError ('NoneType' object has no attribute 'get')."""
    loaded = tiny_loaded(VARIANT)
    latent = sample(loaded, TIERS["none"], request(steps=2), backend=CpuBackend()).latent
    with pytest.raises(ModelError, match=f"latent: {words}.*sample again"):
        decode_audio(loaded, dict(latent, vidmem=metadata), device=CPU)


def test_image_to_video_keeps_its_sound_too(tiny_loaded):
    loaded = tiny_loaded(VARIANT)
    image = torch.full((1, 64, 64, 3), 0.5)
    latent = sample(loaded, TIERS["model"], request(image=image), backend=CpuBackend()).latent
    assert latent["vidmem"]["class_name"] == "LTX2ImageToVideoPipeline" and latent[AUDIO_KEY].ndim == 4
    result = decode_audio(loaded, latent, device=CPU)
    assert result.waveform.ndim == 3 and torch.isfinite(result.waveform).all()
    assert no_audio_parts(loaded.pipe) and no_audio_parts(loaded.image_mode().pipe)


class KeptStore:
    """A warm store as memory/warm.py registers them (`track`): it counts what it is asked to give back."""

    held_bytes = 1 << 20

    def __init__(self) -> None:
        self.asked = []

    def release(self, nbytes: int) -> int:
        self.asked.append(nbytes)
        return 0

    def release_all(self) -> int:
        self.asked.append("all")
        return 0


def test_decode_audio_leaves_the_weights_other_pipelines_keep_warm(tiny_loaded):
    from vidmem.memory.warm import track

    loaded = tiny_loaded(VARIANT)
    latent = sample(loaded, TIERS["none"], request(steps=2), backend=CpuBackend()).latent
    store = KeptStore()
    track(store)
    decode_audio(loaded, latent, device=CPU)
    assert store.asked == []  # a warm run after Decode Audio still finds its weights
    from vidmem.memory.cleanup import free_memory

    free_memory(CPU)
    assert store.asked == ["all"]  # the test can see a release


def diffusers_order(folder, audio: torch.Tensor, dtype: torch.dtype, cast_first: bool = False) -> torch.Tensor:
    """LTX2Pipeline's audio tail by hand: denormalise the fp32 latents, then cast (or, `cast_first`, the other way)."""
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    audio_vae = diffusers.AutoencoderKLLTX2Audio.from_pretrained(folder / "audio_vae", torch_dtype=dtype).eval()
    vocoder = LTX2Vocoder.from_pretrained(folder / "vocoder", torch_dtype=dtype).eval()
    z = audio.to(dtype) if cast_first else audio
    packed = diffusers.LTX2Pipeline._pack_audio_latents(z)
    packed = diffusers.LTX2Pipeline._denormalize_audio_latents(packed, audio_vae.latents_mean, audio_vae.latents_std)
    z = diffusers.LTX2Pipeline._unpack_audio_latents(packed, audio.shape[2], num_mel_bins=audio.shape[3])
    with torch.no_grad():
        return vocoder(audio_vae.decode(z.to(dtype), return_dict=False)[0]).float()


def sound_latent(audio: torch.Tensor) -> dict:
    metadata = {"family": "ltx2", "audio": {"normalised": True}}
    return {"samples": torch.zeros(1, 4, 2, 2, 2), AUDIO_KEY: audio, "vidmem": metadata}


def test_bf16_denormalises_in_fp32_before_the_cast_as_diffusers_does(audio_stats_folder):
    audio = torch.randn(1, 2, 9, 2, generator=torch.Generator().manual_seed(0)) * 3
    result = decode_audio(load_pipeline(audio_stats_folder, "bf16"), sound_latent(audio), device=CPU)
    assert torch.equal(result.waveform, diffusers_order(audio_stats_folder, audio, torch.bfloat16))
    assert not torch.equal(result.waveform, diffusers_order(audio_stats_folder, audio, torch.bfloat16, cast_first=True))


def record_parts(monkeypatch) -> list:
    """The audio VAEs and vocoders decode_audio loads, kept here so the test can look at them after."""
    from vidmem.pipelines import ltx2_audio

    loads, original = [], ltx2_audio._build_parts
    monkeypatch.setattr(ltx2_audio, "_build_parts", lambda loaded: (loads.append(original(loaded)), loads[-1])[1])
    return loads


def count_checks(monkeypatch) -> list:
    """One entry per audio_parts_error call (the folder and checkpoint checks)."""
    from vidmem.pipelines import ltx2_audio

    calls, original = [], ltx2_audio.audio_parts_error
    monkeypatch.setattr(ltx2_audio, "audio_parts_error", lambda loaded: (calls.append(loaded), original(loaded))[1])
    return calls


def all_dropped(loads) -> bool:
    return all(p.device.type == "meta" for parts in loads for m in parts[:2] for p in m.parameters())


def fail_in_vocoder(monkeypatch, error, on_device: str) -> list:
    """The vocoder raises `error` when its input is on `on_device`; returns the activations it made first."""
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    raised, forward = [], LTX2Vocoder.forward

    def failing(self, mel, *args, **kwargs):
        if mel.device.type == on_device:
            activation = mel * 2  # a local that an uncleared traceback would keep on the device
            raised.append(activation)
            raise error
        return forward(self, mel, *args, **kwargs)

    monkeypatch.setattr(LTX2Vocoder, "forward", failing)
    return raised


def test_out_of_memory_in_the_vocoder_decodes_on_the_cpu(tiny_loaded, monkeypatch):
    """The device (meta stands in for CUDA) runs out of memory in the vocoder: its parts leave it,
    and the same sound comes from the CPU, with the fallback in the receipt."""
    loaded = tiny_loaded(VARIANT)
    latent = sample(loaded, TIERS["none"], request(steps=2), backend=CpuBackend()).latent
    expected = decode_audio(loaded, latent, device=CPU).waveform
    loads, checks = record_parts(monkeypatch), count_checks(monkeypatch)
    raised = fail_in_vocoder(monkeypatch, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), "meta")
    result = decode_audio(loaded, latent, device=torch.device("meta"))
    assert raised and torch.equal(result.waveform, expected)
    fallback = "meta ran out of memory (CUDA out of memory. Tried to allocate 2 GiB); decoded on the CPU"
    assert result.receipt["fallback"] == fallback
    assert len(loads) == 2 and all_dropped(loads)  # the device's copies and the CPU's, both dropped
    assert len(checks) == 1  # the folder (and a checkpoint's header) checked once, not again for the CPU's copy


def test_an_error_in_the_cpus_decode_after_out_of_memory_drops_both_copies(tiny_loaded, monkeypatch):
    loaded = tiny_loaded(VARIANT)
    latent = sample(loaded, TIERS["none"], request(steps=2), backend=CpuBackend()).latent
    loads = record_parts(monkeypatch)
    fail_in_vocoder(monkeypatch, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), "meta")
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    on_meta = LTX2Vocoder.forward
    monkeypatch.setattr(LTX2Vocoder, "forward", lambda self, mel, *a, **k: on_meta(self, mel, *a, **k) if mel.device.type
                        == "meta" else (_ for _ in ()).throw(ValueError("a bad vocoder on the CPU")))
    with pytest.raises(ValueError, match="a bad vocoder on the CPU"):
        decode_audio(loaded, latent, device=torch.device("meta"))
    assert len(loads) == 2 and all_dropped(loads)


def test_what_the_config_files_decide_is_refused_before_any_weight_loads(tiny_folder, tmp_path, monkeypatch):
    """A latent of other channels than the audio VAE's config.json states, and a vocoder class diffusers lacks:
    refused by name with neither part loaded (hundreds of MB at full size)."""
    from vidmem.pipelines import ltx2_audio

    folder = shutil.copytree(tiny_folder(VARIANT), tmp_path / "ltx2")
    loaded = load_pipeline(folder, "fp32")
    latent = sample(loaded, TIERS["none"], request(steps=2), backend=CpuBackend()).latent
    loaded_parts, from_folder = [], ltx2_audio._from_folder
    monkeypatch.setattr(ltx2_audio, "_from_folder", lambda cls, path, dtype: (loaded_parts.append(path.name),
                                                                               from_folder(cls, path, dtype))[1])
    with pytest.raises(ModelError, match="3 channels x 2 mel bins, but this pipeline's audio VAE decodes 2 x 2"):
        decode_audio(loaded, dict(latent, audio_samples=torch.zeros(1, 3, 9, 2)), device=CPU)
    config = json.loads((folder / "vocoder" / "config.json").read_text())
    (folder / "vocoder" / "config.json").write_text(json.dumps(dict(config, _class_name="LTX2VocoderFromTheFuture")))
    with pytest.raises(ModelError, match="vocoder/config.json names 'LTX2VocoderFromTheFuture'"):
        decode_audio(loaded, latent, device=CPU)
    assert loaded_parts == []


def test_a_host_error_before_the_decode_drops_the_parts(tiny_loaded, monkeypatch):
    """A host that fails to make room: the parts loaded for the call are dropped all the same."""
    loaded = tiny_loaded(VARIANT)
    latent = sample(loaded, TIERS["none"], request(steps=2), backend=CpuBackend()).latent
    loads = record_parts(monkeypatch)

    def refuse(*args, **kwargs):
        raise RuntimeError("the host could not make room")

    with pytest.raises(RuntimeError, match="could not make room"):
        decode_audio(loaded, latent, device=CPU, hooks=RunHooks(make_room=refuse))
    assert len(loads) == 1 and all_dropped(loads)


def test_an_error_in_the_vocoder_leaves_nothing_on_the_device(tiny_loaded, monkeypatch):
    """Any other error propagates, but the modules its traceback reaches hold no weights on the
    device, and the traceback's frames no activations."""
    import traceback

    loaded = tiny_loaded(VARIANT)
    latent = sample(loaded, TIERS["none"], request(steps=2), backend=CpuBackend()).latent
    loads = record_parts(monkeypatch)
    fail_in_vocoder(monkeypatch, ValueError("a bad vocoder"), "cpu")
    with pytest.raises(ValueError, match="a bad vocoder") as caught:
        decode_audio(loaded, latent, device=CPU)
    assert len(loads) == 1 and all_dropped(loads)
    frames = [frame for frame, _ in traceback.walk_tb(caught.value.__traceback__)]
    assert frames[-1].f_code.co_name == "failing" and "activation" not in frames[-1].f_locals
    no_oom = fail_in_vocoder(monkeypatch, torch.OutOfMemoryError("CPU out of memory"), "cpu")
    with pytest.raises(torch.OutOfMemoryError):  # the CPU has nowhere to fall back to
        decode_audio(loaded, latent, device=CPU)
    assert no_oom and len(loads) == 2
