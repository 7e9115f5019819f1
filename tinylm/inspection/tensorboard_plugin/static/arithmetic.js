// The arithmetic behind one attention weight: for a head and a query token, the explainer's steps
// on the model's own numbers (the plugin's /arithmetic route, arithmetic.py, recomputes them from
// the q, k and v the model's hook points held), laid out as the explainer's worked example:
// each earlier key's q·k, ÷√d, the mask, minus the row's max, exp, the sum, the weight; then the
// value terms weight·v it mixes; then the weight the model's own forward pass gave, beside it.
//
//     window.tinylmArithmetic.render(container, {run, tag, layer, head, query})
//
// (or {run, text, step, ...} in place of tag). Returns a promise that settles once drawn; a
// newer render into the same container wins over a slower older one. Plain script: loaded as
// <script src="arithmetic.js"> or imported for its effect (import "./arithmetic.js").

(() => {
  const ROWS_SHOWN = 12;  // a longer row shows its keys with the largest weights (and says so)
  const DIMS_SHOWN = 4;  // value dimensions drawn (the route sends up to 8)
  const answers = new Map();  // url -> the route's answer: a query revisited draws at once
  const latest = new WeakMap();  // container -> the url of its newest render

  const STYLE = `
  .arith { font-family: Roboto, sans-serif; font-size: 20px; color: #212121; max-width: 1300px; }
  .arith h4 { font-size: 24px; margin: 8px 0; }
  .arith p { margin: 6px 0; line-height: 1.4; }
  .arith .arith-note { color: #37474f; }
  .arith .arith-note b { color: #000; }
  .arith table { border-collapse: collapse; margin: 8px 0 14px; }
  .arith th, .arith td { border: 1px solid #bdbdbd; padding: 4px 10px; font-size: 20px; }
  .arith th { background: #eceff1; font-weight: 600; text-align: center; }
  .arith td { text-align: right; font-family: "Roboto Mono", monospace; cursor: default; }
  .arith td.arith-token { text-align: left; font-family: "Roboto Mono", monospace;
    white-space: pre; }
  .arith td.arith-masked { color: #9e9e9e; font-style: italic; }
  .arith tr.arith-top td { font-weight: bold; background: #fff8e1; }
  .arith tr.arith-sum td { border-top: 3px double #616161; font-weight: bold; }
  .arith .arith-check { font-size: 22px; padding: 6px 10px; background: #e8f5e9;
    border-left: 6px solid #2e7d32; }
  .arith .arith-check.arith-off { background: #ffebee; border-left-color: #c62828; }
  .arith .arith-problem { color: #b71c1c; }
  .arith button { font-size: 18px; }`;

  function make(tag, props = {}, ...children) {
    const node = Object.assign(document.createElement(tag), props);
    node.append(...children);
    return node;
  }

  function addStyle() {
    if (document.getElementById("tinylm-arithmetic-style")) return;
    document.head.append(make("style", {id: "tinylm-arithmetic-style", textContent: STYLE}));
  }

  // A number as the explainer writes it: 4 decimals; tiny ones (exp of a far score) in e-notation.
  function num(x, digits = 4) {
    if (x === null || x === undefined) return "–";
    if (x !== 0 && Math.abs(x) < 10 ** -digits) return x.toExponential(1);
    const text = x.toFixed(digits);
    return Number(text) === 0 ? text.replace("-", "") : text;
  }

  // A difference: "3.0e-8", or "0" when the two are the same float.
  function diff(x) {
    return x === null ? "undefined (the numbers overflow)" : x === 0 ? "0" : x.toExponential(1);
  }

  function tokenText(token) {
    return JSON.stringify(token).slice(1, -1);  // "\n" shown as \n, quotes escaped
  }

  function keyLabel(row, query) {
    return row.j === query ? `${row.j} (itself)` : String(row.j);
  }

  function url({run, tag, text, step, layer, head, query}) {
    const args = tag !== undefined ? {run, tag} : {run, text, step};
    return "arithmetic?" + new URLSearchParams({...args, layer, head, query}).toString();
  }

  async function fetchAnswer(address) {
    if (answers.has(address)) return answers.get(address);
    const response = await fetch(address);
    const answer = await response.json().catch(() => ({error: `HTTP ${response.status}`}));
    if (response.ok && !answer.problem) answers.set(address, answer);
    return answer;
  }

  // What the layer does otherwise than the explainer's plain causal head, in words.
  function notes(a) {
    const said = [];
    if (a.scale_said) said.push(["Scale", a.scale_said]);
    if (a.rotary) {
      said.push(["Positions", "q and k rotated by position (rotary): the q·k column dots the "
        + "rotated vectors, as the model's hook points hold them"]);
    }
    if (a.kv_shared_by) {
      said.push(["Grouped-query attention", `key/value head ${a.kv_head}, shared by heads `
        + `${a.kv_shared_by[0]}-${a.kv_shared_by[1]}: their k and v are the same`]);
    }
    if (a.window !== null) {
      said.push(["Local layer", `each token sees only the last ${a.window} positions; `
        + `${a.masked_keys ? `the ${a.masked_keys} earlier key${a.masked_keys > 1 ? "s are" : " is"}`
          + " masked too" : "no key of this query is that far back"}`]);
    }
    if (a.dtype !== "float32") {
      said.push(["Precision", `the model computed q, k and v in ${a.dtype}; this page `
        + "recomputes in float32, so the two weights differ in the later digits"]);
    }
    return said;
  }

  // The keys drawn: every earlier key, or the ROWS_SHOWN with the largest weights, in order.
  function shownKeys(a, all) {
    if (all || a.keys.length <= ROWS_SHOWN + 2) return a.keys;
    const best = [...a.keys].sort((x, y) => (y.weight ?? 0) - (x.weight ?? 0))
      .slice(0, ROWS_SHOWN).map((row) => row.j);
    const chosen = new Set(best);
    return a.keys.filter((row) => chosen.has(row.j));
  }

  function draw(container, a, options, all = false) {
    const top = a.keys.reduce((best, row) => ((row.weight ?? -1) > (best.weight ?? -1)
      ? row : best), a.keys[0]);
    const scaleHead = a.scale_said
      ? `×${Number.isInteger(a.scale) ? a.scale.toFixed(1) : a.scale}` : `÷√${a.head_size}`;
    const columns = [
      ["key", "the key's position"], ["token", "the key's token"],
      ["q·k", "how well the query matches this key: the dot product of their "
        + `${a.head_size} numbers`],
      [scaleHead, `the score ${a.scale_step}`],
      ["masked", "the mask: a hidden key is set to −∞ (weight 0)"],
      ["−max", `minus the row's largest score (${num(a.row_max)}), so no exp() overflows`],
      ["exp", "e to the power of the column before"],
      ["weight", "exp ÷ the sum of the exps: the attention weight"],
    ];
    const shown = shownKeys(a, all);
    const rows = shown.map((row) => {
      const masked = row.masked === "masked";
      const tr = make("tr", {className: row.j === top.j ? "arith-top" : ""},
        make("td", {textContent: keyLabel(row, a.query)}),
        make("td", {className: "arith-token", textContent: tokenText(row.token)}),
        make("td", {textContent: num(row.qk)}),
        make("td", {textContent: num(row.scaled)}),
        make("td", {className: masked ? "arith-masked" : "",
                    textContent: masked ? "masked" : num(row.masked)}),
        make("td", {className: masked ? "arith-masked" : "",
                    textContent: masked ? "−∞" : num(row.shifted)}),
        make("td", {textContent: num(row.exp)}),
        make("td", {textContent: num(row.weight),
                    title: `the model's own weight: ${row.model_weight}`}));
      Object.assign(tr.dataset, {j: row.j, weight: row.weight, modelWeight: row.model_weight});
      return tr;
    });
    const sum = make("tr", {className: "arith-sum"},
      make("td", {textContent: "sum"}), make("td"), make("td"), make("td"), make("td"),
      make("td"), make("td", {textContent: num(a.exp_sum)}),
      make("td", {textContent: num(a.weight_sum)}));
    const steps = make("table", {className: "arith-steps"},
      make("tr", {}, ...columns.map(([name, title]) => make("th", {textContent: name, title}))),
      ...rows, sum);

    const lines = [];
    if (shown.length < a.keys.length) {
      const rest = a.keys.filter((row) => !shown.includes(row));
      const carry = rest.reduce((s, row) => s + (row.weight ?? 0), 0);
      const more = make("button", {textContent: `show all ${a.keys.length} keys`});
      more.addEventListener("click", () => draw(container, a, options, true));
      lines.push(make("p", {className: "arith-note"}, `The ${shown.length} of ${a.keys.length} `
        + `keys with the largest weights; the other ${rest.length} carry ${num(carry)} `
        + "together. ", more));
    }
    if (a.later_hidden) {
      lines.push(make("p", {className: "arith-note", textContent: `The ${a.later_hidden} later `
        + `token${a.later_hidden > 1 ? "s are" : " is"} hidden by the causal mask: weight 0.`}));
    }
    if (a.row_max !== 0 && a.row_max !== null) {
      lines.push(make("p", {className: "arith-note", textContent: "Without subtracting the max "
        + "(as the explainer's example does) each exp, and their sum, would be multiplied by "
        + `e^${num(a.row_max)} = ${num(Math.exp(a.row_max))}: the weights are the same.`}));
    }

    const off = a.max_difference === null || a.max_difference > 1e-4;
    const check = make("p", {className: `arith-check${off ? " arith-off" : ""}`},
      `The model's own weight for ${JSON.stringify(top.token)}: ${num(top.model_weight)}; `
      + `recomputed here: ${num(top.weight)} (difference `
      + `${diff(top.weight === null || top.model_weight === null ? null
        : Math.abs(top.weight - top.model_weight))}). `
      + `Over all ${a.keys.length} keys the largest difference is ${diff(a.max_difference)}.`);
    check.id = "arith-check";
    Object.assign(check.dataset, {modelWeight: top.model_weight, weight: top.weight,
                                  maxDifference: a.max_difference});

    const dims = Math.min(options.dims || DIMS_SHOWN, a.value_dims);
    const dimCols = Array.from({length: dims}, (_, d) => d);
    const valueRows = shown.map((row) => make("tr", {className: row.j === top.j ? "arith-top" : ""},
      make("td", {textContent: keyLabel(row, a.query)}),
      make("td", {className: "arith-token", textContent: tokenText(row.token)}),
      make("td", {textContent: num(row.weight)}),
      ...dimCols.map((d) => make("td", {textContent: num(row.value[d], 3)})),
      ...dimCols.map((d) => make("td", {textContent: num(row.term[d]),
        title: `${num(row.weight)} × ${num(row.value[d], 3)}`}))));
    const values = make("table", {className: "arith-values"},
      make("tr", {}, make("th", {textContent: "key"}), make("th", {textContent: "token"}),
        make("th", {textContent: "weight"}),
        ...dimCols.map((d) => make("th", {textContent: `v[${d}]`})),
        ...dimCols.map((d) => make("th", {textContent: `weight·v[${d}]`}))),
      ...valueRows,
      make("tr", {className: "arith-sum"}, make("td", {textContent: "output"}), make("td"),
        make("td"), ...dimCols.map(() => make("td")),
        ...dimCols.map((d) => make("td", {textContent: num(a.output[d])}))));

    const head = `layer ${a.layer}, head ${a.head}`;
    container.replaceChildren(make("div", {className: "arith"},
      make("h4", {textContent: `The arithmetic behind one weight: ${head}, query `
        + `${JSON.stringify(a.query_token)} (token ${a.query})`}),
      make("p", {textContent: "The explainer's steps on this model's own numbers: the query's "
        + `q dotted with each earlier key's k, ${a.scale_step}, the mask, minus the row's `
        + "max, exp, and each exp divided by their sum."}),
      ...notes(a).map(([what, text]) => make("p", {className: "arith-note"},
        make("b", {textContent: `${what}: `}), text)),
      steps, ...lines, check,
      make("p", {textContent: `The values it mixes: the output is the sum of weight × v over the `
        + `keys (the first ${dims} of v's ${a.head_size} numbers):`}),
      values));
  }

  async function render(container, options) {
    addStyle();
    const address = url(options);
    latest.set(container, address);
    let answer;
    try {
      answer = await fetchAnswer(address);
    } catch (error) {
      answer = {error: error.message};
    }
    if (latest.get(container) !== address) return;  // a newer query was asked for meanwhile
    const trouble = answer.error || (answer.problem && answer.problem.message);
    if (trouble) {
      container.replaceChildren(make("div", {className: "arith"},
        make("p", {className: "arith-problem",
                   textContent: `The arithmetic of this weight cannot be shown: ${trouble}`})));
      return;
    }
    draw(container, answer, options);
  }

  window.tinylmArithmetic = {render};
})();
