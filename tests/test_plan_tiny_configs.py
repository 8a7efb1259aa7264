"""Models whose config lives in ComfyUI's models/vidmem_configs (not a shipped name) can be planned:
the Sampler's prediction and `auto` for a pipeline loaded from such files, and the config file itself."""

from __future__ import annotations


import pytest

from vidmem.memory import MemoryStrategy
from vidmem.memory.plan.stages import VideoShape
from vidmem.pipelines.comfy_files import LoadOptions, load_model_files, shipped_catalogue
from vidmem.pipelines.configs import load_model
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.planning import choose_for, plan_options, plan_strategy
from vidmem.pipelines.tiny_files import save_tiny_comfy_files

SHAPE = VideoShape(32, 32, 9)
GiB = 2**30


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    root = tmp_path_factory.mktemp("comfy-models")
    out = save_tiny_comfy_files("wan2.1-t2v", root, "fp8_scaled", reference=False)
    return load_model_files(out.files, LoadOptions(dtype="fp32"), shipped_catalogue([root / "vidmem_configs"]))


def test_a_pipeline_from_files_matched_to_a_host_config_is_planned_as_loaded(loaded):
    assert loaded.config_name == "tiny-wan2.1-t2v"
    plan = plan_strategy(loaded, SHAPE, MemoryStrategy(offload="model"), 8 * GiB, 32 * GiB)
    assert plan.fits and "fp8_scaled" in plan.describe_storage() and plan_options(loaded).on_disk
    chosen = choose_for(loaded, SHAPE, MemoryStrategy(), 8 * GiB, 32 * GiB)  # offload=auto
    assert chosen.fits


def test_a_config_file_loads_by_path_and_a_damaged_one_is_named(loaded, tmp_path):
    model = load_model(loaded.folder)
    assert model.name == "tiny-wan2.1-t2v" and loaded.folder.endswith("tiny-wan2.1-t2v.json")
    assert load_model("wan2.1-t2v-1.3b").name == "wan2.1-t2v-1.3b"  # shipped names are still names
    damaged = tmp_path / "broken.json"
    damaged.write_text("{not json")
    with pytest.raises(ModelError, match="broken.json"):
        load_model(str(damaged))
