"""What a workflow template is made of (used by workflows/generate.py and the template lists).

A template names its loader, the memory strategy, the shot and a note that explains the choice.
Templates on ComfyUI's own single files also name the machine they are sized for and where each
file comes from, so the note, the README and the tests read one source.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NEGATIVE = "blurry, low quality, distorted, flickering, static frame, watermark, text, subtitles"
TILES = dict(vae_tiling=True, tile_size=256, overlap=32, temporal_size=64, temporal_overlap=8)


def strategy(offload: str, text_encoder: str, blocks_to_swap: int = 0, **changes) -> dict:
    """The Memory Strategy widgets of a template: what the templates share (prefetch 1, the automatic
    pinned ceiling, non-blocking copies, 256 px VAE tiles), with the tier, text-encoder placement and
    any `changes` (e.g. a larger tile_size) given."""
    return dict(dict(offload=offload, blocks_to_swap=blocks_to_swap, prefetch_blocks=1, max_pinned_ram_gb=-1.0,
                     non_blocking=True, text_encoder=text_encoder, vae_slicing=False, **TILES), **changes)

WAN21_REPO = "Comfy-Org/Wan_2.1_ComfyUI_repackaged"
WAN22_REPO = "Comfy-Org/Wan_2.2_ComfyUI_Repackaged"
NO_FILE = "(none)"  # Load Video Model Files' value for an unused optional file


@dataclass(frozen=True)
class Loader:
    """The node that loads the model: its type, widget values and height.

    A template on another loader gives its own type and widgets by name; the rest of the chain
    links to its output 0 as it does to Load Video Pipeline's.
    """

    type: str
    widgets: dict
    height: int = 130


@dataclass(frozen=True)
class ModelFile:
    """One of Comfy-Org's repackaged files: its name, repository and folder.

    The folder is both the repository's `split_files/<folder>/` and ComfyUI's `models/<folder>/`.
    """

    name: str
    repo: str
    folder: str  # diffusion_models, text_encoders, vae, clip_vision
    size_gb: float  # the file's size in GB (10^9 bytes), as the README's table gives it

    @property
    def source(self) -> str:
        return f"{self.repo}, split_files/{self.folder}/{self.name}"

    @property
    def url(self) -> str:
        return f"https://huggingface.co/{self.repo}/resolve/main/split_files/{self.folder}/{self.name}"


@dataclass(frozen=True)
class Machine:
    """The card and RAM a template is sized for, as `vidmem plan` takes them."""

    vram_gb: float
    ram_gb: float
    plan_model: str  # a built-in model of `vidmem plan --list-models`
    weights: dict  # component -> storage format of the files (what `--weights` sets for all)

    def as_json(self) -> dict:
        return {"vram_gb": self.vram_gb, "ram_gb": self.ram_gb, "plan_model": self.plan_model, "weights": dict(self.weights)}


@dataclass(frozen=True)
class LoraFile:
    """A LoRA file for ComfyUI/models/loras: its name there, where it comes from, its size."""

    name: str
    repo: str  # a Hugging Face repository, or "" for a LoRA the user trains (no download)
    repo_path: str = ""  # the file's path inside the repository
    size: str = ""  # as the note states it
    size_gb: float = 0.0  # for the card's download figure (0: nothing to download)

    @property
    def url(self) -> str:
        return f"https://huggingface.co/{self.repo}/resolve/main/{self.repo_path}" if self.repo else ""


@dataclass(frozen=True)
class LoraStep:
    """One Load LoRA (VidMem) node: the file, its strength and, on Wan 2.2 A14B, the expert it goes on."""

    file: LoraFile
    strength: float = 1.0
    expert: str = "both"


@dataclass(frozen=True)
class Training:
    """Prepare Training Data + Train LoRA: the clips folder, the buckets and Train LoRA's widgets.

    The Sampler after them samples with the LoRA just trained (Train LoRA's pipeline output).
    """

    folder: str  # a placeholder the user replaces with the full path of their clips
    resolutions: str
    frame_buckets: str
    train: dict  # Train LoRA's widgets by name (the rest take their defaults)


@dataclass(frozen=True)
class Template:
    """What differs between templates: the model, the memory strategy, the shot, and why."""

    name: str  # workflows/api/<name>.json, for the command line
    title: str  # workflows/<title>.json: what the Templates browser shows
    pick: str  # when to pick it, in a few words: the last line of its card image (extra.vidmem.card)
    note: str
    loader: Loader
    strategy: dict
    prompt: str
    negative_prompt: str
    width: int
    height: int
    frames: int
    steps: int
    cfg: float
    fps: float
    seed: int = 42
    machine: Machine | None = None  # templates on single files: the card and RAM the strategy was planned for
    files: tuple[ModelFile, ...] = ()  # and where each file comes from
    note_height: int | None = 250  # None: sized to the note's text
    loras: tuple[LoraStep, ...] = ()  # Load LoRA nodes chained between the loader and the Sampler
    training: Training | None = None  # Prepare Training Data + Train LoRA between the loader and the Sampler
    sampler: dict = field(default_factory=dict)  # the Sampler's optional controls (scheduler, shift, cfg_2, ...)
    cache: dict | None = None  # a Step Cache (VidMem) node's widgets, linked to the Sampler's cache input
    speed: dict | None = None  # a Speed (VidMem) node's widgets, linked to the Sampler's speed input
    image: str | None = None  # image-to-video: core Load Image's file (in ComfyUI/input), linked to the Sampler's image
    last_image: str | None = None  # first-last-frame: a second Load Image, linked to the Sampler's last_image
    audio: bool = False  # LTX-2's sound: a Decode Audio (VidMem) node beside the Decode, into Create Video's audio


# The fast templates' Speed node: auto attention (torch's SDPA choosing, measured fastest), compiled blocks, fp8 matmul auto.
FAST_SPEED = dict(attention="auto", compile=True, compile_mode="default", compile_dynamic="auto", fp8_matmul="auto")


def mag_cache(retention: float, max_skip_steps: int) -> dict:
    """A Step Cache on MagCache with the model's published ratios (mag_ratios auto) and the threshold
    published with them (threshold 0); retention and K as the authors published them for the model
    (pipelines/configs/mag_ratios.json: the node's own defaults are generic)."""
    return dict(method="mag_cache", threshold=0.0, retention=retention, max_skip_steps=max_skip_steps, mag_ratios="auto")


def diffusers_folder(model: str, dtype: str, weight_dtype: str = "default") -> Loader:
    """Load Video Pipeline on a diffusers folder under models/diffusers, found by name; weight_dtype
    lowers the transformer's and text encoder's storage at load (default: as diffusers loads them)."""
    return Loader("VidMemLoadPipeline", dict(model=model, dtype=dtype, path="", transformer_file="(from the folder)",
                                             weight_dtype=weight_dtype, vae_dtype="same as dtype"))


def model_files(model: ModelFile, text_encoder: ModelFile, vae: ModelFile, model_2: ModelFile | None = None,
                dtype: str = "bf16", weights_on_disk: bool = True, clip_vision: ModelFile | None = None) -> Loader:
    """Load Video Model Files on ComfyUI's own files, by name: weights stored as in the files
    (weight_dtype default never lowers them), computed in `dtype`, the VAE in the same dtype.
    clip_vision: Wan 2.1 I2V's image encoder (clip_vision_h)."""
    return Loader("VidMemLoadModelFiles", dict(
        model=model.name, text_encoder=text_encoder.name, vae=vae.name, dtype=dtype, vae_dtype="same as dtype",
        weight_dtype="default", weights_on_disk=weights_on_disk, model_2=model_2.name if model_2 else NO_FILE,
        clip_vision=clip_vision.name if clip_vision else NO_FILE,
    ), height=250)
