"""The memory planner: predicts each stage's device and host peaks on the meta device, before a run.

`planner` plans a run and chooses a strategy; `types` is its vocabulary; `stages` composes a
stage from the engine's own stage declaration; `schedule` and `allocator` say what is resident and
what the CUDA caching allocator reserves; `costs` holds the fixed costs and the time model;
`storage` counts stored bytes per format; `advice` says what would fit when nothing does;
`train` and `train_plan` do the same for a LoRA training step.
"""
