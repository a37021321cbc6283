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

// Format edges in log2: smallest normal and largest finite value.
export const FORMATS = {
  fp16: { min: -14, max: Math.log2(65504), colour: '#2e7d32' },
  bf16: { min: -126, max: Math.log2((2 - 2 ** -7) * 2 ** 127), colour: '#616161' },
  e4m3: { min: -6, max: Math.log2(448), colour: '#c62828' },
  e5m2: { min: -14, max: Math.log2(57344), colour: '#6a1b9a' },
};

export const fmt = (v, digits = 2) => (v === null || v === undefined ? '–' : Number(v).toFixed(digits));
export const sci = (v) => (v === null || v === undefined ? '–' : Number(v).toPrecision(3));
export const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' }[c]));
