// Advice: the precision advisor's per-layer recipe (what `lightning-scale advise` exports). For
// every linear layer, the target recipe or `keep`, its three GEMMs' worst SNR over the tracked
// steps, the largest share of an operand flushed to zero, and the reason. The server decides
// (dashboard/advice.py) and sends the recipes and default thresholds; this draws its answer and
// sends the choices back.
import { get, esc } from './api.js';

const choice = { recipe: null, snr_db: null, flushed: null };
const db = (v) => (v === null || v === undefined ? 'exact' : Number(v).toFixed(1));
const pct = (v) => `${(100 * v).toFixed(2)}%`;

function flushedOf(layer) {
  let worst = 0;
  for (const g of Object.values(layer.gemms)) for (const o of Object.values(g.operands || {})) worst = Math.max(worst, o.flushed);
  return worst;
}

function snrCell(g, limit) {
  if (!g.step && g.step !== 0) return '<td class="snr">–</td>';
  const low = g.snr_db !== null && g.snr_db < limit;
  return `<td class="snr${low ? ' low' : ''}" data-snr="${g.snr_db ?? ''}" title="worst at step ${g.step}">${db(g.snr_db)}</td>`;
}

function controls(data) {
  const options = data.recipes.map((r) => `<option${r === data.recipe ? ' selected' : ''}>${esc(r)}</option>`).join('');
  const t = data.thresholds || data.defaults;
  return `<div class="advice-controls"><label>Recipe <select id="advice-recipe">${options}</select></label>
    <label>SNR at least <input id="advice-snr" type="number" step="0.5" value="${t.snr_db}"> dB</label>
    <label>flushed at most <input id="advice-flushed" type="number" step="0.01" min="0" max="1" value="${t.flushed}"></label></div>`;
}

function command(data, run) {
  const t = data.thresholds;
  const extra = [t.snr_db !== data.defaults.snr_db ? ` --snr-db ${t.snr_db}` : '', t.flushed !== data.defaults.flushed ? ` --flushed ${t.flushed}` : ''].join('');
  return `lightning-scale advise LOGDIR --run ${run} --recipe ${data.recipe}${extra} --out DIR`;
}

function table(data) {
  const limit = data.thresholds.snr_db;
  const rows = Object.entries(data.layers).map(([name, l]) => `<tr class="advice-row${l.format === 'keep' ? ' kept' : ''}" data-layer="${esc(name)}" data-format="${esc(l.format)}">
    <td class="lbl">${esc(name)}</td><td class="module">${esc(l.module)}</td><td class="format">${esc(l.format)}</td>
    ${data.gemms.map((g) => snrCell(l.gemms[g], limit)).join('')}<td class="flushed">${pct(flushedOf(l))}</td><td class="reason">${esc(l.reason)}</td></tr>`).join('');
  const head = ['layer', 'module', 'format', ...data.gemms.map((g) => `${esc(g.replace('_', ' '))} SNR dB`), 'most flushed', 'reason'];
  return `<table class="worst advice"><tr>${head.map((h) => `<th>${h}</th>`).join('')}</tr>${rows}</table>`;
}

export async function drawAdvice(root, query) {
  const data = await get('advice', { ...query, ...choice });
  if (!data.available) {
    root.innerHTML = `<p class="note">${esc(data.why)}</p>`;
    return;
  }
  const s = data.summary;
  root.innerHTML = `${controls(data)}<p class="note advice-summary">${s.low_precision} of ${s.layers} linear layers in ${esc(data.recipe)} (${Math.round(100 * s.gemm_share)}% of the GEMMs, ${Math.round(100 * s.size_share)}% of their size K × N), the others kept in high precision; worst over tracked steps ${data.steps.join(', ')}. Export: <code>${esc(command(data, query.run))}</code></p>${table(data)}`;
  const redraw = () => drawAdvice(root, query).catch((e) => { root.innerHTML = `<p class="error">${esc(e.message)}</p>`; });
  root.querySelector('#advice-recipe').addEventListener('change', (e) => { choice.recipe = e.target.value; redraw(); });
  root.querySelector('#advice-snr').addEventListener('change', (e) => { choice.snr_db = e.target.value; redraw(); });
  root.querySelector('#advice-flushed').addEventListener('change', (e) => { choice.flushed = e.target.value; redraw(); });
}
