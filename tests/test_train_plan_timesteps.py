"""The training planner traces the call the trainer makes: one timestep per sample (training/objective.py),
where Wan 2.2 TI2V's pipeline passes one per token. Traced per token, TI2V's training plan counted a
per-token time projection the run never builds (1.55 GiB of activations planned where the run holds 0.99
at 832x480x33 under offload)."""

from __future__ import annotations

from vidmem.memory.plan.types import VideoShape
from vidmem.pipelines.configs import load_model, workloads


def timestep_shapes(model, **options) -> list[tuple[int, ...]]:
    module = model.traced_module("transformer")
    seen = []
    handle = module.register_forward_pre_hook(lambda m, args, kwargs: seen.append(tuple(kwargs["timestep"].shape)),
                                              with_kwargs=True)
    try:
        workloads.denoise_step(model, "transformer", VideoShape(832, 480, 33, cfg=False), module, **options)()
    finally:
        handle.remove()
    return seen


def test_ti2v_samples_per_token_and_trains_per_sample():
    model = load_model("wan2.2-ti2v-5b")
    assert model.pipeline_config.get("expand_timesteps")
    assert len(timestep_shapes(model)[0]) == 2  # the pipeline's call: [batch, tokens]
    assert timestep_shapes(model, per_sample_timesteps=True) == [(1,)]  # the trainer's: [batch]


def test_the_training_planner_traces_the_trainers_call(monkeypatch):
    from vidmem.training import plan as training_plan

    asked = []
    step = workloads.denoise_step
    monkeypatch.setattr(workloads, "denoise_step", lambda *args, **kwargs: asked.append(kwargs) or step(*args, **kwargs))
    model = load_model("wan2.2-ti2v-5b")
    training_plan._tracer(model, "transformer", VideoShape(832, 480, 33, cfg=False), None)
    assert asked == [{"per_sample_timesteps": True}]
