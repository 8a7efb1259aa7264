"""The planner counts weights as stored (fp8, GGUF) and as held (anonymous RAM or page cache on disk).

Expected figures are counted independently of the planner: from each module's state dict, the
way a safetensors file stores it (numel x bytes per tensor, whole GGUF blocks, one float32 scale
per scaled fp8 tensor), never from the planner's own functions.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import pytest

from vidmem.memory.hostpool import MAX_STAGING_SLOTS, RESIDENT_CHUNK_BYTES, RESIDENT_SLOTS
from torch import nn

from vidmem.memory import MemoryStrategy
from vidmem.memory.plan.planner import GiB, PlanError, PlanOptions, VideoShape, choose_strategy, plan_run
from vidmem.memory.storage import FORMATS
from vidmem.pipelines.configs import load_model
from vidmem.cli.plan import main as plan_main

SHAPE = VideoShape(832, 480, 81)
SWAP = MemoryStrategy(offload="block_swap", blocks_to_swap=20, prefetch_blocks=1)


@pytest.fixture(scope="module")
def wan():
    return load_model("wan2.1-t2v-1.3b")


# What the files of each format hold for token embeddings: city96's GGUF text encoders quantize
# token_embd; Comfy-Org's fp8 / fp8-scaled umt5 keeps shared.weight in bf16 (6.7 GB file, not 5.7).
EMBEDDINGS_NARROW_IN_FILES = {"fp8_scaled": False, "fp8_e4m3fn": False, "gguf_q8_0": True, "gguf_q4_k": True}


def _file_bytes(module: nn.Module, storage: str | None, embeddings: bool) -> tuple[int, int]:
    """(bytes the module's state dict takes in a file with `storage`, its largest stored weight's numel)."""
    embeddings = embeddings and EMBEDDINGS_NARROW_IN_FILES.get(storage, False)
    owners = dict(module.named_modules())
    seen, total, largest = set(), 0, 0
    for key, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # tied weights (T5's shared embedding) are one tensor in a file
            continue
        seen.add(id(tensor))
        owner = owners[key.rpartition(".")[0]]
        matrix = key.endswith(".weight") and (type(owner) is nn.Linear or (embeddings and type(owner) is nn.Embedding))
        fmt = FORMATS.get(storage)
        if fmt and matrix and tensor.shape[-1] % fmt.block_size == 0:  # GGUF files keep rows of partial blocks wide
            total += math.ceil(tensor.numel() / fmt.block_size) * fmt.block_bytes + (4 if fmt.scaled else 0)
            largest = max(largest, tensor.numel())
        else:
            total += tensor.numel() * tensor.element_size()
    return total, largest


@pytest.mark.parametrize("storage", ["fp8_scaled", "fp8_e4m3fn", "gguf_q8_0", "gguf_q4_k"])
@pytest.mark.parametrize("component", ["transformer", "text_encoder"])
def test_storage_shrinks_weight_bytes_as_a_file_would(wan, storage, component):
    embeddings = component == "text_encoder"
    module = wan.module(component)
    plain, _ = _file_bytes(module, None, embeddings)
    stored, _ = _file_bytes(module, storage, embeddings)
    # buffers outside the state dict (non-persistent) are counted by the planner in both
    assert wan.weights(component).nbytes - wan.weights(component, storage).nbytes == plain - stored
    ratio = wan.weights(component, storage).nbytes / wan.weights(component).nbytes
    wide_embedding = 0.1 if embeddings and not EMBEDDINGS_NARROW_IN_FILES[storage] else 0.0  # umt5's 1.05 GB table
    assert ratio < FORMATS[storage].bytes_per_weight / 2 + 0.06 + wide_embedding  # almost every byte is in the matrices


def test_fp8_scaled_umt5_is_planned_at_the_size_of_comfy_orgs_file(wan):
    """umt5_xxl_fp8_e4m3fn_scaled.safetensors is 6.7 GB: its bf16 token embedding is 1 GB of that."""
    assert 6.6e9 < wan.weights("text_encoder", "fp8_scaled").nbytes < 6.8e9


def test_host_and_device_hold_the_stored_bytes(wan):
    storage = "fp8_scaled"
    options = PlanOptions(storage=wan.layout.stored_as(storage))
    plain = plan_run(wan, SHAPE, MemoryStrategy(offload="model"))
    stored = plan_run(wan, SHAPE, MemoryStrategy(offload="model"), options)
    saved = {c: _file_bytes(wan.module(c), None, c == "text_encoder")[0] - _file_bytes(wan.module(c), storage, c == "text_encoder")[0]
             for c in ("transformer", "text_encoder")}
    for name in ("text_encode", "denoise", "decode"):
        assert plain.stage(name).host_bytes - stored.stage(name).host_bytes == sum(saved.values())
    _, largest = _file_bytes(wan.module("transformer"), storage, False)
    phase = stored.stage("denoise").phases[0]
    transient = largest * (4 + 4)  # scaled fp8's float32 widened copy and scaled product (test_storage_workspace)
    assert phase.weights_bytes == plain.stage("denoise").phases[0].weights_bytes - saved["transformer"] + transient
    assert stored.peak_vram_bytes < plain.peak_vram_bytes


def test_streamed_bytes_per_pass_are_the_stored_bytes(wan):
    storage = "gguf_q4_k"
    stored = plan_run(wan, SHAPE, SWAP, PlanOptions(storage={"transformer": storage}))
    blocks = wan.module("transformer").blocks
    expected = sum(_file_bytes(block, storage, False)[0] for block in list(blocks)[-SWAP.blocks_to_swap:])
    assert stored.stage("denoise").work[-1].traffic.per_pass_bytes == expected


def test_disk_moves_weight_bytes_from_anonymous_ram_to_page_cache(wan):
    storage = wan.layout.stored_as("fp8_scaled")
    in_ram = plan_run(wan, SHAPE, SWAP, PlanOptions(storage=storage))
    on_disk = plan_run(wan, SHAPE, SWAP, PlanOptions(storage=storage, on_disk=True))
    weights = sum(_file_bytes(wan.module(c), storage.get(c), c == "text_encoder")[0] for c in wan.layout.all)
    nonpersistent = sum(wan.weights(c).nbytes - _file_bytes(wan.module(c), None, c == "text_encoder")[0]
                        for c in wan.layout.all)  # computed buffers (rotary tables): in RAM too
    block = _file_bytes(wan.module("transformer").blocks[-1], "fp8_scaled", False)[0]
    # pinned slots the streamed blocks are read through in chunks (a power of two, at most 16 MiB; at most 8
    # slots), and the whole components' own ring of 4 chunks (memory.hostpool)
    slot = min(2 ** math.ceil(math.log2(block)), RESIDENT_CHUNK_BYTES)
    slots = min(MAX_STAGING_SLOTS, (SWAP.prefetch_blocks + 2) * math.ceil(block / slot))
    staging = slots * slot + RESIDENT_SLOTS * RESIDENT_CHUNK_BYTES
    assert staging <= 192 * 2**20  # bounded whatever the model, not (prefetch + 2) whole blocks
    denoise_ram, denoise_disk = in_ram.stage("denoise"), on_disk.stage("denoise")
    assert denoise_ram.page_cache_bytes == 0
    assert denoise_disk.page_cache_bytes == weights + nonpersistent
    for name in ("text_encode", "denoise", "decode"):  # the slots live as long as the pipeline
        assert in_ram.stage(name).host_bytes - on_disk.stage(name).host_bytes == weights + nonpersistent - staging
    whole = plan_run(wan, SHAPE, MemoryStrategy(offload="model"), PlanOptions(storage=storage, on_disk=True))
    assert whole.stage("denoise").host_bytes == denoise_disk.host_bytes - staging  # copied straight from the files
    assert on_disk.peak_vram_bytes == in_ram.peak_vram_bytes  # the device holds the same either way


def test_disk_reads_slow_a_plan_only_when_the_page_cache_is_short(wan):
    storage = wan.layout.stored_as("fp8_scaled")
    options = PlanOptions(storage=storage, on_disk=True)
    in_ram = plan_run(wan, SHAPE, SWAP, PlanOptions(storage=storage), 8 * GiB, 64 * GiB)
    roomy = plan_run(wan, SHAPE, SWAP, options, 8 * GiB, 64 * GiB)  # every file stays in the page cache
    assert roomy.disk_reread_bytes_per_pass == 0 and roomy.est_slowdown == in_ram.est_slowdown
    # the page cache cannot keep a run's files: each stage reads its weights from the disk once
    short = plan_run(wan, SHAPE, SWAP, options, 8 * GiB, roomy.peak_ram_bytes + GiB // 4)
    assert short.fits and short.peak_page_cache_bytes > short.ram_budget_bytes  # page cache never decides a fit
    assert short.est_slowdown > roomy.est_slowdown
    slow_disk = plan_run(wan, SHAPE, SWAP, replace(options, disk_bytes_per_s=0.2e9), 8 * GiB, short.ram_budget_bytes)
    assert slow_disk.est_slowdown > short.est_slowdown
    # not even the streamed blocks fit beside the denoiser's anonymous bytes: read again every pass
    streamed = short.stage("denoise").work[-1].traffic.per_pass_bytes
    starved = plan_run(wan, SHAPE, SWAP, options, 8 * GiB, short.stage("denoise").host_bytes + streamed // 2)
    assert starved.disk_reread_bytes_per_pass == streamed - streamed // 2


@pytest.mark.parametrize("args", [
    ["--model", "wan2.2-t2v-a14b", "--weights", "fp8_scaled", "--size", "832x480", "--frames", "81", "--vram", "8", "--ram", "32"],
    ["--model", "wan2.1-t2v-1.3b", "--weights", "fp8_scaled", "--size", "832x480", "--frames", "81", "--vram", "6", "--ram", "12"],
], ids=["wan2.2-a14b-8g-32g", "wan2.1-1.3b-6g-12g"])
def test_issue_evidence_commands_fit(args, capsys):
    code = plan_main(["plan", *args, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["recommended"] is not None
    chosen = out["strategies"][out["recommended"]]
    assert chosen["fits"] and chosen["peak_vram_bytes"] <= float(args[-3]) * GiB
    assert chosen["peak_anon_bytes"] <= float(args[-1]) * GiB
    assert set(chosen["storage"].values()) == {"fp8_scaled"} and "text_encoder" in chosen["storage"]
    assert all(set(host) == {"anon_bytes", "ram_bytes", "page_cache_bytes"} for host in chosen["host"].values())


def test_nothing_fits_names_storage_and_disk_that_do_fit(wan):
    vram, ram = 8 * GiB, 12 * GiB  # bf16 weights alone overrun 12 GiB of RAM
    with pytest.raises(PlanError) as error:
        choose_strategy(wan, SHAPE, vram, ram, consider_disk=False)
    message = str(error.value)
    suggested = re.findall(r"\((--weights \S+)?(?: ?(--disk))?\) it fits", message)
    assert len(suggested) == 2, message
    for weights, disk in suggested:
        storage = wan.layout.stored_as(weights.split()[1]) if weights else {}
        plan = choose_strategy(wan, SHAPE, vram, ram, options=PlanOptions(storage=storage, on_disk=bool(disk)),
                               consider_disk=False)
        assert plan.fits


def test_auto_may_choose_disk_but_never_lowers_precision(wan):
    plan = choose_strategy(wan, SHAPE, 8 * GiB, 12 * GiB)
    assert plan.on_disk and plan.options.storage == () and plan.fits
    with pytest.raises(ValueError, match="fp8_scaled"):
        PlanOptions(storage={"transformer": "fp7"})
    with pytest.raises(PlanError, match="'transformr', which wan2.1-t2v-1.3b does not have; .*transformer"):
        plan_run(wan, SHAPE, SWAP, PlanOptions(storage={"transformr": "fp8_scaled"}))


def test_a_loaded_pipelines_storage_reaches_the_planner(wan):
    from vidmem.pipelines.loader import LoadedPipeline, family_for
    from vidmem.pipelines.planning import choose_for, plan_options, plan_strategy

    stored = {"transformer": "fp8_scaled", "text_encoder": "fp8_scaled", "vae": "int64",  # int: recorded by dtype
              "image_encoder": "bf16"}  # loaded beside a text-to-video model, which never runs it
    loaded = LoadedPipeline(None, family_for("WanPipeline"), "WanPipeline", "single files", "bf16",
                            folder="wan2.1-t2v-1.3b", config_name="wan2.1-t2v-1.3b", storage=stored, on_disk=True,
                            vae_dtype_name="fp32")
    assert dict(plan_options(loaded).storage) == {"transformer": "fp8_scaled", "text_encoder": "fp8_scaled"}
    strategy = MemoryStrategy(offload="model")
    plan = plan_strategy(loaded, SHAPE, strategy, 8 * GiB, 12 * GiB, device="cuda")  # as on a GPU host
    assert plan.on_disk and plan.stage("denoise").page_cache_bytes > 0
    as_folder = plan_run(wan, SHAPE, strategy, PlanOptions(storage=plan_options(loaded).storage, on_disk=True))
    vae_bf16 = _file_bytes(wan.module("vae"), None, False)[0]
    decode_weights = plan.stage("decode").peak_phase.weights_bytes - as_folder.stage("decode").peak_phase.weights_bytes
    latent = math.prod(wan.latent_shape(SHAPE))
    assert decode_weights == vae_bf16 + latent * 2  # the VAE and its latent in fp32: twice their bf16 bytes
    in_ram = replace(loaded, on_disk=False, storage={})
    with pytest.raises(PlanError, match=r"\(--disk\) it fits"):  # auto never moves a loaded pipeline to disk
        choose_for(in_ram, SHAPE, strategy, 8 * GiB, 12 * GiB, device="cuda")


def test_plan_for_a_cpu_device_counts_mapped_weights_in_place(capsys):
    """`--device cpu`: weights memory-mapped from disk are computed where they lie, so the disk
    plan's device figure drops by the weights a GPU would have to hold (and no CUDA context)."""
    args = ["plan", "--model", "wan2.1-t2v-1.3b", "--weights", "fp8_scaled", "--disk", "--size", "832x480",
            "--frames", "81", "--vram", "6", "--ram", "12", "--json"]
    peaks = {}
    for device in ("cuda", "cpu"):
        assert plan_main([*args, "--device", device]) == 0
        out = json.loads(capsys.readouterr().out)
        peaks[device] = {(s["tier"], s["on_disk"]): s["peak_vram_bytes"] for s in out["strategies"]}
    assert peaks["cpu"][("none", True)] < peaks["cuda"][("none", True)]
