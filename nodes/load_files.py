"""Load Video Model Files (VidMem): a Wan pipeline from ComfyUI's own model folders."""

from __future__ import annotations

from ..memory.storage import FORMATS
from ..pipelines.comfy_files import DEFAULT_WEIGHTS, LoadOptions, ModelFiles, load_model_files, shipped_catalogue
from ..pipelines.loader import DTYPES
from . import host
from .plan_files import PREFIX, files_request, recognise
from .preflight import HIDDEN, check_before_loading
from .loader import PIPELINE_TYPE, SAME, VAE_DTYPE_INPUT, found, vae_dtype_name  # noqa: F401 (SAME: the widget value)

NONE = "(none)"


def _files(role: str) -> list[str]:
    return host.model_file_names(role) or [f"(no files in models/{host.MODEL_FILE_FOLDERS[role][0]})"]


class VidMemLoadModelFiles:
    DESCRIPTION = (
        "Loads a Wan 2.1 / 2.2 pipeline from ComfyUI's own model files (Comfy-Org's repackaged "
        ".safetensors, fp8 and fp8-scaled included, or city96's .gguf): no diffusers folder needed. "
        "Which model each file is comes from its tensors, not its name."
    )
    CATEGORY = "vidmem"
    FUNCTION = "load"
    RETURN_TYPES = (PIPELINE_TYPE,)
    RETURN_NAMES = ("pipeline",)
    OUTPUT_TOOLTIPS = ("The loaded pipeline; connect it to Video Sampler and Video VAE Decode.",)

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": (_files("model"), {"tooltip": "A Wan transformer from models/diffusion_models (or unet), "
                          "e.g. wan2.1_t2v_14B_fp8_scaled.safetensors. For Wan 2.2 A14B: the high-noise expert."}),
                "text_encoder": (_files("text_encoder"), {"tooltip": "umt5-xxl from models/text_encoders (or clip): Comfy-Org's "
                                 "umt5_xxl_*.safetensors, or city96's umt5-xxl-encoder-*.gguf. It must carry its tokenizer "
                                 "(Comfy-Org's files embed it; city96's GGUFs hold it in their metadata)."}),
                "vae": (_files("vae"), {"tooltip": "wan_2.1_vae.safetensors for every Wan model except Wan 2.2 TI2V-5B, "
                        "which needs wan2.2_vae.safetensors. A mismatch is refused before loading."}),
                "dtype": (list(DTYPES), {"default": "bf16", "tooltip": "Compute precision of the transformer and "
                          "encoders. Weights stored lower (fp8, GGUF) are upcast to it one layer at a time."}),
                "vae_dtype": VAE_DTYPE_INPUT,
                "weight_dtype": ([DEFAULT_WEIGHTS, *FORMATS], {"default": DEFAULT_WEIGHTS, "tooltip": "How weights are "
                                 "stored in memory. default: as in the files. A lower format (fp8_scaled, gguf_q8_0 ...) "
                                 "quantizes the transformer and text encoder matrices at load; never raises precision."}),
                "weights_on_disk": ("BOOLEAN", {"default": True, "tooltip": "On: weights stay memory-mapped from the "
                                    "files (page cache, read from disk as needed: runs models larger than RAM). Off: "
                                    "copied into RAM once (faster repeats, more RAM)."}),
            },
            "optional": {
                "model_2": ([NONE, *host.model_file_names("model")], {"default": NONE, "tooltip": "Wan 2.2 A14B only: "
                            "the low-noise expert (same architecture as model). (none) for every other model."}),
                "clip_vision": ([NONE, *host.model_file_names("clip_vision")], {"default": NONE, "tooltip": "Wan 2.1 "
                                "I2V and FLF2V 14B only: clip_vision_h.safetensors from models/clip_vision. (none) "
                                "otherwise, Wan 2.2 I2V A14B included (it has no image encoder)."}),
            },
            "hidden": HIDDEN,  # the prompt, to check the Samplers it feeds before loading (nodes/preflight.py)
        }

    def load(self, model: str, text_encoder: str, vae: str, dtype: str, vae_dtype: str, weight_dtype: str,
             weights_on_disk: bool, model_2: str = NONE, clip_vision: str = NONE, prompt=None, unique_id=None):
        names = dict(model=model, text_encoder=text_encoder, vae=vae, model_2=model_2, clip_vision=clip_vision,
                     vae_dtype=vae_dtype, weight_dtype=weight_dtype, weights_on_disk=str(bool(weights_on_disk)).lower())
        # The files' config, recognised from their headers as the Strategy's plan does (no weight read).
        check_before_loading(prompt, unique_id, lambda: recognise(
            files_request({PREFIX + k: v for k, v in names.items()}, list(DTYPES)), dtype).planner_model)
        optional = lambda role, name: None if name == NONE else found(host.resolve_model_file, role, name)  # noqa: E731
        files = ModelFiles(
            model=found(host.resolve_model_file, "model", model),
            text_encoder=found(host.resolve_model_file, "text_encoder", text_encoder),
            vae=found(host.resolve_model_file, "vae", vae),
            model_2=optional("model", model_2),
            clip_vision=optional("clip_vision", clip_vision),
        )
        options = LoadOptions(dtype, vae_dtype_name(vae_dtype), weight_dtype, weights_on_disk)
        return (load_model_files(files, options, shipped_catalogue(host.model_config_dirs())),)
