// vidmem's web extension: the live plan on the Memory Strategy node, compact receipts on the nodes
// after they run, a VRAM/RAM meter, "Free VRAM now".
// Official hooks only: registerExtension (beforeRegisterNodeDef chains onExecuted the documented
// way, nodeCreated, beforeConfigureGraph, setup), commands/menuCommands, settings,
// api.addEventListener. Served by ComfyUI at /extensions/vidmem/js/vidmem.js, so ComfyUI's
// scripts are three levels up.
import { app } from "../../../scripts/app.js";
import { api } from "../../../scripts/api.js";
import {
  FREE_BODY, MEMORY_ROUTE, NODE_TYPES, PLAN_ROUTE, SAMPLER_EXTRAS, SAMPLER_SHAPE, STAGES, STRATEGY_BUDGETS, STRATEGY_OPTIONS,
  STRATEGY_PARALLEL, STRATEGY_WIDGETS, compactLines, extraFields, ignoredStrategyWidgets, isParallel, legacyStrategyValues,
  linkedWidgets, loaderFields, loaderGap, loraFields, loraLines, meterText, onCpu, parallelLines, pipelineSource, pipelineStart, planBars, planLines, planQuery,
  outputsThroughReroutes, planFromResponse, planReasons, planVerdict, plannedSampler, speedLines, stageHeaders, summarize, throughReroutes, timeNote, timeShown, windowLines,
} from "./vidmem_format.js";

const RECEIPT_WIDGET = "vidmem_receipt";
const PLAN_WIDGET = "vidmem_plan";
const INTERVAL_SETTING = "VidMem.Meter.IntervalSeconds";
const FREE_COMMAND = "vidmem.freeVram";
const LINE_HEIGHT = 15;
const RECEIPT_LINES = 3; // compact: the full receipt is in the tooltip
// The plan is drawn to stay readable at the templates' 70% zoom: 14-15 px text is 10 px on screen.
// Its height is at least PLAN_HEIGHT (the templates leave that much room: nine rows, no reasons)
// and grows with what it shows (reasons, the table when opened); the node grows with it.
const PLAN_HEIGHT = 390;
const PLAN_FONT = 15; // px, everything in the plan but the verdict (10.5 px on screen at 70%)
const CHART_WIDTH = 462; // the chart's drawing units: CSS px on a 480 px wide node (templates' width)
const PLAN_PADDING = 10; // px above and below the plan's text, together
const MONO_ADVANCE = 0.6; // a monospace character's width per px of font size (DejaVu Sans Mono: 0.602)
const WIDGET_MARGIN = 4; // the frontend insets a DOM widget by this on each side
const PLAN_POLL_MS = 600; // how often the graph is read for a changed plan request (no request if unchanged)
const STRATEGY = "VidMemMemoryStrategy";
const SAMPLER = "VidMemVideoSampler";

function domWidget(node, name, element, height) {
  const widget = node.addDOMWidget(name, name, element, {
    serialize: false, // never part of the prompt
    getValue: () => "",
    setValue: () => {},
    getMinHeight: () => height(),
    getMaxHeight: () => height(),
    margin: WIDGET_MARGIN,
  });
  widget.serialize = false; // nor of the workflow's widgets_values
  return widget;
}

function showReceipt(node, nodeType, message) {
  const lines = compactLines(nodeType, message, RECEIPT_LINES);
  if (!lines.length) return;
  let widget = node.widgets?.find((w) => w.name === RECEIPT_WIDGET);
  if (!widget) {
    const element = document.createElement("div");
    element.className = "vidmem-receipt";
    Object.assign(element.style, {
      font: "11px/15px monospace", padding: "4px 6px", overflow: "hidden", cursor: "help",
      color: "var(--input-text, #ddd)", background: "var(--comfy-input-bg, #222)", borderRadius: "4px",
    });
    widget = domWidget(node, RECEIPT_WIDGET, element, () => RECEIPT_LINES * LINE_HEIGHT + 8 + 2 * WIDGET_MARGIN);
  }
  widget.element.replaceChildren(...lines.map((text) => {
    const line = document.createElement("div");
    Object.assign(line.style, { whiteSpace: "pre", overflow: "hidden", textOverflow: "ellipsis" });
    line.textContent = text;
    return line;
  }));
  const { title, lines: details } = summarize(nodeType, message);
  widget.element.title = [title, ...details].join("\n"); // the whole receipt, on hover
  const wanted = node.computeSize();
  node.setSize([Math.max(node.size[0], wanted[0]), Math.max(node.size[1], wanted[1])]);
  app.graph?.setDirtyCanvas(true, true);
}

// --- the live plan ------------------------------------------------------------------------------

const SVG = "http://www.w3.org/2000/svg";
const planState = new WeakMap(); // strategy node -> {query, plan, controller}
// The server drops a waiting request when a newer one from the same client arrives: one client per
// node of this page (node ids repeat across tabs and workflows).
const PAGE_ID = Math.random().toString(36).slice(2, 10);

function svg(tag, attrs, text) {
  const element = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) element.setAttribute(key, String(value));
  if (text !== undefined) element.textContent = text;
  return element;
}

// Per row: each stage's VRAM (thick) and RAM (thin) bar as a share of its budget (where the CPU computes, one bar:
// its RAM against the RAM budget); the dashed line is the budget (a bar past it is red). The chosen row is marked; its label is never cut:
// the label column is as wide as the longest label. The time column only where times differ;
// over several GPUs it is the speedup against one GPU ("x1.89") and the VRAM the fullest GPU's.
function drawChart(plan) {
  const bars = planBars(plan);
  const time = timeShown(plan);
  const rowH = 24, top = 22, gap = 6, char = PLAN_FONT * MONO_ADVANCE;
  const labelW = Math.ceil(Math.max(8, ...bars.map((row) => row.label.length + 2)) * char) + 12;
  const timeW = time ? Math.ceil(5 * char) + 4 : 0; // "+9%", "x2.4", or over several GPUs "x1.89"
  const peakW = Math.ceil(5 * char); // the row's peak VRAM in GiB, right of the stages
  const peakX = CHART_WIDTH - timeW - peakW;
  const panelW = Math.floor((peakX - labelW - gap * STAGES.length) / STAGES.length);
  const scale = 0.7 * panelW; // the budget line at 70% of a panel; bars stop at 1.4 budgets
  const height = top + bars.length * rowH + 2;
  const chart = svg("svg", { viewBox: `0 0 ${CHART_WIDTH} ${height}`, width: "100%", class: "vidmem-plan-chart" });
  chart.style.font = `${PLAN_FONT}px monospace`;
  chart.style.display = "block";
  stageHeaders(Math.floor((panelW + gap) / char) - 1).forEach((label, s) =>
    chart.append(svg("text", { x: labelW + s * (panelW + gap), y: 15, fill: "#aaa" }, label)));
  chart.append(svg("text", { x: peakX, y: 15, fill: "#aaa" }, onCpu(plan) ? "RAM" : "VRAM"));
  if (time) chart.append(svg("text", { x: CHART_WIDTH - timeW + 2, y: 15, fill: "#aaa" }, isParallel(plan) ? "speed" : "time"));
  bars.forEach((row, r) => {
    const y = top + r * rowH;
    if (row.chosen) chart.append(svg("rect", { x: 0, y: y - 1, width: CHART_WIDTH, height: rowH - 1, fill: "rgba(120,180,255,0.2)", rx: 3 }));
    chart.append(svg("text", { x: 2, y: y + 16, fill: row.fits === false ? "#ef7b85" : "#ddd", "font-weight": row.chosen ? "bold" : "normal" },
      `${row.chosen ? "> " : ""}${row.label}`));
    row.stages.forEach((stage, s) => {
      const x = labelW + s * (panelW + gap);
      chart.append(svg("rect", { x, y: y + 2, width: panelW, height: rowH - 6, fill: "rgba(255,255,255,0.05)" }));
      const vram = Math.min(stage.vram, 1.4) * scale, ram = Math.min(stage.ram, 1.4) * scale;
      chart.append(svg("rect", { x, y: y + 3, width: Math.max(vram, 1), height: 10, fill: stage.vram > 1 ? "#e06c75" : "#5aa0e0" }));
      if (!onCpu(plan)) chart.append(svg("rect", { x, y: y + 15, width: Math.max(ram, 1), height: 4, fill: stage.ram > 1 ? "#e06c75" : "#d7a64a" }));
      chart.append(svg("line", { x1: x + scale, x2: x + scale, y1: y, y2: y + rowH - 2, stroke: "#eee", "stroke-dasharray": "3,2" }));
    });
    const over = row.stages.some((stage) => stage.vram > 1);
    chart.append(svg("text", { x: peakX + peakW - 4, y: y + 16, fill: over ? "#ef7b85" : "#ddd", "text-anchor": "end" },
      (row.peak / 2 ** 30).toFixed(1)));
    if (time) chart.append(svg("text", { x: CHART_WIDTH - timeW + 2, y: y + 16, fill: "#ddd" }, row.time));
  });
  return chart;
}

function textBlock(className, lines, style) {
  const block = document.createElement("div");
  block.className = className;
  Object.assign(block.style, { whiteSpace: "normal", ...style });
  block.replaceChildren(...lines.map((text) => {
    const line = document.createElement("div");
    line.textContent = text;
    return line;
  }));
  return block;
}

function renderPlan(node, plan, note) {
  const widget = node.widgets?.find((w) => w.name === PLAN_WIDGET);
  if (!widget) return;
  const ok = plan?.status === "ok";
  const chosen = ok ? plan.rows[plan.chosen] : null;
  const verdict = textBlock("vidmem-plan-verdict", [note ?? planVerdict(plan)], {
    color: plan?.status === "error" || chosen?.fits === false || (ok && !chosen) ? "#ef7b85" : "#ddd",
    font: `bold 16px/21px sans-serif`, marginBottom: "3px",
  });
  const children = [verdict];
  const samplers = planState.get(node)?.samplers; // which Sampler of several the plan is for
  if (samplers) children.push(textBlock("vidmem-plan-samplers", [samplers], { color: "#e5c07b", marginBottom: "3px" }));
  if (ok) {
    const gpus = parallelLines(plan); // "per GPU, 2 GPUs, ulysses ...", and the speedup against one GPU
    if (gpus.length) children.push(textBlock("vidmem-plan-gpus", gpus, { color: "#c5b3f0", marginBottom: "3px" }));
    const windows = windowLines(plan);
    if (windows.length) children.push(textBlock("vidmem-plan-windows", windows, { color: "#9ec5f0", marginBottom: "3px" }));
    const loras = loraLines(plan);
    if (loras.length) children.push(textBlock("vidmem-plan-loras", loras, { color: "#e0c48a", marginBottom: "3px" }));
    const reasons = planReasons(plan);
    if (reasons.length) children.push(textBlock("vidmem-plan-reasons", reasons, { color: "#f0a0a6", margin: "0 0 4px 8px" }));
    if (plan.auto && chosen) children.push(textBlock("vidmem-plan-strategy", [chosen.strategy], { color: "#aaa", marginBottom: "3px" }));
    const speed = speedLines(plan);
    if (speed.length) children.push(textBlock("vidmem-plan-speed", speed, { color: "#9fd4a0", marginBottom: "3px" }));
    const disk = plan.rows.some((row) => row.label.endsWith("+disk")) ? "; +disk: weights memory-mapped from disk" : "";
    const legend = [isParallel(plan)
      ? `bars: VRAM per GPU (thick, the fullest GPU), RAM of every process (thin) per stage; dashed line: the budget; ` +
        `VRAM: the row's peak per GPU in GiB${disk}`
      : onCpu(plan) ? `bars: RAM per stage (the CPU computes, in RAM; no VRAM is used); dashed line: the RAM budget; ` +
        `RAM: the row's peak in GiB${disk}`
      : `bars: VRAM (thick), RAM (thin) per stage; dashed line: the budget; VRAM: the row's peak in GiB${disk}`,
      timeNote(plan)];
    children.push(drawChart(plan), textBlock("vidmem-plan-legend", legend, { color: "#aaa", marginTop: "3px" }), tableToggle(node, plan));
  }
  const body = document.createElement("div");
  body.className = "vidmem-plan-body";
  body.append(...children);
  widget.element.replaceChildren(body);
  widget.element.dataset.status = plan?.status ?? "none";
  widget.element.title = [planVerdict(plan), planState.get(node)?.samplers, ...parallelLines(plan), ...windowLines(plan), ...loraLines(plan), chosen?.strategy, ...planReasons(plan), ...speedLines(plan), ...planLines(plan), timeNote(plan)]
    .filter(Boolean).join("\n");
  fitPlan(node);
  app.graph?.setDirtyCanvas(true, false);
}

// The text table folds behind a toggle; opened, the node grows to show it, closed, it goes back.
function tableToggle(node, plan) {
  const details = document.createElement("details");
  details.className = "vidmem-plan-details";
  details.open = Boolean(planState.get(node)?.tableOpen);
  const summary = document.createElement("summary");
  summary.textContent = onCpu(plan) ? "table: peak RAM (and its compute's) per row" : "table: peak VRAM and RAM per row";
  Object.assign(summary.style, { cursor: "pointer", color: "#bbb", marginTop: "3px" });
  const table = document.createElement("pre");
  table.className = "vidmem-plan-table";
  // pre-wrap: the rows keep their columns, and a line wider than the node (a +disk row's needs) wraps, not clipped
  Object.assign(table.style, { margin: "2px 0 0", font: `${PLAN_FONT}px/19px monospace`, color: "#ccc", whiteSpace: "pre-wrap" });
  table.textContent = planLines(plan).join("\n");
  details.append(summary, table);
  details.addEventListener("toggle", () => {
    const state = planState.get(node) ?? {};
    state.tableOpen = details.open;
    planState.set(node, state);
    fitPlan(node);
  });
  return details;
}

// The plan widget's height follows its content (at least PLAN_HEIGHT); the node grows to hold it,
// and shrinks back to the size it had before it grew.
function fitPlan(node) {
  const widget = node.widgets?.find((w) => w.name === PLAN_WIDGET);
  const body = widget?.element?.querySelector(".vidmem-plan-body");
  if (!body?.isConnected || !body.offsetHeight) return; // not laid out yet: the next poll measures it
  const needed = Math.max(PLAN_HEIGHT, body.offsetHeight + PLAN_PADDING + 2 * WIDGET_MARGIN);
  const state = planState.get(node) ?? {};
  planState.set(node, state);
  if (needed === widget.vidmemHeight) return;
  widget.vidmemHeight = needed;
  state.baseHeight ??= node.size[1];
  const wanted = node.computeSize()[1];
  node.setSize([node.size[0], Math.max(state.baseHeight, wanted)]);
  app.graph?.setDirtyCanvas(true, true);
}

function addPlanWidget(node) {
  const element = document.createElement("div");
  element.className = "vidmem-plan";
  Object.assign(element.style, {
    font: `${PLAN_FONT}px/20px sans-serif`, padding: `${PLAN_PADDING / 2}px 6px`, overflow: "hidden", boxSizing: "border-box",
    color: "var(--input-text, #ddd)", background: "var(--comfy-input-bg, #222)", borderRadius: "4px",
  });
  const widget = domWidget(node, PLAN_WIDGET, element, () => widget.vidmemHeight ?? PLAN_HEIGHT);
  renderPlan(node, null);
}

const widgetValue = (node, name) => node?.widgets?.find((w) => w.name === name)?.value;
const PLAN_RETRY_MS = 10000; // after a failed plan request, the next refresh after this asks again

// The node on `inputName`, read through Reroute nodes.
function linkedNode(node, inputName) {
  const slot = node?.inputs?.findIndex((input) => input.name === inputName) ?? -1;
  const linked = slot >= 0 ? node.getInputNode?.(slot) ?? null : null;
  return throughReroutes(linked, (reroute) => reroute.getInputNode?.(0) ?? null);
}

// The Sampler this strategy feeds (of several, the largest: plannedSampler), its shape, and the loader of its
// pipeline: {query}, or {gap}, the line saying why there is no plan; and {samplers}: which Sampler of several it plans.
function planRequestFor(node) {
  const fed = outputsThroughReroutes(node.getOutputNodes?.(0) ?? [], (reroute) => reroute.getOutputNodes?.(0) ?? []);
  const { sampler, line } = plannedSampler(fed.filter((n) => n.comfyClass === SAMPLER || n.type === SAMPLER),
    widgetValue, (n, slot) => n.getInputNode?.(slot));
  if (!sampler) return { gap: "connect this Strategy's output to a Video Sampler" };
  return { ...samplerRequest(node, sampler), samplers: line };
}

// The plan request of `node` (the Strategy) for `sampler`: {query} or {gap}.
function samplerRequest(node, sampler) {
  const upstream = (n) => linkedNode(n, "pipeline");
  const start = pipelineStart(node, sampler, upstream);
  const { loader, gap } = pipelineSource(start, upstream);
  if (!loader) return { gap };
  const pathGap = loaderGap(loader, (name) => widgetValue(loader, name));
  if (pathGap) return { gap: pathGap };
  const fields = loaderFields(loader, (name) => widgetValue(loader, name));
  const strategyNames = [...STRATEGY_WIDGETS, ...STRATEGY_BUDGETS, ...STRATEGY_OPTIONS, ...STRATEGY_PARALLEL];
  const allWidgets = (n) => (n?.widgets ?? []).map((w) => w.name);
  const onThePath = []; // the Load LoRA / Train LoRA nodes between the Sampler and the loader
  for (let n = start; n && n !== loader && !onThePath.includes(n); n = upstream(n)) onThePath.push(n);
  const extras = Object.keys(SAMPLER_EXTRAS).map((input) => linkedNode(sampler, input)).filter(Boolean);
  for (const [reader, names] of [[sampler, SAMPLER_SHAPE], [node, strategyNames], [loader, allWidgets(loader)],
    ...[...onThePath, ...extras].map((n) => [n, allWidgets(n)])]) {
    const linked = linkedWidgets(reader, names, (slot) => reader.getInputNode?.(slot));
    if (linked.length) {
      return { gap: `${reader.title || reader.type}'s ${linked.join(", ")} ${linked.length === 1 ? "comes" : "come"} from a `
        + "link, which the plan cannot read before the run: set the value on the node to plan it" };
    }
  }
  const widgets = Object.fromEntries(strategyNames.map((name) => [name, widgetValue(node, name)]));
  // A Sampler without window widgets (an older one) sends none: undefined values are left out of the query.
  const shape = Object.fromEntries(SAMPLER_SHAPE.map((name) => [name, widgetValue(sampler, name)]));
  const extra = Object.assign(loraFields(start, upstream, widgetValue), ...Object.keys(SAMPLER_EXTRAS).map((input) => {
    const linked = linkedNode(sampler, input);
    return extraFields(input, linked, (name) => widgetValue(linked, name));
  }));
  return { query: planQuery({ model: fields.model, dtype: fields.dtype, loader: fields, widgets, shape, extra,
    client: `${PAGE_ID}:${node.id}` }) };
}

async function refreshPlan(node) {
  const { query, gap, samplers } = planRequestFor(node);
  const state = planState.get(node) ?? {};
  const key = `${query ?? `gap:${gap}`}\n${samplers}`; // a changed reason, or another Sampler's title, redraws too
  if (key === state.key) return;
  state.controller?.abort(); // the server drops it too if it has not started
  state.query = query;
  state.key = key;
  state.samplers = samplers;
  planState.set(node, state);
  if (!query) return renderPlan(node, null, `plan: ${gap}`);
  const controller = (state.controller = new AbortController());
  try {
    const response = await api.fetchApi(`${PLAN_ROUTE}?${query}`, { cache: "no-store", signal: controller.signal });
    const plan = await planFromResponse(response);
    if (plan.status === "superseded" || state.query !== query) return;
    renderPlan(node, plan);
    // a server error (not a bad input, which answers 400) may pass: asked again later, as a failed request is
    if (response.status >= 500) setTimeout(() => { if (state.key === key) state.key = undefined; }, PLAN_RETRY_MS);
  } catch (error) {
    if (error.name !== "AbortError" && state.query === query) {
      renderPlan(node, null, `plan unavailable: ${error.message}`);
      // asked again at a later refresh: a server busy or restarting now must not leave the chart without a plan
      setTimeout(() => { if (state.key === key) state.key = undefined; }, PLAN_RETRY_MS);
    }
  }
}

// Widgets the chosen tier ignores are greyed out; their values stay (and are noted in the receipts).
function greyIgnored(node) {
  const ignored = ignoredStrategyWidgets(widgetValue(node, "offload"), widgetValue(node, "vae_tiling"));
  let changed = false;
  for (const widget of node.widgets ?? []) {
    if (!STRATEGY_WIDGETS.includes(widget.name)) continue;
    const disabled = ignored.includes(widget.name);
    if (Boolean(widget.disabled) !== disabled) {
      widget.disabled = disabled;
      changed = true;
    }
  }
  if (changed) app.graph?.setDirtyCanvas(true, false);
}

function refreshPlans() {
  for (const node of app.graph?.nodes ?? []) {
    if (node.comfyClass === STRATEGY || node.type === STRATEGY) {
      greyIgnored(node);
      refreshPlan(node);
      fitPlan(node);
    }
  }
}

// Older Strategy nodes saved width/height/frames before the budgets: give the budgets their values.
function migrateStrategyNodes(graphData) {
  for (const node of graphData?.nodes ?? []) {
    const legacy = node.type === STRATEGY ? legacyStrategyValues(node.widgets_values) : null;
    if (legacy) node.widgets_values = [...STRATEGY_WIDGETS, ...STRATEGY_BUDGETS].map((name) => legacy[name]);
  }
}

class Meter {
  constructor() {
    this.element = document.createElement("div");
    this.element.id = "vidmem-meter";
    Object.assign(this.element.style, {
      position: "fixed", left: "50%", transform: "translateX(-50%)", bottom: "10px", zIndex: 1000, display: "flex", gap: "8px",
      alignItems: "center", font: "11px monospace", padding: "3px 8px", borderRadius: "6px",
      color: "var(--fg-color, #ddd)", background: "var(--comfy-menu-bg, #353535)", opacity: 0.9,
      border: "1px solid var(--border-color, #4e4e4e)",
    });
    this.label = document.createElement("span");
    this.label.textContent = "vidmem: memory ...";
    const button = document.createElement("button");
    button.textContent = "Free VRAM now";
    button.title = "POST /free: ComfyUI unloads its models and frees cached memory when it is idle";
    Object.assign(button.style, { font: "inherit", cursor: "pointer", padding: "1px 6px" });
    button.addEventListener("click", () => app.extensionManager?.command?.execute(FREE_COMMAND) ?? freeVram());
    this.element.append(this.label, button);
    this.timer = null;
  }

  async refresh() {
    try {
      const response = await api.fetchApi(MEMORY_ROUTE, { cache: "no-store" });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const { text, detail, level } = meterText(await response.json());
      this.label.textContent = text;
      this.element.title = detail;
      this.element.dataset.level = level;
      this.label.style.color = { ok: "", high: "#e5c07b", full: "#e06c75" }[level];
    } catch (error) {
      this.label.textContent = `vidmem: memory n/a (${error.message})`;
    }
  }

  schedule(seconds) {
    clearInterval(this.timer);
    const every = Number(seconds) || 0;
    this.element.style.display = every > 0 ? "flex" : "none";
    if (every > 0) {
      this.timer = setInterval(() => this.refresh(), every * 1000);
      this.refresh();
    }
  }
}

let meter = null;

async function freeVram() {
  const response = await api.fetchApi("/free", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(FREE_BODY),
  });
  const ok = response.ok;
  app.extensionManager?.toast?.add({
    severity: ok ? "info" : "error",
    summary: "VidMem",
    detail: ok ? "ComfyUI unloads its models and frees cached memory as soon as no prompt is running."
      : `POST /free failed: HTTP ${response.status}`,
    life: 4000,
  });
  setTimeout(() => meter?.refresh(), 1500);
  return ok;
}

app.registerExtension({
  name: "vidmem.ui",
  settings: [{
    id: INTERVAL_SETTING,
    category: ["VidMem", "Meter", "Refresh"],
    name: "Memory meter refresh (seconds; 0 hides the meter)",
    type: "number",
    defaultValue: 5,
    attrs: { min: 0, max: 60, step: 1 },
    onChange: (value) => meter?.schedule(value),
  }],
  commands: [{ id: FREE_COMMAND, label: "Free VRAM now (VidMem)", icon: "pi pi-eraser", function: freeVram }],
  menuCommands: [{ path: ["Extensions", "VidMem"], commands: [FREE_COMMAND] }],

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!NODE_TYPES.includes(nodeData.name) || nodeData.name === STRATEGY) return; // the strategy shows its plan
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      showReceipt(this, nodeData.name, message);
    };
  },

  nodeCreated(node) {
    if (node.comfyClass === STRATEGY) addPlanWidget(node);
  },

  beforeConfigureGraph(graphData) {
    migrateStrategyNodes(graphData);
  },

  async setup() {
    meter = new Meter();
    document.body.append(meter.element);
    meter.schedule(app.extensionManager?.setting?.get(INTERVAL_SETTING) ?? 5);
    for (const event of ["execution_success", "execution_error", "execution_interrupted"]) {
      api.addEventListener(event, () => meter.refresh());
    }
    setInterval(refreshPlans, PLAN_POLL_MS); // reads the graph; asks the server only when the request changed
  },
});
