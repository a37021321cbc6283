// Entry of the `scales` dashboard: toolbar (run, data, view, step) and one view at a time.
// TensorBoard loads this module in an iframe and calls render().
import { get, esc, loadTable, FORMATS, TABLE, docOf, firstFormat } from './api.js';
import { drawProfile, drawRatios } from './profile.js';
import { drawHeatmap } from './heatmap.js';
import { drawWorst } from './worst.js';
import { drawCode } from './code.js';
import { drawCompare, drawCompareHeatmap } from './compare.js';
import { drawAdvice } from './advice.js';

const VIEWS = ['profile', 'heatmap', 'worst', 'code', 'compare', 'advice'];
const TITLES = { profile: 'Profile', heatmap: 'Heatmap', worst: 'Worst nodes', code: 'Code', compare: 'Compare', advice: 'Advice' };
const state = { run: null, prefix: '', view: 'profile', step: null, steps: [], by: null, regex: '', stat: 'std', format: null, only: false, other: null, compareShow: 'profile' };
let runs = {};

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
      <span id="profile-controls"><label>Range <select id="format">${Object.keys(FORMATS).map((f) => `<option>${f}</option>`).join('')}</select></label>
      <label><input id="only" type="checkbox"> show only nodes outside <span id="only-format">${esc(state.format)}</span></label></span>
      <span id="worst-controls" hidden><label>Rank by <select id="by">${TABLE.rank_by.map((b) => `<option>${b}</option>`).join('')}</select></label>
      <label>Filter <input id="regex" placeholder="regex, e.g. attn"></label></span>
      <span id="compare-controls" hidden><label>with run B <select id="other"></select></label>
      <label>Show <select id="compare-show"><option value="profile">profile and ranking</option><option value="heatmap">difference over steps</option></select></label></span>
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
  $('stat-control').hidden = !['profile', 'heatmap', 'compare'].includes(state.view);
  const overSteps = state.view === 'heatmap' || state.view === 'advice' || (state.view === 'compare' && state.compareShow === 'heatmap');
  $('step-control').hidden = overSteps;  // they show every step
  $('compare-controls').hidden = state.view !== 'compare';
  $('profile-controls').hidden = state.view !== 'profile';
  $('side').innerHTML = '';
  $('status').textContent = 'loading…';
  try {
    await loadTable(query());  // (the run's own statistics' declarations: user statistics included)
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
    } else if (state.view === 'compare') {
      await showCompare(view);
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

// Run B: the other runs with data under the picked prefix (none: the view says so).
function fillOthers() {
  const names = Object.keys(runs).filter((r) => r !== state.run && (runs[r] || []).includes(state.prefix));
  if (!names.includes(state.other)) state.other = names[0] ?? null;
  $('other').innerHTML = names.map((r) => `<option${r === state.other ? ' selected' : ''}>${esc(r)}</option>`).join('');
}

async function showCompare(view) {
  fillOthers();
  if (!state.other) throw new Error('Compare needs a second run: this log directory holds no other run with node statistics for this data. Log another run (e.g. a second version) under the same --logdir.');
  const ask = (route, stat) => get(route, { ...query(), other: state.other, stat, ...(route === 'compare' ? { step: state.step } : {}) });
  const route = state.compareShow === 'heatmap' ? 'compare_heatmap' : 'compare';
  let data;
  try {
    data = await ask(route, state.stat);
  } catch (e) {  // a statistic one of the runs did not log (picked in another view) falls back to std
    if (state.stat === 'std' || !e.message.includes('`stat`')) throw e;
    state.stat = 'std';
    data = await ask(route, 'std');
  }
  fillStats(data.stats);
  if (route === 'compare_heatmap') {
    drawCompareHeatmap(view, data, { ...query(), other: state.other, stat: state.stat });
  } else {
    setSteps(data.steps, data.step);
    drawCompare(view, $('side'), data);
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
    if (TABLE.rank_by.includes(state.by)) throw e;
    state.by = firstFormat();
    return ask(state.by);
  }
}

// "Rank by": the formats, drift and FP8, then the statistics the run logged that rank nodes
// (block what-ifs, kurtosis, channel outliers).
function fillRankBy(rankable) {
  const names = [...TABLE.rank_by, ...(rankable || [])];
  $('by').innerHTML = names.map((b) => `<option${b === state.by ? ' selected' : ''}>${esc(b)}</option>`).join('');
}

// The statistics the run logged (std first); a statistic the run lacks falls back to std.
function fillStats(stats) {
  const names = ['std', ...(stats || []).filter((s) => s !== 'std')];
  if (!names.includes(state.stat)) state.stat = 'std';
  $('stat').innerHTML = names.map((s) => `<option title="${esc(docOf(s))}"${s === state.stat ? ' selected' : ''}>${esc(s)}</option>`).join('');
}

function fillPrefixes(runs) {
  const prefixes = runs[state.run] || [];
  $('prefix').innerHTML = prefixes.map((p) => `<option value="${esc(p)}">${p === '' ? 'training' : p === 'val_' ? 'validation (val_)' : esc(p)}</option>`).join('');
  state.prefix = prefixes.includes('') ? '' : prefixes[0] ?? '';
  $('prefix').value = state.prefix;
}

export async function render() {
  await loadTable();  // (the formats and rankings the toolbar lists)
  state.by = state.format = firstFormat();
  shell();
  runs = await get('runs');
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
  $('other').addEventListener('change', () => { state.other = $('other').value; state.step = null; show(); });
  $('compare-show').addEventListener('change', () => { state.compareShow = $('compare-show').value; show(); });
  let timer = null;
  $('regex').addEventListener('input', () => { clearTimeout(timer); timer = setTimeout(() => { state.regex = $('regex').value; show(); }, 250); });
  await show();
}
