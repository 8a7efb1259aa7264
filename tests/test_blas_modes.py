"""Bit-identity claims that must not rest on a BLAS mode, checked in two more modes.

The suite runs in MKL's reproducible mode (conftest sets MKL_CBWR=AUTO,STRICT). That mode hid
nothing by itself, but it would hide a copy at another alignment than its original: in MKL's
default mode (MKL_CBWR empty or unset: conditional numerical reproducibility off, kernels picked by
CPU and by the operands' alignment) 40 such comparisons failed on an AMD EPYC while CI's machine
passed them. So a few of them, one per kind (the CUDA path under the fake, a scheduler against
plain diffusers, the prompt cache, cancel, training tiers, stored weights, the disk tier, pinned
homes), run again in their own processes, since MKL reads the mode once: in MKL's default mode and
in COMPATIBLE (other kernels). Tests marked `reproducible_blas` are not among them by definition.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

GUARDED = (
    "tests/test_cuda_path.py::test_cuda_backend_keeps_the_promised_order_in_every_tier[wan2.1-t2v]",
    "tests/test_cuda_path.py::test_an_out_of_memory_error_in_a_copy_climbs_the_ladder",
    "tests/test_sampler_controls.py::test_each_scheduler_equals_plain_diffusers_with_it_set_by_hand[wan2.1-t2v-unipc]",
    "tests/test_prompt_cache.py::test_a_repeated_prompt_never_runs_or_onloads_the_encoder[block_swap-wan2.1-t2v]",
    "tests/test_interrupt.py::test_cancel_mid_step_stops_before_the_next_block[swap1-p1]",
    "tests/test_train_loop.py::test_every_tier_trains_the_same_weights[wan2.1-t2v-offload=block_swap blocks_to_swap=1 prefetch=0]",
    "tests/test_folder_storage.py::test_a_stored_folder_samples_like_its_dequantized_twin_under_every_tier[wan2.1-t2v-gguf_q8_0]",
    "tests/test_lora_tiers.py::test_disk_tier_weights_mapped_from_their_file_take_loras",
    "tests/test_single_file.py::test_fp8_scaled_transformer_file_is_dequantized_not_misread",
    "tests/test_hostpool_staging.py::test_a_pinned_home_keeps_its_originals_place_in_a_cache_line",
)
MODES = {"mkl-default": ("", "CNR:OFF"), "mkl-compatible": ("COMPATIBLE", "CNR:COMPATIBLE")}


def in_mode(mode: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env={**os.environ, "MKL_CBWR": mode, **env},
                          capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="this torch has no MKL: MKL_CBWR means nothing to it")
@pytest.mark.parametrize("label", MODES)
def test_mkl_runs_in_the_mode_the_guard_asks_for(label):
    """MKL_VERBOSE prints the mode of each call: an empty MKL_CBWR is MKL's default (CNR off)."""
    mode, verbose = MODES[label]
    probe = in_mode(mode, "-c", "import torch; torch.ones(1, 8) @ torch.ones(8, 8)", MKL_VERBOSE="1")
    assert probe.returncode == 0 and f" {verbose} " in probe.stdout, probe.stdout + probe.stderr


@pytest.mark.parametrize("label", MODES)
def test_copies_compute_like_their_originals_in_other_blas_modes(label):
    run = in_mode(MODES[label][0], "-m", "pytest", "-q", *GUARDED)
    assert run.returncode == 0, f"MKL_CBWR={MODES[label][0]!r}:\n{run.stdout[-6000:]}{run.stderr[-2000:]}"
    assert f"{len(GUARDED)} passed" in run.stdout, run.stdout[-2000:]
