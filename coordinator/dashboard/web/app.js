// Lockstep's dashboard: renders the page in the address bar (/, /jobs/ID, /workers) from the
// coordinator's JSON API (protobuf's JSON mapping of the gRPC messages: lowerCamelCase names,
// 64-bit integers as strings, enums by name) and polls it. Every value from the API goes into
// the page as text, never as markup.
"use strict";

const POLL_MS = 1500;
const ENDED_POLL_MS = 10000;  // a finished job changes no more
const REQUEST_TIMEOUT_MS = 10000;
const TOKEN_KEY = "lockstep-token";
const STATES = ["RUNNING", "RECONFIGURING", "PENDING", "SUSPENDED", "SUCCEEDED", "FAILED", "CANCELLED"];
const COLORS = { train: "#3b6cf6", validation: "#e8910c", throughput: "#0f9d76" };

// ---- Small helpers ----

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "text") el.textContent = value;
    else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else if (key === "style") el.style.cssText = value;  // CSSOM: allowed by the page's CSP
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

const num = (v) => (v === undefined || v === null || v === "" ? 0 : Number(v));
// A chart value: protobuf's JSON writes NaN and infinities as strings; uPlot gets null (a gap).
const plotValue = (v) => { const x = Number(v); return Number.isFinite(x) ? x : null; };
const stateName = (s) => String(s || "").replace("JOB_STATE_", "") || "UNKNOWN";
const terminal = (s) => ["SUCCEEDED", "FAILED", "CANCELLED"].includes(stateName(s));

function fmt(value, digits = 0) {
  if (!Number.isFinite(value)) return "–";
  return value.toLocaleString("en-US", { maximumFractionDigits: digits, minimumFractionDigits: digits });
}
function fmtLoss(value) {
  if (!Number.isFinite(value) || value === 0) return "–";
  return value >= 100 ? fmt(value, 1) : value.toPrecision(4);
}
function fmtRate(value) {
  if (!Number.isFinite(value) || value <= 0) return "–";
  if (value >= 1e6) return fmt(value / 1e6, 2) + "M";
  if (value >= 1e4) return fmt(value / 1e3, 1) + "k";
  return fmt(value, value >= 100 ? 0 : 1);
}
function fmtDuration(ms) {
  ms = num(ms);
  if (ms <= 0) return "–";
  if (ms < 1000) return fmt(ms) + " ms";
  const s = ms / 1000;
  if (s < 60) return fmt(s, s < 10 ? 2 : 1) + " s";
  const m = Math.floor(s / 60), rest = Math.round(s % 60);
  if (m < 60) return m + "m " + String(rest).padStart(2, "0") + "s";
  return Math.floor(m / 60) + "h " + String(m % 60).padStart(2, "0") + "m";
}
function fmtBytes(bytes) {
  bytes = num(bytes);
  if (bytes <= 0) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (bytes >= 1024 && i < units.length - 1) { bytes /= 1024; i++; }
  return fmt(bytes, i === 0 ? 0 : 1) + " " + units[i];
}
function clock(ms) {
  ms = num(ms);
  if (ms <= 0) return "–";
  return new Date(ms).toLocaleTimeString("en-GB", { hour12: false });
}
function ago(ms) {
  ms = num(ms);
  if (ms <= 0) return "–";
  const d = Date.now() - ms;
  if (d < 1500) return "just now";
  return fmtDuration(d) + " ago";
}
function badge(state) {
  const name = stateName(state);
  return h("span", { class: "badge state-" + name.toLowerCase(), text: name.toLowerCase() });
}
function progress(step, total) {
  const pct = total > 0 ? Math.min(100, (100 * step) / total) : 0;
  return h("div", { class: "progress", title: fmt(pct, 1) + "%" },
    h("div", { class: "bar", style: "width:" + pct.toFixed(2) + "%" }));
}
function isLanguage(job) {
  return num(job.tokensPerSecond) > 0 || num(job.trainTokensPerSecond) > 0 ||
    (job.spec && job.spec.model && job.spec.model.type === "gpt");
}
function throughputOf(job) {
  if (isLanguage(job)) {
    const live = num(job.tokensPerSecond), done = num(job.trainTokensPerSecond);
    return { value: terminal(job.state) && done > 0 ? done : live, unit: "tokens/s" };
  }
  const live = num(job.samplesPerSecond), done = num(job.trainSamplesPerSecond);
  return { value: terminal(job.state) && done > 0 ? done : live, unit: "samples/s" };
}

// ---- The API ----

class Unauthenticated extends Error {}

async function api(path, options = {}) {
  const headers = Object.assign({ Accept: "application/json" }, options.headers || {});
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = "Bearer " + token;
  // A request that hangs must not stop the polling silently.
  const abort = new AbortController();
  const timer = setTimeout(() => abort.abort(), REQUEST_TIMEOUT_MS);
  let response;
  try {
    response = await fetch(path, Object.assign({}, options, { headers, cache: "no-store", signal: abort.signal }));
  } catch (e) {
    throw new Error(e.name === "AbortError" ? "no answer in " + REQUEST_TIMEOUT_MS / 1000 + " s" : e.message);
  } finally {
    clearTimeout(timer);
  }
  let body = null;
  try { body = await response.json(); } catch (e) { body = null; }
  // 401: no or a wrong token; 403 on a read: the token is a worker's, not an operator's.
  if (response.status === 401 || (response.status === 403 && !options.method)) {
    throw new Unauthenticated((body && body.message) || "token required");
  }
  if (!response.ok) {
    const error = new Error((body && body.message) || "HTTP " + response.status);
    error.status = response.status;
    throw error;
  }
  return body;
}

// ---- Page frame: sign-in, live indicator, polling ----

const main = () => document.getElementById("main");
let pollTimer = null;
let renderSeq = 0;  // bumped by every navigation and sign-out: older renders stop
let tokenRequired = null;  // from /api/v1/auth, asked once

function setLive(ok, text) {
  const live = document.getElementById("live");
  live.textContent = text;
  live.className = "live " + (ok ? "ok" : "down");
}

function showLogin(message) {
  clearTimeout(pollTimer);
  ++renderSeq;  // a request in flight must not draw the page again
  main().replaceChildren();  // nothing is shown without the token
  document.getElementById("login").hidden = false;
  document.getElementById("sign-out").hidden = true;
  const error = document.getElementById("login-error");
  const had = sessionStorage.getItem(TOKEN_KEY);
  error.hidden = !had;
  error.textContent = had ? message : "";
  sessionStorage.removeItem(TOKEN_KEY);
  setLive(false, "signed out");
  document.getElementById("token").focus();
}

// Calls render(alive) now and then every POLL_MS (or what it returns, in ms) until the next
// navigation or sign-out; render must check alive() after each await before it draws.
function poll(render) {
  const seq = ++renderSeq;
  const alive = () => seq === renderSeq;
  const tick = async () => {
    let next = POLL_MS;
    try {
      if (tokenRequired === null) tokenRequired = (await api("/api/v1/auth")).tokenRequired;
      if (!alive()) return;
      if (tokenRequired && !sessionStorage.getItem(TOKEN_KEY)) return showLogin("");
      next = (await render(alive)) || POLL_MS;
      if (!alive()) return;
      setLive(true, "live");
      document.getElementById("login").hidden = true;
      document.getElementById("sign-out").hidden = !sessionStorage.getItem(TOKEN_KEY);
    } catch (e) {
      if (!alive()) return;
      if (e instanceof Unauthenticated) return showLogin(e.message);
      if (e.status === 404 || e.status === 400) {
        main().replaceChildren(h("div", { class: "card empty" }, h("h1", { text: "Not found" }),
          h("p", { text: e.message }), h("a", { href: "/", text: "All jobs" })));
        setLive(true, "live");
        return;
      }
      setLive(false, "disconnected: " + e.message);
    }
    if (alive()) pollTimer = setTimeout(tick, next);
  };
  tick();
}

// ---- Jobs page ----

const JOBS_SHOWN = 200;

async function renderJobs(alive) {
  // The newest page; the API pages beyond it (?page_token=).
  const data = await api("/api/v1/jobs?page_size=" + JOBS_SHOWN);
  if (!alive()) return;
  const jobs = (data.jobs || []).slice().sort((a, b) => num(b.submitTimeUnixMs) - num(a.submitTimeUnixMs));
  const counts = {};
  for (const job of jobs) counts[stateName(job.state)] = (counts[stateName(job.state)] || 0) + 1;
  const summary = h("div", { class: "summary" },
    STATES.map((s) => h("div", { class: "stat" },
      h("div", { class: "label", text: s.toLowerCase() }),
      h("div", { class: "value" + (counts[s] ? " state-text-" + s.toLowerCase() : " zero"), text: String(counts[s] || 0) }))));
  const rows = jobs.map((job) => {
    const step = num(job.step), total = num(job.totalSteps);
    const rate = throughputOf(job);
    const validation = job.validationHistory && job.validationHistory.length
      ? job.validationHistory[job.validationHistory.length - 1].eval.testLoss
      : (job.eval && num(job.eval.testLoss) > 0 ? job.eval.testLoss : null);
    return h("tr", { "data-job": job.jobId },
      h("td", {}, h("a", { href: "/jobs/" + encodeURIComponent(job.jobId), class: "job-link", text: job.jobId }),
        h("div", { class: "sub", text: (job.spec && job.spec.name) || "" })),
      h("td", {}, badge(job.state)),
      h("td", { class: "progress-cell" }, progress(step, total),
        h("div", { class: "sub", text: fmt(step) + " / " + fmt(total) })),
      h("td", { class: "num" }, fmtRate(rate.value), h("div", { class: "sub", text: rate.unit })),
      h("td", { class: "num", text: fmtLoss(num(job.loss)) }),
      h("td", { class: "num", text: validation === null ? "–" : fmtLoss(num(validation)) }),
      h("td", { class: "num" }, String((job.members || []).length),
        h("div", { class: "sub", text: num(job.generation) > 0 ? "gen " + job.generation : "" })),
      h("td", { class: "num", text: String(num(job.recoveries)) }),
      h("td", { class: "sub-cell", text: ago(job.submitTimeUnixMs) }),
      h("td", { class: "reason", text: job.reason || "" }));
  });
  const table = jobs.length
    ? h("table", { class: "table", id: "jobs" },
        h("thead", {}, h("tr", {}, ["Job", "State", "Progress", "Throughput", "Loss", "Validation",
          "Workers", "Recoveries", "Submitted", "Reason"].map((t) => h("th", { text: t })))),
        h("tbody", {}, rows))
    : h("div", { class: "empty", text: "No jobs yet. Submit one with: lockstepctl submit job.json" });
  const total = num(data.totalJobs);
  const more = total > jobs.length
    ? h("div", { class: "sub", id: "jobs-shown", text: "The newest " + fmt(jobs.length) + " of " + fmt(total) + " jobs (lockstepctl list shows all)." })
    : null;
  main().replaceChildren(h("h1", { class: "page-title", text: "Jobs" }), summary,
    h("div", { class: "card" }, table), ...(more ? [more] : []));
}

// ---- Job page ----

const charts = {};

function chartWidth(container) {
  return Math.max(280, Math.floor(container.getBoundingClientRect().width) - 2);
}

function lineChart(key, container, title, series, data) {
  const existing = charts[key];
  if (existing && existing.root.isConnected && existing.root.parentNode === container &&
      existing.lockstepTitle === title) {
    existing.setData(data);
    return existing;
  }
  if (existing) existing.destroy();
  container.replaceChildren();
  const options = {
    title,
    width: chartWidth(container),
    height: 240,
    cursor: { drag: { x: true, y: false } },
    scales: { x: { time: false } },
    axes: [
      { label: "step", stroke: "#5b6478", grid: { stroke: "#eef0f4" } },
      { stroke: "#5b6478", grid: { stroke: "#eef0f4" }, size: 64 },
    ],
    series: [{ label: "step" }].concat(series),
    legend: { live: false },
  };
  charts[key] = new uPlot(options, data, container);
  charts[key].lockstepTitle = title;
  return charts[key];
}

window.addEventListener("resize", () => {
  for (const chart of Object.values(charts)) {
    if (chart.root.isConnected) chart.setSize({ width: chartWidth(chart.root.parentNode), height: 240 });
  }
});

// [steps, training loss, validation loss] on the union of their steps.
function lossData(job, points) {
  const train = new Map(points.map((p) => [num(p.step), plotValue(p.loss)]));
  const step = num(job.step);
  if (step > 0 && num(job.loss) > 0 && !train.has(step) && (!points.length || step > num(points[points.length - 1].step))) {
    train.set(step, plotValue(job.loss));  // the live tip: the newest report
  }
  const validation = new Map((job.validationHistory || []).map((v) => [num(v.step), plotValue(v.eval && v.eval.testLoss)]));
  const steps = Array.from(new Set([...train.keys(), ...validation.keys()])).sort((a, b) => a - b);
  return [steps, steps.map((s) => (train.has(s) ? train.get(s) : null)),
    steps.map((s) => (validation.has(s) ? validation.get(s) : null))];
}

function throughputData(job, points) {
  const language = isLanguage(job);
  const valid = points.filter((p) => plotValue(language ? p.tokensPerSecond : p.samplesPerSecond) > 0);
  return [valid.map((p) => num(p.step)),
    valid.map((p) => plotValue(language ? p.tokensPerSecond : p.samplesPerSecond))];
}

function statCard(label, value, sub, id) {
  return h("div", { class: "stat", id },
    h("div", { class: "label", text: label }),
    h("div", { class: "value", text: value }),
    sub ? h("div", { class: "sub", text: sub }) : null);
}

function recoveryFor(job, generation) {
  return (job.recoveryHistory || []).find((r) => num(r.toGeneration) === generation) || null;
}

// The band: one segment per generation, as wide as it lasted.
function timelineBand(job) {
  const generations = job.generations || [];
  if (!generations.length) return null;
  const start = num(generations[0].formedUnixMs);
  const end = num(job.endTimeUnixMs) || Date.now();
  const span = Math.max(1, end - start);
  const band = h("div", { class: "band" });
  generations.forEach((g, i) => {
    const from = num(g.formedUnixMs);
    const to = num(g.endedUnixMs) || (i + 1 < generations.length ? num(generations[i + 1].formedUnixMs) : end);
    const next = i + 1 < generations.length ? num(generations[i + 1].formedUnixMs) : to;
    const width = (100 * Math.max(0, to - from)) / span;
    const gap = (100 * Math.max(0, next - to)) / span;
    band.append(h("div", { class: "segment seg-" + (i % 4), style: "width:" + width.toFixed(3) + "%",
      title: "generation " + g.generation + ": " + (g.members || []).join(", ") },
      width > 6 ? h("span", { text: "g" + g.generation + " · " + (g.members || []).length }) : null));
    if (gap > 0) band.append(h("div", { class: "segment gap", style: "width:" + gap.toFixed(3) + "%", title: "re-forming" }));
  });
  return h("div", { class: "band-wrap" }, band,
    h("div", { class: "band-axis" }, h("span", { text: clock(start) }), h("span", { text: num(job.endTimeUnixMs) ? clock(end) : "now" })));
}

function timeline(job) {
  const generations = (job.generations || []).slice().reverse();
  const recoveries = (job.recoveryHistory || []).length;
  const list = h("ol", { class: "generations" }, generations.map((g) => {
    const gen = num(g.generation);
    const r = recoveryFor(job, gen);
    const people = (g.members || []).map((name, rank) => h("span", { class: "member", title: "rank " + rank, text: name }));
    const changes = h("div", { class: "changes" },
      (g.joined || []).length && gen > 1 ? h("span", { class: "joined", text: "+ " + g.joined.join(", ") + " joined" }) : null,
      (g.left || []).length ? h("span", { class: "left", text: "− " + g.left.join(", ") + " left" }) : null);
    let details = null;
    if (r) {
      const firstStep = num(r.firstStepUnixMs);
      const detect = num(r.detectUnixMs);
      details = h("div", { class: "recovery" + (r.scaleUp ? " scale-up" : "") },
        h("div", { class: "why", text: (r.scaleUp ? "Scale-up: " : "Recovery: ") + (r.reason || "") }),
        h("dl", {},
          h("dt", { text: "detection → first step" }),
          h("dd", { class: "recovery-time", text: firstStep > 0 ? fmtDuration(firstStep - detect) : terminal(job.state) ? "no step reported" : "in progress" }),
          h("dt", { text: "steps redone" }),
          h("dd", { class: "steps-redone", text: String(num(r.stepsRedone)) + (r.stepsRedoneLowerBound ? "+" : "") }),
          h("dt", { text: "resumed from" }),
          h("dd", { text: num(r.resumedFromStep) > 0 ? "step " + fmt(num(r.resumedFromStep)) : (firstStep > 0 ? "the start" : "–") }),
          h("dt", { text: "state from" }),
          h("dd", { class: "state-from", text: (r.restoredFrom ? r.restoredFrom + " in " + fmtDuration(num(r.healMs)) : num(r.sourceRank) >= 0 ? "rank " + r.sourceRank + (num(r.healMs) > 0 ? " in " + fmtDuration(r.healMs) : "") : "–") + (r.restoreDetail ? " (" + r.restoreDetail + ")" : "") })));
    }
    const ended = num(g.endedUnixMs);
    return h("li", { class: "generation" + (ended ? "" : " current"), "data-generation": String(gen) },
      h("div", { class: "gen-head" },
        h("span", { class: "gen-number", text: "Generation " + gen }),
        h("span", { class: "gen-time", text: clock(g.formedUnixMs) + (ended ? " – " + clock(ended) : " – now") }),
        h("span", { class: "gen-size", text: (g.members || []).length + " worker" + ((g.members || []).length === 1 ? "" : "s") })),
      h("div", { class: "members" }, people),
      changes,
      details,
      ended && g.endReason ? h("div", { class: "ended", text: "Ended: " + g.endReason }) : null);
  }));
  return h("section", { class: "card", id: "timeline", "data-generations": String((job.generations || []).length),
    "data-recoveries": String(recoveries) },
    h("h2", { text: "Membership timeline" }),
    timelineBand(job),
    (job.generations || []).length ? list : h("div", { class: "empty", text: "No generation yet: the job waits for workers." }));
}

function membersTable(job) {
  const members = job.members || [];
  if (!members.length) return null;
  return h("section", { class: "card" }, h("h2", { text: "Members" }),
    h("table", { class: "table", id: "members" },
      h("thead", {}, h("tr", {}, ["Rank", "Worker", "Host", "Step", "Peak memory", "Parameter checksum"].map((t) => h("th", { text: t })))),
      h("tbody", {}, members.map((m) => h("tr", {},
        h("td", { class: "num", text: String(num(m.rank)) }),
        h("td", { text: m.workerName || m.workerId }),
        h("td", { text: m.host || "" }),
        h("td", { class: "num", text: fmt(num(m.step)) }),
        h("td", { class: "num", text: fmtBytes(m.peakMemoryBytes) }),
        h("td", { class: "mono", text: m.parameterChecksum || "" }))))));
}

function extras(job) {
  const items = [];
  const c = job.checkpoints;
  if (c && (num(c.lastGoodStep) > 0 || num(c.failedWrites) > 0)) {
    items.push(h("div", {}, h("strong", { text: "Checkpoint: " }),
      num(c.lastGoodStep) > 0 ? "step " + fmt(num(c.lastGoodStep)) + " in " + c.lastGoodPath : "none yet",
      num(c.failedWrites) > 0 ? h("span", { class: "error", text: " · " + c.failedWrites + " failed writes, last: " + c.lastError }) : null));
  }
  if (num(job.suspendedMs) > 0) items.push(h("div", {}, h("strong", { text: "Time suspended: " }), fmtDuration(num(job.suspendedMs))));
  if (job.exportPath) items.push(h("div", {}, h("strong", { text: "Export: " }), h("span", { class: "mono", text: job.exportPath })));
  if (job.exportError) items.push(h("div", { class: "error", text: "Export " + job.exportError }));
  if (job.sampleError) items.push(h("div", { class: "error", text: "No sample: " + job.sampleError }));
  if (job.sample && job.sample.text) items.push(h("div", {}, h("strong", { text: "Sample" }), h("pre", { class: "sample", text: job.sample.text })));
  return items.length ? h("section", { class: "card extras" }, items) : null;
}

// A suspended job: for whom (or by a user), since when, from which step, and which workers keep
// its state in memory.
function suspensionCard(job) {
  const s = job.suspension;
  if (!s || stateName(job.state) !== "SUSPENDED") return null;
  const since = num(s.sinceUnixMs);
  return h("section", { class: "card", id: "suspension" }, h("h2", { text: "Suspended" }),
    h("dl", { class: "suspension" },
      h("dt", { text: "for" }),
      h("dd", {}, s.byUser ? "a user (resumes on Resume, lockstepctl resume)"
        : h("a", { href: "/jobs/" + encodeURIComponent(s.byJob || ""), text: s.byJob || "" })),
      h("dt", { text: "since" }),
      h("dd", { text: since > 0 ? fmtDuration(Date.now() - since) + " ago" : "–" }),
      h("dt", { text: "at step" }),
      h("dd", { text: fmt(num(s.step)) }),
      h("dt", { text: "state kept by" }),
      h("dd", { class: "holders", text: (s.holders || []).length ? s.holders.join(", ") : "nobody (it resumes from its last checkpoint, else its first step)" })));
}

// A program job's failed processes: generation, rank, worker, exit, what stderr said; and the
// latest failure's stderr tail.
function programFailures(job) {
  const exits = job.programExits || [];
  if (!exits.length) return null;
  const last = exits[exits.length - 1];
  return h("section", { class: "card", id: "program-failures" }, h("h2", { text: "Failed processes" }),
    h("table", { class: "table" },
      h("thead", {}, h("tr", {}, ["Generation", "Rank", "Worker", "Exit", "What it said"].map((t) => h("th", { text: t })))),
      h("tbody", {}, exits.map((e) => h("tr", {},
        h("td", { class: "num", text: String(num(e.generation)) }),
        h("td", { class: "num", text: String(num(e.rank)) }),
        h("td", { text: e.worker || "" }),
        h("td", { text: e.signal || "code " + num(e.exitCode) }),
        h("td", { class: "mono", text: e.summary || "–" }))))),
    last.stderrTail ? h("div", {}, h("div", { class: "sub", text: "stderr of rank " + num(last.rank) + ", generation " + num(last.generation) + ":" }),
      h("pre", { class: "sample logs", text: last.stderrTail })) : null);
}

// A program job's output, one rank at a time (or all): the lines kept since the page opened
// the job, followed as they arrive (the latest 2,000 kept in the page).
const logView = { job: null, rank: "all", next: 0, lines: [], box: null, buttons: null };
const LOG_LINES_KEPT = 2000;

async function refreshLogs(job) {
  if (logView.job !== job.jobId) Object.assign(logView, { job: job.jobId, rank: "all", next: 0, lines: [] });
  const query = "?from=" + logView.next + (logView.rank === "all" ? "" : "&rank=" + logView.rank);
  const answer = await api("/api/v1/jobs/" + encodeURIComponent(job.jobId) + "/logs" + query);
  for (const line of answer.lines || []) logView.lines.push(line);
  if (logView.lines.length > LOG_LINES_KEPT) logView.lines.splice(0, logView.lines.length - LOG_LINES_KEPT);
  logView.next = num(answer.nextSequence);
}

function logsCard(job) {
  const ranks = new Set((job.members || []).map((m) => String(num(m.rank))));
  for (const line of logView.lines) ranks.add(String(num(line.rank)));
  const choose = (rank) => {
    Object.assign(logView, { rank, next: 0, lines: [] });
    for (const b of logView.buttons.children) b.classList.toggle("active", b.dataset.rank === rank);
    refreshLogs(job).then(() => renderLogLines()).catch(() => {});
  };
  logView.buttons = h("div", { class: "log-ranks" }, ["all", ...[...ranks].sort((a, b) => a - b)].map((r) =>
    h("button", { type: "button", class: r === logView.rank ? "active" : "", "data-rank": r, text: r === "all" ? "All ranks" : "Rank " + r, onclick: () => choose(r) })));
  logView.box = h("pre", { class: "sample logs", id: "job-logs" });
  renderLogLines();
  return h("section", { class: "card" }, h("h2", { text: "Output" }), logView.buttons, logView.box);
}

function renderLogLines() {
  if (!logView.box) return;
  const text = logView.lines.map((l) => "[default" + num(l.rank) + "]:" + l.text).join("\n");
  const atBottom = logView.box.scrollTop + logView.box.clientHeight >= logView.box.scrollHeight - 4;
  logView.box.textContent = text || "(no output yet)";
  logView.box.dataset.lines = String(logView.lines.length);
  if (atBottom) logView.box.scrollTop = logView.box.scrollHeight;
}

async function cancelJob(id) {
  if (!window.confirm("Cancel " + id + "? Its workers stop and the job ends as CANCELLED.")) return;
  try {
    await api("/api/v1/jobs/" + encodeURIComponent(id) + "/cancel", { method: "POST", headers: { "X-Lockstep-Dashboard": "1" } });
  } catch (e) {
    if (e instanceof Unauthenticated) return showLogin(e.message);
    window.alert("Cancel failed: " + e.message);
  }
}

// "gpt 4 layers, d_model 128 · text · batch 64 · adamw lr 0.003 · 1–2 workers · deterministic"
function configLine(spec) {
  const model = spec.model || {}, data = spec.dataset || {}, opt = spec.optimizer || {};
  const parts = [];
  if (spec.program) {
    parts.push("program: " + (spec.program.argv || []).join(" "));
    if (num(spec.maxWorkers) > 0) parts.push(spec.minWorkers + "–" + spec.maxWorkers + " workers" + (spec.device ? " (" + spec.device + ")" : ""));
    return parts.join(" · ");
  }
  // The family's fields are in its message (model.gpt, model.mlp).
  const gpt = model.gpt || {}, mlp = model.mlp || {};
  if (model.type === "gpt") parts.push("gpt " + num(gpt.nLayer) + " layers, d_model " + num(gpt.dModel) + ", context " + num(gpt.contextLength));
  else if (model.type) parts.push(model.type + " [" + (mlp.hiddenWidths || []).join(", ") + "]");
  if (data.type) parts.push(data.type);
  if (num(spec.globalBatchSize) > 0) parts.push("batch " + spec.globalBatchSize);
  if (opt.type) parts.push(opt.type + " lr " + opt.learningRate);
  if (num(spec.maxWorkers) > 0) parts.push(spec.minWorkers + "–" + spec.maxWorkers + " workers" + (spec.device ? " (" + spec.device + ")" : ""));
  if (spec.deterministic) parts.push("deterministic");
  return parts.join(" · ");
}

let jobLayout = null;

async function renderJob(id, alive) {
  const path = "/api/v1/jobs/" + encodeURIComponent(id);
  const [job, curve] = await Promise.all([api(path), api(path + "/curve")]);
  if (!alive()) return;
  const points = curve.points || [];
  document.title = (job.spec && job.spec.name ? job.spec.name + " · " : "") + job.jobId + " · Lockstep";
  if (!jobLayout || !jobLayout.root.isConnected) {
    const root = h("div", { class: "job" });
    jobLayout = {
      root,
      head: h("div", { class: "job-head" }),
      stats: h("div", { class: "summary" }),
      lossChart: h("div", { class: "chart", id: "loss-chart" }),
      rateChart: h("div", { class: "chart", id: "throughput-chart" }),
      rest: h("div", {}),
    };
    root.append(jobLayout.head, jobLayout.stats,
      h("div", { class: "charts" },
        h("section", { class: "card" }, jobLayout.lossChart),
        h("section", { class: "card" }, jobLayout.rateChart)),
      jobLayout.rest);
    main().replaceChildren(root);
  }
  const L = jobLayout;
  const state = stateName(job.state);
  L.head.replaceChildren(...[
    h("div", {},
      h("div", { class: "crumbs" }, h("a", { href: "/", text: "Jobs" }), " / ", job.jobId),
      h("h1", { class: "page-title" }, (job.spec && job.spec.name) || job.jobId, " ", badge(job.state))),
    terminal(job.state) ? null : h("button", { class: "danger", id: "cancel", type: "button", onclick: () => cancelJob(job.jobId), text: "Cancel job" })].filter(Boolean));
  L.head.append(h("p", { class: "config-line", text: configLine(job.spec || {}) }),
    h("p", { class: "reason-line", id: "job-reason", text: job.reason || "" }));
  L.head.dataset.state = state;

  const step = num(job.step), total = num(job.totalSteps);
  const rate = throughputOf(job);
  const lastValidation = (job.validationHistory || []).length
    ? job.validationHistory[job.validationHistory.length - 1]
    : null;
  const validationLoss = job.eval && num(job.eval.testLoss) > 0 ? job.eval : lastValidation && lastValidation.eval;
  const stepCard = statCard("step", total > 0 ? fmt(step) + " / " + fmt(total) : fmt(step), null, "job-step");
  stepCard.append(progress(step, total));
  L.stats.replaceChildren(
    stepCard,
    statCard("training loss", fmtLoss(num(job.loss))),
    statCard("validation loss", validationLoss ? fmtLoss(num(validationLoss.testLoss)) : "–",
      validationLoss && num(validationLoss.bitsPerByte) > 0 ? fmt(num(validationLoss.bitsPerByte), 3) + " bits/byte"
        : validationLoss && num(validationLoss.testAccuracy) > 0 ? fmt(100 * num(validationLoss.testAccuracy), 2) + "% accuracy" : null),
    statCard("throughput", fmtRate(rate.value), rate.unit),
    statCard(terminal(job.state) ? "ran for" : "eta",
      terminal(job.state) ? fmtDuration(num(job.endTimeUnixMs) - num(job.startTimeUnixMs)) : fmtDuration(job.etaMs)),
    statCard("workers", String((job.members || []).length), num(job.generation) > 0 ? "generation " + job.generation : "none yet"),
    statCard("recoveries", String(num(job.recoveries)), (job.recoveryHistory || []).length > num(job.recoveries) ? (job.recoveryHistory.length - num(job.recoveries)) + " not counted" : null));

  const loss = lossData(job, points);
  L.lossChart.dataset.points = String(points.length);
  L.lossChart.dataset.validationPoints = String((job.validationHistory || []).length);
  lineChart("loss", L.lossChart, "Loss", [
    { label: "training", stroke: COLORS.train, width: 2, spanGaps: true, points: { show: false } },
    { label: "validation", stroke: COLORS.validation, width: 2, spanGaps: true, points: { show: true, size: 7, fill: COLORS.validation } },
  ], loss);
  const rateData = throughputData(job, points);
  L.rateChart.dataset.points = String(rateData[0].length);
  lineChart("rate", L.rateChart, "Throughput (" + rate.unit + ")", [
    { label: rate.unit, stroke: COLORS.throughput, width: 2, fill: "rgba(15,157,118,0.08)", points: { show: false } },
  ], rateData);

  const program = Boolean(job.spec && job.spec.program);
  if (program) await refreshLogs(job);
  if (!alive()) return;
  L.rest.replaceChildren(...[suspensionCard(job), program ? programFailures(job) : null, timeline(job), membersTable(job),
    program ? logsCard(job) : null, extras(job)].filter(Boolean));
  return terminal(job.state) ? ENDED_POLL_MS : POLL_MS;
}

// ---- Workers page ----

async function renderWorkers(alive) {
  const data = await api("/api/v1/workers");
  if (!alive()) return;
  const workers = data.workers || [];
  const rejected = data.rejectedClients || [];
  const counts = { idle: 0, busy: 0, lost: 0 };
  for (const w of workers) counts[w.state] = (counts[w.state] || 0) + 1;
  const summary = h("div", { class: "summary" },
    ["busy", "idle", "lost"].map((s) => h("div", { class: "stat" }, h("div", { class: "label", text: s }),
      h("div", { class: "value", text: String(counts[s] || 0) }))),
    h("div", { class: "stat" }, h("div", { class: "label", text: "rejected clients" }),
      h("div", { class: "value" + (rejected.length ? " state-text-failed" : ""), text: String(rejected.length) })));
  const table = workers.length
    ? h("table", { class: "table", id: "workers" },
        h("thead", {}, h("tr", {}, ["Worker", "Host", "Device", "Memory free / total", "State", "Job", "Last heartbeat", "Registered"].map((t) => h("th", { text: t })))),
        h("tbody", {}, workers.map((w) => h("tr", { "data-worker": w.name },
          h("td", {}, h("strong", { text: w.name }), h("div", { class: "sub mono", text: w.workerId })),
          h("td", { text: w.host || "" }),
          h("td", {}, w.device, h("div", { class: "sub", text: w.deviceName && w.deviceName !== w.device ? w.deviceName : "" })),
          h("td", { class: "num", text: fmtBytes(w.freeMemoryBytes) + " / " + fmtBytes(w.totalMemoryBytes) }),
          h("td", {}, h("span", { class: "badge worker-" + w.state, text: w.state })),
          h("td", {}, w.jobId ? h("a", { href: "/jobs/" + encodeURIComponent(w.jobId), text: w.jobId }) : "–"),
          h("td", { class: "sub-cell", text: ago(w.lastHeartbeatUnixMs) }),
          h("td", { class: "sub-cell", text: ago(w.registeredUnixMs) })))))
    : h("div", { class: "empty", text: "No workers have registered." });
  const rejectedTable = h("section", { class: "card" }, h("h2", { text: "Rejected clients" }),
    rejected.length
      ? h("table", { class: "table", id: "rejected" },
          h("thead", {}, h("tr", {}, ["Address", "Client", "Reason", "Calls", "Last"].map((t) => h("th", { text: t })))),
          h("tbody", {}, rejected.map((r) => h("tr", {},
            h("td", { class: "mono", text: r.peer }),
            h("td", { text: r.client || "(unnamed)" }),
            h("td", { class: "reason", text: r.reason }),
            h("td", { class: "num", text: fmt(num(r.count)) }),
            h("td", { class: "sub-cell", text: ago(r.lastUnixMs) })))))
      : h("div", { class: "empty", text: "Nobody has been turned away." }));
  main().replaceChildren(h("h1", { class: "page-title", text: "Workers" }), summary,
    h("div", { class: "card" }, table), rejectedTable);
}

// ---- Routing ----

function route() {
  const path = location.pathname;
  let page = "jobs";
  let render = renderJobs;
  const job = path.match(/^\/jobs\/([^/]+)$/);
  if (job) {
    let id = job[1];
    try { id = decodeURIComponent(job[1]); } catch (e) { /* the API says it is malformed */ }
    render = (alive) => renderJob(id, alive);
  } else if (path === "/workers") {
    page = "workers";
    render = renderWorkers;
  }
  for (const a of document.querySelectorAll("[data-nav]")) a.classList.toggle("active", a.dataset.nav === page);
  jobLayout = null;
  poll(render);
}

document.getElementById("login-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const input = document.getElementById("token");
  sessionStorage.setItem(TOKEN_KEY, input.value.trim());
  input.value = "";
  document.getElementById("login").hidden = true;
  route();
});
document.getElementById("sign-out").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  showLogin("");
});
route();
