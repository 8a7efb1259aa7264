"""Write vidmem's workflow templates, UI format (workflows/*.json) and API format (workflows/api/*.json).

Both files of a template come from one Python description (workflows/templates_folders.py for the
diffusers-folder templates, workflows/templates_files.py for those on ComfyUI's own single files,
workflows/templates_families.py for HunyuanVideo 1.5 and LTX-2; their parts in
workflows/template_types.py), so they cannot drift apart;
`tests/test_workflows.py` checks that the files on disk are what this script writes, and converts
each UI file to API format on its own to compare. Widget order comes from the nodes' INPUT_TYPES.

ComfyUI 0.8.0's Templates browser (frontend 1.35) shows a custom node pack's template by its file
name, as both title and description (a pack cannot give it another description), with
`workflows/<file name>.jpg` as its card image. So the UI file is named by the template's readable
`title`, and the card image says the rest: what extra.vidmem.card holds (the model, the card and RAM
it is made for, the steps it computes, the files to download, when to pick it), drawn in a browser
by tests/browser/template_cards.mjs (`--thumbnails workflows` of check_templates.mjs runs it). The
API twin keeps a short `name` for the command line (workflows/api/<name>.json), and the UI file
records it in extra.vidmem.api.
Node sizes leave room for what the nodes show: the Strategy's plan from the start, the compact
receipts after a run (web/js/vidmem.js), so nothing overlaps after a run.

    python workflows/generate.py          # rewrite the files
    python workflows/generate.py --check  # exit 1 if a file differs from what would be written
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]  # the template lists beside this file; tests/workflow_runner.py
from template_types import Template  # noqa: E402
from templates_files import FILE_TEMPLATES  # noqa: E402
from templates_folders import FOLDER_TEMPLATES  # noqa: E402
from templates_i2v import I2V_TEMPLATES  # noqa: E402
from templates_cache import CACHE_TEMPLATES  # noqa: E402
from templates_families import FAMILY_TEMPLATES  # noqa: E402
from templates_lora import LORA_TEMPLATES  # noqa: E402
from templates_train import TRAIN_TEMPLATES  # noqa: E402
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


TEMPLATES = (FOLDER_TEMPLATES + FILE_TEMPLATES + I2V_TEMPLATES + CACHE_TEMPLATES + LORA_TEMPLATES + TRAIN_TEMPLATES
             + FAMILY_TEMPLATES)

MODEL_GROUP, SAMPLE_GROUP, SAVE_GROUP = "Model and memory strategy", "Sample and decode", "Save"
LORA_GROUP, TRAIN_GROUP = "LoRA", "Train a LoRA"
NOTE_COLORS = ("#432", "#653")


# Layout, in canvas pixels. Heights leave room for what the nodes add in the browser: the
# Strategy's plan (web/js/vidmem.js PLAN_HEIGHT, 390) from the start, a three-line receipt after a run.
COLUMNS = (0, 540, 1020, 1420, 1960)
MIDDLE = 580  # a LoRA or training column, between the loader and the Sampler, moves the rest right by this
NOTE_GAP = 90  # between the note and the groups' top: a group's title sits above its nodes' title bars
GROUP_HEAD = 80  # node title bar (30) + group title (24) + room
GAP = 50  # between stacked nodes: the lower one's title bar (30) and the source badge drawn above it (~20)
SAMPLER_HEIGHT, STRATEGY_HEIGHT = 590, 790  # with the widgets of BASE_WIDGETS (the Strategy: room for its plan)
PLAN_EXTRAS_HEIGHT = 150  # the plan's paragraphs on what a Speed node and a Step Cache will do (6-8 lines)
FIRST_WIDTH = 480  # the loader and the Strategy: the plan's chart is drawn for this width (vidmem.js CHART_WIDTH)
WIDGET_ROW = 28  # what one more number or combo widget adds (24 and spacing)
# Widget counts the heights were set for; an input added to a node later gets its row (see _grown).
BASE_WIDGETS = {"VidMemVideoSampler": 9, "VidMemMemoryStrategy": 14, "VidMemLoadPipeline": 4, "VidMemLoadModelFiles": 9}
MIDDLE_WIDTH = 520  # Load LoRA shows file names of 60 characters (Comfy-Org's Lightning LoRAs) unclipped
LORA_HEIGHT = 180  # Load LoRA: three widgets and its receipt (a run grows it to 171 px)
PREPARE_HEIGHT = 240  # Prepare Training Data: three text widgets and its receipt
TRAIN_HEIGHT = 520  # Train LoRA: thirteen widgets, the loss line and its receipt
CACHE_HEIGHT = 250  # Step Cache: five widgets, below the Sampler, and the receipt a run adds (calibration: 4 lines)
SPEED_HEIGHT = 200  # Speed: five widgets, below the Step Cache
IMAGE_HEIGHT = 420  # core Load Image: its file, upload button and a preview of the image
AUDIO_HEIGHT = 150  # Decode Audio: two links and its receipt
NOTE_CHAR_WIDTH, NOTE_LINE_HEIGHT, NOTE_PADDING = 7.25, 10.7, 70  # a Note's text, for notes sized to fit it
VIEW_SCALE, VIEW_OFFSET = 0.7, (120, 180)  # the view a template opens with (extra.ds)
FIRST_EXTRA_ID = 10  # ids 1-9 are the chain every template shares (the API twins keep them)


def graph(t: Template) -> list[Node]:
    """The chain every template shares: Load -> Strategy -> Sampler -> Decode -> save, with the
    template's LoRA or training nodes between the loader and the Sampler, and its Step Cache (if it
    carries one) under the Sampler, linked to the Sampler's cache input.

    No Free VRAM in the chain: it drops the weights kept for the next queue (which then uploads
    them again) and, never cached itself, makes every node after it run again on every queue.
    ComfyUI takes the kept weights back by itself when it needs the room (docs/warm-runs.md).
    Id 5, once Free VRAM's, stays unused so the API twins keep their ids.

    The strategy takes the Sampler's shape (the browser reads it from the graph), so it has no
    size of its own and no pipeline link: the plan finds the model through the Sampler.
    """
    a, b, c, d, e = COLUMNS
    if t.loras or t.training:
        b, c, d, e = (x + MIDDLE for x in (b, c, d, e))
    note_height = t.note_height or _note_height(t.note, c + 340)
    top = note_height + NOTE_GAP
    middle, pipeline = _middle(t, top)
    loader_h, strategy_h, decode_h = _grown(t.loader.type, t.loader.height), _grown("VidMemMemoryStrategy", STRATEGY_HEIGHT), 190
    if t.cache or t.speed:
        strategy_h += PLAN_EXTRAS_HEIGHT
    sampler_h = _grown("VidMemVideoSampler", SAMPLER_HEIGHT)
    sampler_links = dict(pipeline=pipeline, strategy=(2, 0))
    if t.cache:  # the Step Cache under the Sampler, into its cache input
        cache_id = FIRST_EXTRA_ID + len(middle)
        middle.append(Node(cache_id, "VidMemStepCache", (b, top + sampler_h + GAP), (420, CACHE_HEIGHT), dict(t.cache),
                           group=SAMPLE_GROUP))
        sampler_links["cache"] = (cache_id, 0)
    if t.speed:  # the Speed node under the Step Cache, into the Sampler's speed input
        speed_id = FIRST_EXTRA_ID + len(middle)
        below = top + sampler_h + GAP + (CACHE_HEIGHT + GAP if t.cache else 0)
        middle.append(Node(speed_id, "VidMemSpeed", (b, below), (420, SPEED_HEIGHT), dict(t.speed), group=SAMPLE_GROUP))
        sampler_links["speed"] = (speed_id, 0)
    if t.image:  # image-to-video: core Load Image under the Sampler (and its Step Cache), into its image input
        image_id = FIRST_EXTRA_ID + len(middle)
        below = top + sampler_h + GAP + (CACHE_HEIGHT + GAP if t.cache else 0) + (SPEED_HEIGHT + GAP if t.speed else 0)
        middle.append(Node(image_id, "LoadImage", (b, below), (420, IMAGE_HEIGHT), dict(image=t.image), group=SAMPLE_GROUP))
        sampler_links["image"] = (image_id, 0)
        if t.last_image:  # first-last-frame: the last frame's Load Image under the first one
            last_id = FIRST_EXTRA_ID + len(middle)
            middle.append(Node(last_id, "LoadImage", (b, below + IMAGE_HEIGHT + GAP), (420, IMAGE_HEIGHT),
                               dict(image=t.last_image), group=SAMPLE_GROUP))
            sampler_links["last_image"] = (last_id, 0)
    video_links = {}
    if t.audio:  # Decode Audio under the Decode: the sound into Create Video beside the frames
        audio_id = FIRST_EXTRA_ID + len(middle)
        middle.append(Node(audio_id, "VidMemDecodeAudio", (c, top + decode_h + GAP), (340, AUDIO_HEIGHT),
                           links=dict(pipeline=pipeline, latent=(3, 0)), group=SAMPLE_GROUP))
        video_links["audio"] = (audio_id, 0)
    nodes = [
        Node(1, t.loader.type, (a, top), (FIRST_WIDTH, loader_h), t.loader.widgets, group=MODEL_GROUP),
        Node(2, "VidMemMemoryStrategy", (a, top + loader_h + GAP), (FIRST_WIDTH, strategy_h),
             dict(t.strategy, vram_budget_gb=0.0, ram_budget_gb=0.0), group=MODEL_GROUP),
        Node(3, "VidMemVideoSampler", (b, top), (420, sampler_h), dict(
            prompt=t.prompt, negative_prompt=t.negative_prompt, width=t.width, height=t.height, frames=t.frames,
            steps=t.steps, cfg=t.cfg, seed=t.seed, control_after_generate="fixed", **t.sampler,
        ), links=sampler_links, group=SAMPLE_GROUP),
        Node(4, "VidMemVAEDecode", (c, top), (340, decode_h), dict(save_latents=False),
             links=dict(pipeline=pipeline, latent=(3, 0), strategy=(2, 0)), group=SAMPLE_GROUP),
        # Save Video grows to fit its preview (a square one for the tiny models): room for that.
        Node(6, "CreateVideo", (d, top), (480, 80), dict(fps=t.fps), links=dict(images=(4, 0), **video_links),
             group=SAVE_GROUP),
        Node(7, "SaveVideo", (d, top + 80 + 2 * GAP), (480, 620), dict(filename_prefix=f"vidmem/{t.name}", format="auto",
             codec="auto"), links=dict(video=(6, 0)), group=SAVE_GROUP),
        Node(8, "SaveAnimatedWEBP", (e, top), (480, 760), dict(
            filename_prefix=f"vidmem/{t.name}_preview", fps=t.fps, lossless=False, quality=85, method="default",
        ), links=dict(images=(4, 0)), group=SAVE_GROUP),
        Node(9, "Note", (a, 0), (c + 340, note_height), dict(text=t.note), colors=NOTE_COLORS),
        *middle,
    ]
    return [_with_defaults(node) for node in nodes]


def _note_height(text: str, width: int) -> int:
    """Room for the note's text as the frontend draws it (measured on ComfyUI 0.8.0's Note: about
    7.25 canvas px per character, 10.7 px per line) plus its title bar and padding."""
    per_line = int(width / NOTE_CHAR_WIDTH)
    lines = sum(max(1, math.ceil(len(line) / per_line)) for line in text.split("\n"))
    return NOTE_PADDING + math.ceil(lines * NOTE_LINE_HEIGHT)


def _middle(t: Template, top: int) -> tuple[list[Node], tuple[int, int]]:
    """The nodes between the loader and the Sampler, and the (node, slot) the Sampler's pipeline comes from."""
    x, nid, y = COLUMNS[1], FIRST_EXTRA_ID, top
    if t.training:
        data = t.training
        prepare = Node(nid, "VidMemPrepareTrainingData", (x, y), (MIDDLE_WIDTH, PREPARE_HEIGHT), dict(
            folder=data.folder, resolutions=data.resolutions, frame_buckets=data.frame_buckets,
        ), links=dict(pipeline=(1, 0), strategy=(2, 0)), group=TRAIN_GROUP)
        train = Node(nid + 1, "VidMemTrainLoRA", (x, y + PREPARE_HEIGHT + GAP), (MIDDLE_WIDTH, TRAIN_HEIGHT), dict(data.train),
                     links=dict(pipeline=(1, 0), data=(nid, 0), strategy=(2, 0)), group=TRAIN_GROUP)
        return [prepare, train], (train.id, 0)
    nodes, source = [], (1, 0)
    for step in t.loras:
        nodes.append(Node(nid, "VidMemLoadLoRA", (x, y), (MIDDLE_WIDTH, LORA_HEIGHT), dict(
            lora_name=step.file.name, strength=step.strength, expert=step.expert,
        ), links=dict(pipeline=source), group=LORA_GROUP))
        source, nid, y = (nid, 0), nid + 1, y + LORA_HEIGHT + GAP
    return nodes, source


def _grown(node_type: str, height: int) -> int:
    """`height` plus a row for every widget the node has today beyond BASE_WIDGETS (inputs added later)."""
    extra = len(widget_names(node_spec(node_type))) - BASE_WIDGETS[node_type]
    return height + WIDGET_ROW * max(0, extra)


def _with_defaults(node: Node) -> Node:
    """The node with a value for every widget: what the template sets, else the input's default
    (so an input added to a node later gets its default in both files, as a fresh node would)."""
    spec = node_spec(node.type)
    configs = {name: (kind, config) for name, kind, config, _optional in spec.ordered_inputs()}
    widgets = dict(node.widgets)
    for name in widget_names(spec):
        if name not in widgets:
            widgets[name] = "fixed" if name == "control_after_generate" else _default(*configs[name])
    return replace(node, widgets=widgets)


def _default(kind, config: dict):
    if "default" in config:
        return config["default"]
    if isinstance(kind, list) and kind:
        return kind[0]
    raise ValueError(f"a widget of type {kind} has no default: give it a value in the template")


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
        # The saved view starts right of the sidebar and below the workflow's name, which the frontend
        # draws over the canvas's top left (42-90 px from the top): the note's title bar at 105 px.
        "extra": {"ds": {"scale": VIEW_SCALE, "offset": list(VIEW_OFFSET)}, "vidmem": _vidmem_extra(t)},
        "version": 0.4,
    }


def _vidmem_extra(t: Template) -> dict:
    """extra.vidmem: the API twin's name; for single-file templates, the machine and the files."""
    extra = {"api": t.name}
    if t.machine:
        extra["machine"] = t.machine.as_json()
    if t.files:
        extra["files"] = [{"name": f.name, "folder": f.folder, "repo": f.repo, "url": f.url} for f in t.files]
    if t.loras:  # where each LoRA comes from ("repo" empty: one the user trains, e.g. with a train template)
        extra["loras"] = [{"name": s.file.name, "folder": "loras", "repo": s.file.repo, "url": s.file.url,
                           "expert": s.expert} for s in t.loras]
    if t.training:
        extra["trains"] = t.training.train["lora_name"]
    extra["card"] = _card(t)
    return extra


# --- the Templates browser's card image (tests/browser/template_cards.mjs draws extra.vidmem.card) ----

FAMILIES = (("CogVideoX", "cogvideox"), ("Wan 2.2", "wan22"), ("Wan 2.1", "wan21"), ("HunyuanVideo 1.5", "hunyuan15"),
            ("LTX-2", "ltx2"))


def _card(t: Template) -> dict:
    """What a user choosing a template wants at a glance: the model, what it is made for (VRAM, RAM),
    how much computing it asks (steps, passes), what to download, and when to pick it."""
    model = re.search(r"(Wan 2\.\d (?:I2V |FLF2V )?[\w.-]+|CogVideoX-\w+(?: I2V)?|HunyuanVideo 1\.5|LTX-2)",
                      t.title).group(1)
    vram = t.machine.vram_gb if t.machine else _title_vram(t.title)
    return {
        "model": model, "family": next(key for prefix, key in FAMILIES if model.startswith(prefix)),
        "variant": _variant(t), "vram_gb": vram, "ram_gb": t.machine.ram_gb if t.machine else None,
        "shot": f"{t.width}x{t.height}, {t.frames} frames", "speed": _speed(t), "files": _files(t), "pick": t.pick,
    }


def _title_vram(title: str) -> float | None:
    found = re.search(r"(\d+) GB card", title)
    return float(found.group(1)) if found else None  # "small card": under 8 GB


def _variant(t: Template) -> str:
    if t.training:
        return "train a LoRA"
    if t.cache:
        return "fast: Step Cache"
    if t.loras:
        return f"{t.steps}-step distill LoRA" if t.steps <= 8 else "with a LoRA"
    stored = t.loader.widgets.get("weight_dtype", "default")
    if t.files:  # the model file's storage (the text encoder is fp8 in every Wan template)
        return "fp8 files" if "fp8" in t.files[0].name else "Comfy-Org files"
    return "diffusers folder" + (f", {stored}" if stored != "default" else "")


def _speed(t: Template) -> str:
    """Transformer steps and passes per step (two with classifier-free guidance, one at cfg 1); a Step
    Cache's computed steps from its published ratios (diffusers' own MagCache hook on a stand-in)."""
    if t.training:
        return f"trains {t.training.train['steps']} steps, samples {t.steps}"
    passes = "2 passes each (cfg)" if t.cfg > 1.0 else "1 pass each (cfg 1)"
    computed = _cache_steps(t) if t.cache else None
    steps = f"{computed} of {t.steps} steps" if computed is not None else f"{t.steps} steps"
    return f"{steps}, {passes}"


def _cache_steps(t: Template) -> int | None:
    from vidmem.pipelines.configs import load_model
    from vidmem.pipelines.step_cache import layout_key, mag_schedule, published_cache

    model = load_model(t.machine.plan_model)
    denoisers = {name: (c.config["num_layers"], c.config) for name, c in model.components.items() if name.startswith("transformer")}
    cache = published_cache(layout_key(model.pipeline_class, denoisers))
    if cache is None or t.cache.get("mag_ratios") != "auto":
        return None
    cache = replace(cache, retention=t.cache["retention"], max_skip_steps=t.cache["max_skip_steps"],
                    threshold=t.cache["threshold"] or cache.threshold)
    return sum(sum(mag_schedule(cache, t.steps, name)) for name in denoisers if cache.ratios_for(name) is not None)


def _files(t: Template) -> str:
    files = sum(f.size_gb for f in t.files)
    loras = sum(step.file.size_gb for step in t.loras)
    if t.files:
        return f"{files:.1f} GB of files + {loras:.1f} GB LoRA" if loras else f"{files:.1f} GB of Comfy-Org files"
    extra = " + your clips" if t.training else f" + {loras:.2g} GB LoRA" if loras else " + your LoRA" if t.loras else ""
    return f"a diffusers folder{extra}"


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
    """One group per stage, numbered left to right in the order the graph runs."""
    titles = [t for t in (MODEL_GROUP, TRAIN_GROUP, LORA_GROUP, SAMPLE_GROUP, SAVE_GROUP) if any(n.group == t for n in nodes)]
    groups = []
    for index, title in enumerate(titles, start=1):
        members = [n for n in nodes if n.group == title]
        left, top = min(n.pos[0] for n in members), min(n.pos[1] for n in members)
        right = max(n.pos[0] + n.size[0] for n in members)
        bottom = max(n.pos[1] + n.size[1] for n in members)
        groups.append({"id": index, "title": f"{index}. {title}", "bounding": [left - 10, top - GROUP_HEAD, right - left + 20,
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
    sys.path.insert(0, str(HERE.parent))
    from bench.support.checkout import use_this_checkout

    use_this_checkout()  # `import vidmem` is this clone, installed or not
    sys.exit(main())
