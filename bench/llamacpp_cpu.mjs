// llama.cpp on the CPU through node-llama-cpp's prebuilt binary: the baseline of
// bench/NOTES-cpu-exl3.md (prompt and generation tok/s of one GGUF, greedy).
//
//   (cd /tmp/llama-node && npm i -E node-llama-cpp@3.21.1)
//   NODE_PATH=/tmp/llama-node/node_modules node bench/llamacpp_cpu.mjs MODEL.gguf \
//       [threads=1] [prompt_tokens=512] [new_tokens=64] [repeats=3]
//
// Prints one line per repeat and the best prompt / generation rate (the same
// best-of-N as bench/cpu_decode.py) over wall time and over the process's CPU time
// (user + system, all threads), and the process's resident memory after load.
import { createRequire } from "node:module";
import { readFileSync } from "node:fs";
import path from "node:path";

const require = createRequire(path.join(process.env.NODE_PATH || "/tmp/llama-node/node_modules", "x"));
const { getLlama } = await import(require.resolve("node-llama-cpp"));

const [modelPath, threadsArg = "1", promptArg = "512", newArg = "64", repeatsArg = "3"] =
  process.argv.slice(2);
const threads = Number(threadsArg), promptTokens = Number(promptArg);
const newTokens = Number(newArg), repeats = Number(repeatsArg);

function rssMiB() {
  const status = readFileSync("/proc/self/status", "utf8");
  const get = (key) => Number(status.match(new RegExp(`${key}:\\s+(\\d+)`))[1]) / 1024;
  return [get("RssAnon"), get("RssFile")];
}

const [anon0, file0] = rssMiB();
const llama = await getLlama({ gpu: false, build: "never" });
const model = await llama.loadModel({ modelPath, useMmap: true });
const [anon1, file1] = rssMiB();
const text = readFileSync(new URL("../README.md", import.meta.url), "utf8").repeat(4);
const prompt = Array.from(model.tokenize(text)).slice(0, promptTokens);
let bestPrompt = 0, bestGen = 0, bestPromptCpu = 0, bestGenCpu = 0;
const cpuSeconds = (since) => { const u = process.cpuUsage(since); return (u.user + u.system) / 1e6; };
for (let r = 0; r <= repeats; r++) {  // r = 0: warm-up
  const context = await model.createContext({
    contextSize: promptTokens + newTokens + 16, threads, batchSize: promptTokens,
  });
  const sequence = context.getSequence();
  let t = performance.now(), cpu = process.cpuUsage();
  await sequence.evaluateWithoutGeneratingNewTokens(prompt.slice(0, -1));
  const promptRate = (prompt.length - 1) / ((performance.now() - t) / 1000);
  const promptCpu = (prompt.length - 1) / cpuSeconds(cpu);
  t = performance.now();
  let count = 0, first = 0, firstCpu = null;
  for await (const _token of sequence.evaluate(prompt.slice(-1), { temperature: 0 })) {
    if (count === 0) { first = performance.now(); firstCpu = process.cpuUsage(); }
    if (++count >= newTokens + 1) break;
  }
  const genRate = newTokens / ((performance.now() - first) / 1000);
  const genCpu = newTokens / cpuSeconds(firstCpu);
  await context.dispose();
  if (r === 0) continue;
  console.log(`repeat ${r}: prompt ${promptRate.toFixed(1)} tok/s  generation ${genRate.toFixed(1)} tok/s`);
  bestPrompt = Math.max(bestPrompt, promptRate);
  bestGen = Math.max(bestGen, genRate);
  bestPromptCpu = Math.max(bestPromptCpu, promptCpu);
  bestGenCpu = Math.max(bestGenCpu, genCpu);
}
const [anon2, file2] = rssMiB();
console.log(`llama.cpp threads=${threads} ${path.basename(modelPath)} | load +${(anon1 - anon0).toFixed(1)} anon ` +
  `+${(file1 - file0).toFixed(1)} file MiB | after run +${(anon2 - anon0).toFixed(1)} anon ` +
  `+${(file2 - file0).toFixed(1)} file MiB | prompt ${bestPrompt.toFixed(1)} tok/s  generation ` +
  `${bestGen.toFixed(1)} tok/s | per CPU-second: prompt ${bestPromptCpu.toFixed(1)} ` +
  `generation ${bestGenCpu.toFixed(1)}`);
await model.dispose();
