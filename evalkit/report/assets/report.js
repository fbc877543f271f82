// evalkit report: the answer plot and the policies table drawn from the page's JSON (#answer-data), the run
// table's filters, sorting by column. Plain JavaScript, no network: the page works from file://.
// Text from run folders is set as textContent, and escaped for plotly (which reads a subset of HTML).
"use strict";

var DATA = JSON.parse(document.getElementById("answer-data").textContent);

function escapeForPlotly(text) {
  return String(text).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
}

function unique(values) {
  return values.filter(function (v, i) { return values.indexOf(v) === i; });
}

function fillSelect(select, values, keep) {
  var previous = keep ? select.value : null;
  while (select.options.length) { select.remove(0); }
  values.forEach(function (v) { select.add(new Option(v, v)); });
  if (previous !== null && values.indexOf(previous) >= 0) { select.value = previous; }
}

function viewName(item) { return item.model + " · " + item.length + " tokens · " + item.mode; }

function percent(value) { return value === null || value === undefined ? "—" : (100 * value).toFixed(1); }

// ---- the answer: one plot, one table --------------------------------------------------------------------

var viewSelect = document.getElementById("view");
var scorerSelect = document.getElementById("scorer");
var granularitySelect = document.getElementById("granularity");

function inView() {
  return DATA.points.filter(function (p) { return viewName(p) === viewSelect.value; });
}

function linesMode() {
  return document.querySelector("input[name=lines]:checked").value;
}

function drawAnswer() {
  var points = inView();
  fillSelect(scorerSelect, unique(points.map(function (p) { return p.scorer; })).sort(), true);
  fillSelect(granularitySelect, unique(points.map(function (p) { return p.granularity; })).sort(), true);
  var byGranularity = linesMode() === "granularity";
  var shown = points.filter(function (p) {
    return byGranularity ? p.scorer === scorerSelect.value : p.granularity === granularitySelect.value;
  });
  var traces = unique(shown.map(function (p) { return p.series; })).map(function (series) {
    var line = shown.filter(function (p) { return p.series === series; })
      .sort(function (a, b) { return a.x - b.x; });
    return {
      x: line.map(function (p) { return p.x; }), y: line.map(function (p) { return 100 * p.relative; }),
      error_y: {type: "data", array: line.map(function (p) { return p.error === null ? 0 : 100 * p.error; }),
                thickness: 1},
      mode: "lines+markers", name: escapeForPlotly(series),
      customdata: line.map(function (p) { return [p.budget, p.tasks.length, escapeForPlotly(p.tasks.join(", "))]; }),
      hovertemplate: "budget %{customdata[0]}<br>%{y:.1f} % of the full cache<br>%{customdata[1]} tasks: " +
                     "%{customdata[2]}<extra>" + escapeForPlotly(series) + "</extra>"
    };
  });
  var title = viewSelect.value + (byGranularity ? " — " + scorerSelect.value + " by granularity"
                                                 : " — scorers at " + granularitySelect.value);
  Plotly.react("answer-plot", traces, {
    title: {text: escapeForPlotly(title), font: {size: 14}}, template: "plotly_white",
    xaxis: {title: {text: "budget (fraction of the prompt kept)"},
            range: [0, 1.1 * Math.max.apply(null, shown.map(function (p) { return p.x; }).concat([0.1]))]},
    yaxis: {title: {text: "score / full cache (%)"}, rangemode: "tozero"},
    shapes: [{type: "line", xref: "paper", x0: 0, x1: 1, y0: 100, y1: 100, line: {dash: "dash", color: "gray"}}],
    margin: {t: 50}, legend: {font: {size: 11}}
  }, {responsive: true});
  fillPolicies();
}

function cell(row, text, value, className) {
  var td = row.insertCell();
  td.textContent = text;
  td.dataset.value = value === null || value === undefined ? "" : String(value);
  if (className) { td.className = className; }
  return td;
}

function fillPolicies() {
  var body = document.querySelector("#policies tbody");
  while (body.rows.length) { body.deleteRow(0); }
  var rows = DATA.rows.filter(function (r) { return viewName(r) === viewSelect.value; })
    .sort(function (a, b) { return (b.auc === null ? -1 : b.auc) - (a.auc === null ? -1 : a.auc); });
  rows.forEach(function (r) {
    var tr = body.insertRow();
    tr.className = "series";
    var budgets = Object.keys(r.budgets).sort(function (a, b) { return Number(a) - Number(b); });
    cell(tr, r.series, r.series, "text");
    cell(tr, r.scorer, r.scorer, "text");
    cell(tr, r.granularity, r.granularity, "text");
    cell(tr, String(r.tasks.length), r.tasks.length);
    cell(tr, percent(r.auc), r.auc, "headline");
    cell(tr, budgets.map(function (b) { return b + ": " + percent(r.budgets[b].relative); }).join(" · "),
         r.budgets[budgets[0]].relative, "wrap");
    cell(tr, budgets.map(function (b) { return b + ": " + percent(r.budgets[b].held_over_full); }).join(" · "),
         r.budgets[budgets[0]].held_over_full, "wrap");
    cell(tr, String(r.wins), r.wins);
    cell(tr, String(r.losses), r.losses);
    tr.addEventListener("click", function () { toggleTasks(tr, r, budgets); });
  });
}

function toggleTasks(tr, r, budgets) {
  var next = tr.nextElementSibling;
  if (next && next.classList.contains("tasks")) { next.remove(); return; }
  var details = tr.parentNode.insertRow(tr.sectionRowIndex + 1);
  details.className = "tasks";
  var td = details.insertCell();
  td.colSpan = tr.cells.length;
  td.textContent = r.tasks.map(function (t) {
    return t.task + " (full cache " + percent(t.full) + " %): " + budgets.map(function (b) {
      return b + ": " + (b in t.relative ? percent(t.relative[b]) : "—");
    }).join(", ");
  }).join("\n");
  td.style.whiteSpace = "pre-line";
}

// Opens on the view, and in it the scorer and granularity, with the most runs behind their points.
function mostRuns(points, key) {
  var runs = {};
  points.forEach(function (p) { runs[key(p)] = (runs[key(p)] || 0) + p.tasks.length; });
  return Object.keys(runs).sort(function (a, b) { return runs[b] - runs[a] || a.localeCompare(b); })[0];
}
var views = unique(DATA.points.map(viewName));
fillSelect(viewSelect, views, false);
if (views.length) {
  viewSelect.value = mostRuns(DATA.points, viewName);
  var opening = inView();
  fillSelect(scorerSelect, [mostRuns(opening, function (p) { return p.scorer; })], false);
  fillSelect(granularitySelect, [mostRuns(opening, function (p) { return p.granularity; })], false);
}
[viewSelect, scorerSelect, granularitySelect].forEach(function (s) { s.addEventListener("change", drawAnswer); });
document.querySelectorAll("input[name=lines]").forEach(function (r) { r.addEventListener("change", drawAnswer); });
if (views.length) { drawAnswer(); } else {
  document.getElementById("answer-plot").textContent = "No policy run on a task its model can do: nothing to average.";
}

// ---- all runs: filters ------------------------------------------------------------------------------------

var runRows = Array.prototype.slice.call(document.querySelectorAll("#leaderboard tbody tr"));
var filters = Array.prototype.slice.call(document.querySelectorAll("#run-filters select"));

function filterRuns() {
  var shown = 0;
  runRows.forEach(function (row) {
    var match = filters.every(function (f) { return !f.value || row.dataset[f.dataset.filter] === f.value; });
    row.hidden = !match;
    shown += match;
  });
  document.getElementById("runs-shown").textContent = shown + " of " + runRows.length + " runs shown";
}

filters.forEach(function (select) {
  var name = select.dataset.filter;
  unique(runRows.map(function (row) { return row.dataset[name]; })).sort().forEach(function (v) {
    select.add(new Option(v, v));
  });
  select.addEventListener("change", filterRuns);
});
filterRuns();

// ---- sorting: numbers (data-value) numerically, text alphabetically, missing values last; again reverses ----

document.querySelectorAll("table.sortable").forEach(function (table) {
  var headings = table.tHead.rows[0].cells;
  Array.prototype.forEach.call(headings, function (heading, column) {
    heading.addEventListener("click", function () {
      var ascending = heading.getAttribute("aria-sort") !== "ascending";
      Array.prototype.forEach.call(headings, function (h) { h.removeAttribute("aria-sort"); });
      heading.setAttribute("aria-sort", ascending ? "ascending" : "descending");
      var body = table.tBodies[0];
      Array.prototype.slice.call(body.querySelectorAll("tr.tasks")).forEach(function (r) { r.remove(); });
      var rows = Array.prototype.slice.call(body.rows);
      rows.sort(function (a, b) {
        var x = a.cells[column].dataset.value, y = b.cells[column].dataset.value;
        if (x === "" || y === "") { return (x === "") - (y === ""); }
        var nx = Number(x), ny = Number(y);
        var order = (isNaN(nx) || isNaN(ny)) ? x.localeCompare(y) : nx - ny;
        return ascending ? order : -order;
      });
      rows.forEach(function (row) { body.appendChild(row); });
    });
  });
});
