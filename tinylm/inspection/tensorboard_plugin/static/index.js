// The "tinylm attention" tab: hover a token to see where the selected head(s) look from it.
//
// TensorBoard loads this ES module inside an iframe whose base URL is the plugin's route, so
// fetch("texts") reaches /data/plugin/tinylm_attention/texts. Plain JS and one stylesheet: no
// framework, no build step, nothing from the network but this TensorBoard server.
//
// Weights arrive as float16 bytes, (n_layer, n_head, T, T), row q = where query token q looks.
// Word level follows capture.py's word_level: attention *to* a word sums its tokens' columns,
// attention *from* a word averages its tokens' rows.
//
// Made to be projected to a class: every text is named by what it holds (its sentence; a
// training sample's step; an inspected text as inspected), every colour scale has a legend with
// its baseline (chance for an accuracy, 0 for a patching effect, uniform attention for a weight),
// a reading that points at a name of the other gender is flagged, only he/she/they and their
// other forms are read against names ("it" stands for a thing or an animal), the type can be
// zoomed (the zoom is kept), and a text opens on the head the evidence singles out (the largest
// patching effect of the same model where the logdir has one, else the head that looks most at a
// name from the first pronoun), saying why.
//
// With grouped-query attention (Llama, Qwen2) a group of consecutive query heads shares one
// key/value head: the summary's kv_heads counts them per layer, and every head is labelled with
// the key/value head it reads, "H3 (KV 1)".
//
// A run with an activation-patching report (tinylm-probe patch=true) is one entry of the text
// picker, "probe pair i of n", and its pair picker moves both views: the attention of the pair's
// clean text (tinylm-probe writes it for its first pairs) and the strip of the selected head's
// effect at each of its positions, beside the report's layer x head grid; both grids select the
// same head (state.layer, state.head).
//
// The arithmetic behind one weight (static/arithmetic.js, window.tinylmArithmetic) is drawn
// below the attention and its tables for the selected head and query token, where that script
// loaded.

const ANTECEDENTS_SHOWN = 3;  // as tinylm-generate inspect=true's pronoun tables
const ZOOMS = [1, 1.25, 1.5, 2];
const STORED = "tinylm-attention.";  // localStorage keys: the zoom, the arithmetic panel open
const KINDS = {inspect: "inspected", training: "training sample", probe: "probe pair"};
const KIND_ORDER = ["inspect", "training", "probe"];  // the picker lists texts in this order

const state = {
  listing: null, choices: [], choice: null,  // choice: the picked entry of the text picker
  text: null, content: null, weights: null, probes: [],  // text: a listed text, its data
  layer: 0, head: 0,  // head: a number, or "all" for the small multiples
  level: "word", reverse: false,
  query: null, locked: false,  // query: the token whose row (or column) is shown
  patching: [],  // every run's patching report (effects per head, its pairs without tokens)
  report: null, pair: null, pairIndex: null,  // the report beside the text; the pair drawn
  headPicked: false,  // a head picked by hand is kept; until then each text opens on evidence
  why: "",  // why the head shown was opened on
  arithmeticKey: null, arithmeticTimer: null,
};
const el = {};  // the tab's fixed elements, made once by render()
// performance.now() readings the browser test prints: ms since the iframe began to load
window.tinylmTiming = {firstDrawMs: null, textLoadMs: null, redrawMs: null};

// ------------------------------------------------------------------------------- data

const HALF_TO_FLOAT = (() => {  // all 65536 float16 bit patterns, decoded once
  const table = new Float32Array(65536);
  for (let bits = 0; bits < 65536; bits++) {
    const sign = bits & 0x8000 ? -1 : 1, exponent = (bits >> 10) & 0x1f, fraction = bits & 0x3ff;
    table[bits] = exponent === 0 ? sign * fraction * 2 ** -24
      : exponent === 31 ? (fraction ? NaN : sign * Infinity)
      : sign * (1 + fraction / 1024) * 2 ** (exponent - 15);
  }
  return table;
})();

async function getJSON(url) {
  const response = await fetch(url);
  if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
  return response.json();
}

// A text the server skipped answers {problem} in place of its data: say why, as a problem line.
function unlessSkipped(answer) {
  if (answer.problem) throw new Error(problemLine(answer.problem));
  return answer;
}

// Fetch one text's content and weights into state (drawn by show()).
async function loadText(run, tag) {
  const query = `run=${encodeURIComponent(run)}&tag=${encodeURIComponent(tag)}`;
  const [content, buffer] = await Promise.all([
    getJSON(`attention?${query}`).then(unlessSkipped),
    fetch(`weights?${query}`).then(async (r) => {
      if (!r.ok) throw new Error(`weights of ${run} ${tag}: HTTP ${r.status}`);
      if (r.headers.get("Content-Type").startsWith("application/json")) {
        unlessSkipped(await r.json());
      }
      return r.arrayBuffer();
    }),
  ]);
  const bits = new Uint16Array(buffer);
  const weights = new Float32Array(bits.length);
  for (let i = 0; i < bits.length; i++) weights[i] = HALF_TO_FLOAT[bits[i]];
  const [nLayer, nHead, T] = content.shape;
  if (weights.length !== nLayer * nHead * T * T || content.tokens.length !== T) {
    throw new Error(`${run} ${tag}: ${weights.length} weights for shape ${content.shape}`);
  }
  content.person_pronouns ??= content.pronouns;  // a server before the field: every pronoun
  const wordTokens = content.words.map(() => []);
  content.token_words.forEach((w, t) => { if (w >= 0) wordTokens[w].push(t); });
  // open on something readable without a click: the first pronoun read against names, its
  // attention row shaded
  const first = content.person_pronouns[0];
  const pronoun = first === undefined ? null : wordTokens[first][0];
  Object.assign(state, {content, weights, wordTokens, nLayer, nHead, T, query: pronoun,
                        locked: false, tag});
}

// One pair of the picked report: its clean tokens, (L, nh, T) effects.
async function loadPair(index) {
  const query = `run=${encodeURIComponent(state.report.run)}&pair=${index}`;
  state.pair = null;
  try {
    state.pair = unlessSkipped(await getJSON(`patching_pair?${query}`));
  } catch (error) {
    showProblem(`Cannot load pair ${index + 1} of the patching report: ${error.message}`);
  }
}

// ------------------------------------------------------------------------- attention math

function at(layer, head, q, k) {
  return state.weights[((layer * state.nHead + head) * state.T + q) * state.T + k];
}

// Word-level attention from word `from` to every word (a row of word_level).
function wordRow(layer, head, from) {
  const row = new Float64Array(state.wordTokens.length), rows = state.wordTokens[from];
  for (const q of rows) {
    for (let k = 0; k <= q; k++) {
      const w = state.content.token_words[k];
      if (w >= 0) row[w] += at(layer, head, q, k) / rows.length;
    }
  }
  return row;
}

// Word-level attention from every word to word `to` (a column of word_level).
function wordColumn(layer, head, to) {
  const column = new Float64Array(state.wordTokens.length), keys = state.wordTokens[to];
  state.wordTokens.forEach((queries, w) => {
    for (const q of queries) for (const k of keys) column[w] += at(layer, head, q, k);
    if (queries.length) column[w] /= queries.length;
  });
  return column;
}

// One value per token: how much the query looks at it (or, reversed, it looks at the query),
// for one head. Tokens outside the shaded side of the query are NaN.
function tokenValues(layer, head) {
  const {T} = state, q = state.query, values = new Float32Array(T).fill(NaN);
  if (state.level === "token") {
    for (let k = 0; k < T; k++) {
      if (!state.reverse && k <= q) values[k] = at(layer, head, q, k);
      if (state.reverse && k >= q) values[k] = at(layer, head, k, q);
    }
    return values;
  }
  const word = state.content.token_words[q];
  if (word < 0) return values;  // punctuation is no word: nothing to show at word level
  const byWord = state.reverse ? wordColumn(layer, head, word) : wordRow(layer, head, word);
  state.content.token_words.forEach((w, t) => {
    const shown = state.reverse ? w >= word : w <= word;
    if (w >= 0 && shown && state.wordTokens[w].length) values[t] = byWord[w];
  });
  return values;
}

// The key/value head query head `head` of `layer` reads: kv_heads[layer] of them, each shared by
// nHead / kv_heads[layer] consecutive query heads (as many as the query heads: its own).
function kvHead(layer, head) {
  return Math.floor(head / (state.nHead / state.content.kv_heads[layer]));
}

// A head's label, "H3", with the key/value head it reads where several share one: "H3 (KV 1)".
function headLabel(layer, head, prefix = "H") {
  const shared = state.content && state.content.kv_heads[layer] < state.nHead;
  return shared ? `${prefix}${head} (KV ${kvHead(layer, head)})` : `${prefix}${head}`;
}

// Which query heads share each key/value head, in words ("" where every head has its own), as
// tinylm-generate inspect=true says it.
function kvGroups() {
  const kv = state.content.kv_heads, nHead = state.nHead;
  const groups = (n) => n === nHead ? "each head has its own key/value head"
    : Array.from({length: n}, (_, g) => `heads ${g * nHead / n}-${(g + 1) * nHead / n - 1} `
                                        + `share key/value head ${g}`).join(", ");
  if (kv.every((n) => n === nHead)) return "";
  if (kv.every((n) => n === kv[0])) {
    return `Grouped-query attention, in every layer: ${groups(kv[0])}.`;
  }
  return `Grouped-query attention: ${kv.map((n, l) => `layer ${l}: ${groups(n)}`).join("; ")}.`;
}

// The heads the pickers select: [[layer, head], ...].
function selectedHeads() {
  if (state.head !== "all") return [[state.layer, state.head]];
  return Array.from({length: state.nHead}, (_, h) => [state.layer, h]);
}

// Attention from one token to every word (a row of capture.py's key_words).
function keyWordRow(layer, head, q) {
  const row = new Float64Array(state.wordTokens.length);
  for (let k = 0; k <= q; k++) {
    const w = state.content.token_words[k];
    if (w >= 0) row[w] += at(layer, head, q, k);
  }
  return row;
}

// The token that predicts a word: the one just before its first token (null: none in view).
function decidingToken(word) {
  const first = state.wordTokens[word][0];
  return first > 0 ? first - 1 : null;
}

// The earlier words of word `word` that have tokens in view.
function earlierWords(word) {
  const earlier = [];
  for (let w = 0; w < word; w++) if (state.wordTokens[w].length) earlier.push(w);
  return earlier;
}

// A pronoun's most-attended earlier words for one head, best first, as capture.py's
// read_pronouns reads them from the pronoun ("resolving") or from the token before it ("deciding").
function antecedents(layer, head, pronoun, position = "resolving") {
  const row = position === "deciding" ? keyWordRow(layer, head, decidingToken(pronoun))
    : wordRow(layer, head, pronoun);
  const earlier = earlierWords(pronoun);
  earlier.sort((a, b) => row[b] - row[a] || a - b);
  return earlier.slice(0, ANTECEDENTS_SHOWN).map((w) => [w, row[w]]);
}

// Whether word w is a name of the other gender than pronoun p (the server's lists say which
// names and pronouns have a gender; a name of neither list has none, and is never flagged).
function otherGender(p, w) {
  const c = state.content, female = new Set(c.female_words || []);
  const male = new Set(c.male_words || []);
  return (female.has(p) && male.has(w)) || (male.has(p) && female.has(w));
}

// ------------------------------------------------------------------------- the evidence

// The folder of the model a run belongs to: a run directory holds tensorboard/ (training),
// inspect/<date>/ and probe/<date>/, or what logdir= named inspect/ and probe/ ("." and those
// directly under the logdir: "").
function modelRoot(run) {
  return run === "." ? "" : run.replace(/(^|\/)(tensorboard|inspect(\/[^/]+)?|probe(\/[^/]+)?)$/, "");
}

// The patching report of the model that wrote the text of `run`, if the logdir has one: of the
// same run, or of the same run directory, with its shape; null otherwise.
function sameModelReport(run) {
  const reports = state.patching.filter((r) => r.shape[0] === state.nLayer
                                               && r.shape[1] === state.nHead);
  return reports.find((r) => r.run === run)
    || reports.find((r) => modelRoot(r.run) === modelRoot(run)) || null;
}

// The head to open a text on, and why: the largest patching effect of a report of the same
// model (sameModelReport), where one carries any of the name's effect, else the head that looks
// most at a name from the first pronoun read against names; null where neither says anything.
function evidenceHead() {
  const report = state.report || sameModelReport((state.text || state.choice).run);
  if (report) {
    let best = null;
    report.effect.forEach((row, layer) => row.forEach((v, head) => {
      if (v !== null && v > 0 && (!best || v > best.v)) best = {layer, head, v};
    }));
    if (best) {
      return {...best, why: `the head whose patching carries the most of the name's effect on `
        + `the pronoun (${best.v.toFixed(2)}, probe run "${report.run_label}")`};
    }
  }
  const c = state.content;
  const p = c ? c.person_pronouns[0] : undefined;
  if (p === undefined) return null;
  const names = earlierWords(p).filter((w) => c.names.includes(w));
  let best = null;
  for (let layer = 0; layer < state.nLayer; layer++) {
    for (let head = 0; head < state.nHead; head++) {
      const row = wordRow(layer, head, p);
      for (const w of names) if (!best || row[w] > best.v) best = {layer, head, v: row[w], w};
    }
  }
  return best && {...best, why: `the head that looks most at a name from "${c.words[p]}": `
    + `"${c.words[best.w]}", ${best.v.toFixed(2)} of its attention`};
}

// ------------------------------------------------------------------------------- drawing

function make(tag, props = {}, ...children) {
  const node = Object.assign(document.createElement(tag), props);
  node.append(...children);
  return node;
}

function headColour(head, alpha) {
  return `hsla(${Math.round((360 * head) / Math.max(state.nHead, 1))}, 75%, 45%, ${alpha})`;
}

function fillSelect(select, options, value) {
  select.replaceChildren(...options.map(([v, label]) => make("option", {value: v, text: label})));
  select.value = String(value);
}

// A colour scale's legend: a bar of CSS colour `stops` from left to right, labelled `ticks`
// ([position 0..1, text]), a dashed line at the baseline ([position, text]) and what it means.
function legend(className, stops, ticks, baseline, caption) {
  const bar = make("div", {className: "legend-bar"});
  bar.style.background = `linear-gradient(to right, ${stops.join(", ")})`;
  const place = (node, x) => { node.style.left = `${(100 * x).toFixed(1)}%`; return node; };
  const line = place(make("span", {className: "baseline-line"}), baseline[0]);
  const label = place(make("span", {className: "baseline", textContent: baseline[1]}),
                      baseline[0]);
  const marks = ticks.map(([x, text]) => place(make("span", {className: "tick", textContent: text}),
                                               x));
  return make("div", {className: `legend ${className}`},
              make("div", {className: "legend-scale"}, bar, line, ...marks, label),
              make("span", {className: "legend-caption", textContent: caption}));
}

// A layer x head table; cellAt(layer, head) makes each cell (its text, title, colour), marked
// where isSelected(layer, head) says, and a click on a cell selects its head in every table.
function headTable(className, corner, nLayer, nHead, cellAt, isSelected) {
  // the column's key/value head where every layer of this text's model groups its heads alike
  // (a report of another model's shape gets plain labels)
  const kv = state.content ? state.content.kv_heads : [nHead], alike = kv.every((n) => n === kv[0]);
  const label = (h) => alike && nHead === state.nHead && nLayer === state.nLayer
    ? headLabel(0, h) : `H${h}`;
  const header = make("tr", {}, make("th", {textContent: corner}),
    ...Array.from({length: nHead}, (_, h) => make("th", {textContent: label(h)})));
  const rows = Array.from({length: nLayer}, (_, layer) => make("tr", {},
    make("th", {textContent: `L${layer}`}),
    ...Array.from({length: nHead}, (_, head) => {
      const cell = cellAt(layer, head);
      Object.assign(cell.dataset, {layer, head});
      cell.classList.toggle("selected", isSelected(layer, head));
      cell.addEventListener("click", () => selectHead(layer, head, true));
      return cell;
    })));
  return make("table", {className}, header, ...rows);
}

// A token as the text shows it: newlines visible, and a word's letters in their own span, so
// that a pronoun's underline leaves the space before it (" She") out.
function tokenNodes(token) {
  const text = token.replace(/\n/g, "⏎\n"), lead = /^\s*/.exec(text)[0];
  if (!lead || lead === text) return [text];
  return [lead, make("span", {className: "word-part", textContent: text.slice(lead.length)})];
}

function drawText() {
  const c = state.content, pronouns = new Set(c.person_pronouns), any = new Set(c.pronouns);
  el.note.textContent = [c.window_note ? `Note: ${c.window_note}.` : "", kvGroups()]
    .filter(Boolean).join(" ");
  el.tokens.hidden = false;
  el.tokens.replaceChildren(...c.tokens.map((token, i) => {
    const span = make("span", {className: "token"}, ...tokenNodes(token));
    span.dataset.i = i;
    if (pronouns.has(c.token_words[i])) span.classList.add("pronoun");
    else if (any.has(c.token_words[i])) span.classList.add("thing-pronoun");  // it, its
    return span;
  }));
  state.spans = Array.from(el.tokens.children);
  drawHeadPickers();
}

// A pair of a patching report whose clean text has no attention in the logdir: its strip only.
function drawNoText() {
  const shown = state.choice.texts.size;
  el.note.textContent = `tinylm-probe wrote the attention of ${shown ? `its first ${shown}`
    : "none of its"} pairs: pair ${state.pairIndex + 1} has its patching effects only (below).`;
  el.tokens.replaceChildren();
  el.tokens.hidden = true;
  state.spans = [];
  drawHeadPickers();
}

// The layer and head pickers and the small multiples' rows, labelled for the selected layer.
function drawHeadPickers() {
  fillSelect(el.layer, Array.from({length: state.nLayer}, (_, l) => [l, `layer ${l}`]),
             state.layer);
  fillSelect(el.head, [...Array.from({length: state.nHead},
                                     (_, h) => [h, headLabel(state.layer, h, "head ")]),
                       ["all", "all heads"]], state.head);
  if (!state.content) {
    el.heads.replaceChildren();
    return;
  }
  const width = cellWidth();
  // each token's label above its column, read upwards (names and pronouns in bold)
  const labels = make("div", {className: "head-labels"});
  labels.style.width = `${state.T * width}px`;
  const marked = new Set([...state.content.names, ...state.content.person_pronouns]);
  labels.append(...state.content.tokens.map((token, t) => {
    const text = token.replace(/\n/g, "⏎").trim() || JSON.stringify(token);
    const label = make("span", {textContent: text.length > 9 ? `${text.slice(0, 8)}…` : text});
    label.style.left = `${t * width}px`;
    label.style.width = `${width}px`;
    if (marked.has(state.content.token_words[t])) label.className = "marked";
    return label;
  }));
  el.heads.replaceChildren(make("div", {className: "head-row"}, make("span"), labels),
    ...Array.from({length: state.nHead}, (_, h) => {
      const canvas = make("canvas", {width: state.T * width, height: 20});
      const row = make("div", {className: "head-row"},
                       make("span", {textContent: headLabel(state.layer, h)}), canvas);
      row.dataset.head = h;
      row.addEventListener("click", () => selectHead(state.layer, h, true));
      return row;
    }));
}

// Pixels per token in the small multiples: room for a label, fewer for a long text (it scrolls).
function cellWidth() {
  return Math.max(12, Math.min(40, Math.floor(1100 / state.T)));
}

function redraw() {
  const start = performance.now();
  el.why.textContent = state.why ? `Opened on layer ${state.layer} head ${state.head}: `
    + `${state.why}.` : "";
  if (!state.content) {
    el.heads.hidden = true;
    el.shading.replaceChildren();
    el.status.textContent = "";
    el.pronoun.replaceChildren();
    drawPatching();
    drawProbeGrids();
    drawArithmetic();
    return;
  }
  const heads = selectedHeads(), all = state.head === "all";
  el.heads.hidden = !all;
  const words = state.content.token_words, queryWord = state.query === null ? -2
    : state.level === "word" && words[state.query] >= 0 ? words[state.query] : -2;
  for (const span of state.spans) {
    const t = Number(span.dataset.i);
    span.style.backgroundColor = "";
    delete span.dataset.weight;
    span.classList.toggle("query", t === state.query || words[t] === queryWord);
  }
  if (state.query !== null) {
    // the main line: the selected head, or the mean of the layer's heads in "all heads" mode
    const mean = new Float32Array(state.T);
    heads.forEach(([layer, head]) => {
      const values = tokenValues(layer, head);
      values.forEach((v, t) => { mean[t] += v / heads.length; });
      if (all) drawHeadStrip(head, values);
    });
    mean.forEach((v, t) => {
      if (Number.isNaN(v)) return;
      state.spans[t].dataset.weight = v.toFixed(4);
      // sqrt: small weights stay visible next to a dominant one
      state.spans[t].style.backgroundColor = all ? `rgba(60, 60, 60, ${Math.sqrt(v)})`
        : headColour(heads[0][1], Math.sqrt(v));
    });
    state.shown = mean;
  }
  drawShadingLegend();
  drawPronounPanel();
  drawPatching();
  drawProbeGrids();
  drawStatus(null);
  drawArithmetic();
  void document.body.offsetHeight;  // count the layout the change causes, not just the JS
  window.tinylmTiming.redrawMs = performance.now() - start;
}

function drawHeadStrip(head, values) {
  const canvas = el.heads.children[head + 1].querySelector("canvas");
  const g = canvas.getContext("2d"), width = cellWidth();
  g.clearRect(0, 0, canvas.width, canvas.height);
  values.forEach((v, t) => {
    if (Number.isNaN(v)) return;
    g.fillStyle = headColour(head, Math.sqrt(v));
    g.fillRect(t * width, 0, width, canvas.height);
  });
  if (state.query !== null) {
    g.strokeStyle = "#000";
    g.strokeRect(state.query * width + 0.5, 0.5, width - 1, canvas.height - 1);
  }
}

// How many words (or tokens) the shaded row spreads over: uniform attention gives each 1/n.
function shadedCount() {
  if (!state.shown) return 0;
  let n = 0;
  state.shown.forEach((v, t) => {
    if (!Number.isNaN(v) && (state.level === "token" || firstTokenOfWord(t))) n += 1;
  });
  return n;
}

// The legend of the text's shading: the selected head's colour from weight 0 to 1 (on a square
// root scale), uniform attention marked; in "all heads" mode each head's colour.
function drawShadingLegend() {
  if (state.query === null) {
    el.shading.replaceChildren();
    return;
  }
  const n = shadedCount(), unit = state.level === "word" ? "words" : "tokens";
  const uniform = n ? [Math.sqrt(1 / n), `uniform: 1/${n} = ${(1 / n).toFixed(2)}`]
    : [0, "uniform"];
  const ticks = [[0, "0"], [Math.sqrt(0.05), "0.05"], [0.5, "0.25"], [1, "1"]];
  if (state.head === "all") {
    el.shading.replaceChildren(
      legend("shading-legend", ["rgba(60,60,60,0)", "rgba(60,60,60,1)"], ticks, uniform,
             `Text: the mean weight of layer ${state.layer}'s heads over the ${n} shaded `
             + `${unit} (square-root scale). Strips: one head each, in its colour:`),
      make("div", {className: "head-swatches"}, ...Array.from({length: state.nHead}, (_, h) => {
        const swatch = make("span", {className: "swatch"});
        swatch.style.backgroundColor = headColour(h, 1);
        return make("span", {}, swatch, headLabel(state.layer, h));
      })));
    return;
  }
  el.shading.replaceChildren(legend("shading-legend",
    [headColour(state.head, 0), headColour(state.head, 1)], ticks, uniform,
    `Shading: layer ${state.layer} head ${state.head}'s weight on each of the ${n} ${unit} `
    + "(square-root scale, so that small weights stay visible); the dashed line is what every "
    + `${unit.slice(0, -1)} would get if the head spread its attention evenly.`));
}

// A word of a reading: names in italics, a name of the other gender than the pronoun flagged.
function readingWord(pronoun, w) {
  const c = state.content, name = c.names.includes(w), other = otherGender(pronoun, w);
  const node = make(name ? "em" : "span", {textContent: c.words[w] + (other ? " ≠" : "")});
  if (other) {
    node.className = "other-gender";
    node.title = `a name of the other gender than "${c.words[pronoun]}": a head looking here `
      + "looks at the wrong character";
  }
  return node;
}

// The query's pronoun: its top earlier words for the selected head, and every head's best one.
function drawPronounPanel() {
  const c = state.content, q = state.query;
  const pronoun = q === null ? -1 : c.token_words[q];
  if (pronoun >= 0 && c.pronouns.includes(pronoun) && !c.person_pronouns.includes(pronoun)) {
    el.pronoun.replaceChildren(make("p", {className: "hint",
      textContent: `"${c.words[pronoun]}" stands for a thing or an animal, not a named `
        + "character: the tab reads only he, she, they and their other forms against names."}));
    return;
  }
  if (pronoun < 0 || !c.pronouns.includes(pronoun)) {
    el.pronoun.replaceChildren(make("p", {className: "hint",
      textContent: c.person_pronouns.length
        ? "Hover a pronoun (underlined) to list the words it looks at."
        : "This text has no he, she or they to read against names."}));
    return;
  }
  const heads = selectedHeads();
  const positions = decidingToken(pronoun) === null ? ["resolving"] : ["resolving", "deciding"];
  const lists = heads.flatMap(([layer, head]) => positions.map((position) => {
    const items = antecedents(layer, head, pronoun, position).map(([w, v]) => {
      const li = make("li", {}, readingWord(pronoun, w), ` ${v.toFixed(2)}`);
      li.dataset.word = w;
      li.dataset.weight = v.toFixed(4);
      return li;
    });
    const list = make("ol", {className: "antecedents"}, ...items);
    Object.assign(list.dataset, {layer, head, position});
    const from = position === "deciding" ? "from the token before it" : "from the pronoun";
    return make("div", {}, make("b", {textContent: `L${layer} ${headLabel(layer, head)} ${from}`}),
                list);
  }));
  const n = earlierWords(pronoun).length;
  const table = headTable("best-per-head", "top word", state.nLayer, state.nHead,
    (layer, head) => {
      const [[w, v] = [-1, 0]] = antecedents(layer, head, pronoun);
      const cell = make("td", {title: `layer ${layer} head ${head}: ${v.toFixed(3)}`},
                        ...(w >= 0 ? [readingWord(pronoun, w),
                                      make("small", {textContent: ` ${v.toFixed(2)}`})] : []));
      cell.style.backgroundColor = `rgba(120, 120, 120, ${0.6 * Math.sqrt(v)})`;
      return cell;
    },
    (layer, head) => heads.some(([l, h]) => l === layer && h === head));
  const flagged = heads.length && c.female_words && c.male_words;
  el.pronoun.replaceChildren(
    make("p", {}, `"${c.words[pronoun]}" (word ${pronoun}) looks at, summed over sub-word ` +
         "tokens (names in italics):"),
    make("div", {className: "lists"}, ...lists),
    make("p", {textContent: "Each head's most-attended earlier word from the pronoun, and its "
                            + "weight (click to select the head):"}),
    table,
    legend("top-word-legend", ["rgba(120,120,120,0)", "rgba(120,120,120,0.6)"],
           [[0, "0"], [0.5, "0.25"], [1, "1"]],
           [Math.sqrt(1 / Math.max(n, 1)), `uniform: 1/${n} = ${(1 / Math.max(n, 1)).toFixed(2)}`],
           `Grey: the weight of the top word (square-root scale); the dashed line: what each of `
           + `the ${n} earlier words would get from a head that spread its attention evenly. `
           + (flagged ? "≠ (red): a name of the other gender than the pronoun." : "")));
}

// Diverging colour of a patching effect: red where the head carries the name's effect (1: all
// of it), blue where it pushes the other way, white at 0; null (undefined) stays blank.
function effectColour(v) {
  if (v === null) return "";
  const alpha = Math.min(1, Math.abs(v));
  return v >= 0 ? `rgba(198, 40, 40, ${alpha})` : `rgba(21, 101, 192, ${alpha})`;
}

function effectText(v, digits = 3) {
  return v === null ? "undefined" : v.toFixed(digits);
}

function effectLegend(className) {
  return legend(className, ["rgb(21,101,192)", "#fff", "rgb(198,40,40)"],
                [[0, "-1"], [1, "+1"]], [0.5, "0: none"],
                "Effect: the share of the name's effect on the pronoun that the head carries. "
                + "0 (white): none of it; +1 (red): all of it; blue: it pushes the other way.");
}

// The picked run's patching grid (layer x head) and, for the selected head, its effect at each
// position of the picked pair's clean text. Another run's report is only named: its heads
// belong to the model that run probed.
function drawPatching() {
  const report = state.report;
  if (!report) {
    const elsewhere = state.patching.map((r) => `"${r.run_label}"`);
    el.patching.replaceChildren(...(elsewhere.length ? [make("p", {className: "hint",
      textContent: `Activation patching of run ${elsewhere.join(", ")}: pick a "probe pair" in `
        + "the text list to see it beside the attention of the pair's text."})] : []));
    return;
  }
  const level = report.interval_level === null ? ""
    : `${Math.round(100 * report.interval_level)}% `;
  const selected = selectedHeads();
  const grid = headTable("patch-grid", "", report.effect.length, report.effect[0].length,
    (layer, head) => {
      const v = report.effect[layer][head], [low, high] = report.interval[layer][head];
      const cell = make("td", {textContent: v === null ? "–" : v.toFixed(2),
        title: `layer ${layer} head ${head}: effect ${effectText(v)}, `
          + `${level}bootstrap interval ${effectText(low)} .. ${effectText(high)}`});
      cell.dataset.effect = effectText(v, 4);
      cell.style.backgroundColor = effectColour(v);
      cell.classList.toggle("strong", v !== null && Math.abs(v) > 0.6);
      return cell;
    },
    (l, h) => selected.some(([layer, head]) => layer === l && head === h));
  el.patching.replaceChildren(
    make("p", {textContent: `Activation patching (run "${report.run_label}", `
      + `${report.pairs.length} pairs, ${report.n_skipped} skipped): each head's output copied `
      + "from the text with the other name, at every position; the share of the name's effect "
      + "on the pronoun it carries (hover a cell: its interval):"}),
    grid, effectLegend("patch-legend"), drawPatchingStrip());
}

// The effect of the selected head patched at one position at a time, over the pair's tokens,
// each written under its token.
function drawPatchingStrip() {
  const pair = state.pair;
  if (!pair) {
    return make("p", {className: "hint", textContent: "Each head's effect at each position of "
      + "one pair: pick a \"probe pair\" in the text list."});
  }
  if (state.head === "all") {
    return make("p", {className: "hint", textContent: "Pick one head to see its effect at each "
                                                      + "position."});
  }
  const effects = pair.effect[state.layer]?.[state.head];
  if (!effects) return make("p", {className: "hint",  // a report of another model's shape
    textContent: `The patching report has no layer ${state.layer} head ${state.head}.`});
  const tokens = pair.tokens.map((token, p) => {
    const v = effects[p], span = make("span", {className: "patch-token",
      title: `${JSON.stringify(token)} (position ${p}): effect ${effectText(v)}`},
      // a space is drawn as ␣: the strip has no text around it to show where it is
      make("span", {className: "patch-text", textContent: token.trim() ? token.replace(/\n/g, "⏎")
        : token.replace(/\n/g, "⏎").replace(/ /g, "␣")}),
      make("span", {className: "patch-value", textContent: v === null ? "–" : v.toFixed(2)}));
    Object.assign(span.dataset, {position: p, effect: effectText(v, 4), token});
    span.style.backgroundColor = effectColour(v);
    span.classList.toggle("deciding", p === pair.position);
    return span;
  });
  return make("div", {id: "patch-strip"},
    make("p", {textContent: `L${state.layer} ${headLabel(state.layer, state.head)} patched at `
      + `one position at a time, pair ${pair.pair + 1}: "${pair.text}" `
      + `("${pair.pronoun.trim()}" against "${pair.wrong_pronoun.trim()}"), margin `
      + `${pair.m_clean.toFixed(2)} with its name, ${pair.m_counterfactual.toFixed(2)} with the `
      + "other; under each token its effect, the deciding token (the one before the pronoun) "
      + "outlined:", title: pair.source}),
    make("div", {className: "patch-tokens"}, ...tokens));
}

// Diverging colour of an accuracy around chance: green above, purple below, white at chance.
function accuracyColour(v, chance) {
  const alpha = v >= chance ? (v - chance) / (1 - chance) : (chance - v) / chance;
  return v >= chance ? `rgba(27, 120, 55, ${alpha})` : `rgba(118, 42, 131, ${alpha})`;
}

function drawProbeGrids() {
  el.probes.replaceChildren(...state.probes.map((report) => {
    const chance = report.chance ?? 0.5, n = report.n;
    // how far chance alone scatters over n items (95%, normal approximation)
    const band = n ? 1.96 * Math.sqrt(chance * (1 - chance) / n) : 0;
    const grid = headTable("probe-grid", "", report.accuracy.length, report.accuracy[0].length,
      (layer, head) => {
        const accuracy = report.accuracy[layer][head];
        const cell = make("td", {textContent: accuracy === null ? "" : accuracy.toFixed(2)});
        if (accuracy !== null) {
          cell.style.backgroundColor = accuracyColour(accuracy, chance);
          cell.classList.toggle("beyond-chance", Math.abs(accuracy - chance) > band);
          cell.title = `layer ${layer} head ${head}: ${accuracy.toFixed(3)}`
            + (Math.abs(accuracy - chance) > band ? "" : ", within what chance alone gives");
        }
        return cell;
      },
      (layer, head) => state.layer === layer && state.head === head);
    const low = Math.max(0, chance - band).toFixed(2), high = Math.min(1, chance + band).toFixed(2);
    return make("div", {className: "probe"},
      make("p", {textContent: `Probe accuracy per head (run "${report.run_label ?? report.run}", `
                              + `${n} items; click a cell to select that head). It reads `
                              + `${report.reads ?? "attention from the pronoun"}.`}),
      grid,
      legend("probe-legend", ["rgb(118,42,131)", `#fff ${(100 * chance).toFixed(0)}%`,
                              "rgb(27,120,55)"],
             [[0, "0"], [1, "1"]], [chance, `chance ${chance.toFixed(2)}`],
             `Chance: ${chance.toFixed(2)} (a head choosing at random). Green: above chance, `
             + `purple: below. Over ${n} items chance alone scatters from ${low} to ${high} `
             + "(95%): only a bold cell lies outside that."));
  }));
}

// Exact numbers: the hovered token's weight and its rank among the row's keys.
function drawStatus(hovered) {
  const c = state.content, q = state.query;
  if (q === null) {
    el.status.textContent = "Hover a token to see where it looks; click to keep it and read "
      + "the numbers of the others.";
    return;
  }
  const what = state.reverse ? "is looked at by" : "looks at";
  const word = c.token_words[q];
  const who = state.level === "word" && word >= 0 ? `"${c.words[word]}" (word ${word})`
    : `${JSON.stringify(c.tokens[q])} (token ${q})`;
  if (hovered === null || Number.isNaN(state.shown[hovered])) {
    el.status.textContent = `${who} ${what} the shaded ${state.level}s` +
      (state.locked ? "; hover one for its weight" : "");
    return;
  }
  const shown = [];
  state.shown.forEach((v, t) => {
    if (!Number.isNaN(v) && (state.level === "token" || firstTokenOfWord(t))) shown.push(v);
  });
  const v = state.shown[hovered], rank = 1 + shown.filter((x) => x > v).length;
  const other = state.level === "word"
    ? `"${c.words[c.token_words[hovered]]}" (word ${c.token_words[hovered]})`
    : `${JSON.stringify(c.tokens[hovered])} (token ${hovered})`;
  el.status.textContent = `${who} ${what} ${other}: weight ${v.toFixed(4)}, rank ${rank} of ${shown.length} ` +
    `${state.level}s`;
}

function firstTokenOfWord(t) {
  const w = state.content.token_words[t];
  return w >= 0 && state.wordTokens[w][0] === t;
}

// The arithmetic behind the shown weight (static/arithmetic.js) for the selected head and query
// token; nothing where that script did not load.
function drawArithmetic() {
  el.arithmeticBox.hidden = !window.tinylmArithmetic;
  if (!window.tinylmArithmetic) return;
  const hint = !state.content ? "This pair has no attention to compute."
    : state.head === "all" ? "Pick one head to see the arithmetic behind its weights."
    : state.query === null ? "Hover or click a token to see the arithmetic behind its weights."
    : null;
  el.arithmeticTitle.textContent = hint || `The arithmetic behind the weights of `
    + `${JSON.stringify(state.content.tokens[state.query])} (token ${state.query}), layer `
    + `${state.layer} head ${state.head}`;
  if (hint) {
    state.arithmeticKey = null;
    clearTimeout(state.arithmeticTimer);
    el.arithmetic.classList.remove("stale");
    el.arithmetic.replaceChildren();
    return;
  }
  const options = {run: state.text.run, tag: state.tag, text: state.text.name,
                   step: state.content.step, layer: state.layer, head: state.head,
                   query: state.query};
  const key = JSON.stringify(options);
  if (key === state.arithmeticKey) return;
  state.arithmeticKey = key;
  el.arithmetic.classList.add("stale");  // another weight's steps, greyed until these arrive
  clearTimeout(state.arithmeticTimer);  // hovering across a sentence asks for its last token
  state.arithmeticTimer = setTimeout(() => {
    Promise.resolve(window.tinylmArithmetic.render(el.arithmetic, options)).catch((error) => {
      el.arithmetic.replaceChildren(make("p", {className: "problem",
                                               textContent: `Cannot draw the arithmetic: ${error}`}));
    }).finally(() => {
      if (state.arithmeticKey === key) el.arithmetic.classList.remove("stale");
    });
  }, state.locked ? 0 : 120);
}

// Select a head in every view; `byHand`: the user picked it, so texts opened later keep it.
function selectHead(layer, head, byHand = false) {
  // a probe report of another model may name heads this text's model does not have
  if (layer >= state.nLayer || (head !== "all" && head >= state.nHead)) return;
  if (byHand) {
    state.headPicked = true;
    state.why = "";
  }
  const relabel = layer !== state.layer;
  state.layer = layer;
  state.head = head;
  el.layer.value = String(layer);
  if (relabel) drawHeadPickers();  // a layer may group its heads otherwise
  el.head.value = String(head);
  redraw();
}

// ------------------------------------------------------------------------------- the tab

// What the server skipped, in one line: each message starts with the file or tag it is about.
function problemLine(p) {
  return `Skipped ${p.run === undefined ? "" : `run "${p.run}", `}${p.message}`;
}

function showProblem(text) {
  el.problems.append(make("p", {className: "problem", textContent: text}));
}

// The text picker's entries: each text by what it holds, and each patching report as one entry
// whose pairs the pair picker chooses (with the attention of those tinylm-probe wrote).
function makeChoices(texts, reports) {
  const choices = [], pairTexts = new Map();  // run -> Map(pair index -> its text)
  for (const text of texts) {
    const match = /^patching\/pair_(\d+)$/.exec(text.name);
    const report = reports.find((r) => r.run === text.run);
    if (match && report && Number(match[1]) < report.pairs.length) {
      if (!pairTexts.has(text.run)) pairTexts.set(text.run, new Map());
      pairTexts.get(text.run).set(Number(match[1]), text);
    } else {
      choices.push({type: "text", kind: text.kind ?? "inspect", run: text.run, text,
                    base: `"${text.sentence ?? text.name}" (${KINDS[text.kind ?? "inspect"]})`});
    }
  }
  for (const report of reports) {
    choices.push({type: "pairs", kind: "probe", run: report.run, report,
                  texts: pairTexts.get(report.run) || new Map(), base: `pairs of ${report.run}`});
  }
  // texts of several runs may read alike: those say their run too
  const counts = new Map();
  choices.forEach((c) => counts.set(c.base, (counts.get(c.base) || 0) + 1));
  choices.forEach((c) => {
    c.label = (text) => counts.get(c.base) > 1 ? `${text} · run ${c.run_label ?? c.run}` : text;
    c.run_label = c.type === "pairs" ? c.report.run_label : c.text.run_label;
  });
  return KIND_ORDER.flatMap((kind) => choices.filter((c) => c.kind === kind));
}

// An entry of the text picker as it reads now: the step a training sample shows, the pair.
function choiceLabel(choice) {
  if (choice.type === "pairs") {
    const i = choice === state.choice && state.pairIndex !== null ? state.pairIndex : 0;
    const pair = choice.report.pairs[i];
    return choice.label(`"${pair.text}" (probe pair ${i + 1} of ${choice.report.pairs.length})`);
  }
  const text = choice.text, steps = text.steps;
  const step = choice === state.choice ? Number(el.step.value) : steps[steps.length - 1].step;
  const kind = text.kind ?? "inspect";
  return choice.label(`"${text.sentence ?? text.name}" (${KINDS[kind]}`
                      + `${kind === "training" ? `, step ${step}` : ""})`);
}

function drawListing(problems) {
  const {texts, empty} = state.listing;
  problems.forEach((p) => showProblem(problemLine(p)));
  el.empty.textContent = empty || "";
  state.choices = makeChoices(texts, state.patching);
  el.main.hidden = !state.choices.length;
  el.text.replaceChildren(...state.choices.map((choice, i) => {
    const option = make("option", {value: i, text: choiceLabel(choice)});
    Object.assign(option.dataset, {run: choice.run, kind: choice.kind,
                                   name: choice.type === "pairs" ? "" : choice.text.name});
    return option;
  }));
}

// The label of each step of a text: a training step's number; "inspected" (or "probe") for a
// text written once.
function stepLabel(text, step) {
  const kind = text.kind ?? "inspect";
  if (kind === "training" || text.steps.length > 1) return `step ${step}`;
  return kind === "probe" ? "probe" : "inspected";
}

// Load and draw one entry of the text picker (a step of a text, or a pair of a patching
// report); false (and a problem line saying why) when it cannot be drawn.
async function chooseText(index, step = null, pair = null) {
  const start = performance.now(), choice = state.choices[index];
  state.choice = choice;
  el.text.value = String(index);
  const pairs = choice.type === "pairs";
  el.stepLabel.hidden = pairs;
  el.pairLabel.hidden = !pairs;
  state.pair = null;
  state.arithmeticKey = null;
  try {
    if (pairs) {
      state.report = choice.report;
      const i = pair ?? 0;
      state.pairIndex = i;
      fillSelect(el.pair, choice.report.pairs.map((p, k) => [k, `${k + 1}. ${p.text}`
        + (choice.texts.has(k) ? "" : " (patching only)")]), i);
      state.text = choice.texts.get(i) || null;
      const loads = [loadPair(i)];
      if (state.text) {
        loads.push(loadText(state.text.run, state.text.steps[state.text.steps.length - 1].tag));
      } else {
        Object.assign(state, {content: null, weights: null, query: null,
                              nLayer: choice.report.shape[0], nHead: choice.report.shape[1]});
      }
      await Promise.all(loads);
    } else {
      const steps = choice.text.steps;
      const chosen = step === null ? steps[steps.length - 1] : steps.find((s) => s.step === step);
      fillSelect(el.step, steps.map((s) => [s.step, stepLabel(choice.text, s.step)]), chosen.step);
      state.text = choice.text;
      state.pairIndex = null;
      await loadText(state.text.run, chosen.tag);
      state.report = sameModelReport(state.text.run);
    }
  } catch (error) {
    showProblem(error.message);
    return false;
  }
  el.text.selectedOptions[0].text = choiceLabel(choice);
  show();
  window.tinylmTiming.textLoadMs = performance.now() - start;
  return true;
}

// Draw what chooseText loaded: on the head the evidence singles out, until one is picked.
function show() {
  state.layer = Math.min(state.layer, state.nLayer - 1);
  if (state.head !== "all") state.head = Math.min(state.head, state.nHead - 1);
  const evidence = state.headPicked ? null : evidenceHead();
  state.why = evidence ? evidence.why : "";
  if (evidence) Object.assign(state, {layer: evidence.layer, head: evidence.head});
  if (state.content) drawText(); else drawNoText();
  redraw();
}

function onTokenEvent(event) {
  const span = event.target.closest(".token");
  if (!span) return;
  const t = Number(span.dataset.i);
  if (event.type === "click") {
    state.locked = !(state.locked && state.query === t);
    state.query = t;
    redraw();
  } else if (state.locked) {
    drawStatus(t);
  } else if (state.query !== t) {
    state.query = t;
    redraw();
  }
}

// The type's size, for a projector: kept between visits (localStorage), 100% to 200%.
function applyZoom(zoom) {
  document.body.style.zoom = String(zoom);
  el.zoom.value = String(zoom);
  try { localStorage.setItem(`${STORED}zoom`, String(zoom)); } catch { /* private mode */ }
}

function stored(key) {
  try { return localStorage.getItem(`${STORED}${key}`); } catch { return null; }
}

export async function render() {
  document.head.append(make("link", {rel: "stylesheet", href: "style.css"}));
  const labelled = (text, input) => make("label", {}, text, input);
  Object.assign(el, {
    problems: make("div", {id: "problems"}), empty: make("p", {id: "empty"}),
    text: make("select", {id: "text-select"}), step: make("select", {id: "step-select"}),
    pair: make("select", {id: "pair-select"}),
    layer: make("select", {id: "layer-select"}), head: make("select", {id: "head-select"}),
    level: make("select", {id: "level-select"}), zoom: make("select", {id: "zoom-select"}),
    reverse: make("input", {id: "reverse", type: "checkbox"}),
    note: make("p", {id: "note"}), why: make("p", {id: "head-why"}),
    tokens: make("div", {id: "tokens"}), shading: make("div", {id: "shading"}),
    heads: make("div", {id: "heads"}), status: make("p", {id: "status"}),
    pronoun: make("div", {id: "pronoun"}), probes: make("div", {id: "probes"}),
    patching: make("div", {id: "patching"}),
    arithmetic: make("div", {id: "arithmetic"}), arithmeticTitle: make("summary"),
  });
  el.stepLabel = labelled("step ", el.step);
  el.pairLabel = labelled("pair ", el.pair);
  el.pairLabel.hidden = true;
  el.arithmeticBox = make("details", {id: "arithmetic-panel", open: stored("arithmetic") !== "closed"},
                          el.arithmeticTitle, el.arithmetic);
  el.arithmeticBox.hidden = true;
  el.arithmeticBox.addEventListener("toggle", () => {
    try {
      localStorage.setItem(`${STORED}arithmetic`, el.arithmeticBox.open ? "open" : "closed");
    } catch { /* private mode */ }
  });
  fillSelect(el.level, [["word", "words"], ["token", "tokens"]], state.level);
  fillSelect(el.zoom, ZOOMS.map((z) => [z, `${Math.round(100 * z)}%`]), 1);
  el.main = make("div", {id: "main"},
    make("div", {className: "controls"}, labelled("text ", el.text), el.stepLabel, el.pairLabel),
    make("div", {className: "controls"},
         labelled("layer ", el.layer), labelled("head ", el.head),
         labelled("level ", el.level),
         labelled("", el.reverse), make("span", {textContent: " reverse: who looks at it"}),
         labelled("type size ", el.zoom)),
    el.why, el.note, el.tokens, el.shading, el.status, el.heads,
    make("div", {id: "grids"}, el.pronoun, el.patching), el.arithmeticBox, el.probes);
  document.body.append(make("h3", {textContent: "tinylm attention"}), el.problems, el.empty,
                       el.main);
  const zoom = Number(stored("zoom"));
  applyZoom(ZOOMS.includes(zoom) ? zoom : 1);

  el.text.addEventListener("change", () => chooseText(Number(el.text.value)));
  el.step.addEventListener("change", () => chooseText(Number(el.text.value),
                                                      Number(el.step.value)));
  el.pair.addEventListener("change", () => chooseText(Number(el.text.value), null,
                                                      Number(el.pair.value)));
  el.layer.addEventListener("change", () => selectHead(Number(el.layer.value), state.head, true));
  el.head.addEventListener("change", () => selectHead(
    state.layer, el.head.value === "all" ? "all" : Number(el.head.value), true));
  el.level.addEventListener("change", () => { state.level = el.level.value; redraw(); });
  el.reverse.addEventListener("change", () => { state.reverse = el.reverse.checked; redraw(); });
  el.zoom.addEventListener("change", () => applyZoom(Number(el.zoom.value)));
  el.tokens.addEventListener("mouseover", onTokenEvent);
  el.tokens.addEventListener("click", onTokenEvent);

  // the arithmetic panel's own script, where the plugin serves one: drawn once it has loaded
  const script = make("script", {src: "arithmetic.js"});
  script.addEventListener("load", () => { if (state.choice) drawArithmetic(); });
  document.head.append(script);

  // one route that fails leaves the other's data drawn, and says what failed
  const failed = (what) => (error) => {
    showProblem(`Cannot load the ${what}: ${error.message}`);
    return null;
  };
  const [listing, probes, patching] = await Promise.all([
    getJSON("texts").catch(failed("list of texts")),
    getJSON("probes").catch(failed("probe reports")),
    getJSON("patching").catch(failed("patching reports"))]);
  state.listing = listing || {texts: [], problems: [], empty: ""};
  state.probes = probes ? probes.reports : [];
  state.patching = patching ? patching.reports : [];
  drawListing([...state.listing.problems, ...(probes ? probes.problems : []),
               ...(patching ? patching.problems : [])]);
  // the first entry that can be drawn: a skipped one is named among the problems
  for (let i = 0; i < state.choices.length && !(await chooseText(i)); i++);
  window.tinylmTiming.firstDrawMs = performance.now();
  document.body.dataset.ready = "true";  // for the browser test: the first draw is done
}
