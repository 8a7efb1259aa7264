"""One rank's denoiser forward under diffusers' context parallelism, traced on the meta device.

How it works: the per-rank trace runs the same pipeline step as the single-GPU trace (the model's
own `denoise` workload), with the transformer's context-parallel plan (`_cp_plan`) applied the way
diffusers' hooks apply it: the rotary embedding and the hidden states entering the first block are
split along the sequence (a rank keeps 1/N of the tokens), the timestep too when it has a sequence
dimension (Wan 2.2 TI2V), and the output of `proj_out` is gathered back to the whole sequence. Inside
each block's self-attention (`attn1`, the only attention diffusers parallelises: cross-attention keeps
the whole text on every rank) the collective is replayed with the tensors diffusers creates:

- Ulysses (`TemplatedUlyssesAttention`): q, k and v are permuted into per-peer chunks, exchanged by an
  all-to-all (a fresh output buffer each), and permuted into [B, S, H/N, D]; attention runs on the whole
  sequence with H/N heads; the output goes back the same way.
- Ring with all-gather rotation (`TemplatedRingAttention`): k and v are concatenated and all-gathered
  (every rank holds the whole K and V), attention runs N times on one chunk each, and the partial
  outputs are merged in float32 through their log-sum-exp.

The collectives are stood in for by `torch.empty` of the size NCCL would write, so the ledger counts
every buffer at the moment it is live, and attention FLOPs are those a rank really computes. The
traced module's processors and hooks are put back in `finally`: the model's other traces are untouched.

Checked (tests/test_plan_parallel.py): diffusers' own Ulysses path, run on meta under a fake process
group, holds the same step peak, allocator footprint and FLOPs. Ring is not held to it: the fake
group's functional collectives count an extra wrapper tensor per collective (an alias on NCCL), and
the two differ by a few percent at the step peak.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .types import Call
from ..strategy import ContextParallel

ULYSSES, RING = ContextParallel.ULYSSES.value, ContextParallel.RING.value


@dataclass(frozen=True)
class RankCall(Call):
    """A denoise call as one of `degree` context-parallel ranks runs it (`mode`: ulysses | ring).

    A distinct key from the single-GPU `Call`, so the model memoises the per-rank trace apart."""

    degree: int = 1
    mode: str = ULYSSES


@contextmanager
def context_parallel_trace(transformer: nn.Module, degree: int, mode: str):
    """While active, a forward of `transformer` (a diffusers Wan-style model on meta) runs as one rank.

    Only a transformer with Wan's `TRACED_PARTS` (memory.plan.parallel.check_traceable says so first)."""
    handles, swapped = [], []
    try:
        handles.append(transformer.register_forward_pre_hook(_split_timestep(degree), with_kwargs=True))
        handles.append(transformer.rope.register_forward_hook(_split_outputs(degree)))
        handles.append(transformer.blocks[0].register_forward_pre_hook(_split_hidden(degree), with_kwargs=True))
        handles.append(transformer.proj_out.register_forward_hook(_gather_output(degree)))
        for block in transformer.blocks:
            swapped.append((block.attn1, block.attn1.processor))
            block.attn1.processor = _RankProcessor(block.attn1.processor, degree, mode)
        yield
    finally:
        for handle in handles:
            handle.remove()
        for attention, processor in swapped:
            attention.processor = processor


TRACED_PARTS = ("rope", "blocks", "proj_out")  # what the hooks below attach to, as Wan names them


def _chunk(tensor: torch.Tensor, degree: int, dim: int = 1) -> torch.Tensor:
    """diffusers' EquipartitionSharder.shard: a view of this rank's equal share (rank 0 stands for all)."""
    return tensor.chunk(degree, dim=dim)[0]


def _split_timestep(degree: int):
    def hook(module, args, kwargs):
        timestep = kwargs.get("timestep")
        if isinstance(timestep, torch.Tensor) and timestep.ndim == 2:  # per-token timesteps (expand_timesteps)
            return args, {**kwargs, "timestep": _chunk(timestep, degree)}
        return None
    return hook


def _split_outputs(degree: int):
    def hook(module, args, output):
        return tuple(_chunk(t, degree) for t in output)
    return hook


def _split_hidden(degree: int):
    def hook(module, args, kwargs):
        if args:
            return (_chunk(args[0], degree), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": _chunk(kwargs["hidden_states"], degree)}
    return hook


def _gather_output(degree: int):
    """ContextParallelGatherHook: all_gather_tensor along dim 0 into one buffer, then concatenated on dim 1."""
    def hook(module, args, output):
        local = output.contiguous()
        gathered = torch.empty((degree * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
        return torch.cat(gathered.chunk(degree, dim=0), dim=1)
    return hook


class _RankProcessor:
    """The block's own self-attention processor, with its attention call replaced by the collective."""

    def __init__(self, inner, degree: int, mode: str) -> None:
        self.inner, self.degree, self.mode = inner, degree, mode

    def __call__(self, attn, *args, **kwargs):
        with _CollectiveAttention(self.degree, self.mode):
            return self.inner(attn, *args, **kwargs)


class _CollectiveAttention(TorchFunctionMode):
    """Entered inside the trace, above its fused-attention mode: the inner attention call goes down to it."""

    def __init__(self, degree: int, mode: str) -> None:
        super().__init__()
        self.degree, self.mode = degree, mode

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("query", "key", "value")
        q, k, v = (list(args) + [kwargs.pop(n) for n in names[len(args):]])[:3]
        rest = {n: value for n, value in kwargs.items() if n not in names}
        # diffusers' native path hands SDPA [B, H, S, D] views of [B, S, H, D] tensors; the collectives
        # work on the [B, S, H, D] layout, as TemplatedUlyssesAttention / TemplatedRingAttention receive it.
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        run = ulysses_attention if self.mode == ULYSSES else ring_attention
        return run(q, k, v, self.degree, rest).transpose(1, 2)


def ulysses_attention(query, key, value, degree: int, sdpa_kwargs: dict) -> torch.Tensor:
    """TemplatedUlyssesAttention.forward's allocations; q, k, v and the result are [B, S_local, H, D]."""
    batch, local, heads, dim = query.shape
    per_rank = heads // degree
    qkv = (x.reshape(batch, local, degree, per_rank, dim).permute(2, 1, 0, 3, 4).contiguous() for x in (query, key, value))
    qkv = tuple(torch.empty_like(x) for x in tuple(qkv))  # all_to_all_single: a fresh output per tensor
    qkv = tuple(x.flatten(0, 1).permute(1, 0, 2, 3).contiguous() for x in qkv)  # [B, S, H/N, D]
    # the whole sequence with H/N heads (the native forward op permutes to SDPA's layout): [B, H/N, S, D]
    out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in qkv), **sdpa_kwargs)
    out = out.unflatten(2, (degree, local)).permute(2, 1, 0, 3, 4).contiguous()  # [N, H/N, B, S_local, D]
    out = torch.empty_like(out)  # the all-to-all back
    return out.flatten(0, 1).permute(1, 2, 0, 3).contiguous()  # [B, S_local, H, D]


def ring_attention(query, key, value, degree: int, sdpa_kwargs: dict) -> torch.Tensor:
    """TemplatedRingAttention.forward (rotate_method="allgather", convert_to_fp32=True) over the
    cuDNN backend the runtime sets for ring (the native one returns no log-sum-exp)."""
    kv_local = torch.cat([key.flatten(), value.flatten()]).contiguous()
    gathered = torch.empty(degree * kv_local.numel(), dtype=kv_local.dtype, device=kv_local.device).chunk(degree)
    del kv_local
    previous_out = previous_lse = None
    for index in range(degree):
        if index:
            key = gathered[index][: key.numel()].reshape_as(key)
            value = gathered[index][key.numel():].reshape_as(value)
        out, lse = _cudnn_attention(query, key, value, sdpa_kwargs)
        out = out.to(torch.float32)
        lse = lse.unsqueeze(-1)
        if previous_out is not None:
            out = previous_out - torch.sigmoid(lse - previous_lse) * (previous_out - out)
            lse = previous_lse - F.logsigmoid(previous_lse - lse)
        previous_out, previous_lse = out, lse
    return out.to(query.dtype)


def _cudnn_attention(query, key, value, sdpa_kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' `_cudnn_attention_forward_op`: contiguous [B, H, S, D] copies for the kernel, its output
    and float32 log-sum-exp, both made contiguous again in the [B, S, H, ...] layout."""
    query_t, key_t, value_t = (x.transpose(1, 2).contiguous() for x in (query, key, value))
    out = F.scaled_dot_product_attention(query_t, key_t, value_t, **sdpa_kwargs)
    lse = torch.empty((*query_t.shape[:-1], 1), dtype=torch.float32, device=query.device)  # the kernel's
    out = out.transpose(1, 2).contiguous()
    lse = lse.squeeze(-1).transpose(1, 2).contiguous()
    del query_t, key_t, value_t
    return out, lse
