"""The memory planner: predicts each stage's device and host peaks on the meta device, before a run.

`planner` chooses a strategy from `candidates` (one fitted plan per tier); `types` is their
vocabulary; `stages` composes a stage from the engine's own stage declaration; `schedule` and
`allocator` say what is resident and what the CUDA caching allocator reserves; `costs` holds the
fixed costs and the time model; `storage` counts stored bytes per format; `advice` says what would
fit when nothing does; `train` and `train_plan` do the same for a LoRA training step.
"""
