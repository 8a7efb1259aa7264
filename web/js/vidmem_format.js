// Pure helpers for the vidmem web extension: bytes, receipts and the memory meter as text.
// No DOM and no ComfyUI imports, so Node's test runner checks them (tests/js/).

export const NODE_TYPES = Object.freeze([
  "VidMemLoadPipeline",
  "VidMemMemoryStrategy",
  "VidMemVideoSampler",
  "VidMemVAEDecode",
  "VidMemDecodeAudio",
  "VidMemFreeVRAM",
  "VidMemLoadLoRA",
  "VidMemPrepareTrainingData",
  "VidMemTrainLoRA",
]);
export const MEMORY_ROUTE = "/vidmem/memory";
export const PLAN_ROUTE = "/vidmem/plan";
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

/** The last part of a path, "/" or "\\" separated. */
export function baseName(path) {
  return String(path).split(/[\\/]/).pop();
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
    const seconds = promptCached(receipt, stage) ? "prompt from the cache" : formatSeconds(stage.seconds);
    lines.push(`${stage.stage}: ${seconds}, ${vram}peak RSS ${formatBytes(stage.peak_rss_bytes)}`);
  }
  if (stages.length > 1) {
    const total = stages.reduce((sum, s) => sum + (Number(s.seconds) || 0), 0);
    lines.push(`total: ${formatSeconds(total)}`);
  }
  if (receipt.swap) lines.push(swapLine(receipt.swap));
  if (receipt.cache) lines.push(cacheLine(receipt.cache));
  if (receipt.decode) lines.push(decodeLine(receipt.decode));
  return lines;
}

/** Whether `stage` is a text encode the prompt cache answered: nothing was encoded ("0 ms" read as if the encoder
 * had run at no cost). */
function promptCached(receipt, stage) {
  return stage.stage === "text_encode" && receipt.text_encode?.cache === "used";
}

/** A Step Cache's work, as nodes/receipts.py cache_line says it: blocks computed of all, copies saved. */
export function cacheLine(cache) {
  const total = (cache.blocks_computed ?? 0) + (cache.blocks_skipped ?? 0);
  let line = `step cache ${cache.method}: ${cache.blocks_computed} of ${total} blocks computed ` +
    `(${formatPercent(cache.blocks_computed_share)})`;
  if (cache.streamed_copies_skipped) line += `, ${cache.streamed_copies_skipped} streamed copies saved`;
  if (cache.ratios_file) line += `; ratios saved as ${cache.ratios_file} (pick it in Step Cache's mag_ratios)`;
  if (cache.note) line += ` (${cache.note})`;
  return line;
}

export function swapLine(swap) {
  return `swap cost: ${formatPercent(swap.swap_cost)} of denoise time (${formatBytes(swap.bytes_moved)} moved, ` +
    `waited ${formatSeconds(swap.wait_s)}, ${swap.groups} streamed groups)`;
}

/** "1 tile x 2 chunks": the decode's pieces, each count with its own plural. */
function piecesText(decode) {
  const count = (n, word) => `${n} ${word}${n === 1 ? "" : "s"}`;
  return `${count(decode.tiles, "tile")} x ${count(decode.chunks, "chunk")}`;
}

export function decodeLine(decode) {
  const tiled = decode.tiles > 1;
  const shared = decode.shared_context && tiled ? ", attention shared by the tiles" : "";
  const streamed = decode.streamed && decode.chunks > 1 ? ", exact chunks" : "";
  const calls = `${decode.decode_calls} call${decode.decode_calls === 1 ? "" : "s"}`;
  const fallbacks = decode.fallbacks?.length ? `; fell back: ${decode.fallbacks.join("; ")}` : "";
  return `VAE: ${decode.mode}, ${piecesText(decode)}${shared}${streamed}, ${calls}${fallbacks}`;
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
  VidMemDecodeAudio: "audio receipt",
  VidMemFreeVRAM: "freed",
  VidMemLoadLoRA: "LoRA",
  VidMemPrepareTrainingData: "training data",
  VidMemTrainLoRA: "training receipt",
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
    // The Decode's strategy line says how the VAE ran (placement, tiling, slicing: pipelines/decode.py decode_as_run);
    // the Sampler's plan line already says how its run was set.
    if (nodeType === "VidMemVAEDecode" && receipt.strategy) head.push(`strategy: ${receipt.strategy}`);
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

// --- the live plan on the Memory Strategy node (GET /vidmem/plan, nodes/plan_route.py) ------------

// The Strategy's widgets in INPUT_TYPES order, then its budgets (nodes/strategy.py).
export const STRATEGY_WIDGETS = Object.freeze([
  "offload", "blocks_to_swap", "prefetch_blocks", "max_pinned_ram_gb", "non_blocking", "text_encoder",
  "vae_slicing", "vae_tiling", "tile_size", "overlap", "temporal_size", "temporal_overlap",
]);
export const STRATEGY_BUDGETS = Object.freeze(["vram_budget_gb", "ram_budget_gb"]);
// Optional Strategy inputs the plan reads besides the budgets (nodes/strategy.py; the last input, after gpus
// and context_parallel).
export const STRATEGY_OPTIONS = Object.freeze(["activation_chunks"]);
// The Strategy's GPUs and how they share the run: two or more plan per GPU (nodes/plan_route_parallel.py).
export const STRATEGY_PARALLEL = Object.freeze(["gpus", "context_parallel"]);

/** The Strategy widgets its offload tier ignores (greyed out on the node; nodes/strategy.py notes them). */
export function ignoredStrategyWidgets(offload, vaeTiling) {
  const ignored = [];
  if (offload !== "block_swap") ignored.push("blocks_to_swap"); // auto chooses the blocks itself
  if (offload === "none" || offload === "model") ignored.push("prefetch_blocks"); // nothing streams
  if (!vaeTiling && offload !== "auto") ignored.push("tile_size", "overlap", "temporal_size", "temporal_overlap");
  return ignored;
}
// Older Strategy nodes had their own width/height/frames between the widgets and the budgets.
const LEGACY_STRATEGY_ORDER = [...STRATEGY_WIDGETS, "width", "height", "frames", ...STRATEGY_BUDGETS];
export const STAGES = Object.freeze([["text_encode", "encode"], ["denoise", "denoise"], ["decode", "decode"]]);

/** The chart's stage headers for panels `chars` characters wide: the names, or where one would run into the next
 * panel's (long row labels such as "block_swap 30 chunks 16" leave narrow panels) their first three letters. */
export function stageHeaders(chars) {
  const fits = STAGES.every(([, label]) => label.length <= chars);
  return STAGES.map(([, label]) => (fits ? label : label.slice(0, 3)));
}

/** Widget values of an older Strategy node by name, or null when `values` is already the current layout. */
export function legacyStrategyValues(values) {
  if (!Array.isArray(values) || values.length !== LEGACY_STRATEGY_ORDER.length) return null;
  // Today's layout has 17 values too (widgets, budgets, gpus, context_parallel, activation_chunks): where an
  // older node has frames, a number, today's has gpus, text.
  if (typeof values[STRATEGY_WIDGETS.length + 2] !== "number") return null;
  return Object.fromEntries(LEGACY_STRATEGY_ORDER.map((name, i) => [name, values[i]]));
}

/** The GET /vidmem/plan query string, or null when the graph does not say enough yet. */
// Nodes that pass a pipeline through unchanged in shape and storage (LoRAs are added on top).
export const PIPELINE_PASS_THROUGH = ["VidMemLoadLoRA", "VidMemTrainLoRA"];
export const PIPELINE_LOADERS = ["VidMemLoadPipeline", "VidMemLoadModelFiles"];
// The Load Video Model Files widgets the plan needs: its files, precisions and the disk tier.
export const FILES_LOADER_WIDGETS = ["model", "model_2", "text_encoder", "vae", "clip_vision", "dtype", "vae_dtype",
  "weight_dtype", "weights_on_disk"];

export const LOADER_PREFIX = "loader_";
// The Sampler's widgets the plan reads: its shape, and its context window (window, window_overlap in
// video frames; 0: off), sent only where the Sampler has them (nodes/plan_route.py checks them as it does).
// cfg_2: Wan 2.2 A14B's low-noise expert's guidance, which keeps the negative prompt's pass as cfg does.
export const SAMPLER_SHAPE = Object.freeze(["width", "height", "frames", "cfg", "cfg_2", "steps", "window", "window_overlap"]);
// Nodes on the Sampler's cache and speed inputs: the plan says what they will do (nodes/plan_route.py).
export const SAMPLER_EXTRAS = Object.freeze({
  cache: { node: "VidMemStepCache", prefix: "cache_", widgets: ["method", "threshold", "retention", "max_skip_steps", "mag_ratios",
    "interval", "warmup_steps", "end_steps", "order"] },
  speed: { node: "VidMemSpeed", prefix: "speed_", widgets: ["attention", "compile", "compile_mode", "compile_dynamic", "fp8_matmul"] },
});

const typeOf = (node) => node?.comfyClass ?? node?.type;

// LiteGraph's node modes: a muted node does not run, and what it feeds gets no input (the Sampler's required
// pipeline goes missing: the prompt cannot run); a bypassed one hands its input of the same type through unchanged.
export const MODE_MUTED = 2;
export const MODE_BYPASSED = 4;

/** Where the plan walks the pipeline from: the Sampler's own `pipeline` input, as the run reads it; the
 * Strategy's (not needed, kept so old workflows load) only while the Sampler's is not connected. */
export function pipelineStart(strategy, sampler, upstream) {
  return upstream(sampler) ?? upstream(strategy);
}

/** The loader a pipeline comes from: follow `upstream(node)` (the node on its `pipeline` input)
 * through any number of Load LoRA / Train LoRA nodes, bypassed ones too (they pass the pipeline on);
 * null when unconnected, a loop, another node, or a muted node or bypassed loader on the way (no pipeline arrives). */
export function pipelineLoader(start, upstream) {
  return pipelineSource(start, upstream).loader;
}

/** Why no plan can be made from `start` (see pipelineLoader), as the chart's line names it: which node
 * stops the pipeline and what to do; null when a loader is found. */
export function pipelineGap(start, upstream) {
  return pipelineSource(start, upstream).gap;
}

const nodeName = (node) => `"${node.title || typeOf(node)}"`;

/** Both answers of one walk from `start`: {loader, gap}, one of them null (pipelineLoader, pipelineGap). */
export function pipelineSource(start, upstream) {
  const seen = new Set();
  let last = null;
  for (let node = start; node; last = node, node = upstream(node)) {
    if (seen.has(node)) return { loader: null, gap: "the pipeline's links go round in a loop: connect a loader at its start" };
    seen.add(node);
    const type = typeOf(node);
    if (node.mode === MODE_MUTED) {
      const bypass = PIPELINE_PASS_THROUGH.includes(type) ? " (or bypass it: a bypassed one passes the pipeline on)" : "";
      return { loader: null, gap: `${nodeName(node)} is muted, so no pipeline reaches the Sampler and the prompt cannot run: unmute it${bypass}` };
    }
    if (PIPELINE_LOADERS.includes(type)) {
      if (node.mode !== MODE_BYPASSED) return { loader: node, gap: null };
      return { loader: null, gap: `${nodeName(node)} is bypassed, so nothing loads the model and the prompt cannot run: set it back to Always` };
    }
    if (type === REROUTE) { // throughReroutes stopped here: nothing on its input, or a loop of Reroutes
      return { loader: null, gap: `connect ${nodeName(node)}'s input to a vidmem loader (its links may go round in a loop)` };
    }
    if (!PIPELINE_PASS_THROUGH.includes(type)) {
      return { loader: null, gap: `the Sampler's pipeline comes from ${nodeName(node)}, which the plan cannot read: connect it from a vidmem loader, through Load LoRA / Train LoRA if any` };
    }
  }
  if (!last) return { loader: null, gap: "connect the Sampler's pipeline to a vidmem loader (Load Video Pipeline or Load Video Model Files)" };
  return { loader: null, gap: `connect ${nodeName(last)}'s pipeline input to a vidmem loader` };
}

// ComfyUI's Reroute node lives in the browser only (left out of the prompt): the run reads through it, so does the plan.
export const REROUTE = "Reroute";

/** The nodes `nodes` lead to with Reroute nodes read through (`outputsOf(reroute)`: the nodes on its output),
 * each once; a loop of Reroutes ends. */
export function outputsThroughReroutes(nodes, outputsOf) {
  const found = [];
  const seen = new Set();
  const queue = [...nodes];
  while (queue.length) {
    const node = queue.shift();
    if (!node || seen.has(node)) continue;
    seen.add(node);
    if (typeOf(node) === REROUTE) queue.push(...(outputsOf(node) ?? []));
    else found.push(node);
  }
  return found;
}

// The Sampler's widgets whose product its memory grows with.
const SIZE_WIDGETS = Object.freeze(["width", "height", "frames"]);

/** The Sampler the plan is for, among the `samplers` one Strategy feeds (a draft and a final pass, say): the one
 * with the largest width*height*frames, the worst case the budgets must hold (ties: the first). `value(sampler,
 * name)` reads a widget. A Sampler whose size comes from a link (`sourceOf(sampler, slot)`, as in linkedWidgets)
 * cannot be compared before the run: it is taken, so the chart says that link is in the way rather than plan a
 * smaller pass. Muted and bypassed Samplers are left out while another runs. Returns {sampler (null for none), line:
 * what the chart says about the choice, "" for one Sampler}. */
export function plannedSampler(samplers, value, sourceOf = () => null) {
  // A muted or bypassed Sampler runs nothing, so holds no memory: the running ones are compared (all, if none runs,
  // so the chart still names one).
  const running = samplers.filter((n) => n.mode !== MODE_MUTED && n.mode !== MODE_BYPASSED);
  samplers = running.length ? running : samplers;
  let sampler = null, largest = -1, linked = false;
  for (const candidate of samplers) {
    const fromLink = linkedWidgets(candidate, SIZE_WIDGETS, (slot) => sourceOf(candidate, slot)).length > 0;
    const size = fromLink ? Infinity : SIZE_WIDGETS.reduce((product, name) => product * (Number(value(candidate, name)) || 0), 1);
    if (size > largest) [sampler, largest, linked] = [candidate, size, fromLink];
  }
  if (samplers.length < 2) return { sampler, line: "" };
  const which = linked ? `its size comes from a link, so it cannot be compared with the other ${samplers.length - 1}`
    : `the largest of ${samplers.length} this Strategy feeds`;
  // Copies of a Sampler keep its title: its node number and size say which one is planned.
  const id = sampler.id !== undefined ? ` #${sampler.id}` : "";
  const at = linked ? "" : ` at ${SIZE_WIDGETS.map((name) => value(sampler, name)).join("x")}`;
  return { sampler, line: `plans Sampler ${nodeName(sampler)}${id}${at} (${which}); give each Sampler its own Strategy to plan each` };
}

/** `node`, or the node that feeds it through any chain of Reroute nodes (`firstInput(reroute)`: the node on
 * its one input); a Reroute left dangling, or in a loop of Reroutes, is returned as it is. */
export function throughReroutes(node, firstInput) {
  const seen = new Set();
  while (node && typeOf(node) === REROUTE && !seen.has(node)) {
    seen.add(node);
    const next = firstInput(node);
    if (!next) return node;
    node = next;
  }
  return node ?? null;
}

// Load LoRA's widgets the plan reads, sent as lora<i>_<widget> from the loader down (nodes/plan_loras.py).
export const LORA_NODE = "VidMemLoadLoRA";
export const LORA_WIDGETS = Object.freeze(["lora_name", "strength", "expert"]);

/** The plan query's LoRA fields: each Load LoRA between `start` and the loader, in the order the run applies
 * them (the loader's side first), and how many Train LoRA nodes are there (their LoRA is not written yet);
 * bypassed ones hold nothing and are left out. {} when there are none, so a graph without LoRAs sends the query
 * it always sent, and {} when a node on the path is muted: no pipeline reaches the Sampler, nothing runs. */
export function loraFields(start, upstream, value) {
  const path = [];
  const seen = new Set();
  for (let node = start; node && !seen.has(node) && PIPELINE_PASS_THROUGH.includes(typeOf(node)); node = upstream(node)) {
    seen.add(node);
    if (node.mode === MODE_MUTED) return {};
    if (node.mode !== MODE_BYPASSED) path.unshift(node);
  }
  const fields = {};
  path.filter((node) => typeOf(node) === LORA_NODE).forEach((node, i) => {
    for (const name of LORA_WIDGETS) fields[`lora${i}_${name}`] = value(node, name);
  });
  const trained = path.filter((node) => typeOf(node) !== LORA_NODE).length;
  if (trained) fields.trained_loras = trained;
  return fields;
}

/** The plan query's fields for the node on the Sampler's `input` (cache or speed) and `value(name)` of
 * its widgets: prefixed, so the route keeps them apart from the Strategy's; {} for any other node. */
export function extraFields(input, node, value) {
  const extra = SAMPLER_EXTRAS[input];
  // muted or bypassed: the frontend leaves the Sampler's optional input out of the prompt, so the run has neither
  if (!extra || typeOf(node) !== extra.node || node.mode === MODE_MUTED || node.mode === MODE_BYPASSED) return {};
  return Object.fromEntries(extra.widgets.map((name) => [`${extra.prefix}${name}`, value(name)]));
}

/** Why the plan cannot follow the loader (its line on the chart), or null: Load Video Pipeline's `path` loads a
 * folder the plan route never reads (it plans only the models the pack lists, never a path). */
export function loaderGap(loader, value) {
  const path = typeOf(loader) === "VidMemLoadPipeline" ? value("path") : "";
  return typeof path === "string" && path.trim()
    ? `${nodeName(loader)} loads its path, which the plan does not read (it plans the model list's folders only): `
      + "put the folder under models/diffusers and choose it in model, with path empty"
    : null;
}

/** The widgets of `node` named in `names` that another node feeds (converted to inputs and linked): the plan reads
 * widget values only, so a value that arrives from a link at run time is unknown to it. */
export function linkedWidgets(node, names, sourceOf = () => null) {
  // The frontend's Primitive node copies its value onto the widget: that one the plan reads as it is.
  return (node?.inputs ?? []).map((input, slot) => ({ input, slot }))
    .filter(({ input, slot }) => input.link != null && input.widget && names.includes(input.widget.name)
      && typeOf(sourceOf(slot)) !== "PrimitiveNode")
    .map(({ input }) => input.widget.name);
}

/** The plan query's loader fields from a loader node and `value(name)` of its widgets. */
export function loaderFields(loader, value) {
  const kind = typeOf(loader);
  if (kind === "VidMemLoadModelFiles") {
    // Prefixed: the Strategy has widgets of the same names (text_encoder).
    const files = Object.fromEntries(FILES_LOADER_WIDGETS.map((name) => [`${LOADER_PREFIX}${name}`, value(name)]));
    return { loader: kind, model: value("model"), dtype: value("dtype"), ...files };
  }
  const fields = { loader: kind, model: value("model"), dtype: value("dtype") };
  // Load Video Pipeline's own file, storage and VAE precision choices (its text-encoder files plan in their storage).
  for (const name of ["transformer_file", "weight_dtype", "vae_dtype", "text_encoder_file", "text_encoder_2_file"]) {
    const chosen = value(name);
    if (chosen !== undefined && chosen !== null) fields[name] = chosen;
  }
  return fields;
}

export function planQuery({ model, dtype, widgets, shape, client, loader, extra }) {
  if (!model || !shape || [shape.width, shape.height, shape.frames].some((v) => !Number.isFinite(Number(v)))) return null;
  const params = new URLSearchParams({ model: String(model), dtype: String(dtype ?? "bf16") });
  for (const [name, value] of Object.entries(loader ?? {})) {
    if (value !== undefined && value !== null && !params.has(name)) params.set(name, String(value));
  }
  for (const name of [...STRATEGY_WIDGETS, ...STRATEGY_BUDGETS, ...STRATEGY_OPTIONS, ...STRATEGY_PARALLEL]) {
    if (widgets?.[name] !== undefined && widgets[name] !== null) params.set(name, String(widgets[name]));
  }
  for (const name of SAMPLER_SHAPE) {
    if (shape[name] !== undefined && shape[name] !== null) params.set(name, String(shape[name]));
  }
  for (const [name, value] of Object.entries(extra ?? {})) {
    if (value !== undefined && value !== null) params.set(name, String(value));
  }
  if (client !== undefined) params.set("client", String(client));
  return params.toString();
}

/** The plan route's answer (a fetch Response): its JSON, an error plan included; where the server answered an error
 * that is not JSON (a plain-text 500, a proxy's HTML page) it throws Error("HTTP <status>"), which the node shows,
 * rather than a JSON parse error. */
export async function planFromResponse(response) {
  const json = (response.headers?.get("Content-Type") ?? "").includes("application/json");
  if (!response.ok && !json) throw new Error(`HTTP ${response.status}`);
  return response.json();
}

/** Estimated time against the same run with every weight resident: "+9%" below twice that, then
 * "x2.4", "x62", "x403" (the tiny stand-in models stream far more than they compute). */
export function slowdownText(x) {
  const value = Number(x);
  if (!Number.isFinite(value)) return "?";
  if (value < 2) return `+${Math.max(0, Math.round((value - 1) * 100))}%`;
  return `x${value.toFixed(value < 10 ? 1 : 0)}`;
}

const gib = (n) => (Number.isFinite(n) ? `${(n / 2 ** 30).toFixed(1)}` : "-");

/** A plan over two or more GPUs (plan.parallel): its rows are per GPU and its times speedups. */
export function isParallel(plan) {
  return plan?.status === "ok" && Boolean(plan.parallel);
}

/** A row's time cell: its speedup against one GPU ("x1.89") over several GPUs, else its slowdown ("+9%"). */
export function timeText(plan, row) {
  if (!isParallel(plan)) return slowdownText(row.est_slowdown);
  return Number.isFinite(row.speedup) ? `x${row.speedup.toFixed(2)}` : "-";
}

/** What the GPUs are and the speedup, e.g. "per GPU, 2 GPUs, ulysses over PCIe 4.0 x16 (...)": lines under the verdict. */
export function parallelLines(plan) {
  return isParallel(plan) ? plan.parallel.lines ?? [] : [];
}

/** Whether the rows' times differ by more than the time model can tell (the server decides: plan.time). */
export function timeShown(plan) {
  return plan?.status === "ok" && plan.time?.shown !== false;
}

/** What the time figures are, or why there are none: one sentence under the chart. */
export function timeNote(plan) {
  if (plan?.status !== "ok" || !plan.time) return "";
  const within = `${Math.round((plan.time.resolution ?? 0.05) * 100)}%`;
  if (timeShown(plan) && plan.time.speedup) return `speed: how many times faster than ${plan.time.relative_to}`;
  if (timeShown(plan)) return `time: estimated, against ${plan.time.relative_to}`;
  const [low, high] = (plan.time.range ?? [1, 1]).map((x) => slowdownText(x));
  const span = low === high ? low : `${low} to ${high}`;
  return `no time column: every row is within ${within} of the others (${span} against ${plan.time.relative_to})`;
}

/** Whether the host computes on its CPU (ComfyUI --cpu, or no CUDA): the compute's memory is RAM, so the RAM budget
 * decides and the VRAM budget is not used. */
export function onCpu(plan) {
  return plan?.status === "ok" && plan.device === "cpu";
}

/** The plan as a text table: one line per row, the chosen one marked, then the budgets. */
export function planLines(plan) {
  if (!plan || plan.status !== "ok") return [];
  const width = Math.max(6, ...plan.rows.map((row) => row.label.length));
  const time = timeShown(plan);
  const disk = plan.on_disk ? ", weights on disk" : "";
  // The config the files were recognised as (a file name would run past the node), else the model's name.
  const parallel = isParallel(plan); // its own line: the table is not wrapped
  const lines = [`${plan.config ?? plan.model} ${shapeText(plan.shape)}${disk}`,
    ...(parallel ? [`per GPU, ${plan.parallel.gpus} GPUs, ${plan.parallel.mode}`] : []),
    `  ${"row".padEnd(width)}  ${onCpu(plan) ? "comp" : "VRAM"}   RAM GiB${time ? (parallel ? "  speed" : "  time") : ""}`];
  plan.rows.forEach((row, i) => {
    const mark = i === plan.chosen ? ">" : " ";
    const fit = row.fits === false ? " over" : "";
    lines.push(`${mark} ${row.label.padEnd(width)} ${gib(row.peak_vram_bytes).padStart(5)} ${gib(row.peak_ram_bytes).padStart(5)}` +
      `${time ? `     ${timeText(plan, row).padStart(4)}` : ""}${fit}`);
  });
  const vramBudget = onCpu(plan) ? "-" : gib(plan.budgets.vram_bytes);
  lines.push(`  ${"budget".padEnd(width)} ${vramBudget.padStart(5)} ${gib(plan.budgets.ram_bytes).padStart(5)}`);
  if (onCpu(plan)) lines.push("  the CPU computes: comp is the RAM its compute holds, counted in RAM; no VRAM is used");
  const needs = needsLine(plan);
  if (needs) lines.push(`  ${needs}`);
  return lines;
}

/** What the +disk rows need from the loader (row.needs, nodes/plan_route.py), or "" when every row runs as loaded:
 * auto never runs them, so the chart must not read as if the Sampler could. */
export function needsLine(plan) {
  const row = plan?.status === "ok" ? plan.rows.find((r) => r.needs) : undefined;
  return row ? `+disk rows need the weights on disk: ${row.needs}; auto runs the weights as loaded` : "";
}

/** The row the verdict is about: the chosen one, else (nothing fits) the leanest candidate the loader can run. */
function verdictRow(plan) {
  const row = plan.rows[plan.chosen];
  if (row) return row;
  const candidates = plan.rows.filter((r) => r.label !== "your settings" && !r.needs);
  return candidates.at(-1) ?? plan.rows.at(-1);
}

/** One line saying what the plan means, e.g. "auto chose block_swap 37: fits, peak 7.7 of 8.0 GiB VRAM, ...". */
export function planVerdict(plan) {
  if (!plan) return "plan: connect the Sampler (and its Load Video Pipeline)";
  if (plan.status === "error") return `plan: ${plan.error}`;
  if (plan.status !== "ok") return "";
  const row = verdictRow(plan);
  if (!row) return "no plan";
  const { vram_bytes: vram, ram_bytes: ram } = plan.budgets;
  const asLoaded = plan.rows.some((r) => r.needs) ? " as loaded" : "";
  const head = !plan.rows[plan.chosen] ? `nothing fits${asLoaded}; even ${row.label} is over`
    : plan.auto ? `auto chose ${row.label}: ${row.fits === false ? "over budget" : "fits"}`
    : `your settings: ${row.fits === false ? "over budget" : "fit"}`;
  const parallel = isParallel(plan);
  const time = !timeShown(plan) ? "" : parallel ? `, ${timeText(plan, row)} against one GPU` : `, time ${slowdownText(row.est_slowdown)}`;
  // "over budget" says the row does not fit; the figure that is over says which budget to act on
  const over = (need, budget) => (row.fits === false && need > budget ? " (over)" : "");
  if (onCpu(plan)) return `${head}; the CPU computes: peak ${gib(row.peak_ram_bytes)} of ${gib(ram)} GiB RAM${over(row.peak_ram_bytes, ram)}${time}`;
  return `${head}; peak ${gib(row.peak_vram_bytes)} of ${gib(vram)} GiB VRAM${parallel ? " per GPU" : ""}` +
    `${over(row.peak_vram_bytes, vram)}, ${gib(row.peak_ram_bytes)} of ${gib(ram)} GiB RAM${over(row.peak_ram_bytes, ram)}${time}`;
}

/** The planned clip, "832x480x161", and its context windows where they split it: ", 81-frame windows, overlap 16". */
export function shapeText(shape) {
  const clip = `${shape.width}x${shape.height}x${shape.frames}`;
  const windowed = shape.window > 0 && shape.window < shape.frames;
  return windowed ? `${clip}, ${shape.window}-frame windows, overlap ${shape.window_overlap ?? 0}` : clip;
}

/** What the Sampler's context window does to the plan (the server's words): lines under the verdict. */
export function windowLines(plan) {
  return plan?.status === "ok" ? plan.windows ?? [] : [];
}

/** The LoRAs the plan counted (and the Train LoRA nodes it could not): lines under the verdict. */
export function loraLines(plan) {
  return plan?.status === "ok" ? plan.loras ?? [] : [];
}

/** What makes the run faster than the rows say (the Speed node's choices, a step cache's skips): lines under the verdict. */
export function speedLines(plan) {
  return plan?.status === "ok" ? plan.speed ?? [] : [];
}

/** Why the verdict's row does not fit: one short line per stage, each with the fix (nodes/plan_route.py). */
export function planReasons(plan) {
  if (plan?.status !== "ok") return [];
  const reasons = verdictRow(plan)?.over_budget ?? [];
  // Nothing runs as loaded, but a +disk row would: say which loader input gets there.
  const onDisk = !plan.rows[plan.chosen] && plan.rows.find((r) => r.needs && r.fits !== false);
  return onDisk ? [...reasons, `${onDisk.label} fits with ${onDisk.needs}`] : reasons;
}

/** Bars to draw: per row and stage, VRAM and RAM as fractions of their budgets (1 = on the line). Where the CPU
 * computes, the thick bar is the stage's RAM (its compute's and the process's) against the RAM budget, what decides
 * the fit, and there is no thin bar; `peak` is then the row's RAM. */
export function planBars(plan) {
  if (!plan || plan.status !== "ok") return [];
  const { vram_bytes: vram, ram_bytes: ram } = plan.budgets;
  const cpu = onCpu(plan);
  return plan.rows.map((row, i) => ({
    label: row.label, chosen: i === plan.chosen, fits: row.fits, slowdown: row.est_slowdown, time: timeText(plan, row),
    peak: cpu ? row.peak_ram_bytes : row.peak_vram_bytes,
    stages: STAGES.map(([name]) => {
      const stage = row.stages.find((s) => s.name === name) ?? { vram_bytes: 0, ram_bytes: 0 };
      const share = (bytes, budget) => (budget ? bytes / budget : 0);
      return cpu ? { name, vram: share(stage.ram_bytes, ram), ram: 0 }
        : { name, vram: share(stage.vram_bytes, vram), ram: share(stage.ram_bytes, ram) };
    }),
  }));
}

/** A receipt in at most `max` short lines (the full text goes in the tooltip). */
export function compactLines(nodeType, message, max = 3) {
  const receipt = receiptFrom(message);
  if (nodeType === "VidMemFreeVRAM" && receipt) {
    const rss = receipt.before?.rss_bytes !== undefined ? `RSS ${formatBytes(receipt.before.rss_bytes)} -> ${formatBytes(receipt.after?.rss_bytes)}` : "";
    const gpu = receipt.before?.allocated_bytes !== undefined
      ? `VRAM ${formatBytes(receipt.before.allocated_bytes)} -> ${formatBytes(receipt.after?.allocated_bytes)}` : "";
    return [[rss, gpu].filter(Boolean).join(", ") || "freed", `models unloaded: ${receipt.comfy_models_unloaded ? "yes" : "no"}`];
  }
  if (nodeType === "VidMemTrainLoRA" && receipt?.lora) {
    const losses = receipt.losses ?? [];
    const loss = losses.length ? `, loss ${Number(losses[losses.length - 1]).toFixed(4)}` : "";
    const plan = String(receipt.plan ?? "").startsWith("auto chose") ? receipt.plan.split(":")[0] : receipt.strategy;
    return [`LoRA written: ${baseName(receipt.lora)}`, `${receipt.steps} steps${loss}`, plan].filter(Boolean).slice(0, max);
  }
  if (nodeType === "VidMemPrepareTrainingData" && receipt?.buckets) {
    const buckets = Object.entries(receipt.buckets).map(([label, count]) => `${label}: ${count}`).join(", ");
    return [`${receipt.clips} clips (${receipt.encoded} encoded, ${receipt.reused} reused)`, buckets].slice(0, max);
  }
  if (receipt?.stages) {
    const stages = receipt.stages.map((st) => (promptCached(receipt, st) ? "prompt from the cache"
      : `${st.stage.replace("_", " ")} ${formatSeconds(st.seconds)}`)).join(" + ");
    const vram = Math.max(...receipt.stages.map((st) => st.peak_allocated_bytes ?? -1));
    const rss = Math.max(...receipt.stages.map((st) => st.peak_rss_bytes ?? -1));
    const peak = vram >= 0 ? `peak VRAM ${formatBytes(vram)}, RSS ${formatBytes(rss)}` : `peak RSS ${formatBytes(rss)} (no GPU)`;
    const extra = [];
    if (String(receipt.plan ?? "").startsWith("auto chose")) extra.push(receipt.plan.split(";")[0]);
    if (receipt.swap) extra.push(`swap cost ${formatPercent(receipt.swap.swap_cost)} of denoise`);
    if (receipt.cache) extra.push(`cache ${formatPercent(receipt.cache.blocks_computed_share)} of blocks computed`);
    if (receipt.decode) extra.push(`VAE ${receipt.decode.mode}, ${piecesText(receipt.decode)}`);
    if (receipt.saved_latents) extra.push(`saved ${receipt.saved_latents}`);
    if (receipt.note) extra.unshift(`note: ${receipt.note}`); // a Strategy value the tier ignored
    return [stages, peak, extra.join("; ")].filter(Boolean).slice(0, max);
  }
  return textFrom(message).split("\n").filter(Boolean).slice(0, max);
}
