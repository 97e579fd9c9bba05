#!/usr/bin/env node
// A consumer of llamabundle bundles in another language, written from docs/consumer-walkthrough.md,
// docs/store-layout.md and docs/bundle-format.md only: install a bundle by key from a LOCAL store
// directory, checking everything on the way. Node.js built-ins only (no npm package): it reads the zip
// itself (central directory + zlib.inflateRawSync), and takes the install root's slot lock the way
// docs/install-rules.md#the-slot-lock says (a directory renamed into place: no flock, no native module).
//
//   node install.mjs --store DIR --key KEY --dest ROOT [--expect-commit C] [--expect-toolkit V]
//                    [--expect-sha256 HEX] [--platform linux-x86_64|windows-x86_64]
//
// On success it prints one JSON object ({"ok": true, "name", "key", "path", "zip_sha256", "files", "waited_for":
// the first live holder of the slot lock it waited for, "<program> pid N", or null}) and
// exits 0. A refused bundle exits 5, a usage error (or a key the store does not hold) 2, a store or disk
// error 6; the message is on stderr ("install.mjs: refused: ...").

import crypto from "node:crypto";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import process from "node:process";
import zlib from "node:zlib";

const FORMAT = 1;
const PLATFORMS = ["linux-x86_64", "windows-x86_64"];
const ROLES = ["exe", "backend", "runtime", "license"];
const HEX64 = /^[0-9a-f]{64}$/;
const COMMIT = /^[0-9a-f]{40}$/;
const NAME = /^[A-Za-z0-9][A-Za-z0-9._+-]{0,99}$/;
const SUMS_LINE = /^([0-9a-f]{64}) [ *](.+)$/;
const MAX_MANIFEST = 16 << 20;
const MAX_MEMBERS = 200000;
const MAX_TOTAL = 16 * 1024 ** 3;

class Failure extends Error {
  constructor(code, message) {
    super(message);
    this.code = code;
  }
}
const refused = (msg) => new Failure(5, `refused: ${msg}`);
const usage = (msg) => new Failure(2, msg);
const storeError = (msg) => new Failure(6, msg);

// ------------------------------------------------------------------------------ arguments

function parseArgs(argv) {
  const known = ["store", "key", "dest", "expect-commit", "expect-toolkit", "expect-sha256", "platform"];
  const out = {};
  for (let i = 0; i < argv.length; i += 2) {
    const name = argv[i].replace(/^--/, "");
    if (!argv[i].startsWith("--") || !known.includes(name) || i + 1 >= argv.length) {
      throw usage(`bad argument ${argv[i]} (options: ${known.map((k) => "--" + k).join(" ")} VALUE)`);
    }
    out[name] = argv[i + 1];
  }
  for (const need of ["store", "key", "dest"]) {
    if (!out[need]) throw usage(`--${need} is required`);
  }
  if (!HEX64.test(out.key)) throw usage(`'${out.key}' is not a key (64 lowercase hex digits)`);
  if (out["expect-sha256"] && !/^[0-9a-fA-F]{64}$/.test(out["expect-sha256"])) {
    throw usage("--expect-sha256 is not a sha256");
  }
  return out;
}

function hostPlatform() {
  const arch = { x64: "x86_64" }[process.arch] || process.arch;
  const os = { linux: "linux", win32: "windows" }[process.platform] || process.platform;
  return `${os}-${arch}`;
}

// --------------------------------------------------------------------- canonical JSON, key

// bundle-format.md: Python's json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=True).
function canonical(v) {
  if (v === null) return "null";
  if (v === true) return "true";
  if (v === false) return "false";
  if (typeof v === "number") {
    if (!Number.isInteger(v)) throw refused("bundle.json: 'inputs' holds a fractional number (format 1 has none)");
    return String(v);
  }
  if (typeof v === "string") {
    let s = '"';
    for (let i = 0; i < v.length; i++) {
      const c = v.charCodeAt(i);
      const short = { 0x22: '\\"', 0x5c: "\\\\", 0x0a: "\\n", 0x0d: "\\r", 0x09: "\\t", 0x08: "\\b", 0x0c: "\\f" }[c];
      if (short) s += short;
      else if (c >= 0x20 && c <= 0x7e) s += v[i];
      else s += "\\u" + c.toString(16).padStart(4, "0");
    }
    return s + '"';
  }
  if (Array.isArray(v)) return "[" + v.map(canonical).join(",") + "]";
  const keys = Object.keys(v).sort();
  return "{" + keys.map((k) => canonical(k) + ":" + canonical(v[k])).join(",") + "}";
}

const sha256 = (data) => crypto.createHash("sha256").update(data).digest("hex");

// ------------------------------------------------------------------------- bundle.json checks

const isObj = (v) => v !== null && typeof v === "object" && !Array.isArray(v);

function checkShape(m, where) {
  const bad = (field, what) => refused(`${where}: '${field}' ${what}`);
  const str = (v, field, { re = null, optional = false } = {}) => {
    if ((v === undefined || v === null) && optional) return;
    if (typeof v !== "string") throw bad(field, "is not a string");
    if (re && !re.test(v)) throw bad(field, `is ${JSON.stringify(v).slice(0, 80)}, which does not match ${re}`);
  };
  const strs = (v, field, optional = true) => {
    if ((v === undefined || v === null) && optional) return;
    if (!Array.isArray(v)) throw bad(field, "is not a list");
    v.forEach((x, i) => str(x, `${field}[${i}]`));
  };
  if (!isObj(m)) throw refused(`${where} is not a JSON object`);
  if (m.format !== FORMAT) throw refused(`${where} has unknown format ${JSON.stringify(m.format)}`);
  for (const k of ["name", "key", "inputs", "llama_cpp", "platform", "files"]) {
    if (!(k in m)) throw refused(`${where} lacks '${k}'`);
  }
  str(m.name, "name", { re: NAME });
  str(m.key, "key", { re: HEX64 });
  if (!isObj(m.inputs)) throw bad("inputs", "is not an object");
  if (!isObj(m.llama_cpp)) throw bad("llama_cpp", "is not an object");
  str(m.llama_cpp.commit, "llama_cpp.commit", { re: COMMIT });
  str(m.llama_cpp.version, "llama_cpp.version", { optional: true });
  if (!PLATFORMS.includes(m.platform)) throw bad("platform", `is ${JSON.stringify(m.platform)}, not a known platform`);
  strs(m.backends, "backends");
  if (m.cuda !== undefined && m.cuda !== null) {
    if (!isObj(m.cuda)) throw bad("cuda", "is not an object");
    str(m.cuda.toolkit, "cuda.toolkit");
    str(m.cuda.driver_floor, "cuda.driver_floor", { optional: true });
  }
  strs(m.system_deps, "system_deps");
  if (!Array.isArray(m.files)) throw bad("files", "is not a list");
  const seen = new Set();
  m.files.forEach((f, i) => {
    const w = `files[${i}]`;
    if (!isObj(f)) throw bad(w, "is not an object");
    str(f.path, `${w}.path`);
    const parts = f.path.split("/");
    if (!f.path || f.path.startsWith("/") || f.path.includes("\\") || parts.includes("..") ||
        f.path === "bundle.json" || parts[0].includes(":")) {
      throw bad(`${w}.path`, `is ${JSON.stringify(f.path)}, not a relative path inside the bundle`);
    }
    if (seen.has(f.path.toLowerCase())) throw bad(`${w}.path`, `lists ${f.path} twice`);
    seen.add(f.path.toLowerCase());
    str(f.sha256, `${w}.sha256`, { re: HEX64 });
    if (!Number.isInteger(f.size) || f.size < 0) throw bad(`${w}.size`, "is not a size in bytes");
    if (!ROLES.includes(f.role)) throw bad(`${w}.role`, `is ${JSON.stringify(f.role)}, not one of ${ROLES}`);
  });
}

// The consumer's checks 1-5 (bundle-format.md): shape, format, platform, self-consistency, what was asked for.
function checkManifest(m, where, expect) {
  checkShape(m, where);
  if (m.platform !== expect.platform) throw refused(`it is built for ${m.platform}, not ${expect.platform}`);
  if (sha256(canonical(m.inputs)) !== m.key) {
    throw refused(`its key ${m.key.slice(0, 12)} is not the sha256 of the inputs its bundle.json records`);
  }
  if ("platform" in m.inputs && m.inputs.platform !== m.platform) throw refused("its platform is not its inputs' platform");
  if ("commit" in m.inputs && m.inputs.commit !== m.llama_cpp.commit) throw refused("its commit is not its inputs' commit");
  if ("cuda" in m.inputs) {
    const recorded = isObj(m.inputs.cuda) ? (m.inputs.cuda.toolkit ?? null) : null;
    const have = isObj(m.cuda) ? m.cuda.toolkit : null;
    if (recorded !== have) throw refused(`it says CUDA ${have ?? "none"}, its inputs say ${recorded ?? "none"}`);
  }
  if (m.key !== expect.key) throw refused(`its bundle.json names key ${m.key.slice(0, 12)}, not ${expect.key.slice(0, 12)}`);
  if (expect.commit && m.llama_cpp.commit !== expect.commit) {
    throw refused(`it holds llama.cpp ${m.llama_cpp.commit}, expected ${expect.commit}`);
  }
  if (expect.toolkit && !(isObj(m.cuda) && m.cuda.toolkit === expect.toolkit)) {
    throw refused(`it was built with CUDA ${isObj(m.cuda) ? m.cuda.toolkit : "none"}, expected ${expect.toolkit}`);
  }
}

function parseManifest(bytes, where) {
  if (bytes.length > MAX_MANIFEST) throw refused(`${where} is larger than 16 MiB`);
  let text;
  try {
    text = new TextDecoder("utf-8", { fatal: true }).decode(bytes);
  } catch {
    throw refused(`${where} is not UTF-8 text`);
  }
  try {
    return JSON.parse(text);
  } catch (e) {
    throw refused(`${where} is not valid JSON (${e.message})`);
  }
}

// -------------------------------------------------------------------------------- the store

function readStore(storeDir, key) {
  const entry = path.join(storeDir, key);
  const manifestPath = path.join(entry, "bundle.json");
  if (!fs.existsSync(manifestPath)) throw usage(`no bundle with key ${key.slice(0, 12)} in ${storeDir}`);
  let sums;
  let raw;
  try {
    raw = fs.readFileSync(manifestPath);
    sums = fs.readFileSync(path.join(entry, "SHA256SUMS"), "utf8");
  } catch (e) {
    throw storeError(`store entry ${entry} is damaged: ${e.message}`);
  }
  const listed = {};
  sums.split(/\r?\n/).forEach((line, n) => {
    if (!line.trim()) return;
    const m = SUMS_LINE.exec(line);
    if (!m || m[2].includes("/") || m[2].includes("\\") || m[2] === "." || m[2] === "..") {
      throw storeError(`store entry ${entry} is damaged: SHA256SUMS:${n + 1} is not '<sha256>  <file name>'`);
    }
    listed[m[2]] = m[1];
  });
  const zips = Object.keys(listed).filter((n) => n.endsWith(".zip"));
  if (zips.length !== 1) throw storeError(`store entry ${entry}: SHA256SUMS lists ${zips.length} zips, not one`);
  const zipPath = path.join(entry, zips[0]);
  if (!fs.existsSync(zipPath)) throw usage(`no bundle with key ${key.slice(0, 12)} in ${storeDir} (its zip is missing)`);
  return { manifestRaw: raw, zipName: zips[0], zipPath, zipSha256: listed[zips[0]] };
}

// Copy the zip while hashing it (store-layout.md: the zip's sha256 must be the one SHA256SUMS lists).
function copyHashing(src, dst) {
  const h = crypto.createHash("sha256");
  const buf = Buffer.alloc(1 << 20);
  const i = fs.openSync(src, "r");
  const o = fs.openSync(dst, "wx");
  try {
    for (;;) {
      const n = fs.readSync(i, buf, 0, buf.length, null);
      if (n === 0) break;
      h.update(buf.subarray(0, n));
      fs.writeSync(o, buf, 0, n);
    }
    fs.fsyncSync(o);
  } finally {
    fs.closeSync(i);
    fs.closeSync(o);
  }
  return h.digest("hex");
}

// ------------------------------------------------------------------------------------- zip

const CRC_TABLE = (() => {
  const t = new Uint32Array(256);
  for (let n = 0; n < 256; n++) {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    t[n] = c >>> 0;
  }
  return t;
})();

function crc32(buf) {
  let c = 0xffffffff;
  for (let i = 0; i < buf.length; i++) c = CRC_TABLE[(c ^ buf[i]) & 0xff] ^ (c >>> 8);
  return (c ^ 0xffffffff) >>> 0;
}

function readAt(fd, offset, length) {
  const b = Buffer.alloc(length);
  const n = fs.readSync(fd, b, 0, length, offset);
  if (n !== length) throw refused(`the zip ends before byte ${offset + length}`);
  return b;
}

// The central directory: [{name, method, flags, crc, csize, usize, mode, isDir, localOffset}].
function centralDirectory(fd, size, label) {
  const tailLen = Math.min(size, 65535 + 22);
  const tail = readAt(fd, size - tailLen, tailLen);
  let eocd = -1;
  for (let i = tailLen - 22; i >= 0; i--) {
    if (tail.readUInt32LE(i) === 0x06054b50) { eocd = i; break; }
  }
  if (eocd < 0) throw refused(`${label} is not a zip (no end of central directory)`);
  const count = tail.readUInt16LE(eocd + 10);
  const cdSize = tail.readUInt32LE(eocd + 12);
  const cdOffset = tail.readUInt32LE(eocd + 16);
  if (count === 0xffff || cdOffset === 0xffffffff) throw refused(`${label} is a ZIP64 archive, which bundles are not`);
  if (count > MAX_MEMBERS) throw refused(`${label} has ${count} members, more than ${MAX_MEMBERS}`);
  if (cdOffset + cdSize > size) throw refused(`${label}: the central directory lies outside the file`);
  const cd = readAt(fd, cdOffset, cdSize);
  const members = [];
  let p = 0;
  for (let i = 0; i < count; i++) {
    if (p + 46 > cd.length || cd.readUInt32LE(p) !== 0x02014b50) throw refused(`${label}: damaged central directory`);
    const madeBy = cd.readUInt16LE(p + 4) >> 8;
    const nameLen = cd.readUInt16LE(p + 28);
    const extraLen = cd.readUInt16LE(p + 30);
    const commentLen = cd.readUInt16LE(p + 32);
    const ext = cd.readUInt32LE(p + 38);
    const name = new TextDecoder("utf-8", { fatal: true }).decode(cd.subarray(p + 46, p + 46 + nameLen));
    members.push({
      name,
      flags: cd.readUInt16LE(p + 8),
      method: cd.readUInt16LE(p + 10),
      crc: cd.readUInt32LE(p + 16),
      csize: cd.readUInt32LE(p + 20),
      usize: cd.readUInt32LE(p + 24),
      mode: madeBy === 3 ? ext >>> 16 : 0,
      isDir: name.endsWith("/"),
      localOffset: cd.readUInt32LE(p + 42),
    });
    p += 46 + nameLen + extraLen + commentLen;
  }
  return members;
}

// Safe extraction (consumer-walkthrough.md step 4) into `dest` (a new directory).
function unzip(zipPath, dest, label) {
  const fd = fs.openSync(zipPath, "r");
  try {
    const size = fs.fstatSync(fd).size;
    const members = centralDirectory(fd, size, label);
    const files = new Set();
    const dirs = new Set();
    let total = 0;
    for (const m of members) {
      const name = m.isDir ? m.name.slice(0, -1) : m.name;
      const parts = name.split("/");
      if (!name || name.startsWith("/") || m.name.includes("\\") || parts.includes("..") || parts[0].includes(":")) {
        throw refused(`${label}: member '${m.name}' escapes the destination`);
      }
      const type = m.mode & 0o170000;
      if (type === 0o120000) throw refused(`${label}: member '${m.name}' is a symbolic link`);
      if (type !== 0 && type !== 0o100000 && type !== 0o040000) {
        throw refused(`${label}: member '${m.name}' is a device, pipe or socket`);
      }
      if (m.flags & 1) throw refused(`${label}: member '${m.name}' is encrypted`);
      if (m.method !== 0 && m.method !== 8) throw refused(`${label}: member '${m.name}' uses compression method ${m.method}`);
      const lower = name.toLowerCase();
      for (let i = 1; i < parts.length; i++) {
        const parent = parts.slice(0, i).join("/").toLowerCase();
        if (files.has(parent)) throw refused(`${label}: member '${m.name}' is inside a file`);
        dirs.add(parent);
      }
      if (files.has(lower) || (!m.isDir && dirs.has(lower))) throw refused(`${label}: member '${m.name}' collides with another`);
      (m.isDir ? dirs : files).add(lower);
      total += m.usize;
      if (total > MAX_TOTAL) throw refused(`${label} expands to more than 16 GiB`);
    }
    fs.mkdirSync(dest);
    for (const m of members) {
      const target = path.join(dest, ...m.name.split("/").filter(Boolean));
      if (m.isDir) {
        fs.mkdirSync(target, { recursive: true });
        continue;
      }
      const local = readAt(fd, m.localOffset, 30);
      if (local.readUInt32LE(0) !== 0x04034b50) throw refused(`${label}: member '${m.name}' has no local header`);
      const start = m.localOffset + 30 + local.readUInt16LE(26) + local.readUInt16LE(28);
      const raw = readAt(fd, start, m.csize);
      let data;
      try {
        data = m.method === 8 ? zlib.inflateRawSync(raw, { maxOutputLength: Math.max(m.usize, 1) }) : raw;
      } catch (e) {
        throw refused(`${label}: member '${m.name}' is damaged (${e.message})`);
      }
      if (data.length !== m.usize) throw refused(`${label}: member '${m.name}' is not the size its header says`);
      if (crc32(data) !== m.crc) throw refused(`${label}: member '${m.name}' fails its CRC-32`);
      fs.mkdirSync(path.dirname(target), { recursive: true });
      fs.writeFileSync(target, data, { mode: m.mode & 0o111 ? 0o755 : 0o644, flag: "wx" });
    }
  } finally {
    fs.closeSync(fd);
  }
}

// ---------------------------------------------------------------------- the unpacked files

function walk(root, rel = "") {
  const out = [];
  for (const d of fs.readdirSync(path.join(root, rel), { withFileTypes: true })) {
    const r = rel ? `${rel}/${d.name}` : d.name;
    if (d.isDirectory()) out.push(...walk(root, r));
    else out.push(r);
  }
  return out;
}

// The consumer's checks 6 and 7: every listed file with its size and sha256, nothing outside the list.
function checkFiles(root, m) {
  const listed = new Map(m.files.map((f) => [f.path, f]));
  for (const p of walk(root)) {
    if (p !== "bundle.json" && !listed.has(p)) throw refused(`${p} is in the bundle but not in bundle.json`);
  }
  for (const f of m.files) {
    const p = path.join(root, ...f.path.split("/"));
    let st;
    try {
      st = fs.lstatSync(p);
    } catch {
      throw refused(`${f.path} is listed in bundle.json but missing`);
    }
    if (!st.isFile()) throw refused(`${f.path} is listed in bundle.json but is not a regular file`);
    if (st.size !== f.size) throw refused(`${f.path} has size ${st.size}, bundle.json says ${f.size}`);
    if (sha256(fs.readFileSync(p)) !== f.sha256) throw refused(`${f.path} does not match its sha256 in bundle.json`);
  }
}

// ------------------------------------------------------------ the slot lock (docs/install-rules.md#the-slot-lock)

const LOCK_TIMEOUT_MS = 600 * 1000;
const STALE_KEEP_MS = 600 * 1000;
const INVALID_AGE_MS = 30 * 1000;
const TOKEN = /^\d{1,10}-\d{1,20}-[0-9a-f]{6}$/;
const HELD_CODES = new Set(["EEXIST", "ENOTEMPTY", "EACCES", "EPERM", "ENOTDIR", "EISDIR"]);

const sleep = (ms) => Atomics.wait(new Int32Array(new SharedArrayBuffer(4)), 0, 0, ms);

// A process's start time as the protocol records it: Linux /proc/PID/stat field 22 (clock ticks since boot);
// 0 where it cannot be read (it runs); null when no such process runs.
function startTime(pid) {
  if (process.platform === "linux") {
    let stat;
    try {
      stat = fs.readFileSync(`/proc/${pid}/stat`, "latin1");
    } catch (e) {
      return e.code === "ENOENT" || e.code === "ESRCH" ? null : 0;
    }
    const fields = stat.slice(stat.lastIndexOf(")") + 2).split(" ");
    if (fields[0] === "Z" || fields[0] === "X") return null;
    return /^\d+$/.test(fields[19] || "") ? Number(fields[19]) : 0;
  }
  try {
    process.kill(pid, 0);
    return 0;
  } catch (e) {
    return e.code === "EPERM" ? 0 : null;
  }
}

function readOwner(held) {
  let data;
  try {
    const raw = fs.readFileSync(path.join(held, "owner.json"));
    if (raw.length > 4096) return null;
    data = JSON.parse(raw.toString("utf8"));
  } catch {
    return null;
  }
  if (!isObj(data) || !Number.isInteger(data.pid) || data.pid <= 0 || !Number.isInteger(data.start) || data.start < 0
      || typeof data.host !== "string" || typeof data.token !== "string" || !TOKEN.test(data.token)) return null;
  return data;
}

// The holder may still hold it: on another host always; here while its pid runs with the start time it recorded.
function ownerAlive(owner) {
  if (owner.host !== os.hostname()) return true;
  const running = startTime(owner.pid);
  if (running === null) return false;
  return owner.start === 0 || running === 0 || running === owner.start;
}

function tokenAlive(token) {
  const [pid, start] = token.split("-").map(Number);
  return ownerAlive({ pid, start, host: os.hostname() });
}

function breakLock(locks, held, tag) {
  const aside = path.join(locks, `.stale-${tag}`);
  try {
    fs.renameSync(held, aside);
  } catch {
    return; // another waiter broke it first, or it was released meanwhile
  }
  try {
    fs.writeFileSync(path.join(aside, "broken"), `${new Date().toISOString()} by pid ${process.pid}\n`);
  } catch {
    // its age is only a courtesy to the next sweep
  }
}

function sweepLocks(locks) {
  for (const n of fs.readdirSync(locks)) {
    const p = path.join(locks, n);
    const tail = n.startsWith(".new-") ? n.slice(5) : n.startsWith(".released-") ? n.slice(10) : null;
    try {
      if (tail !== null ? TOKEN.test(tail) && !tokenAlive(tail)
          : n.startsWith(".stale-") && Date.now() - fs.statSync(p).mtimeMs > STALE_KEEP_MS) {
        fs.rmSync(p, { recursive: true, force: true });
      }
    } catch {
      // tried again by the next taker
    }
  }
}

function takeLock(root, name) {
  const locks = path.join(root, "bundles", ".locks");
  fs.mkdirSync(locks, { recursive: true });
  sweepLocks(locks);
  const held = path.join(locks, `${name}.held`);
  const start = startTime(process.pid) || 0;
  const token = `${process.pid}-${start}-${crypto.randomBytes(3).toString("hex")}`;
  const fresh = path.join(locks, `.new-${token}`);
  fs.mkdirSync(fresh);
  const owner = { by: "install.mjs", host: os.hostname(), pid: process.pid, since: isoNow(), start, token };
  fs.writeFileSync(path.join(fresh, "owner.json"), JSON.stringify(owner, Object.keys(owner).sort()) + "\n");
  const deadline = Date.now() + LOCK_TIMEOUT_MS;
  let delay = 20;
  let waitedFor = null;
  try {
    for (;;) {
      try {
        fs.renameSync(fresh, held);
        return { locks, held, token, waitedFor };
      } catch (e) {
        if (!HELD_CODES.has(e.code)) throw e;
      }
      const holder = readOwner(held);
      if (holder && !ownerAlive(holder)) {
        breakLock(locks, held, holder.token);
        continue;
      }
      if (!holder) {
        let st;
        try {
          st = fs.lstatSync(held);
        } catch {
          continue; // released meanwhile: take it now
        }
        if (Date.now() - st.mtimeMs > INVALID_AGE_MS) {
          breakLock(locks, held, `invalid-${Date.now()}000000`);
          continue;
        }
      }
      if (Date.now() > deadline) {
        const who = holder ? `pid ${holder.pid} (${holder.by || "?"}), since ${holder.since || "?"}` : "an unreadable owner";
        throw storeError(`another process (${who}) is installing or removing ${name} in ${root}: waited 600 s for its lock ${held}`);
      }
      if (waitedFor === null) waitedFor = holder ? `${holder.by || "?"} pid ${holder.pid}` : "an unreadable owner";
      sleep(delay);
      delay = Math.min(delay * 1.5, 250);
    }
  } finally {
    fs.rmSync(fresh, { recursive: true, force: true });
  }
}

function releaseLock(lock) {
  const owner = readOwner(lock.held);
  if (!owner || owner.token !== lock.token) return; // broken by a waiter that judged this process dead: not ours
  const gone = path.join(lock.locks, `.released-${lock.token}`);
  try {
    fs.renameSync(lock.held, gone);
  } catch {
    return;
  }
  fs.rmSync(gone, { recursive: true, force: true });
}

const isoNow = () => new Date().toISOString().replace(/\.\d{3}Z$/, "Z");

// ------------------------------------------------------------------------------- install

function install(opts) {
  const expect = {
    key: opts.key,
    platform: opts.platform || hostPlatform(),
    commit: opts["expect-commit"] || null,
    toolkit: opts["expect-toolkit"] || null,
  };
  const pinned = opts["expect-sha256"] ? opts["expect-sha256"].toLowerCase() : null;
  // 1-2: find the entry, check the store's bundle.json before touching the zip
  const found = readStore(opts.store, opts.key);
  const storeManifest = parseManifest(found.manifestRaw, "the store's bundle.json");
  checkManifest(storeManifest, "the store's bundle.json", expect);
  if (pinned && found.zipSha256 !== pinned) throw refused(`the store lists ${found.zipName} with sha256 ${found.zipSha256}, not the pinned ${pinned}`);
  const name = storeManifest.name;
  const root = path.resolve(opts.dest);
  const slot = path.join(root, "bundles", name);
  const lock = takeLock(root, name); // every read-decide-write of the slot holds it
  try {
    return { ...installLocked(opts, found, storeManifest, expect, pinned, name, slot), waited_for: lock.waitedFor };
  } finally {
    releaseLock(lock);
  }
}

function installLocked(opts, found, storeManifest, expect, pinned, name, slot) {
  fs.mkdirSync(slot, { recursive: true });
  let old = null;
  try {
    old = JSON.parse(fs.readFileSync(path.join(slot, "current"), "utf8")).dir;
  } catch {
    old = null;
  }
  for (const leftover of fs.readdirSync(slot)) { // a killed install's stage, version or pointer temp file
    if (leftover !== "current" && leftover !== old) fs.rmSync(path.join(slot, leftover), { recursive: true, force: true });
  }
  const stage = path.join(slot, `.stage-${process.pid}-${Date.now()}-${crypto.randomBytes(4).toString("hex")}`);
  fs.mkdirSync(path.join(stage, "download"), { recursive: true });
  const version = `${opts.key.slice(0, 12)}-${crypto.randomBytes(4).toString("hex")}`;
  try {
    // 3: download (copy) and verify the zip's sha256
    const zip = path.join(stage, "download", found.zipName);
    const got = copyHashing(found.zipPath, zip);
    if (got !== found.zipSha256) throw refused(`${found.zipName} has sha256 ${got}, the store's SHA256SUMS says ${found.zipSha256}`);
    if (pinned && got !== pinned) throw refused(`${found.zipName} has sha256 ${got}, not the pinned ${pinned}`);
    // 4: unpack safely
    const tree = path.join(stage, version);
    unzip(zip, tree, found.zipName);
    // 5: check the unpacked bundle: its manifest (the store's), then every file
    const inner = path.join(tree, "bundle.json");
    if (!fs.existsSync(inner)) throw refused(`${found.zipName} has no bundle.json at its root`);
    const manifest = parseManifest(fs.readFileSync(inner), `the bundle.json inside ${found.zipName}`);
    checkManifest(manifest, `the bundle.json inside ${found.zipName}`, expect);
    if (canonical(manifest) !== canonical(storeManifest)) {
      throw refused(`the bundle.json inside ${found.zipName} is not the one the store lists`);
    }
    checkFiles(tree, manifest);
    // 6: install atomically: the version directory, then the pointer, then the old version goes
    fs.renameSync(tree, path.join(slot, version));
    const pointer = { dir: version, installed_at: isoNow(), key: opts.key, zip_sha256: got };
    const tmp = path.join(slot, `.current.${process.pid}-${crypto.randomBytes(4).toString("hex")}.tmp`);
    const fd = fs.openSync(tmp, "wx");
    fs.writeSync(fd, JSON.stringify(pointer, Object.keys(pointer).sort()) + "\n");
    fs.fsyncSync(fd);
    fs.closeSync(fd);
    fs.renameSync(tmp, path.join(slot, "current"));
    if (old && old !== version && NAME.test(old)) fs.rmSync(path.join(slot, old), { recursive: true, force: true });
    return { ok: true, name, key: opts.key, path: path.join(slot, version), zip_sha256: got, files: manifest.files.length };
  } finally {
    fs.rmSync(stage, { recursive: true, force: true });
  }
}

try {
  const result = install(parseArgs(process.argv.slice(2)));
  process.stdout.write(JSON.stringify(result) + "\n");
} catch (e) {
  if (e instanceof Failure) {
    process.stderr.write(`install.mjs: ${e.message}\n`);
    process.exit(e.code);
  }
  process.stderr.write(`install.mjs: ${e.code === "EACCES" || e.code === "ENOSPC" || e.code === "EROFS" ? "cannot write: " : ""}${e.message}\n`);
  process.exit(6);
}
