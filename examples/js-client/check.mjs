// Walks a server through the contract's operations with fillmask-client.mjs and prints one JSON line
// per step: {"step": ..., "ok": true|false, ...}. Exit status 0 when every step passed. Written, like
// the client, from protocol/asyncapi.yaml alone. tests/test_contract.py runs it against a real server.
//
//   node check.mjs ws://127.0.0.1:8765/ hello request       # any server
//   node check.mjs ws://127.0.0.1:8765/ cancel overload deadline
//       # needs requests to stay queued: a server whose model is held, with hello.limits.max_queue 1
import { FillMaskClient, codePoints, perMask } from './fillmask-client.mjs';

const [url, ...steps] = process.argv.slice(2);
const ONE_MASK = 'Paris is the [MASK] of France.';
const TWO_MASKS = 'The [MASK] of France is [MASK].';

class StepFailed extends Error {}

function expect(condition, what) {
  if (!condition) throw new StepFailed(what);
}

function checkCandidates(list, topK, what) {
  expect(Array.isArray(list) && list.length >= 1 && list.length <= topK, `${what}: 1 to ${topK} candidates`);
  for (const c of list) {
    expect(c !== null && typeof c === 'object' && !Array.isArray(c), `${what}: each candidate is an object`);
    expect(typeof c.score === 'number' && c.score >= 0 && c.score <= 1, `${what}: score in [0, 1]`);
    expect(Number.isInteger(c.token) && c.token >= 0, `${what}: token is a vocabulary id`);
    expect(typeof c.token_str === 'string' && typeof c.sequence === 'string', `${what}: token_str and sequence`);
  }
  for (let i = 1; i < list.length; i += 1) {
    expect(list[i - 1].score >= list[i].score, `${what}: by descending score`);
  }
}

async function answerOf(request) {
  const { frame, closed, why } = await request.answer;
  expect(!closed, `request ${request.id}: ${why}`);
  return frame;
}

const STEPS = {
  async hello(client) {
    const { hello } = client;
    expect(hello.protocol === 1, 'hello.protocol is 1');
    expect(typeof hello.mask_token === 'string' && hello.mask_token.length > 0, 'hello.mask_token');
    for (const name of ['max_text_chars', 'max_masks', 'max_queue', 'max_frame_bytes', 'max_id_chars']) {
      expect(Number.isInteger(hello.limits[name]) && hello.limits[name] >= 1, `hello.limits.${name}`);
    }
    return { model: hello.model, mask_token: hello.mask_token, random_weights: hello.random_weights };
  },

  async request(client) {
    const one = client.send(ONE_MASK, { topK: 3 });
    const two = client.send(TWO_MASKS, { topK: 2 });
    const [first, second] = [await answerOf(one), await answerOf(two)];
    expect(first.type === 'result' && first.id === one.id, `one mask: a result for id ${one.id}`);
    expect(!Array.isArray(first.predictions[0]), 'one mask: a list of candidates (first element not an array)');
    checkCandidates(first.predictions, 3, 'one mask');
    expect(second.type === 'result' && second.id === two.id, `two masks: a result for id ${two.id}`);
    expect(Array.isArray(second.predictions[0]) && second.predictions.length === 2,
      'two masks: one list per mask (first element an array)');
    second.predictions.forEach((list, i) => checkCandidates(list, 2, `two masks, mask ${i + 1}`));
    expect(perMask(first.predictions).length === 1 && perMask(second.predictions).length === 2, 'perMask');
    for (const name of ['queue_ms', 'inference_ms']) expect(typeof first[name] === 'number', `result.${name}`);
    for (const name of ['batch_size', 'batch_tokens', 'batch_id']) {
      expect(Number.isInteger(first[name]) && first[name] >= 1, `result.${name}`);
    }
    const filled = await client.fill(ONE_MASK.replace('Paris', 'Pâris 🗼'), { topK: 1 });
    expect(filled.length === 1 && filled[0].length === 1, 'fill(): one mask, top_k 1');
    expect(codePoints('🗼') === 1 && '🗼'.length === 2, 'characters are code points');
    return { tokens: first.predictions.map((c) => c.token), per_mask: second.predictions.length };
  },

  async cancel(client) {
    const queued = client.send(ONE_MASK);
    client.cancel(queued.id);
    const frame = await answerOf(queued);
    expect(frame.type === 'cancelled' && frame.id === queued.id, `cancelled for id ${queued.id}, got ${frame.type}`);
    return { id: queued.id };
  },

  async overload(client) {
    expect(client.limits.max_queue === 1, 'a server with hello.limits.max_queue 1');
    const waiting = client.send(ONE_MASK);
    const refused = client.send(ONE_MASK);
    const frame = await answerOf(refused);
    expect(frame.type === 'overloaded' && frame.id === refused.id, `overloaded for id ${refused.id}, got ${frame.type}`);
    expect(frame.status === 503 && frame.reason === 'queue_full', `503 queue_full, got ${frame.status} ${frame.reason}`);
    expect(Number.isInteger(frame.retry_after_ms) && frame.retry_after_ms >= 0, 'retry_after_ms');
    client.cancel(waiting.id);
    expect((await answerOf(waiting)).type === 'cancelled', 'the waiting request cancelled');
    return { status: frame.status, reason: frame.reason, retry_after_ms: frame.retry_after_ms };
  },

  async deadline(client) {
    const late = client.send(ONE_MASK, { deadlineMs: 50 });
    const frame = await answerOf(late);
    expect(frame.type === 'overloaded' && frame.status === 504 && frame.reason === 'deadline_exceeded',
      `504 deadline_exceeded, got ${JSON.stringify(frame)}`);
    expect(typeof frame.queue_ms === 'number' && frame.queue_ms >= 0, 'queue_ms with a 504');
    return { status: frame.status, queue_ms: frame.queue_ms };
  },
};

// Usage errors before connecting: no URL, no step, or a step this script does not have (exit 2).
const unknown = steps.filter((step) => !(step in STEPS));
if (!url || !/^wss?:\/\//.test(url) || steps.length === 0 || unknown.length > 0) {
  const problem = !url || !/^wss?:\/\//.test(url) ? `the first argument must be a ws:// or wss:// URL (got ${url ?? 'none'})`
    : steps.length === 0 ? 'no step given' : `unknown step ${unknown.join(', ')}`;
  console.error(`check.mjs: ${problem}. Usage: node check.mjs ws://HOST:PORT/ STEP... with STEP one of `
    + `${Object.keys(STEPS).join(', ')} (cancel, overload and deadline need a server whose requests stay queued, `
    + 'with hello.limits.max_queue 1: tests/test_contract.py starts one)');
  process.exit(2);
}

let failed = false;
let client;
try {
  client = await FillMaskClient.connect(url, { openTimeoutMs: 5000 });
  for (const step of steps) {
    try {
      const details = await STEPS[step](client);
      console.log(JSON.stringify({ step, ok: true, ...details }));
    } catch (error) {
      failed = true;
      console.log(JSON.stringify({ step, ok: false, error: String(error.message ?? error) }));
    }
  }
  expect(client.inFlight === 0, 'every request answered');
} catch (error) {
  failed = true;
  console.log(JSON.stringify({ step: 'connect', ok: false, error: String(error.message ?? error) }));
} finally {
  const closed = await client?.close();
  if (closed) console.log(JSON.stringify({ step: 'close', ok: closed.code === 1000, code: closed.code }));
  if (closed && closed.code !== 1000) failed = true;
}
process.exitCode = failed ? 1 : 0;
