// Run with: node --test tests/js/
// One Strategy feeding several Samplers, and a plan route that answers an error that is not JSON.
import assert from "node:assert/strict";
import { test } from "node:test";

import { planFromResponse, plannedSampler } from "../../web/js/vidmem_format.js";

// A Sampler as the graph holds it: widgets by name, and its inputs (a converted widget has `widget` and a link).
const sampler = (title, width, height, frames, inputs = []) => ({ comfyClass: "VidMemVideoSampler", title, inputs,
  widgets: Object.entries({ width, height, frames }).map(([name, value]) => ({ name, value })) });
const value = (node, name) => node.widgets.find((w) => w.name === name)?.value;

test("of several Samplers the plan is for the largest width*height*frames, and the chart says so", () => {
  const draft = sampler("draft", 832, 480, 81);
  const final = sampler("final", 1280, 720, 81);
  const { sampler: chosen, line } = plannedSampler([draft, final], value);
  assert.equal(chosen, final, "the first Sampler (the small draft) must not be the one planned");
  assert.equal(line, `plans Sampler "final" at 1280x720x81 (the largest of 2 this Strategy feeds); give each Sampler its own Strategy to plan each`);
  // copies of one Sampler share its title: the node number tells them apart
  const copy = { ...sampler("final", 1280, 720, 121), id: 10 };
  assert.match(plannedSampler([{ ...final, id: 3 }, copy], value).line, /^plans Sampler "final" #10 at 1280x720x121 \(/);
  // more frames make the larger run even at a smaller size
  assert.equal(plannedSampler([final, sampler("long", 832, 480, 241)], value).sampler.title, "long");
});

test("a muted or bypassed Sampler is not planned while another runs", () => {
  const draft = sampler("draft", 832, 480, 81);
  for (const mode of [2, 4]) {
    const off = { ...sampler("final", 1280, 720, 81), mode };
    assert.deepEqual(plannedSampler([draft, off], value), { sampler: draft, line: "" });
    const other = sampler("other", 480, 320, 33);
    assert.match(plannedSampler([draft, off, other], value).line, /^plans Sampler "draft" at 832x480x81 \(the largest of 2 /);
    assert.equal(plannedSampler([off], value).sampler, off); // none runs: the chart still names one
  }
});

test("ties go to the first Sampler; one Sampler needs no line; none gives none", () => {
  const first = sampler("first", 832, 480, 81);
  const second = sampler("second", 480, 832, 81);
  assert.equal(plannedSampler([first, second], value).sampler, first);
  assert.deepEqual(plannedSampler([first], value), { sampler: first, line: "" });
  assert.deepEqual(plannedSampler([], value), { sampler: null, line: "" });
});

test("a Sampler whose size comes from a link is the one taken, so the chart names the link, not a smaller plan", () => {
  const linked = sampler("final", 1280, 720, 81, [{ name: "frames", link: 5, widget: { name: "frames" } }]);
  const sources = new Map([[linked, { comfyClass: "PrimitiveInt" }]]);
  const sourceOf = (node) => sources.get(node) ?? null;
  const draft = sampler("draft", 832, 480, 81);
  const { sampler: chosen, line } = plannedSampler([draft, sampler("small", 64, 64, 9), linked], value, sourceOf);
  assert.equal(chosen, linked);
  assert.match(line, /^plans Sampler "final" \(its size comes from a link, so it cannot be compared with the other 2\)/);
  // a Primitive node copies its value onto the widget: that one is compared as it is
  sources.set(linked, { comfyClass: "PrimitiveNode" });
  assert.equal(plannedSampler([sampler("big", 1920, 1080, 121), linked], value, sourceOf).sampler.title, "big");
});

test("a plan route error that is not JSON reads as its HTTP status, not a JSON parse error", async () => {
  const plain = new Response("500 Internal Server Error\n\nServer got itself in trouble", {
    status: 500, headers: { "Content-Type": "text/plain; charset=utf-8" } });
  await assert.rejects(planFromResponse(plain), { message: "HTTP 500" });
  const error = { status: "error", input: null, error: "planning failed: KeyError: 'blocks'" };
  const json = new Response(JSON.stringify(error), { status: 500, headers: { "Content-Type": "application/json; charset=utf-8" } });
  assert.deepEqual(await planFromResponse(json), error, "the route's own JSON error is shown with its words");
  const ok = new Response(JSON.stringify({ status: "ok" }), { headers: { "Content-Type": "application/json" } });
  assert.deepEqual(await planFromResponse(ok), { status: "ok" });
});
