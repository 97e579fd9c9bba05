#!/usr/bin/env node
// Validates JSON files against the schemas llamabundle ships, the way an app in another language would: ajv 8
// in strict mode (draft 2020-12, no allowUnionTypes), every schema loaded into one validator and found by its
// $id (urn:llamabundle:schema:NAME for the file NAME.schema.json). Its one dependency, ajv, is pinned by
// package-lock.json beside it: `npm ci --prefix tests/consumer`.
//
//   node validate.mjs SCHEMA_DIR [NAME FILE]...
//
// It first compiles every SCHEMA_DIR/*.schema.json (a schema strict mode refuses, or one whose $id is not its
// file's, fails), then validates each FILE against the schema NAME (`bundle`, `cli-probe`, ...). It prints one
// JSON object on stdout ({"ok", "schemas": [names], "validated": N}) and exits 0 when every file is valid;
// otherwise one line on stderr per failure, naming the file, the schema and the failing path
// ("validate.mjs: out.json is not valid against cli-key: /key must match pattern ..."), and exits 1.
// A usage error (or a file that is not JSON) exits 2.

import fs from "node:fs";
import path from "node:path";
import process from "node:process";
import Ajv2020 from "ajv/dist/2020.js";

const SUFFIX = ".schema.json";
const idOf = (name) => `urn:llamabundle:schema:${name}`;

function fail(code, message) {
  process.stderr.write(`validate.mjs: ${message}\n`);
  process.exit(code);
}

function readJson(file) {
  try {
    return JSON.parse(fs.readFileSync(file, "utf8"));
  } catch (e) {
    fail(2, `cannot read ${file} as JSON: ${e.message}`);
  }
}

const [dir, ...pairs] = process.argv.slice(2);
if (!dir || pairs.length % 2 !== 0) {
  fail(2, "usage: node validate.mjs SCHEMA_DIR [NAME FILE]...");
}

const ajv = new Ajv2020({ strict: true, allErrors: true });
const names = fs.readdirSync(dir).filter((f) => f.endsWith(SUFFIX)).map((f) => f.slice(0, -SUFFIX.length)).sort();
if (names.length === 0) {
  fail(2, `${dir} holds no ${SUFFIX} file`);
}
const problems = [];
for (const name of names) {
  const schema = readJson(path.join(dir, name + SUFFIX));
  if (schema.$id !== idOf(name)) {
    problems.push(`${name}${SUFFIX} has the $id ${JSON.stringify(schema.$id)}, not ${JSON.stringify(idOf(name))}`);
    continue;
  }
  try {
    ajv.addSchema(schema);
    ajv.getSchema(idOf(name)); // compiles it: strict mode's refusals are thrown here
  } catch (e) {
    problems.push(`${name}${SUFFIX} does not compile under ajv strict mode: ${e.message}`);
  }
}

let validated = 0;
for (let i = 0; i < pairs.length; i += 2) {
  const [name, file] = [pairs[i], pairs[i + 1]];
  if (!names.includes(name)) {
    fail(2, `no schema ${name}${SUFFIX} in ${dir}`);
  }
  const validate = ajv.getSchema(idOf(name));
  if (!validate) {
    continue; // it did not compile: already said
  }
  const data = readJson(file);
  if (validate(data)) {
    validated += 1;
  } else {
    for (const e of validate.errors) {
      problems.push(`${file} is not valid against ${name}: ${e.instancePath || "/"} ${e.message}` +
                    (e.params && Object.keys(e.params).length ? ` ${JSON.stringify(e.params)}` : ""));
    }
  }
}

for (const p of problems) {
  process.stderr.write(`validate.mjs: ${p}\n`);
}
process.stdout.write(JSON.stringify({ ok: problems.length === 0, schemas: names, validated }) + "\n");
process.exit(problems.length === 0 ? 0 : 1);
