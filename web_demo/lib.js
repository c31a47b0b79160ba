/* Fill-mask demo page: the pure parts (no page state, no network), shared as window.FillMask.lib.
 *
 * Everything here takes values and returns values, so the browser test can call each function
 * directly (page.evaluate) as well as through the page. The one exception is glyphProbe, which
 * draws on a detached canvas to learn whether this device has a font for a character.
 */
'use strict';

(function () {
  const FillMask = (window.FillMask = window.FillMask || {});

  // ---------------------------------------------------------------- numbers and words

  /** Score as a percentage with three significant digits: 41.2%, 4.12%, 0.0412%. */
  function formatScore(score) {
    const pct = score * 100;
    if (pct === 0) return '0%';
    if (pct >= 99.95) return pct.toFixed(1) + '%';
    return pct.toPrecision(3) + '%';
  }

  function formatMs(ms) {
    if (typeof ms !== 'number' || !isFinite(ms)) return '–';
    if (ms < 10) return ms.toFixed(1) + ' ms';
    if (ms < 10000) return Math.round(ms) + ' ms';
    return (ms / 1000).toFixed(1) + ' s';
  }

  function plural(n, one, many) { return n + ' ' + (n === 1 ? one : many); }

  /** A span of seconds, as the live view's "over the last ...": 0.25 s, 1.0 s, 12 s. (Two decimals
   *  under a second: the shortest interval, 0.25 s, read "0.3 s" with one.) */
  function formatSeconds(s) {
    if (typeof s !== 'number' || !isFinite(s)) return '–';
    return s.toFixed(s < 1 ? 2 : s < 10 ? 1 : 0) + ' s';
  }

  /** A word as spelled apart from case, accents, surrounding spaces and a tokenizer's word-start mark
   *  (SentencePiece's ▁, byte-level BPE's Ġ): equal for "Capital" and an uncased model's "capital". */
  function foldWord(word) {
    return String(word).trim().replace(/^[\u2581\u0120]+/, '').normalize('NFKD').replace(/\p{M}/gu, '')
      .toLowerCase();
  }

  // ---------------------------------------------------------------- text as the server counts it

  /**
   * Characters as the server counts them (protocol.md §3: Python's len, i.e. Unicode code points).
   * String.length counts UTF-16 units, which says 2 for one emoji.
   */
  function codePoints(text) {
    let n = 0;
    // A for..of loop walks code points without building an array (texts may be long).
    for (const _ of text) n++;
    return n;
  }

  function countOccurrences(text, token) {
    if (!token) return 0;
    let n = 0;
    for (let i = text.indexOf(token); i !== -1; i = text.indexOf(token, i + token.length)) n++;
    return n;
  }

  /**
   * The targets field as the request's `targets`: words separated by commas, trimmed, blanks dropped.
   * Returns null for a blank field (no targets sent) and [] for one holding only commas (an error).
   */
  function parseTargets(raw) {
    if (!raw || !raw.trim()) return null;
    return raw.split(',').map((t) => t.trim()).filter((t) => t !== '');
  }

  /**
   * The start of `text` to show on a card: at most `max` code points, never cutting a `token` (the
   * mask) in two. Returns {text, more (code points left out), total}.
   */
  function clipText(text, max, token) {
    const total = codePoints(text);
    if (total <= max) return { text, more: 0, total };
    let units = 0;
    let n = 0;
    for (const ch of text) {
      if (n === max) break;
      units += ch.length;
      n++;
    }
    if (token) {
      const start = text.lastIndexOf(token, units - 1);
      if (start !== -1 && start + token.length > units) units = start + token.length;
    }
    const head = text.slice(0, units);
    return { text: head, more: total - codePoints(head), total };
  }

  /** "12,345": a count with thousands separators whatever the browser's locale. */
  function formatCount(n) { return String(n).replace(/\B(?=(\d{3})+(?!\d))/g, ','); }

  // ---------------------------------------------------------------- filled-in sentence

  /**
   * The user's text with mask i replaced by fills[i], as segments [{text, mask}] (mask: index of the
   * filled mask, or -1 for the text around it). The pipeline's own `sequence` is no good for this
   * with several masks: it keeps [CLS], [SEP] and the other masks (protocol.md §4), and it is the
   * tokenizer's normalised text (lower case for uncased models).
   *
   * Word pieces join the word before them ("##s" after "cat" reads "cats"); a token that carries its
   * own leading space (byte-level BPE) does not add a second one.
   */
  function filledSegments(text, maskToken, fills) {
    const parts = maskToken ? text.split(maskToken) : [text];
    const out = [];
    parts.forEach((part, i) => {
      if (i > 0) {
        let fill = String(fills[i - 1] ?? maskToken);
        const prev = out.length ? out[out.length - 1] : null;
        const before = prev ? prev.text : '';
        if (fill.startsWith('##') && fill.length > 2) {
          fill = fill.slice(2);
          if (prev && prev.mask === -1) prev.text = before.replace(/[ \t]$/, '');
        } else if (/^\s/.test(fill) && (before === '' || /\s$/.test(before))) {
          fill = fill.replace(/^\s+/, '');
        }
        out.push({ text: fill, mask: i - 1 });
      }
      if (part) out.push({ text: part, mask: -1 });
    });
    return out;
  }

  /**
   * filledSegments cut down to the words around each mask, for a long text: every text segment keeps
   * at most `context` code points next to each mask it touches, with "…" where words were left out.
   * The masks' segments are kept whole.
   */
  function excerptSegments(segments, context) {
    return segments.map((seg, i) => {
      if (seg.mask !== -1) return seg;
      const chars = Array.from(seg.text);
      const before = i > 0;                      // a mask comes before this text
      const after = i < segments.length - 1;     // and one after it
      const keep = (before ? context : 0) + (after ? context : 0);
      if (chars.length <= keep + 1) return seg;
      const head = before ? chars.slice(0, context).join('') : '';
      const tail = after ? chars.slice(chars.length - context).join('') : '';
      return { text: head + '…' + tail, mask: -1 };
    });
  }

  // ---------------------------------------------------------------- tokens a person can read

  const SPECIAL_TOKEN = /^(\[[A-Za-z_]+\d*\]|<[^<>\s]+>)$/;  // [unused12], [UNK], <mask>, </s>

  function uPlus(cp) { return 'U+' + cp.toString(16).toUpperCase().padStart(4, '0'); }

  /**
   * How to show a predicted token so that it never renders as a missing-glyph box or as nothing:
   * returns {text, note, special}. `note` (for a tooltip and screen readers) says what was changed;
   * `special` marks tokens that are not words (special and unused vocabulary entries).
   * `glyphMissing(ch)` (optional) says whether this device lacks a font for ch.
   */
  function readableToken(str, glyphMissing) {
    str = String(str);
    if (str === '') return { text: '∅', note: 'an empty token', special: true };
    if (SPECIAL_TOKEN.test(str)) {
      const unused = /^\[unused\d+\]$/.test(str);
      return {
        text: str,
        note: unused ? 'an unused vocabulary entry: the model was never trained on it' : 'a special token, not a word',
        special: true,
      };
    }
    if (/^\s+$/u.test(str)) {
      const codes = Array.from(str, (ch) => uPlus(ch.codePointAt(0))).join(' ');
      const space = glyphMissing && glyphMissing('␣') ? '(space)' : '␣';
      return { text: space, note: 'whitespace (' + codes + ')', special: true };
    }
    let text = '';
    const notes = [];
    let hasBase = false;
    for (const ch of str) {
      const cp = ch.codePointAt(0);
      const kind = invisibleKind(ch);
      if (kind) {
        text += '⟨' + uPlus(cp) + '⟩';
        notes.push(kind + ' ' + uPlus(cp));
        continue;
      }
      if (cp > 0x24f && glyphMissing && glyphMissing(ch)) {
        text += '⟨' + uPlus(cp) + '⟩';
        notes.push(uPlus(cp) + ', which no font on this device shows');
        hasBase = true;
        continue;
      }
      // A combining mark with nothing to sit on is drawn on a dotted circle, as Unicode charts do.
      if (/\p{M}/u.test(ch) && !hasBase) text += '◌';
      text += ch;
      if (!/\p{M}/u.test(ch) && ch !== '#') hasBase = true;
    }
    return { text, note: notes.join('; '), special: false };
  }

  /** Why ch would show as nothing or as a box whatever the fonts: its kind, or '' for a visible one. */
  function invisibleKind(ch) {
    if (/\p{Cc}/u.test(ch)) return 'control character';
    if (/\p{Cf}/u.test(ch)) return 'invisible formatting character';
    if (/\p{Co}/u.test(ch)) return 'private-use character';
    if (/\p{Cs}/u.test(ch)) return 'lone surrogate';
    if (/\p{Cn}/u.test(ch)) return 'unassigned code point';
    if (/[\p{Zl}\p{Zp}]/u.test(ch) || (/\p{Zs}/u.test(ch) && ch !== ' ')) return 'space character';
    return '';
  }

  /**
   * A function ch -> true when this device has no font for ch: the character, drawn on a canvas,
   * looks exactly like an unassigned code point (the font's missing-glyph box). Answers are cached.
   */
  function glyphProbe(font) {
    const cache = new Map();
    let ctx = null;
    let reference = null;
    const W = 48;
    const H = 40;
    function draw(ch) {
      ctx.clearRect(0, 0, W, H);
      ctx.fillText(ch, 6, H - 10);
      return ctx.getImageData(0, 0, W, H).data;
    }
    return function glyphMissing(ch) {
      if (cache.has(ch)) return cache.get(ch);
      if (!ctx) {
        const canvas = document.createElement('canvas');
        canvas.width = W;
        canvas.height = H;
        ctx = canvas.getContext('2d', { willReadFrequently: true });
        if (!ctx) return false;
        ctx.font = font;
        reference = draw('\u0378');  // unassigned since Unicode 1.1: always the missing-glyph box
      }
      const image = draw(ch);
      let same = true;
      for (let i = 3; i < image.length; i += 4) {
        if (image[i] !== reference[i]) { same = false; break; }
      }
      cache.set(ch, same);
      return same;
    };
  }

  // ---------------------------------------------------------------- burst accounting

  /**
   * Count a burst's requests by outcome. `kinds` holds each request's card state: 'pending' while
   * unanswered, else 'done', 'cancelled', 'overloaded', 'error' or 'lost'.
   */
  function tally(kinds) {
    const t = { sent: kinds.length, waiting: 0, answered: 0, cancelled: 0, overloaded: 0, errors: 0, lost: 0 };
    for (const kind of kinds) {
      if (kind === 'done') t.answered++;
      else if (kind === 'error') t.errors++;
      else if (kind in t && kind !== 'sent') t[kind]++;
      else t.waiting++;
    }
    return t;
  }

  /** "64 sent: 12 answered, 52 cancelled" (outcomes with none are left out; answered always shown). */
  function tallyText(t) {
    const parts = [t.answered + ' answered'];
    if (t.cancelled) parts.push(t.cancelled + ' cancelled');
    if (t.overloaded) parts.push(t.overloaded + ' overloaded');
    if (t.errors) parts.push(plural(t.errors, 'error', 'errors'));
    if (t.lost) parts.push(t.lost + ' lost with the connection');
    if (t.waiting) parts.push(t.waiting + ' waiting');
    return t.sent + ' sent: ' + parts.join(', ');
  }

  // ---------------------------------------------------------------- copy as code

  /** A shell word: left bare when safe, else in single quotes (a quote inside becomes '\''). */
  function shellQuote(s) {
    if (/^[A-Za-z0-9_\/:.,@%+=-]+$/.test(s)) return s;
    return "'" + s.replace(/'/g, "'\\''") + "'";
  }

  /** JSON strings are valid Python and JavaScript string literals (escapes included). */
  function literal(s) { return JSON.stringify(String(s)); }

  /** What copied code says where the page's address held a token, which the code leaves out. */
  const TOKEN_NOTE = "the server's token, from FILLMASK_TOKEN (the page leaves it out of copied code)";

  function pythonSnippet(url, frame, token) {
    const args = ['            ' + literal(frame.text) + ','];
    if (frame.top_k !== undefined) args.push('            top_k=' + frame.top_k + ',');
    if (frame.targets !== undefined) args.push('            targets=[' + frame.targets.map(literal).join(', ') + '],');
    if (frame.deadline_ms !== undefined) args.push('            deadline_ms=' + frame.deadline_ms + ',');
    const client = token
      ? ['    # ' + TOKEN_NOTE[0].toUpperCase() + TOKEN_NOTE.slice(1) + '.',
         '    async with FillMaskClient(' + literal(url) + ', token=os.environ["FILLMASK_TOKEN"]) as client:']
      : ['    async with FillMaskClient(' + literal(url) + ') as client:'];
    return [
      'import asyncio',
      ...(token ? ['import os'] : []),
      '',
      'from fillmask_client import FillMaskClient',
      '',
      '',
      'async def main() -> None:',
      ...client,
      '        predictions = await client.fill_mask(',
      ...args,
      '        )',
      '    print(predictions)',
      '',
      '',
      'asyncio.run(main())',
      '',
    ].join('\n');
  }

  /** The CLI as `bash scripts/setup.sh` installs it, so the line works without activating the venv. */
  const CLI = '.venv/bin/fillmask-client';

  function cliSnippet(url, frame, token) {
    // Each option and its value as one word (--targets=-ish,b): argparse takes a separate value that
    // starts with '-' for an option, whatever the shell's quotes were.
    const options = [];
    if (frame.top_k !== undefined) options.push('--top-k=' + frame.top_k);
    if (frame.targets !== undefined) options.push(shellQuote('--targets=' + frame.targets.join(',')));
    if (frame.deadline_ms !== undefined) options.push('--deadline-ms=' + frame.deadline_ms);
    options.push(shellQuote('--url=' + url));
    // A text starting with '-' would read as an option (and '-' alone as stdin): put it after '--'.
    const words = frame.text.startsWith('-')
      ? [CLI, ...options, '--', shellQuote(frame.text)]
      : [CLI, shellQuote(frame.text), ...options];
    return '# In the fillmask-server folder. With its venv activated, plain fillmask-client does the same.\n' +
      (token ? '# It reads ' + TOKEN_NOTE.replace(', from ', ' from ') + ': export FILLMASK_TOKEN=... first.\n' : '') +
      words.join(' ') + '\n';
  }

  function jsSnippet(url, frame, token) {
    const request = Object.assign({}, frame, { id: 1 });
    const open = token
      ? ['const url = new URL(' + literal(url) + ');',
         '// The server\'s token: FILLMASK_TOKEN in Node.js, asked for in a browser (the page leaves it out of copied code).',
         "const token = globalThis.process?.env?.FILLMASK_TOKEN || (typeof prompt === 'function' ? prompt(\"The server's token\") : '');",
         "if (!token) throw new Error(\"no token: set FILLMASK_TOKEN to the server's token\");",
         "url.searchParams.set('token', token);",
         'const ws = new WebSocketClass(url);']
      : ['const ws = new WebSocketClass(' + literal(url) + ');'];
    return [
      '// Plain WebSocket. Runs in a browser console (on a page the server allows, see --allowed-origins),',
      '// in Node.js 22+, or in Node.js 18 or 20 with the ws package (npm install ws): node ask.js',
      "const WebSocketClass = globalThis.WebSocket ?? require('ws');",
      ...open,
      'ws.onmessage = (event) => {',
      '  const frame = JSON.parse(event.data);',
      "  if (frame.type === 'hello') {",
      '    ws.send(JSON.stringify(' + JSON.stringify(request) + '));',
      '  } else if (frame.id === 1) {',
      "    // result, error, overloaded or cancelled: the request's one terminal frame",
      "    console.log(frame.type === 'result' ? frame.predictions : frame);",
      '    ws.close();',
      '  }',
      '};',
      '',
    ].join('\n');
  }

  const SNIPPETS = { python: pythonSnippet, js: jsSnippet, cli: cliSnippet };

  /**
   * The request `frame` (as sent, any id) as code in `language` ('python', 'js' or 'cli'). A token in
   * `url` is never copied (code is pasted into chats and issues): the code reads it from FILLMASK_TOKEN
   * (the client's `token=`, the command's own variable), or in a browser asks for it.
   */
  function snippet(language, url, frame) {
    const clean = {};
    for (const key of ['type', 'text', 'top_k', 'targets', 'deadline_ms']) {
      if (frame[key] !== undefined && frame[key] !== null) clean[key] = frame[key];
    }
    if (typeof clean.targets === 'string') clean.targets = [clean.targets];
    let bare = url;
    let token = false;
    try {
      const parsed = new URL(url);
      token = parsed.searchParams.has('token');
      parsed.searchParams.delete('token');
      bare = parsed.toString();
    } catch (err) { /* the page checked the address before connecting */ }
    return SNIPPETS[language](bare, clean, token);
  }

  // ---------------------------------------------------------------- why a connection failed

  /** The ports browsers refuse to open a WebSocket to (the Fetch standard's "bad ports", those of
   *  other protocols); fillmask_server/config.py warns of them at start-up (the same list). */
  const BLOCKED_PORTS = new Set([
    1, 7, 9, 11, 13, 15, 17, 19, 20, 21, 22, 23, 25, 37, 42, 43, 53, 69, 77, 79, 87, 95, 101, 102, 103,
    104, 109, 110, 111, 113, 115, 117, 119, 123, 135, 137, 139, 143, 161, 179, 389, 427, 465, 512, 513,
    514, 515, 526, 530, 531, 532, 540, 548, 554, 556, 563, 587, 601, 636, 989, 990, 993, 995, 1719,
    1720, 1723, 2049, 3659, 4045, 4190, 5060, 5061, 6000, 6566, 6665, 6666, 6667, 6668, 6669, 6679,
    6697, 10080]);

  /**
   * Why `url` is no WebSocket address (a few words, for "... is not a WebSocket URL: ..."), or '' when
   * it is one as far as the page can tell. The browser's WebSocket constructor is the judge; this only
   * names the usual slips.
   */
  function wsUrlProblem(url) {
    const m = /^(wss?):\/\/([^/?#]*)/i.exec(String(url));
    if (!m) return 'it does not start with ws:// or wss://';
    const authority = m[2].replace(/^.*@/, '');
    if (!authority) return 'it has no host';
    if (/\s/.test(authority)) return 'its host has a space in it';  // (Chromium takes it, %-escaped)
    if (authority.startsWith('[') && !authority.includes(']')) return 'its IPv6 address has no closing ]';
    const port = /:(\d+)$/.exec(authority.startsWith('[') ? authority.slice(authority.indexOf(']')) : authority);
    if (port && Number(port[1]) > 65535) return 'its port, ' + port[1] + ', is above 65535';
    if (port && BLOCKED_PORTS.has(Number(port[1]))) {
      return 'its port, ' + port[1] + ', is one that browsers refuse to connect to (the Fetch standard blocks ' +
        "it: another protocol's port); start the server on another port";
    }
    try {
      new URL(url);
    } catch (err) {
      return 'it is not a valid address';
    }
    return '';
  }

  /** The HTTP address of the server behind a WebSocket URL, for its /healthz and /readyz. */
  function httpBase(wsUrl) {
    const u = new URL(wsUrl);
    u.protocol = u.protocol === 'wss:' ? 'https:' : 'http:';
    return u.origin;
  }

  /**
   * What to tell the user after a WebSocket handshake failed (no `open`), from what the page could
   * learn without it. Browsers hide the HTTP status of a refused handshake, but the server answers
   * /healthz to anyone (no Origin rule): if something answers there, a server is up. On the page's own
   * origin /readyz says whether it is a fill-mask server (and draining or not); on another origin (or
   * from disk) the answer is opaque, so a refusal of this page cannot be told from a server that is
   * no fill-mask server, and the notice says so rather than name one cause.
   *
   * facts: {url (its token redacted, not removed), pageProtocol, pageOrigin, reachable, ready ('ready',
   * 'draining', 'engine_stopped' or null when unknown), fillMask (false: a same-origin server whose
   * /readyz is not a fill-mask server's; absent when unknown), unavailable (a same-origin /readyz
   * answered 5xx without a fill-mask server's status: a balancer with no replica ready), plainHttp (a
   * wss:// address whose host and port answer plain HTTP), tokenRequired (the page's own server was
   * started with --token: true, or not: false; absent when unknown), restarting (a going_away came),
   * everConnected, attempts (the client's attempt count: 1 once the connection dropped, one more for
   * each reconnection that failed; a page that was connected says "not reachable" only from
   * UNREACHABLE_ATTEMPTS on)}
   * returns {kind: 'reconnecting'|'refused'|'offline', label, notice (or '' for none)}
   */
  /** The attempt count from which a page that was connected says the server is not reachable: four
   *  failed reconnections, about 8 s after the connection dropped (the backoff starts at 0.5 s). */
  const UNREACHABLE_ATTEMPTS = 5;

  function diagnose(facts) {
    const url = facts.url;
    if (facts.restarting) {
      return { kind: 'reconnecting', label: 'Server is restarting; reconnecting', notice: '' };
    }
    if (!facts.reachable && facts.plainHttp) {
      return { kind: 'offline', label: 'Server not reachable over TLS', notice: 'The server at ' + url +
        ' answers plain HTTP, not TLS: connect with ws:// instead of wss:// (under "Server and limits").' };
    }
    if (!facts.reachable) {
      if (facts.everConnected && (facts.attempts || 0) < UNREACHABLE_ATTEMPTS) {
        return { kind: 'reconnecting', label: 'Reconnecting', notice: '' };
      }
      if (facts.everConnected) {
        return {
          kind: 'offline', label: 'Server not reachable',
          notice: 'Lost the connection to the server at ' + url + ', and it does not answer. Is it still ' +
            'running? The page keeps trying.',
        };
      }
      return {
        kind: 'offline', label: 'Server not reachable',
        notice: 'Cannot reach the server at ' + url + '. Is it running? The page keeps trying; ' +
          'another address can be set under "Server and limits".',
      };
    }
    if (facts.unavailable) {
      return { kind: 'reconnecting', label: 'Server unavailable; reconnecting', notice: 'The address ' +
        httpBase(url) + ' answers, but nothing behind it is ready (a balancer or an Ingress with no ' +
        'replica in rotation, as while they restart). The page keeps trying.' };
    }
    if (facts.fillMask === false && !facts.everConnected) {
      return { kind: 'refused', label: 'No fill-mask server here', notice: 'The server at ' + httpBase(url) +
        ' answers, but it is not a fill-mask server (its /readyz is not one). Set the fill-mask server\'s ' +
        'address under "Server and limits", or open this page with ?ws=ws://HOST:PORT/.' };
    }
    if (facts.ready === 'draining') {
      return { kind: 'reconnecting', label: 'Server is shutting down', notice: 'The server at ' + url +
        ' is shutting down and takes no new connections. The page keeps trying.' };
    }
    if (facts.ready === 'engine_stopped') {
      return { kind: 'refused', label: 'Server unavailable', notice: 'The server at ' + url +
        " is running but its model worker stopped, so it takes no connections. Restart the server." };
    }
    let path = '/';
    try { path = new URL(url).pathname; } catch (err) { /* checked before connecting */ }
    if (path !== '/' && path !== '/ws') {
      return { kind: 'refused', label: 'Refused by the server', notice: 'The server at ' + httpBase(url) +
        ' is running but has no WebSocket endpoint at ' + path + '. Connect to ' + httpBase(url).replace(/^http/, 'ws') + '/ .' };
    }
    const withToken = /[?&]token=/.test(url);  // (the page's copy: the token itself is redacted)
    const token = withToken
      ? 'it may have refused the token in this address (a wrong token? check the server\'s --token)'
      : 'it may need its token: add ?token=TOKEN to the address under "Server and limits"';
    // Only on its own origin can the page read /readyz, and so know that a fill-mask server answers
    // there (facts.ready). Elsewhere it knows only that something answers HTTP (an opaque /healthz):
    // browsers hide the handshake's status, so it cannot tell a refusal of this page's Origin from a
    // server that is not a fill-mask server at all. It says both, and claims neither.
    const unknown = 'Something answers HTTP at ' + httpBase(url) + ', but it did not take a WebSocket ' +
      'connection from this page, and browsers do not tell a page why. ';
    const notOne = ' If it is not a fill-mask server, set the fill-mask server\'s address under "Server and limits".';
    if (facts.pageProtocol === 'file:') {
      return {
        kind: 'refused', label: 'Refused, or no fill-mask server',
        notice: unknown + 'If it is a fill-mask server, it refused this page: a page opened from disk sends ' +
          '"Origin: null", which the server refuses by default. Start the server with --allowed-origins ' +
          'same-origin,localhost,null (or open the page it serves, ' + httpBase(url) + '/). If it already ' +
          'allows null, ' + token + '.' + notOne,
      };
    }
    const sameOrigin = facts.pageOrigin === httpBase(url);
    if (!sameOrigin) {
      return {
        kind: 'refused', label: 'Refused, or no fill-mask server',
        notice: unknown + 'If it is a fill-mask server, it refused this page: pages of this origin (' +
          facts.pageOrigin + ') may not be allowed (start it with --allowed-origins same-origin,localhost,' +
          facts.pageOrigin + '), or ' + token + ', or it has reached its --max-connections.' + notOne,
      };
    }
    const refused = 'The server at ' + url + ' is running but refused this page';
    if (facts.tokenRequired === false) {  // no token to get wrong, and its own page's origin: it is full
      return { kind: 'reconnecting', label: 'Server full; reconnecting', notice: refused + ', and it takes no ' +
        'token: it most likely has as many connections as it takes (its --max-connections); the page keeps ' +
        'trying, and connects once one closes. Or it does not allow this page\'s origin (--allowed-origins ' +
        'without same-origin, or a proxy in front that rewrites the Host header).' };
    }
    const causes = withToken
      ? ': it refused the token in this address (a wrong token? check the server\'s --token), or it has ' +
        'reached its --max-connections.'
      : (facts.tokenRequired ? ': it was started with --token' : ': it was probably started with --token') +
        '; add ?token=TOKEN to the WebSocket address under "Server and limits". Or it has reached its ' +
        '--max-connections.';
    return { kind: 'refused', label: 'Refused by the server', notice: refused + causes };
  }

  // ---------------------------------------------------------------- the raw-frame log

  /** Characters that show as nothing or reorder what follows (controls, format characters such as
   *  U+202E RIGHT-TO-LEFT OVERRIDE or U+200B ZERO WIDTH SPACE, line and paragraph separators): in the
   *  log they are written as \uXXXX escapes, so a token cannot make its frame read otherwise. */
  const INVISIBLE = /[\p{Cc}\p{Cf}\p{Zl}\p{Zp}]/gu;

  function escapeInvisible(text) {
    return text.replace(INVISIBLE, (c) => Array.from({ length: c.length },
      (_, i) => '\\u' + c.charCodeAt(i).toString(16).padStart(4, '0')).join(''));
  }

  /** JSON.stringify, with invisible characters escaped (escapeInvisible: still valid JSON). */
  function jsonText(value) {
    return escapeInvisible(JSON.stringify(value));
  }

  /**
   * JSON for people: objects and arrays that hold other objects or arrays get one member per line,
   * indented by two spaces; those that hold only numbers, strings, booleans and nulls stay on one
   * line (a prediction, a latency pair). JSON.parse of the result gives `value` back.
   */
  function prettyJson(value, indent) {
    indent = indent || '';
    if (value === null || typeof value !== 'object') return jsonText(value);
    const isArray = Array.isArray(value);
    const keys = isArray ? null : Object.keys(value);
    const members = isArray ? value : keys.map((k) => value[k]);
    const [open, close] = isArray ? ['[', ']'] : ['{', '}'];
    if (!members.length) return open + close;
    const flat = members.every((v) => v === null || typeof v !== 'object');
    const inner = flat ? '' : indent + '  ';
    const parts = members.map((v, i) => inner + (isArray ? '' : jsonText(keys[i]) + ': ') + prettyJson(v, inner));
    return flat ? open + parts.join(', ') + close : open + '\n' + parts.join(',\n') + '\n' + indent + close;
  }

  /** A frame's text as the log shows it: indented JSON (prettyJson), or as it came when not JSON. */
  function logText(text) {
    try {
      return prettyJson(JSON.parse(text));
    } catch (err) {
      return escapeInvisible(String(text));
    }
  }

  /**
   * The last `max` frames sent and received, oldest first, each as indented JSON (logText) cut to
   * `maxChars` characters, so that one 150 KB result cannot make the log heavy. `dropped` counts entries that
   * fell off the front, and stats frames dropped from the middle. Stats frames (type 'stats', one a second while the live view is open) keep at
   * most a fifth of the places, their oldest dropping first, so that they never push the requests' own
   * frames out of a log that the user may have told to hide them; `removed` lists the seq of each entry
   * dropped from the middle since the caller last took it (takeRemoved), for a view to drop too.
   */
  class FrameLog {
    constructor(max, maxChars) {
      this.max = max;
      this.maxChars = maxChars;
      this.maxStats = Math.max(1, Math.floor(max / 5));
      this.entries = [];
      this.stats = 0;
      this.removed = [];
      this.dropped = 0;
      this.seq = 0;
    }

    /** dir: 'out' (sent), 'in' (received) or 'event' (the connection opened or closed). */
    add(dir, text, type, at) {
      let shown = dir === 'event' ? String(text) : logText(text);
      if (shown.length > this.maxChars) {
        shown = shown.slice(0, this.maxChars) + ' … (' + (shown.length - this.maxChars) + ' more characters)';
      }
      const entry = { seq: ++this.seq, dir, type: type || '', text: shown, at };
      this.entries.push(entry);
      if (entry.type === 'stats' && ++this.stats > this.maxStats) {
        const oldest = this.entries.findIndex((e) => e.type === 'stats');
        this.removed.push(this.entries[oldest].seq);
        this.entries.splice(oldest, 1);
        this.stats -= 1;
        this.dropped += 1;
      }
      this.trim();
      return entry;
    }

    trim() {
      const excess = this.entries.length - this.max;
      if (excess > 0) {
        this.stats -= this.entries.slice(0, excess).filter((e) => e.type === 'stats').length;
        this.entries.splice(0, excess);
        this.dropped += excess;
      }
    }

    /** The seq of each entry dropped from the middle since the last call (see the class comment). */
    takeRemoved() {
      const removed = this.removed;
      this.removed = [];
      return removed;
    }

    clear() {
      this.entries = [];
      this.stats = 0;
      this.removed = [];
      this.dropped = 0;
    }
  }

  FillMask.lib = {
    formatScore, formatMs, formatSeconds, foldWord, plural, codePoints, countOccurrences, parseTargets, clipText, formatCount,
    filledSegments, excerptSegments, readableToken, glyphProbe, tally, tallyText, shellQuote, snippet, httpBase, wsUrlProblem,
    BLOCKED_PORTS, diagnose,
    prettyJson, logText, FrameLog,
  };
})();
