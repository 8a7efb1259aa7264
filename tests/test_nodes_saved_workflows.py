"""What saved workflows and queued prompts rely on at every node's door.

A UI workflow stores a node's widget values as a bare list (`widgets_values`), by position: the
required inputs, then the optional ones, in INPUT_TYPES order, an INT seed followed by the
frontend's control_after_generate (tests/workflow_runner.py `widget_names`, which
workflows/generate.py writes the templates with). Moving a widget makes every saved workflow load
its values into the wrong widgets, silently when the types agree (two INTs); a new widget may only
be appended (older workflows then get its default). SAVED_ORDER freezes every node's order as
released: a change that is not an append at the end fails here.

ComfyUI calls VALIDATE_INPUTS with the inputs the prompt holds, also when a required one is
missing (it reports that itself afterwards): a parameter without a default turns its message into
a TypeError.
"""

from __future__ import annotations

import inspect

import pytest

try:
    from . import workflow_runner as wr
except ImportError:  # tests/ is not a package: pytest put this folder on sys.path
    import workflow_runner as wr

from vidmem.nodes import NODE_CLASS_MAPPINGS
from vidmem.nodes.cache import VidMemStepCache

SAVED_ORDER = {
    "VidMemLoadPipeline": ["model", "dtype", "path", "transformer_file", "weight_dtype", "vae_dtype", "vae_file",
                           "text_encoder_file", "text_encoder_2_file"],
    "VidMemLoadModelFiles": ["model", "text_encoder", "vae", "dtype", "vae_dtype", "weight_dtype", "weights_on_disk",
                             "model_2", "clip_vision"],
    "VidMemMemoryStrategy": ["offload", "blocks_to_swap", "prefetch_blocks", "max_pinned_ram_gb", "non_blocking",
                             "text_encoder", "vae_slicing", "vae_tiling", "tile_size", "overlap", "temporal_size",
                             "temporal_overlap", "vram_budget_gb", "ram_budget_gb", "gpus", "context_parallel",
                             "activation_chunks"],
    "VidMemVideoSampler": ["prompt", "negative_prompt", "width", "height", "frames", "steps", "cfg", "seed",
                           "control_after_generate", "scheduler", "shift", "cfg_2", "boundary_ratio", "resize", "window",
                           "window_overlap"],
    "VidMemStepCache": ["method", "threshold", "retention", "max_skip_steps", "mag_ratios", "interval", "warmup_steps",
                        "end_steps", "order"],
    "VidMemSpeed": ["attention", "compile", "compile_mode", "compile_dynamic", "fp8_matmul"],
    "VidMemVAEDecode": ["save_latents"],
    "VidMemDecodeAudio": [],
    "VidMemFreeVRAM": ["unload_comfy_models"],
    "VidMemLoadLoRA": ["lora_name", "strength", "expert"],
    "VidMemPrepareTrainingData": ["folder", "resolutions", "frame_buckets"],
    "VidMemTrainLoRA": ["lora_name", "rank", "alpha", "learning_rate", "steps", "batch_size", "seed",
                        "control_after_generate", "target_modules", "gradient_checkpointing", "optimizer",
                        "checkpoint_every", "resume", "expert", "activation_offload"],
}


def order_problem(node_id: str) -> str | None:
    """Why `node_id`'s widgets no longer line up with its saved workflows' values, or None."""
    saved, now = SAVED_ORDER[node_id], wr.widget_names(wr.node_spec(node_id))
    if now[: len(saved)] == saved:
        return None
    moved = [f"{i}: {old} -> {new}" for i, (old, new) in enumerate(zip(saved, now)) if old != new]
    missing = [name for name in saved if name not in now]
    return (f"{node_id}: saved workflows' widgets_values no longer line up (position: saved -> now: "
            f"{', '.join(moved) or 'none'}; gone: {', '.join(missing) or 'none'}); add new widgets at the end only")


def test_every_node_has_a_saved_widget_order():
    assert set(SAVED_ORDER) == set(NODE_CLASS_MAPPINGS)


@pytest.mark.parametrize("node_id", sorted(SAVED_ORDER))
def test_widgets_keep_their_saved_positions(node_id):
    assert order_problem(node_id) is None


def _step_cache_inputs(reorder):
    spec = VidMemStepCache.INPUT_TYPES()
    return lambda: {**spec, "optional": reorder(dict(spec["optional"]))}


def test_two_widgets_swapped_are_caught(monkeypatch):
    def swap(optional):
        names = list(optional)
        i, j = names.index("interval"), names.index("warmup_steps")
        names[i], names[j] = names[j], names[i]
        return {name: optional[name] for name in names}

    monkeypatch.setattr(VidMemStepCache, "INPUT_TYPES", _step_cache_inputs(swap))
    problem = order_problem("VidMemStepCache")
    assert problem is not None and "5: interval -> warmup_steps" in problem and "6: warmup_steps -> interval" in problem


def test_a_widget_appended_at_the_end_is_allowed(monkeypatch):
    monkeypatch.setattr(VidMemStepCache, "INPUT_TYPES",
                        _step_cache_inputs(lambda optional: {**optional, "new_widget": ("INT", {"default": 1})}))
    assert order_problem("VidMemStepCache") is None


def _no_argument_validators():
    for node_id, cls in sorted(NODE_CLASS_MAPPINGS.items()):
        if getattr(cls, "VALIDATE_INPUTS", None) is None:
            continue
        yield pytest.param(cls, id=node_id)


@pytest.mark.parametrize("cls", _no_argument_validators())
def test_validate_inputs_answers_with_every_input_missing(cls):
    """As ComfyUI calls it for a prompt that lacks a required input: a parameter without a default raises
    TypeError here; with one (None, as a linked input) ComfyUI's own "required input missing" follows."""
    assert cls.VALIDATE_INPUTS() is True


def test_load_pipeline_path_tooltip_says_model_is_still_checked():
    """ComfyUI checks `model` against its list when queued, path or not (VALIDATE_INPUTS does not name it, so
    that check stays on): a workflow saved elsewhere needs `model` picked again, and the tooltip says so."""
    from vidmem.nodes.loader import VidMemLoadPipeline

    tooltip = VidMemLoadPipeline.INPUT_TYPES()["optional"]["path"][1]["tooltip"]
    assert "overrides" not in tooltip and "'model' must still name a folder in its list" in tooltip
    assert "model" not in inspect.signature(VidMemLoadPipeline.VALIDATE_INPUTS).parameters
