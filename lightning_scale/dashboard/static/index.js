// Entry of the `scales` dashboard: toolbar (run, data, view, step) and one view at a time.
// TensorBoard loads this module in an iframe and calls render().
import { get, esc } from './api.js';
import { drawProfile, drawRatios } from './profile.js';
import { drawHeatmap } from './heatmap.js';
import { drawWorst } from './worst.js';
import { drawCode } from './code.js';
import { drawAdvice } from './advice.js';

const VIEWS = ['profile', 'heatmap', 'worst', 'code', 'advice'];
const TITLES = { profile: 'Profile', heatmap: 'Heatmap', worst: 'Worst nodes', code: 'Code', advice: 'Advice' };
const state = { run: null, prefix: '', view: 'profile', step: null, steps: [], by: 'fp16', regex: '', stat: 'std', format: 'fp16', only: false };
const FORMAT_NAMES = ['fp16', 'bf16', 'e4m3', 'e5m2'];
const RANK_BY = [...FORMAT_NAMES, 'drift', 'fp8'];

function shell() {
  const css = document.createElement('link');
  css.rel = 'stylesheet';
  css.href = new URL('./style.css', import.meta.url).toString();
  document.head.appendChild(css);
  document.body.innerHTML = `<div class="toolbar">
      <label>Run <select id="run"></select></label>
      <label>Data <select id="prefix"></select></label>
      <span class="tabs">${VIEWS.map((v) => `<button class="tab" data-view="${v}">${TITLES[v]}</button>`).join('')}</span>
      <label id="stat-control">Statistic <select id="stat"><option>std</option></select></label>
      <label class="step" id="step-control">Step <input id="step" type="range" min="0" max="0" value="0"><output id="step-value"></output></label>
      <span id="profile-controls"><label>Range <select id="format">${FORMAT_NAMES.map((f) => `<option>${f}</option>`).join('')}</select></label>
      <label><input id="only" type="checkbox"> show only nodes outside <span id="only-format">fp16</span></label></span>
      <span id="worst-controls" hidden><label>Rank by <select id="by">${RANK_BY.map((b) => `<option>${b}</option>`).join('')}</select></label>
      <label>Filter <input id="regex" placeholder="regex, e.g. attn"></label></span>
      <span id="status"></span>
    </div><div class="main"><div id="view"></div><div id="side"></div></div>`;
}

const $ = (id) => document.getElementById(id);
const query = () => ({ run: state.run, prefix: state.prefix });

function setSteps(steps, step) {
  state.steps = steps;
  const slider = $('step');
  slider.max = Math.max(steps.length - 1, 0);
  const i = steps.indexOf(step);
  slider.value = i >= 0 ? i : steps.length - 1;
  state.step = steps[+slider.value] ?? null;
  $('step-value').textContent = state.step ?? '–';
}

async function show() {
  const view = $('view');
  document.querySelectorAll('.tab').forEach((b) => b.classList.toggle('active', b.dataset.view === state.view));
  $('worst-controls').hidden = state.view !== 'worst';
  $('stat-control').hidden = state.view !== 'profile' && state.view !== 'heatmap';
  $('step-control').hidden = state.view === 'heatmap' || state.view === 'advice';  // they show every step
  $('profile-controls').hidden = state.view !== 'profile';
  $('side').innerHTML = '';
  $('status').textContent = 'loading…';
  try {
    if (state.view === 'profile') {
      const data = await get('profile', { ...query(), step: state.step });
      setSteps(data.steps, data.step);
      fillStats(data.stats);
      drawProfile(view, data, state.stat, { format: state.format, only: state.only });
      drawRatios($('side'), data.ratios);
    } else if (state.view === 'heatmap') {
      const data = await heatmapData();
      fillStats(data.stats);
      drawHeatmap(view, data, query());
    } else if (state.view === 'worst') {
      const data = await worstData();
      setSteps(data.steps, data.step);
      fillRankBy(data.rankable);
      drawWorst(view, data);
    } else if (state.view === 'advice') {
      await drawAdvice(view, query());
    } else {
      const data = await get('code', { ...query(), step: state.step });
      drawCode(view, data);
    }
    $('status').textContent = '';
  } catch (e) {
    view.innerHTML = `<p class="error">${esc(e.message)}</p>`;
    $('status').textContent = '';
  }
}

// One fetch; a statistic this run did not log (picked in another run) falls back to std.
async function heatmapData() {
  try {
    return await get('heatmap', { ...query(), stat: state.stat });
  } catch (e) {
    if (state.stat === 'std') throw e;
    state.stat = 'std';
    return get('heatmap', { ...query(), stat: 'std' });
  }
}

// One fetch; a ranking statistic this run did not log (picked in another run) falls back to fp16.
async function worstData() {
  const ask = (by) => get('worst', { ...query(), step: state.step, by, regex: state.regex });
  try {
    return await ask(state.by);
  } catch (e) {
    if (RANK_BY.includes(state.by)) throw e;
    state.by = 'fp16';
    return ask('fp16');
  }
}

// "Rank by": the formats, drift and FP8, then the statistics the run logged that rank nodes
// (block what-ifs, kurtosis, channel outliers).
function fillRankBy(rankable) {
  const names = [...RANK_BY, ...(rankable || [])];
  $('by').innerHTML = names.map((b) => `<option${b === state.by ? ' selected' : ''}>${esc(b)}</option>`).join('');
}

// The statistics the run logged (std first); a statistic the run lacks falls back to std.
function fillStats(stats) {
  const names = ['std', ...(stats || []).filter((s) => s !== 'std')];
  if (!names.includes(state.stat)) state.stat = 'std';
  $('stat').innerHTML = names.map((s) => `<option${s === state.stat ? ' selected' : ''}>${esc(s)}</option>`).join('');
}

function fillPrefixes(runs) {
  const prefixes = runs[state.run] || [];
  $('prefix').innerHTML = prefixes.map((p) => `<option value="${esc(p)}">${p === '' ? 'training' : p === 'val_' ? 'validation (val_)' : esc(p)}</option>`).join('');
  state.prefix = prefixes.includes('') ? '' : prefixes[0] ?? '';
  $('prefix').value = state.prefix;
}

export async function render() {
  shell();
  const runs = await get('runs');
  const names = Object.keys(runs);
  if (!names.length) {
    $('view').innerHTML = '<p class="note">No scales logged yet: add <code>ScaleMonitor()</code> to the Trainer\'s callbacks.</p>';
    return;
  }
  $('run').innerHTML = names.map((r) => `<option>${esc(r)}</option>`).join('');
  state.run = names[0];
  fillPrefixes(runs);
  $('run').addEventListener('change', () => { state.run = $('run').value; state.step = null; fillPrefixes(runs); show(); });
  $('prefix').addEventListener('change', () => { state.prefix = $('prefix').value; state.step = null; show(); });
  document.querySelectorAll('.tab').forEach((b) => b.addEventListener('click', () => { state.view = b.dataset.view; show(); }));
  $('step').addEventListener('input', () => { state.step = state.steps[+$('step').value]; $('step-value').textContent = state.step; show(); });
  $('by').addEventListener('change', () => { state.by = $('by').value; show(); });
  $('stat').addEventListener('change', () => { state.stat = $('stat').value; show(); });
  $('format').addEventListener('change', () => { state.format = $('format').value; $('only-format').textContent = state.format; show(); });
  $('only').addEventListener('change', () => { state.only = $('only').checked; show(); });
  let timer = null;
  $('regex').addEventListener('input', () => { clearTimeout(timer); timer = setTimeout(() => { state.regex = $('regex').value; show(); }, 250); });
  await show();
}
