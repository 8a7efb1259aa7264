// Load every vidmem UI template in the real ComfyUI frontend (headless Chromium driven by
// playwright-core), check it, screenshot it, and run one template from the browser to see the
// extension put its receipts on the nodes. Run by tests/test_web_browser.py; usage:
//
//   NODE_PATH=/path/to/node_modules node tests/browser/check_templates.mjs \
//     --url http://127.0.0.1:8188 --browser /usr/bin/chromium --workflows workflows \
//     --screenshots docs/screenshots [--run wan21_t2v_blockswap]
//
// Prints one JSON report on stdout; exit status 0 when every check passed.
import fs from "node:fs";
import { createRequire } from "node:module";
import os from "node:os";
import path from "node:path";
import { parseArgs } from "node:util";

const require = createRequire(import.meta.url);
const { chromium } = require("playwright-core"); // resolved through NODE_PATH (not a repo dependency)

const { values: args } = parseArgs({
  options: {
    url: { type: "string" }, browser: { type: "string" }, workflows: { type: "string" },
    screenshots: { type: "string" }, run: { type: "string" },
  },
});
const TINY = { width: 32, height: 32, frames: 9, steps: 2 }; // the tiny stand-in models' size
const VIEWPORT = { width: 1600, height: 900 };
// Readable screenshots: full detail at the fitted zoom, no minimap over the graph.
const SETTINGS = { "LiteGraph.Canvas.MinFontSizeForLOD": 0, "Comfy.Minimap.Visible": false };

function templates() {
  return fs.readdirSync(args.workflows).filter((f) => f.endsWith(".json")).sort()
    .map((f) => ({ name: f.slice(0, -5), ui: JSON.parse(fs.readFileSync(path.join(args.workflows, f), "utf8")),
                   api: JSON.parse(fs.readFileSync(path.join(args.workflows, "api", f), "utf8")) }));
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
async function runInBrowser(page, seed) {
  return page.evaluate(async ({ tiny, seed }) => {
    const app = window.app;
    const byType = (type) => app.graph.nodes.find((n) => n.type === type);
    const set = (node, name, value) => { node.widgets.find((w) => w.name === name).value = value; };
    const sampler = byType("VidMemVideoSampler");
    for (const [name, value] of Object.entries(tiny)) set(sampler, name, value);
    set(sampler, "seed", seed);
    const strategy = byType("VidMemMemoryStrategy");
    for (const name of ["width", "height", "frames"]) set(strategy, name, tiny[name]); // the size it plans for
    if (strategy.widgets.find((w) => w.name === "offload").value === "block_swap") set(strategy, "blocks_to_swap", 1);
    await app.queuePrompt(0, 1);
    const receipt = (node) => node.widgets?.find((w) => w.name === "vidmem_receipt")?.element?.textContent ?? null;
    const deadline = Date.now() + 240000;
    while (Date.now() < deadline) {
      const texts = ["VidMemMemoryStrategy", "VidMemVideoSampler", "VidMemVAEDecode", "VidMemFreeVRAM"]
        .map((t) => receipt(byType(t)));
      const queue = await (await fetch("/api/queue")).json();
      const idle = !queue.queue_running.length && !queue.queue_pending.length;
      if (texts.every(Boolean) && idle) {
        const saved = app.graph.serialize().nodes.find((n) => n.type === "VidMemVideoSampler").widgets_values;
        return { strategy: texts[0], sampler: texts[1], decode: texts[2], free: texts[3], samplerWidgetsSaved: saved.length };
      }
      await new Promise((resolve) => setTimeout(resolve, 500));
    }
    return { timeout: true };
  }, { tiny: TINY, seed });
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
      result.screenshot = path.join(args.screenshots, `${template.name}.png`);
      result.bytes = await fitAndShoot(page, result.screenshot);
      report.templates.push(result);
      if (result.missing.length) report.problems.push(`${template.name}: missing node types ${result.missing}`);
      if (result.loaded !== result.expected) report.problems.push(`${template.name}: ${result.loaded} of ${result.expected} nodes loaded`);
      if (result.apiDifferences.length || result.extraApiNodes.length) {
        report.problems.push(`${template.name}: the frontend's graphToPrompt differs from workflows/api/${template.name}.json`);
      }
    }
    if (args.run) {
      const template = templates().find((t) => t.name === args.run);
      await loadAndInspect(page, template);
      report.run = await runInBrowser(page, Date.now() % 2 ** 31);
      report.run.screenshot = path.join(args.screenshots, `${args.run}_receipts.png`);
      if (report.run.timeout) report.problems.push(`${args.run}: no receipts on the nodes within 240 s`);
      else {
        report.run.bytes = await fitAndShoot(page, report.run.screenshot);
        if (!/denoise/.test(report.run.sampler) || !/swap cost/.test(report.run.sampler)) report.problems.push("sampler receipt lacks denoise/swap cost");
        if (report.run.samplerWidgetsSaved !== template.ui.nodes.find((n) => n.type === "VidMemVideoSampler").widgets_values.length) {
          report.problems.push("the receipt widget leaked into the saved workflow's widgets_values");
        }
      }
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
