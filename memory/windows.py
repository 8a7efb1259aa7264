"""Context windows: which latent frames each denoiser pass sees, and how the passes are blended.

A clip longer than the model was trained on (or than fits) is denoised as overlapping windows of
latent frames; each step runs the transformer once per window and blends the overlaps. This is
the schedule and the blend, with no torch model in it, so the planner and the sampler read the same
rule (pipelines/context_windows.py applies it to a denoiser).

What we follow (learned from, not copied):
- ComfyUI core `comfy/context_windows.py` (the `ContextWindowsManual` / `WanContextWindowsManual`
  nodes) and kijai's ComfyUI-WanVideoWrapper context options: window length and overlap are given
  in video frames and turned into latent frames on the model's temporal grid; the *static* schedule
  (`static_standard`: windows start at 0 and step by `window - overlap`, the same at every step,
  no per-step shift), with the last window moved back so it ends on the clip's last frame instead
  of running short.
- Their "overlap-linear" fuse method: inside an overlap, a frame's weight ramps linearly from the
  window's edge, so two neighbours cross-fade (the blend divides by the weights' sum, which is not one
  where the end-aligned last window overlaps more than its neighbour); elsewhere the weight is
  exactly 1, so a frame seen by one window only is that window's output, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WindowSchedule:
    """Windows of `window` latent frames over a clip of `frames` latent frames, `overlap` shared.

    `spans`: (start, stop) per window in order; the last one ends at the clip's end (its overlap
    with the one before may then be larger than `overlap`). A window not shorter than the clip
    gives one span, the whole clip.
    """

    frames: int
    window: int
    overlap: int

    def __post_init__(self) -> None:
        for name in ("frames", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"context window {name}={value!r} must be a whole number of latent frames, 1 or more.")
        if isinstance(self.overlap, bool) or not isinstance(self.overlap, int) or not 0 <= self.overlap < self.window:
            raise ValueError(f"context window overlap={self.overlap!r} must be a whole number from 0 to window - 1 "
                             f"({self.window - 1}) latent frames.")

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        if self.window >= self.frames:
            return ((0, self.frames),)
        stride = self.window - self.overlap
        starts = list(range(0, self.frames - self.window, stride)) + [self.frames - self.window]
        return tuple((start, start + self.window) for start in dict.fromkeys(starts))

    @property
    def count(self) -> int:
        return len(self.spans)

    def weights(self, index: int) -> list[float]:
        """The blend weight of each latent frame of window `index`: a linear ramp over each overlap
        with a neighbour ((i + 1) / (n + 1) up, its mirror down), 1 elsewhere."""
        spans = self.spans
        start, stop = spans[index]
        weights = [1.0] * (stop - start)
        if index > 0:  # shared with the window before: ramp up from its end
            shared = spans[index - 1][1] - start
            for i in range(shared):
                weights[i] = (i + 1) / (shared + 1)
        if index + 1 < len(spans):  # shared with the window after: ramp down to its start
            shared = stop - spans[index + 1][0]
            for i in range(shared):
                weights[-1 - i] = min(weights[-1 - i], (i + 1) / (shared + 1))
        return weights

    def describe(self) -> list[str]:
        """Each window as latent frames "start-stop" (stop exclusive), for receipts and plans."""
        return [f"{start}-{stop}" for start, stop in self.spans]


def latent_count(video_frames: int, temporal_factor: int) -> int:
    """Latent frames of a clip of `video_frames` (the causal VAEs here: 1 + (frames - 1) / factor)."""
    return (video_frames - 1) // temporal_factor + 1
