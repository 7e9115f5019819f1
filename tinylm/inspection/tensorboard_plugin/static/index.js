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
// A run with an activation-patching report (tinylm-probe patch=true) gets its layer x head grid
// of effects beside the attention's, and for the selected head the effect at each position of a
// pair's clean text; both grids select the same head (state.layer, state.head).

const ANTECEDENTS_SHOWN = 3;  // as tinylm-generate inspect=true's pronoun tables

const state = {
  listing: null, text: null, content: null, weights: null, probes: [],
  layer: 0, head: 0,  // head: a number, or "all" for the small multiples
  level: "word", reverse: false,
  query: null, locked: false,  // query: the token whose row (or column) is shown
  patching: [],  // every run's patching report (effects per head, its pairs without tokens)
  report: null, pair: null,  // the selected text's run's report; the pair drawn (with tokens)
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

async function loadText(run, tag) {
  const start = performance.now();
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
  const wordTokens = content.words.map(() => []);
  content.token_words.forEach((w, t) => { if (w >= 0) wordTokens[w].push(t); });
  // open on something readable without a click: the first pronoun, its attention row shaded
  const pronoun = content.pronouns.length ? wordTokens[content.pronouns[0]][0] : null;
  Object.assign(state, {content, weights, wordTokens, nLayer, nHead, T, query: pronoun,
                        locked: false});
  state.layer = Math.min(state.layer, nLayer - 1);
  if (state.head !== "all") state.head = Math.min(state.head, nHead - 1);
  drawText();
  window.tinylmTiming.textLoadMs = performance.now() - start;
}

// One pair of the selected run's patching report: its clean tokens, (L, nh, T) effects.
async function loadPair(index) {
  const query = `run=${encodeURIComponent(state.report.run)}&pair=${index}`;
  state.pair = null;
  try {
    state.pair = unlessSkipped(await getJSON(`patching_pair?${query}`));
    el.pair.value = String(index);
  } catch (error) {
    showProblem(`Cannot load pair ${index} of the patching report: ${error.message}`);
  }
  drawPatching();
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

// The heads the pickers select: [[layer, head], ...].
function selectedHeads() {
  if (state.head !== "all") return [[state.layer, state.head]];
  return Array.from({length: state.nHead}, (_, h) => [state.layer, h]);
}

// A layer x head table; cellAt(layer, head) makes each cell (its text, title, colour), marked
// where isSelected(layer, head) says, and a click on a cell selects its head in every table.
function headTable(className, corner, nLayer, nHead, cellAt, isSelected) {
  const header = make("tr", {}, make("th", {textContent: corner}),
                      ...Array.from({length: nHead}, (_, h) => make("th", {textContent: `H${h}`})));
  const rows = Array.from({length: nLayer}, (_, layer) => make("tr", {},
    make("th", {textContent: `L${layer}`}),
    ...Array.from({length: nHead}, (_, head) => {
      const cell = cellAt(layer, head);
      Object.assign(cell.dataset, {layer, head});
      cell.classList.toggle("selected", isSelected(layer, head));
      cell.addEventListener("click", () => selectHead(layer, head));
      return cell;
    })));
  return make("table", {className}, header, ...rows);
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

// A pronoun's most-attended earlier words for one head, best first, as capture.py's
// read_pronouns reads them from the pronoun ("resolving") or from the token before it ("deciding").
function antecedents(layer, head, pronoun, position = "resolving") {
  const row = position === "deciding" ? keyWordRow(layer, head, decidingToken(pronoun))
    : wordRow(layer, head, pronoun);
  const earlier = [];
  for (let w = 0; w < pronoun; w++) if (state.wordTokens[w].length) earlier.push(w);
  earlier.sort((a, b) => row[b] - row[a] || a - b);
  return earlier.slice(0, ANTECEDENTS_SHOWN).map((w) => [w, row[w]]);
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

function drawText() {
  const c = state.content, pronouns = new Set(c.pronouns);
  el.note.textContent = c.window_note ? `Note: ${c.window_note}.` : "";
  el.tokens.replaceChildren(...c.tokens.map((token, i) => {
    const span = make("span", {className: "token", textContent: token.replace(/\n/g, "⏎\n")});
    span.dataset.i = i;
    if (pronouns.has(c.token_words[i])) span.classList.add("pronoun");
    return span;
  }));
  state.spans = Array.from(el.tokens.children);
  fillSelect(el.layer, Array.from({length: state.nLayer}, (_, l) => [l, `layer ${l}`]),
             state.layer);
  fillSelect(el.head, [...Array.from({length: state.nHead}, (_, h) => [h, `head ${h}`]),
                       ["all", "all heads"]], state.head);
  el.heads.replaceChildren(...Array.from({length: state.nHead}, (_, h) => {
    const canvas = make("canvas", {width: state.T * cellWidth(), height: 12});
    const row = make("div", {className: "head-row"}, make("span", {textContent: `H${h}`}),
                     canvas);
    row.dataset.head = h;
    row.addEventListener("click", () => selectHead(state.layer, h));
    return row;
  }));
  redraw();
}

function cellWidth() {
  return Math.max(1, Math.min(10, Math.floor(900 / state.T)));
}

function redraw() {
  const start = performance.now();
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
  drawPronounPanel();
  drawPatching();
  drawProbeGrids();
  drawStatus(null);
  void document.body.offsetHeight;  // count the layout the change causes, not just the JS
  window.tinylmTiming.redrawMs = performance.now() - start;
}

function drawHeadStrip(head, values) {
  const canvas = el.heads.children[head].querySelector("canvas");
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

// The query's pronoun: its top earlier words for the selected head, and every head's best one.
function drawPronounPanel() {
  const c = state.content, q = state.query;
  const pronoun = q === null ? -1 : c.token_words[q];
  if (pronoun < 0 || !c.pronouns.includes(pronoun)) {
    el.pronoun.replaceChildren(make("p", {className: "hint",
      textContent: c.pronouns.length ? "Hover a pronoun (underlined) to list the words it looks at."
        : "This text has no pronoun."}));
    return;
  }
  const names = new Set(c.names);
  const word = (w) => make(names.has(w) ? "em" : "span", {textContent: c.words[w]});
  const heads = selectedHeads();
  const positions = decidingToken(pronoun) === null ? ["resolving"] : ["resolving", "deciding"];
  const lists = heads.flatMap(([layer, head]) => positions.map((position) => {
    const items = antecedents(layer, head, pronoun, position).map(([w, v]) => {
      const li = make("li", {}, word(w), ` ${v.toFixed(2)}`);
      li.dataset.word = w;
      li.dataset.weight = v.toFixed(4);
      return li;
    });
    const list = make("ol", {className: "antecedents"}, ...items);
    Object.assign(list.dataset, {layer, head, position});
    const from = position === "deciding" ? "from the token before it" : "from the pronoun";
    return make("div", {}, make("b", {textContent: `L${layer} H${head} ${from}`}), list);
  }));
  const table = headTable("best-per-head", "top word", state.nLayer, state.nHead,
    (layer, head) => {
      const [[w, v] = [-1, 0]] = antecedents(layer, head, pronoun);
      return make("td", {title: `layer ${layer} head ${head}: ${v.toFixed(3)}`},
                  w >= 0 ? word(w) : "");
    },
    (layer, head) => heads.some(([l, h]) => l === layer && h === head));
  el.pronoun.replaceChildren(
    make("p", {}, `"${c.words[pronoun]}" (word ${pronoun}) looks at, summed over sub-word ` +
         "tokens (names in italics):"),
    make("div", {className: "lists"}, ...lists),
    make("p", {textContent: "Each head's most-attended earlier word from the pronoun (click to "
                            + "select the head):"}),
    table);
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

// The selected run's patching grid (layer x head) and, for the selected head, its effect at
// each position of the chosen pair's clean text. Another run's report is only named: its heads
// belong to the model that run probed.
function drawPatching() {
  const report = state.report;
  if (!report) {
    const elsewhere = state.patching.map((r) => `"${r.run}"`);
    el.patching.replaceChildren(...(elsewhere.length ? [make("p", {className: "hint",
      textContent: `Activation patching of run ${elsewhere.join(", ")}: pick one of its texts `
        + "to see it beside the attention."})] : []));
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
    make("p", {textContent: `Activation patching (run "${report.run}", `
      + `${report.pairs.length} pairs, ${report.n_skipped} skipped): the share of the name's `
      + "effect on the pronoun each head carries, patched at every position (hover: interval):"}),
    grid,
    make("label", {}, "pair ", el.pair),
    drawPatchingStrip());
}

// The effect of the selected head patched at one position at a time, over the pair's tokens.
function drawPatchingStrip() {
  const pair = state.pair;
  if (!pair) return make("p");
  if (state.head === "all") {
    return make("p", {className: "hint", textContent: "Pick one head to see its effect at each "
                                                      + "position."});
  }
  const effects = pair.effect[state.layer]?.[state.head];
  if (!effects) return make("p", {className: "hint",  // a report of another model's shape
    textContent: `The patching report has no layer ${state.layer} head ${state.head}.`});
  const tokens = pair.tokens.map((token, p) => {
    const v = effects[p], span = make("span", {className: "patch-token",
      textContent: token.replace(/\n/g, "⏎"),
      title: `${JSON.stringify(token)} (position ${p}): effect ${effectText(v)}`});
    Object.assign(span.dataset, {position: p, effect: effectText(v, 4)});
    span.style.backgroundColor = effectColour(v);
    span.classList.toggle("deciding", p === pair.position);
    return span;
  });
  return make("div", {id: "patch-strip"},
    make("p", {textContent: `L${state.layer} H${state.head} patched at one position at a time, `
      + `pair ${pair.pair} (${pair.source}): "${pair.pronoun}" vs "${pair.wrong_pronoun}", `
      + `margin ${pair.m_clean.toFixed(2)} clean, ${pair.m_counterfactual.toFixed(2)} `
      + "counterfactual; the deciding token is outlined:"}),
    make("div", {className: "patch-tokens"}, ...tokens));
}

function drawProbeGrids() {
  el.probes.replaceChildren(...state.probes.map((report) => {
    const grid = headTable("probe-grid", "", report.accuracy.length, report.accuracy[0].length,
      (layer, head) => {
        const accuracy = report.accuracy[layer][head];
        const cell = make("td", {textContent: accuracy === null ? "" : accuracy.toFixed(2)});
        if (accuracy !== null) cell.style.backgroundColor = `rgba(30, 120, 60, ${accuracy})`;
        return cell;
      },
      (layer, head) => state.layer === layer && state.head === head);
    return make("div", {className: "probe"},
      make("p", {textContent: `Probe accuracy per head (run "${report.run}", ` +
                              `${report.n} items); click a cell to select that head:`}),
      grid);
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

function selectHead(layer, head) {
  // a probe report of another model may name heads this text's model does not have
  if (layer >= state.nLayer || (head !== "all" && head >= state.nHead)) return;
  state.layer = layer;
  state.head = head;
  el.layer.value = String(layer);
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

function drawListing(problems) {
  const {texts, empty} = state.listing;
  problems.forEach((p) => showProblem(problemLine(p)));
  el.empty.textContent = empty || "";
  el.main.hidden = !texts.length;
  fillSelect(el.text, texts.map((t, i) => [i, `${t.run} · ${t.name}`]), 0);
}

// Load and draw one text; false (and a problem line saying why) when it cannot be drawn.
async function chooseText(index, step = null) {
  state.text = state.listing.texts[index];
  el.text.value = String(index);
  const steps = state.text.steps;
  const chosen = step === null ? steps[steps.length - 1] : steps.find((s) => s.step === step);
  fillSelect(el.step, steps.map((s) => [s.step, `step ${s.step}`]), chosen.step);
  state.report = state.patching.find((r) => r.run === state.text.run) || null;
  state.pair = null;
  try {
    await loadText(state.text.run, chosen.tag);
  } catch (error) {
    showProblem(error.message);
    return false;
  }
  if (state.report) {
    fillSelect(el.pair, state.report.pairs.map((p, i) => [i, `${i}: ${p.source}`]), 0);
    // tinylm-probe writes pair i's clean text as "patching/pair_<i>": show that pair beside it
    const match = /^patching\/pair_(\d+)$/.exec(state.text.name);
    const index = match && Number(match[1]) < state.report.pairs.length ? Number(match[1]) : 0;
    await loadPair(index);
  }
  return true;
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

export async function render() {
  const style = make("link", {rel: "stylesheet", href: "style.css"});
  document.head.append(style);
  const labelled = (text, input) => make("label", {}, text, input);
  Object.assign(el, {
    problems: make("div", {id: "problems"}), empty: make("p", {id: "empty"}),
    text: make("select", {id: "text-select"}), step: make("select", {id: "step-select"}),
    layer: make("select", {id: "layer-select"}), head: make("select", {id: "head-select"}),
    level: make("select", {id: "level-select"}),
    reverse: make("input", {id: "reverse", type: "checkbox"}),
    note: make("p", {id: "note"}), tokens: make("div", {id: "tokens"}),
    heads: make("div", {id: "heads"}), status: make("p", {id: "status"}),
    pronoun: make("div", {id: "pronoun"}), probes: make("div", {id: "probes"}),
    patching: make("div", {id: "patching"}), pair: make("select", {id: "pair-select"}),
  });
  fillSelect(el.level, [["word", "words"], ["token", "tokens"]], state.level);
  el.main = make("div", {id: "main"},
    make("div", {className: "controls"}, labelled("text ", el.text), labelled("step ", el.step),
         labelled("layer ", el.layer), labelled("head ", el.head),
         labelled("level ", el.level),
         labelled("", el.reverse), make("span", {textContent: " reverse: who looks at it"})),
    el.note, el.tokens, el.status, el.heads,
    make("div", {id: "grids"}, el.pronoun, el.patching), el.probes);
  document.body.append(make("h3", {textContent: "tinylm attention"}), el.problems, el.empty,
                       el.main);

  el.text.addEventListener("change", () => chooseText(Number(el.text.value)));
  el.step.addEventListener("change", () => chooseText(Number(el.text.value),
                                                      Number(el.step.value)));
  el.layer.addEventListener("change", () => selectHead(Number(el.layer.value), state.head));
  el.head.addEventListener("change", () => selectHead(
    state.layer, el.head.value === "all" ? "all" : Number(el.head.value)));
  el.level.addEventListener("change", () => { state.level = el.level.value; redraw(); });
  el.reverse.addEventListener("change", () => { state.reverse = el.reverse.checked; redraw(); });
  el.tokens.addEventListener("mouseover", onTokenEvent);
  el.tokens.addEventListener("click", onTokenEvent);
  el.pair.addEventListener("change", () => loadPair(Number(el.pair.value)));

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
  // the first text that can be drawn: a skipped one is named among the problems
  for (let i = 0; i < state.listing.texts.length && !(await chooseText(i)); i++);
  window.tinylmTiming.firstDrawMs = performance.now();
  document.body.dataset.ready = "true";  // for the browser test: the first draw is done
}
