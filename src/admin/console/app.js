// sluice console (DESIGN §15). Every value from the API is untrusted (key values are what
// clients sent): it reaches the page only as text (textContent, text nodes, option.text),
// never as HTML. Every change asks for confirmation first.
'use strict';

(() => {
  const TOKEN_KEY = 'sluice.console.token';
  const REFRESH_MS = 3000;
  const MAX_ROWS = 1000; // rows drawn per table; a filter narrows the rest
  const TOP_N = 5000;

  const $ = (id) => document.getElementById(id);

  const state = {
    tab: 'routes',
    summary: null,
    previous: null, // the summary before, for rates
    policies: [],
    consumers: [],
    top: null, // {policy, entries} or {policy, error}
    runtimeOverrides: null, // {policy, entries}
    selected: null, // the policy whose overrides are shown
    timer: null,
    running: false,
    generation: 0, // bumped on sign-out: answers of an older session are dropped
  };

  // ---- building the page, as text only ----

  function el(tag, className, ...children) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function td(value, className) {
    return el('td', className, value);
  }

  function button(text, className, onClick) {
    const b = el('button', className, text);
    b.type = 'button';
    b.addEventListener('click', onClick);
    return b;
  }

  function fmtCount(n) {
    return typeof n === 'number' ? n.toLocaleString('en-US') : '—';
  }

  function fmtRate(r) {
    if (r === null || r === undefined) return '…';
    if (r === 0) return '0';
    return r < 10 ? r.toFixed(2) : r.toFixed(1);
  }

  function fmtSeconds(s) {
    if (s === null || s === undefined) return '—';
    for (const [unit, size] of [['d', 86400], ['h', 3600], ['m', 60]]) {
      if (s >= size && Number.isInteger(s / size)) return `${s / size}${unit}`;
    }
    if (s < 1) return `${Math.round(s * 1000)}ms`;
    if (s < 120) return `${+s.toFixed(3)}s`;
    if (s < 7200) return `${+(s / 60).toFixed(1)}m`;
    if (s < 172800) return `${+(s / 3600).toFixed(1)}h`;
    return `${+(s / 86400).toFixed(1)}d`;
  }

  function fmtTime(unixSeconds) {
    if (!unixSeconds) return '—';
    return new Date(unixSeconds * 1000).toISOString().replace('T', ' ').replace(/\.\d+Z$/, ' UTC');
  }

  function keyText(parts) {
    return Array.isArray(parts) ? parts.join(' | ') : String(parts);
  }

  function message(id, text, bad) {
    const node = $(id);
    node.textContent = text;
    node.classList.toggle('bad', !!bad);
  }

  // Draws `rows` (those `filter` matches, at most MAX_ROWS) into `table`'s body.
  function fill(tableId, rows, matches, makeRow, noteId, emptyText) {
    const filterBox = $(tableId.replace('-table', '-filter'));
    const needle = filterBox ? filterBox.value.trim().toLowerCase() : '';
    const kept = needle ? rows.filter((r) => matches(r).toLowerCase().includes(needle)) : rows;
    const body = $(tableId).tBodies[0];
    const drawn = kept.slice(0, MAX_ROWS).map(makeRow);
    if (drawn.length === 0) {
      const cells = $(tableId).tHead ? $(tableId).tHead.rows[0].cells.length : 1;
      const cell = el('td', 'muted', rows.length ? 'Nothing matches the filter.' : emptyText || 'None.');
      cell.colSpan = cells;
      drawn.push(el('tr', null, cell));
    }
    body.replaceChildren(...drawn);
    if (noteId) {
      let note = '';
      if (kept.length > MAX_ROWS) note = `Showing ${MAX_ROWS} of ${kept.length}: filter to narrow.`;
      else if (needle) note = `${kept.length} of ${rows.length} match.`;
      $(noteId).textContent = note;
    }
  }

  // ---- the API ----

  class ApiError extends Error {
    constructor(status, detail) {
      super(detail);
      this.status = status;
    }
  }

  function keyQuery(values) {
    return values.map((v) => `key=${encodeURIComponent(v)}`).join('&');
  }

  function seg(s) {
    return encodeURIComponent(s);
  }

  async function api(method, path, body) {
    const token = sessionStorage.getItem(TOKEN_KEY);
    if (!token) throw new ApiError(401, 'not signed in');
    const generation = state.generation;
    const headers = { Authorization: `Bearer ${token}` };
    const init = { method, headers, cache: 'no-store', credentials: 'omit', redirect: 'error' };
    if (body !== undefined) {
      headers['Content-Type'] = 'application/json';
      init.body = JSON.stringify(body);
    }
    const response = await fetch(path, init);
    const text = await response.text();
    let data = null;
    if (text) {
      try {
        data = JSON.parse(text);
      } catch (_) {
        data = text;
      }
    }
    if (generation !== state.generation) throw new ApiError(0, 'signed out');
    if (!response.ok) {
      const detail = data && typeof data === 'object' && data.detail
        ? String(data.detail) : `${response.status} ${response.statusText}`;
      if (response.status === 401) signOut(`Refused: ${detail}`);
      throw new ApiError(response.status, detail);
    }
    return data;
  }

  // ---- refreshing ----

  function rate(now, before, pick) {
    if (!before || !now) return null;
    const seconds = state.summary.now - state.previous.now;
    if (!(seconds > 0)) return null;
    return Math.max(0, (pick(now) - pick(before)) / seconds);
  }

  async function refresh() {
    if (!sessionStorage.getItem(TOKEN_KEY)) return;
    try {
      const [summary, policies, consumers] = await Promise.all([
        api('GET', '/v1/summary'),
        api('GET', '/v1/policies'),
        api('GET', '/v1/consumers'),
      ]);
      state.previous = state.summary;
      state.summary = summary;
      state.policies = Array.isArray(policies) ? policies : [];
      state.consumers = Array.isArray(consumers) ? consumers : [];
      syncPolicySelects();
      await Promise.all([refreshTop(), refreshRuntimeOverrides()]);
      render();
      const status = $('status');
      status.textContent = `Updated ${new Date().toLocaleTimeString()} · every ${REFRESH_MS / 1000}s`;
      status.classList.remove('bad');
    } catch (e) {
      if (e.status === 401 || e.status === 0) return;
      const status = $('status');
      status.textContent = `Refresh failed: ${e.message}`;
      status.classList.add('bad');
    }
  }

  async function refreshTop() {
    const policy = $('top-policy').value;
    if (!policy) {
      state.top = null;
      return;
    }
    try {
      state.top = { policy, entries: await api('GET', `/v1/top/${seg(policy)}?n=${TOP_N}`) };
    } catch (e) {
      if (e.status === 401) throw e;
      state.top = { policy, entries: [], error: e.message };
    }
  }

  async function refreshRuntimeOverrides() {
    const policy = state.selected;
    if (!policy) {
      state.runtimeOverrides = null;
      return;
    }
    try {
      state.runtimeOverrides = { policy, entries: await api('GET', `/v1/overrides/${seg(policy)}`) };
    } catch (e) {
      if (e.status === 401) throw e;
      state.runtimeOverrides = { policy, entries: [], error: e.message };
    }
  }

  function loop() {
    clearTimeout(state.timer);
    state.timer = setTimeout(async () => {
      await refresh();
      if (sessionStorage.getItem(TOKEN_KEY)) loop();
    }, REFRESH_MS);
  }

  // ---- drawing ----

  function render() {
    const s = state.summary;
    if (!s) return;
    $('version').textContent = `${s.version} · ${s.backend}`;
    renderRoutes();
    renderPolicies();
    renderTop();
    renderConsumers();
    renderUpstreams();
    renderCertificates();
    renderReload();
  }

  function byName(list, field) {
    const out = new Map();
    for (const item of list || []) out.set(item[field], item);
    return out;
  }

  function renderRoutes() {
    const before = byName(state.previous && state.previous.routes, 'route');
    fill('routes-table', state.summary.routes, (r) => `${r.route} ${r.policies.join(' ')}`, (r) => {
      const was = before.get(r.route);
      const rejecting = rate(r, was, (x) => x.rejected);
      const row = el('tr', null,
        td(r.routes > 1 ? `${r.route} (${r.routes} routes)` : r.route),
        td(r.policies.join(', ') || '—'),
        td(fmtRate(rate(r, was, (x) => x.requests)), 'num'),
        td(fmtRate(rejecting), rejecting > 0 ? 'num moving' : 'num'),
        td(fmtRate(rate(r, was, (x) => x.errors)), 'num'),
        td(fmtCount(r.requests), 'num'),
        td(fmtCount(r.rejected), 'num'));
      return row;
    }, 'routes-note', 'No routes.');
  }

  function renderPolicies() {
    const counts = byName(state.summary.policies, 'name');
    const before = byName(state.previous && state.previous.policies, 'name');
    fill('policies-table', state.policies, (p) => `${p.name} ${p.algorithm} ${p.key.join(' ')}`, (p) => {
      const c = counts.get(p.name) || {};
      const was = before.get(p.name);
      const overrides = `${p.overrides.length} + ${c.runtime_overrides || 0}`;
      const pick = button(p.name, 'small', () => selectPolicy(p.name));
      pick.title = 'Show overrides and look up a key';
      const row = el('tr', p.name === state.selected ? 'selected' : null,
        el('td', null, pick),
        td(p.algorithm),
        td(p.key.join(', '), 'key'),
        td(fmtCount(p.limit), 'num'),
        td(fmtSeconds(p.period_seconds), 'num'),
        td(fmtCount(p.burst), 'num'),
        td(overrides, 'num'),
        td(fmtRate(rate(c, was, (x) => x.allowed)), 'num'),
        td(fmtRate(rate(c, was, (x) => x.rejected)), 'num'),
        td(fmtCount(c.allowed), 'num'),
        td(fmtCount(c.rejected), 'num'));
      return row;
    }, 'policies-note', 'No policies.');
    renderOverrides();
  }

  function renderOverrides() {
    const policy = state.policies.find((p) => p.name === state.selected);
    $('ov-policy-name').textContent = policy ? policy.name : '(pick a policy)';
    fill('config-overrides-table', policy ? policy.overrides : [], () => '', (o) => el('tr', null,
      td(o.when.join(', '), 'key'),
      td(fmtCount(o.limit), 'num'),
      td(fmtSeconds(o.period_seconds), 'num'),
      td(fmtCount(o.burst), 'num')), null, 'None.');
    const runtime = state.runtimeOverrides && state.runtimeOverrides.policy === state.selected
      ? state.runtimeOverrides : { entries: [] };
    fill('runtime-overrides-table', runtime.entries || [], () => '', (o) => el('tr', null,
      td(keyText(o.key), 'key'),
      td(fmtCount(o.limit), 'num'),
      td(fmtSeconds(o.period_seconds), 'num'),
      td(fmtCount(o.burst), 'num'),
      td(o.ttl_seconds === null ? 'never' : fmtSeconds(o.ttl_seconds), 'num'),
      el('td', null,
        button('Inspect', 'small', () => inspect(o.policy, o.key)),
        ' ',
        button('Delete', 'small danger', () => deleteOverride(o.policy, o.key)))),
    null, runtime.error || 'None.');
  }

  function renderTop() {
    const top = state.top;
    const entries = top && Array.isArray(top.entries) ? top.entries : [];
    fill('top-table', entries, (e) => keyText(e.key), (e) => el('tr', null,
      td(keyText(e.key), 'key'),
      td(fmtCount(e.requests), 'num'),
      td(fmtCount(e.allowed), 'num'),
      td(fmtCount(e.rejected), e.rejected > 0 ? 'num moving' : 'num'),
      td(fmtCount(e.error), 'num'),
      el('td', null, button('Inspect', 'small', () => inspect(top.policy, e.key)))),
    'top-note', top && top.error ? top.error : 'No keys seen yet.');
  }

  function renderConsumers() {
    fill('consumers-table', state.consumers, (c) => `${c.name} ${c.plan || ''} ${c.source}`, (c) => {
      const runtime = c.source === 'runtime';
      const ids = el('div', 'ids');
      for (const id of c.key_ids || []) {
        ids.append(el('span', null, id, ' ',
          button('Revoke', 'small danger', () => revokeKey(c.name, id))));
      }
      const actions = runtime
        ? button('New key', 'small', () => createKey(c.name))
        : el('span', 'muted', 'in the config');
      return el('tr', null,
        td(c.name),
        td(c.plan || '—'),
        td(c.source),
        td(fmtCount(c.keys), 'num'),
        el('td', null, runtime ? ids : el('span', 'muted', 'digests in the config')),
        el('td', null, actions));
    }, 'consumers-note', 'No consumers.');
  }

  function renderUpstreams() {
    const rows = [];
    for (const u of state.summary.upstreams) {
      for (const s of u.servers) rows.push({ upstream: u, server: s });
    }
    fill('upstreams-table', rows, (r) => `${r.upstream.name} ${r.server.server} ${r.server.address}`, (r) => el('tr', null,
      td(r.upstream.name),
      td(r.server.server),
      td(r.server.address, 'key'),
      td(r.server.healthy ? 'up' : 'down', r.server.healthy ? 'up' : 'down'),
      td(r.upstream.health_check ? 'active + passive' : 'passive')), null, 'No upstreams.');
    // `adaptive` upstreams (DESIGN §22): the learnt limit against what is in flight.
    const adaptive = state.summary.upstreams.filter((u) => u.adaptive);
    fill('adaptive-table', adaptive, (u) => u.name, (u) => {
      const a = u.adaptive;
      const load = el('meter');
      load.max = a.limit;
      load.value = Math.min(a.in_flight, a.limit);
      load.title = `${a.in_flight} of ${a.limit} in flight`;
      return el('tr', null,
        td(u.name),
        td(fmtCount(a.limit), 'num'),
        td(fmtCount(a.in_flight), 'num'),
        el('td', null, load),
        td(a.best_ms == null ? 'probing' : `${a.best_ms.toFixed(1)} ms`, 'num'),
        td(`${a.min_limit}–${a.max_limit}`));
    }, null, 'No upstream has adaptive concurrency.');
  }

  function renderCertificates() {
    const now = state.summary.now;
    fill('certificates-table', state.summary.certificates, (c) => c.name, (c) => {
      const days = (c.not_after - now) / 86400;
      return el('tr', null,
        td(c.name),
        td(fmtCount(c.hosts), 'num'),
        td(fmtTime(c.not_after)),
        td(days < 0 ? 'expired' : Math.floor(days), days < 14 ? 'num expiring' : 'num'));
    }, null, 'No certificates (no TLS listener).');
  }

  function renderReload() {
    const s = state.summary;
    const r = s.reload;
    const rows = [
      ['Version', s.version],
      ['Limiter backend', s.backend],
      ['Config file', s.config],
      ['Last successful load', `${fmtTime(r.last_success_at)} (${fmtSeconds(s.now - r.last_success_at)} ago)`],
      ['Last reload', r.last_successful ? 'succeeded' : 'FAILED: the previous config is in force'],
      ['Reloads since start', `${r.successes} succeeded, ${r.failures} failed`],
    ];
    $('reload-table').tBodies[0].replaceChildren(...rows.map(([k, v]) => el('tr', null,
      el('th', null, k), td(v, k === 'Last reload' && !r.last_successful ? 'down' : null))));
  }

  // ---- choosing a policy and a key ----

  function syncSelect(select, names) {
    const have = Array.from(select.options, (o) => o.value);
    if (have.length === names.length && have.every((n, i) => n === names[i])) return;
    const keep = select.value;
    select.replaceChildren(...names.map((n) => new Option(n, n)));
    if (names.includes(keep)) select.value = keep;
  }

  function syncPolicySelects() {
    const names = state.policies.map((p) => p.name);
    syncSelect($('top-policy'), names);
    const before = $('key-policy').value;
    syncSelect($('key-policy'), names);
    if ($('key-policy').value !== before || !$('key-parts').children.length) drawKeyParts();
    if (!state.selected || !names.includes(state.selected)) state.selected = names[0] || null;
  }

  function drawKeyParts(values) {
    const policy = state.policies.find((p) => p.name === $('key-policy').value);
    const parts = policy ? policy.key : [];
    $('key-parts').replaceChildren(...parts.map((part, i) => {
      const input = el('input');
      input.dataset.part = String(i);
      input.required = true;
      input.autocomplete = 'off';
      if (values && values[i] !== undefined) input.value = values[i];
      return el('label', null, part, input);
    }));
    $('quota-table').tBodies[0].replaceChildren();
  }

  function keyValues() {
    return Array.from($('key-parts').querySelectorAll('input'), (i) => i.value);
  }

  function selectPolicy(name) {
    state.selected = name;
    if ($('key-policy').value !== name) {
      $('key-policy').value = name;
      drawKeyParts();
    }
    refreshRuntimeOverrides().then(renderPolicies, () => {});
    renderPolicies();
  }

  function inspect(policy, key) {
    state.selected = policy;
    $('key-policy').value = policy;
    drawKeyParts(key);
    showTab('policies');
    renderPolicies();
    refreshRuntimeOverrides().then(renderPolicies, () => {});
    lookup(false);
  }

  function describe(policy, values) {
    return `policy ${policy}, key ${JSON.stringify(values)}`;
  }

  // ---- actions ----

  // `quiet`: after an action, whose message stays.
  async function lookup(quiet) {
    const policy = $('key-policy').value;
    const values = keyValues();
    try {
      const q = await api('GET', `/v1/quota/${seg(policy)}?${keyQuery(values)}`);
      const order = ['policy', 'key', 'limit', 'period_seconds', 'burst', 'remaining', 'reset_seconds',
        'retry_after_seconds', 'banned_seconds', 'override'];
      const fields = Object.keys(q).sort((a, b) => (order.indexOf(a) + 1 || 99) - (order.indexOf(b) + 1 || 99));
      const rows = fields.map((k) => [k, q[k]]).map(([k, v]) => {
        let shown = v;
        if (v === null) shown = '—';
        else if (Array.isArray(v)) shown = keyText(v);
        else if (typeof v === 'object') shown = JSON.stringify(v);
        return el('tr', null, el('th', null, k), td(shown, k === 'key' ? 'key' : null));
      });
      $('quota-table').tBodies[0].replaceChildren(...rows);
      if (quiet !== true) message('key-message', `Quota of ${describe(policy, values)} (read without charging).`);
    } catch (e) {
      $('quota-table').tBodies[0].replaceChildren();
      message('key-message', `Look-up failed: ${e.message}`, true);
    }
  }

  async function act(what, doIt, done) {
    if (!window.confirm(what)) return;
    try {
      const result = await doIt();
      message('key-message', done(result));
    } catch (e) {
      message('key-message', `Failed: ${e.message}`, true);
    }
    await refresh();
  }

  function reset() {
    const policy = $('key-policy').value;
    const values = keyValues();
    return act(`Reset ${describe(policy, values)}? Its count and any ban are deleted on every instance.`,
      () => api('DELETE', `/v1/quota/${seg(policy)}?${keyQuery(values)}`),
      () => `Reset ${describe(policy, values)}.`).then(() => lookup(true));
  }

  function setOverride() {
    const policy = $('key-policy').value;
    const values = keyValues();
    const body = {};
    for (const [field, id, numeric] of [['limit', 'ov-limit', true], ['period', 'ov-period', false],
      ['burst', 'ov-burst', true], ['ttl', 'ov-ttl', false]]) {
      const text = $(id).value.trim();
      if (!text) continue;
      body[field] = numeric && /^\d+$/.test(text) ? Number(text) : text;
    }
    const numbers = Object.entries(body).map(([k, v]) => `${k} ${v}`).join(', ') || 'nothing';
    return act(`Set an override on ${describe(policy, values)}: ${numbers}?`,
      () => api('PUT', `/v1/overrides/${seg(policy)}?${keyQuery(values)}`, body),
      (o) => `Override stored: limit ${o.limit}, period ${fmtSeconds(o.period_seconds)}, burst ${o.burst}` +
        (o.ttl_seconds === null ? '.' : `, expires in ${fmtSeconds(o.ttl_seconds)}.`)).then(() => lookup(true));
  }

  function deleteOverride(policy, values) {
    return act(`Delete the override on ${describe(policy, values)}? The policy's own numbers apply again.`,
      () => api('DELETE', `/v1/overrides/${seg(policy)}?${keyQuery(values)}`),
      () => `Override on ${describe(policy, values)} deleted.`);
  }

  async function revokeKey(name, id) {
    if (!window.confirm(`Revoke API key ${id} of consumer ${name}? Requests with it are refused from now on.`)) return;
    try {
      await api('DELETE', `/v1/consumers/${seg(name)}/keys/${seg(id)}`);
      message('consumers-message', `Key ${id} of ${name} revoked.`);
    } catch (e) {
      message('consumers-message', `Revoking failed: ${e.message}`, true);
    }
    await refresh();
  }

  async function createKey(name) {
    if (!window.confirm(`Create a new API key for consumer ${name}? It is shown once.`)) return;
    try {
      const k = await api('POST', `/v1/consumers/${seg(name)}/keys`);
      $('secret-consumer').textContent = `${name} (id ${k.id})`;
      $('secret-value').textContent = k.key;
      $('secret-box').hidden = false;
    } catch (e) {
      message('consumers-message', `Creating a key failed: ${e.message}`, true);
    }
    await refresh();
  }

  async function putConsumer() {
    const name = $('consumer-name').value.trim();
    const plan = $('consumer-plan').value.trim();
    if (!window.confirm(`Create or change runtime consumer ${name}${plan ? ` with plan ${plan}` : ' without a plan'}?`)) return;
    try {
      await api('PUT', `/v1/consumers/${seg(name)}`, { plan: plan || null });
      message('consumers-message', `Consumer ${name} stored.`);
    } catch (e) {
      message('consumers-message', `Storing the consumer failed: ${e.message}`, true);
    }
    await refresh();
  }

  // ---- signing in and out, tabs ----

  function showTab(name) {
    state.tab = name;
    for (const b of document.querySelectorAll('#tabs button')) {
      b.setAttribute('aria-selected', String(b.dataset.tab === name));
    }
    for (const s of document.querySelectorAll('main section')) s.hidden = s.dataset.section !== name;
    if (location.hash !== `#${name}`) history.replaceState(null, '', `#${name}`);
  }

  function signOut(why) {
    state.generation += 1;
    clearTimeout(state.timer);
    sessionStorage.removeItem(TOKEN_KEY);
    Object.assign(state, { summary: null, previous: null, policies: [], consumers: [], top: null, runtimeOverrides: null });
    $('app').hidden = true;
    $('signout').hidden = true;
    $('login').hidden = false;
    $('secret-box').hidden = true;
    const error = $('login-error');
    error.textContent = why || '';
    error.hidden = !why;
    const status = $('status');
    status.textContent = 'Not signed in';
    status.classList.toggle('bad', !!why);
  }

  async function signIn() {
    $('login').hidden = true;
    $('app').hidden = false;
    $('signout').hidden = false;
    $('status').textContent = 'Loading…';
    await refresh();
    if (sessionStorage.getItem(TOKEN_KEY)) loop();
  }

  function start() {
    $('login').addEventListener('submit', (e) => {
      e.preventDefault();
      const token = $('token').value.trim();
      $('token').value = '';
      if (!token) return;
      sessionStorage.setItem(TOKEN_KEY, token);
      signIn();
    });
    $('signout').addEventListener('click', () => signOut());
    for (const b of document.querySelectorAll('#tabs button')) {
      b.addEventListener('click', () => showTab(b.dataset.tab));
    }
    for (const box of document.querySelectorAll('input[type="search"]')) {
      box.addEventListener('input', () => render());
    }
    $('top-policy').addEventListener('change', () => refreshTop().then(renderTop, () => {}));
    $('key-policy').addEventListener('change', () => selectPolicy($('key-policy').value));
    $('key-form').addEventListener('submit', (e) => {
      e.preventDefault();
      lookup(false);
    });
    $('key-reset').addEventListener('click', () => reset());
    $('override-form').addEventListener('submit', (e) => {
      e.preventDefault();
      setOverride();
    });
    $('ov-delete').addEventListener('click', () => deleteOverride($('key-policy').value, keyValues()));
    $('consumer-form').addEventListener('submit', (e) => {
      e.preventDefault();
      putConsumer();
    });
    $('secret-done').addEventListener('click', () => {
      $('secret-value').textContent = '';
      $('secret-box').hidden = true;
    });
    const tabs = Array.from(document.querySelectorAll('#tabs button'), (b) => b.dataset.tab);
    const wanted = location.hash.slice(1);
    showTab(tabs.includes(wanted) ? wanted : 'routes');
    if (sessionStorage.getItem(TOKEN_KEY)) signIn();
    else signOut();
  }

  start();
})();
