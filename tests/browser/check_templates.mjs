// Load every vidmem UI template in the real ComfyUI frontend (headless Chromium driven by
// playwright-core), check it, screenshot it, watch the Memory Strategy's live plan change as
// blocks_to_swap changes (before anything is queued), load an older Strategy layout, and run
// templates from the browser to see the receipts on the nodes and check that no node overlaps
// another afterwards. Run by tests/test_web_browser.py; usage:
//
//   NODE_PATH=/path/to/node_modules node tests/browser/check_templates.mjs \
//     --url http://127.0.0.1:8188 --browser /usr/bin/chromium --workflows workflows \
//     --screenshots docs/screenshots [--run wan21_t2v_blockswap,wan21_t2v_14b_fp8_files] [--run-all] \
//     [--thumbnails workflows]
//
// Templates are named by their UI file's title; --run and the screenshots use the API twin's
// short name (extra.vidmem.api). --run lists templates to run from the browser (each gets
// <name>_receipts.png); the first also gets the live-plan and older-layout checks. --run-all runs
// and layout-checks every template. --thumbnails writes each template's card image, <title>.jpg
// (template_cards.mjs: drawn from extra.vidmem.card, not a screenshot of the graph).
//
// Prints one JSON report on stdout; exit status 0 when every check passed.
import fs from "node:fs";
import { createRequire } from "node:module";
import os from "node:os";
import path from "node:path";
import { parseArgs } from "node:util";

import { writeCards } from "./template_cards.mjs";

const require = createRequire(import.meta.url);
const { chromium } = require("playwright-core"); // resolved through NODE_PATH (not a repo dependency)

const { values: args } = parseArgs({
  options: {
    url: { type: "string" }, browser: { type: "string" }, workflows: { type: "string" },
    screenshots: { type: "string" }, run: { type: "string" }, "run-all": { type: "boolean" },
    thumbnails: { type: "string" },
  },
});
const RUNS = (args.run ?? "").split(",").filter(Boolean); // templates run from the browser, by API name
const TINY = { width: 32, height: 32, frames: 9, steps: 2 }; // the tiny stand-in models' size
// Wan 2.2 TI2V-5B's tiny stand-in takes multiples of 64; LTX-2's tiny VAE (32x down) needs a 2x2 latent to decode
const TINY_64 = { ...TINY, width: 64, height: 64 };
const tinyFor = (template) => (/TI2V|LTX-2/i.test(JSON.stringify(template.api)) ? TINY_64 : TINY);
const VIEWPORT = { width: 1600, height: 900 };
// Readable screenshots: full detail at the fitted zoom, no minimap over the graph.
const SETTINGS = { "LiteGraph.Canvas.MinFontSizeForLOD": 0, "Comfy.Minimap.Visible": false };

function templates() {
  return fs.readdirSync(args.workflows).filter((f) => f.endsWith(".json")).sort().map((f) => {
    const ui = JSON.parse(fs.readFileSync(path.join(args.workflows, f), "utf8"));
    const name = ui.extra.vidmem.api;
    return { name, title: f.slice(0, -5), ui, api: JSON.parse(fs.readFileSync(path.join(args.workflows, "api", `${name}.json`), "utf8")) };
  });
}

async function openComfy(page) {
  await page.goto(args.url, { waitUntil: "domcontentloaded" });
  await page.waitForFunction(() => window.app?.graph && window.app?.extensionManager && window.LiteGraph, null, { timeout: 90000 });
  await page.waitForTimeout(1500);
  await page.evaluate(async (settings) => {
    for (const [id, value] of Object.entries(settings)) await window.app.extensionManager.setting.set(id, value);
  }, SETTINGS);
  return dismissDialogs(page);
}

// The first visit with a fresh profile opens the Templates overlay (it may open a little later):
// close whatever dialog is open, by its close button, else with Escape. Returns how many are left.
async function dismissDialogs(page) {
  const open = () => page.locator('[role="dialog"]:visible');
  for (let i = 0; i < 5 && await open().count(); i++) {
    const close = open().first().locator('button[aria-label*="close" i], button:has(.pi-times), .p-dialog-close-button').first();
    if (await close.count()) await close.click({ timeout: 2000 }).catch(() => page.keyboard.press("Escape"));
    else await page.keyboard.press("Escape");
    await page.waitForTimeout(400);
  }
  return open().count();
}

// In the page: load a workflow, report what the frontend made of it.
async function loadAndInspect(page, template) {
  return page.evaluate(async ({ ui, api }) => {
    const app = window.app;
    await app.loadGraphData(structuredClone(ui));
    const wanted = ui.nodes.map((n) => n.type);
    const missing = wanted.filter((type) => !window.LiteGraph.registered_node_types[type]);
    const loaded = app.graph.nodes.map((n) => n.type);
    const { output } = await app.graphToPrompt();
    const canonical = (inputs) => JSON.stringify(Object.entries(inputs ?? {}).sort(([a], [b]) => (a < b ? -1 : 1)));
    const differences = [];
    for (const [id, node] of Object.entries(api)) {
      const got = output[id];
      if (!got || got.class_type !== node.class_type || canonical(got.inputs) !== canonical(node.inputs)) {
        differences.push({ id, expected: node.inputs, frontend: got?.inputs });
      }
    }
    const extra = Object.keys(output).filter((id) => !(id in api));
    return { missing, loaded: loaded.length, expected: wanted.length, apiDifferences: differences, extraApiNodes: extra };
  }, template);
}

async function fitAndShoot(page, file) {
  const left = await dismissDialogs(page);
  if (left) throw new Error(`${left} dialog(s) still open over the graph`);
  await page.evaluate(() => window.app.extensionManager.command.execute("Comfy.Canvas.FitView"));
  await page.waitForTimeout(600);
  await page.screenshot({ path: file, type: "png" });
  return fs.statSync(file).size;
}

// Queue the loaded graph from the browser at the tiny size and wait for the receipts on the nodes.
async function runInBrowser(page, seed, tiny = TINY) {
  return page.evaluate(async ({ tiny, seed }) => {
    const app = window.app;
    const byType = (type) => app.graph.nodes.find((n) => n.type === type);
    const set = (node, name, value) => { node.widgets.find((w) => w.name === name).value = value; };
    const sampler = byType("VidMemVideoSampler");
    for (const [name, value] of Object.entries(tiny)) set(sampler, name, value);
    set(sampler, "seed", seed);
    const strategy = byType("VidMemMemoryStrategy"); // it plans at the Sampler's shape: nothing to set there
    if (strategy.widgets.find((w) => w.name === "offload").value === "block_swap") set(strategy, "blocks_to_swap", 1);
    // The tiny stand-ins have no published MagCache ratios ("auto" is refused there): calibrate, as
    // tests/workflow_runner.py shrink_for_tiny does.
    const cache = byType("VidMemStepCache");
    if (cache) set(cache, "mag_ratios", "calibrate");
    await app.queuePrompt(0, 1);
    const receipt = (node) => node.widgets?.find((w) => w.name === "vidmem_receipt")?.element?.title || null;
    const plan = (node) => { // the plan's tooltip: the verdict and the strategy planned, then the table
      const element = node.widgets?.find((w) => w.name === "vidmem_plan")?.element;
      return element?.title || element?.textContent || null;
    };
    const deadline = Date.now() + 240000;
    while (Date.now() < deadline) {
      const texts = ["VidMemMemoryStrategy", "VidMemVideoSampler", "VidMemVAEDecode"]
        .map((t) => (t === "VidMemMemoryStrategy" ? plan(byType(t)) : receipt(byType(t))));
      const queue = await (await fetch("/api/queue")).json();
      const idle = !queue.queue_running.length && !queue.queue_pending.length;
      if (texts.slice(1).every(Boolean) && idle) {
        const saved = app.graph.serialize().nodes.find((n) => n.type === "VidMemVideoSampler").widgets_values;
        return { strategy: texts[0], sampler: texts[1], decode: texts[2], samplerWidgetsSaved: saved.length };
      }
      await new Promise((resolve) => setTimeout(resolve, 500));
    }
    return { timeout: true };
  }, { tiny, seed });
}


// The Templates browser as a newcomer opens it (sidebar, Templates, the pack's category): which cards
// asked for their thumbnail, with what answer, and what each card says.
async function templatesBrowser(page, file) {
  const cards = [];
  const listen = (r) => { if (/\/workflow_templates\/vidmem\/[^/]+\.jpg$/.test(r.url())) cards.push([r.status(), decodeURIComponent(r.url().split("/").pop())]); };
  page.on("response", listen);
  await dismissDialogs(page);
  await page.getByText("Templates", { exact: true }).first().click();
  await page.waitForTimeout(2000);
  await page.locator('[role="dialog"]').getByText("vidmem", { exact: true }).first().click();
  await page.waitForTimeout(2500);
  await page.screenshot({ path: file, type: "png" });
  await scrollThroughDialog(page); // cards below the fold load their image only when scrolled into view
  const texts = await page.locator('[role="dialog"]').innerText();
  page.off("response", listen);
  await dismissDialogs(page);
  return { cards, text: texts, screenshot: file };
}

// Scroll every scrollable panel of the open dialog to its end, half a view at a time, then back.
async function scrollThroughDialog(page) {
  await page.evaluate(async () => {
    const dialog = document.querySelector('[role="dialog"]');
    const scrollable = [...(dialog?.querySelectorAll("*") ?? [])]
      .filter((e) => e.scrollHeight > e.clientHeight + 10 && /(auto|scroll)/.test(getComputedStyle(e).overflowY));
    for (const panel of scrollable) {
      for (let y = 0; y < panel.scrollHeight; y += panel.clientHeight / 2) {
        panel.scrollTop = y;
        await new Promise((resolve) => setTimeout(resolve, 300));
      }
      panel.scrollTop = 0;
    }
  });
  await page.waitForTimeout(1500);
}

// As the template opens (its saved view): the note's title bar starts below the workflow's name,
// which the frontend draws over the canvas's top left (the breadcrumb), and clear of the tabs.
async function noteClearOfTheName(page) {
  return page.evaluate(() => {
    const { ds } = window.app.canvas;
    const note = window.app.graph.nodes.find((n) => n.type === "Note");
    const title = window.LiteGraph.NODE_TITLE_HEIGHT ?? 30;
    const canvasTop = window.app.canvas.canvas.getBoundingClientRect().top;
    const noteTop = canvasTop + (note.pos[1] - title + ds.offset[1]) * ds.scale;
    const name = [...document.querySelectorAll(".p-breadcrumb")].map((e) => e.getBoundingClientRect()).filter((r) => r.height);
    const nameBottom = Math.max(0, ...name.map((r) => r.bottom));
    return { clear: noteTop >= nameBottom, noteTop, nameBottom };
  });
}

// In the page: the Strategy node's plan widget as text, its chart's markup and status ("none" until it answered).
async function planOnNode(page) {
  return page.evaluate(() => {
    const node = window.app.graph.nodes.find((n) => n.type === "VidMemMemoryStrategy");
    const element = node?.widgets?.find((w) => w.name === "vidmem_plan")?.element;
    // Its tooltip: the verdict, the strategy planned, the reasons, the table (the node shows the same, the
    // strategy aside: the widgets above say it).
    return { status: element?.dataset.status ?? "missing", text: element?.title || element?.textContent || "",
             chart: element?.querySelector("svg")?.outerHTML ?? "", table: element?.querySelector("pre")?.textContent ?? "" };
  });
}

async function waitForPlan(page, differentFrom = null, timeout = 30000) {
  const deadline = Date.now() + timeout;
  let plan = await planOnNode(page);
  while (Date.now() < deadline && (plan.status === "none" || (differentFrom !== null && plan.text === differentFrom))) {
    await page.waitForTimeout(250);
    plan = await planOnNode(page);
  }
  return plan;
}

async function setWidgets(page, type, values) {
  await page.evaluate(({ type, values }) => {
    const node = window.app.graph.nodes.find((n) => n.type === type);
    for (const [name, value] of Object.entries(values)) {
      const widget = node.widgets.find((w) => w.name === name);
      widget.value = value;
      widget.callback?.(value);
    }
    window.app.graph.setDirtyCanvas(true, true);
  }, { type, values });
}

const queued = []; // POST /prompt requests the page made
async function promptCount(page) {
  const queue = await page.evaluate(async () => (await (await fetch("/api/queue")).json()));
  return queued.length + queue.queue_running.length + queue.queue_pending.length;
}

// Load the template, give the Sampler the tiny model's size, and change blocks_to_swap twice:
// the plan on the Strategy node must change each time, and nothing may be queued meanwhile.
async function livePlanCheck(page, template, file) {
  await loadAndInspect(page, template);
  const prompts = await promptCount(page);
  const atTemplateSize = await waitForPlan(page);
  await setWidgets(page, "VidMemVideoSampler", tinyFor(template)); // the plan follows the Sampler's shape
  // Budgets near the tiny model's needs, so the bars and the budget line say something.
  await setWidgets(page, "VidMemMemoryStrategy", { vram_budget_gb: 1, ram_budget_gb: 2 });
  const steps = [await waitForPlan(page, atTemplateSize.text)];
  for (const blocks of [1, 2]) {
    await setWidgets(page, "VidMemMemoryStrategy", { blocks_to_swap: blocks });
    steps.push(await waitForPlan(page, steps.at(-1).text));
  }
  await showNode(page, "VidMemMemoryStrategy");
  await page.screenshot({ path: file, type: "png" });
  return { steps: steps.map(({ status, text, table, chart }) => ({ status, text, table, chartBytes: chart.length, chart })),
           queued: (await promptCount(page)) - prompts, screenshot: file };
}

// Zoom the canvas onto one node (and its neighbours) for a readable screenshot.
async function showNode(page, type) {
  await dismissDialogs(page);
  await page.evaluate((type) => {
    const app = window.app;
    const node = app.graph.nodes.find((n) => n.type === type);
    const canvas = app.canvas;
    const scale = Math.min(canvas.canvas.height / (node.size[1] + 220), 1.6);
    canvas.ds.scale = scale;
    canvas.ds.offset[0] = -node.pos[0] + 90 / scale;
    canvas.ds.offset[1] = -node.pos[1] + 140 / scale; // clear of the workflow tabs and the title bar
    canvas.setDirty(true, true);
  }, type);
  await page.waitForTimeout(800);
}

// An older Strategy node: width/height/frames between the widgets and the budgets, and a pipeline link.
function legacyOf(ui) {
  const old = structuredClone(ui);
  const strategy = old.nodes.find((n) => n.type === "VidMemMemoryStrategy");
  const sampler = old.nodes.find((n) => n.type === "VidMemVideoSampler");
  const shape = ["width", "height", "frames"].map((name) => sampler.widgets_values[2 + ["width", "height", "frames"].indexOf(name)]);
  strategy.widgets_values = [...strategy.widgets_values.slice(0, 12), ...shape, 6.5, 48];
  return old;
}

async function legacyCheck(page, template) {
  return page.evaluate(async (ui) => {
    await window.app.loadGraphData(ui);
    const { output } = await window.app.graphToPrompt();
    const strategy = Object.values(output).find((n) => n.class_type === "VidMemMemoryStrategy").inputs;
    return { vram_budget_gb: strategy.vram_budget_gb, ram_budget_gb: strategy.ram_budget_gb, width: strategy.width ?? null,
             loaded: window.app.graph.nodes.length, nodes: ui.nodes.length };
  }, legacyOf(template.ui));
}

// After a run: every node's box (title bar included) against every other's, and each group
// against the nodes it holds. Returns the problems found.
async function layoutProblems(page) {
  return page.evaluate(() => {
    const app = window.app;
    const title = window.LiteGraph.NODE_TITLE_HEIGHT ?? 30;
    const boxes = app.graph.nodes.map((n) => ({ id: n.id, type: n.type, x: n.pos[0], y: n.pos[1] - title, w: n.size[0], h: n.size[1] + title }));
    const problems = [];
    for (const [i, a] of boxes.entries()) {
      for (const b of boxes.slice(i + 1)) {
        const dx = Math.min(a.x + a.w, b.x + b.w) - Math.max(a.x, b.x);
        const dy = Math.min(a.y + a.h, b.y + b.h) - Math.max(a.y, b.y);
        if (dx > 0 && dy > 0) problems.push(`${a.type} overlaps ${b.type} by ${Math.round(dx)}x${Math.round(dy)} px`);
      }
    }
    for (const group of app.graph.groups ?? app.graph._groups ?? []) {
      const [gx, gy, gw, gh] = group._bounding ?? group.bounding;
      for (const box of boxes) {
        const inside = box.x >= gx && box.x < gx + gw && box.y >= gy && box.y < gy + gh;
        if (inside && (box.x + box.w > gx + gw || box.y + box.h > gy + gh)) problems.push(`${box.type} runs past its group "${group.title}"`);
        const head = gy + (group.font_size ?? 24) + 8; // the group's title band
        if (inside && box.y < head) problems.push(`${box.type} covers the title of group "${group.title}"`);
      }
    }
    return { problems, boxes };
  });
}

async function main() {
  const report = { templates: [], problems: [] };
  const profile = fs.mkdtempSync(path.join(os.tmpdir(), "vidmem-chromium-"));
  const context = await chromium.launchPersistentContext(profile, {
    executablePath: args.browser, headless: true, viewport: VIEWPORT,
    args: ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", "--no-first-run"],
  });
  const page = context.pages()[0] ?? await context.newPage();
  const consoleErrors = [];
  page.on("console", (m) => { if (m.type() === "error") consoleErrors.push(m.text()); });
  page.on("pageerror", (e) => consoleErrors.push(String(e)));
  const frees = [];
  page.on("request", (r) => { if (r.method() === "POST" && new URL(r.url()).pathname.endsWith("/free")) frees.push(r.postData()); });
  page.on("request", (r) => { if (r.method() === "POST" && new URL(r.url()).pathname.endsWith("/prompt")) queued.push(r.url()); });
  try {
    report.overlaysLeft = await openComfy(page);
    report.extensions = await page.evaluate(() => window.app.extensions.map((e) => e.name).filter((n) => n.startsWith("vidmem.")));
    if (!report.extensions.length) report.problems.push("no vidmem.* extension registered");
    await page.waitForFunction(() => /RAM/.test(document.querySelector("#vidmem-meter")?.textContent ?? ""), null, { timeout: 20000 })
      .catch(() => report.problems.push("the memory meter shows no RAM figure"));
    report.meter = await page.evaluate(() => document.querySelector("#vidmem-meter")?.textContent ?? null);
    report.helpPages = await page.evaluate(async () => {
      const ids = ["VidMemLoadPipeline", "VidMemMemoryStrategy", "VidMemVideoSampler", "VidMemVAEDecode", "VidMemFreeVRAM"];
      return Object.fromEntries(await Promise.all(ids.map(async (id) => [id, (await fetch(`/extensions/vidmem/docs/${id}.md`)).status])));
    });
    if (Object.values(report.helpPages).some((s) => s !== 200)) report.problems.push("a help page is not served");
    fs.mkdirSync(args.screenshots, { recursive: true });
    for (const template of templates()) {
      const result = await loadAndInspect(page, template);
      result.name = template.name;
      result.title = template.title;
      const plan = await waitForPlan(page);
      result.plan = plan.text.slice(0, 300);
      result.planStatus = plan.status;
      // At the template's size only the model's own limits may stop the plan (the host's tiny stand-ins
      // cannot trace Wan at 832x480, and have 1-2 blocks where the template swaps 16); never the loader's inputs.
      const ownLimit = plan.status === "error" && (/cannot run \w+ at \d+x\d+x\d+/.test(plan.text)
        || /is more than \S+ can place: its positional embedding covers/.test(plan.text)
        || /has learned positional embeddings and only generates \d+x\d+/.test(plan.text)
        || /blocks_to_swap=\d+ but this model's .* has \d+ blocks/.test(plan.text));
      if (!(plan.status === "ok" && plan.chart) && !ownLimit) report.problems.push(`${template.name}: no plan at the template's size (status ${plan.status}): ${result.plan}`);
      result.noteBelowName = await noteClearOfTheName(page);
      if (!result.noteBelowName.clear) report.problems.push(`${template.name}: the note starts under the workflow's name: ${JSON.stringify(result.noteBelowName)}`);
      result.screenshot = path.join(args.screenshots, `${template.name}.png`);
      result.bytes = await fitAndShoot(page, result.screenshot);
      // A size and block count the stand-ins (2 blocks) can run: there the plan must draw.
      await setWidgets(page, "VidMemVideoSampler", tinyFor(template));
      await page.evaluate(() => {
        const swap = window.app.graph.nodes.find((n) => n.type === "VidMemMemoryStrategy")?.widgets.find((w) => w.name === "blocks_to_swap");
        if (swap && swap.value > 1) { swap.value = 1; swap.callback?.(1); }
      });
      const tinyPlan = await waitForPlan(page, plan.text);
      result.tinyPlanStatus = tinyPlan.status;
      if (tinyPlan.status !== "ok" || !tinyPlan.chart) report.problems.push(`${template.name}: the Strategy node shows no plan chart at the tiny size (status ${tinyPlan.status}): ${tinyPlan.text.slice(0, 300)}`);
      report.templates.push(result);
      if (result.missing.length) report.problems.push(`${template.name}: missing node types ${result.missing}`);
      if (result.loaded !== result.expected) report.problems.push(`${template.name}: ${result.loaded} of ${result.expected} nodes loaded`);
      if (result.apiDifferences.length || result.extraApiNodes.length) {
        report.problems.push(`${template.name}: the frontend's graphToPrompt differs from workflows/api/${template.name}.json`);
      }
    }
    if (args.thumbnails) {
      const cards = await writeCards(context, args.workflows, args.thumbnails);
      for (const card of cards) {
        const result = report.templates.find((t) => t.title === card.title);
        if (result) result.thumbnail = card.file;
        if (card.overflow.length) report.problems.push(`${card.title}: card text cut: ${card.overflow}`);
      }
    }
    report.templatesBrowser = await templatesBrowser(page, path.join(args.screenshots, "templates_browser.png"));
    const served = report.templatesBrowser.cards.filter(([status]) => status === 200).map(([, name]) => name.slice(0, -4));
    for (const template of templates()) {
      if (!served.includes(template.title)) report.problems.push(`Templates browser: no card image for "${template.title}"`);
    }
    const runTemplate = templates().find((t) => t.name === RUNS[0]);
    if (runTemplate) {
      report.livePlan = await livePlanCheck(page, runTemplate, path.join(args.screenshots, "strategy_live_plan.png"));
      const texts = report.livePlan.steps.map((step) => step.text);
      if (new Set(texts).size !== texts.length) report.problems.push("the plan text did not change with blocks_to_swap");
      if (report.livePlan.steps[1].chart === report.livePlan.steps[0].chart) report.problems.push("the plan chart did not change with blocks_to_swap");
      if (report.livePlan.steps.slice(1).some((step) => step.status !== "ok")) report.problems.push("no plan for blocks_to_swap 1 or 2 at the tiny size");
      if (report.livePlan.queued !== 0) report.problems.push("something was queued while the plan changed");
      report.legacy = await legacyCheck(page, runTemplate);
      if (report.legacy.vram_budget_gb !== 6.5 || report.legacy.ram_budget_gb !== 48 || report.legacy.width !== null) {
        report.problems.push(`an older Strategy layout loads with the wrong budgets: ${JSON.stringify(report.legacy)}`);
      }
    }
    report.runs = [];
    for (const template of templates().filter((t) => RUNS.includes(t.name) || args["run-all"])) {
      await loadAndInspect(page, template);
      const run = await runInBrowser(page, Date.now() % 2 ** 31, tinyFor(template));
      run.name = template.name;
      report.runs.push(run);
      if (run.timeout) {
        report.problems.push(`${template.name}: no receipts on the nodes within 240 s`);
        continue;
      }
      await page.evaluate(() => window.app.extensionManager.command.execute("Comfy.Canvas.FitView"));
      await page.waitForTimeout(3000); // the video preview sizes its node once its metadata loads
      const layout = await layoutProblems(page);
      run.layoutProblems = layout.problems;
      report.problems.push(...layout.problems.map((p) => `${template.name} after a run: ${p}`));
      if (RUNS.includes(template.name)) {
        run.screenshot = path.join(args.screenshots, `${template.name}_receipts.png`);
        run.bytes = await fitAndShoot(page, run.screenshot);
      }
      if (template.name === RUNS[0]) {
        report.run = run;
        if (!/denoise/.test(run.sampler) || !/swap cost/.test(run.sampler)) report.problems.push("sampler receipt lacks denoise/swap cost");
        if (run.samplerWidgetsSaved !== template.ui.nodes.find((n) => n.type === "VidMemVideoSampler").widgets_values.length) {
          report.problems.push("the receipt widget leaked into the saved workflow's widgets_values");
        }
        report.meterBox = await page.evaluate(() => document.querySelector("#vidmem-meter")?.getBoundingClientRect().toJSON());
      }
    }
    if (args.run) {
      await page.evaluate(() => window.app.extensionManager.command.execute("vidmem.freeVram"));
      await page.waitForTimeout(1000);
      report.freeRequests = frees;
      if (!frees.includes(JSON.stringify({ unload_models: true, free_memory: true }))) report.problems.push("Free VRAM now did not POST /free");
    }
  } finally {
    report.consoleErrors = consoleErrors.filter((e) => /vidmem/i.test(e));
    await context.close();
    fs.rmSync(profile, { recursive: true, force: true });
  }
  if (report.consoleErrors.length) report.problems.push("console errors mention vidmem");
  console.log(JSON.stringify(report, null, 1));
  process.exit(report.problems.length ? 1 : 0);
}

main().catch((error) => { console.error(error); process.exit(2); });
