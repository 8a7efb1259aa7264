// Run with: node --test tests/js/
import assert from "node:assert/strict";
import { test } from "node:test";

import {
  FREE_BODY, MEMORY_ROUTE, NODE_TYPES, PLAN_ROUTE, STRATEGY_BUDGETS, STRATEGY_OPTIONS, STRATEGY_WIDGETS, compactLines, legacyStrategyValues,
  SAMPLER_SHAPE, extraFields, cacheLine, shapeText, speedLines, windowLines, onCpu, runLines, stageHeaders, planBars, planLines, planQuery, planReasons, planVerdict, needsLine, slowdownText, timeNote, timeShown, extraLines, formatBytes, formatPercent, formatSeconds, meterText,
  parseStrategyText, receiptFrom, strategyLines, summarize, textFrom,
} from "../../web/js/vidmem_format.js";

// Shapes as the nodes send them (vidmem demo's receipt.json, trimmed).
const SAMPLER = {
  strategy: "offload=block_swap blocks_to_swap=1 prefetch=1 text_encoder=offload_after_encoding vae_tiling=64/16px,8/4f",
  device: "cuda:0",
  stages: [
    { stage: "text_encode", seconds: 1.2856, peak_rss_bytes: 434585600, peak_allocated_bytes: 9.5e9 },
    { stage: "denoise", seconds: 12.5, peak_rss_bytes: 426487808, peak_allocated_bytes: 3 * 2 ** 30 },
  ],
  swap: { bytes_moved: 106880, copies: 4, copy_s: 0, wait_s: 0.0421, compute_s: 0.12, swap_cost: 0.0368, groups: 20,
          host_pool: { pinned_bytes: 0 } },
};
const DECODE = {
  strategy: "offload=model text_encoder=cpu", device: "cpu",
  stages: [{ stage: "decode", seconds: 0.5177, peak_rss_bytes: 441815040 }],
  decode: { mode: "tiled", sliced: false, tiles: 6, chunks: 2, decode_calls: 12, seconds: 0.51, tiling: null, device: "cpu",
            fallbacks: [] },
};
const FREE = { before: { rss_bytes: 441810944, allocated_bytes: 2 ** 30 }, after: { rss_bytes: 441810944, allocated_bytes: 0 },
               collected_objects: 12, comfy_models_unloaded: false };

test("formatBytes matches the Python receipts' units", () => {
  assert.equal(formatBytes(0), "0 B");
  assert.equal(formatBytes(1023), "1023 B");
  assert.equal(formatBytes(1024), "1.00 KiB");
  assert.equal(formatBytes(441810944), "421.34 MiB");
  assert.equal(formatBytes(3 * 2 ** 30), "3.00 GiB");
  assert.equal(formatBytes(-2 * 2 ** 20), "-2.00 MiB");
  for (const missing of [null, undefined, NaN, Infinity]) assert.equal(formatBytes(missing), "n/a");
});

test("seconds and percentages", () => {
  assert.equal(formatSeconds(0.0421), "42 ms");
  assert.equal(formatSeconds(12.5), "12.50 s");
  assert.equal(formatSeconds(undefined), "n/a");
  assert.equal(formatPercent(0.0368), "3.7%");
  assert.equal(formatPercent(null), "n/a");
});

test("messages: receipt and text are read defensively", () => {
  assert.equal(receiptFrom({ vidmem_receipt: [SAMPLER] }), SAMPLER);
  assert.equal(receiptFrom({ vidmem_receipt: ["text"] }), null);
  assert.equal(receiptFrom(undefined), null);
  assert.equal(textFrom({ text: ["a", "b"] }), "a\nb");
  assert.equal(textFrom({}), "");
});

test("strategy text parses into fields and short lines", () => {
  const fields = parseStrategyText("offload=block_swap blocks_to_swap=20 prefetch=1 text_encoder=cpu vae_slicing vae_tiling=256/64px,64/8f");
  assert.deepEqual(fields, { offload: "block_swap", blocks_to_swap: "20", prefetch: "1", text_encoder: "cpu",
                             vae_slicing: true, vae_tiling: "256/64px,64/8f" });
  assert.deepEqual(strategyLines("offload=block_swap blocks_to_swap=20 prefetch=1 text_encoder=cpu vae_slicing vae_tiling=256/64px,64/8f"), [
    "tier: block_swap, 20 blocks streamed, prefetch 1", "text encoder: cpu", "VAE tiles: 256/64px,64/8f", "VAE slicing: on",
  ]);
  assert.deepEqual(strategyLines("offload=model text_encoder=offload_after_encoding"),
                   ["tier: model", "text encoder: offload_after_encoding"]);
  assert.deepEqual(strategyLines(""), []);
});

test("the Memory Strategy node shows its plan, and any predicted figures a receipt carries", () => {
  const plain = summarize("VidMemMemoryStrategy", { text: ["offload=model text_encoder=cpu"] });
  assert.deepEqual(plain, { title: "plan", lines: ["tier: model", "text encoder: cpu"] });
  const planned = summarize("VidMemMemoryStrategy", { text: ["x"], vidmem_receipt: [{
    strategy: "offload=block_swap blocks_to_swap=12 prefetch=1 text_encoder=cpu",
    predicted_peak_device_bytes: 7.5 * 2 ** 30, fits: true, details: { nested: 1 },
  }] });
  assert.deepEqual(planned.lines, [
    "tier: block_swap, 12 blocks streamed, prefetch 1", "text encoder: cpu", "predicted peak device: 7.50 GiB", "fits: true",
  ]);
});

test("the sampler shows peak memory, swap cost and time", () => {
  const { title, lines } = summarize("VidMemVideoSampler", { text: ["ignored"], vidmem_receipt: [SAMPLER] });
  assert.equal(title, "sampler receipt");
  assert.deepEqual(lines, [
    "device: cuda:0",
    "text_encode: 1.29 s, peak VRAM 8.85 GiB, peak RSS 414.45 MiB",
    "denoise: 12.50 s, peak VRAM 3.00 GiB, peak RSS 406.73 MiB",
    "total: 13.79 s",
    "swap cost: 3.7% of denoise time (104.38 KiB moved, waited 42 ms, 20 streamed groups)",
  ]);
});

test("the decode shows its tiles and time", () => {
  const { title, lines } = summarize("VidMemVAEDecode", { vidmem_receipt: [DECODE] });
  assert.equal(title, "decode receipt");
  assert.deepEqual(lines, ["device: cpu", "strategy: offload=model text_encoder=cpu", "decode: 518 ms, peak RSS 421.35 MiB",
    "VAE: tiled, 6 tiles x 2 chunks, 12 calls"]);
  const fell = summarize("VidMemVAEDecode", { vidmem_receipt: [{ ...DECODE, decode: { ...DECODE.decode, fallbacks: ["whole", "tiled"] } }] });
  assert.match(fell.lines.at(-1), /fell back: whole; tiled$/);
  const wan = summarize("VidMemVAEDecode", { vidmem_receipt: [{ ...DECODE, decode: { ...DECODE.decode, shared_context: true, streamed: true } }] });
  assert.equal(wan.lines.at(-1), "VAE: tiled, 6 tiles x 2 chunks, attention shared by the tiles, exact chunks, 12 calls");
  const whole = { ...DECODE.decode, mode: "whole", tiles: 1, chunks: 1, decode_calls: 1, shared_context: true, streamed: true };
  assert.equal(summarize("VidMemVAEDecode", { vidmem_receipt: [{ ...DECODE, decode: whole }] }).lines.at(-1),
    "VAE: whole, 1 tile x 1 chunk, 1 call");
});

test("Free VRAM shows before and after", () => {
  assert.deepEqual(summarize("VidMemFreeVRAM", { vidmem_receipt: [FREE] }).lines, [
    "rss: 421.34 MiB -> 421.34 MiB", "allocated: 1.00 GiB -> 0 B", "gc collected 12 objects; ComfyUI models unloaded: no",
  ]);
});

test("without a receipt the text is shown, minus JSON dumps; nothing at all gives no lines", () => {
  assert.deepEqual(summarize("VidMemVideoSampler", { text: ["Video Sampler\nswap cost: 1%\n{\"a\": 1}"] }).lines,
                   ["Video Sampler", "swap cost: 1%"]);
  assert.deepEqual(summarize("VidMemVAEDecode", {}).lines, []);
});

test("extraLines skips known keys, objects and nulls", () => {
  assert.deepEqual(extraLines({ strategy: "s", a_bytes: 2048, b: null, c: { d: 1 }, e_f: "x" }, new Set(["strategy"])),
                   ["a: 2.00 KiB", "e f: x"]);
});

test("the meter reads the /vidmem/memory answer", () => {
  const gib = 2 ** 30;
  const cpu = meterText({ ram: { total_bytes: 32 * gib, available_bytes: 24 * gib }, process_rss_bytes: 2 * gib, cuda: [] });
  assert.deepEqual(cpu, { text: "no GPU in use | RAM 8.00 GiB / 32.00 GiB",
                          detail: "RAM: 24.00 GiB available of 32.00 GiB\nComfyUI process RSS: 2.00 GiB", level: "ok" });
  const gpu = meterText({ ram: { total_bytes: 32 * gib, available_bytes: 24 * gib }, process_rss_bytes: gib, cuda: [
    { index: 0, allocated_bytes: 6 * gib, reserved_bytes: 7 * gib, free_bytes: 0.5 * gib, total_bytes: 8 * gib },
    { index: 1, allocated_bytes: 0, reserved_bytes: 0, free_bytes: null, total_bytes: 24 * gib },
  ] });
  assert.equal(gpu.text, "GPU0 7.50 GiB / 8.00 GiB | GPU1 ? / 24.00 GiB | RAM 8.00 GiB / 32.00 GiB");
  assert.equal(gpu.level, "full");
  assert.match(gpu.detail, /^GPU0: allocated 6.00 GiB, reserved 7.00 GiB, free 512.00 MiB of 8.00 GiB\n/);
  assert.equal(meterText({ ram: { total_bytes: 100, available_bytes: 20 }, cuda: [] }).level, "high");
  assert.equal(meterText(null).text, "no GPU in use");
});

test("constants the extension relies on", () => {
  assert.deepEqual(FREE_BODY, { unload_models: true, free_memory: true });
  assert.ok(Object.isFrozen(FREE_BODY));
  assert.equal(MEMORY_ROUTE, "/vidmem/memory");
  assert.deepEqual([...NODE_TYPES].sort(), ["VidMemDecodeAudio", "VidMemFreeVRAM", "VidMemLoadLoRA", "VidMemLoadPipeline",
                                            "VidMemMemoryStrategy", "VidMemPrepareTrainingData", "VidMemTrainLoRA",
                                            "VidMemVAEDecode", "VidMemVideoSampler"]);
});

// A plan as GET /vidmem/plan answers it (nodes/plan_route.py), trimmed to two rows.
const GIB = 2 ** 30;
const stages = (te, dn, dc, ram) => [
  { name: "text_encode", vram_bytes: te * GIB, ram_bytes: ram * GIB },
  { name: "denoise", vram_bytes: dn * GIB, ram_bytes: ram * GIB },
  { name: "decode", vram_bytes: dc * GIB, ram_bytes: ram * GIB },
];
const PLAN = {
  status: "ok", model: "Wan2.1-T2V-1.3B-Diffusers", auto: false, shape: { width: 832, height: 480, frames: 81 },
  budgets: { vram_bytes: 8 * GIB, ram_bytes: 32 * GIB }, chosen: 1,
  time: { shown: true, resolution: 0.05, relative_to: "the same run with every weight on the GPU and the decode in one piece" },
  rows: [
    { label: "none", strategy: "offload=none", fits: false, est_slowdown: 1, peak_vram_bytes: 12 * GIB, peak_ram_bytes: 20 * GIB,
      stages: stages(12, 9, 7, 20), over_budget: ["text encode: VRAM 12.0 > 8.0 GiB; fix: text encoder on the CPU"] },
    { label: "your settings", strategy: "offload=block_swap blocks_to_swap=5", fits: true, est_slowdown: 1.09,
      peak_vram_bytes: 6 * GIB, peak_ram_bytes: 20 * GIB, stages: stages(0, 5.5, 6, 20), over_budget: [] },
  ],
};

test("the plan route and the Strategy's widgets as the node declares them", () => {
  assert.equal(PLAN_ROUTE, "/vidmem/plan");
  assert.equal(STRATEGY_WIDGETS.length, 12);
  assert.deepEqual([...STRATEGY_BUDGETS], ["vram_budget_gb", "ram_budget_gb"]);
});

test("an older Strategy node's widget values are read by name; current ones are left alone", () => {
  const current = ["model", 0, 1, -1, true, "cpu", false, true, 256, 32, 64, 8, 6, 0];
  assert.equal(legacyStrategyValues(current), null);
  const old = [...current.slice(0, 12), 832, 480, 81, 6, 0];
  const named = legacyStrategyValues(old);
  assert.equal(named.vram_budget_gb, 6);
  assert.equal(named.ram_budget_gb, 0);
  assert.equal(named.frames, 81);
  assert.equal(named.tile_size, 256);
});

test("today's 17 values (gpus, context_parallel, activation_chunks last) are not mistaken for an older node's", () => {
  const current = ["model", 0, 1, -1, true, "cpu", false, true, 256, 32, 64, 8, 6, 0, "auto", "off", "auto"];
  assert.equal(current.length, 17);
  assert.equal(legacyStrategyValues(current), null);
});

test("the plan query carries activation_chunks", () => {
  const widgets = { ...Object.fromEntries([...STRATEGY_WIDGETS, ...STRATEGY_BUDGETS].map((n) => [n, 1])), activation_chunks: "4" };
  const query = new URLSearchParams(planQuery({ model: "Wan", dtype: "bf16", widgets, shape: { width: 832, height: 480, frames: 81 } }));
  assert.deepEqual([...STRATEGY_OPTIONS], ["activation_chunks"]);
  assert.equal(query.get("activation_chunks"), "4");
});

test("the plan query carries the model, every widget and the sampler's shape, or nothing", () => {
  const widgets = Object.fromEntries([...STRATEGY_WIDGETS, ...STRATEGY_BUDGETS].map((n) => [n, n === "non_blocking" ? true : 1]));
  const query = new URLSearchParams(planQuery({ model: "Wan", dtype: "bf16", widgets, shape: { width: 832, height: 480, frames: 81, cfg: 5 }, client: 7 }));
  assert.equal(query.get("model"), "Wan");
  assert.equal(query.get("non_blocking"), "true");
  assert.equal(query.get("frames"), "81");
  assert.equal(query.get("client"), "7");
  for (const name of [...STRATEGY_WIDGETS, ...STRATEGY_BUDGETS]) assert.ok(query.has(name), name);
  assert.equal(planQuery({ model: "", widgets, shape: { width: 1, height: 1, frames: 1 } }), null);
  assert.equal(planQuery({ model: "Wan", widgets, shape: { width: 832, height: undefined, frames: 81 } }), null);
});

test("the plan query carries the Sampler's context window where the Sampler has one", () => {
  const shape = { width: 832, height: 480, frames: 161, cfg: 5, steps: 30, window: 81, window_overlap: 16 };
  const query = new URLSearchParams(planQuery({ model: "Wan", dtype: "bf16", widgets: {}, shape }));
  assert.ok(SAMPLER_SHAPE.includes("window") && SAMPLER_SHAPE.includes("window_overlap"));
  assert.equal(query.get("window"), "81");
  assert.equal(query.get("window_overlap"), "16");
  assert.equal(new URLSearchParams(planQuery({ model: "Wan", widgets: {}, shape: { ...shape, window: 0 } })).get("window"), "0");
  // An older Sampler without the widgets: nothing sent, the route plans the whole clip.
  const older = new URLSearchParams(planQuery({ model: "Wan", widgets: {}, shape: { ...shape, window: undefined, window_overlap: undefined } }));
  assert.equal(older.has("window"), false);
  assert.equal(older.has("window_overlap"), false);
  // A changed window is a changed request: the poll asks again and the chart redraws.
  assert.notEqual(planQuery({ model: "Wan", widgets: {}, shape }), planQuery({ model: "Wan", widgets: {}, shape: { ...shape, window: 41 } }));
});

test("the plan states the windows it was planned for", () => {
  const windowed = { ...PLAN, shape: { width: 832, height: 480, frames: 161, window: 81, window_overlap: 16 },
    windows: ["81-frame windows, overlap 16, of 161 frames: 3 windows a step; the denoise peak follows one window"] };
  assert.equal(planLines(windowed)[0], "Wan2.1-T2V-1.3B-Diffusers 832x480x161, 81-frame windows, overlap 16");
  assert.deepEqual(windowLines(windowed), windowed.windows);
  assert.equal(shapeText({ width: 832, height: 480, frames: 81, window: 81, window_overlap: 0 }), "832x480x81"); // covers the clip
  assert.equal(shapeText(PLAN.shape), "832x480x81");
  assert.deepEqual(windowLines(PLAN), []);
  assert.deepEqual(windowLines({ status: "error", windows: ["x"] }), []);
});

test("the plan table marks the chosen row, keeps labels whole and shows the budgets", () => {
  const lines = planLines(PLAN);
  assert.equal(lines[0], "Wan2.1-T2V-1.3B-Diffusers 832x480x81");
  assert.match(lines[1], /row +VRAM +RAM GiB +time$/);
  assert.match(lines[2], /^  none  .* 12\.0  20\.0 .* \+0% over$/);
  assert.match(lines[3], /^> your settings .*  6\.0  20\.0 .* \+9%$/);
  assert.match(lines.at(-1), /budget +8\.0  32\.0/);
  const long = { ...PLAN, rows: [{ ...PLAN.rows[0], label: "block_swap 37 +disk" }, PLAN.rows[1]] };
  assert.match(planLines(long)[2], /^  block_swap 37 \+disk  /);
  assert.deepEqual(planLines({ status: "error" }), []);
});

test("no time column where the rows' times cannot be told apart; the note says against what", () => {
  const same = { ...PLAN, time: { ...PLAN.time, shown: false, range: [1.0, 1.02] } };
  assert.equal(timeShown(same), false);
  assert.doesNotMatch(planLines(same)[1], /time/);
  assert.doesNotMatch(planVerdict(same), /time/);
  assert.equal(timeNote(same), "no time column: every row is within 5% of the others (+0% to +2% against the same run with " +
    "every weight on the GPU and the decode in one piece)");
  assert.match(timeNote(PLAN), /^time: estimated, against the same run with every weight on the GPU/);
  assert.equal(slowdownText(1.004), "+0%");
  assert.equal(slowdownText(1.09), "+9%");
  assert.equal(slowdownText(2.44), "x2.4");
  assert.equal(slowdownText(403), "x403");
  assert.equal(slowdownText("n/a"), "?");
});

test("the verdict names the chosen row, or the problem and its input; the reasons are one line per stage", () => {
  assert.equal(planVerdict(PLAN), "your settings: fit; peak 6.0 of 8.0 GiB VRAM, 20.0 of 32.0 GiB RAM, time +9%");
  const auto = { ...PLAN, auto: true, chosen: 0 };
  assert.match(planVerdict(auto), /^auto chose none: over budget; peak 12\.0 of 8\.0 GiB VRAM/);
  assert.deepEqual(planReasons(auto), ["text encode: VRAM 12.0 > 8.0 GiB; fix: text encoder on the CPU"]);
  assert.deepEqual(planReasons(PLAN), []);
  const none = { ...PLAN, auto: true, chosen: null, rows: [PLAN.rows[0]] };
  assert.match(planVerdict(none), /^nothing fits; even none is over; peak 12\.0/);
  // the figure over its budget is marked, the other not: which budget to act on
  assert.match(planVerdict(auto), /peak 12\.0 of 8\.0 GiB VRAM \(over\), 20\.0 of 32\.0 GiB RAM, time/);
  const overRam = { ...auto, rows: [{ ...PLAN.rows[0], peak_vram_bytes: 7 * GIB, peak_ram_bytes: 40 * GIB }] };
  assert.match(planVerdict(overRam), /peak 7\.0 of 8\.0 GiB VRAM, 40\.0 of 32\.0 GiB RAM \(over\)/);
  assert.doesNotMatch(planVerdict(PLAN), /over/);
  assert.equal(planReasons(none).length, 1);
  assert.equal(planVerdict({ status: "error", error: "tile_size=100 must be a multiple of 32" }), "plan: tile_size=100 must be a multiple of 32");
  assert.match(planVerdict(null), /connect the Sampler/);
});

test("a +disk row the loader does not hold is never the verdict's: it says which loader input it needs", () => {
  // nodes/plan_route.py: auto chooses among the rows the loader holds (the Sampler's auto); +disk rows carry `needs`.
  const needs = "weights_on_disk on (Load Video Model Files)";
  const leanest = { ...PLAN.rows[0], label: "sequential" };
  const disk = { ...PLAN.rows[1], label: "sequential +disk", on_disk: true, needs, fits: true };
  const nothing = { ...PLAN, auto: true, chosen: null, rows: [leanest, disk] };
  assert.match(planVerdict(nothing), /^nothing fits as loaded; even sequential is over; peak 12\.0/);
  assert.deepEqual(planReasons(nothing), [...leanest.over_budget, `sequential +disk fits with ${needs}`]);
  assert.equal(needsLine(nothing), `+disk rows need the weights on disk: ${needs}; auto runs the weights as loaded`);
  assert.equal(planLines(nothing).at(-1), `  ${needsLine(nothing)}`);
  const chosen = { ...nothing, chosen: 0, rows: [{ ...leanest, fits: true, over_budget: [] }, disk] };
  assert.match(planVerdict(chosen), /^auto chose sequential: fits/);
  assert.deepEqual(planReasons(chosen), []);
  assert.equal(needsLine(PLAN), "");
  assert.match(planLines(PLAN).at(-1), /budget/);
});

test("bars are shares of the budgets: past 1 is over the line", () => {
  const [none, mine] = planBars(PLAN);
  assert.equal(none.chosen, false);
  assert.equal(mine.chosen, true);
  assert.equal(none.stages[0].vram, 1.5);
  assert.equal(mine.stages[1].vram, 5.5 / 8);
  assert.equal(mine.stages[2].ram, 20 / 32);
  assert.deepEqual(none.stages.map((s) => s.name), ["text_encode", "denoise", "decode"]);
});

test("where the CPU computes, the RAM budget decides: no VRAM figure is set against the VRAM budget", () => {
  // ComfyUI --cpu (or no CUDA): the plan is the CPU's (nodes/plan_route.py "device"), its fit the RAM's. The chart set
  // the compute's memory against the VRAM budget: "your settings: fit; peak 10.7 of 4.0 GiB VRAM" beside red bars.
  const mine = { ...PLAN.rows[1], peak_vram_bytes: 10.7 * GIB, peak_ram_bytes: 15.2 * GIB, stages: stages(1, 10.7, 3, 15.2) };
  const cpu = { ...PLAN, device: "cpu", budgets: { vram_bytes: 4 * GIB, ram_bytes: 23.5 * GIB }, rows: [PLAN.rows[0], mine] };
  assert.equal(onCpu(cpu), true);
  assert.equal(onCpu(PLAN), false); // answers without "device" (older servers) keep the GPU chart
  assert.equal(planVerdict(cpu), "your settings: fit; the CPU computes: peak 15.2 of 23.5 GiB RAM, time +9%");
  const over = { ...cpu, rows: [PLAN.rows[0], { ...mine, fits: false, peak_ram_bytes: 30 * GIB }] };
  assert.match(planVerdict(over), /^your settings: over budget; the CPU computes: peak 30\.0 of 23\.5 GiB RAM \(over\)/);
  const [, bars] = planBars(cpu);
  assert.equal(bars.peak, 15.2 * GIB);
  assert.deepEqual(bars.stages.map((s) => [s.vram, s.ram]), [[15.2 / 23.5, 0], [15.2 / 23.5, 0], [15.2 / 23.5, 0]]);
  assert.equal(planBars(PLAN)[1].peak, 6 * GIB);
  const table = planLines(cpu);
  assert.match(table[1], /comp {3}RAM GiB/);
  assert.match(table.at(-2), /^ {2}budget +- +23\.5$/);
  assert.match(table.at(-1), /the CPU computes/);
});

test("stage headers shorten together where a name would run into the next panel", () => {
  assert.deepEqual(stageHeaders(7), ["encode", "denoise", "decode"]);
  assert.deepEqual(stageHeaders(6), ["enc", "den", "dec"]); // "denoise" ran into "decode" beside "block_swap 30 chunks 16"
});

test("receipts are at most three short lines; the rest is in the tooltip", () => {
  const sampler = compactLines("VidMemVideoSampler", { vidmem_receipt: [{ ...SAMPLER, plan: "auto chose at 32x32x9: offload=none; peak" }] });
  assert.equal(sampler.length, 3);
  assert.equal(sampler[0], "text encode 1.29 s + denoise 12.50 s");
  const hit = compactLines("VidMemVideoSampler", { vidmem_receipt: [{ ...SAMPLER, text_encode: { cache: "used" } }] });
  assert.equal(hit[0], "prompt from the cache + denoise 12.50 s");
  assert.match(runLines({ ...SAMPLER, text_encode: { cache: "used" } })[0], /^text_encode: prompt from the cache, /);
  assert.equal(sampler[1], "peak VRAM 8.85 GiB, RSS 414.45 MiB");
  assert.equal(sampler[2], "auto chose at 32x32x9: offload=none; swap cost 3.7% of denoise");
  const decode = compactLines("VidMemVAEDecode", { vidmem_receipt: [DECODE] });
  assert.deepEqual(decode, ["decode 518 ms", "peak RSS 421.35 MiB (no GPU)", "VAE tiled, 6 tiles x 2 chunks"]);
  const free = compactLines("VidMemFreeVRAM", { vidmem_receipt: [FREE] });
  assert.deepEqual(free, ["RSS 421.34 MiB -> 421.34 MiB, VRAM 1.00 GiB -> 0 B", "models unloaded: no"]);
  assert.ok(compactLines("VidMemVideoSampler", { text: ["a\nb\nc\nd"] }).length <= 3);
});

test("training nodes say where the LoRA went and what the data holds", () => {
  const trained = { lora: "C:\\ComfyUI\\models\\loras\\my_lora.safetensors", steps: 500, losses: [0.41, 0.3876],
                    plan: "auto chose offload=block_swap blocks_to_swap=4 at 832x480x33: predicted", strategy: "offload=model",
                    stages: [{ stage: "train", seconds: 9 }] };
  assert.deepEqual(compactLines("VidMemTrainLoRA", { vidmem_receipt: [trained] }),
                   ["LoRA written: my_lora.safetensors", "500 steps, loss 0.3876", "auto chose offload=block_swap blocks_to_swap=4 at 832x480x33"]);
  const chosen = compactLines("VidMemTrainLoRA", { vidmem_receipt: [{ ...trained, plan: undefined, lora: "/m/loras/a.safetensors" }] });
  assert.deepEqual(chosen, ["LoRA written: a.safetensors", "500 steps, loss 0.3876", "offload=model"]);
  const data = { clips: 3, encoded: 1, reused: 2, buckets: { "832x480x33": 2, "480x832x33": 1 } };
  assert.deepEqual(compactLines("VidMemPrepareTrainingData", { vidmem_receipt: [data] }),
                   ["3 clips (1 encoded, 2 reused)", "832x480x33: 2, 480x832x33: 1"]);
  assert.deepEqual(compactLines("VidMemLoadLoRA", { text: ["lightx2v x1.0 on transformer: 400 layers"] }),
                   ["lightx2v x1.0 on transformer: 400 layers"]);
});

test("the plan finds the loader through any chain of Load LoRA / Train LoRA nodes", async () => {
  const { pipelineLoader, loaderFields } = await import("../../web/js/vidmem_format.js");
  const node = (type, up = null, widgets = {}) => ({ comfyClass: type, up, widgets });
  const files = node("VidMemLoadModelFiles", null, { model: "wan.safetensors", model_2: "(none)", text_encoder: "t5.safetensors",
    vae: "vae.safetensors", clip_vision: "(none)", dtype: "bf16", vae_dtype: "fp32", weight_dtype: "default", weights_on_disk: true });
  const upstream = (n) => n.up;
  const chain = node("VidMemLoadLoRA", node("VidMemTrainLoRA", node("VidMemLoadLoRA", files)));
  assert.equal(pipelineLoader(chain, upstream), files);
  assert.equal(pipelineLoader(files, upstream), files);
  assert.equal(pipelineLoader(node("VidMemLoadLoRA", node("SomethingElse", files)), upstream), null);
  assert.equal(pipelineLoader(node("VidMemLoadLoRA"), upstream), null);
  const loop = node("VidMemLoadLoRA");
  loop.up = node("VidMemLoadLoRA", loop);
  assert.equal(pipelineLoader(loop, upstream), null);
  const fields = loaderFields(files, (name) => files.widgets[name]);
  assert.deepEqual(fields, { loader: "VidMemLoadModelFiles", model: "wan.safetensors", dtype: "bf16",
    ...Object.fromEntries(Object.entries(files.widgets).map(([k, v]) => [`loader_${k}`, v])) });
  const query = new URLSearchParams(planQuery({ model: fields.model, dtype: fields.dtype, loader: fields,
    widgets: { text_encoder: "cpu" }, shape: { width: 32, height: 32, frames: 9 } }));
  assert.equal(query.get("loader"), "VidMemLoadModelFiles");
  assert.equal(query.get("loader_vae"), "vae.safetensors");
  assert.equal(query.get("loader_text_encoder"), "t5.safetensors");
  assert.equal(query.get("text_encoder"), "cpu"); // the Strategy's own widget keeps its name
  assert.equal(query.get("loader_weights_on_disk"), "true");
  const folder = node("VidMemLoadPipeline", null, { model: "Wan2.1", dtype: "fp16", transformer_file: "(folder)" });
  assert.deepEqual(loaderFields(folder, (name) => folder.widgets[name]),
    { loader: "VidMemLoadPipeline", model: "Wan2.1", dtype: "fp16", transformer_file: "(folder)" });
  const stored = node("VidMemLoadPipeline", null, { model: "Cog", dtype: "bf16", transformer_file: "(folder)",
    weight_dtype: "fp8_scaled" });
  const storedQuery = new URLSearchParams(planQuery({ model: "Cog", dtype: "bf16",
    loader: loaderFields(stored, (name) => stored.widgets[name]), widgets: {}, shape: { width: 32, height: 32, frames: 9 } }));
  assert.equal(storedQuery.get("weight_dtype"), "fp8_scaled"); // the folder's storage choice reaches the route
  const fp32Vae = node("VidMemLoadPipeline", null, { model: "Wan2.1", dtype: "bf16", vae_dtype: "fp32" });
  const vaeQuery = new URLSearchParams(planQuery({ model: "Wan2.1", dtype: "bf16",
    loader: loaderFields(fp32Vae, (name) => fp32Vae.widgets[name]), widgets: {}, shape: { width: 32, height: 32, frames: 9 } }));
  assert.equal(vaeQuery.get("vae_dtype"), "fp32"); // the folder's VAE precision reaches the route, as the files'
  const withText = node("VidMemLoadPipeline", null, { model: "HY15", dtype: "bf16", text_encoder_file: "qwen_fp8.safetensors" });
  const textQuery = new URLSearchParams(planQuery({ model: "HY15", dtype: "bf16",
    loader: loaderFields(withText, (name) => withText.widgets[name]), widgets: {}, shape: { width: 32, height: 32, frames: 9 } }));
  assert.equal(textQuery.get("text_encoder_file"), "qwen_fp8.safetensors"); // the text encoder file's storage is planned
});

test("the Strategy widgets a tier ignores are the ones greyed out, and the note shows on the receipt", async () => {
  const { ignoredStrategyWidgets } = await import("../../web/js/vidmem_format.js");
  assert.deepEqual(ignoredStrategyWidgets("block_swap", true), []);
  assert.deepEqual(ignoredStrategyWidgets("sequential", true), ["blocks_to_swap"]);
  assert.deepEqual(ignoredStrategyWidgets("model", true), ["blocks_to_swap", "prefetch_blocks"]);
  assert.deepEqual(ignoredStrategyWidgets("auto", false), ["blocks_to_swap"]); // auto may choose tiling
  assert.deepEqual(ignoredStrategyWidgets("block_swap", false), ["tile_size", "overlap", "temporal_size", "temporal_overlap"]);
  const note = "blocks_to_swap=20 ignored: it applies only to offload=block_swap (offload is model).";
  const lines = compactLines("VidMemVideoSampler", { vidmem_receipt: [{ ...SAMPLER, note }] });
  assert.ok(lines[2].startsWith(`note: ${note}`), lines);
  assert.ok(summarize("VidMemVideoSampler", { vidmem_receipt: [{ ...SAMPLER, note }] }).lines.includes(`note: ${note}`));
});

test("a Step Cache's work shows in the Sampler's receipt: blocks computed of all, copies saved", () => {
  const cache = { method: "mag_cache", blocks_computed: 52, blocks_skipped: 28, blocks_computed_share: 0.65, streamed_copies_skipped: 476 };
  assert.equal(cacheLine(cache), "step cache mag_cache: 52 of 80 blocks computed (65.0%), 476 streamed copies saved");
  const receipt = { ...SAMPLER, cache };
  assert.ok(summarize("VidMemVideoSampler", { vidmem_receipt: [receipt] }).lines.includes(cacheLine(cache)));
  assert.match(compactLines("VidMemVideoSampler", { vidmem_receipt: [receipt] })[2], /cache 65\.0% of blocks computed/);
});

test("the Step Cache and Speed nodes on the Sampler's inputs go into the plan query, prefixed, with the Sampler's steps", () => {
  const widgets = Object.fromEntries([...STRATEGY_WIDGETS, ...STRATEGY_BUDGETS].map((n) => [n, 1]));
  const values = { method: "mag_cache", threshold: 0.1, retention: 0.2, max_skip_steps: 4, mag_ratios: "auto", interval: 3,
    attention: "flash", compile: true, compile_mode: "default", compile_dynamic: "auto", fp8_matmul: "auto" };
  const extra = { ...extraFields("cache", { comfyClass: "VidMemStepCache" }, (name) => values[name]),
    ...extraFields("speed", { comfyClass: "VidMemSpeed" }, (name) => values[name]) };
  const query = new URLSearchParams(planQuery({ model: "Wan", widgets, shape: { width: 832, height: 480, frames: 81, cfg: 5, steps: 40 }, extra }));
  assert.equal(query.get("steps"), "40");
  assert.equal(query.get("cache_method"), "mag_cache");
  assert.equal(query.get("cache_max_skip_steps"), "4");
  assert.equal(query.get("cache_interval"), "3");  // TaylorSeer's
  assert.equal(query.get("cache_order"), null);  // a widget the node lacks is not sent: the route takes its default
  assert.equal(query.get("speed_attention"), "flash");
  assert.equal(query.get("speed_compile"), "true");
  assert.equal(query.get("method"), null);
  assert.deepEqual(extraFields("cache", { comfyClass: "VidMemSpeed" }, () => 1), {});
  assert.deepEqual(extraFields("speed", null, () => 1), {});
  assert.deepEqual(speedLines({ status: "ok", speed: ["step cache: x"] }), ["step cache: x"]);
  assert.deepEqual(speedLines({ status: "error", speed: ["x"] }), []);
});

test("Decode Audio's receipt: device, its stage, where the audio VAE came from and the sound", () => {
  const receipt = { device: "cuda:0", stages: [{ stage: "audio_decode", seconds: 0.4, peak_allocated_bytes: 2 ** 28 }],
                    audio_vae: "folder", audio: "5.04 s at 24000 Hz, 2 channels" };
  const { title, lines } = summarize("VidMemDecodeAudio", { vidmem_receipt: [receipt] });
  assert.equal(title, "audio receipt");
  assert.equal(lines[0], "device: cuda:0");
  assert.ok(lines.some((line) => line.includes("5.04 s at 24000 Hz")), lines.join("\n"));
});

test("the plan query carries each Load LoRA on the pipeline's path, the loader's side first, and counts Train LoRA nodes", async () => {
  const { loraFields, loraLines, pipelineLoader } = await import("../../web/js/vidmem_format.js");
  const node = (type, up = null, widgets = {}) => ({ comfyClass: type, up, widgets });
  const upstream = (n) => n.up;
  const value = (n, name) => n.widgets[name];
  const loader = node("VidMemLoadPipeline", null, { model: "Wan2.1", dtype: "bf16" });
  const style = node("VidMemLoadLoRA", loader, { lora_name: "style.safetensors", strength: 0.8, expert: "both" });
  const trained = node("VidMemTrainLoRA", style, { lora_name: "mine", rank: 16 });
  const distill = node("VidMemLoadLoRA", trained, { lora_name: "lightx2v.safetensors", strength: 1, expert: "high_noise" });
  assert.equal(pipelineLoader(distill, upstream), loader);
  const fields = loraFields(distill, upstream, value);
  assert.deepEqual(fields, { lora0_lora_name: "style.safetensors", lora0_strength: 0.8, lora0_expert: "both",
    lora1_lora_name: "lightx2v.safetensors", lora1_strength: 1, lora1_expert: "high_noise", trained_loras: 1 });
  const shape = { width: 832, height: 480, frames: 81 };
  const query = new URLSearchParams(planQuery({ model: "Wan2.1", widgets: {}, shape, extra: fields }));
  assert.equal(query.get("lora0_lora_name"), "style.safetensors");
  assert.equal(query.get("lora0_strength"), "0.8");
  assert.equal(query.get("lora1_expert"), "high_noise");
  assert.equal(query.get("trained_loras"), "1");
  const zero = loraFields(node("VidMemLoadLoRA", loader, { lora_name: "style.safetensors", strength: 0, expert: "both" }), upstream, value);
  assert.equal(new URLSearchParams(planQuery({ model: "Wan2.1", widgets: {}, shape, extra: zero })).get("lora0_strength"), "0");
  // A graph without LoRAs sends no LoRA field: the query string is the one it sent before.
  assert.deepEqual(loraFields(loader, upstream, value), {});
  assert.deepEqual(loraFields(null, upstream, value), {});
  const before = planQuery({ model: "Wan2.1", dtype: "bf16", widgets: { offload: "auto" }, shape, client: 3 });
  assert.equal(planQuery({ model: "Wan2.1", dtype: "bf16", widgets: { offload: "auto" }, shape, client: 3,
    extra: loraFields(loader, upstream, value) }), before);
  assert.equal(before, "model=Wan2.1&dtype=bf16&offload=auto&width=832&height=480&frames=81&client=3");
  assert.deepEqual(loraLines({ status: "ok", loras: ["LoRAs: 1 counted"] }), ["LoRAs: 1 counted"]);
  assert.deepEqual(loraLines({ status: "ok" }), []);
  assert.deepEqual(loraLines({ status: "error", loras: ["x"] }), []);
});

test("a bypassed Load LoRA passes the pipeline on and holds nothing; a muted node on the path sends no plan", async () => {
  const { loraFields, pipelineLoader, MODE_BYPASSED, MODE_MUTED } = await import("../../web/js/vidmem_format.js");
  const node = (type, up = null, widgets = {}, mode = 0) => ({ comfyClass: type, up, widgets, mode });
  const upstream = (n) => n.up;
  const value = (n, name) => n.widgets[name];
  const loader = node("VidMemLoadPipeline", null, { model: "Wan2.1", dtype: "bf16" });
  const first = node("VidMemLoadLoRA", loader, { lora_name: "style.safetensors", strength: 0.8, expert: "both" });
  const off = node("VidMemLoadLoRA", first, { lora_name: "off.safetensors", strength: 1, expert: "both" }, MODE_BYPASSED);
  const offTrain = node("VidMemTrainLoRA", off, { lora_name: "mine", rank: 16 }, MODE_BYPASSED);
  const last = node("VidMemLoadLoRA", offTrain, { lora_name: "lightx2v.safetensors", strength: 1, expert: "high_noise" });
  assert.equal(pipelineLoader(last, upstream), loader); // the bypassed nodes hand the loader's pipeline through
  assert.deepEqual(loraFields(last, upstream, value), { lora0_lora_name: "style.safetensors", lora0_strength: 0.8,
    lora0_expert: "both", lora1_lora_name: "lightx2v.safetensors", lora1_strength: 1, lora1_expert: "high_noise" });
  assert.deepEqual(loraFields(off, upstream, value), { lora0_lora_name: "style.safetensors", lora0_strength: 0.8,
    lora0_expert: "both" });
  // A muted node on the path: the Sampler's required pipeline goes missing and the prompt cannot run.
  const muted = node("VidMemLoadLoRA", first, { lora_name: "off.safetensors", strength: 1, expert: "both" }, MODE_MUTED);
  const after = node("VidMemLoadLoRA", muted, { lora_name: "lightx2v.safetensors", strength: 1, expert: "both" });
  assert.equal(pipelineLoader(after, upstream), null);
  assert.deepEqual(loraFields(after, upstream, value), {});
  // A loader muted or bypassed passes no pipeline on (it has no pipeline input).
  for (const mode of [MODE_MUTED, MODE_BYPASSED]) {
    const gone = node("VidMemLoadPipeline", null, { model: "Wan2.1", dtype: "bf16" }, mode);
    assert.equal(pipelineLoader(node("VidMemLoadLoRA", gone), upstream), null);
    assert.equal(pipelineLoader(gone, upstream), null);
  }
});

test("the plan follows the Sampler's pipeline, not the Strategy's old pipeline input", async () => {
  const { loraFields, pipelineLoader, pipelineStart } = await import("../../web/js/vidmem_format.js");
  const node = (type, up = null, widgets = {}) => ({ comfyClass: type, up, widgets });
  const upstream = (n) => n.up;
  const value = (n, name) => n.widgets[name];
  const loader = node("VidMemLoadPipeline", null, { model: "Wan2.1", dtype: "bf16" });
  const lora = node("VidMemLoadLoRA", loader, { lora_name: "style.safetensors", strength: 1, expert: "both" });
  const sampler = node("VidMemSampler", lora);
  const oldStrategy = node("VidMemStrategy", loader); // an old workflow: the Strategy's pipeline from the loader itself
  const start = pipelineStart(oldStrategy, sampler, upstream);
  assert.equal(start, lora);
  assert.equal(pipelineLoader(start, upstream), loader);
  assert.deepEqual(loraFields(start, upstream, value), { lora0_lora_name: "style.safetensors", lora0_strength: 1,
    lora0_expert: "both" });
  // The Strategy's pipeline from another loader: the Sampler runs its own pipeline's model.
  const other = node("VidMemLoadPipeline", null, { model: "CogVideoX", dtype: "bf16" });
  assert.equal(pipelineLoader(pipelineStart(node("VidMemStrategy", other), sampler, upstream), upstream), loader);
  // While the Sampler's pipeline is not connected yet, the Strategy's still shows a plan; neither: none.
  assert.equal(pipelineStart(oldStrategy, node("VidMemSampler"), upstream), loader);
  assert.equal(pipelineStart(node("VidMemStrategy"), node("VidMemSampler"), upstream), null);
});

test("without a plan, the chart names the node that stops the pipeline and what to do", async () => {
  const { pipelineGap, pipelineLoader, MODE_BYPASSED, MODE_MUTED } = await import("../../web/js/vidmem_format.js");
  const node = (type, up = null, mode = 0, title = undefined) => ({ comfyClass: type, up, mode, title });
  const upstream = (n) => n.up;
  const loader = node("VidMemLoadPipeline", null, 0, "Load Video Pipeline (VidMem)");
  const lora = node("VidMemLoadLoRA", loader, 0, "style LoRA");
  assert.equal(pipelineGap(lora, upstream), null);
  assert.equal(pipelineLoader(lora, upstream), loader);
  assert.match(pipelineGap(null, upstream), /connect the Sampler's pipeline to a vidmem loader/);
  const muted = node("VidMemLoadLoRA", loader, MODE_MUTED, "style LoRA");
  assert.equal(pipelineGap(node("VidMemLoadLoRA", muted), upstream),
    "\"style LoRA\" is muted, so no pipeline reaches the Sampler and the prompt cannot run: unmute it " +
    "(or bypass it: a bypassed one passes the pipeline on)");
  // A muted loader: bypassing would not help (it has no pipeline input), so only unmuting is offered.
  assert.match(pipelineGap(node("VidMemLoadPipeline", null, MODE_MUTED), upstream), /"VidMemLoadPipeline" is muted.*unmute it$/);
  assert.match(pipelineGap(node("VidMemLoadModelFiles", null, MODE_BYPASSED), upstream),
    /"VidMemLoadModelFiles" is bypassed, so nothing loads the model.*set it back to Always/);
  assert.match(pipelineGap(node("VidMemLoadLoRA", node("SomethingElse", loader, 0, "Other")), upstream),
    /comes from "Other", which the plan cannot read/);
  assert.match(pipelineGap(node("VidMemLoadLoRA", null, 0, "dangling LoRA"), upstream), /connect "dangling LoRA"'s pipeline input/);
  const loop = node("VidMemLoadLoRA");
  loop.up = node("VidMemLoadLoRA", loop);
  assert.match(pipelineGap(loop, upstream), /loop/);
});

test("the plan reads through Reroute nodes, as the run does", async () => {
  const { throughReroutes } = await import("../../web/js/vidmem_format.js");
  const node = (type, up = null) => ({ comfyClass: type, up });
  const firstInput = (n) => n.up;
  const loader = node("VidMemLoadPipeline");
  assert.equal(throughReroutes(node("Reroute", node("Reroute", loader)), firstInput), loader);
  assert.equal(throughReroutes(loader, firstInput), loader);
  assert.equal(throughReroutes(null, firstInput), null);
  const dangling = node("Reroute");
  assert.equal(throughReroutes(dangling, firstInput), dangling);
  const a = node("Reroute");
  a.up = node("Reroute", a);
  assert.equal(throughReroutes(a, firstInput).comfyClass, "Reroute"); // a loop ends, on a Reroute
});

test("a Reroute left unconnected on the pipeline is named; the Sampler is found through Reroutes on the Strategy's output", async () => {
  const { outputsThroughReroutes, pipelineGap, throughReroutes } = await import("../../web/js/vidmem_format.js");
  const node = (type, up = null, title = undefined) => ({ comfyClass: type, up, title, out: [] });
  const dangling = node("Reroute", null, "");
  const start = throughReroutes(node("Reroute", dangling), (n) => n.up);
  assert.equal(start, dangling);
  assert.match(pipelineGap(node("VidMemLoadLoRA", start), (n) => n.up), /connect "Reroute"'s input to a vidmem loader/);
  const sampler = node("VidMemVideoSampler");
  const other = node("PreviewAny");
  const first = node("Reroute");
  const second = node("Reroute");
  first.out = [second, other];
  second.out = [sampler, first]; // a loop back ends
  assert.deepEqual(outputsThroughReroutes([first], (n) => n.out), [other, sampler]);
  assert.deepEqual(outputsThroughReroutes([sampler], (n) => n.out), [sampler]);
});


test("a muted or bypassed Step Cache or Speed node is not planned: the run gets neither", async () => {
  const { extraFields, MODE_MUTED, MODE_BYPASSED } = await import("../../web/js/vidmem_format.js");
  const value = () => "mag_cache";
  assert.ok(Object.keys(extraFields("cache", { comfyClass: "VidMemStepCache" }, value)).length > 0);
  for (const mode of [MODE_MUTED, MODE_BYPASSED]) {
    assert.deepEqual(extraFields("cache", { comfyClass: "VidMemStepCache", mode }, value), {});
    assert.deepEqual(extraFields("speed", { comfyClass: "VidMemSpeed", mode }, value), {});
  }
});

test("Load Video Pipeline's path is named as what the plan cannot follow", async () => {
  const { loaderGap } = await import("../../web/js/vidmem_format.js");
  const folder = { comfyClass: "VidMemLoadPipeline", title: "Load Video Pipeline (VidMem)" };
  assert.equal(loaderGap(folder, (name) => ({ path: "" })[name]), null);
  assert.equal(loaderGap(folder, (name) => ({ path: "  " })[name]), null);
  assert.match(loaderGap(folder, (name) => ({ path: "/data/Wan2.1" })[name]),
    /loads its path, which the plan does not read .* with path empty/);
  assert.equal(loaderGap({ comfyClass: "VidMemLoadModelFiles" }, () => "x"), null);
});

test("widgets fed by a link are named; a Primitive node's copied value is read as it is", async () => {
  const { linkedWidgets } = await import("../../web/js/vidmem_format.js");
  const sampler = { inputs: [{ name: "pipeline", link: 1 }, { name: "frames", link: 7, widget: { name: "frames" } },
    { name: "steps", link: 8, widget: { name: "steps" } }, { name: "cfg", link: null, widget: { name: "cfg" } }] };
  const sources = { 0: { type: "VidMemLoadPipeline" }, 1: { type: "PrimitiveInt" }, 2: { type: "PrimitiveNode" } };
  assert.deepEqual(linkedWidgets(sampler, ["frames", "steps", "cfg"], (slot) => sources[slot]), ["frames"]);
  assert.deepEqual(linkedWidgets(sampler, ["cfg"], (slot) => sources[slot]), []);
});

test("the Sampler's cfg_2 is sent: Wan 2.2 A14B's low-noise expert keeps the negative pass", async () => {
  const { SAMPLER_SHAPE, planQuery } = await import("../../web/js/vidmem_format.js");
  assert.ok(SAMPLER_SHAPE.includes("cfg_2"));
  const query = new URLSearchParams(planQuery({ model: "m", dtype: "bf16", widgets: {},
    shape: { width: 32, height: 32, frames: 9, cfg: 1, cfg_2: 3.5 } }));
  assert.equal(query.get("cfg_2"), "3.5");
});
