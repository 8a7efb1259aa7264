"""Load Video Pipeline (VidMem): a diffusers folder of any family vidmem declares (Wan, CogVideoX, LTX-2,
HunyuanVideo 1.5), its parts optionally replaced by single files, kept on the CPU until used."""

from __future__ import annotations

from ..pipelines.comfy_files.text_encoder_file import FOLDER_CHOICE, ROLES
from ..pipelines.configs import load_model
from ..pipelines.family import ModelError
from ..pipelines.loader import DTYPES, load_pipeline
from ..pipelines.weight_storage import DEFAULT_WEIGHTS, WEIGHT_DTYPES
from . import host
from .preflight import HIDDEN, check_before_loading

PIPELINE_TYPE = "VIDMEM_PIPELINE"
NO_MODELS = "(no diffusers models found)"
FOLDER_TRANSFORMER = FOLDER_CHOICE  # the folder's own transformer (one sentinel for every file input)
FOLDER_VAE = FOLDER_TRANSFORMER  # the folder's own VAE
FOLDER_TEXT_ENCODER = FOLDER_TRANSFORMER  # the folder's own text encoder(s)
SAME = "same as dtype"
# Both loaders' VAE precision, one widget (Load Video Model Files, Load Video Pipeline).
VAE_DTYPE_INPUT = ([SAME, *DTYPES], {"default": SAME, "tooltip": "The VAE's precision. fp32 is what diffusers' Wan "
                                     "examples use for quality (ComfyUI's --fp32-vae); it doubles the decode's "
                                     "activation memory. The plan counts it."})


def vae_dtype_name(value: str) -> str:
    """The widget's value as LoadOptions and configs.load_model take it: "" follows dtype."""
    return "" if value == SAME else value


class VidMemLoadPipeline:
    DESCRIPTION = (
        "Loads a Wan, CogVideoX, LTX-2 or HunyuanVideo 1.5 pipeline from a diffusers folder (safetensors only), "
        "optionally with its transformer, VAE or text encoders from single files (ComfyUI's models/ folders). "
        "Weights stay in system RAM; a Memory Strategy decides what goes to the GPU during each run."
    )
    CATEGORY = "vidmem"
    FUNCTION = "load"
    RETURN_TYPES = (PIPELINE_TYPE,)
    RETURN_NAMES = ("pipeline",)
    OUTPUT_TOOLTIPS = ("The loaded pipeline; connect it to Video Sampler and Video VAE Decode.",)

    @classmethod
    def INPUT_TYPES(cls):
        names = host.diffusers_model_names() or [NO_MODELS]
        return {
            "required": {
                "model": (names, {"tooltip": "A folder under models/diffusers holding model_index.json. "
                                  "Saved by name, so a shared workflow finds it on another machine."}),
                "dtype": (list(DTYPES), {"default": "bf16", "tooltip": "Compute precision. bf16 for Wan, LTX-2, "
                          "HunyuanVideo 1.5 and CogVideoX-5b/1.5, fp16 for CogVideoX-2b; fp32 doubles memory."}),
            },
            "optional": {
                "path": ("STRING", {"default": "", "tooltip": "Full path to a diffusers folder, loaded instead "
                         "of 'model' when set. 'model' must still name a folder in its list: ComfyUI checks that "
                         "when the workflow is queued, so a workflow saved on another machine needs 'model' picked "
                         "again even with a path. Inside ComfyUI the path must lie in ComfyUI's model folders "
                         "(models/ or extra_model_paths.yaml) unless the server was started with "
                         "VIDMEM_ALLOW_ANY_PATH=1. Leave empty for workflows you share."}),
                "transformer_file": ([FOLDER_TRANSFORMER] + host.single_file_transformer_names(), {"tooltip":
                    "Wan, LTX-2 or HunyuanVideo 1.5: a single-file transformer from models/diffusion_models "
                    "(bf16/fp16, fp8, fp8-scaled or GGUF; the authors', ComfyUI's or diffusers' names), e.g. a ComfyUI-repackaged "
                    "Wan 2.1 checkpoint, used in place from the file; the folder still provides its config, text "
                    "encoder and VAE. An LTX-2 checkpoint (ltx-2-19b-dev*) also supplies its video VAE, so that "
                    "folder needs no transformer or VAE weights (only their config.json). Not for Wan 2.2 A14B "
                    "(two experts) or CogVideoX. A HunyuanVideo 1.5 file's T2V/I2V and 480p/720p come from "
                    "the folder."}),
                # Last on purpose: saved workflows' widget values are positional.
                "weight_dtype": (list(WEIGHT_DTYPES), {"default": DEFAULT_WEIGHTS, "tooltip": "How the transformer "
                                 "and text encoder weights are stored in memory. default: loaded as diffusers does, at "
                                 "dtype. A lower format (fp8_scaled, gguf_q8_0 ...) quantizes their matrices at load and "
                                 "upcasts them one layer at a time (about half the RAM of bf16 for fp8); never raises "
                                 "precision. The folder's own format (e.g. bf16 for a bf16 folder at dtype bf16) keeps "
                                 "the weights mapped from the files (disk tier). The VAE is never lowered."}),
                # After weight_dtype, for the same reason: older workflows get the default.
                "vae_dtype": VAE_DTYPE_INPUT,
                # Last, for the same reason.
                "vae_file": ([FOLDER_VAE] + host.model_file_names("vae"), {"tooltip":
                    "Wan or HunyuanVideo 1.5: a single VAE file from models/vae that replaces the folder's VAE, "
                    "recognised by its tensors (Wan's wan_2.1_vae / wan2.2_vae, Comfy-Org's "
                    "hunyuanvideo15_vae_fp16); the folder still provides its config, so its vae/ needs only "
                    "config.json. Run at vae_dtype. Not for CogVideoX, nor LTX-2 (its checkpoint brings its VAE)."}),
                # Last, for the same reason.
                "text_encoder_file": ([FOLDER_TEXT_ENCODER] + host.model_file_names("text_encoder"), {"tooltip":
                    "A single text-encoder file from models/text_encoders that replaces the folder's text_encoder, "
                    "recognised by its tensors: Wan umt5_xxl_fp8_e4m3fn_scaled / umt5_xxl_fp16, HunyuanVideo 1.5 "
                    "qwen_2.5_vl_7b_fp8_scaled / qwen_2.5_vl_7b, LTX-2 gemma_3_12B_it (and its fp8-scaled "
                    "variants), CogVideoX t5xxl_fp16 / t5xxl_fp8_e4m3fn_scaled (bf16/fp16, fp8, fp8-scaled or GGUF). GGUFs in "
                    "llama.cpp's names are read too: city96's umt5-xxl-encoder-* (Wan) and t5-v1_1-xxl-encoder-* "
                    "(CogVideoX), Qwen2.5-VL 7B (qwen2vl) and Gemma 3 12B (gemma3) language models (no mmproj file "
                    "needed); other llama.cpp architectures are refused by name. "
                    "It must fit the folder's text_encoder/config.json (refused otherwise, naming the file to pick); "
                    "the folder still provides the tokenizer, so its text_encoder/ needs only config.json. "
                    "weight_dtype lowers it as it lowers the folder's; the plan counts its format (an fp8 file "
                    "about halves the text encoder's RAM)."}),
                # After text_encoder_file, for the same reason.
                "text_encoder_2_file": ([FOLDER_TEXT_ENCODER] + host.model_file_names("text_encoder"), {"tooltip":
                    "HunyuanVideo 1.5 only: its second text encoder (ByT5, for quoted text) from a single file, "
                    "Comfy-Org's byt5_small_glyphxl_fp16, checked against the folder's text_encoder_2/config.json; "
                    "the folder keeps its tokenizer_2. Held as the file stores it (weight_dtype does not lower it)."}),
            },
            "hidden": HIDDEN,  # the prompt, to check the Samplers it feeds before loading (nodes/preflight.py)
        }

    @classmethod
    def VALIDATE_INPUTS(cls, path=""):
        """path is named (a STRING: ComfyUI checks nothing of it) so a folder outside ComfyUI's
        model folders is refused when queued, before anything reads it."""
        return path_problem(path) or True

    def load(self, model: str, dtype: str, path: str = "", transformer_file: str = FOLDER_TRANSFORMER,
             weight_dtype: str = DEFAULT_WEIGHTS, vae_dtype: str = SAME, vae_file: str = FOLDER_VAE,
             text_encoder_file: str = FOLDER_TEXT_ENCODER, text_encoder_2_file: str = FOLDER_TEXT_ENCODER,
             prompt=None, unique_id=None):
        problem = path_problem(path)
        if problem:
            raise ModelError(problem)
        if model == NO_MODELS and not path.strip():
            raise ModelError(
                "model: no diffusers-format model was found under ComfyUI's models/diffusers; put one there (a folder "
                "holding model_index.json, e.g. models/diffusers/Wan2.1-T2V-1.3B-Diffusers) and refresh, or give its "
                "full path in the 'path' input."
            )
        folder = found(host.resolve_model_folder, model, path)
        check_before_loading(prompt, unique_id, lambda: load_model(str(folder), dtype, vae_dtype_name(vae_dtype) or None))
        single = None if transformer_file == FOLDER_TRANSFORMER else found(host.resolve_single_file, transformer_file)
        chosen = {"text_encoder_file": text_encoder_file, "text_encoder_2_file": text_encoder_2_file}
        texts = {widget: None if chosen[widget] == FOLDER_TEXT_ENCODER
                 else found(host.resolve_model_file, "text_encoder", chosen[widget], widget) for widget in ROLES.values()}
        vae = None if vae_file == FOLDER_VAE else found(host.resolve_model_file, "vae", vae_file, "vae_file")
        return (load_pipeline(folder, dtype, single, weight_dtype, vae, vae_dtype_name(vae_dtype), **texts),)


def path_problem(path) -> str | None:
    """Why the typed `path` may not be read (outside ComfyUI's model folders, inside ComfyUI), or None."""
    if not isinstance(path, str) or not path.strip():
        return None  # linked (no value when queued) or empty: 'model' is used
    return host.model_folders().outside_models(path)


def found(resolve, *names):
    """`resolve(*names)` with the host's FileNotFoundError (a listed file gone since) as the pack's error."""
    try:
        return resolve(*names)
    except FileNotFoundError as error:
        raise ModelError(str(error)) from None
