// The live plan over several GPUs (GET /vidmem/plan with gpus and context_parallel). Run with: node --test tests/js/
import assert from "node:assert/strict";
import { test } from "node:test";

import {
  STRATEGY_PARALLEL, isParallel, parallelLines, planBars, planLines, planQuery, planVerdict, timeNote, timeText,
} from "../../web/js/vidmem_format.js";

const GiB = 2 ** 30;
const stages = (vram, ram) => ["text_encode", "denoise", "decode"].map((name, i) => ({ name, vram_bytes: vram[i], ram_bytes: ram }));
// A 2-GPU ulysses answer as nodes/plan_route_parallel.py gives it (wan2.1-t2v-14b 832x480x81, trimmed).
const PARALLEL = {
  status: "ok", model: "wan2.1-t2v-14b", config: "wan2.1-t2v-14b", auto: true, on_disk: false,
  shape: { width: 832, height: 480, frames: 81, window: 0, window_overlap: 0 },
  budgets: { vram_bytes: 24 * GiB, ram_bytes: 128 * GiB },
  rows: [
    { label: "none chunks 32", fits: false, est_slowdown: 0.56, speedup: 1.78, peak_vram_bytes: 30.7 * GiB,
      peak_ram_bytes: 118 * GiB, stages: stages([0, 30.7 * GiB, 7.2 * GiB], 118 * GiB), over_budget: ["denoise: VRAM 30.7 > 24.0 GiB on GPU 0, 1"] },
    { label: "block_swap 11", fits: true, est_slowdown: 0.53, speedup: 1.89, peak_vram_bytes: 23.7 * GiB,
      peak_ram_bytes: 118 * GiB, stages: stages([11.6 * GiB, 23.7 * GiB, 7.2 * GiB], 118 * GiB), over_budget: [] },
  ],
  chosen: 1,
  time: { shown: true, resolution: 0.05, range: [0.53, 0.56], speedup: true,
          relative_to: "one GPU (block_swap 15, its recommended row), estimated" },
  parallel: { mode: "ulysses", gpus: 2, speedup: 1.89, interconnect: { name: "PCIe 4.0 x16", gbps: 25, assumed: "pcie4" },
              lines: ["per GPU, 2 GPUs, ulysses over PCIe 4.0 x16 (25 GB/s per GPU, assumed); every GPU holds all the weights",
                      "speedup x1.89 against one GPU (block_swap 15, 23.8 GiB)"] },
};
const ONE_GPU = { ...PARALLEL, parallel: undefined, time: { shown: true, resolution: 0.05, range: [1, 1.4],
  relative_to: "the same run with every weight on the GPU and the decode in one piece" } };

test("the plan query carries the Strategy's gpus and context_parallel", () => {
  assert.deepEqual([...STRATEGY_PARALLEL], ["gpus", "context_parallel"]);
  const query = new URLSearchParams(planQuery({ model: "Wan", widgets: { gpus: "0,1", context_parallel: "ulysses" },
    shape: { width: 832, height: 480, frames: 81 } }));
  assert.equal(query.get("gpus"), "0,1");
  assert.equal(query.get("context_parallel"), "ulysses");
});

test("over several GPUs the chart says per GPU, how many, the mode and the speedup", () => {
  assert.ok(isParallel(PARALLEL) && !isParallel(ONE_GPU) && !isParallel({ status: "error", parallel: {} }));
  assert.match(parallelLines(PARALLEL)[0], /^per GPU, 2 GPUs, ulysses over PCIe 4.0 x16 .*assumed/);
  assert.deepEqual(parallelLines(ONE_GPU), []);
  assert.equal(planVerdict(PARALLEL), "auto chose block_swap 11: fits; peak 23.7 of 24.0 GiB VRAM per GPU, 118.0 of 128.0 " +
    "GiB RAM, x1.89 against one GPU");
  assert.equal(timeNote(PARALLEL), "speed: how many times faster than one GPU (block_swap 15, its recommended row), estimated");
  assert.deepEqual(planLines(PARALLEL).slice(0, 2), ["wan2.1-t2v-14b 832x480x81", "per GPU, 2 GPUs, ulysses"]);
  assert.match(planLines(PARALLEL)[2], / speed$/);
  assert.match(planLines(PARALLEL)[4], /^> block_swap 11 .* x1\.89$/);
  assert.deepEqual(planBars(PARALLEL).map((row) => row.time), ["x1.78", "x1.89"]);
  assert.equal(timeText(PARALLEL, { speedup: null }), "-"); // nothing fits one GPU: no speedup
});

test("one GPU keeps its slowdown column", () => {
  assert.deepEqual(planBars(ONE_GPU).map((row) => row.time), ["+0%", "+0%"]);
  assert.doesNotMatch(planVerdict(ONE_GPU), /per GPU|one GPU/);
  assert.match(timeNote(ONE_GPU), /^time: estimated, against the same run/);
});
