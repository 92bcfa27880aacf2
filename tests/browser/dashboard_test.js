#!/usr/bin/env node
// The dashboard as a person uses it, in a real browser (Debian's chromium, driven by
// playwright-core): a local cluster with a token and three workers trains a job; the job page
// shows nothing but the sign-in form until the token is given (a wrong one is refused), then
// the loss chart fills; a member is killed and the membership timeline shows the recovery (who
// left, who joined, detection to first step); the workers page lists the lost worker and the
// refused sign-in; the jobs page lists the job; Cancel ends it; a program job that failed once
// shows its failed process and each rank's output; signing out empties the page.
// Screenshots of the three pages are kept in the artifacts directory.
//
// Usage: node tests/browser/dashboard_test.js --build BUILD_DIR --node_modules DIR --artifacts DIR
// Exit 77 (skipped) where /usr/bin/chromium is missing.
"use strict";

const assert = require("node:assert/strict");
const { execFileSync } = require("node:child_process");
const fs = require("node:fs");
const os = require("node:os");
const path = require("node:path");
const test = require("node:test");

const args = {};
for (let i = 2; i + 1 < process.argv.length; i += 2) args[process.argv[i].replace(/^--/, "")] = process.argv[i + 1];
const root = path.resolve(__dirname, "..", "..");
const build = path.resolve(args.build || path.join(root, "build"));
const artifacts = path.resolve(args.artifacts || path.join(build, "test-artifacts"));
const chromiumPath = "/usr/bin/chromium";
if (!fs.existsSync(chromiumPath)) {
  console.log("SKIPPED: " + chromiumPath + " is missing (scripts/install_deps.sh --test installs it)");
  process.exit(77);
}
const { chromium } = require(path.join(path.resolve(args.node_modules), "playwright-core"));

const TIMEOUT = 120000;
const dir = fs.mkdtempSync(path.join(os.tmpdir(), "lockstep-dashboard-"));
const cluster = path.join(dir, "cluster");
const tokenFile = path.join(dir, "token");
const token = "dashboard-test-" + Math.random().toString(36).slice(2);
fs.writeFileSync(tokenFile, token + "\n", { mode: 0o600 });
const ctl = path.join(build, "cli", "lockstepctl");

function clusterSh(...rest) {
  return execFileSync(path.join(root, "deploy", "local", "cluster.sh"), rest, { encoding: "utf8" });
}
function lockstepctl(...rest) {
  const address = fs.readFileSync(path.join(cluster, "address"), "utf8").trim();
  return execFileSync(ctl, ["--coordinator=" + address, "--token_file=" + tokenFile, ...rest],
    { encoding: "utf8" }).trim();
}

test("dashboard", { timeout: 8 * 60 * 1000 }, async (t) => {
  // The workers also run program jobs from here (as nobody when the test runs as root).
  const programs = path.join(dir, "programs");
  fs.mkdirSync(programs);
  fs.chmodSync(dir, 0o755);
  fs.chmodSync(programs, 0o755);
  // Rank 1 fails the first time it runs, whichever generation that is (on a loaded machine the
  // first generation may be re-formed before its processes got that far: a worker that had to
  // register again), so the page has one failed process to show.
  const marks = path.join(programs, "marks");
  fs.mkdirSync(marks);
  fs.chmodSync(marks, 0o777);
  fs.writeFileSync(path.join(programs, "hello.py"), [
    "import os",
    "print('hello from rank', os.environ['RANK'], flush=True)",
    "mark = " + JSON.stringify(path.join(marks, "failed-once")),
    "if os.environ['RANK'] == '1' and not os.path.exists(mark):",
    "    open(mark, 'w').close()",
    "    raise ValueError('boom on rank 1')",
    ""].join("\n"), { mode: 0o644 });
  // Checkpoint memory in the test's directory: the worker the test kills leaves its own behind.
  const memory = path.join(dir, "shm");
  fs.mkdirSync(memory);
  clusterSh("start", "--dir", cluster, "--workers", "3", "--bin", build, "--token_file", tokenFile,
    "--http_listen", "127.0.0.1:0", "--programs_root", programs,
    "--checkpoint_memory_dir", memory);
  const base = fs.readFileSync(path.join(cluster, "dashboard"), "utf8").trim().replace(/\/$/, "");
  let browser = null;
  let passed = false;
  t.after(async () => {
    if (browser) await browser.close();
    if (!passed) {
      // What the cluster said, where CI shows only the output.
      for (const log of ["coordinator.log", "w0.log", "w1.log", "w2.log"]) {
        const file = path.join(cluster, log);
        if (!fs.existsSync(file)) continue;
        const lines = fs.readFileSync(file, "utf8").trimEnd().split("\n");
        console.log("# " + log + " (last 40 lines)\n" + lines.slice(-40).map((l) => "#   " + l).join("\n"));
      }
    }
    try { clusterSh("stop", "--dir", cluster); } catch (e) { /* already down */ }
    for (const log of ["coordinator.log", "w0.log", "w1.log", "w2.log"]) {
      const file = path.join(cluster, log);
      if (fs.existsSync(file)) fs.copyFileSync(file, path.join(artifacts, "dashboard-" + log));
    }
    fs.rmSync(dir, { recursive: true, force: true });
  });
  fs.mkdirSync(artifacts, { recursive: true });

  // A job long enough to be killed into and cancelled: a small MLP, validation every 200 steps.
  const spec = path.join(dir, "job.json");
  fs.writeFileSync(spec, JSON.stringify({
    name: "dashboard-mlp",
    model: { mlp: { hiddenWidths: [128] } },
    dataset: { type: "synthetic", synthetic: { trainSamples: 100000, testSamples: 2000, inputDim: 128, numClasses: 10, seed: 3 } },
    optimizer: { type: "sgd", learningRate: 0.02, momentum: 0.9 },
    globalBatchSize: 64, maxSteps: 1000000, evalEverySteps: 200, seed: 1, minWorkers: 2, maxWorkers: 2,
  }));
  const jobId = lockstepctl("submit", spec).split(/\s+/).pop();
  assert.match(jobId, /^job-/);

  // The API itself refuses a request without the token.
  const bare = await fetch(base + "/api/v1/jobs/" + jobId);
  assert.equal(bare.status, 401);
  assert.equal((await bare.json()).code, "UNAUTHENTICATED");

  browser = await chromium.launch({
    executablePath: chromiumPath,
    headless: true,
    args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync"],
  });
  const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
  const pageErrors = [];
  page.on("pageerror", (e) => pageErrors.push(String(e)));
  page.on("dialog", (d) => d.accept());

  // Without the token: the sign-in form and nothing else.
  await page.goto(base + "/jobs/" + jobId);
  await page.waitForSelector("#login:not([hidden])", { timeout: TIMEOUT });
  assert.equal(await page.$eval("#main", (m) => m.childElementCount), 0);
  assert.ok(!(await page.textContent("body")).includes("dashboard-mlp"), "no job data before sign-in");

  // A wrong token is refused and says so; the right one opens the page.
  await page.fill("#token", "not-the-token");
  await page.click("#login-form button[type=submit]");
  await page.waitForFunction(() => /wrong token/.test(document.querySelector("#login-error").textContent),
    null, { timeout: TIMEOUT });
  assert.equal(await page.$eval("#main", (m) => m.childElementCount), 0);
  await page.fill("#token", token);
  await page.click("#login-form button[type=submit]");

  // The loss chart fills as the job trains.
  await page.waitForFunction(() => {
    const chart = document.querySelector("#loss-chart");
    return chart && Number(chart.dataset.points) >= 5 && chart.querySelector("canvas");
  }, null, { timeout: TIMEOUT });
  assert.equal(await page.textContent("h1.page-title"), "dashboard-mlp running");
  await page.waitForFunction(() => Number(document.querySelector("#loss-chart").dataset.validationPoints) >= 1,
    null, { timeout: TIMEOUT });

  // Kill a member (not rank 0) while the page is open.
  const job = await (await fetch(base + "/api/v1/jobs/" + jobId, { headers: { Authorization: "Bearer " + token } })).json();
  assert.equal(job.members.length, 2);
  const victim = job.members[1].workerName;
  const spare = ["w0", "w1", "w2"].find((w) => !job.members.some((m) => m.workerName === w));
  process.kill(Number(fs.readFileSync(path.join(cluster, victim + ".pid"), "utf8")), "SIGKILL");
  const pointsBefore = Number(await page.$eval("#loss-chart", (c) => c.dataset.points));

  // The timeline shows generation 2: the victim left, the spare joined, and the recovery's
  // detection-to-first-step time once its first step is done.
  await page.waitForFunction(() => {
    const g = document.querySelector('.generation[data-generation="2"]');
    const time = g && g.querySelector(".recovery-time");
    return time && time.textContent !== "in progress";
  }, null, { timeout: TIMEOUT });
  const second = await page.$eval('.generation[data-generation="2"]', (g) => ({
    left: g.querySelector(".left") && g.querySelector(".left").textContent,
    joined: g.querySelector(".joined") && g.querySelector(".joined").textContent,
    why: g.querySelector(".why").textContent,
    time: g.querySelector(".recovery-time").textContent,
    redone: g.querySelector(".steps-redone").textContent,
    members: Array.from(g.querySelectorAll(".member")).map((m) => m.textContent),
  }));
  assert.equal(second.left, "− " + victim + " left");
  assert.equal(second.joined, "+ " + spare + " joined");
  assert.match(second.why, new RegExp("^Recovery: .*" + victim));
  assert.match(second.time, /^[0-9.,]+ (ms|s)$/);
  assert.equal(second.redone, "0", "a survivor held the state");
  assert.ok(second.members.includes(spare) && !second.members.includes(victim), second.members.join(","));
  assert.equal(await page.$eval("#timeline", (t) => t.dataset.recoveries), "1");
  assert.equal(await page.$eval('.generation[data-generation="1"] .ended', (e) => e.textContent.startsWith("Ended: ")), true);
  assert.ok((await page.$$(".band .segment")).length >= 2);
  // Training goes on after the recovery, and the chart with it.
  await page.waitForFunction((before) => Number(document.querySelector("#loss-chart").dataset.points) > before + 3,
    pointsBefore, { timeout: TIMEOUT });
  await page.waitForTimeout(1600);  // one more poll, so the screenshot shows the latest state
  await page.screenshot({ path: path.join(artifacts, "dashboard-job.png"), fullPage: true });

  // The workers page: three workers, the victim lost; the wrong sign-in among the rejected.
  await page.goto(base + "/workers");
  await page.waitForSelector("#workers tbody tr", { timeout: TIMEOUT });
  await page.waitForFunction((name) => {
    const row = document.querySelector('#workers tr[data-worker="' + name + '"]');
    return row && row.querySelector(".worker-lost");
  }, victim, { timeout: TIMEOUT });
  // Three workers by name (a worker that had to register again on a loaded machine is listed
  // once more, lost, under its old id: that row is the registry's history, not a fourth worker).
  const names = await page.$$eval("#workers tbody tr", (rows) => rows.map((r) => r.dataset.worker));
  assert.deepEqual([...new Set(names)].sort(), ["w0", "w1", "w2"]);
  const rejected = await page.textContent("#rejected");
  assert.match(rejected, /dashboard/);
  assert.match(rejected, /wrong token/);
  await page.screenshot({ path: path.join(artifacts, "dashboard-workers.png"), fullPage: true });

  // The jobs page lists it, linked to its page.
  await page.goto(base + "/");
  await page.waitForSelector('#jobs tr[data-job="' + jobId + '"]', { timeout: TIMEOUT });
  await page.screenshot({ path: path.join(artifacts, "dashboard-jobs.png"), fullPage: true });
  await page.click('#jobs tr[data-job="' + jobId + '"] a.job-link');
  await page.waitForSelector("#cancel", { timeout: TIMEOUT });

  // Cancel (confirmed) ends the job.
  await page.click("#cancel");
  await page.waitForFunction(() => document.querySelector(".job-head").dataset.state === "CANCELLED",
    null, { timeout: TIMEOUT });
  assert.match(lockstepctl("status", jobId), /CANCELLED/);

  // A program job: rank 1 fails in generation 1, the group restarts and succeeds. Its page shows
  // the failed process (rank, worker, exit, the traceback's last line) and the output by rank.
  const programSpec = path.join(dir, "program.json");
  fs.writeFileSync(programSpec, JSON.stringify({
    name: "dashboard-program", minWorkers: 2, maxWorkers: 2,
    program: { argv: ["/usr/bin/python3", "hello.py"], workdir: programs },
  }));
  const programJob = lockstepctl("submit", programSpec).split(/\s+/).pop();
  await page.goto(base + "/jobs/" + programJob);
  await page.waitForFunction(() => {
    const head = document.querySelector(".job-head");
    const logs = document.querySelector("#job-logs");
    return head && head.dataset.state === "SUCCEEDED" && logs && Number(logs.dataset.lines) >= 4;
  }, null, { timeout: TIMEOUT });
  const programState = await (await fetch(base + "/api/v1/jobs/" + programJob,
    { headers: { Authorization: "Bearer " + token } })).json();
  assert.ok((programState.programExits || []).length >= 1,
    "no failed process recorded:\n" + lockstepctl("status", programJob));
  const failures = await page.textContent("#program-failures");
  assert.match(failures, /code 1/);
  assert.match(failures, /ValueError: boom on rank 1/);
  assert.match(failures, /Traceback \(most recent call last\)/);
  const everyRank = await page.textContent("#job-logs");
  assert.match(everyRank, /\[default0\]:hello from rank 0/);
  assert.match(everyRank, /\[default1\]:hello from rank 1/);
  await page.click('.log-ranks button[data-rank="1"]');
  await page.waitForFunction(() => {
    const lines = document.querySelector("#job-logs").textContent.split("\n");
    return lines.length >= 2 && lines.every((l) => l.startsWith("[default1]:"));
  }, null, { timeout: TIMEOUT });
  assert.equal(await page.$eval(".log-ranks button.active", (b) => b.dataset.rank), "1");
  await page.screenshot({ path: path.join(artifacts, "dashboard-program.png"), fullPage: true });

  // Signing out leaves nothing on the page.
  await page.click("#sign-out");
  await page.waitForSelector("#login:not([hidden])", { timeout: TIMEOUT });
  assert.equal(await page.$eval("#main", (m) => m.childElementCount), 0);
  assert.deepEqual(pageErrors, [], "no script errors");
  passed = true;
});
