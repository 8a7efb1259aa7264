"""One beyond_ram run in its own process: load with the loader node, sample, decode, measure.

    python bench/support/beyond_ram_run.py RUN.json OUT.json

RUN.json: {"models": root of a ComfyUI-style models/ tree, "files": {role: file name},
"weights_on_disk", "dtype", "vae_dtype", "offload", "prompt", "width", "height", "frames", "steps", "cfg", "seed"}.
OUT.json gets the memory peaks (overall and per phase), wall seconds, the nodes' receipts and the
pipeline's storage. Nodes run as ComfyUI would call them; outside ComfyUI the loader node finds its
files through a stand-in for ComfyUI's `folder_paths` over the models/ tree (nodes/host.py reads
model folders only from `folder_paths`), as the pack's node tests do.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.support.checkout import use_this_checkout  # noqa: E402

use_this_checkout()  # `import vidmem` is this clone, installed or not

from bench.support.memwatch import MemoryWatch  # noqa: E402

FOLDER_KEYS = {"diffusion_models": "diffusion_models", "unet": "diffusion_models", "text_encoders": "text_encoders",
               "clip": "text_encoders", "vae": "vae", "clip_vision": "clip_vision"}


def folder_paths_stand_in(models: Path, user: Path) -> SimpleNamespace:
    """ComfyUI's folder_paths functions nodes/host.py calls, over `models` (user: the prompt cache's root)."""
    def folders(key: str) -> list[str]:
        return [str(models / FOLDER_KEYS[key])]  # KeyError for keys ComfyUI would not know either

    def names(key: str) -> list[str]:
        root = models / FOLDER_KEYS[key]
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.is_dir() else []

    return SimpleNamespace(models_dir=str(models), get_folder_paths=folders, get_filename_list=names,
                           get_user_directory=lambda: str(user), get_input_directory=lambda: str(user / "input"),
                           get_output_directory=lambda: str(user / "output"))


def work_around_prompt_cache_index() -> list[str]:
    """pipelines/prompt_cache.py `_sampled_bytes` picks its sample indices with a float32 linspace,
    which rounds the last index of a tensor over 2**24 elements up past its end (umt5-xxl's
    256384 x 4096 embedding: IndexError in every Sampler run). Probed on a 2**24 + 4 element view
    (no memory); only when it fails, the same function with float64 indices replaces it for this
    process, and the run's JSON says so. Nothing is patched once the module is fixed."""
    import torch
    from vidmem.pipelines import prompt_cache

    probe = torch.zeros(1, dtype=torch.uint8).expand(2**24 + 4)
    try:
        prompt_cache._sampled_bytes("probe", probe)
        return []
    except IndexError:
        pass
    original = prompt_cache._sampled_bytes

    def sampled_bytes(name: str, tensor: torch.Tensor) -> bytes:
        flat = tensor.detach().reshape(-1)
        if tensor.device.type == "meta" or flat.numel() <= 2**24:
            return original(name, tensor)
        count = min(prompt_cache.SAMPLES_PER_TENSOR, flat.numel())
        index = torch.linspace(0, flat.numel() - 1, count, dtype=torch.float64).round().long()
        values = flat[index.to(flat.device)].to("cpu")
        if values.is_floating_point() and values.element_size() == 1:
            values = values.view(torch.uint8)
        return values.contiguous().view(torch.uint8).numpy().tobytes()

    prompt_cache._sampled_bytes = sampled_bytes
    return ["pipelines/prompt_cache.py _sampled_bytes: float32 linspace index past the end of tensors over 2**24 "
            "elements (IndexError on umt5-xxl's embedding); float64 indices used for those tensors in this run"]


def widget_defaults(node) -> dict:
    return {name: spec[1]["default"] for name, spec in node.INPUT_TYPES()["required"].items()
            if len(spec) > 1 and "default" in spec[1]}


def run(settings: dict, watch: MemoryWatch, user: Path) -> dict:
    from vidmem.nodes import host
    from vidmem.nodes.decode import VidMemVAEDecode
    from vidmem.nodes.load_files import VidMemLoadModelFiles
    from vidmem.nodes.sampler import VidMemVideoSampler
    from vidmem.nodes.strategy import VidMemMemoryStrategy

    loader = "VidMemLoadModelFiles (inside ComfyUI)"
    if not host.in_comfyui():
        host.folder_paths = folder_paths_stand_in(Path(settings["models"]), user)
        loader = "VidMemLoadModelFiles over a folder_paths stand-in (models/ tree, no ComfyUI)"
    workarounds = work_around_prompt_cache_index()
    files = settings["files"]
    listed = {role: host.model_file_names(role) for role in files}
    missing = [f"{role} {name}" for role, name in files.items() if name not in listed[role]]
    if missing:
        raise SystemExit(f"the loader node does not list {', '.join(missing)} (it lists {listed})")

    watch.phase("load")
    (pipeline,) = VidMemLoadModelFiles().load(files["model"], files["text_encoder"], files["vae"], settings["dtype"],
                                              settings["vae_dtype"], "default", settings["weights_on_disk"])
    watch.phase("strategy")
    widgets = dict(widget_defaults(VidMemMemoryStrategy), offload=settings["offload"])
    strategy = VidMemMemoryStrategy().build(**widgets)["result"][0]
    watch.phase("sample")
    sampled = VidMemVideoSampler().sample(pipeline, strategy, settings["prompt"], "", settings["width"],
                                          settings["height"], settings["frames"], settings["steps"], settings["cfg"],
                                          settings["seed"])
    (latent,) = sampled["result"]
    watch.phase("decode")
    decoded = VidMemVAEDecode().decode(pipeline, latent, strategy)
    watch.phase("done")
    (frames,) = decoded["result"]
    return {
        "loader": loader,
        "workarounds": workarounds,
        "pipeline": pipeline.describe(),
        "storage": dict(pipeline.storage),
        "storage_reports": {name: report.describe() for name, report in pipeline.storage_reports.items()},
        "sampler_receipt": sampled["ui"]["vidmem_receipt"][0],
        "decode_receipt": decoded["ui"]["vidmem_receipt"][0],
        "latent_shape": list(latent["samples"].shape),
        "frames_shape": list(frames.shape),
        "frames_finite": bool(frames.isfinite().all()),
        "frames_mean": float(frames.float().mean()),
    }


def main() -> None:
    settings = json.loads(Path(sys.argv[1]).read_text())
    started, load_before = time.perf_counter(), os.getloadavg()
    with MemoryWatch(settings.get("interval_s", 0.02)) as watch:
        watch.phase("import")
        import torch  # noqa: F401 - counted in the import phase, as every run pays it

        import vidmem.nodes  # noqa: F401
        with tempfile.TemporaryDirectory(prefix="beyond_ram_user_") as user:  # a fresh prompt cache: the encoder runs
            result = run(settings, watch, Path(user))
    result["seconds_total"] = round(time.perf_counter() - started, 3)
    result["memory"] = watch.summary()
    result["torch_threads"] = torch.get_num_threads()
    result["load_average_1min"] = {"start": load_before[0], "end": os.getloadavg()[0]}  # other work on this machine
    Path(sys.argv[2]).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
