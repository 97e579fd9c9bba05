#!/usr/bin/env node
// The app's second step, written from docs/consumer-walkthrough.md (step 7) alone: choose the backend of an
// installed bundle from its own llamabundle-probe's JSON, with no log parsing and no Python. Node.js built-ins only.
//
//   node backend.mjs --dest ROOT --name NAME        run the install's llamabundle-probe, then choose
//   node backend.mjs --probe-json FILE [--bundle-json FILE]   choose from a saved probe answer
//
// Prints one JSON object and exits 0: {"backend": "cuda"|"vulkan"|"cpu", "device": "CUDA0"|"Vulkan0"|"CPU",
// "description", "memory_free", "compute_capability", "server_args": [...], "server_env": {...},
// "passed_over": [{"backend", "file", "why"}]}. A bundle without the program, or a probe that fails, exits 3.

import { spawnSync } from "node:child_process";
import fs from "node:fs";
import path from "node:path";
import process from "node:process";

const GPU_ORDER = ["cuda", "vulkan"]; // the walkthrough's order: CUDA, else Vulkan, else the CPU
const DEVICE_BACKEND = { cuda: "CUDA", vulkan: "Vulkan" }; // a device's "backend" as ggml registers it

function fail(code, message) {
  process.stderr.write(`backend.mjs: ${message}\n`);
  process.exit(code);
}

function args(argv) {
  const out = {};
  for (let i = 0; i < argv.length; i += 2) {
    if (!argv[i].startsWith("--") || i + 1 >= argv.length) fail(2, `bad argument ${argv[i]}`);
    out[argv[i].slice(2)] = argv[i + 1];
  }
  return out;
}

// Run the install's probe as an app does: from its directory, in a clean environment.
function runProbe(root, name) {
  const slot = path.join(root, "bundles", name);
  const current = JSON.parse(fs.readFileSync(path.join(slot, "current"), "utf8"));
  const dir = path.join(slot, current.dir);
  const manifest = JSON.parse(fs.readFileSync(path.join(dir, "bundle.json"), "utf8"));
  const exe = path.join(dir, process.platform === "win32" ? "llamabundle-probe.exe" : "llamabundle-probe");
  if (!fs.existsSync(exe)) fail(3, `${name} has no llamabundle-probe (a bundle older than key derivation 8): use --list-devices`);
  const env = { PATH: process.platform === "win32" ? process.env.PATH : "/usr/bin:/bin" };
  // what the user set for the Vulkan loader and ggml's Vulkan device list passes through; nothing else does
  for (const keep of ["HOME", "XDG_RUNTIME_DIR", "VK_ICD_FILENAMES", "VK_DRIVER_FILES", "GGML_VK_VISIBLE_DEVICES", "SystemRoot"]) {
    if (process.env[keep] !== undefined) env[keep] = process.env[keep];
  }
  const r = spawnSync(exe, [], { cwd: dir, env, encoding: "utf8", timeout: 120000, maxBuffer: 64 << 20 });
  if (r.error || r.status !== 0) fail(3, `${exe} failed (${r.error ? r.error.message : `exit ${r.status}`}): ${(r.stderr || "").slice(-2000)}`);
  return { probe: JSON.parse(r.stdout), manifest };
}

function choose(probe, manifest) {
  const carried = manifest ? manifest.backends : null;
  const passedOver = [];
  for (const backend of GPU_ORDER) {
    const modules = probe.modules.filter((m) => m.backend === backend);
    if (modules.length === 0) continue; // the bundle does not carry it
    const devices = probe.devices.filter((d) => d.backend === DEVICE_BACKEND[backend] && d.type !== "cpu");
    const loaded = modules.find((m) => m.loaded);
    if (loaded && devices.length > 0) {
      const d = devices[0];
      const env = {};
      for (const other of GPU_ORDER) {
        if (other === backend) continue;
        const has = carried ? carried.includes(other) : probe.modules.some((m) => m.backend === other);
        if (has) env[other === "cuda" ? "CUDA_VISIBLE_DEVICES" : "GGML_VK_VISIBLE_DEVICES"] = "";
      }
      return { backend, device: d.name, description: d.description, memory_free: d.memory_free,
               compute_capability: d.compute_capability ?? null, server_args: ["--device", d.name], server_env: env,
               passed_over: passedOver };
    }
    for (const m of modules) {
      const why = m.loaded ? "loaded, but it finds no device"
        : m.outcome === "not_opened" ? `the loader refused it: ${m.error}`
        : m.outcome === "unsupported" ? "ggml scores it 0 on this machine"
        : `${m.outcome}`;
      passedOver.push({ backend, file: m.file, why });
    }
  }
  const cpu = probe.devices.find((d) => d.type === "cpu");
  if (!cpu) fail(3, "the probe lists no CPU device: the bundle's CPU backend did not load");
  return { backend: "cpu", device: cpu.name, description: cpu.description, memory_free: cpu.memory_free,
           compute_capability: null, server_args: ["--device", "none"], server_env: {}, passed_over: passedOver };
}

const opts = args(process.argv.slice(2));
let probe;
let manifest = null;
if (opts["probe-json"]) {
  probe = JSON.parse(fs.readFileSync(opts["probe-json"], "utf8"));
  if (opts["bundle-json"]) manifest = JSON.parse(fs.readFileSync(opts["bundle-json"], "utf8"));
} else if (opts.dest && opts.name) {
  ({ probe, manifest } = runProbe(path.resolve(opts.dest), opts.name));
} else {
  fail(2, "pass --dest ROOT --name NAME, or --probe-json FILE");
}
if (probe.schema !== 1 || !Array.isArray(probe.modules) || !Array.isArray(probe.devices)) fail(3, "not a llamabundle-probe answer (schema 1)");
process.stdout.write(JSON.stringify(choose(probe, manifest)) + "\n");
