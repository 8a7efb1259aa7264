"""Training runs in ComfyUI's process on its device: a Memory Strategy asking for GPUs or context
parallelism is refused by name, not silently ignored."""

from __future__ import annotations

import pytest
import torch

from fuzz_support import strategy_widgets
from vidmem.memory import StrategyError
from vidmem.nodes import NODE_CLASS_MAPPINGS as N
from vidmem.nodes.train import _train_strategy
from vidmem.training.settings import TrainSettings


def strategy(**parallel):
    (choice,) = N["VidMemMemoryStrategy"]().build(**strategy_widgets(offload="none"), **parallel)["result"]
    return choice


@pytest.mark.parametrize("parallel, named", [(dict(gpus="cpu:2", context_parallel="ulysses"), "ulysses degree=2"),
                                             (dict(gpus="0,1"), "balanced gpus=0,1")])
def test_training_nodes_refuse_a_parallel_strategy(tiny_loaded, tmp_path, parallel, named):
    with pytest.raises(StrategyError, match=f"Prepare Training Data runs on ComfyUI's device only.*{named}"):
        N["VidMemPrepareTrainingData"]().prepare(tiny_loaded("wan2.1-t2v"), strategy(**parallel), str(tmp_path),
                                                 "32x32", "9")
    with pytest.raises(StrategyError, match=f"Train LoRA runs on ComfyUI's device only.*{named}"):
        _train_strategy(strategy(**parallel), None, None, None, torch.device("cpu"))
    assert _train_strategy(strategy(), None, None, TrainSettings(), torch.device("cpu"))[0] == strategy().strategy
