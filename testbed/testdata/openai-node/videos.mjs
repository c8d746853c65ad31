// The official OpenAI Node client against a latentmesh agent: create a
// video (the client sends multipart/form-data), poll it to completion,
// download its content, list it, delete it, and list the models.
// Usage: node videos.mjs <baseURL, e.g. http://127.0.0.1:8080/v1> <out.mp4>
// Prints one JSON line with what it saw; exits non-zero on any failure.
import { writeFile } from 'node:fs/promises';
import OpenAI from 'openai';

const [baseURL, outPath] = process.argv.slice(2);
if (!baseURL || !outPath) {
  console.error('usage: node videos.mjs <baseURL> <out.mp4>');
  process.exit(2);
}
const client = new OpenAI({ apiKey: 'unused', baseURL, maxRetries: 0 });
const fail = (msg) => {
  console.error(msg);
  process.exit(1);
};

const models = [];
for await (const m of client.models.list()) models.push(m.id);

let video = await client.videos.create({
  model: 'latentmesh-reference',
  prompt: 'a red fox in a snowy forest at dawn',
  seconds: '4',
  size: '128x128',
  // latentmesh extensions travel as extra form fields.
  num_inference_steps: '4',
  seed: '7',
});
const created = video.id;
const statuses = [video.status];
const deadline = Date.now() + 120_000;
while (video.status === 'queued' || video.status === 'in_progress') {
  if (Date.now() > deadline) fail(`video ${created} still ${video.status} after 120 s`);
  await new Promise((r) => setTimeout(r, 100));
  video = await client.videos.retrieve(created);
  if (statuses.at(-1) !== video.status) statuses.push(video.status);
}
if (video.status !== 'completed') fail(`video ${created} ended ${video.status}: ${JSON.stringify(video.error)}`);

const content = await client.videos.downloadContent(created);
const bytes = Buffer.from(await content.arrayBuffer());
await writeFile(outPath, bytes);

const listed = [];
for await (const v of client.videos.list({ limit: 1 })) listed.push(v.id);

const deleted = await client.videos.delete(created);
let goneStatus = 0;
try {
  await client.videos.retrieve(created);
} catch (e) {
  goneStatus = e.status;
}

console.log(JSON.stringify({
  models,
  id: created,
  statuses,
  progress: video.progress,
  seconds: video.seconds,
  size: video.size,
  completed_at: video.completed_at,
  content_type: content.headers.get('content-type'),
  bytes: bytes.length,
  listed,
  deleted,
  gone_status: goneStatus,
}));
