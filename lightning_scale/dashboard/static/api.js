// Fetches the plugin's JSON routes (relative to this module's URL), cached per query.
const cache = new Map();

export async function get(route, params = {}) {
  const url = new URL(`./${route}`, import.meta.url);
  for (const [k, v] of Object.entries(params)) if (v !== undefined && v !== null) url.searchParams.set(k, v);
  const key = url.toString();
  if (!cache.has(key)) {
    cache.set(key, fetch(key).then(async (r) => {
      const body = await r.json();
      if (!r.ok) throw new Error(body.error || r.statusText);
      return body;
    }));
  }
  try {
    return await cache.get(key);
  } catch (e) {
    cache.delete(key);
    throw e;
  }
}

export function clearCache() { cache.clear(); }

// What the server's statistic table says (route `table`): the formats' edges in log2 (smallest
// normal, largest finite value) and colours, each statistic's declaration (axis, worse, docs
// line), the worst nodes' rankings and the heatmap's hue bands. Filled by loadTable() before a
// view draws; the browser keeps no list of statistics or formats of its own.
export const FORMATS = {};
export const TABLE = { statistics: {}, rank_by: [], bands: [] };

export async function loadTable(params = {}) {
  const t = await get('table', params);
  for (const k of Object.keys(FORMATS)) delete FORMATS[k];
  Object.assign(FORMATS, t.formats);
  TABLE.statistics = t.statistics;
  TABLE.rank_by = t.rank_by;
  TABLE.bands = t.bands.map(([lo, hi, a, b]) => [lo ?? -Infinity, hi ?? Infinity, a, b]);
  return TABLE;
}

// The format the views start from (the table's first: FP16).
export const firstFormat = () => Object.keys(FORMATS)[0];

// Whether a statistic is a magnitude: drawn on the log2 axis with the format edges.
export const isLog2 = (stat) => TABLE.statistics[stat]?.axis === 'log2';
// Its docs line (a tooltip), '' where the table has none.
export const docOf = (stat) => TABLE.statistics[stat]?.doc || '';

export const fmt = (v, digits = 2) => (v === null || v === undefined ? '–' : Number(v).toFixed(digits));
export const sci = (v) => (v === null || v === undefined ? '–' : Number(v).toPrecision(3));
export const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' }[c]));

// About `count` round ticks (1, 2 or 5 times a power of ten) over [lo, hi].
export function ticks(lo, hi, count = 6) {
  const span = hi - lo || 1;
  const p = 10 ** Math.floor(Math.log10(span / count));
  const step = [1, 2, 5, 10].map((m) => m * p).find((s) => span / s <= count + 1);
  const out = [];
  for (let t = Math.ceil(lo / step) * step; t <= hi + step * 1e-9; t += step) out.push(+t.toPrecision(12));
  return out;
}

// Width in pixels of `text` drawn in `font` (what the SVG text will take).
const measure = document.createElement('canvas').getContext('2d');
export function textWidth(text, font = '11px Roboto, Arial, sans-serif') {
  measure.font = font;
  return measure.measureText(text).width;
}

// The formats sharing each edge value: FP16 and E5M2 have the same smallest normal (2^-14).
export function edges(lo = -Infinity, hi = Infinity) {
  const out = [];
  for (const [name, f] of Object.entries(FORMATS)) {
    for (const [v, kind] of [[f.min, 'min'], [f.max, 'max']]) {
      if (v < lo || v > hi) continue;
      const same = out.find((e) => e.kind === kind && Math.abs(e.v - v) < 1e-9);
      if (same) same.names.push(name); else out.push({ v, kind, names: [name], colour: f.colour, dash: f.dash });
    }
  }
  return out.sort((a, b) => a.v - b.v);
}

// Rows for labels that each hang off a tick at x = `a` and span [p, q]: the first row where a
// label overlaps no other label, its tick crosses no label and no tick crosses it. Ticks run
// up to row 0 (`up`: a colour bar above the labels) or down from the label (an axis below).
export function stackLabels(items, up) {
  const placed = [];
  const overlap = ([p, q], [u, v]) => p < v + 4 && q > u - 4;
  const within = (a, [p, q]) => a >= p && a <= q;
  const crosses = (from, to) => (up ? to < from : to > from);  // a tick of row `from` passes row `to`
  for (const item of items) {
    let row = 0;
    while (row < items.length && !placed.every((o) => !(o.row === row && overlap(o.span, item.span))
        && !(crosses(o.row, row) && within(o.a, item.span)) && !(crosses(row, o.row) && within(item.a, o.span)))) row++;
    placed.push({ ...item, row });
  }
  return placed;
}
