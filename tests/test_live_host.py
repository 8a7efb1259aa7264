"""vidmem inside a real, running ComfyUI: skipped unless VIDMEM_COMFYUI_URL is set.

It checks that all five nodes appear in /object_info with their inputs, that the core nodes our
templates use match what the server declares, that each UI template's node types and widget
values load against /object_info, that each API workflow (shrunk to the tiny models' size and
steps, with a fresh seed so the cache cannot answer) queued with POST /prompt finishes with its
files saved (MP4 and WEBP under output/vidmem/), that a bad Memory Strategy comes back as HTTP 400
naming the input, that too many swapped blocks fail in the sampler as an execution_error, and that
the four offload tiers save identical pixels. Queue-time checks: a bad tile_size is one error on
tile_size, out-of-range numbers get ComfyUI's own messages, Wan frames=50 is refused on frames;
an older API workflow with the Strategy's own width/height/frames still runs; saved latents are
listed and loaded by core Load Latent; GET /vidmem/plan answers for listed models only; every
template's Templates-browser card is served. Standard library only for HTTP (PIL decodes the WEBPs).
The single-file templates need Comfy-Org's file names on the server, the LoRA templates their LoRA
names in models/loras: when the server does not list them and its models folder is on this machine
(VIDMEM_COMFYUI_MODELS, else ComfyUI's GET /internal/folder_paths), the test writes tiny files under
those names first (never over an existing file); otherwise their tests skip, naming the missing
files. The train templates get a few tiny captioned clips in the server's input folder as their data.
It also queues every API workflow with the headless client, `vidmem queue --set ... --out DIR`,
with the tiny models' sizes given as --set overrides, and checks the downloaded files, and
that GET /vidmem/memory answers memory figures only.

How to run it (ComfyUI 0.8.0, CPU, loopback only):

    # 1. the pack and tiny models under the workflows' model folder names
    ln -sfn "$PWD" /path/to/ComfyUI/custom_nodes/vidmem
    python tests/workflow_runner.py place-models /path/to/ComfyUI/models/diffusers
    python tests/workflow_runner.py place-files /path/to/ComfyUI/models   # or let the test do it
    # 2. the server
    cd /path/to/ComfyUI && python main.py --cpu --listen 127.0.0.1 --port 8188
    # 3. the test, from the repo root
    VIDMEM_COMFYUI_URL=http://127.0.0.1:8188 python -m pytest -q -rA tests/test_live_host.py

VIDMEM_COMFYUI_TIMEOUT (seconds, default 300) bounds each queued workflow.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest

try:
    from . import model_files, tiny_loras
    from . import workflow_runner as wr
except ImportError:  # tests/ is not a package: pytest put this folder on sys.path
    import model_files
    import tiny_loras
    import workflow_runner as wr

URL = os.environ.get("VIDMEM_COMFYUI_URL", "").rstrip("/")
TIMEOUT = float(os.environ.get("VIDMEM_COMFYUI_TIMEOUT", "300"))
pytestmark = pytest.mark.skipif(not URL, reason="set VIDMEM_COMFYUI_URL (e.g. http://127.0.0.1:8188) to test a running ComfyUI")

CLIENT_ID = f"vidmem-tests-{uuid.uuid4().hex[:8]}"
SAVE_NODES = ("SaveVideo", "SaveAnimatedWEBP")


def request(path: str, body: dict | None = None) -> tuple[int, object]:
    """(HTTP status, decoded JSON or raw bytes); an HTTP error status is returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(URL + path, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=60) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as error:
        status, raw = error.code, error.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def get_json(path: str):
    status, payload = request(path)
    assert status == 200, f"GET {path}: HTTP {status}: {payload!r:.500}"
    return payload


@pytest.fixture(scope="module")
def object_info():
    """The server's /object_info, after placing tiny files under the single-file templates' names
    when the server lists them not and its models folder is on this machine (never overwriting)."""
    info = get_json("/object_info")
    root = server_models_root() if unlisted_files(info) or unlisted_loras(info) else None
    if root is not None:
        model_files.place_tiny_model_files(root)
        tiny_loras.place_tiny_loras(server_loras_folder() or root / "loras")
        info = get_json("/object_info")  # ComfyUI lists new files at once (INPUT_TYPES per request)
    return info


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """Tiny captioned clips for the train templates, in the server's input folder (Prepare Training Data reads
    only folders there unless the server runs with VIDMEM_ALLOW_ANY_PATH=1): <models>/../input, when the models
    folder is on this machine; else a temporary folder, which such a server must allow."""
    root = server_models_root()
    if root is None or not (root.parent / "input").is_dir():
        yield tiny_loras.place_tiny_clips(tmp_path_factory.mktemp("vidmem_clips"))
        return
    folder = root.parent / "input" / f"vidmem_test_clips_{uuid.uuid4().hex[:8]}"
    try:
        yield tiny_loras.place_tiny_clips(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def server_loras_folder() -> Path | None:
    status, folders = request("/internal/folder_paths")
    found = [Path(f) for f in (folders.get("loras", []) if status == 200 and isinstance(folders, dict) else []) if Path(f).is_dir()]
    return found[0] if found else None


def unlisted_loras(info: dict, paths: list[Path] | None = None) -> list[str]:
    """models/loras/<file> of every LoRA the API workflows' Load LoRA nodes name that the server does not list."""
    listed = info.get(tiny_loras.LORA_NODE, {}).get("input", {}).get("required", {}).get("lora_name", [[]])[0]
    return sorted(f"models/loras/{name}" for name in tiny_loras.referenced_loras(paths) if name not in listed)


def server_models_root() -> Path | None:
    """The server's models folder when this machine can write it: VIDMEM_COMFYUI_MODELS, else the parent
    of the folder the server reports for diffusion_models (GET /internal/folder_paths) if it exists here."""
    if os.environ.get("VIDMEM_COMFYUI_MODELS"):
        return Path(os.environ["VIDMEM_COMFYUI_MODELS"])
    status, folders = request("/internal/folder_paths")
    if status != 200 or not isinstance(folders, dict):
        return None
    roots = [Path(folder).parent for folder in folders.get("diffusion_models", []) if Path(folder).is_dir()]
    return roots[0] if roots else None


def unlisted_files(info: dict, paths: list[Path] | None = None) -> list[str]:
    """models/<folder>/<file> of every file the API workflows' file loaders name that the server does not list."""
    node = info.get(wr.FILES_LOADER, {}).get("input", {})
    inputs = {**node.get("required", {}), **node.get("optional", {})}
    missing = set()
    for files in model_files.referenced_model_files(paths):
        for role, name in files.names:
            listed = inputs.get("model" if role == "model_2" else role, [[]])[0]
            if name not in listed:
                missing.add(f"models/{model_files.FOLDERS[role]}/{name}")
    return sorted(missing)


def require_files(api_path: Path, info: dict) -> None:
    """Skip a single-file or LoRA template's test when the server lists its files not, saying how to place them."""
    missing = unlisted_files(info, [api_path]) + unlisted_loras(info, [api_path])
    if missing:
        pytest.skip(f"{api_path.stem}: the server does not list {missing}; place tiny files under those names with "
                    "`python tests/workflow_runner.py place-files <ComfyUI>/models` (LoRAs: place-loras "
                    "<ComfyUI>/models/loras), or set "
                    "VIDMEM_COMFYUI_MODELS=<ComfyUI>/models and this test places them")


def server_spec(info: dict) -> wr.NodeSpec:
    """A NodeSpec from one /object_info entry, inputs in the server's input_order, combos as lists."""
    sections = {}
    for section in ("required", "optional"):
        entries = info["input"].get(section, {})
        order = info.get("input_order", {}).get(section, list(entries))
        sections[section] = {name: _as_v1(*entries[name]) for name in order}
    return wr.NodeSpec(sections, tuple(info["output"]), tuple(info.get("output_name", info["output"])), info["display_name"])


def _as_v1(input_type, config=None):
    config = config or {}
    if input_type == "COMBO":  # V3 nodes list combo options in the config
        return (list(config.get("options", [])), config)
    return (input_type, config)


def test_all_five_nodes_are_listed_with_their_inputs(object_info):
    for node_id, cls in wr.our_nodes().items():
        assert node_id in object_info, f"{node_id} missing from /object_info: did the pack fail to import? see the server log"
        listed, ours = object_info[node_id], cls.INPUT_TYPES()
        for section in ("required", "optional"):
            assert list(listed["input"].get(section, {})) == list(ours.get(section, {})), (node_id, section)
        assert tuple(listed["output"]) == tuple(cls.RETURN_TYPES), node_id
        assert listed["category"].startswith("vidmem"), node_id


def test_the_workflow_models_are_listed(object_info):
    listed = object_info["VidMemLoadPipeline"]["input"]["required"]["model"][0]
    missing = [name for name in wr.referenced_model_names() if name not in listed]
    assert not missing, f"not in the server's models/diffusers: {missing}; run `python tests/workflow_runner.py place-models <ComfyUI>/models/diffusers`"


def test_the_single_file_templates_files_are_listed(object_info):
    assert model_files.referenced_model_files(), "some template loads ComfyUI's own files"
    missing = unlisted_files(object_info)
    if missing:
        pytest.skip(f"not listed by the server: {missing}; run `python tests/workflow_runner.py place-files "
                    "<ComfyUI>/models` or set VIDMEM_COMFYUI_MODELS=<ComfyUI>/models")


def test_core_node_table_matches_the_server(object_info):
    for node_id, ours in wr.CORE_NODES.items():
        listed = server_spec(object_info[node_id])
        assert [(n, t, o) for n, t, _c, o in listed.ordered_inputs()] == [(n, t, o) for n, t, _c, o in ours.ordered_inputs()], node_id
        assert listed.outputs == ours.outputs, node_id


@pytest.mark.parametrize("path", wr.ui_files(), ids=lambda p: p.stem)
def test_ui_template_loads_against_object_info(path, object_info):
    require_files(wr.api_twin(path), object_info)
    problems = []
    for node in wr.load_json(path)["nodes"]:
        if node["type"] in wr.VIRTUAL_NODES:
            continue
        if node["type"] not in object_info:
            problems.append(f"{node['type']}: not a node type on this server")
            continue
        spec = server_spec(object_info[node["type"]])
        names, values = wr.widget_names(spec), node["widgets_values"]
        if len(names) != len(values):
            problems.append(f"{node['type']}: {len(values)} widget values, the server has widgets {names}")
            continue
        configs = {name: (t, config) for name, t, config, _o in spec.ordered_inputs()}
        problems += [f"{node['type']}.{name}: {wr.value_problem(*configs[name], value)}"
                     for name, value in zip(names, values)
                     if name != "control_after_generate" and wr.value_problem(*configs[name], value)]
    assert not problems, "\n".join(problems)


def test_templates_are_served():
    listed = get_json("/api/workflow_templates")
    names = {name for templates in listed.values() for name in templates}
    assert {p.stem for p in wr.ui_files()} <= names, listed


def queue(api: dict) -> str:
    status, payload = request("/prompt", {"prompt": api, "client_id": CLIENT_ID})
    assert status == 200, f"POST /prompt: HTTP {status}: {json.dumps(payload, indent=1)[:3000]}"
    return payload["prompt_id"]


def wait_for(prompt_id: str) -> dict:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        entry = get_json(f"/history/{prompt_id}").get(prompt_id)
        if entry and (entry["status"].get("completed") or entry["status"].get("status_str") == "error"):
            return entry
        time.sleep(0.5)
    pytest.fail(f"prompt {prompt_id} did not finish in {TIMEOUT:.0f} s; queue: {get_json('/queue')}")


def execution_errors(entry: dict) -> list:
    return [data for kind, data in entry["status"].get("messages", []) if kind == "execution_error"]


def fetch_output(file: dict) -> bytes:
    query = urllib.parse.urlencode({k: file.get(k, "") for k in ("filename", "subfolder", "type")})
    status, payload = request(f"/view?{query}")
    assert status == 200, f"/view?{query}: HTTP {status}"
    return payload if isinstance(payload, bytes) else json.dumps(payload).encode()


def looks_like(filename: str, data: bytes) -> bool:
    """The container's magic bytes: MP4 has 'ftyp' at offset 4, WEBP is RIFF....WEBP."""
    if filename.endswith(".mp4"):
        return data[4:8] == b"ftyp"
    if filename.endswith(".webp"):
        return data[:4] == b"RIFF" and data[8:12] == b"WEBP"
    return len(data) > 0


@pytest.mark.parametrize("path", wr.api_files(), ids=lambda p: p.stem)
def test_api_workflow_runs_in_the_host(path, object_info, clips):
    require_files(path, object_info)
    seed = time.time_ns() % 2**32  # a fresh seed: the execution cache cannot answer for the sampler
    api = wr.shrink_for_tiny(wr.load_json(path), seed=seed, clips=clips)
    prompt_id = queue(api)
    entry = wait_for(prompt_id)
    assert entry["status"]["status_str"] == "success", json.dumps(execution_errors(entry), indent=1)[:4000]

    outputs = entry["outputs"]
    saved = []
    for nid, node in api.items():
        if node["class_type"] in SAVE_NODES:
            files = outputs.get(nid, {}).get("images", [])
            assert files, f"{node['class_type']} (node {nid}) saved nothing: {outputs.get(nid)}"
            for file in files:
                data = fetch_output(file)
                assert looks_like(file["filename"], data), f"{file['filename']} is not a valid file ({data[:16]!r})"
                saved.append((file["subfolder"], file["filename"], len(data)))
        if node["class_type"] == "VidMemVideoSampler" and "1" in api and api["1"]["class_type"] == wr.FILES_LOADER:
            check_files_receipt(api["1"]["inputs"], outputs[nid]["text"][0])
        if node["class_type"] == "VidMemVideoSampler":  # it sampled with every LoRA loaded or trained before it
            check_lora_receipt(api, outputs[nid]["text"][0])
    assert saved
    print(f"\n{path.name}: prompt {prompt_id} seed {seed}: {entry['status']['status_str']}; saved {saved}")


def check_files_receipt(loader: dict, text: str) -> None:
    """The Sampler's text names the files it ran from, their storage and the disk tier."""
    assert loader["model"] in text and loader["text_encoder"] in text, text[:600]
    assert f"transformer {model_files.storage_named(loader['model'])}" in text, text[:600]
    assert ("mapped from the files" in text) is loader["weights_on_disk"], text[:600]


def check_lora_receipt(api: dict, text: str) -> None:
    names = [n["inputs"]["lora_name"] for n in api.values() if n["class_type"] == tiny_loras.LORA_NODE]
    names += [n["inputs"]["lora_name"] + ".safetensors" for n in api.values() if n["class_type"] == wr.TRAIN_NODE]
    assert all(name in text for name in names), (names, text[:800])


def blockswap_api(seed: int | None = None) -> tuple[dict, dict]:
    """The block-swap template at the tiny size, and node ids by class type."""
    api = wr.shrink_for_tiny(wr.load_json(wr.API_DIR / "wan21_t2v_blockswap.json"), seed=seed or time.time_ns() % 2**32)
    return api, {node["class_type"]: nid for nid, node in api.items()}


def node_errors(api: dict) -> dict:
    status, payload = request("/prompt", {"prompt": api, "client_id": CLIENT_ID})
    assert status == 400, f"expected HTTP 400, got {status}: {payload!r:.500}"
    return payload["node_errors"]


def named_refusal(errors: list, name: str, words: str) -> dict:
    """ComfyUI 0.8.0 attaches a node's own queue-time refusal to every input its VALIDATE_INPUTS reads
    (docs/robustness.md): the refusal is on `name`, and every copy is the same message, about `name`."""
    on_input = [e for e in errors if e["extra_info"]["input_name"] == name]
    assert on_input and words in on_input[0]["details"], errors
    assert all(e["details"].split(" - ", 1)[-1] == on_input[0]["details"].split(" - ", 1)[-1] for e in errors), errors
    return on_input[0]


def test_a_bad_tile_size_is_refused_on_tile_size_when_queued():
    api, ids = blockswap_api(seed=1)
    api[ids["VidMemMemoryStrategy"]]["inputs"]["tile_size"] = 100
    errors = node_errors(api)
    assert list(errors) == [ids["VidMemMemoryStrategy"]], errors
    error = named_refusal(errors[ids["VidMemMemoryStrategy"]]["errors"], "tile_size", "tile_size=100 must be a multiple of 32")
    print(f"\ntile_size=100: {error['details']}")


@pytest.mark.parametrize("node, name, value, kind", [
    ("VidMemMemoryStrategy", "prefetch_blocks", 1000, "value_bigger_than_max"),
    ("VidMemMemoryStrategy", "blocks_to_swap", 999, "value_bigger_than_max"),
    ("VidMemMemoryStrategy", "offload", "fast", "value_not_in_list"),
])
def test_out_of_range_numbers_get_comfyuis_own_messages(node, name, value, kind):
    api, ids = blockswap_api(seed=1)
    api[ids[node]]["inputs"][name] = value
    errors = node_errors(api)[ids[node]]["errors"]
    assert [(e["type"], e["extra_info"]["input_name"]) for e in errors] == [(kind, name)], errors


@pytest.mark.parametrize("node, name, value, words", [
    ("VidMemMemoryStrategy", "vram_budget_gb", -5, "vram_budget_gb=-5"),
    ("VidMemVideoSampler", "width", -16, "width=-16 must be from 16 to 4096"),
    ("VidMemVideoSampler", "cfg", float("inf"), "cfg=inf is not a finite number"),
])
def test_inputs_the_nodes_check_themselves_are_refused_by_name_when_queued(node, name, value, words):
    """Inputs a node's VALIDATE_INPUTS reads (floats: NaN passes ComfyUI's min/max) lose ComfyUI's own
    range check, so the node repeats it (nodes/checks.py)."""
    api, ids = blockswap_api(seed=1)
    api[ids[node]]["inputs"][name] = value
    named_refusal(node_errors(api)[ids[node]]["errors"], name, words)


def test_wan_frames_50_is_refused_at_queue_time_on_frames():
    api, ids = blockswap_api(seed=1)
    api[ids["VidMemVideoSampler"]]["inputs"]["frames"] = 50
    errors = node_errors(api)
    error = named_refusal(errors[ids["VidMemVideoSampler"]]["errors"], "frames", "use 49 or 53")
    print(f"\nframes=50: {error['details']}")


def run_and_fail(api: dict) -> dict:
    entry = wait_for(queue(api))
    errors = execution_errors(entry)
    assert entry["status"]["status_str"] == "error" and errors, entry["status"]
    return errors[0]


def test_cfg_nan_is_refused_when_queued_and_never_reaches_the_history():
    """JSON NaN passes ComfyUI's min/max; queued, it sat in /history as JSON a browser cannot parse."""
    api, ids = blockswap_api()
    api[ids["VidMemVideoSampler"]]["inputs"]["cfg"] = float("nan")
    named_refusal(node_errors(api)[ids["VidMemVideoSampler"]]["errors"], "cfg", "cfg=nan is not a finite number")


def test_block_swap_with_no_blocks_stops_the_strategy_node_naming_the_input():
    """A rule between two inputs: shown on the node by the live plan before queueing, raised when the node runs."""
    api, ids = blockswap_api()
    api[ids["VidMemMemoryStrategy"]]["inputs"].update(offload="block_swap", blocks_to_swap=0)
    error = run_and_fail(api)
    assert error["node_type"] == "VidMemMemoryStrategy" and "blocks_to_swap" in error["exception_message"], error


def test_too_many_swapped_blocks_are_refused_by_the_loader_before_it_loads():
    """The loader checks the Sampler's Memory Strategy against the model's config before reading a
    weight (nodes/preflight.py); the message names the Strategy node and the input."""
    api, ids = blockswap_api()
    api[ids["VidMemMemoryStrategy"]]["inputs"]["blocks_to_swap"] = 99
    error = run_and_fail(api)
    assert error["node_type"] in ("VidMemLoadPipeline", "VidMemLoadModelFiles"), error
    assert "before loading" in error["exception_message"] and "blocks_to_swap=99" in error["exception_message"], error
    print(f"\ntoo many blocks: {error['node_type']}: {error['exception_message']}")


def test_an_older_api_workflow_with_the_strategys_own_shape_still_runs():
    api, ids = blockswap_api()
    api[ids["VidMemMemoryStrategy"]]["inputs"].update(width=832, height=480, frames=81)  # as saved before
    entry = wait_for(queue(api))
    assert entry["status"]["status_str"] == "success", json.dumps(execution_errors(entry))[:2000]


def test_saved_latents_are_listed_and_loaded_by_core_load_latent():
    api, ids = blockswap_api()
    api[ids["VidMemVAEDecode"]]["inputs"]["save_latents"] = True
    entry = wait_for(queue(api))
    assert entry["status"]["status_str"] == "success", json.dumps(execution_errors(entry))[:2000]
    saved = next(iter(entry["outputs"][ids["VidMemVAEDecode"]]["vidmem_receipt"]))["saved_latents"]
    listed = get_json("/object_info/LoadLatent")["LoadLatent"]["input"]["required"]["latent"][0]
    assert saved in listed, (saved, listed[-5:])
    # core Load Latent -> our decode -> core Save Animated WEBP
    reload = {
        "1": api[ids["VidMemLoadPipeline"]],
        "2": {"class_type": "LoadLatent", "inputs": {"latent": saved}},
        "3": {"class_type": "VidMemVAEDecode", "inputs": {"pipeline": ["1", 0], "latent": ["2", 0]}},
        "4": {"class_type": "SaveAnimatedWEBP", "inputs": {"images": ["3", 0], "filename_prefix": "vidmem/tests/reloaded",
              "fps": 8.0, "lossless": True, "quality": 90, "method": "default"}},
    }
    entry = wait_for(queue(reload))
    assert entry["status"]["status_str"] == "success", json.dumps(execution_errors(entry))[:2000]
    assert entry["outputs"]["4"]["images"], entry["outputs"]
    print(f"\nsaved {saved}: listed by Load Latent and decoded again")


def test_plan_route_answers_for_a_listed_model_only():
    model = wr.loader_models(wr.load_json(wr.API_DIR / "wan21_t2v_blockswap.json"))["1"]
    query = urllib.parse.urlencode(dict(model=model, dtype="bf16", offload="block_swap", blocks_to_swap=1, vae_tiling="true",
                                        width=32, height=32, frames=9, client="live-test"))
    plan = get_json(f"/api/vidmem/plan?{query}")
    assert plan["status"] == "ok" and plan["rows"][plan["chosen"]]["label"] == "your settings", plan
    assert get_json(f"/vidmem/plan?{query}")["cached"] is True
    status, bad = request("/vidmem/plan?" + urllib.parse.urlencode(dict(model="/etc", width=32, height=32, frames=9)))
    assert status == 400 and bad["input"] == "model"


def test_every_template_has_its_card_served():
    for path in wr.ui_files():
        status, payload = request("/api/workflow_templates/vidmem/" + urllib.parse.quote(wr.thumbnail(path).name))
        assert status == 200 and isinstance(payload, bytes) and payload[:3] == b"\xff\xd8\xff", (path.stem, status)


def test_every_offload_tier_saves_the_same_video():
    """Same seed, four tiers, run by the host: the lossless WEBPs it saves hold identical pixels."""
    base = wr.shrink_for_tiny(wr.load_json(wr.API_DIR / "wan21_t2v_blockswap.json"), seed=time.time_ns() % 2**32)
    ids = {node["class_type"]: nid for nid, node in base.items()}
    tiers = {"none": 0, "model": 0, "block_swap": base[ids["VidMemMemoryStrategy"]]["inputs"]["blocks_to_swap"], "sequential": 0}
    videos = {}
    for offload, blocks in tiers.items():
        api = json.loads(json.dumps(base))
        api[ids["VidMemMemoryStrategy"]]["inputs"].update(offload=offload, blocks_to_swap=blocks)
        api[ids["SaveAnimatedWEBP"]]["inputs"].update(lossless=True, filename_prefix=f"vidmem/tests/tier_{offload}")
        api[ids["SaveVideo"]]["inputs"]["filename_prefix"] = f"vidmem/tests/tier_{offload}"
        entry = wait_for(queue(api))
        assert entry["status"]["status_str"] == "success", json.dumps(execution_errors(entry))[:2000]
        videos[offload] = webp_pixels(fetch_output(entry["outputs"][ids["SaveAnimatedWEBP"]]["images"][0]))
    assert len(set(videos.values())) == 1, {tier: hash(data) for tier, data in videos.items()}
    print(f"\ntiers {list(videos)}: identical pixels in the lossless WEBPs ({len(videos['none'])} bytes of RGB)")


def webp_pixels(data: bytes) -> bytes:
    """Every frame's RGB bytes (the file itself also embeds the prompt, which differs per tier)."""
    import io

    from PIL import Image, ImageSequence

    with Image.open(io.BytesIO(data)) as image:
        return b"".join(frame.convert("RGB").tobytes() for frame in ImageSequence.Iterator(image))


def tiny_overrides(path, clips: Path | None = None) -> list[str]:
    """`--set NODE.INPUT=VALUE` for every input shrink_for_tiny changes (sizes, steps, blocks, seed, clips)."""
    original = wr.load_json(path)
    shrunk = wr.shrink_for_tiny(original, seed=time.time_ns() % 2**32, clips=clips)
    return [f"{nid}.{name}={json.dumps(value)}" for nid, node in shrunk.items()
            for name, value in node["inputs"].items() if original[nid]["inputs"][name] != value]


@pytest.mark.parametrize("path", wr.api_files(), ids=lambda p: p.stem)
def test_queue_client_runs_every_api_workflow(path, tmp_path, capsys, object_info, clips):
    from vidmem.cli.queue import main as queue_main

    require_files(path, object_info)
    overrides = tiny_overrides(path, clips)
    argv = ["queue", str(path), "--server", URL, "--out", str(tmp_path), "--timeout", str(TIMEOUT)]
    for setting in overrides:
        argv += ["--set", setting]
    code = queue_main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    saved = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert {p.suffix for p in saved} == {".mp4", ".webp"}, saved
    assert all(looks_like(p.name, p.read_bytes()) for p in saved)
    assert "Video Sampler:" in captured.out and "VAE Decode" in captured.out, "the receipts are printed"
    with capsys.disabled():
        print(f"\nvidmem queue {path.name} {' '.join('--set ' + s for s in overrides)}: exit {code}; "
              f"saved {[str(p.relative_to(tmp_path)) for p in saved]}")


def test_memory_route_answers_memory_figures_only():
    figures = get_json("/vidmem/memory")
    assert set(figures) == {"ram", "process_rss_bytes", "cuda", "vidmem_kept_bytes"}
    assert figures["vidmem_kept_bytes"] >= 0  # weights kept between runs (none on --cpu)
    assert set(figures["ram"]) == {"total_bytes", "available_bytes"}
    for device in figures["cuda"]:
        assert set(device) == {"index", "allocated_bytes", "reserved_bytes", "free_bytes", "total_bytes"}
    assert get_json("/api/vidmem/memory").keys() == figures.keys()


def test_a_step_cache_skips_blocks_and_their_copies_under_block_swap():
    """Step Cache (VidMem) linked to the Sampler's cache input: the receipt counts blocks computed and
    the streamed copies the cache saved; a calibration run saves ratios the node then lists."""
    api, ids = blockswap_api()
    sampler = ids["VidMemVideoSampler"]
    api[sampler]["inputs"]["steps"] = 6
    api["90"] = {"class_type": "VidMemStepCache", "inputs": dict(method="first_block_cache", threshold=0.9, retention=0.0,
                                                                    max_skip_steps=3, mag_ratios="auto")}
    api[sampler]["inputs"]["cache"] = ["90", 0]
    entry = wait_for(queue(api))
    assert entry["status"]["status_str"] == "success", json.dumps(execution_errors(entry))[:2000]
    receipt = next(iter(entry["outputs"][sampler]["vidmem_receipt"]))["cache"]
    assert receipt["blocks_skipped"] > 0 and receipt["streamed_copies_skipped"] > 0, receipt
    api["90"]["inputs"].update(method="mag_cache", mag_ratios="calibrate")
    entry = wait_for(queue(api))
    assert entry["status"]["status_str"] == "success", json.dumps(execution_errors(entry))[:2000]
    saved = next(iter(entry["outputs"][sampler]["vidmem_receipt"]))["cache"]["ratios_file"]
    choices = get_json("/object_info/VidMemStepCache")["VidMemStepCache"]["input"]["required"]["mag_ratios"][0]
    assert saved in choices, choices
    print(f"\nstep cache: {receipt['blocks_computed']} of {receipt['blocks_computed'] + receipt['blocks_skipped']} "
          f"blocks computed, {receipt['streamed_copies_skipped']} copies saved; calibration saved {saved}")
