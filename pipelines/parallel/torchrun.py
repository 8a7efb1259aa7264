"""Context-parallel sampling under torchrun: the same job, one process per GPU, on one or many machines.

    torchrun --nproc-per-node 8 -m vidmem.pipelines.parallel.torchrun MODEL_FOLDER out.safetensors \\
        --prompt "a cat" --width 1280 --height 720 --frames 81 --steps 50 --offload none

Several machines: the same command on each, with `--nnodes N --node-rank I --rdzv-backend c10d
--rdzv-endpoint HOST:PORT` (torchrun's own rendezvous, env://); no scheduler of vidmem's own.
Every process opens the folder itself; rank 0 writes the latent (safetensors, key "latent").
"""

from __future__ import annotations

import argparse
import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from ..atomic import atomic_path
from ...memory.parallel import leave_group, run_in_process_group
from ...memory.strategy import MemoryStrategy, Parallelism
from ..sample import SampleRequest
from .job import ParallelSampleJob
from .run import rank_pinned_share
from .source import PipelineSource


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    parser.add_argument("out")
    parser.add_argument("--prompt", default="")
    parser.add_argument("--negative-prompt", default="")
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--frames", type=int, default=81)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--cfg", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--offload", default="none", help="the tier each rank applies to its own copy")
    parser.add_argument("--blocks-to-swap", type=int, default=0)
    parser.add_argument("--mode", default="ulysses", choices=("ulysses", "ring"))
    parser.add_argument("--max-pinned-ram-gb", type=float, default=None,
                        help="each process's pinned-memory ceiling; unset, the processes on a machine share half its "
                             "free RAM")
    return parser.parse_args(argv)


def write_latent(samples: torch.Tensor, out) -> Path:
    """The latent as safetensors (key "latent"), written whole or not at all: an interrupt or a full
    disk never leaves a half-written file a later step could load."""
    from safetensors.torch import save_file

    with atomic_path(Path(out)) as temporary:
        save_file({"latent": samples.contiguous().cpu()}, str(temporary))
    return Path(out)


def main(argv=None) -> None:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")  # env:// from torchrun
    try:
        world = dist.get_world_size()
        strategy = MemoryStrategy(offload=args.offload, blocks_to_swap=args.blocks_to_swap,
                                  max_pinned_ram_gb=args.max_pinned_ram_gb, parallel=Parallelism(None, args.mode, world))
        # The processes on this machine share one automatic pinned ceiling, as the pool's ranks do.
        strategy = rank_pinned_share(strategy, int(os.environ.get("LOCAL_WORLD_SIZE", 1)), None)
        request = SampleRequest(args.prompt, args.negative_prompt, args.width, args.height, args.frames, args.steps,
                                args.cfg, args.seed)
        source = PipelineSource(os.path.abspath(args.folder), args.dtype)
        # Every rank checks the run (same inputs, same verdict) right after opening the folder.
        result = run_in_process_group(ParallelSampleJob(source, strategy, request))
        if dist.get_rank() == 0:
            write_latent(result.latent["samples"], args.out)
            print(result.receipt.get("parallel"))
    except BaseException as error:
        traceback.clear_frames(error.__traceback__)  # they hold the pipeline: leave_group must free it first
        raise
    finally:
        leave_group()


if __name__ == "__main__":
    main()
