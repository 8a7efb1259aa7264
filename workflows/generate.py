"""Write vidmem's workflow templates, UI format (workflows/*.json) and API format (workflows/api/*.json).

Both files of a template come from one Python description below, so they cannot drift apart;
`tests/test_workflows.py` checks that the files on disk are what this script writes, and converts
each UI file to API format on its own to compare. Widget order comes from the nodes' INPUT_TYPES.

ComfyUI 0.8.0's Templates browser (frontend 1.35) shows a custom node pack's template by its file
name, as both title and description, with `workflows/<file name>.jpg` as its card. So the UI file is
named by the template's readable `title`, and its thumbnail beside it is a screenshot taken by
tests/browser/check_templates.mjs (`--thumbnails workflows`); the API twin keeps a short `name`
for the command line (workflows/api/<name>.json), and the UI file records it in extra.vidmem.api.
Node sizes leave room for what the nodes show: the Strategy's plan from the start, the compact
receipts after a run (web/js/vidmem.js), so nothing overlaps after a run.

    python workflows/generate.py          # rewrite the files
    python workflows/generate.py --check  # exit 1 if a file differs from what would be written
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from workflow_runner import API_DIR, WORKFLOWS_DIR, node_spec, socket_inputs, widget_names  # noqa: E402


@dataclass
class Node:
    id: int
    type: str
    pos: tuple[int, int]
    size: tuple[int, int]
    widgets: dict = field(default_factory=dict)  # input name -> value (control_after_generate too)
    links: dict = field(default_factory=dict)  # input name -> (source node id, output slot)
    group: str | None = None
    colors: tuple[str, str] | None = None  # (color, bgcolor)


@dataclass(frozen=True)
class Loader:
    """The node that loads the model: its type, widget values and height.

    A template on another loader (e.g. one for ComfyUI's single-file models) gives its own:
    `Loader("VidMemLoadModelFiles", dict(<its widgets by name>), height=170)`; the rest of the
    chain links to its output 0 as it does to Load Video Pipeline's.
    """

    type: str
    widgets: dict
    height: int = 130


def diffusers_folder(model: str, dtype: str) -> Loader:
    """Load Video Pipeline on a diffusers folder under models/diffusers, found by name."""
    return Loader("VidMemLoadPipeline", dict(model=model, dtype=dtype, path="", transformer_file="(from the folder)"))


@dataclass(frozen=True)
class Template:
    """What differs between templates: the model, the memory strategy, the shot, and why."""

    name: str  # workflows/api/<name>.json, for the command line
    title: str  # workflows/<title>.json: what the Templates browser shows
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


NEGATIVE = "blurry, low quality, distorted, flickering, static frame, watermark, text, subtitles"
TILES = dict(vae_tiling=True, tile_size=256, overlap=32, temporal_size=64, temporal_overlap=8)

TEMPLATES = (
    Template(
        name="cogvideox_t2v",
        title="CogVideoX-2b, 12 GB card",
        note=(
            "CogVideoX-2b text to video on a 12 GB card: 720x480, 49 frames (about 6 s at 8 fps).\n\n"
            "Model: the diffusers folder of THUDM/CogVideoX-2b in ComfyUI/models/diffusers/CogVideoX-2b "
            "(the dropdown lists folders by name, so this workflow finds it on any machine). "
            "fp16 is the precision CogVideoX-2b was trained in.\n\n"
            "Memory strategy, offload = model: the text encoder, the transformer and the VAE each go to the "
            "GPU only while they run, so the peak is the largest component plus its activations, not their "
            "sum. The largest is the T5-XXL text encoder (about 9.5 GB in fp16); with text_encoder = "
            "offload_after_encoding it leaves the GPU as soon as the prompt is encoded. On a card under "
            "12 GB set text_encoder = cpu (encoding then takes a while in system RAM and no VRAM).\n\n"
            "VAE tiling: decoding 720x480x49 in one piece needs about 16 GB in fp16; 256 px tiles with "
            "32 px overlap keep the decode to a few GB.\n\n"
            "Every strategy gives the same frames; they differ only in memory and speed."
        ),
        loader=diffusers_folder("CogVideoX-2b", "fp16"),
        strategy=dict(offload="model", blocks_to_swap=0, prefetch_blocks=1, max_pinned_ram_gb=-1.0, non_blocking=True,
                      text_encoder="offload_after_encoding",
                      vae_slicing=False, **TILES),
        prompt="A golden retriever runs through a sunlit meadow of tall grass, slow motion, shallow depth of field.",
        negative_prompt=NEGATIVE,
        width=720, height=480, frames=49, steps=50, cfg=6.0, fps=8.0,
    ),
    Template(
        name="wan21_t2v_blockswap",
        title="Wan 2.1 1.3B, small card, block swap",
        note=(
            "Wan 2.1 T2V 1.3B text to video: 832x480, 81 frames (about 5 s at 16 fps), for small cards.\n\n"
            "Model: the diffusers folder of Wan-AI/Wan2.1-T2V-1.3B-Diffusers in "
            "ComfyUI/models/diffusers/Wan2.1-T2V-1.3B-Diffusers.\n\n"
            "Memory strategy, offload = block_swap with blocks_to_swap = 20: of the transformer's 30 "
            "blocks, the first 10 stay on the GPU and the last 20 live in system RAM and stream in each "
            "step, the next one copied while the current one computes (prefetch_blocks = 1). The "
            "transformer then holds about a third of its 2.8 GB (bf16) on the GPU. The UMT5-XXL text "
            "encoder (about 11 GB in bf16) encodes on the CPU (text_encoder = cpu), so it never takes "
            "VRAM, and the VAE decodes in 256 px tiles.\n\n"
            "With 12 GB or more, offload = model and blocks_to_swap = 0 is faster. Fewer swapped blocks "
            "run faster and use more VRAM. Every strategy gives the same frames."
        ),
        loader=diffusers_folder("Wan2.1-T2V-1.3B-Diffusers", "bf16"),
        strategy=dict(offload="block_swap", blocks_to_swap=20, prefetch_blocks=1, max_pinned_ram_gb=-1.0, non_blocking=True,
                      text_encoder="cpu",
                      vae_slicing=False, **TILES),
        prompt="A red fox trots through fresh snow in a pine forest, morning light, tracking shot.",
        negative_prompt=NEGATIVE,
        width=832, height=480, frames=81, steps=30, cfg=5.0, fps=16.0,
    ),
    # --- one template per VRAM tier. Figures: bf16 weight bytes = parameters x 2 (parameter counts of
    # the real configs, built on the meta device); activations and the CUDA context come on top, so
    # each tier keeps a reserve (3 GiB for the small models, 6 GiB for the large ones) and the
    # table in web/docs/VidMemMemoryStrategy.md gives the same choices for every model and card.
    Template(
        name="wan21_t2v_1_3b_8gb",
        title="Wan 2.1 1.3B, 8 GB card",
        note=(
            "Wan 2.1 T2V 1.3B on an 8 GB card: 832x480, 81 frames (about 5 s at 16 fps).\n\n"
            "Model: the diffusers folder of Wan-AI/Wan2.1-T2V-1.3B-Diffusers in "
            "ComfyUI/models/diffusers/Wan2.1-T2V-1.3B-Diffusers.\n\n"
            "Memory strategy, offload = model: the transformer (1.42 billion parameters, 2.6 GiB of bf16 "
            "weights) is on the GPU only while it samples and the VAE only while it decodes, so the "
            "weights on the card never exceed 2.6 GiB. The UMT5-XXL text encoder (5.7 billion parameters, "
            "10.6 GiB) cannot fit an 8 GB card, so text_encoder = cpu: the prompt is encoded in system RAM "
            "(no VRAM, but it takes a while and needs about 11 GiB of free RAM). The VAE decodes in 256 px "
            "tiles.\n\n"
            "These are weight sizes; activations (a few GiB at this size) and the CUDA context come on top. "
            "The Memory Strategy node shows the predicted peaks for the Sampler's size before you queue. If "
            "it still runs out of memory, the \"Wan 2.1 1.3B, small card, block swap\" "
            "template streams 20 of the 30 blocks from RAM. Every strategy gives the same frames."
        ),
        loader=diffusers_folder("Wan2.1-T2V-1.3B-Diffusers", "bf16"),
        strategy=dict(offload="model", blocks_to_swap=0, prefetch_blocks=1, max_pinned_ram_gb=-1.0, non_blocking=True,
                      text_encoder="cpu", vae_slicing=False, **TILES),
        prompt="A paper boat drifts down a rain-filled gutter past glowing shop windows at night, close-up.",
        negative_prompt=NEGATIVE,
        width=832, height=480, frames=81, steps=30, cfg=5.0, fps=16.0,
    ),
    Template(
        name="wan21_t2v_1_3b_12gb",
        title="Wan 2.1 1.3B, 12 GB card",
        note=(
            "Wan 2.1 T2V 1.3B on a 12 GB card: 832x480, 81 frames (about 5 s at 16 fps).\n\n"
            "Model: the diffusers folder of Wan-AI/Wan2.1-T2V-1.3B-Diffusers in "
            "ComfyUI/models/diffusers/Wan2.1-T2V-1.3B-Diffusers.\n\n"
            "Memory strategy, offload = model with text_encoder = offload_after_encoding: the UMT5-XXL text "
            "encoder (10.6 GiB of bf16 weights) goes to the GPU alone, encodes the prompt in about a second "
            "and leaves; then the transformer (2.6 GiB) samples, then the VAE decodes in 512 px tiles. "
            "10.6 GiB on a 12 GB card is tight: if the card also drives your display or ComfyUI holds "
            "other models, set text_encoder = cpu (the 8 GB template).\n\n"
            "These are weight sizes; activations and the CUDA context come on top. The Memory Strategy node "
            "shows the predicted peaks for the Sampler's size before you queue. Every strategy gives the same frames."
        ),
        loader=diffusers_folder("Wan2.1-T2V-1.3B-Diffusers", "bf16"),
        strategy=dict(offload="model", blocks_to_swap=0, prefetch_blocks=1, max_pinned_ram_gb=-1.0, non_blocking=True,
                      text_encoder="offload_after_encoding", vae_slicing=False,
                      **dict(TILES, tile_size=512, overlap=128)),
        prompt="A hummingbird hovers at a red flower in a sunlit garden, slow motion, macro shot.",
        negative_prompt=NEGATIVE,
        width=832, height=480, frames=81, steps=30, cfg=5.0, fps=16.0,
    ),
    Template(
        name="wan21_t2v_14b_24gb",
        title="Wan 2.1 14B, 24 GB card",
        note=(
            "Wan 2.1 T2V 14B on a 24 GB card: 832x480, 81 frames (about 5 s at 16 fps).\n\n"
            "Model: the diffusers folder of Wan-AI/Wan2.1-T2V-14B-Diffusers in "
            "ComfyUI/models/diffusers/Wan2.1-T2V-14B-Diffusers.\n\n"
            "Memory strategy, offload = block_swap with blocks_to_swap = 15: the transformer has 14.3 billion "
            "parameters (26.6 GiB in bf16), more than the card holds. Its 40 blocks are 0.65 GiB each; 25 "
            "stay on the GPU (16.8 GiB with the embeddings and head) and the last 15 live in system RAM and "
            "stream in every step, the next one copied while the current one computes (prefetch_blocks = 1). "
            "That leaves about 6 GiB for activations and the CUDA context. The UMT5-XXL text encoder "
            "(10.6 GiB) goes to the GPU alone to encode the prompt and leaves at once "
            "(text_encoder = offload_after_encoding); the VAE decodes in 256 px tiles.\n\n"
            "System RAM: every weight lives there between runs, about 38 GiB (transformer, text encoder, "
            "VAE), plus pinned copies of the streamed blocks; 64 GB of RAM is comfortable. At 1280x720 "
            "the activations grow about 2.3x: swap more blocks (each one frees 0.65 GiB). If you run out of "
            "memory, raise blocks_to_swap by 4 at a time. The Memory Strategy node shows the predicted peaks for the Sampler's size "
            "before you queue. Every strategy gives the same frames."
        ),
        loader=diffusers_folder("Wan2.1-T2V-14B-Diffusers", "bf16"),
        strategy=dict(offload="block_swap", blocks_to_swap=15, prefetch_blocks=1, max_pinned_ram_gb=-1.0,
                      non_blocking=True, text_encoder="offload_after_encoding", vae_slicing=False, **TILES),
        prompt="A lighthouse on a rocky cliff at dusk, waves crashing below, its beam sweeping through sea mist, aerial shot.",
        negative_prompt=NEGATIVE,
        width=832, height=480, frames=81, steps=40, cfg=5.0, fps=16.0,
    ),
    Template(
        name="cogvideox_2b_t2v_8gb",
        title="CogVideoX-2b, 8 GB card",
        note=(
            "CogVideoX-2b on an 8 GB card: 720x480, 49 frames (about 6 s at 8 fps).\n\n"
            "Model: the diffusers folder of THUDM/CogVideoX-2b in ComfyUI/models/diffusers/CogVideoX-2b; "
            "fp16, the precision CogVideoX-2b was trained in.\n\n"
            "Memory strategy, offload = model: the transformer (1.69 billion parameters, 3.2 GiB in fp16) is "
            "on the GPU only while it samples, the VAE only while it decodes (256 px tiles). The T5-XXL text "
            "encoder (4.8 billion parameters, 8.9 GiB) does not fit an 8 GB card, so text_encoder = cpu: "
            "the prompt is encoded in system RAM (slow, no VRAM). With 12 GB or more, the \"CogVideoX-2b, 12 GB card\" "
            "template encodes on the GPU instead.\n\n"
            "These are weight sizes; activations and the CUDA context come on top. The Memory Strategy node "
            "shows the predicted peaks for the Sampler's size before you queue. Every strategy gives the same frames."
        ),
        loader=diffusers_folder("CogVideoX-2b", "fp16"),
        strategy=dict(offload="model", blocks_to_swap=0, prefetch_blocks=1, max_pinned_ram_gb=-1.0, non_blocking=True,
                      text_encoder="cpu", vae_slicing=False, **TILES),
        prompt="A steaming cup of coffee on a wooden table by a window, rain on the glass, soft morning light.",
        negative_prompt=NEGATIVE,
        width=720, height=480, frames=49, steps=50, cfg=6.0, fps=8.0,
    ),
    Template(
        name="wan22_ti2v_5b_12gb",
        title="Wan 2.2 TI2V-5B, 12 GB card",
        note=(
            "Wan 2.2 TI2V-5B on a 12 GB card, text to video: 1280x704, 121 frames (about 5 s at 24 fps). "
            "Width and height must be multiples of 32 for this model and frames 4k+1.\n\n"
            "Model: the diffusers folder of Wan-AI/Wan2.2-TI2V-5B-Diffusers in "
            "ComfyUI/models/diffusers/Wan2.2-TI2V-5B-Diffusers.\n\n"
            "Memory strategy, offload = block_swap with blocks_to_swap = 12: the transformer has 5.0 billion "
            "parameters (9.3 GiB in bf16) in 30 blocks of 0.31 GiB; 18 stay on the GPU (6.0 GiB with the "
            "embeddings, head and one prefetched block) and 12 stream in from system RAM every step. The "
            "UMT5-XXL text encoder (10.6 GiB) goes to the GPU alone to encode the prompt, then leaves "
            "(text_encoder = offload_after_encoding; tight on 12 GB: set it to cpu if the card also drives a "
            "display). Its VAE compresses 16x and decodes 1280x704x121 in 256 px tiles.\n\n"
            "On a 16 GB card offload = model (blocks_to_swap = 0) fits and is faster. These are weight "
            "sizes; activations and the CUDA context come on top. The Memory Strategy node shows the "
            "predicted peaks for the Sampler's size before you queue. Every strategy gives the same frames."
        ),
        loader=diffusers_folder("Wan2.2-TI2V-5B-Diffusers", "bf16"),
        strategy=dict(offload="block_swap", blocks_to_swap=12, prefetch_blocks=1, max_pinned_ram_gb=-1.0,
                      non_blocking=True, text_encoder="offload_after_encoding", vae_slicing=False, **TILES),
        prompt="A street musician plays violin under a bridge at golden hour, pigeons taking off around him, cinematic.",
        negative_prompt=NEGATIVE,
        width=1280, height=704, frames=121, steps=50, cfg=5.0, fps=24.0,
    ),
)

GROUPS = ("1. Model and memory strategy", "2. Sample, decode, free", "3. Save")
NOTE_COLORS = ("#432", "#653")


# Layout, in canvas pixels. Heights leave room for what the nodes add in the browser: the
# Strategy's plan (web/js/vidmem.js PLAN_HEIGHT) from the start, a three-line receipt after a run.
COLUMNS = (0, 460, 940, 1340, 1880)
TOP = 340  # below the note; a group's title sits above its nodes' title bars (GROUP_HEAD)
GROUP_HEAD = 80  # node title bar (30) + group title (24) + room
GAP = 30


def graph(t: Template) -> list[Node]:
    """The chain every template shares: Load -> Strategy -> Sampler -> Decode -> Free VRAM -> save.

    The strategy takes the Sampler's shape (the browser reads it from the graph), so it has no
    size of its own and no pipeline link: the plan finds the model through the Sampler.
    """
    a, b, c, d, e = COLUMNS
    loader_h, strategy_h, decode_h = t.loader.height, 700, 190
    return [
        Node(1, t.loader.type, (a, TOP), (400, loader_h), t.loader.widgets, group=GROUPS[0]),
        Node(2, "VidMemMemoryStrategy", (a, TOP + loader_h + GAP), (400, strategy_h),
             dict(t.strategy, vram_budget_gb=0.0, ram_budget_gb=0.0), group=GROUPS[0]),
        Node(3, "VidMemVideoSampler", (b, TOP), (420, 590), dict(
            prompt=t.prompt, negative_prompt=t.negative_prompt, width=t.width, height=t.height, frames=t.frames,
            steps=t.steps, cfg=t.cfg, seed=t.seed, control_after_generate="fixed",
        ), links=dict(pipeline=(1, 0), strategy=(2, 0)), group=GROUPS[1]),
        Node(4, "VidMemVAEDecode", (c, TOP), (340, decode_h), dict(save_latents=False),
             links=dict(pipeline=(1, 0), latent=(3, 0), strategy=(2, 0)), group=GROUPS[1]),
        Node(5, "VidMemFreeVRAM", (c, TOP + decode_h + GAP), (340, 160), dict(unload_comfy_models=False),
             links=dict(anything=(4, 0)), group=GROUPS[1]),
        # Save Video grows to fit its preview (a square one for the tiny models): room for that.
        Node(6, "CreateVideo", (d, TOP), (480, 80), dict(fps=t.fps), links=dict(images=(5, 0)), group=GROUPS[2]),
        Node(7, "SaveVideo", (d, TOP + 80 + 2 * GAP), (480, 620), dict(filename_prefix=f"vidmem/{t.name}", format="auto",
             codec="auto"), links=dict(video=(6, 0)), group=GROUPS[2]),
        Node(8, "SaveAnimatedWEBP", (e, TOP), (480, 760), dict(
            filename_prefix=f"vidmem/{t.name}_preview", fps=t.fps, lossless=False, quality=85, method="default",
        ), links=dict(images=(5, 0)), group=GROUPS[2]),
        Node(9, "Note", (a, 0), (c + 340, 250), dict(text=t.note), colors=NOTE_COLORS),
    ]


# --- API format ----------------------------------------------------------------------------------

def to_api(nodes: list[Node]) -> dict:
    api = {}
    for node in nodes:
        if node.type == "Note":
            continue
        values = {**node.widgets, **{name: [str(src), slot] for name, (src, slot) in node.links.items()}}
        order = [name for name, *_ in node_spec(node.type).ordered_inputs()]  # INPUT_TYPES order
        inputs = {name: values[name] for name in order if name in values}
        api[str(node.id)] = {"class_type": node.type, "inputs": inputs, "_meta": {"title": node_spec(node.type).display}}
    return api


# --- UI format (LiteGraph 0.4, as the ComfyUI frontend saves it) ---------------------------------

def to_ui(t: Template, nodes: list[Node]) -> dict:
    by_id = {n.id: n for n in nodes}
    links, incoming, outgoing = [], {}, {}
    for target in nodes:
        slots = [name for name, _t, _o in socket_inputs(node_spec(target.type))]
        for name, (src, slot) in target.links.items():
            link_id = len(links) + 1
            links.append([link_id, src, slot, target.id, slots.index(name), _link_type(by_id[src], slot, target, name)])
            incoming[(target.id, name)] = link_id
            outgoing.setdefault((src, slot), []).append(link_id)
    order = _execution_order(nodes)
    return {
        "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"vidmem/workflows/{t.name}")),
        "revision": 0,
        "last_node_id": max(by_id),
        "last_link_id": len(links),
        "nodes": [_ui_node(n, order[n.id], incoming, outgoing) for n in nodes],
        "links": links,
        "groups": _groups(nodes),
        "config": {},
        # The saved view starts right of the sidebar; extra.vidmem.api names the API twin.
        "extra": {"ds": {"scale": 0.7, "offset": [120, 60]}, "vidmem": {"api": t.name}},
        "version": 0.4,
    }


def _ui_node(node: Node, order: int, incoming: dict, outgoing: dict) -> dict:
    spec = node_spec(node.type)
    inputs = []
    for name, input_type, optional in socket_inputs(spec):
        slot = {"name": name, "type": input_type, "link": incoming.get((node.id, name))}
        if optional:
            slot["shape"] = 7  # the frontend's hollow dot for optional inputs
        inputs.append(slot)
    outputs = [
        {"name": name, "type": out_type, "links": outgoing.get((node.id, slot), []), "slot_index": slot}
        for slot, (out_type, name) in enumerate(zip(spec.outputs, spec.output_names))
    ]
    ui = {
        "id": node.id, "type": node.type, "pos": list(node.pos), "size": list(node.size), "flags": {},
        "order": order, "mode": 0, "inputs": inputs, "outputs": outputs,
        "properties": {} if node.type == "Note" else {"Node name for S&R": node.type},
        "widgets_values": [node.widgets[name] for name in widget_names(spec)],
    }
    if node.colors:
        ui["color"], ui["bgcolor"] = node.colors
    return ui


def _link_type(source: Node, slot: int, target: Node, name: str) -> str:
    """The concrete type on the wire: the output's, or the input's when the output is any-type."""
    out_type = node_spec(source.type).outputs[slot]
    if out_type != "*":
        return out_type
    return dict((n, t) for n, t, _o in socket_inputs(node_spec(target.type)))[name]


def _execution_order(nodes: list[Node]) -> dict[int, int]:
    done: list[int] = []
    while len(done) < len(nodes):
        ready = [n.id for n in nodes if n.id not in done and all(src in done for src, _s in n.links.values())]
        done.extend(sorted(ready))
    return {nid: i for i, nid in enumerate(done)}


def _groups(nodes: list[Node]) -> list[dict]:
    groups = []
    for index, title in enumerate(GROUPS, start=1):
        members = [n for n in nodes if n.group == title]
        left, top = min(n.pos[0] for n in members), min(n.pos[1] for n in members)
        right = max(n.pos[0] + n.size[0] for n in members)
        bottom = max(n.pos[1] + n.size[1] for n in members)
        groups.append({"id": index, "title": title, "bounding": [left - 10, top - GROUP_HEAD, right - left + 20,
                                                                 bottom - top + GROUP_HEAD + 10],
                       "color": "#3f789e", "font_size": 24, "flags": {}})
    return groups


# --- files ---------------------------------------------------------------------------------------

def render() -> dict[Path, str]:
    """path -> file text, for every template in both formats."""
    files = {}
    for t in TEMPLATES:
        nodes = graph(t)
        files[WORKFLOWS_DIR / f"{t.title}.json"] = _dump(to_ui(t, nodes))
        files[API_DIR / f"{t.name}.json"] = _dump(to_api(nodes))
    return files


def _dump(data: dict) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write vidmem's workflow templates (UI and API format).")
    parser.add_argument("--check", action="store_true", help="only report files that differ; exit 1 if any")
    args = parser.parse_args(argv)
    files = render()
    stale = [path for path, text in files.items() if not path.is_file() or path.read_text() != text]
    strays = [path for path in (*WORKFLOWS_DIR.glob("*.json"), *API_DIR.glob("*.json")) if path not in files]
    if args.check:
        for path in stale:
            print(f"out of date: {path.relative_to(WORKFLOWS_DIR.parent)}")
        for path in strays:
            print(f"not a template any more: {path.relative_to(WORKFLOWS_DIR.parent)}")
        return 1 if stale or strays else 0
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(WORKFLOWS_DIR.parent)}")
    for path in strays:
        path.unlink()
        print(f"removed {path.relative_to(WORKFLOWS_DIR.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
