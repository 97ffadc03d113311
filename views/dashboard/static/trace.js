// A small offline viewer of the trace-event JSON that `rl-controller trace` writes (the
// same file, from /api/runs/RUN/trace): one row per track, slices as bars, the
// controller's instants as marks, each group's flow as a line between the slices it
// binds to, and the counters below. For the full thing open the file in Perfetto.
"use strict";

window.rlcTrace = { drawn: false, slices: 0, flows: 0 };

const COLORS = [["generate", "#4c7fd1"], ["microbatch", "#2f855a"], ["finish", "#1c5a3a"],
  ["step", "#cfd8e3"], ["publish", "#dd6b20"], ["checkpoint", "#805ad5"], ["evict", "#c0392b"],
  ["open at end", "#a0aec0"]];

function colorOf(name) {
  const hit = COLORS.find(([prefix]) => name.startsWith(prefix));
  return hit ? hit[1] : "#718096";
}

async function showTrace(runId, steps) {
  const link = document.getElementById("run-link");
  link.textContent = runId;
  link.href = "/run/" + encodeURIComponent(runId);
  const api = `/api/runs/${encodeURIComponent(runId)}/trace?steps=${encodeURIComponent(steps)}`;
  document.getElementById("download").href = api;
  const doc = await (await fetch(api)).json();
  if (doc.error) { document.getElementById("trace-note").textContent = doc.error; return; }
  draw(doc);
}

function tracks(doc) {
  const proc = {}, thread = {}, order = {};
  for (const e of doc.traceEvents) {
    if (e.ph !== "M") continue;
    if (e.name === "process_name") proc[e.pid] = e.args.name;
    if (e.name === "thread_name") thread[e.pid + "/" + e.tid] = e.args.name;
    if (e.name === "thread_sort_index") order[e.pid + "/" + e.tid] = e.args.sort_index;
  }
  const label = (pid, tid) => `${proc[pid] || pid} · ${thread[pid + "/" + tid] || tid}`;
  const keys = Object.keys(thread).sort((a, b) => {
    const [pa, ta] = a.split("/").map(Number), [pb, tb] = b.split("/").map(Number);
    return pa - pb || (order[a] ?? ta) - (order[b] ?? tb);
  });
  return { label, rows: keys.map((k) => label(...k.split("/").map(Number))) };
}

function draw(doc) {
  const { label, rows } = tracks(doc);
  const ms = (us) => us / 1000;
  const slices = [], open = {}, flows = {}, instants = [], counters = {};
  for (const e of doc.traceEvents) {
    const key = e.pid + "/" + e.tid;
    if (e.ph === "B") (open[key] = open[key] || []).push(e);
    else if (e.ph === "E") { const b = open[key].pop(); slices.push({ ...b, dur: e.ts - b.ts }); }
    else if (e.ph === "X") slices.push(e);
    else if (e.ph === "i") instants.push(e);
    else if ("stf".includes(e.ph)) (flows[e.id] = flows[e.id] || []).push(e);
    else if (e.ph === "C") for (const [k, v] of Object.entries(e.args))
      (counters[e.name + " " + k] = counters[e.name + " " + k] || []).push([ms(e.ts), v]);
  }
  slices.sort((a, b) => (a.name.startsWith("step") ? 0 : 1) - (b.name.startsWith("step") ? 0 : 1));
  const bars = { type: "bar", orientation: "h", name: "slices", base: [], x: [], y: [], text: [],
    hovertext: [], textposition: "inside", insidetextanchor: "start",
    marker: { color: [], line: { width: 0 } }, width: [], hoverinfo: "text", xaxis: "x", yaxis: "y" };
  const LABELLED = ["generate", "publish", "checkpoint", "step"];
  for (const s of slices) {
    bars.base.push(ms(s.ts)); bars.x.push(Math.max(ms(s.dur), 0.001)); bars.y.push(label(s.pid, s.tid));
    bars.hovertext.push(s.name); bars.marker.color.push(colorOf(s.name));
    bars.text.push(LABELLED.some((p) => s.name.startsWith(p)) ? s.name : "");
    bars.width.push(s.name.startsWith("step") ? 0.85 : 0.55);
  }
  const arrows = { type: "scatter", mode: "lines", name: "group flows", x: [], y: [], hoverinfo: "skip",
    line: { color: "rgba(45,55,72,0.35)", width: 1 }, xaxis: "x", yaxis: "y" };
  for (const points of Object.values(flows)) {
    for (const p of points) { arrows.x.push(ms(p.ts)); arrows.y.push(label(p.pid, p.tid)); }
    arrows.x.push(null); arrows.y.push(null);
  }
  const marks = { type: "scatter", mode: "markers", name: "decisions", x: instants.map((e) => ms(e.ts)),
    y: instants.map((e) => label(e.pid, e.tid)), text: instants.map((e) => e.name),
    hoverinfo: "text", marker: { symbol: "line-ns-open", size: 10, color: "#2d3748" },
    xaxis: "x", yaxis: "y" };
  const lines = Object.entries(counters).map(([name, pts]) => ({ type: "scatter", mode: "lines",
    name, x: pts.map((p) => p[0]), y: pts.map((p) => p[1]), line: { shape: "hv" },
    xaxis: "x", yaxis: "y2" }));
  Plotly.newPlot("trace-chart", [bars, arrows, marks, ...lines], {
    margin: { l: 190, r: 20, t: 10, b: 40 }, barmode: "overlay", showlegend: true,
    legend: { orientation: "h", y: -0.08 }, font: { size: 11 },
    xaxis: { title: "ms since the run's first event", anchor: "y2" },
    yaxis: { domain: [0.3, 1], categoryorder: "array", categoryarray: rows.slice().reverse(), type: "category" },
    yaxis2: { domain: [0, 0.24], title: "counters" },
  }, { displayModeBar: false, responsive: true });
  document.getElementById("trace-note").textContent =
    `${slices.length} slices, ${Object.keys(flows).length} group flows, positions ` +
    `${doc.metadata.first_position}..${doc.metadata.last_position}`;
  Object.assign(window.rlcTrace, { drawn: true, slices: slices.length, flows: Object.keys(flows).length });
}
