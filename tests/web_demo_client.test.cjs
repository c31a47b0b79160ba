// Unit tests of web_demo/client.js (the demo page's DOM-free WebSocket client), run with `node --test`
// by tests/test_web_demo.py. A fake WebSocket and fake timers drive it; no network, no browser.
'use strict';

const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');
const test = require('node:test');

const ROOT = path.resolve(__dirname, '..');
const { State, transition, backoffMs, Client, OVERLOAD_REASONS, ERROR_CODES, overloadText, redactToken, utf8Bytes } =
  require(path.join(ROOT, 'web_demo', 'client.js'));

function schema(name) {
  return JSON.parse(fs.readFileSync(path.join(ROOT, 'protocol', 'schemas', name), 'utf8'));
}

class FakeSocket {
  constructor(url) {
    this.url = url;
    this.readyState = 0;
    this.sent = [];
    this.closedWith = null;
    FakeSocket.all.push(this);
  }
  send(text) { this.sent.push(JSON.parse(text)); }
  close(code) { this.closedWith = code; }
  // what the server does
  open() { this.readyState = 1; this.onopen(); }
  frame(obj) { this.onmessage({ data: JSON.stringify(obj) }); }
  hello() { this.open(); this.frame({ type: 'hello', protocol: 1, model: 'm', mask_token: '[MASK]' }); }
  drop(code, reason) { this.readyState = 3; this.onclose({ code: code || 1006, reason: reason || '' }); }
}
FakeSocket.all = [];

/** A client on fake sockets and a fake clock; `events` records every callback. */
function harness(url, options) {
  FakeSocket.all = [];
  const timers = [];
  const clock = { t: 1000 };
  const events = [];
  const on = {};
  for (const name of ['status', 'log', 'hello', 'stats', 'settle', 'strayError', 'goingAway', 'handshakeFailed',
    'badUrl', 'notJson', 'incompatible']) {
    on[name] = (...args) => events.push([name, ...args]);
  }
  const client = new Client({
    url: url || 'ws://x/', WebSocket: FakeSocket, on,
    setTimeout: (f, ms) => { const t = { f, at: clock.t + ms, ms }; timers.push(t); return t; },
    clearTimeout: (t) => { const i = timers.indexOf(t); if (i >= 0) timers.splice(i, 1); },
    random: () => 0.5, now: () => clock.t, helloTimeoutMs: 0, ...options,
  });
  const runTimers = () => {
    while (timers.length) {
      const t = timers.shift();
      clock.t = Math.max(clock.t, t.at);
      t.f();
    }
  };
  const socket = () => FakeSocket.all[FakeSocket.all.length - 1];
  return { client, timers, clock, events, runTimers, socket };
}

const settled = (events) => events.filter((e) => e[0] === 'settle').map((e) => [e[1].id, e[2]]);

// The values this version sends of an open list: the enum beside the branch for a later version's (x-later).
const thisVersions = (branches) => branches.filter((branch) => branch['x-later'] !== true);
const known = (open) => thisVersions(open.anyOf)[0].enum;

test('the reasons and codes table matches protocol/schemas', () => {
  const overloaded = schema('overloaded.json');
  assert.deepEqual(Object.keys(OVERLOAD_REASONS).sort(), [...known(overloaded.properties.reason)].sort());
  // Each reason's status, as the schema's oneOf pairs them.
  const statusOf = {};
  for (const branch of thisVersions(overloaded.oneOf)) {
    const reasons = branch.properties.reason.enum || [branch.properties.reason.const];
    for (const reason of reasons) statusOf[reason] = branch.properties.status.const;
  }
  for (const [reason, entry] of Object.entries(OVERLOAD_REASONS)) assert.equal(entry.status, statusOf[reason], reason);
  assert.deepEqual(Object.keys(ERROR_CODES).sort(), [...known(schema('defs.json').$defs.error_code)].sort());
  assert.match(overloadText('queue_share'), /share/);
  assert.equal(overloadText('something_new'), 'The server is overloaded');
  assert.equal(overloadText('constructor'), 'The server is overloaded');
});

test('the token in an address is hidden, or left out, for everything the page shows or keeps', () => {
  assert.equal(redactToken('wss://h:1/?token=s3cret'), 'wss://h:1/?token=***');
  assert.equal(redactToken('wss://h:1/?token=s3cret', false), 'wss://h:1/');
  assert.equal(redactToken('ws://h/?a=1&token=x%20y&b=2', false), 'ws://h/?a=1&b=2');
  assert.equal(redactToken('ws://h/?tok%65n=s3cret'), 'ws://h/?token=***');  // the server decodes names too
  assert.equal(redactToken('ws://h/'), 'ws://h/');
  assert.equal(redactToken('not a url'), 'not a url');
  // An address the URL parser refuses (the page's "not a WebSocket URL" notice shows it) still hides it.
  assert.equal(redactToken('ws://h:70000/?token=s3cret'), 'ws://h:70000/?token=***');
  assert.equal(redactToken('ws://my host/?a=1&token=s3cret&b=2', false), 'ws://my host/?a=1&b=2');
  const { client, events, socket } = harness('ws://h/?token=s3cret');
  client.connect();
  const logged = events.filter((e) => e[0] === 'log').map((e) => e[2]);
  assert.ok(logged.some((text) => text.includes('token=***')), logged);
  assert.ok(!logged.some((text) => text.includes('s3cret')), logged);  // (status events carry it, for the page)
  assert.equal(socket().url, 'ws://h/?token=s3cret');  // the socket itself still presents it
});

test('transition: one table, final close, events that mean nothing leave the state', () => {
  assert.equal(transition(State.CONNECTING, 'hello'), State.OPEN);
  assert.equal(transition(State.OPEN, 'going_away'), State.DRAINING);
  assert.equal(transition(State.CONNECTING, 'going_away'), State.DRAINING);
  for (const s of Object.values(State)) assert.equal(transition(s, 'close'), State.CLOSED);
  assert.equal(transition(State.OPEN, 'hello'), State.OPEN);
  assert.equal(transition(State.DRAINING, 'hello'), State.DRAINING);
  assert.equal(transition(State.CLOSED, 'hello'), State.CLOSED);
  assert.equal(transition(State.CLOSED, 'going_away'), State.CLOSED);
  assert.throws(() => transition('half-open', 'close'));
});

test('a page whose server stays down tries again at least every 5 s (+20%)', () => {
  const { client, socket, timers, runTimers } = harness();
  client.connect();
  socket().hello();
  socket().drop(1006);
  const delays = [];
  for (let i = 0; i < 8; i++) {  // bounded: eight refused attempts
    delays.push(timers[0].ms);
    runTimers();
    socket().drop(1006);
  }
  assert.deepEqual(delays, [500, 1000, 2000, 4000, 5000, 5000, 5000, 5000]);
});

test('backoff doubles from 500 ms to a cap, with +-20% jitter', () => {
  assert.deepEqual([0, 1, 2, 5, 10].map((a) => backoffMs(a, 500, 15000, () => 0.5)), [500, 1000, 2000, 15000, 15000]);
  assert.equal(backoffMs(0, 500, 15000, () => 0), 400);
  assert.ok(Math.abs(backoffMs(0, 500, 15000, () => 1) - 600) < 1e-9);
});

test('nothing is sent before hello; requests get growing ids and settle once', () => {
  const { client, events, socket } = harness();
  client.connect();
  assert.equal(client.state, State.CONNECTING);
  assert.equal(client.request({ text: 'a [MASK]' }), null);
  assert.equal(client.send({ type: 'subscribe_stats' }), false);
  socket().hello();
  assert.equal(client.state, State.OPEN);
  assert.ok(client.isOpen);
  const a = client.request({ text: 'a [MASK]' });
  const b = client.request({ text: 'b [MASK]' });
  assert.deepEqual([a.id, b.id], [1, 2]);
  assert.deepEqual(socket().sent, [{ type: 'fill_mask', id: 1, text: 'a [MASK]' }, { type: 'fill_mask', id: 2, text: 'b [MASK]' }]);
  socket().frame({ type: 'result', id: 2, predictions: [] });
  socket().frame({ type: 'result', id: 2, predictions: [] });  // a second terminal frame: ignored
  assert.ok(client.cancel(a));
  assert.ok(!client.cancel(a));  // asked already
  socket().frame({ type: 'cancelled', id: 1 });
  assert.deepEqual(settled(events), [[2, 'result'], [1, 'cancelled']]);
  assert.equal(client.inflight.size, 0);
  socket().frame({ type: 'error', id: null, code: 'invalid_json', message: 'x' });
  assert.equal(events.filter((e) => e[0] === 'strayError').length, 1);
});

test('a dropped connection loses its requests, backs off, and ids are never reused', () => {
  const { client, events, socket, timers, runTimers } = harness();
  client.connect();
  socket().hello();
  client.request({ text: 'a' });
  socket().drop(1006);
  assert.equal(client.state, State.CLOSED);
  assert.deepEqual(settled(events), [[1, 'lost']]);
  assert.equal(events.find((e) => e[0] === 'settle')[3].code, 1006);
  assert.equal(timers.length, 1);
  assert.equal(timers[0].ms, 500);  // the first retry
  assert.equal(client.status().retryAt, 1500);
  runTimers();
  assert.equal(FakeSocket.all.length, 2);
  socket().drop(1006);  // refused before hello: the handshake failed
  assert.equal(timers[0].ms, 1000);  // the second retry waits twice as long
  const failed = events.filter((e) => e[0] === 'handshakeFailed');
  assert.deepEqual(failed[failed.length - 1].slice(1), ['ws://x/', 2]);
  runTimers();
  socket().hello();
  assert.equal(client.status().attempt, 2);  // reset only by a connection that lasted
  assert.equal(client.request({ text: 'b' }).id, 2);
});

test('going_away: the old connection drains (receives only), a new one opens', () => {
  const { client, events, socket, timers, runTimers } = harness();
  client.connect();
  const old = socket();
  old.hello();
  client.request({ text: 'owed' });
  old.frame({ type: 'going_away', reconnect_within_ms: 2000 });
  assert.equal(client.state, State.DRAINING);
  assert.ok(client.status().restarting);
  assert.equal(client.request({ text: 'not sent' }), null);
  assert.equal(old.sent.length, 1);
  assert.deepEqual(events.filter((e) => e[0] === 'goingAway').map((e) => e[2]), [1]);
  assert.equal(timers[0].ms, 1000);  // random() * reconnect_within_ms
  runTimers();
  const fresh = socket();
  assert.notEqual(fresh, old);
  assert.equal(client.state, State.CONNECTING);
  old.frame({ type: 'result', id: 1, predictions: [] });  // the answer still owed arrives on the old one
  assert.deepEqual(settled(events), [[1, 'result']]);
  old.frame({ type: 'stats', queue_depth: 1 });  // not the current connection: not shown
  assert.equal(events.filter((e) => e[0] === 'stats').length, 0);
  old.drop(1001);
  assert.equal(timers.length, 0);  // a drained connection closing schedules nothing
  fresh.hello();
  assert.equal(client.state, State.OPEN);
  assert.ok(!client.status().restarting);
  assert.equal(client.request({ text: 'again' }).id, 2);
});

test('going_away right after every hello backs off; a huge hint is held to a minute', () => {
  // A review's stand-in server said going_away with reconnect_within_ms 0 after each hello: the page
  // reconnected 460 times in 6 s, and a hint of 1e11 ms had it wait 106 days.
  const { client, socket, timers, runTimers, clock } = harness();
  client.connect();
  const delays = [];
  for (let i = 0; i < 5; i += 1) {
    socket().hello();
    socket().frame({ type: 'going_away', reconnect_within_ms: 0 });
    delays.push(timers[0].ms);
    runTimers();
  }
  assert.deepEqual(delays, [500, 1000, 2000, 4000, 5000]);  // (the cap: 5 s)
  socket().hello();
  clock.t += 6000;  // a connection that lasted: the hint alone, from the start again
  socket().frame({ type: 'going_away', reconnect_within_ms: 1e11 });
  assert.equal(timers[0].ms, 0.5 * 60000);
  assert.equal(client.state, State.DRAINING);
});

test('a hello of another protocol version: closed with 1000, nothing sent, no retry (§14)', () => {
  // Found by a protocol review: the page showed a notice, then sent requests to such a server.
  const { client, events, socket, timers } = harness();
  client.connect();
  const ws = socket();
  ws.open();
  ws.frame({ type: 'hello', protocol: 2, model: 'm', mask_token: '[MASK]' });
  assert.equal(ws.closedWith, 1000);
  assert.equal(client.request({ text: 'a [MASK]' }), null);
  assert.deepEqual(ws.sent, []);
  ws.drop(1000);
  assert.equal(timers.length, 0);
  assert.deepEqual(events.filter((e) => e[0] === 'incompatible'), [['incompatible', 2]]);
  assert.equal(events.filter((e) => e[0] === 'hello').length, 0);
  client.connect();  // Retry now: tries again
  assert.notEqual(socket(), ws);
});

test('no hello within the timeout: the attempt is given up and retried with the backoff', () => {
  // A review's stand-ins (TCP accepted, no handshake answer; or no hello) held the page on
  // "Connecting" for good, with no way out.
  const { client, socket, timers, clock, events } = harness('ws://x/', { helloTimeoutMs: 10000 });
  client.connect();
  const silent = socket();
  silent.open();  // the WebSocket opened, but no hello comes
  assert.equal(timers.length, 1);
  const t = timers.shift();
  clock.t = t.at;
  t.f();
  assert.equal(silent.closedWith, undefined);  // close() was called (it starts as null)
  assert.equal(client.status().lastClose.reason, 'no hello within 10 s');
  assert.equal(timers.length, 1);
  assert.equal(timers[0].ms, 500);  // the backoff's first step
  const retry = timers.shift();
  clock.t = retry.at;
  retry.f();
  const fresh = socket();
  assert.notEqual(fresh, silent);
  fresh.hello();  // a hello in time: its timer is cleared, the connection is open
  assert.equal(client.state, State.OPEN);
  assert.equal(timers.length, 0);
  silent.drop(1006);  // the given-up socket's own close event changes nothing
  assert.equal(client.state, State.OPEN);
  assert.ok(events.some((e) => e[0] === 'status'));
});

test('duplicate_id is not the in-flight request\'s answer (§7)', () => {
  const { client, events, socket } = harness();
  client.connect();
  socket().hello();
  client.request({ text: 'a [MASK]' });
  socket().frame({ type: 'error', id: 1, code: 'duplicate_id', message: 'in flight' });
  assert.deepEqual(settled(events), []);
  assert.ok(client.inflight.has(1));
  assert.equal(events.filter((e) => e[0] === 'strayError').length, 1);
  socket().frame({ type: 'result', id: 1, predictions: [] });
  assert.deepEqual(settled(events), [[1, 'result']]);
});

test('connect() to a new address closes the old connection and starts afresh', () => {
  const { client, events, socket } = harness();
  client.connect();
  const old = socket();
  old.hello();
  client.request({ text: 'a' });
  client.connect('ws://y/');
  assert.equal(old.closedWith, 1000);
  assert.deepEqual(settled(events), [[1, 'lost']]);
  old.drop(1000);  // its close event comes later: nothing more happens
  old.frame({ type: 'result', id: 1, predictions: [] });
  assert.deepEqual(settled(events), [[1, 'lost']]);
  assert.equal(socket().url, 'ws://y/');
  assert.deepEqual(client.status(), { state: State.CONNECTING, url: 'ws://y/', attempt: 0, retryAt: 0,
    restarting: false, everConnected: false, lastClose: null, badUrl: false });
});

test('a URL the WebSocket constructor refuses is reported, and nothing is scheduled', () => {
  const { client, events, timers } = harness();
  client.WebSocket = function () { throw new SyntaxError('bad'); };
  client.connect('nonsense');
  assert.deepEqual(events.filter((e) => e[0] === 'badUrl').map((e) => e[1]), ['nonsense']);
  assert.equal(timers.length, 0);
  assert.equal(client.state, State.CLOSED);
  // The status says so (the page shows "Not a WebSocket URL", no Retry now), until a good address.
  assert.equal(client.status().badUrl, true);
  client.retryNow();
  assert.equal(client.status().badUrl, true);
  assert.equal(timers.length, 0);
  client.WebSocket = FakeSocket;
  client.connect('ws://good/');
  assert.equal(client.status().badUrl, false);
});

test('an address the constructor refuses leaves the open connection and its requests alone', () => {
  // A review: a typo in the address field (or ws:// typed on an https page, Chromium's SecurityError)
  // closed the working connection first, and every request in flight on it was lost.
  const { client, events, socket } = harness();
  client.connect();
  const old = socket();
  old.hello();
  client.request({ text: 'a' });
  client.WebSocket = function () { const err = new Error('insecure'); err.name = 'SecurityError'; throw err; };
  client.connect('ws://elsewhere:8765/');
  assert.deepEqual(events.filter((e) => e[0] === 'badUrl').map((e) => e.slice(1)),
    [['ws://elsewhere:8765/', 'SecurityError']]);
  assert.equal(old.closedWith, null);  // never closed
  assert.deepEqual(settled(events), []);
  assert.equal(client.isOpen, true);
  assert.equal(client.url, 'ws://x/');
  old.frame({ type: 'result', id: 1, predictions: [] });
  assert.deepEqual(settled(events), [[1, 'result']]);
});

test('a frame larger than hello.limits.max_frame_bytes (UTF-8 bytes) is never sent (§1: 1009)', () => {
  assert.deepEqual(['', 'a', 'é', '€', '😀', '\ud800', 'a😀é'].map(utf8Bytes), [0, 1, 2, 3, 4, 3, 7]);
  for (const text of ['Paris é 😀 [MASK]', '\u0000\u2028"\\']) {
    const json = JSON.stringify({ text });
    assert.equal(utf8Bytes(json), Buffer.byteLength(json, 'utf8'));
  }
  const { client, socket } = harness();
  client.connect();
  socket().open();
  socket().frame({ type: 'hello', protocol: 1, model: 'm', mask_token: '[MASK]', limits: { max_frame_bytes: 100 } });
  assert.equal(client.maxFrameBytes, 100);
  const first = client.request({ text: 'a [MASK]' });
  assert.equal(first.outcome, null);
  // {"type":"fill_mask","id":N,"text":"..."}: 37 bytes around the text; 63 bytes of text fit, 64 do not.
  const fits = client.request({ text: 'é'.repeat(31) + 'x' });
  assert.equal(fits.tooBig, undefined);
  assert.equal(utf8Bytes(JSON.stringify(fits.frame)), 100);
  const big = client.request({ text: 'é'.repeat(32) });
  assert.deepEqual([big.id, big.outcome, big.tooBig], [3, 'too_big', { bytes: 101, limit: 100 }]);
  assert.ok(!client.inflight.has(big.id));
  assert.deepEqual(socket().sent.map((f) => f.id), [1, 2]);  // the others are still in flight
  assert.deepEqual(Array.from(client.inflight.keys()), [1, 2]);
  assert.equal(client.send({ type: 'cancel', id: 'x'.repeat(200) }), false);
  assert.equal(client.request({ text: 'b [MASK]' }).id, 4);  // ids still only grow
  assert.deepEqual(socket().sent.map((f) => f.id), [1, 2, 4]);
});
