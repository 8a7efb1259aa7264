// Run with: node --test tests/js/
import assert from "node:assert/strict";
import { test } from "node:test";

import {
  FREE_BODY, MEMORY_ROUTE, NODE_TYPES, extraLines, formatBytes, formatPercent, formatSeconds, meterText,
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
  assert.deepEqual(lines, ["device: cpu", "decode: 518 ms, peak RSS 421.35 MiB", "VAE: tiled, 6 tiles x 2 chunks, 12 calls"]);
  const fell = summarize("VidMemVAEDecode", { vidmem_receipt: [{ ...DECODE, decode: { ...DECODE.decode, fallbacks: ["whole", "tiled"] } }] });
  assert.match(fell.lines.at(-1), /fell back: whole; tiled$/);
  const wan = summarize("VidMemVAEDecode", { vidmem_receipt: [{ ...DECODE, decode: { ...DECODE.decode, shared_context: true, streamed: true } }] });
  assert.equal(wan.lines.at(-1), "VAE: tiled, 6 tiles x 2 chunks, attention shared by the tiles, exact chunks, 12 calls");
  const whole = { ...DECODE.decode, mode: "whole", tiles: 1, chunks: 1, decode_calls: 1, shared_context: true, streamed: true };
  assert.equal(summarize("VidMemVAEDecode", { vidmem_receipt: [{ ...DECODE, decode: whole }] }).lines.at(-1),
    "VAE: whole, 1 tiles x 1 chunks, 1 call");
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
  assert.deepEqual([...NODE_TYPES].sort(), ["VidMemFreeVRAM", "VidMemLoadPipeline", "VidMemMemoryStrategy",
                                            "VidMemVAEDecode", "VidMemVideoSampler"]);
});
