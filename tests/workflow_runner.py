"""Read, check and run vidmem's workflow files without ComfyUI; place tiny models for a real ComfyUI.

What it gives the tests (and `workflows/generate.py`):
- `node_spec(class_type)`: the inputs and outputs of one of our nodes (from NODE_CLASS_MAPPINGS) or of
  the few core nodes our templates use (`CORE_NODES`, as ComfyUI 0.8.0 declares them; the live-host
  test checks that table against a running server's `/object_info`).
- `widget_names`, `value_problem`: how UI `widgets_values` line up with `INPUT_TYPES`, the way the
  frontend lays them out (required then optional; an INT `seed` is followed by `control_after_generate`).
- `ui_to_api(ui)`: the frontend's `graphToPrompt()` reduced to what our templates use.
- `run_api(api)`: a minimal executor. It runs our node classes in topological order (calling
  `FUNCTION`, unwrapping `{"ui", "result"}`) and records, for each core node, what reached it.
- `shrink_for_tiny(api)`: the same graph at the tiny models' sizes (width/height/frames/steps,
  `blocks_to_swap` capped to what a tiny transformer has, a Step Cache's published ratios swapped
  for a calibration).

Placing tiny models under the templates' folder and file names, e.g. for a real ComfyUI:

    python tests/workflow_runner.py place-models /path/to/ComfyUI/models/diffusers
    python tests/workflow_runner.py place-files /path/to/ComfyUI/models
    python tests/workflow_runner.py place-loras /path/to/ComfyUI/models/loras
    python tests/workflow_runner.py place-headers /path/to/plan-screenshot-ComfyUI/models
    python tests/workflow_runner.py place-clips /path/to/clips

The first writes one tiny random diffusers folder per model name the API workflows reference (a
Wan-family tiny for Wan names, a CogVideoX tiny for CogVideoX names); the second tiny single files
under the names the Load Video Model Files nodes use (tests/model_files.py); the third tiny LoRAs
under the names the Load LoRA nodes use, the fourth tiny captioned clips for the train templates
(tests/tiny_loras.py). An existing folder or file is never overwritten.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

REPO = Path(__file__).resolve().parents[1]
WORKFLOWS_DIR = REPO / "workflows"
API_DIR = WORKFLOWS_DIR / "api"

WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN")
ANY = "*"
SEED_CONTROLS = ("fixed", "increment", "decrement", "randomize")
TINY_STEPS = 2
STEP_CACHE_NODE, CALIBRATE = "VidMemStepCache", "calibrate"


@dataclass(frozen=True)
class NodeSpec:
    """A node type as the graph sees it: INPUT_TYPES-shaped inputs, output types and names."""

    inputs: Mapping[str, Mapping[str, tuple]]
    outputs: tuple[str, ...]
    output_names: tuple[str, ...]
    display: str

    def ordered_inputs(self) -> list[tuple[str, Any, dict, bool]]:
        """(name, type, config, optional) in the frontend's order: required, then optional."""
        rows = []
        for section in ("required", "optional"):
            for name, entry in self.inputs.get(section, {}).items():
                config = entry[1] if len(entry) > 1 else {}
                rows.append((name, entry[0], dict(config), section == "optional"))
        return rows


def _core(display: str, required: dict, optional: dict | None = None, outputs: tuple[str, ...] = ()) -> NodeSpec:
    return NodeSpec({"required": required, "optional": optional or {}}, outputs, outputs, display)


# Core nodes the templates use, as ComfyUI 0.8.0 declares them (comfy_extras/nodes_video.py,
# nodes_images.py). "Note" is frontend-only: it lives in UI files and never reaches POST /prompt.
CORE_NODES: dict[str, NodeSpec] = {
    "CreateVideo": _core(
        "Create Video",
        {"images": ("IMAGE", {}), "fps": ("FLOAT", {"default": 30.0, "min": 1.0, "max": 120.0})},
        {"audio": ("AUDIO", {})},
        outputs=("VIDEO",),
    ),
    "SaveVideo": _core("Save Video", {
        "video": ("VIDEO", {}),
        "filename_prefix": ("STRING", {"default": "video/ComfyUI"}),
        "format": (["auto", "mp4"], {"default": "auto"}),
        "codec": (["auto", "h264"], {"default": "auto"}),
    }),
    "SaveAnimatedWEBP": _core("Save Animated WEBP", {
        "images": ("IMAGE", {}),
        "filename_prefix": ("STRING", {"default": "ComfyUI"}),
        "fps": ("FLOAT", {"default": 6.0, "min": 0.01, "max": 1000.0}),
        "lossless": ("BOOLEAN", {"default": True}),
        "quality": ("INT", {"default": 80, "min": 0, "max": 100}),
        "method": (["default", "fastest", "slowest"], {}),
    }),
    # The image combo lists the files in ComfyUI/input; example.png ships there. The frontend adds an
    # upload button after it (no value of its own in the API format; the UI's widgets_values may carry "image").
    "LoadImage": _core("Load Image", {"image": (["example.png"], {"image_upload": True})}, outputs=("IMAGE", "MASK")),
}
VIRTUAL_NODES: dict[str, NodeSpec] = {"Note": _core("Note", {"text": ("STRING", {"multiline": True})})}


def our_nodes() -> dict[str, type]:
    from vidmem.nodes import NODE_CLASS_MAPPINGS

    return NODE_CLASS_MAPPINGS


def node_spec(class_type: str) -> NodeSpec:
    """Our node's live INPUT_TYPES (so the model list reflects the current models folder) or a core spec."""
    ours = our_nodes()
    if class_type in ours:
        from vidmem.nodes import NODE_DISPLAY_NAME_MAPPINGS

        cls = ours[class_type]
        names = getattr(cls, "RETURN_NAMES", None) or cls.RETURN_TYPES
        inputs = _node_validated(cls.INPUT_TYPES(), cls)
        return NodeSpec(inputs, tuple(cls.RETURN_TYPES), tuple(names), NODE_DISPLAY_NAME_MAPPINGS[class_type])
    if class_type in CORE_NODES:
        return CORE_NODES[class_type]
    if class_type in VIRTUAL_NODES:
        return VIRTUAL_NODES[class_type]
    raise KeyError(f"node type {class_type!r} is neither a vidmem node nor one of the core nodes {sorted(CORE_NODES)}")


NODE_VALIDATES = "vidmem_node_validates"  # config mark: the node's VALIDATE_INPUTS names this input


def _node_validated(inputs: Mapping, cls: type) -> dict:
    """INPUT_TYPES with the inputs VALIDATE_INPUTS names marked: ComfyUI then skips its own list
    check for a combo (a workflow saved when the input was a BOOLEAN still queues)."""
    import inspect

    validate = getattr(cls, "VALIDATE_INPUTS", None)
    named = set(inspect.getfullargspec(validate).args) if validate is not None else set()
    marked = {}
    for section, entries in inputs.items():
        marked[section] = {name: (entry[0], {**(entry[1] if len(entry) > 1 else {}), NODE_VALIDATES: True})
                           if name in named and isinstance(entry[0], list) else entry
                           for name, entry in entries.items()} if isinstance(entries, Mapping) else entries
    return marked


def is_widget(input_type: Any) -> bool:
    return isinstance(input_type, list) or input_type in WIDGET_TYPES


def widget_names(spec: NodeSpec) -> list[str]:
    """Names for each entry of a UI node's widgets_values, in order."""
    names = []
    for name, input_type, config, _optional in spec.ordered_inputs():
        if is_widget(input_type):
            names.append(name)
            if input_type == "INT" and (name in ("seed", "noise_seed") or config.get("control_after_generate")):
                names.append("control_after_generate")
    return names


def socket_inputs(spec: NodeSpec) -> list[tuple[str, str, bool]]:
    """(name, type, optional) of the inputs drawn as slots, in slot order."""
    return [(name, t, optional) for name, t, _config, optional in spec.ordered_inputs() if not is_widget(t)]


def value_problem(input_type: Any, config: Mapping, value: Any) -> str | None:
    """Why `value` would fail ComfyUI's validation of a widget input, or None if it is fine."""
    if isinstance(input_type, list):
        return None if value in input_type or config.get(NODE_VALIDATES) else f"{value!r} is not one of {input_type}"
    expected = {"INT": int, "FLOAT": (int, float), "STRING": str, "BOOLEAN": bool}[input_type]
    if not isinstance(value, expected) or (input_type in ("INT", "FLOAT") and isinstance(value, bool)):
        return f"{value!r} is not a {input_type}"
    if input_type in ("INT", "FLOAT"):
        low, high = config.get("min"), config.get("max")
        if (low is not None and value < low) or (high is not None and value > high):
            return f"{value} is outside {low}..{high}"
    return None


def types_match(sent: str, accepted: str) -> bool:
    return ANY in (sent, accepted) or sent == accepted


# --- files ---------------------------------------------------------------------------------------

def load_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def ui_files() -> list[Path]:
    return sorted(WORKFLOWS_DIR.glob("*.json"))


def api_files() -> list[Path]:
    return sorted(API_DIR.glob("*.json"))


def api_twin(ui_path: Path) -> Path:
    """The API file of a UI template: the UI file is named by its title, and names its twin in extra.vidmem.api."""
    return API_DIR / f"{load_json(ui_path)['extra']['vidmem']['api']}.json"


def ui_twin(api_path: Path) -> Path:
    return next(path for path in ui_files() if api_twin(path).name == Path(api_path).name)


def thumbnail(ui_path: Path) -> Path:
    """What the Templates browser requests for a template's card: <file name>.jpg beside it."""
    return Path(ui_path).with_suffix(".jpg")


def is_link(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)


def ui_to_api(ui: dict) -> dict:
    """API format of a UI workflow: frontend-only nodes dropped, widgets named, links as [id, slot]."""
    links = {link[0]: link for link in ui["links"]}
    api = {}
    for node in ui["nodes"]:
        if node["type"] in VIRTUAL_NODES or node.get("mode", 0) in (2, 4):  # 2 muted, 4 bypassed
            continue
        spec = node_spec(node["type"])
        inputs = dict(zip(widget_names(spec), node.get("widgets_values", [])))
        inputs.pop("control_after_generate", None)
        for slot in node.get("inputs", []):
            if slot.get("link") is not None:
                link = links[slot["link"]]
                inputs[slot["name"]] = [str(link[1]), link[2]]
        api[str(node["id"])] = {"class_type": node["type"], "inputs": inputs, "_meta": {"title": node.get("title") or spec.display}}
    return api


def topological_order(api: dict) -> list[str]:
    """Node ids so that every node comes after the nodes it reads from (ties by id)."""
    pending = {nid: {v[0] for v in node["inputs"].values() if is_link(v)} for nid, node in api.items()}
    order: list[str] = []
    while pending:
        ready = sorted((nid for nid, deps in pending.items() if deps <= set(order)), key=_id_key)
        if not ready:
            raise ValueError(f"the graph has a cycle or a link to a missing node among {sorted(pending)}")
        order.extend(ready)
        for nid in ready:
            del pending[nid]
    return order


def _id_key(node_id: str) -> tuple:
    return (0, int(node_id), "") if node_id.isdigit() else (1, 0, node_id)


# --- tiny models ---------------------------------------------------------------------------------

# First match wins: every listed substring must occur in the lower-cased folder or file name.
# Wan 2.2 A14B's single files are its two experts (wan2.2_t2v_high_noise_14B_..., _low_noise_).
TINY_FOR_NAME: tuple[tuple[tuple[str, ...], str], ...] = (
    (("hunyuanvideo", "1.5", "i2v"), "hunyuanvideo1.5-i2v"),
    (("hunyuanvideo", "1.5"), "hunyuanvideo1.5-t2v"),
    (("ltx-2",), "ltx2-t2v"),  # one LTX-2 folder runs text- and image-to-video
    (("wan", "ti2v"), "wan2.2-ti2v"),
    (("wan", "i2v", "a14b"), "wan2.2-i2v-a14b"),
    (("wan2.2", "i2v", "_noise_"), "wan2.2-i2v-a14b"),
    (("wan", "a14b"), "wan2.2-a14b"),
    (("wan2.2", "t2v", "_noise_"), "wan2.2-a14b"),
    (("wan", "flf2v"), "wan2.1-flf2v"),
    (("wan", "i2v"), "wan2.1-i2v"),
    (("wan",), "wan2.1-t2v"),
    (("cogvideo", "i2v"), "cogvideox-i2v"),
    (("cogvideo",), "cogvideox-t2v"),
)


def tiny_variant_for(model_name: str) -> str:
    name = model_name.lower()
    for parts, variant in TINY_FOR_NAME:
        if all(part in name for part in parts):
            return variant
    raise ValueError(f"no tiny stand-in for model {model_name!r}; expected a Wan, CogVideoX, HunyuanVideo 1.5 or LTX-2 "
                     "folder or file name")


FOLDER_LOADER, FILES_LOADER = "VidMemLoadPipeline", "VidMemLoadModelFiles"


def loader_models(api: dict) -> dict[str, str]:
    """node id -> model name (a diffusers folder, or a file in models/diffusion_models), for every loader."""
    return {nid: node["inputs"]["model"] for nid, node in api.items() if node["class_type"] in (FOLDER_LOADER, FILES_LOADER)}


def referenced_model_names(paths: list[Path] | None = None) -> list[str]:
    """The diffusers folder names the workflows load (Load Video Pipeline)."""
    names = set()
    for path in paths or api_files():
        api = load_json(path)
        names.update(node["inputs"]["model"] for node in api.values() if node["class_type"] == FOLDER_LOADER)
    return sorted(names)


def place_tiny_models(models_dir: Path, names: list[str] | None = None) -> list[Path]:
    """A tiny diffusers folder at models_dir/<name> for each name; existing folders are kept."""
    from vidmem.pipelines.tiny import save_tiny_pipeline

    placed = []
    for name in names or referenced_model_names():
        folder = Path(models_dir) / name
        if not (folder / "model_index.json").is_file():
            save_tiny_pipeline(tiny_variant_for(name), folder)
        placed.append(folder)
    return placed


PREPARE_NODE, TRAIN_NODE = "VidMemPrepareTrainingData", "VidMemTrainLoRA"
TINY_RANK = 4


def shrink_for_tiny(api: dict, seed: int | None = None, clips: Path | None = None) -> dict:
    """A copy of `api` that the tiny models accept: their size and frames, TINY_STEPS steps, and
    blocks_to_swap capped below the tiny transformer's block count (so a swap stays partial).
    Training nodes get the tiny size as their only bucket, TINY_STEPS steps at rank TINY_RANK, no
    periodic checkpoints, and `clips` (tests/tiny_loras.place_tiny_clips) as their folder when given."""
    from vidmem.pipelines.tiny import tiny_spec

    api = copy.deepcopy(api)
    _shrink_training(api, clips)
    specs = [tiny_spec(tiny_variant_for(name)) for name in loader_models(api).values()]
    if not specs:
        return api
    spec = specs[0]
    block_cap = max(1, min(s.transformer_config["num_layers"] for s in specs) - 1)
    for node in api.values():
        inputs = node["inputs"]
        if node["class_type"] == "VidMemVideoSampler":
            inputs.update(width=spec.width, height=spec.height, frames=spec.frames, steps=min(inputs["steps"], TINY_STEPS))
            if seed is not None:
                inputs["seed"] = seed
        if node["class_type"] == "VidMemMemoryStrategy":
            inputs.update({k: v for k, v in dict(width=spec.width, height=spec.height, frames=spec.frames).items()
                           if k in inputs})  # an older workflow's own copy of the shape (now ignored)
            if inputs["blocks_to_swap"] > 0:
                inputs["blocks_to_swap"] = min(inputs["blocks_to_swap"], block_cap)
        if node["class_type"] == STEP_CACHE_NODE and inputs.get("mag_ratios") not in (None, CALIBRATE):
            # The tiny models have no published MagCache ratios, so "auto" (or a ratio file measured on a
            # real model) would be refused: a calibration runs MagCache's hooks on every block instead.
            inputs["mag_ratios"] = CALIBRATE
    return api


def _shrink_training(api: dict, clips: Path | None) -> None:
    from vidmem.pipelines.tiny import tiny_spec

    for node in api.values():
        inputs = node["inputs"]
        if node["class_type"] == PREPARE_NODE:
            spec = tiny_spec(_chain_variant(api, inputs))
            inputs.update(resolutions=f"{spec.width}x{spec.height}", frame_buckets=str(spec.frames))
            if clips is not None:
                inputs["folder"] = str(clips)
        if node["class_type"] == TRAIN_NODE:
            inputs.update(steps=min(inputs["steps"], TINY_STEPS), rank=min(inputs["rank"], TINY_RANK), checkpoint_every=0)


def _chain_variant(api: dict, inputs: dict) -> str:
    """The tiny variant of the loader a node's pipeline input comes from (through LoRA or training nodes)."""
    node = api[inputs["pipeline"][0]]
    while node["class_type"] not in (FOLDER_LOADER, FILES_LOADER):
        node = api[node["inputs"]["pipeline"][0]]
    return tiny_variant_for(node["inputs"]["model"])


# --- a minimal executor --------------------------------------------------------------------------

@dataclass(frozen=True)
class CoreValue:
    """Stands in for the output of a core node the executor does not run."""

    type: str
    made_by: str


@dataclass
class Run:
    outputs: dict[str, tuple]  # node id -> its result tuple
    ui: dict[str, dict]  # node id -> the "ui" part our nodes returned
    core_inputs: dict[str, dict]  # core node id -> the inputs that reached it


def run_api(api: dict) -> Run:
    """Run `api`: our nodes for real (validated first, as POST /prompt does), core nodes recorded.
    Each node runs inside torch.inference_mode(), as ComfyUI 0.8.0's executor runs it (execution.py)."""
    import torch

    ours = our_nodes()
    run = Run({}, {}, {})
    for nid in topological_order(api):
        node = api[nid]
        inputs = {k: (run.outputs[v[0]][v[1]] if is_link(v) else v) for k, v in node["inputs"].items()}
        if node["class_type"] in ours:
            with torch.inference_mode():
                run.outputs[nid] = _run_ours(ours[node["class_type"]], inputs, run.ui, nid)
        elif node["class_type"] in CORE_SOURCES:  # a core node whose output our nodes compute with
            run.core_inputs[nid] = inputs
            run.outputs[nid] = CORE_SOURCES[node["class_type"]](inputs)
        else:
            spec = node_spec(node["class_type"])
            run.core_inputs[nid] = inputs
            run.outputs[nid] = tuple(CoreValue(t, node["class_type"]) for t in spec.outputs)
    return run


def _loaded_image(inputs: dict) -> tuple:
    """Load Image's (IMAGE, MASK) for any file: a colour gradient of a size and aspect ratio no tiny
    model runs at (56x40), so the sampler's fitting to the video's size is part of every I2V run."""
    import torch

    height, width = 40, 56
    y = torch.linspace(0, 1, height)[:, None].expand(height, width)
    x = torch.linspace(0, 1, width)[None, :].expand(height, width)
    image = torch.stack([x, y, (x + y) / 2], dim=-1)[None]
    return image, torch.zeros(1, height, width)


CORE_SOURCES = {"LoadImage": _loaded_image}  # core nodes run_api stands in for with a real value


def _run_ours(cls: type, inputs: dict, ui: dict, nid: str) -> tuple:
    if hasattr(cls, "VALIDATE_INPUTS"):  # as ComfyUI: only the inputs it names (all of them for **kwargs)
        import inspect

        spec = inspect.getfullargspec(cls.VALIDATE_INPUTS)
        named = {k: v for k, v in inputs.items() if spec.varkw or k in spec.args}
        verdict = cls.VALIDATE_INPUTS(**named)
        if verdict is not True:
            raise ValueError(f"node {nid} ({cls.__name__}) failed validation: {verdict}")
    result = getattr(cls(), cls.FUNCTION)(**inputs)
    if isinstance(result, dict):
        ui[nid] = result.get("ui", {})
        result = result["result"]
    if len(result) != len(cls.RETURN_TYPES):
        raise ValueError(f"node {nid} ({cls.__name__}) returned {len(result)} values for {cls.RETURN_TYPES}")
    return tuple(result)


def core_input_problems(class_type: str, inputs: dict) -> list[str]:
    """What a real core node would choke on: missing inputs, wrong types, IMAGE not [F, H, W, 3] 0..1."""
    problems = []
    for name, input_type, config, optional in node_spec(class_type).ordered_inputs():
        if name not in inputs:
            if not optional:
                problems.append(f"{name}: missing")
            continue
        value = inputs[name]
        problem = value_problem(input_type, config, value) if is_widget(input_type) else _socket_problem(input_type, value)
        if problem:
            problems.append(f"{name}: {problem}")
    return problems


def _socket_problem(input_type: str, value: Any) -> str | None:
    if isinstance(value, CoreValue):
        return None if types_match(value.type, input_type) else f"got {value.type} from {value.made_by}"
    if input_type == "AUDIO":  # core AUDIO: {"waveform": [batch, channels, samples] float on the CPU, "sample_rate": int}
        import torch

        waveform = value.get("waveform") if isinstance(value, dict) else None
        if not isinstance(waveform, torch.Tensor) or waveform.ndim != 3 or not waveform.is_floating_point() \
                or waveform.device.type != "cpu" or not isinstance(value.get("sample_rate"), int):
            return f"AUDIO must be {{'waveform': [batch, channels, samples] float on the CPU, 'sample_rate': int}}, got {value!r:.120}"
    if input_type == "IMAGE":
        import torch

        if not isinstance(value, torch.Tensor) or value.ndim != 4 or value.shape[-1] != 3:
            return f"IMAGE must be a [frames, H, W, 3] tensor, got {getattr(value, 'shape', type(value).__name__)}"
        if not value.is_floating_point() or value.min() < 0 or value.max() > 1:
            return f"IMAGE must be float in 0..1, got {value.dtype} {value.min().item()}..{value.max().item()}"
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python tests/workflow_runner.py", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    place = commands.add_parser("place-models", help="write tiny models under the API workflows' model names")
    place.add_argument("models_dir", type=Path, help="e.g. ComfyUI/models/diffusers")
    files = commands.add_parser("place-files", help="write tiny single files under the names the API workflows' "
                                "Load Video Model Files nodes use (tests/model_files.py)")
    files.add_argument("models_root", type=Path, help="ComfyUI/models (files go to its diffusion_models, "
                       "text_encoders, vae and vidmem_configs folders)")
    loras = commands.add_parser("place-loras", help="write tiny LoRAs under the names the API workflows' Load LoRA "
                                "nodes use (tests/tiny_loras.py)")
    loras.add_argument("loras_dir", type=Path, help="e.g. ComfyUI/models/loras")
    headers = commands.add_parser("place-headers", help="write Comfy-Org's files at their real size with every weight "
                                  "a hole (sparse): real plans on the Memory Strategy node, never a run")
    headers.add_argument("models_root", type=Path, help="ComfyUI/models of a server for plan screenshots")
    clips = commands.add_parser("place-clips", help="write a few tiny captioned clips for the train templates")
    clips.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    if args.command in ("place-loras", "place-clips"):
        from tiny_loras import place_tiny_clips, place_tiny_loras

        for path in place_tiny_loras(args.loras_dir) if args.command == "place-loras" else [place_tiny_clips(args.folder)]:
            print(path)
        return
    if args.command in ("place-files", "place-headers"):
        from model_files import place_real_size_headers, place_tiny_model_files

        place = place_tiny_model_files if args.command == "place-files" else place_real_size_headers
        for path in place(args.models_root):
            print(path)
        return
    for folder in place_tiny_models(args.models_dir):
        print(f"{folder}  ({tiny_variant_for(folder.name)})")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    from bench.support.checkout import use_this_checkout

    use_this_checkout()  # `import vidmem` is this clone, installed or not
    main()
