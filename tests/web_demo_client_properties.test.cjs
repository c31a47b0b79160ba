// Randomized property tests of web_demo/client.js (the demo page's DOM-free WebSocket client), run with
// `node --test`. A scripted fake WebSocket, fake timers and a seeded PRNG (mulberry32, fixed seeds: the
// runs are deterministic) drive the Client through random sequences of what the page does (requests
// with various options, cancels, connect/retryNow, bad addresses) and what the server and network do
// (hello, answers of every kind, duplicate and stray answers, malformed frames, going_away, closes with
// various codes, socket errors, time passing). After every step the invariants of client.js's header
// comment are checked:
//   - request ids only grow and are never reused (on the wire and in the records);
//   - each request is settled exactly once: by its terminal frame on its own connection, or when that
//     connection closes (never by a frame on another connection, never twice, never left behind);
//   - at most one connection is current (connecting or open), any number draining;
//   - while no connection is current, exactly one reconnection is scheduled (unless the URL is bad, or
//     the server spoke another protocol version: §14, no retry), and none while one is current;
//   - nothing is sent on a draining or closed connection (or before hello);
//   - no exception escapes to the caller, whatever the server sends.
// A failure names the seed and the last steps, so that it can be replayed: PROPS_SEED=<n> node --test ...
// PROPS_CLIENT_JS=<file> runs the same properties against another copy of client.js (e.g. a mutant, to
// check that the properties catch a planted bug).
'use strict';

const assert = require('node:assert/strict');
const path = require('node:path');
const test = require('node:test');

const ROOT = path.resolve(__dirname, '..');
const { State, Client, OVERLOAD_REASONS, ERROR_CODES } = require(process.env.PROPS_CLIENT_JS || path.join(ROOT, 'web_demo', 'client.js'));

/** A tiny seeded PRNG (mulberry32): a function returning floats in [0, 1). */
function mulberry32(seed) {
  let a = seed >>> 0;
  return function () {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

class Violation extends Error {}

const ERROR_CODE_LIST = Object.keys(ERROR_CODES).filter((c) => c !== 'duplicate_id');
const REASONS = Object.keys(OVERLOAD_REASONS).concat(['something_new']);
const CLOSE_CODES = [1000, 1001, 1006, 1008, 1009, 1011, 1013, 4000, 0, undefined];
const TEXTS = ['a [MASK]', 'Paris is the [MASK] of France.', 'é😀 [MASK] \u2028"\\', 'x'.repeat(150) + ' [MASK]',
  'no mask', '', '\ud800 [MASK]'];

/** Frames no server should send, and data that is not a frame at all: none may throw out of the client. */
const MALFORMED = [
  '', 'not json', '{', '}', 'null', 'true', '42', '"hello"', '[]', '[{"type":"result","id":1}]', '{}',
  '{"type":5}', '{"type":null,"id":1}', '{"type":"result"}', '{"type":"result","id":"1"}', '{"type":"result","id":null}',
  '{"type":"result","id":1.5}', '{"type":"result","id":{}}', '{"type":"result","id":[1]}',
  '{"type":"error","id":{},"code":null}', '{"type":"error","code":"duplicate_id"}', '{"type":"error"}',
  '{"type":"overloaded","id":-1,"retry_after_ms":"soon"}', '{"type":"cancelled","id":1e400}',
  '{"type":"unknown_thing","id":1}', '{"type":"constructor","id":1}', '{"type":"__proto__","id":1}',
  '{"__proto__":{"type":"hello","protocol":1}}', '{"type":"stats"}', '{"type":"stats","queue_depth":"x"}',
  '{"type":"hello"}', '{"type":"hello","protocol":"1"}', '{"type":"hello","protocol":1,"limits":null}',
  '{"type":"hello","protocol":1,"limits":{"max_frame_bytes":"x"}}', '{"type":"hello","protocol":1,"limits":[]}',
  '{"type":"hello","protocol":1,"limits":{"max_frame_bytes":-5}}', '{"type":"hello","protocol":null}',
  '{"type":"going_away"}', '{"type":"going_away","reconnect_within_ms":"abc"}',
  '{"type":"going_away","reconnect_within_ms":-1}', '{"type":"going_away","reconnect_within_ms":1e400}',
  '{"type":"going_away","reconnect_within_ms":null}', '{"type":"going_away","reconnect_within_ms":{}}',
  '{"type":"going_away","reconnect_within_ms":[5]}', '{"type":"going_away","reconnect_within_ms":1e11}',
  '\u0000', '\ud800', '{"type":"result","id":1,"predictions":' + '['.repeat(50) + ']'.repeat(50) + '}',
];
const NOT_TEXT = [() => undefined, () => null, () => 7, () => ({ type: 'result', id: 1 }), () => new ArrayBuffer(4),
  () => Buffer.from('{"type":"stats"}'), () => Symbol('x'), () => [1, 2]];

/** One randomized run: a Client against scripted sockets, `steps` random steps, invariants after each. */
function runOnce(seed, steps, reentrant = false) {
  const rnd = mulberry32(seed);
  const clientRandom = mulberry32(seed ^ 0x9e3779b9);
  const pick = (list) => list[Math.floor(rnd() * list.length)];
  const chance = (p) => rnd() < p;
  const trace = [];
  const violations = [];
  const fail = (what) => { violations.push(what); };

  // ---- the world: clock, timers, sockets
  const clock = { t: 1000 };
  let timers = [];     // pending {f, at, ms, kind, seq}
  let timerSeq = 0;
  let ctx = { kind: 'none' };   // what the harness is delivering right now
  const sockets = [];
  const closedByClient = new Set();  // sockets the client called close() on during the current step

  const helloTimeoutMs = pick([0, 10000, 10000, 300]);

  class ScriptSocket {
    constructor(url) {
      if (String(url).startsWith('bad:')) {
        const err = new Error('not a WebSocket URL');
        err.name = pick(['SyntaxError', 'SecurityError']);
        throw err;
      }
      this.url = url;
      this.readyState = 0;
      this.sent = [];        // frames the client sent, parsed
      this.closeCalls = [];  // codes the client closed it with
      this.closeEvented = false;
      this.pendingClose = null;  // a close event still to be delivered
      this.owed = new Map();     // id -> fill_mask frame not yet answered by the "server"
      this.answered = [];        // ids the server answered on this socket (for duplicate answers)
      this.index = sockets.length;
      sockets.push(this);
    }

    send(text) {
      if (typeof text !== 'string') fail(`socket ${this.index}: send() of a non-string`);
      const frame = JSON.parse(text);
      const cur = client.current;
      if (this.closeEvented || this.readyState !== 1) fail(`sent ${text} on socket ${this.index} in readyState ${this.readyState}`);
      if (!cur || cur.ws !== this) fail(`sent ${text} on socket ${this.index}, which is not the current connection's`);
      else if (cur.state !== State.OPEN) fail(`sent ${text} on socket ${this.index} in state ${cur.state}`);
      for (const c of client.draining) if (c.ws === this) fail(`sent ${text} on draining socket ${this.index}`);
      if (frame.type === 'fill_mask') {
        if (!(frame.id > world.maxWireId)) fail(`fill_mask id ${frame.id} sent after id ${world.maxWireId}`);
        world.maxWireId = Math.max(world.maxWireId, frame.id);
        this.owed.set(frame.id, frame);
      } else if (frame.type === 'cancel') {
        if (!this.owed.has(frame.id) && !outstanding.has(frame.id)) fail(`cancel of id ${frame.id}, not in flight on socket ${this.index}`);
      }
      this.sent.push(frame);
    }

    close(code) {
      this.closeCalls.push(code);
      closedByClient.add(this);
      if (!this.closeEvented && this.readyState < 2) {
        this.readyState = 2;
        this.pendingClose = { code: code === undefined ? 1005 : code, reason: '' };
      }
    }
  }

  const setTimeoutFake = (f, ms) => {
    const kind = /onNoHello/.test(String(f)) ? 'hello' : 'retry';  // connect()'s hello timer, or a reconnection
    if (!Number.isFinite(ms) || ms < 0 || ms > 60000) fail(`setTimeout with ${ms} ms`);
    const t = { f, at: clock.t + ms, ms, kind, seq: timerSeq++ };
    timers.push(t);
    return t;
  };
  const clearTimeoutFake = (t) => { timers = timers.filter((x) => x !== t); };

  // ---- what the client reports
  const world = { maxWireId: 0, maxRecId: 0, incompatible: false };
  const seen = {};  // coverage: what happened, by name
  const saw = (name) => { seen[name] = (seen[name] || 0) + 1; };
  const outstanding = new Map();  // id -> rec: requests sent and not settled yet
  const settledIds = new Set();
  let settleCalls = [];           // settles during the current step: [rec, outcome, msg]
  let lostChecks = [];            // requests lost during the current step other than by a close event

  // reentrant: a callback sometimes acts as the page at once (a request, a cancel, a connect), inside
  // the client's own call, as a page's handler could.
  let depth = 0;
  const maybeReenter = (where) => {
    if (!reentrant || depth > 0 || !chance(0.15)) return;
    const saved = ctx;
    depth += 1;
    trace.push(`  (inside ${where}:)`);
    try { pageMove(true); } finally { depth -= 1; ctx = saved; }
  };
  const client = new Client({
    url: 'ws://x/', WebSocket: ScriptSocket,
    on: {
      settle: (rec, outcome, msg) => {
        settleCalls.push([rec, outcome, msg]);
        saw('settle ' + outcome);
        if (settledIds.has(rec.id)) fail(`request ${rec.id} settled twice (${outcome})`);
        if (!outstanding.has(rec.id)) fail(`request ${rec.id} settled (${outcome}) but it was not in flight`);
        settledIds.add(rec.id);
        outstanding.delete(rec.id);
        if (rec.outcome !== outcome) fail(`request ${rec.id}: rec.outcome ${rec.outcome} but settled as ${outcome}`);
        const sock = rec.conn && rec.conn.ws;
        if (outcome === 'lost') {
          // Only when its own connection closes: its close event, or the client closing it itself.
          // (connect() settles them just before it calls close(): checked at the end of the step)
          const ownClose = ctx.kind === 'close' && ctx.socket === sock;
          if (!ownClose) lostChecks.push([rec, sock, ctx.kind]);
          if (rec.conn.state !== State.CLOSED) fail(`request ${rec.id} lost on a connection in state ${rec.conn.state}`);
          if (!msg || typeof msg.code !== 'number') fail(`request ${rec.id} lost without a close code`);
        } else {
          if (ctx.kind !== 'frame' || ctx.socket !== sock) fail(`request ${rec.id} settled (${outcome}) by a frame on another socket (${ctx.kind} ${ctx.socket && ctx.socket.index}, own ${sock && sock.index})`);
          else if (!ctx.msg || ctx.msg.id !== rec.id || ctx.msg.type !== outcome) fail(`request ${rec.id} settled as ${outcome} by ${ctx.data}`);
          else if (ctx.msg.type === 'error' && ctx.msg.code === 'duplicate_id') fail(`request ${rec.id} settled by a duplicate_id error`);
        }
        maybeReenter('settle ' + outcome);
      },
      log: () => {}, status: () => maybeReenter('status'), hello: () => maybeReenter('hello'), stats: () => {}, strayError: () => saw('strayError'), goingAway: (m, owed) => { saw(owed ? 'going_away with requests owed' : 'going_away'); maybeReenter('goingAway'); },
      handshakeFailed: () => {}, badUrl: () => {}, notJson: () => {}, incompatible: () => { world.incompatible = true; saw('incompatible hello'); },
    },
    setTimeout: setTimeoutFake, clearTimeout: clearTimeoutFake, random: clientRandom, now: () => clock.t,
    helloTimeoutMs, backoffFirstMs: pick([undefined, 100, 500]), lastedMs: pick([undefined, 1000, 5000]),
  });

  // ---- the server's and network's moves on one socket
  const live = () => sockets.filter((s) => !s.closeEvented);
  const openSockets = () => sockets.filter((s) => !s.closeEvented && s.readyState === 1);

  function deliver(sock, data, label) {
    if (sock.closeEvented || sock.readyState !== 1) return;  // a browser delivers messages only while OPEN
    let msg;
    try { msg = typeof data === 'string' ? JSON.parse(data) : undefined; } catch (e) { msg = undefined; }
    ctx = { kind: 'frame', socket: sock, msg: msg && typeof msg === 'object' ? msg : null, data: typeof data === 'string' ? data : String(typeof data) };
    trace.push(`socket ${sock.index} <- ${label || ctx.data}`);
    // What the invariant says must happen: a terminal frame about a request in flight on this very
    // connection (not closed) settles it, at once; anything else settles nothing.
    const m = ctx.msg;
    let expected = null;
    if (m && ['result', 'error', 'overloaded', 'cancelled'].includes(m.type) && !(m.type === 'error' && m.code === 'duplicate_id')) {
      const rec = outstanding.get(m.id);
      if (rec && rec.conn.ws === sock && rec.conn.state !== State.CLOSED) expected = rec.id;
    }
    sock.onmessage({ data });
    const got = settleCalls.filter((s) => s[1] !== 'lost').map((s) => s[0].id);
    if (expected !== null && !(got.length === 1 && got[0] === expected)) fail(`${ctx.data} on socket ${sock.index}: expected request ${expected} settled, got [${got}]`);
    if (expected === null && got.length) fail(`${ctx.data} on socket ${sock.index} settled [${got}], expected nothing`);
    if (m && m.id !== undefined) sock.owed.delete(m.id);
  }

  function fireClose(sock, code, reason) {
    if (sock.closeEvented) return;
    sock.readyState = 3;
    sock.closeEvented = true;
    sock.pendingClose = null;
    ctx = { kind: 'close', socket: sock };
    trace.push(`socket ${sock.index} closes with ${code}${reason ? ' ' + reason : ''}`);
    sock.onclose({ code, reason: reason || '', wasClean: code === 1000 || code === 1001 });
  }

  function answer(sock) {
    const owedIds = Array.from(sock.owed.keys());
    let id;
    const r = rnd();
    if (owedIds.length && r < 0.75) id = pick(owedIds);
    else if (sock.answered.length && r < 0.85) id = pick(sock.answered);         // a second answer
    else if (r < 0.93) id = Math.max(1, world.maxWireId - Math.floor(rnd() * 4)); // maybe another socket's
    else id = world.maxWireId + 1 + Math.floor(rnd() * 3);                       // an id never sent
    const k = rnd();
    let frame;
    if (k < 0.35) frame = { type: 'result', id, predictions: [{ token: 1, token_str: 'a', score: 0.5, sequence: 'a' }] };
    else if (k < 0.5) frame = { type: 'error', id, code: pick(ERROR_CODE_LIST), message: 'm' };
    else if (k < 0.7) {
      const reason = pick(REASONS);
      frame = { type: 'overloaded', id, status: (OVERLOAD_REASONS[reason] || { status: 503 }).status, reason,
        retry_after_ms: pick([0, 120, 1000, 30000, -1, 1e9]) };
    } else if (k < 0.78) frame = { type: 'overloaded', id, status: 504, reason: 'deadline_exceeded', queue_ms: 2000.3, retry_after_ms: 120 };
    else if (k < 0.9) frame = { type: 'cancelled', id };
    else frame = { type: 'error', id, code: 'duplicate_id', message: 'in flight' };
    deliver(sock, JSON.stringify(frame));
    sock.answered.push(id);
  }

  function serverMove() {
    const candidates = live();
    if (!candidates.length) return;
    // Mostly the newest socket; sometimes an older (draining, replaced) one.
    const sock = chance(0.7) ? candidates[candidates.length - 1] : pick(candidates);
    const r = rnd();
    if (sock.readyState === 0) {
      if (r < 0.8) { sock.readyState = 1; ctx = { kind: 'open', socket: sock }; trace.push(`socket ${sock.index} opens`); sock.onopen({}); }
      else if (r < 0.9) fireClose(sock, 1006, 'refused');
      else { sock.readyState = 3; trace.push(`socket ${sock.index} errors`); sock.onerror({}); fireClose(sock, 1006); }
      return;
    }
    saw('socket ' + (client.current && client.current.ws === sock ? client.current.state : sock.closeCalls.length ? 'replaced' : 'draining'));
    if (sock.readyState === 2 || sock.readyState === 3) {  // closing: its close event comes
      if (r < 0.6) fireClose(sock, sock.pendingClose ? sock.pendingClose.code : 1006);
      else if (r < 0.85 && sock.readyState === 2 && sock.closeCalls.length) {
        // Node's ws package still emits frames that were on their way while CLOSING (a browser does
        // not): a late answer, hello or going_away on a connection the client has closed changes nothing.
        const was = sock.readyState;
        sock.readyState = 1;
        if (chance(0.6)) answer(sock);
        else deliver(sock, JSON.stringify(pick([{ type: 'hello', protocol: 1, model: 'm', mask_token: '[MASK]' },
          { type: 'going_away', reconnect_within_ms: 0 }, { type: 'stats' }])));
        sock.readyState = was;
        saw('frame while closing');
      }
      return;
    }
    const waitsHello = client.current && client.current.ws === sock && client.current.state === State.CONNECTING;
    if (waitsHello ? r < 0.7 : r < 0.03) {
      const hello = { type: 'hello', protocol: chance(0.95) ? 1 : pick([2, 0]), model: 'm', mask_token: '[MASK]' };
      if (chance(0.3)) hello.limits = { max_frame_bytes: pick([60, 80, 120, 1 << 20]) };
      deliver(sock, JSON.stringify(hello));
    } else if (r < 0.55) answer(sock);
    else if (r < 0.6) deliver(sock, JSON.stringify({ type: 'error', id: null, code: pick(ERROR_CODE_LIST), message: 'x' }));
    else if (r < 0.7) deliver(sock, pick(MALFORMED));
    else if (r < 0.74) { const make = pick(NOT_TEXT); deliver(sock, make(), 'non-text data'); }
    else if (r < 0.78) deliver(sock, JSON.stringify({ type: 'stats', queue_depth: 1 }));
    else if (r < 0.83) deliver(sock, JSON.stringify({ type: 'going_away', reason: 'shutting_down',
      reconnect_within_ms: pick([0, 1000, 2000, 60000, -5, 'x', null, 1e11]) }));
    else if (r < 0.9) fireClose(sock, pick(CLOSE_CODES), pick(['', 'bye']));
    else if (r < 0.95) {  // a socket error: the close event follows, now or a little later
      sock.readyState = 3;
      trace.push(`socket ${sock.index} errors`);
      ctx = { kind: 'error', socket: sock };
      sock.onerror({});
      if (chance(0.5)) fireClose(sock, 1006);
      else { sock.readyState = 2; sock.pendingClose = { code: 1006 }; }
    } else {  // the server starts a close handshake: CLOSING first, the event later
      sock.readyState = 2;
      sock.pendingClose = { code: pick(CLOSE_CODES) };
      trace.push(`socket ${sock.index} starts closing`);
    }
  }

  function randomFields() {
    const fields = { text: pick(TEXTS) };
    if (chance(0.3)) fields.top_k = pick([1, 5, 0, -1, 1000, 2.5]);
    if (chance(0.2)) fields.targets = pick([['a'], ['capital', 'city'], [], ['é😀']]);
    if (chance(0.2)) fields.deadline_ms = pick([1, 100, 2000, 0, -3]);
    return fields;
  }

  function pageMove(nested) {
    ctx = { kind: 'page' };
    const r = rnd();
    if (r < 0.55) {
      const fields = randomFields();
      const wasOpen = client.isOpen;
      const rec = client.request(fields, { n: trace.length });
      trace.push(`page: request ${JSON.stringify(fields).slice(0, 60)} -> ${rec ? rec.id + (rec.outcome ? ' ' + rec.outcome : '') : 'null'}`);
      if (!wasOpen && rec) fail('request() gave a record while not open');
      if (wasOpen && !rec) fail('request() gave null while open');
      if (rec) {
        if (!(rec.id > world.maxRecId)) fail(`request id ${rec.id} after ${world.maxRecId}`);
        world.maxRecId = Math.max(world.maxRecId, rec.id);
        if (rec.outcome === 'too_big') {  // settled at once, never sent, never in flight
          if (client.inflight.has(rec.id)) fail(`too_big request ${rec.id} in flight`);
          settledIds.add(rec.id);
          saw('too_big');
        } else {
          if (rec.outcome !== null) fail(`new request ${rec.id} with outcome ${rec.outcome}`);
          if (rec.conn !== client.current) fail(`request ${rec.id} not on the current connection`);
          outstanding.set(rec.id, rec);
        }
      }
    } else if (r < 0.7) {
      const recs = Array.from(outstanding.values());
      if (!recs.length) return;
      const rec = pick(recs);
      const ok = client.cancel(rec);
      saw('cancel ' + ok);
      trace.push(`page: cancel ${rec.id} -> ${ok}`);
    } else if (r < 0.74) {
      trace.push('page: send subscribe_stats');
      client.send({ type: 'subscribe_stats', interval_ms: 1000 });
    } else if (r < 0.78) {
      trace.push('page: retryNow');
      client.retryNow();
    } else if (r < 0.81) {
      trace.push('page: connect()');
      client.connect();
    } else if (r < 0.85) {
      const url = pick(['ws://x/', 'ws://y/?token=s', 'wss://z:1/']);
      trace.push(`page: connect(${url})`);
      client.connect(url);
    } else if (r < 0.88) {
      const url = pick(['bad:typo', 'bad:ws://insecure/']);
      trace.push(`page: connect(${url})`);
      client.connect(url);
    } else if (!nested) {
      advanceTime();
    }
  }

  function advanceTime() {
    const dt = pick([0, 1, 50, 300, 300, 1000, 1000, 5000, 12000, 70000]);
    const target = clock.t + dt;
    trace.push(`time +${dt} ms`);
    for (;;) {
      const due = timers.filter((t) => t.at <= target).sort((a, b) => a.at - b.at || a.seq - b.seq)[0];
      if (!due) break;
      timers = timers.filter((t) => t !== due);
      clock.t = Math.max(clock.t, due.at);
      ctx = { kind: 'timer', timer: due };
      trace.push(`  timer (${due.kind}, ${due.ms} ms) fires at ${clock.t}`);
      saw('timer ' + due.kind);
      due.f();
      checkInvariants();
    }
    clock.t = target;
  }

  // ---- the invariants, after every step
  function checkInvariants() {
    const cur = client.current;
    if (cur && cur.state !== State.CONNECTING && cur.state !== State.OPEN) fail(`current connection in state ${cur.state}`);
    if (cur && client.draining.has(cur)) fail('the current connection is also draining');
    for (const c of client.draining) if (c.state !== State.DRAINING) fail(`a draining-set connection in state ${c.state}`);
    // Every request in flight is on a connection that is not closed; none on a closed one.
    if (client.inflight.size !== outstanding.size) fail(`client has ${client.inflight.size} in flight, the test ${outstanding.size}`);
    for (const [id, rec] of outstanding) {
      if (client.inflight.get(id) !== rec) fail(`request ${id} missing from the client's inflight`);
      if (rec.conn.state === State.CLOSED) fail(`request ${id} unsettled on a closed connection`);
      if (rec.conn.ws.closeEvented) fail(`request ${id} unsettled after its socket ${rec.conn.ws.index} closed`);
      if (rec.conn !== cur && !client.draining.has(rec.conn)) fail(`request ${id} on a connection neither current nor draining`);
    }
    // A connection whose socket closed is closed, and never current or draining.
    for (const s of sockets) {
      if (!s.closeEvented) continue;
      if (cur && cur.ws === s) fail(`socket ${s.index} closed but still current`);
      for (const c of client.draining) if (c.ws === s) fail(`socket ${s.index} closed but still draining`);
    }
    // Every socket the client opened and has not closed is the current connection's or a draining one's:
    // no connection is left outside the states (open, never used, never closed).
    for (const s of sockets) {
      if (s.closeEvented || s.closeCalls.length) continue;
      const owned = (cur && cur.ws === s) || Array.from(client.draining).some((c) => c.ws === s);
      if (!owned) fail(`socket ${s.index} is open but neither current nor draining, and the client never closed it`);
    }
    // Reconnection: exactly one scheduled while none is current; none while one is.
    const retries = timers.filter((t) => t.kind === 'retry');
    if (cur) {
      if (retries.length) fail(`${retries.length} reconnection(s) scheduled while a connection is current`);
      if (client.retryAt !== 0) fail(`retryAt ${client.retryAt} while a connection is current`);
    } else if (client.badUrl || world.incompatible) {
      if (retries.length > 1) fail(`${retries.length} reconnections scheduled`);
    } else {
      if (retries.length !== 1) fail(`${retries.length} reconnections scheduled while no connection is current`);
      else if (client.retryTimer !== retries[0] || client.retryAt !== retries[0].at) fail('retryTimer/retryAt do not name the scheduled reconnection');
    }
    if (client.nextId <= world.maxRecId) fail(`nextId ${client.nextId} not above the last id ${world.maxRecId}`);
  }

  function step(fn) {
    settleCalls = [];
    lostChecks = [];
    closedByClient.clear();
    const before = sockets.length;
    try {
      fn();
    } catch (err) {
      if (err instanceof Violation) throw err;
      fail(`an exception escaped to the caller: ${err && err.stack ? err.stack.split('\n').slice(0, 3).join(' | ') : err}`);
    }
    if (sockets.length > before) world.incompatible = false;  // a fresh attempt
    for (const [rec, sock, kind] of lostChecks) {
      if (!closedByClient.has(sock)) fail(`request ${rec.id} lost, but its socket ${sock && sock.index} did not close (${kind})`);
    }
    checkInvariants();
    if (violations.length) {
      throw new Violation(`seed ${seed}: ${violations.join('; ')}\nlast steps:\n  ${trace.slice(-40).join('\n  ')}`);
    }
  }

  step(() => { trace.push('page: connect()'); client.connect(); });
  for (let i = 0; i < steps; i++) {
    const r = rnd();
    if (r < 0.3) step(pageMove);
    else if (r < 0.82) step(serverMove);
    else step(advanceTime);
  }
  // The end: every socket closes (and pending closes arrive): nothing may be left unsettled.
  step(() => {
    trace.push('the end: every socket closes');
    for (const s of sockets.slice()) fireClose(s, s.pendingClose ? s.pendingClose.code : 1006);
  });
  if (outstanding.size) throw new Violation(`seed ${seed}: requests never settled: ${Array.from(outstanding.keys())}`);
  if (client.badUrl) saw('bad url at the end');
  return { sockets: sockets.length, settled: settledIds.size, maxId: world.maxRecId, trace: trace.length, seen };
}

const SEEDS = process.env.PROPS_SEED ? [Number(process.env.PROPS_SEED)] : Array.from({ length: 500 }, (_, i) => 1 + i * 7919);

test('random sessions keep client.js\'s invariants (ids, settle once, one current, one retry, no send after drain, no throw)', (t) => {
  const totals = { runs: 0, sockets: 0, settled: 0 };
  const seen = {};
  for (const seed of SEEDS) {
    const out = runOnce(seed, 250);
    totals.runs += 1;
    totals.sockets += out.sockets;
    totals.settled += out.settled;
    for (const [k, v] of Object.entries(out.seen)) seen[k] = (seen[k] || 0) + v;
  }
  t.diagnostic(JSON.stringify(totals));
  t.diagnostic(JSON.stringify(seen));
  if (!process.env.PROPS_SEED) {
    for (const what of ['settle result', 'settle error', 'settle overloaded', 'settle cancelled', 'settle lost', 'too_big',
      'going_away with requests owed', 'incompatible hello', 'timer hello', 'timer retry', 'strayError', 'cancel true',
      'socket draining', 'socket replaced', 'frame while closing']) {
      assert.ok(seen[what] > 0, `the runs never reached: ${what}`);
    }
  }
  // The runs did reach the interesting places (not all requests refused while connecting).
  assert.ok(totals.settled > totals.runs * 3, JSON.stringify(totals));
  assert.ok(totals.sockets > totals.runs * 2, JSON.stringify(totals));
});

test('the PRNG is deterministic: the same seed gives the same session', () => {
  assert.deepEqual(runOnce(12345, 120), runOnce(12345, 120));
  const a = mulberry32(1);
  const b = mulberry32(1);
  for (let i = 0; i < 10; i++) assert.equal(a(), b());
});

// Found by the test below: a callback that called connect() inside the client's own call left a
// connection open that was neither current nor draining (the minimal repro after it). The page (app.js)
// does not do that, but the client is an API: fixed in client.js (onSocketClose, connect).
test('reentrant: callbacks that act as the page at once (request, cancel, connect) keep the invariants', () => {
    for (const seed of SEEDS.slice(0, 200)) runOnce(seed, 250, true);
  });

test('connect() from a settle(lost) callback during a close keeps the new connection current', () => {
    // onSocketClose(conn) runs closeConnection(conn), whose settle(rec, 'lost') callback here calls
    // connect(): that makes a new current connection. onSocketClose then goes on with `this.current =
    // null` and schedules a reconnection, so the new socket is neither current nor draining, never used
    // and never closed; the scheduled reconnection opens yet another one.
    const sockets = [];
    class Sock {
      constructor(url) { this.url = url; this.readyState = 0; this.closedWith = null; sockets.push(this); }
      send() {}
      close(code) { this.closedWith = code === undefined ? 1005 : code; }
    }
    const timers = [];
    let client = null;
    client = new Client({
      url: 'ws://x/', WebSocket: Sock, helloTimeoutMs: 0, random: () => 0.5, now: () => 1000,
      setTimeout: (f, ms) => { const t = { f, ms }; timers.push(t); return t; },
      clearTimeout: (t) => { const i = timers.indexOf(t); if (i >= 0) timers.splice(i, 1); },
      on: { settle: (rec, outcome) => { if (outcome === 'lost') client.connect(); } },
    });
    client.connect();
    const first = sockets[0];
    first.readyState = 1;
    first.onopen();
    first.onmessage({ data: JSON.stringify({ type: 'hello', protocol: 1, model: 'm', mask_token: '[MASK]' }) });
    assert.equal(client.request({ text: 'a [MASK]' }).id, 1);
    first.readyState = 3;
    first.onclose({ code: 1006, reason: '' });  // request 1 is lost; the callback connects at once
    assert.equal(sockets.length, 2);
    const second = sockets[1];
    // Expected: the connection the callback made is the current one (and no reconnection is scheduled),
    // or, at least, it was closed. Actual: current is null, a reconnection is scheduled, and the second
    // socket stays open, owned by nothing.
    assert.ok(client.current && client.current.ws === second || second.closedWith !== null,
      `current: ${client.current && sockets.indexOf(client.current.ws)}, second socket closed: ${second.closedWith}, timers: ${timers.length}`);
  });
