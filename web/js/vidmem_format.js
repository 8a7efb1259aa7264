// Pure helpers for the vidmem web extension: bytes, receipts and the memory meter as text.
// No DOM and no ComfyUI imports, so Node's test runner checks them (tests/js/).

export const NODE_TYPES = Object.freeze([
  "VidMemLoadPipeline",
  "VidMemMemoryStrategy",
  "VidMemVideoSampler",
  "VidMemVAEDecode",
  "VidMemFreeVRAM",
]);
export const MEMORY_ROUTE = "/vidmem/memory";
// ComfyUI's own POST /free body: unload its models and free cached memory between prompts.
export const FREE_BODY = Object.freeze({ unload_models: true, free_memory: true });

const UNITS = [["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];

/** Bytes as receipts show them (same rule as nodes/receipts.py human_bytes). */
export function formatBytes(n) {
  if (n === null || n === undefined || !Number.isFinite(n)) return "n/a";
  for (const [unit, size] of UNITS) {
    if (Math.abs(n) >= size) return `${(n / size).toFixed(2)} ${unit}`;
  }
  return `${n} B`;
}

export function formatSeconds(s) {
  if (!Number.isFinite(s)) return "n/a";
  return s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(2)} s`;
}

export function formatPercent(fraction) {
  return Number.isFinite(fraction) ? `${(fraction * 100).toFixed(1)}%` : "n/a";
}

/** The first structured receipt a node sent (`ui.vidmem_receipt`), or null. */
export function receiptFrom(message) {
  const receipt = message?.vidmem_receipt?.[0];
  return receipt && typeof receipt === "object" ? receipt : null;
}

/** The node's text output (`ui.text`) joined, or "". */
export function textFrom(message) {
  return Array.isArray(message?.text) ? message.text.join("\n") : "";
}

/** "offload=block_swap blocks_to_swap=20 vae_slicing" -> {offload: "block_swap", blocks_to_swap: "20", vae_slicing: true}. */
export function parseStrategyText(text) {
  const fields = {};
  for (const token of String(text ?? "").trim().split(/\s+/).filter(Boolean)) {
    const at = token.indexOf("=");
    if (at < 0) fields[token] = true;
    else fields[token.slice(0, at)] = token.slice(at + 1);
  }
  return fields;
}

/** Strategy text as short lines: the tier first, then what it streams, then the rest. */
export function strategyLines(text) {
  const fields = parseStrategyText(text);
  const lines = [];
  if (fields.offload) {
    const blocks = fields.blocks_to_swap ? `, ${fields.blocks_to_swap} blocks streamed` : "";
    const prefetch = fields.prefetch !== undefined ? `, prefetch ${fields.prefetch}` : "";
    lines.push(`tier: ${fields.offload}${blocks}${prefetch}`);
  }
  if (fields.text_encoder) lines.push(`text encoder: ${fields.text_encoder}`);
  if (fields.vae_tiling) lines.push(`VAE tiles: ${fields.vae_tiling}`);
  if (fields.vae_slicing) lines.push("VAE slicing: on");
  return lines;
}

/** Stage lines and totals of a sampler or decode receipt (pipelines/sample.py, decode.py). */
export function runLines(receipt) {
  const lines = [];
  const stages = Array.isArray(receipt.stages) ? receipt.stages : [];
  for (const stage of stages) {
    const vram = stage.peak_allocated_bytes !== undefined ? `peak VRAM ${formatBytes(stage.peak_allocated_bytes)}, ` : "";
    lines.push(`${stage.stage}: ${formatSeconds(stage.seconds)}, ${vram}peak RSS ${formatBytes(stage.peak_rss_bytes)}`);
  }
  if (stages.length > 1) {
    const total = stages.reduce((sum, s) => sum + (Number(s.seconds) || 0), 0);
    lines.push(`total: ${formatSeconds(total)}`);
  }
  if (receipt.swap) lines.push(swapLine(receipt.swap));
  if (receipt.decode) lines.push(decodeLine(receipt.decode));
  return lines;
}

export function swapLine(swap) {
  return `swap cost: ${formatPercent(swap.swap_cost)} of denoise time (${formatBytes(swap.bytes_moved)} moved, ` +
    `waited ${formatSeconds(swap.wait_s)}, ${swap.groups} streamed groups)`;
}

export function decodeLine(decode) {
  const tiled = decode.tiles > 1;
  const shared = decode.shared_context && tiled ? ", attention shared by the tiles" : "";
  const streamed = decode.streamed && decode.chunks > 1 ? ", exact chunks" : "";
  const calls = `${decode.decode_calls} call${decode.decode_calls === 1 ? "" : "s"}`;
  const fallbacks = decode.fallbacks?.length ? `; fell back: ${decode.fallbacks.join("; ")}` : "";
  return `VAE: ${decode.mode}, ${decode.tiles} tiles x ${decode.chunks} chunks${shared}${streamed}, ${calls}${fallbacks}`;
}

/** Free VRAM's before -> after figures (nodes/free.py). */
export function freeLines(report) {
  const lines = [];
  for (const key of Object.keys(report.before ?? {})) {
    lines.push(`${key.replace(/_bytes$/, "")}: ${formatBytes(report.before[key])} -> ${formatBytes(report.after?.[key])}`);
  }
  lines.push(`gc collected ${report.collected_objects ?? 0} objects; ComfyUI models unloaded: ${report.comfy_models_unloaded ? "yes" : "no"}`);
  return lines;
}

/** Any other receipt fields (e.g. a planner's prediction) as "key: value", byte counts formatted. */
export function extraLines(receipt, known) {
  const lines = [];
  for (const [key, value] of Object.entries(receipt)) {
    if (known.has(key) || value === null || typeof value === "object") continue;
    const shown = /_bytes$/.test(key) && typeof value === "number" ? formatBytes(value) : String(value);
    lines.push(`${key.replace(/_bytes$/, "").replaceAll("_", " ")}: ${shown}`);
  }
  return lines;
}

const RUN_KEYS = new Set(["strategy", "device", "stages", "swap", "decode", "decode_summary"]);
const TITLES = {
  VidMemMemoryStrategy: "plan",
  VidMemVideoSampler: "sampler receipt",
  VidMemVAEDecode: "decode receipt",
  VidMemFreeVRAM: "freed",
};

/** What to show on a node after it ran: {title, lines}; lines is empty when there is nothing. */
export function summarize(nodeType, message) {
  const receipt = receiptFrom(message);
  const text = textFrom(message);
  const title = TITLES[nodeType] ?? "vidmem";
  if (nodeType === "VidMemFreeVRAM" && receipt) return { title, lines: freeLines(receipt) };
  if (nodeType === "VidMemMemoryStrategy") {
    const lines = strategyLines(receipt?.strategy ?? text.split("\n")[0]);
    return { title, lines: receipt ? [...lines, ...extraLines(receipt, RUN_KEYS)] : lines };
  }
  if (receipt && receipt.stages) {
    const head = receipt.device ? [`device: ${receipt.device}`] : [];
    return { title, lines: [...head, ...runLines(receipt), ...extraLines(receipt, RUN_KEYS)] };
  }
  return { title, lines: text ? text.split("\n").filter((line) => !line.startsWith("{")) : [] };
}

/** The meter: {text, detail, level} from GET /vidmem/memory; level is ok | high | full. */
export function meterText(memory) {
  const parts = [];
  const details = [];
  let worst = 0;
  for (const device of memory?.cuda ?? []) {
    const total = device.total_bytes;
    const used = device.free_bytes === null || device.free_bytes === undefined ? null : total - device.free_bytes;
    if (used !== null && total) worst = Math.max(worst, used / total);
    parts.push(`GPU${device.index} ${used === null ? "?" : formatBytes(used)} / ${formatBytes(total)}`);
    details.push(`GPU${device.index}: allocated ${formatBytes(device.allocated_bytes)}, reserved ${formatBytes(device.reserved_bytes)}, ` +
      `free ${formatBytes(device.free_bytes)} of ${formatBytes(total)}`);
  }
  if (!parts.length) parts.push("no GPU in use");
  const ram = memory?.ram;
  if (ram?.total_bytes) {
    const used = ram.total_bytes - ram.available_bytes;
    worst = Math.max(worst, used / ram.total_bytes);
    parts.push(`RAM ${formatBytes(used)} / ${formatBytes(ram.total_bytes)}`);
    details.push(`RAM: ${formatBytes(ram.available_bytes)} available of ${formatBytes(ram.total_bytes)}`);
  }
  if (memory?.process_rss_bytes !== undefined) details.push(`ComfyUI process RSS: ${formatBytes(memory.process_rss_bytes)}`);
  const level = worst >= 0.9 ? "full" : worst >= 0.75 ? "high" : "ok";
  return { text: parts.join(" | "), detail: details.join("\n"), level };
}
