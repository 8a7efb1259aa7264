"""Sampler controls: each scheduler equals plain diffusers with that scheduler set by hand (bit for
bit), the shared pipeline's scheduler is never touched, shift changes the timesteps, cfg = 1 runs
no negative pass and encodes no negative prompt, A14B's second scale and boundary follow
diffusers' WanPipeline, and bad values are refused before anything moves."""

from __future__ import annotations

import copy
import dataclasses

import diffusers
import pytest
import torch

from backends import StrictBackend
from test_tiers import hooks_of, request_for, storage_map
from vidmem.memory import MemoryStrategy
from vidmem.pipelines.family import ModelError
from vidmem.pipelines.hooks import RunHooks
from vidmem.pipelines.sample import sample
from vidmem.pipelines.tiny import tiny_call_kwargs, tiny_spec
from vidmem.pipelines.wan import WAN

STEPS = 3
STRATEGY = MemoryStrategy(offload="block_swap", blocks_to_swap=1)


def by_hand(pipe, name: str, shift: float | None = None):
    """The scheduler as a user would set it on a plain diffusers pipeline (written independently)."""
    config = pipe.scheduler.config
    if name == "default":
        return type(pipe.scheduler).from_config(config, **({"flow_shift": shift} if shift else {}))
    if name == "unipc":
        return diffusers.UniPCMultistepScheduler.from_config(config, **({"flow_shift": shift} if shift else {}))
    if name == "dpmpp_2m":
        return diffusers.DPMSolverMultistepScheduler.from_config(
            config, algorithm_type="dpmsolver++", solver_order=2, **({"flow_shift": shift} if shift else {}))
    if name == "flow_match_euler":
        return diffusers.FlowMatchEulerDiscreteScheduler(shift=shift or config["flow_shift"])
    raise AssertionError(name)


def plain_diffusers(loaded, variant, scheduler, steps=STEPS, boundary_ratio=None, **call):
    pipe = loaded.pipe
    extra = {k: pipe.config[k] for k in ("boundary_ratio", "expand_timesteps") if k in pipe.config}
    if boundary_ratio is not None:
        extra["boundary_ratio"] = boundary_ratio
    reference = getattr(diffusers, loaded.class_name)(**dict(pipe.components, scheduler=scheduler), **extra)
    reference.set_progress_bar_config(disable=True)
    with torch.no_grad():
        raw = reference(**dict(tiny_call_kwargs(variant, steps=steps), **call)).frames
    return loaded.spec.to_comfy_latent(pipe, raw, tiny_spec(variant).frames)


def ours(loaded, variant, steps=STEPS, strategy=STRATEGY, hooks=RunHooks(), **changes):
    request = dataclasses.replace(request_for(variant, steps=steps), **changes)
    return sample(loaded, strategy, request, hooks=hooks, backend=StrictBackend())


CASES = [("wan2.1-t2v", name) for name in ("default", "unipc", "dpmpp_2m", "flow_match_euler")] + [
    ("wan2.2-a14b", "dpmpp_2m"), ("wan2.2-a14b", "flow_match_euler"), ("wan2.1-i2v", "flow_match_euler"),
    ("cogvideox-t2v", "default"), ("cogvideox1.5-t2v", "default"),
    ("cogvideox-i2v", "default"), ("cogvideox-i2v", "unipc"), ("cogvideox-i2v", "dpmpp_2m"),
]


@pytest.mark.parametrize("variant,name", CASES)
def test_each_scheduler_equals_plain_diffusers_with_it_set_by_hand(variant, name, tiny_loaded):
    loaded = tiny_loaded(variant)
    shipped = loaded.pipe.scheduler
    state = copy.deepcopy(shipped.__dict__)
    # 5 steps: multistep solvers reach their full order only away from the first and last two steps
    result = ours(loaded, variant, steps=5, scheduler=name)
    assert torch.equal(result.latent["samples"], plain_diffusers(loaded, variant, by_hand(loaded.pipe, name), steps=5))
    assert f"scheduler={name}" in result.receipt["sampler"]
    assert loaded.pipe.scheduler is shipped
    assert shipped.__dict__.keys() == state.keys()
    for key, value in state.items():  # never stepped nor re-timed: the shipped object is only read
        assert key == "_internal_dict" or same(shipped.__dict__[key], value), key


def same(a, b) -> bool:
    """Equal values, tensors compared bit for bit, inside lists too (UniPC keeps its history in lists)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def test_a_shipped_scheduler_used_before_stays_as_it_was(tiny_loaded):
    """A plain diffusers call on the shared pipeline leaves history in its scheduler; ours never reads it."""
    loaded = tiny_loaded("wan2.1-t2v")
    with torch.no_grad():
        loaded.pipe(**tiny_call_kwargs("wan2.1-t2v", steps=2))
    state = copy.deepcopy(loaded.pipe.scheduler.__dict__)
    assert any(isinstance(v, list) and any(isinstance(x, torch.Tensor) for x in v) for v in state.values())
    result = ours(loaded, "wan2.1-t2v", steps=5)
    assert torch.equal(result.latent["samples"], plain_diffusers(loaded, "wan2.1-t2v", by_hand(loaded.pipe, "unipc"), steps=5))
    assert all(key == "_internal_dict" or same(loaded.pipe.scheduler.__dict__[key], v) for key, v in state.items())


def test_the_shipped_scheduler_is_untouched_after_an_error(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    shipped, class_before = loaded.pipe.scheduler, type(loaded.pipe.scheduler)

    class Stop(Exception):
        pass

    def stop(done, total):
        raise Stop()

    with pytest.raises(Stop):
        ours(loaded, "wan2.1-t2v", scheduler="flow_match_euler", shift=7.0, hooks=RunHooks(on_step=stop))
    assert loaded.pipe.scheduler is shipped and type(shipped) is class_before
    assert shipped.config["flow_shift"] == tiny_spec("wan2.1-t2v").scheduler_config["flow_shift"]
    assert not hasattr(loaded.pipe, "vidmem_execution_device")


class Calls:
    """Forward calls of a module, with their timestep and batch size."""

    def __init__(self, module):
        self.timesteps, self.batches = [], []
        self.handle = module.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        self.timesteps.append(float(kwargs["timestep"].flatten()[0]))
        self.batches.append(hidden.shape[0])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def test_shift_changes_the_timesteps(tiny_loaded):
    loaded = tiny_loaded("wan2.1-t2v")
    runs = {}
    for shift in (None, 3.0, 8.0):
        with Calls(loaded.pipe.transformer) as calls:
            result = ours(loaded, "wan2.1-t2v", shift=shift)
        runs[shift] = (calls.timesteps[::2], result)
    assert runs[None][0] == runs[3.0][0]  # the tiny model ships flow_shift 3.0
    assert runs[8.0][0] != runs[3.0][0] and runs[8.0][0][1] > runs[3.0][0][1]  # a larger shift stays noisier
    expected = by_hand(loaded.pipe, "unipc", 8.0)
    expected.set_timesteps(STEPS)
    assert runs[8.0][0] == [float(t) for t in expected.timesteps]
    assert torch.equal(runs[8.0][1].latent["samples"], plain_diffusers(loaded, "wan2.1-t2v", expected.__class__.from_config(expected.config)))
    assert "shift=3 (model default)" in runs[None][1].receipt["sampler"] and "shift=8 " in runs[8.0][1].receipt["sampler"] + " "


@pytest.mark.parametrize("variant", ["wan2.1-t2v", "cogvideox-t2v"])
def test_cfg_one_runs_no_negative_pass_and_encodes_no_negative_prompt(variant, tiny_loaded):
    loaded = tiny_loaded(variant)
    encoder_calls = []
    handle = loaded.pipe.text_encoder.register_forward_pre_hook(lambda m, a: encoder_calls.append(1))
    try:
        with Calls(loaded.pipe.transformer) as calls:
            result = ours(loaded, variant, cfg=1.0, negative_prompt="blurry")
    finally:
        handle.remove()
    assert len(calls.batches) == STEPS and set(calls.batches) == {1}  # one single-batch pass per step
    assert len(encoder_calls) == 1 and "negative_prompt" not in result.receipt["text_encode"]
    assert "no negative pass" in result.receipt["sampler"]
    plain = plain_diffusers(loaded, variant, by_hand(loaded.pipe, "default"), guidance_scale=1.0, negative_prompt="blurry")
    assert torch.equal(result.latent["samples"], plain)
    with Calls(loaded.pipe.transformer) as guided:
        ours(loaded, variant, cfg=5.0)
    assert sum(guided.batches) == 2 * STEPS  # the guided run does make the negative pass


def expert_calls(loaded, **changes):
    with Calls(loaded.pipe.transformer) as high, Calls(loaded.pipe.transformer_2) as low:
        result = ours(loaded, "wan2.2-a14b", steps=4, **changes)
    return result, high, low


def test_a14b_second_scale_and_boundary_follow_diffusers(tiny_loaded):
    loaded = tiny_loaded("wan2.2-a14b")
    default = by_hand(loaded.pipe, "default")
    result, high, low = expert_calls(loaded, cfg=5.0, cfg_2=3.0)
    assert torch.equal(result.latent["samples"], plain_diffusers(loaded, "wan2.2-a14b", default, steps=4, guidance_scale_2=3.0))
    assert result.latent["samples"].shape and "cfg_2=3" in result.receipt["sampler"]
    for ratio, more_high_steps in ((0.5, True), (0.95, False)):  # a lower boundary: more high-noise steps
        moved, high_b, low_b = expert_calls(loaded, boundary_ratio=ratio)
        plain = plain_diffusers(loaded, "wan2.2-a14b", default, steps=4, boundary_ratio=ratio)
        assert torch.equal(moved.latent["samples"], plain)
        assert (len(high_b.timesteps) > len(high.timesteps)) is more_high_steps
        assert (len(low_b.timesteps) < len(low.timesteps)) is more_high_steps and len(high_b.timesteps) != len(high.timesteps)
    assert loaded.pipe.config["boundary_ratio"] == tiny_spec("wan2.2-a14b").pipeline_config["boundary_ratio"]


def test_a14b_scale_of_one_skips_the_negative_pass_of_that_expert_only(tiny_loaded):
    loaded = tiny_loaded("wan2.2-a14b")
    both, high, low = expert_calls(loaded, cfg=5.0, cfg_2=5.0)
    high_steps, low_steps = len(high.timesteps) // 2, len(low.timesteps) // 2
    assert high_steps and low_steps
    lightning_low, high_1, low_1 = expert_calls(loaded, cfg=5.0, cfg_2=1.0)
    assert len(high_1.timesteps) == 2 * high_steps and len(low_1.timesteps) == low_steps
    assert "no negative pass on the low-noise expert" in lightning_low.receipt["sampler"]
    # diffusers runs the negative pass and mixes it at scale 1: equal up to rounding
    plain = plain_diffusers(loaded, "wan2.2-a14b", by_hand(loaded.pipe, "default"), steps=4, guidance_scale_2=1.0)
    torch.testing.assert_close(lightning_low.latent["samples"], plain, rtol=1e-5, atol=1e-5)
    _, high_2, low_2 = expert_calls(loaded, cfg=1.0, cfg_2=5.0)
    assert len(high_2.timesteps) == high_steps and len(low_2.timesteps) == 2 * low_steps
    _, high_3, low_3 = expert_calls(loaded, cfg=1.0, cfg_2=1.0)
    assert len(high_3.timesteps) == high_steps and len(low_3.timesteps) == low_steps


BAD = [
    ("wan2.1-t2v", dict(scheduler="euler_a"), "scheduler='euler_a' is not a scheduler vidmem knows"),
    ("cogvideox-i2v", dict(scheduler="flow_match_euler"), "not offered for cogvideox; use one of default, unipc, dpmpp_2m"),
    ("cogvideox-t2v", dict(scheduler="unipc"), "snr_shift_scale=3.*use scheduler='default'"),
    ("cogvideox-t2v", dict(shift=3.0), "shift applies to flow-matching models"),
    ("wan2.1-t2v", dict(shift=0.0), "shift=0.0 must be a finite number above 0"),
    ("wan2.1-t2v", dict(shift=-2.0), "shift=-2.0 must be"),
    ("wan2.1-t2v", dict(shift=float("nan")), "shift=nan must be"),
    ("wan2.1-t2v", dict(shift=float("inf")), "shift=inf must be"),
    ("wan2.1-t2v", dict(cfg_2=3.0), "cfg_2 applies to two-expert models"),
    ("wan2.1-t2v", dict(boundary_ratio=0.5), "boundary_ratio applies to two-expert models"),
    ("wan2.2-a14b", dict(boundary_ratio=0.0), "boundary_ratio=0.0 must be a finite number above 0"),
    ("wan2.2-a14b", dict(boundary_ratio=1.0), "boundary_ratio=1.0 must be between 0 and 1"),
    ("wan2.2-a14b", dict(boundary_ratio=1.5), "boundary_ratio=1.5 must be between 0 and 1"),
    ("wan2.2-a14b", dict(boundary_ratio=float("nan")), "boundary_ratio=nan"),
    ("wan2.2-a14b", dict(cfg_2=float("nan")), "cfg_2=nan is not a finite number"),
    ("wan2.2-a14b", dict(cfg_2=-1.0), "cfg_2=-1.0 must be 0 or more"),
]


@pytest.mark.parametrize("variant,changes,message", BAD)
def test_bad_controls_are_refused_before_anything_moves(variant, changes, message, tiny_loaded):
    loaded = tiny_loaded(variant)
    before, hooks_before = storage_map(loaded.pipe), hooks_of(loaded.pipe)
    with Calls(loaded.pipe.transformer) as calls, pytest.raises(ModelError, match=message):
        ours(loaded, variant, **changes)
    assert calls.timesteps == []
    assert storage_map(loaded.pipe) == before and hooks_of(loaded.pipe) == hooks_before


def test_family_defaults_are_data():
    assert WAN.sampler.shift_for(1280, 720) == 5.0 and WAN.sampler.shift_for(832, 480) == 3.0
    assert WAN.sampler.flow_matching and "flow_match_euler" in WAN.sampler.schedulers
    from vidmem.pipelines.cogvideox import COGVIDEOX

    assert not COGVIDEOX.sampler.flow_matching and COGVIDEOX.sampler.shift_for(1280, 720) is None


def test_the_receipt_names_the_recommended_shift_when_it_differs(tiny_loaded):
    from vidmem.pipelines.schedulers import resolve_sampler

    pipe = tiny_loaded("wan2.1-t2v").pipe
    at_720p = resolve_sampler(pipe, WAN, "default", None, 5.0, None, None, (1280, 720))
    assert at_720p.shift == 3.0 and "(recommended at this size: shift=5)" in at_720p.describe()
    at_480p = resolve_sampler(pipe, WAN, "default", None, 5.0, None, None, (832, 480))
    assert "recommended" not in at_480p.describe()


def test_the_sampler_node_passes_its_controls_to_the_engine(tiny_folder):
    """The node's widget values for "the model's own" (shift 0, cfg_2 -1, boundary 0) are the engine's None."""
    from test_nodes import strategy_inputs
    from vidmem.nodes import NODE_CLASS_MAPPINGS as N

    (pipeline,) = N["VidMemLoadPipeline"]().load(model="ignored", dtype="fp32", path=str(tiny_folder("wan2.1-t2v")))
    (strategy,) = N["VidMemMemoryStrategy"]().build(**strategy_inputs())["result"]
    node = N["VidMemVideoSampler"]()
    plain = node.sample(pipeline, strategy, "a cat", "", 32, 32, 9, 2, 5.0, 0)
    default = node.sample(pipeline, strategy, "a cat", "", 32, 32, 9, 2, 5.0, 0, None, "default", 0.0, -1.0, 0.0)
    assert torch.equal(plain["result"][0]["samples"], default["result"][0]["samples"])
    euler = node.sample(pipeline, strategy, "a cat", "", 32, 32, 9, 2, 1.0, 0, None, "flow_match_euler", 7.0, -1.0, 0.0)
    receipt = euler["ui"]["vidmem_receipt"][0]
    assert "scheduler=flow_match_euler" in receipt["sampler"] and "shift=7 " in receipt["sampler"] + " "
    assert "no negative pass" in receipt["sampler"]
    with pytest.raises(ModelError, match="cfg_2 applies to two-expert models"):
        node.sample(pipeline, strategy, "a cat", "", 32, 32, 9, 2, 5.0, 0, None, "default", 0.0, 2.0, 0.0)
