"""GET /vidmem/plan for a Load Video Model Files node: names from the host's lists, model and storage from the files."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from vidmem.nodes import host, plan_files
from vidmem.nodes.plan_route import PlanRequestError, parse_request, plan_answer
from vidmem.pipelines.loader import DTYPES
from vidmem.pipelines.tiny_files import save_tiny_comfy_files

BUDGETS = (8 * 2**30, 32 * 2**30)
FOLDERS = {"diffusion_models": "diffusion_models", "unet": "diffusion_models", "text_encoders": "text_encoders",
           "clip": "text_encoders", "vae": "vae", "clip_vision": "clip_vision", "diffusers": "diffusers"}


@pytest.fixture
def models(tmp_path, monkeypatch):
    """Tiny fp8-scaled Wan 2.1 files in a models/ tree that a stand-in folder_paths lists."""
    files = save_tiny_comfy_files("wan2.1-t2v", tmp_path, "fp8_scaled", reference=False)
    folders = {key: tmp_path / sub for key, sub in FOLDERS.items()}
    fake = SimpleNamespace(
        models_dir=str(tmp_path),
        get_folder_paths=lambda key: [str(folders[key])],
        get_filename_list=lambda key: sorted(p.name for p in folders[key].glob("*") if p.is_file()),
    )
    monkeypatch.setattr(host, "folder_paths", fake)
    plan_files.recognise.cache_clear()
    return files.files


def query(files, **changes):
    loader = {"model": files.model.name, "text_encoder": files.text_encoder.name, "vae": files.vae.name,
              "model_2": "(none)", "clip_vision": "(none)", "dtype": "bf16", "vae_dtype": "fp32",
              "weight_dtype": "default", "weights_on_disk": "true", **changes}
    return {"loader": "VidMemLoadModelFiles", "model": loader["model"], "dtype": loader["dtype"],
            "text_encoder": "offload_after_encoding", "width": "32", "height": "32", "frames": "9",
            **{f"loader_{name}": value for name, value in loader.items()}}


def answer(q):
    def no_folder(name, dtype):
        raise AssertionError("a files request must not be planned as a diffusers folder")
    return plan_answer(parse_request(q, [], list(DTYPES)), no_folder, BUDGETS)


def test_files_are_recognised_with_their_storage_and_the_disk_tier(models):
    plan = answer(query(models))
    assert plan["status"] == "ok", plan
    assert plan["config"] == "tiny-wan2.1-t2v"
    assert plan["storage"]["transformer"] == "fp8_scaled"
    assert plan["storage"]["vae"] == "fp32"
    assert plan["on_disk"] is True
    assert plan["rows"] and all(row["stages"] for row in plan["rows"])


def test_weight_dtype_lowers_but_never_raises_and_ram_copy_changes_the_plan(models):
    lowered = answer(query(models, weight_dtype="gguf_q4_k"))
    assert lowered["storage"]["transformer"] == "gguf_q4_k"
    # q4_k's 256-weight blocks fit none of the tiny model's rows but its time embedder's, which the model keeps in
    # float32 and weight_dtype never lowers: nothing is re-stored, the files stay mapped (the storage label is the
    # chosen format's, as the plan names it from the files' majority; real widths fit q4_k's blocks)
    assert lowered["on_disk"] is True
    restored = answer(query(models, weight_dtype="bf16"))  # the text encoder's fp32 tables re-stored in bf16
    assert restored["on_disk"] is False  # re-stored matrices are held in RAM, not mapped from the files
    # fp8 is no narrower than the fp8-scaled matrices and keeps embeddings wide: nothing is re-stored.
    kept = answer(query(models, weight_dtype="fp8_e4m3fn"))
    assert kept["storage"]["transformer"] == "fp8_scaled"
    assert kept["on_disk"] is True
    in_ram = answer(query(models, weights_on_disk="false"))
    assert in_ram["on_disk"] is False
    on_disk = answer(query(models))
    assert [r["peak_ram_bytes"] for r in in_ram["rows"]] != [r["peak_ram_bytes"] for r in on_disk["rows"]]


def test_a_name_not_in_the_hosts_list_is_refused_before_any_file_is_opened(models):
    with pytest.raises(PlanRequestError, match=r"vae='../escape.safetensors' is not among ComfyUI's files in models/vae;") as error:
        parse_request(query(models, vae="../escape.safetensors"), [], list(DTYPES))
    assert error.value.name == "vae"
    with pytest.raises(PlanRequestError, match="weight_dtype='q3'"):
        parse_request(query(models, weight_dtype="q3"), [], list(DTYPES))


def test_a_file_of_the_wrong_kind_is_an_error_status_naming_the_input(models):
    models.vae.with_name("copy_of_text_encoder.safetensors").write_bytes(models.text_encoder.read_bytes())
    plan = answer(query(models, vae="copy_of_text_encoder.safetensors"))
    assert plan["status"] == "error"
    assert plan["input"] == "vae"
    assert "T5 / UMT5 text encoder" in plan["error"]


def test_the_request_changes_when_a_file_changes(models):
    first = parse_request(query(models), [], list(DTYPES))
    assert parse_request(query(models), [], list(DTYPES)) == first
    models.vae.write_bytes(models.vae.read_bytes() + b"")  # same bytes, new mtime
    import os
    os.utime(models.vae, ns=(1, 1))
    assert parse_request(query(models), [], list(DTYPES)) != first


def test_wan22_a14b_takes_its_low_noise_expert_from_the_model_list(tmp_path, monkeypatch):
    files = save_tiny_comfy_files("wan2.2-a14b", tmp_path, "fp8_scaled", reference=False).files
    folders = {key: tmp_path / sub for key, sub in FOLDERS.items()}
    monkeypatch.setattr(host, "folder_paths", SimpleNamespace(
        models_dir=str(tmp_path), get_folder_paths=lambda key: [str(folders[key])],
        get_filename_list=lambda key: sorted(p.name for p in folders[key].glob("*") if p.is_file())))
    plan = answer(query(files, model_2=files.model_2.name))
    assert plan["status"] == "ok", plan
    assert plan["config"] == "tiny-wan2.2-a14b"
    assert {"transformer", "transformer_2"} <= plan["storage"].keys()
    alone = answer(query(files))  # without its second expert
    assert alone["status"] == "error" and "set model_2 to its low-noise expert" in alone["error"]


def test_a_folders_transformer_file_is_planned_in_its_storage(models, tmp_path):
    """Load Video Pipeline with transformer_file: the folder's architecture, the file's storage."""
    diffusers_folder(tmp_path, "wan2.1-t2v", "Wan2.1-T2V-1.3B-Diffusers")  # the loader checks the file against it

    def folder_model(name, dtype):
        from vidmem.pipelines.configs import load_model
        return load_model("wan2.1-t2v-1.3b", dtype)

    shape = {"model": "Wan2.1-T2V-1.3B-Diffusers", "dtype": "bf16", "width": "832", "height": "480", "frames": "81"}
    with_file = parse_request({**shape, "transformer_file": models.model.name}, ["Wan2.1-T2V-1.3B-Diffusers"], list(DTYPES))
    assert with_file.transformer_file[0] == models.model.name
    plan = plan_answer(with_file, folder_model, BUDGETS)
    assert plan["status"] == "ok", plan
    assert plan["storage"] == {"transformer": "fp8_scaled"} and plan["on_disk"] is False
    own = plan_answer(parse_request({**shape, "transformer_file": "(from the folder)"}, ["Wan2.1-T2V-1.3B-Diffusers"],
                                    list(DTYPES)), folder_model, BUDGETS)
    assert own["storage"] == {}
    assert own["rows"][0]["peak_ram_bytes"] != plan["rows"][0]["peak_ram_bytes"]
    with pytest.raises(PlanRequestError, match="transformer_file='nope.safetensors' is not in the host's list"):
        parse_request({**shape, "transformer_file": "nope.safetensors"}, ["Wan2.1-T2V-1.3B-Diffusers"], list(DTYPES))


def diffusers_folder(root, variant: str, name: str):
    """Tiny `variant` saved as models/diffusers/<name> (the plan checks a text encoder file against its configs)."""
    from vidmem.pipelines.tiny import save_tiny_pipeline

    return save_tiny_pipeline(variant, root / "diffusers" / name)


def test_a_folders_text_encoder_file_is_planned_in_its_storage(models, tmp_path):
    """Load Video Pipeline with text_encoder_file: an fp8 file plans as fp8 bytes, as the loader holds it."""
    diffusers_folder(tmp_path, "wan2.1-t2v", "Wan2.1-T2V-1.3B-Diffusers")

    def folder_model(name, dtype):
        from vidmem.pipelines.configs import load_model
        return load_model("wan2.1-t2v-1.3b", dtype)

    shape = {"model": "Wan2.1-T2V-1.3B-Diffusers", "dtype": "bf16", "width": "832", "height": "480", "frames": "81",
             "text_encoder": "cpu"}  # the Strategy's own widget of that name keeps its meaning
    with_file = parse_request({**shape, "text_encoder_file": models.text_encoder.name}, ["Wan2.1-T2V-1.3B-Diffusers"],
                              list(DTYPES))
    assert [entry[:2] for entry in with_file.text_encoder_files] == [("text_encoder", models.text_encoder.name)]
    plan = plan_answer(with_file, folder_model, BUDGETS)
    assert plan["status"] == "ok", plan
    assert plan["storage"] == {"text_encoder": "fp8_scaled"}
    own = plan_answer(parse_request(shape, ["Wan2.1-T2V-1.3B-Diffusers"], list(DTYPES)), folder_model, BUDGETS)
    assert own["storage"] == {}
    assert plan["rows"][0]["peak_ram_bytes"] < own["rows"][0]["peak_ram_bytes"]
    with pytest.raises(PlanRequestError, match="text_encoder_2_file='nope.safetensors' is not in the host's text encoder list"):
        parse_request({**shape, "text_encoder_2_file": "nope.safetensors"}, ["Wan2.1-T2V-1.3B-Diffusers"], list(DTYPES))


def test_files_are_planned_per_context_window_and_a_bad_window_is_refused(models):
    """The Sampler's window reaches a files plan too: the model recognised from the headers is the one asked."""
    whole = answer(dict(query(models), frames="17"))
    windowed = answer(dict(query(models), frames="17", window="9", window_overlap="4"))
    assert windowed["status"] == "ok", windowed
    assert windowed["shape"]["window"] == 9 and windowed["windows"][0].startswith("9-frame windows, overlap 4, of 17 frames")
    assert whole["windows"] == []
    refused = answer(dict(query(models), frames="17", window="9", window_overlap="12"))
    assert refused["status"] == "error" and refused["input"] == "window_overlap", refused


def test_a_text_encoder_file_the_loader_refuses_gets_the_loaders_message_not_a_plan(models, tmp_path):
    """The plan checks the file against the folder with the loader's own checks (headers only): Wan's umt5 over an
    LTX-2 folder, or a second text encoder for a folder that has none, is the loader's refusal naming the widget."""
    diffusers_folder(tmp_path, "ltx2-t2v", "LTX-2")
    diffusers_folder(tmp_path, "wan2.1-t2v", "Wan2.1-T2V-1.3B-Diffusers")

    def folder_model(name, dtype):
        from vidmem.pipelines.configs import load_model
        return load_model("wan2.1-t2v-1.3b", dtype)

    shape = {"dtype": "bf16", "width": "64", "height": "64", "frames": "9"}
    names = ["LTX-2", "Wan2.1-T2V-1.3B-Diffusers"]
    over_ltx2 = plan_answer(parse_request({**shape, "model": "LTX-2", "text_encoder_file": models.text_encoder.name}, names,
                                          list(DTYPES)), folder_model, BUDGETS)
    assert over_ltx2["status"] == "error" and over_ltx2["input"] == "text_encoder_file", over_ltx2
    assert "is a UMT5-XXL text encoder (Wan's), but the text_encoder of 'LTX-2' is a Gemma 3 12B" in over_ltx2["error"]
    second = plan_answer(parse_request({**shape, "model": names[1], "text_encoder_2_file": models.text_encoder.name}, names,
                                       list(DTYPES)), folder_model, BUDGETS)
    assert second["status"] == "error" and second["input"] == "text_encoder_2_file", second
    assert "'Wan2.1-T2V-1.3B-Diffusers' has no second text encoder" in second["error"]


def test_a_gemma_file_without_its_vision_tower_is_planned_without_it(models, tmp_path):
    """The plan reads from the file's header what the loader will remove (text_encoder_file.removed_parts) and
    builds the folder's model without it: fewer bytes than the same folder with the whole Gemma file."""
    from vidmem.pipelines.comfy_files import text_encoders
    from vidmem.pipelines.comfy_files.write import store_tensors, write_language_model
    from vidmem.pipelines.configs import load_model
    from vidmem.pipelines.loader import load_pipeline

    folder = diffusers_folder(tmp_path, "ltx2-t2v", "LTX-2")
    tensors = store_tensors(load_pipeline(folder, "fp32").pipe.text_encoder, "bf16")
    lean = {n: t for n, t in tensors.items() if not n.startswith(text_encoders.GEMMA3.optional)}
    for name, written in (("gemma_whole.safetensors", tensors), ("gemma_novision.safetensors", lean)):
        write_language_model(written, tmp_path / "text_encoders" / name, "Gemma3ForConditionalGeneration")
    asked = []

    def folder_model(name, dtype, *vae, removed=()):
        asked.append(removed)
        return load_model(str(tmp_path / "diffusers" / name), dtype, *vae, removed=removed)

    shape = {"model": "LTX-2", "dtype": "bf16", "width": "64", "height": "64", "frames": "9"}
    names = ("gemma_whole.safetensors", "gemma_novision.safetensors")
    whole, without = (plan_answer(parse_request({**shape, "text_encoder_file": name}, ["LTX-2"], list(DTYPES)), folder_model,
                                  BUDGETS) for name in names)
    assert whole["status"] == without["status"] == "ok", (whole, without)
    assert asked == [(), ("text_encoder.model.vision_tower", "text_encoder.model.multi_modal_projector")]
    assert without["rows"][0]["peak_ram_bytes"] < whole["rows"][0]["peak_ram_bytes"]


@pytest.mark.parametrize("variant, words", [
    ("wan2.2-ti2v", r"transformer_file '.*' is not the transformer of 'Folder' \(.*in_channels"),
    ("wan2.2-a14b", "transformer_file cannot replace the two experts of a Wan 2.2 A14B folder"),
    ("cogvideox-t2v", "transformer_file is not supported for cogvideox"),
])
def test_a_transformer_file_the_loader_would_refuse_is_refused_by_the_plan(models, tmp_path, variant, words):
    """The chart said ok where Load Video Pipeline then refused the file: the route runs the loader's own checks."""
    diffusers_folder(tmp_path, variant, "Folder")
    request = parse_request({"model": "Folder", "dtype": "bf16", "width": "32", "height": "32", "frames": "9",
                             "transformer_file": models.model.name}, ["Folder"], list(DTYPES))

    def folder_model(name, dtype):
        from vidmem.pipelines.configs import load_model
        return load_model(str(tmp_path / "diffusers" / "Folder"), dtype)

    plan = plan_answer(request, folder_model, BUDGETS)
    assert plan["status"] == "error" and plan["input"] == "transformer_file", plan
    assert re.search(words, plan["error"]), plan["error"]
