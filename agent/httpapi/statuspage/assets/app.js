// latentmesh status page: reads the admin JSON every few seconds and draws
// it. Every value from the mesh goes into the page as text (textContent),
// never as markup: prompts are user input.
"use strict";

const POLL_MS = 2000;
const JOBS = 20;
const TOKEN_KEY = "latentmesh-admin-token";
const STAGES = ["encode", "denoise", "decode"];
const CLASSES = ["interactive", "standard", "batch"];
// The phases of one stage on the Gantt chart, as its StageRecord gives them.
const PHASES = ["queued", "claimed", "transferred", "ran", "committed"];

const $ = (id) => document.getElementById(id);
let prev = null; // the last status and when it came, for rates
let timer = 0;

// el builds an element: attrs are attributes (or "text"), kids elements or strings.
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "text") e.textContent = v;
    else if (k === "style") Object.assign(e.style, v); // CSSOM: the policy allows no style attributes
    else if (v !== undefined && v !== null) e.setAttribute(k, v);
  }
  for (const k of kids) e.append(k);
  return e;
}

function fill(tbody, rows) { tbody.replaceChildren(...rows); }

function bytes(n) {
  if (!n) return "0 B";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + u[i];
}

function ms(v) { return v < 10 ? v.toFixed(2) + " ms" : v < 1000 ? v.toFixed(0) + " ms" : (v / 1000).toFixed(2) + " s"; }

async function read(path) {
  const headers = {};
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = "Bearer " + token;
  const resp = await fetch(path, { headers, cache: "no-store" });
  if (resp.status === 401) throw { unauthorized: true };
  const body = await resp.json().catch(() => null);
  if (!resp.ok) throw new Error(path + ": " + resp.status + " " + ((body && body.error && body.error.message) || ""));
  return body;
}

async function refresh() {
  clearTimeout(timer);
  try {
    const [status, recent] = await Promise.all([read("/v1/admin/status"), read("/v1/admin/jobs?limit=" + JOBS)]);
    $("login").hidden = true;
    $("error").hidden = true;
    $("content").hidden = false;
    draw(status, recent);
  } catch (e) {
    if (e && e.unauthorized) {
      $("content").hidden = true;
      $("login").hidden = false;
      $("login-error").textContent = sessionStorage.getItem(TOKEN_KEY) ? "that token was refused" : "";
      $("token").focus();
      return; // no polling until a token is given
    }
    $("error").textContent = "refresh failed: " + (e && e.message ? e.message : e);
    $("error").hidden = false;
  }
  if ($("live").checked) timer = setTimeout(refresh, POLL_MS);
}

function draw(st, recent) {
  const now = Date.now();
  $("self").textContent = "node " + st.node.id + (st.node.version ? " · " + st.node.version : "");
  $("updated").textContent = "updated " + new Date(now).toLocaleTimeString();
  drawNodes(st);
  drawQueues(st.queues || {});
  drawTransfers(st, now);
  drawStore(st.store || {});
  drawJobs(recent.jobs || [], now);
  prev = { st, at: now };
}

function drawNodes(st) {
  const peers = (st.peers || []).slice().sort((a, b) => a.id.localeCompare(b.id));
  fill($("nodes").tBodies[0], peers.map((p) => {
    const health = !p.alive ? "down" : p.suspect ? "suspect" : "alive";
    const credits = (p.roles || []).map((r) => r + " " + ((p.free_credits || {})[r] ?? 0) + "/" + ((p.slots || {})[r] ?? "?")).join(", ");
    const load = Math.max(0, p.load || 0);
    return el("tr", { "data-node": p.id, class: p.id === st.node.id ? "self" : "" },
      el("td", { text: p.id }),
      el("td", { class: "health " + health, text: health }),
      el("td", { text: (p.roles || []).join(", ") }),
      el("td", { text: (p.models && p.models.length) ? p.models.join(", ") : "built-in" }),
      el("td", { text: credits }),
      el("td", {}, el("span", { class: "meter" }, el("span", { style: { width: Math.min(100, load * 100).toFixed(0) + "%" } })), " " + load.toFixed(2)),
      el("td", { text: bytes(p.store_free) }));
  }));
}

function drawQueues(queues) {
  fill($("queues").tBodies[0], STAGES.map((s) => {
    const q = queues[s] || {};
    const by = q.by_class || {};
    return el("tr", { "data-stage": s },
      el("td", { text: s }), el("td", { text: q.queued ?? 0 }), el("td", { text: q.running ?? 0 }),
      ...CLASSES.map((c) => el("td", { text: by[c] ?? 0 })));
  }));
}

// rate is the change of a counter per second since the last poll.
function rate(kind, t, v, now) {
  if (!prev) return "–";
  const before = ((prev.st.data_plane || {})[kind] || {})[t] || 0;
  return ((v - before) / ((now - prev.at) / 1000)).toFixed(1);
}

function drawTransfers(st, now) {
  const d = st.data_plane || {};
  const pulls = d.pulls_by_transport || {}, store = d.store_pulls_by_transport || {};
  const names = [...new Set([...Object.keys(pulls), ...Object.keys(store)])].sort();
  $("transport").textContent = "(" + (d.transport || "?") + ")";
  fill($("transfers").tBodies[0], names.length ? names.map((t) => el("tr", { "data-transport": t },
    el("td", { text: t }),
    el("td", { text: pulls[t] || 0 }), el("td", { text: rate("pulls_by_transport", t, pulls[t] || 0, now) }),
    el("td", { text: store[t] || 0 }), el("td", { text: rate("store_pulls_by_transport", t, store[t] || 0, now) })))
    : [el("tr", {}, el("td", { colspan: 5, class: "muted", text: "no pulls yet" }))]);
  $("held").textContent = "holding " + (d.held_payloads || 0) + " payloads (" + bytes(d.held_bytes) + ")" +
    (d.arena_bytes ? " · arena " + bytes(d.arena_bytes - d.arena_free) + " of " + bytes(d.arena_bytes) + " used" : "") +
    " · relayed " + (d.relayed || 0) + " · heap fallbacks " + (d.heap_fallbacks || 0);
}

function usage(label, used, cap) {
  const pct = cap ? Math.min(100, (100 * used) / cap) : 0;
  return el("div", { class: "usage" }, el("span", { text: label }),
    el("span", { class: "meter wide" }, el("span", { style: { width: pct.toFixed(1) + "%" } })),
    el("span", { text: bytes(used) + " / " + (cap ? bytes(cap) : "–") }));
}

function drawStore(s) {
  $("store").replaceChildren(
    usage("memory", s.memory_used || 0, s.memory_capacity || 0),
    usage("disk", s.disk_used || 0, s.disk_capacity || 0),
    el("p", { class: "muted", text: "copies " + (s.copies || 0) + " (staged " + (s.staged || 0) + ") · puts " + (s.puts || 0) +
      " · gets " + (s.gets || 0) + " · spills " + (s.spills || 0) + " · evictions " + (s.evictions || 0) + " · lost " + (s.lost || 0) }));
}

// phases turns a job record into Gantt bars: per committed stage, from when
// its task was queued (the job's creation, or the previous stage's commit)
// to its commit. A stage still queued or running gets one open bar to now.
function phases(job, now) {
  const t = (s) => (s ? Date.parse(s) : NaN);
  const bars = [];
  let enq = t(job.created_at);
  for (const s of STAGES) {
    const r = (job.stages || {})[s];
    if (!r) {
      if (job.stage === s && !isNaN(enq)) {
        const p = job.progress;
        bars.push({ stage: s, phase: p ? "running" : "waiting", from: enq, to: Math.max(enq, now),
          node: p ? p.node : "", note: p ? "step " + p.step + " of " + p.total : "not claimed yet" });
      }
      break;
    }
    const start = t(r.started_at), end = t(r.finished_at);
    const claimed = start + (r.claim_ms || 0);
    const pulled = claimed + (r.pull_ms || 0);
    const ran = Math.min(claimed + (r.ms || 0), end);
    const mode = job.transfer_mode || "agent default";
    const seg = (phase, from, to, note, transport) => bars.push({ stage: s, phase, from, to: Math.max(from, to), node: r.node, note, transport: transport || "" });
    seg("queued", Math.min(enq, start), start, "waited for a worker");
    seg("claimed", start, claimed, "claim transaction " + ms(r.claim_ms || 0) + ", attempt " + r.attempt);
    seg("transferred", claimed, pulled, s === "encode" ? "no input to pull" :
      "pulled input " + ms(r.pull_ms || 0) + " by " + (r.transport || "?") + " (transfer mode " + mode + ")", r.transport);
    seg("ran", pulled, ran, "worked " + ms(Math.max(0, (r.ms || 0) - (r.pull_ms || 0))));
    seg("committed", ran, end, "commit " + ms(end - ran));
    enq = end;
  }
  return bars;
}

function drawLegend() {
  $("legend").replaceChildren(...PHASES.concat(["running", "waiting"]).map((p) =>
    el("span", { class: "key" }, el("span", { class: "bar " + p }), p)));
}

function drawJobs(js, now) {
  if (!js.length) {
    $("jobs").replaceChildren(el("p", { class: "muted", text: "no jobs seen yet" }));
    return;
  }
  $("jobs").replaceChildren(...js.map((job) => {
    const bars = phases(job, now);
    const t0 = Date.parse(job.created_at);
    const t1 = Math.max(t0 + 1, ...bars.map((b) => b.to));
    const span = t1 - t0;
    const track = el("div", { class: "track" });
    for (const s of STAGES) { // one lane per stage, so a stage's bars line up
      const lane = el("div", { class: "lane", "data-stage": s }, el("span", { class: "lane-name", text: s }));
      for (const b of bars.filter((b) => b.stage === s)) {
        const left = (100 * (b.from - t0)) / span, width = (100 * (b.to - b.from)) / span;
        lane.append(el("span", {
          class: "bar " + b.phase, "data-job": job.id, "data-stage": s, "data-phase": b.phase, "data-node": b.node, "data-transport": b.transport,
          style: { left: left.toFixed(3) + "%", width: width.toFixed(3) + "%" },
          title: s + " " + b.phase + " on " + (b.node || "?") + ": " + ms(b.to - b.from) + " — " + b.note,
        }));
      }
      const own = bars.filter((b) => b.stage === s);
      if (own.length) { // the node's name after the stage's bars, or before them where no room is left
        const from = (100 * (own[0].from - t0)) / span, to = (100 * (own[own.length - 1].to - t0)) / span;
        const pos = to < 85 ? { left: (to + 0.5).toFixed(3) + "%" } : { right: (100.5 - from).toFixed(3) + "%" };
        const via = (bars.find((b) => b.stage === s && b.phase === "transferred") || {}).transport;
        lane.append(el("span", { class: "bar-label", style: pos, text: own[0].node + (via ? " · " + via : "") }));
      }
      track.append(lane);
    }
    const prompt = (job.spec && job.spec.prompt) || "";
    return el("div", { class: "job", "data-job": job.id },
      el("div", { class: "job-head" },
        el("code", { text: job.id }),
        el("span", { class: "state " + job.state, text: job.state }),
        el("span", { class: "muted", text: (job.class || "") + " · " + ms(span) + (bars.some((b) => b.phase === "running" || b.phase === "waiting") ? " so far" : "") + " · grid " + ms(span / 10) + " · " + new Date(t0).toLocaleTimeString() }),
        el("span", { class: "prompt", text: prompt.length > 80 ? prompt.slice(0, 79) + "…" : prompt }),
        job.error ? el("span", { class: "bad", text: job.error.code + ": " + job.error.message }) : ""),
      track);
  }));
}

document.addEventListener("DOMContentLoaded", () => {
  drawLegend();
  $("login").addEventListener("submit", (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
    $("token").value = "";
    refresh();
  });
  $("live").addEventListener("change", () => { if ($("live").checked) refresh(); else clearTimeout(timer); });
  refresh();
});
