"""A weight file mapped at load (the disk tier) and changed on disk before a later call is refused
before anything is placed, naming the file and the fix, instead of silently running on new bytes."""
import os

import pytest
import torch

from test_storage import inputs, load, wan_state, write_model_file
from vidmem.memory import MemoryStrategy, StageComponents, apply_strategy
from vidmem.memory.device import CpuBackend
from vidmem.memory.storage.mapping import MappedFileChanged


def _run(model, strategy):
    stage = StageComponents({"transformer": model}, {"transformer": model.blocks})
    with torch.no_grad(), apply_strategy(stage, strategy, CpuBackend()) as handle:
        handle.activate("transformer")
        return model(**inputs(torch.float32))[0]


@pytest.mark.parametrize("change", ["rewrite", "truncate"])
def test_changed_weight_file_is_refused(change, tmp_path):
    path = tmp_path / "wan.fp8_scaled"
    write_model_file(path, wan_state(), "fp8_scaled")
    model, _ = load(path, torch.float32)
    strategy = MemoryStrategy(offload="block_swap", blocks_to_swap=1, prefetch_blocks=1)
    first = _run(model, strategy)
    assert torch.equal(_run(model, strategy), first)  # unchanged: runs again
    size = os.path.getsize(path)
    stamp = os.stat(path).st_mtime_ns
    with open(path, "r+b") as handle:
        if change == "rewrite":  # in place, same size (a re-download over it)
            handle.seek(size - 4096)
            handle.write(bytes(range(256)) * 16)
        else:
            handle.truncate(size // 2)  # reading past the new end would be SIGBUS
    os.utime(path, ns=(stamp + 10**9, stamp + 10**9))  # a coarse clock may not move the mtime itself
    with pytest.raises(MappedFileChanged, match="reload the model") as error:
        _run(model, strategy)
    assert str(path) in str(error.value)
