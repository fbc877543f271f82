"""`evalkit report`: the AUC by hand, the report of the killed-and-resumed sweep (CSV, PNGs, HTML) opened
in headless Chromium with the network off, and hostile strings from run folders kept inert."""

import csv
import io
import json
import re
import shutil
from pathlib import Path

import plotly.offline
import pytest

from evalkit.policies import fraction_of
from evalkit.report.leaderboard import quality_auc
from evalkit.report.page import build_report
from test_sweep import BUDGETS, POLICIES, evalkit, run_folders, swept  # noqa: F401 (swept is a fixture)


# ---- the headline number ------------------------------------------------------------------------------------

def test_auc_is_the_mean_score_over_the_budget_range():
    # Trapezoids 0.25 -> 0.5 -> 1 (anchored at the full-cache score 1.0), over a width of 0.75.
    assert quality_auc([(0.5, 0.75), (0.25, 0.5)], 0.25, 1.0) == pytest.approx((0.25 * 0.625 + 0.5 * 0.875) / 0.75)
    # A run at budget 1 is used instead of the anchor.
    assert quality_auc([(0.25, 0.5), (1.0, 0.5)], 0.25, 1.0) == pytest.approx(0.5)
    assert quality_auc([(0.5, 0.8)], 0.25, 1.0) is None  # not run at the setting's lowest budget
    assert quality_auc([(0.25, 0.8)], 0.25, None) is None  # no point at budget 1 and no full cache
    assert quality_auc([], 1.0, 0.9) == pytest.approx(0.9)
    assert fraction_of(0.2, None) == 0.2
    assert fraction_of(100, 400.0) == 0.25
    assert fraction_of(1000, 400.0) == 1.0


# ---- the sweep's report -------------------------------------------------------------------------------------

@pytest.fixture
def sweep_report(swept, tmp_path_factory):
    output = tmp_path_factory.getbasetemp() / "sweep-report"
    if not (output / "index.html").exists():
        build_report(swept["out"], output)
    return swept["out"], output


@pytest.mark.model  # swept: a sweep on the default model
def test_report_of_the_sweep_has_every_run_its_numbers_and_plots(sweep_report):
    runs, output = sweep_report
    folders = run_folders(runs)
    metrics = {n: json.loads((f / "metrics.json").read_text()) for n, f in folders.items()}
    rows = list(csv.DictReader((output / "leaderboard.csv").open()))
    assert {r["run_id"] for r in rows} == set(folders)
    full = next(m for n, m in metrics.items() if "-full-" in n)["score"]
    for row in rows:
        m = metrics[row["run_id"]]
        assert float(row["score"]) == pytest.approx(m["score"])
        assert float(row["held_over_full"]) == pytest.approx(m["held_over_full"])
        assert float(row["held_over_ideal"]) == pytest.approx(m["held_over_ideal"]) and m["held_over_ideal"] >= 1
        assert float(row["decode_tokens_per_s"]) == pytest.approx(m["decode_tokens_per_s"])
        if full:
            assert float(row["relative_score"]) == pytest.approx(m["score"] / full)
        # Every score with its interval (metrics.json's: docs/statistics.md), and its paired tests.
        assert (float(row["ci_low"]), float(row["ci_high"])) == (m["ci_low"], m["ci_high"])
        assert m["n"] == m["samples"] and m["ci_method"] == "wilson"  # needles: found or not
        assert float(row["ci_low"]) <= m["score"] <= float(row["ci_high"])
        if "-full-" in row["run_id"]:
            assert row["significance"] == "" and row["p_vs_full"] == ""
        else:  # tested against the full cache (Holm-adjusted within its policy and budget)
            assert row["significance"] == "no difference found" or "(p = " in row["significance"]
            assert 0 < float(row["p_vs_full"]) <= 1
    for policy in POLICIES:  # AUC: trapezoids 0.1 -> 0.3 -> 0.5 -> (1, full cache), width 0.9
        mine = {float(r["budget"]): r for r in rows if r["policy"] == policy}
        s = [float(mine[b]["score"]) for b in BUDGETS]
        expected = (0.2 * (s[0] + s[1]) / 2 + 0.2 * (s[1] + s[2]) / 2 + 0.5 * (s[2] + full) / 2) / 0.9
        assert all(float(r["auc"]) == pytest.approx(expected) for r in mine.values())

    from matplotlib.image import imread

    pngs = sorted(output.glob("*.png"))
    assert [p.name.split("-1-")[0] for p in pngs] == ["memory-vs-quality", "quality-vs-budget"]
    for png in pngs:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        height, width, _ = imread(png).shape
        assert width > 400 and height > 200

    html = (output / "index.html").read_text()
    assert _fetched(html) == set()  # nothing to fetch: the page works offline
    # plotly.js and the page's script beside it, the same bytes at every regeneration; the page itself small
    assert 'src="plotly.min.js"' in html and 'src="report.js"' in html
    assert (output / "plotly.min.js").read_text() == plotly.offline.get_plotlyjs()
    assert len(html.encode()) < 100_000
    assert all(name in html for name in folders)
    # The answer's points: each policy's score over its full cache's, one task (its full cache >= a third)
    data = json.loads(re.search(r'id="answer-data">(.*?)</script>', html, re.S).group(1))
    assert {p["series"] for p in data["points"]} == set(POLICIES) and len(data["points"]) == 9
    for point in data["points"]:
        (row,) = [r for r in rows if r["series"] == point["series"] and float(r["budget"]) == point["budget"]]
        assert point["relative"] == pytest.approx(float(row["relative_score"]))
        assert point["error"] == pytest.approx((float(row["ci_high"]) - float(row["ci_low"])) / 2 / full)
        assert point["tasks"] == ["ruler:niah_single_2"] and point["mode"] == "question seen"


def _fetched(html: str) -> set[str]:
    """Addresses the page's elements would load (script src, link href, img src, ...), data: URIs aside."""
    from html.parser import HTMLParser

    found = set()

    class Parser(HTMLParser):  # script bodies are raw text to it: URLs inside plotly.js are not elements
        def handle_starttag(self, tag, attrs):
            for name, value in attrs:
                if name in ("src", "href") and value and not value.startswith("data:") and "://" in value:
                    found.add(value)

    Parser().feed(html)
    return found


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium through Selenium, with the browser's console log readable."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not (chromium and driver_path):
        pytest.skip("Chromium and chromedriver are not installed: `make test` installs Debian's chromium and "
                    "chromium-driver when apt-get is usable as root")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.execute_cdp_cmd("Network.enable", {})  # no network at all: the page must carry everything
    driver.execute_cdp_cmd("Network.emulateNetworkConditions", {"offline": True, "latency": 0,
                                                                "downloadThroughput": -1, "uploadThroughput": -1})
    yield driver
    driver.quit()


def _errors(driver) -> list:
    return [entry for entry in driver.get_log("browser") if entry["level"] in ("SEVERE", "WARNING")]


def _column(driver, heading: str) -> list[str]:
    return driver.execute_script(
        "var table = document.getElementById('leaderboard');"
        "var index = Array.prototype.findIndex.call(table.tHead.rows[0].cells,"
        "                                           c => c.textContent.trim() === arguments[0]);"
        "return Array.prototype.map.call(table.tBodies[0].rows, r => r.cells[index].dataset.value);", heading)


@pytest.mark.model  # swept: a sweep on the default model
def test_report_in_chromium_renders_plots_and_sorts(sweep_report, browser, tmp_path):
    from selenium.webdriver.common.by import By

    _, output = sweep_report
    browser.get((output / "index.html").as_uri())
    assert _errors(browser) == []
    # Plotly ran from the file beside the page: the answer drawn as SVG, one line per granularity of the scorer
    # with the most runs (each a scorer of its own here), then one line per scorer at head granularity.
    assert browser.execute_script("return document.querySelectorAll('#answer-plot .main-svg').length") >= 1
    traces = "return document.getElementById('answer-plot').data.map(t => t.name)"
    assert len(browser.execute_script(traces)) == 1
    browser.find_element(By.CSS_SELECTOR, "input[name=lines][value=scorer]").click()
    assert sorted(browser.execute_script(traces)) == sorted(POLICIES)  # all three at head granularity
    bars = browser.execute_script("return document.getElementById('answer-plot').data"
                                  ".map(trace => trace.error_y.array.length)")
    assert bars == [3, 3, 3]  # each point's error bar
    policies = "return Array.from(document.querySelectorAll('#policies tbody tr.series'), r => r.cells[0].textContent)"
    assert sorted(browser.execute_script(policies)) == sorted(POLICIES)
    browser.find_element(By.CSS_SELECTOR, "#policies tbody tr.series").click()  # its tasks
    assert "ruler:niah_single_2 (full cache" in browser.find_element(By.CSS_SELECTOR, "#policies tr.tasks").text
    # The run table's filters hide the other runs, and say how many are shown.
    assert len(browser.find_elements(By.CSS_SELECTOR, "#leaderboard tbody tr")) == 10
    browser.execute_script("var s = document.querySelector('select[data-filter=scorer]'); s.value = 'snapkv';"
                           "s.dispatchEvent(new Event('change'));")
    shown = "return Array.from(document.querySelectorAll('#leaderboard tbody tr'), r => !r.hidden)"
    assert browser.execute_script(shown).count(True) == 3
    assert browser.find_element(By.ID, "runs-shown").text == "3 of 10 runs shown"
    browser.execute_script("var s = document.querySelector('select[data-filter=scorer]'); s.value = '';"
                           "s.dispatchEvent(new Event('change'));")
    assert browser.execute_script(shown).count(True) == 10
    assert browser.execute_script("return document.body.scrollWidth <= window.innerWidth")  # no sideways scrolling

    # Intervals and significance marks are shown: a "95% CI" column (low–high), a "significant" column, and
    # each quality-vs-budget point's error bar.
    intervals = browser.execute_script(
        "var table = document.getElementById('leaderboard');"
        "var index = Array.prototype.findIndex.call(table.tHead.rows[0].cells, c => c.textContent.trim() === '95% CI');"
        "return Array.prototype.map.call(table.tBodies[0].rows, r => r.cells[index].textContent.trim());")
    assert len(intervals) == 10 and all(re.fullmatch(r"\d+\.\d–\d+\.\d", text) for text in intervals), intervals
    marks = browser.find_elements(By.XPATH, "//table[@id='leaderboard']//th[normalize-space()='significant']")
    assert len(marks) == 1
    shown = _column(browser, "significant")
    assert shown.count("") == 1  # the full cache is tested against nothing
    assert all(text == "no difference found" or "(p = " in text for text in shown if text)

    header = browser.find_element(By.XPATH, "//table[@id='leaderboard']//th[normalize-space()='score']")
    header.click()
    ascending = [float(v) for v in _column(browser, "score")]
    assert ascending == sorted(ascending) and header.get_attribute("aria-sort") == "ascending"
    header.click()
    descending = [float(v) for v in _column(browser, "score")]
    assert descending == sorted(ascending, reverse=True)
    browser.find_element(By.XPATH, "//table[@id='leaderboard']//th[normalize-space()='policy']").click()
    policies = _column(browser, "policy")
    assert policies == sorted(policies) and policies[0] == "full"
    browser.find_element(By.XPATH, "//table[@id='leaderboard']//th[normalize-space()='KV held MiB']").click()
    held = [float(v) for v in _column(browser, "KV held MiB")]
    assert held == sorted(held) and held[0] < held[-1]
    assert _errors(browser) == []

    screenshot = tmp_path / "report.png"
    assert browser.save_screenshot(str(screenshot))
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- hand-written run folders: hostile strings, heatmaps, runs that are not leaderboard runs ----------------

HOSTILE_POLICY = "<script>window.pwned = 1</script>"
HOSTILE_TASK = "<img src=x onerror=\"window.pwned = 2\">"
HOSTILE_PREDICTION = "</td></tr></table><script>window.pwned = 3</script>"


def _write_run(runs: Path, name: str, config: dict, metrics: dict, predictions: list[dict]) -> Path:
    folder = runs / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"config": config, "run_id": name}))
    (folder / "predictions.jsonl").write_text("".join(json.dumps(p) + "\n" for p in predictions))
    (folder / "metrics.json").write_text(json.dumps(metrics))
    return folder


def _metrics(score: float, held: float) -> dict:
    return {"samples": 1, "score": score, "held_over_full": held, "bytes_held": held * 2**22, "bytes_full": 2**22,
            "kept_tokens": 100 * held, "prompt_tokens": 100, "prefill_tokens_per_s": 500.0,
            "decode_tokens_per_s": 10.0}


@pytest.fixture
def hostile_runs(tmp_path) -> Path:
    from matplotlib.figure import Figure

    runs = tmp_path / "runs"
    base = {"task": HOSTILE_TASK, "length": 512, "samples": 1, "model": "m", "seed": 0}
    record = {"id": "<b>0</b>", "score": 0.0, "prediction": HOSTILE_PREDICTION, "references": ["\"x\" & <y>"]}
    _write_run(runs, "full", {**base, "policy": "full", "budget": 1.0}, _metrics(1.0, 1.0), [record])
    for budget, score in ((0.25, 0.5), (0.5, 0.75)):
        _write_run(runs, f"hostile-{budget}", {**base, "policy": HOSTILE_POLICY, "budget": budget},
                   _metrics(score, budget), [record])
    figure = Figure(figsize=(2, 2))
    figure.add_subplot().imshow([[0, 1], [1, 0]])
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    (runs / "hostile-0.25" / "heatmap.png").write_bytes(buffer.getvalue())
    _write_run(runs, "lm_eval-arc", {"task": "lm_eval:arc_easy", "policy": "h2o_head"},
               {"arc_easy/acc,none": 0.5}, [])
    (runs / "half-done").mkdir()  # a partial run: config and predictions, no metrics.json
    (runs / "half-done" / "config.json").write_text(json.dumps({"config": {**base, "policy": "x", "budget": 0.1}}))
    return runs


def test_hostile_strings_are_escaped_and_heatmaps_shown(hostile_runs, tmp_path):
    output = tmp_path / "report"
    written = build_report(hostile_runs, output)
    html = (output / "index.html").read_text()
    for payload in (HOSTILE_POLICY, HOSTILE_TASK, HOSTILE_PREDICTION, "<b>0</b>", "<y>"):
        assert payload not in html
    assert "&lt;script&gt;window.pwned = 1&lt;/script&gt;" in html  # shown, as text
    assert "&lt;/td&gt;&lt;/tr&gt;&lt;/table&gt;&lt;script&gt;window.pwned = 3" in html
    assert written.runs == 3 and written.heatmaps == 1
    assert any("lm_eval-arc" in reason for reason in written.skipped)
    heatmap = (hostile_runs / "hostile-0.25" / "heatmap.png").read_bytes()
    assert 'src="heatmap-hostile-0.25.png"' in html
    assert (output / "heatmap-hostile-0.25.png").read_bytes() == heatmap
    (row,) = [r for r in csv.DictReader((output / "leaderboard.csv").open()) if r["budget"] == "0.25"]
    assert row["policy"] == HOSTILE_POLICY and row["task"] == HOSTILE_TASK  # the CSV keeps the raw text
    assert float(row["auc"]) == pytest.approx((0.25 * 0.625 + 0.5 * 0.875) / 0.75)


@pytest.mark.slow  # Chromium starts
def test_hostile_page_runs_no_injected_script_in_chromium(hostile_runs, browser, tmp_path):
    build_report(hostile_runs, tmp_path / "report")
    browser.get((tmp_path / "report" / "index.html").as_uri())
    assert browser.execute_script("return typeof window.pwned") == "undefined"
    assert _errors(browser) == []
    assert browser.execute_script("return document.querySelectorAll('.js-plotly-plot').length") == 1
    text = browser.execute_script("return document.getElementById('leaderboard').innerText")
    assert HOSTILE_POLICY in text  # the name is displayed as the literal text it is
    assert HOSTILE_POLICY in browser.execute_script("return document.getElementById('policies').innerText")
    legend = browser.execute_script("return document.getElementById('answer-plot').innerText")
    assert "<script>" in legend  # plotly shows the name as text too
    assert browser.execute_script("return document.querySelector('figure img').naturalWidth") > 0  # heatmap decoded
    browser.save_screenshot(str(tmp_path / "hostile.png"))


@pytest.mark.parametrize("make, message", [
    (lambda root: root / "nowhere", "no results folder"),
    (lambda root: root, "no complete runs with a score under"),
])
def test_report_bad_input_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path, make, message):
    code, _, err = evalkit(monkeypatch, capsys, "report", str(make(tmp_path)), "-o", str(tmp_path / "out"))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_report_command_prints_where_it_wrote(monkeypatch, capsys, hostile_runs, tmp_path):
    code, out, _ = evalkit(monkeypatch, capsys, "report", str(hostile_runs), "-o", str(tmp_path / "r"))
    assert code == 0 and f"report: {tmp_path / 'r' / 'index.html'}\n" in out
    assert "3 runs, 2 plots, 1 heatmaps" in out and "left out: lm_eval-arc: no policy, budget and score" in out


def test_perplexity_runs_show_as_perplexity_and_rank_lowest_first(tmp_path):
    """A ppl run's score is a perplexity (metrics say higher_is_better: false): shown as is, best = lowest."""
    runs = tmp_path / "runs"
    base = {"task": "ppl", "length": 4096, "samples": 1, "model": "m", "seed": 0}

    def ppl_metrics(perplexity, held):
        return {**_metrics(perplexity, held), "metric": "perplexity", "higher_is_better": False}

    _write_run(runs, "full", {**base, "policy": "full", "budget": 1.0}, ppl_metrics(29.74, 1.0), [])
    _write_run(runs, "good", {**base, "policy": "snapkv", "budget": 0.1}, ppl_metrics(30.5, 0.1), [])
    _write_run(runs, "bad", {**base, "policy": "streaming_llm", "budget": 0.1}, ppl_metrics(31.2, 0.1), [])
    build_report(runs, tmp_path / "report")
    rows = list(csv.DictReader((tmp_path / "report" / "leaderboard.csv").open()))
    assert [r["policy"] for r in rows] == ["full", "snapkv", "streaming_llm"]
    html = (tmp_path / "report" / "index.html").read_text()
    assert ">30.50<" in html and ">3050.0<" not in html  # a perplexity, not a percentage
    assert "perplexity" in html


def test_runs_that_differ_only_in_block_size_get_a_quality_vs_block_size_plot(tmp_path):
    runs = tmp_path / "runs"
    base = {"task": "ruler:niah_single_2", "length": 2048, "samples": 1, "model": "m", "seed": 0, "query_aware": True}
    _write_run(runs, "full", {**base, "policy": "full", "budget": 1.0, "block_size": 16}, _metrics(1.0, 1.0), [])
    scores = {4: 0.9, 16: 0.6, 32: 0.3}
    for size, score in scores.items():
        for policy in ("h2o_head_page", "h2o_page"):
            _write_run(runs, f"{policy}-{size}", {**base, "policy": policy, "budget": 0.2, "block_size": size},
                       _metrics(score if policy == "h2o_head_page" else score / 2, 0.2), [])
    _write_run(runs, "h2o_head-16", {**base, "policy": "h2o_head", "budget": 0.2, "block_size": 16},
               _metrics(0.5, 0.2), [])  # one block size only: no line
    build_report(runs, tmp_path / "report")
    (png,) = (tmp_path / "report").glob("quality-vs-block-size-*.png")
    assert png.stat().st_size > 0
    html = (tmp_path / "report" / "index.html").read_text()
    assert f'src="{png.name}"' in html
    from evalkit.report.page import load_entries
    from evalkit.report.plots import block_size_lines

    lines = block_size_lines(load_entries([runs])[0])  # what the PNG draws
    assert sorted(lines) == ["h2o_head_page @ 0.2", "h2o_page @ 0.2"]  # h2o_head: one block size, no line
    line = lines["h2o_head_page @ 0.2"]
    assert [e.config["block_size"] for e in line] == [4, 16, 32] and [e.metrics["score"] for e in line] == [0.9, 0.6, 0.3]
    # Without a second block size there is no such plot.
    for size in (4, 32):
        for policy in ("h2o_head_page", "h2o_page"):
            shutil.rmtree(runs / f"{policy}-{size}")
    build_report(runs, tmp_path / "report")
    assert not list((tmp_path / "report").glob("quality-vs-block-size-*.png"))


@pytest.mark.slow  # six run folders written, the page and its PNGs drawn
def test_the_answer_averages_the_tasks_the_model_can_do_relative_to_their_full_cache(tmp_path):
    """Tasks whose full cache scores under a third are left out; a point is the mean relative score over the
    others, its error bar the mean's from the runs' intervals; a row counts its significant paired tests."""
    from evalkit.report.answer import answer_data, headline
    from evalkit.report.page import load_entries
    from evalkit.uncertainty import score_interval

    runs = tmp_path / "runs"
    passed = {  # (task, policy, budget) -> samples of 20 passed; full caches 100 %, 50 % and 20 %
        ("a", "full", 1.0): 20, ("b", "full", 1.0): 10, ("c", "full", 1.0): 4,
        ("a", "h2o_head_page", 0.2): 18, ("a", "h2o_head_page", 0.5): 20, ("a", "h2o_head", 0.2): 0,
        ("a", "h2o_head", 0.5): 0, ("b", "h2o_head_page", 0.2): 5, ("b", "h2o_head_page", 0.5): 5,
        ("b", "h2o_head", 0.2): 5, ("b", "h2o_head", 0.5): 5, ("c", "h2o_head_page", 0.2): 0, ("c", "h2o_head", 0.2): 4,
    }
    records = {}
    for (task, policy, budget), n in passed.items():
        records[task, policy, budget] = [{"id": f"s{i}", "score": float(i < n)} for i in range(20)]
        config = {"task": f"ruler:{task}", "length": 1024, "samples": 20, "model": "m", "seed": 0,
                  "query_aware": True, "policy": policy, "budget": budget}
        _write_run(runs, f"{task}-{policy}-{budget}", config, {**_metrics(n / 20, budget), "samples": 20},
                   records[task, policy, budget])
    data = answer_data(load_entries([runs])[0])

    def half_width(task, policy, budget):
        interval = score_interval(records[task, policy, budget])
        return (interval.ci_high - interval.ci_low) / 2

    points = {(p["series"], p["budget"]): p for p in data["points"]}
    assert len(points) == 4 and all(p["tasks"] == ["ruler:a", "ruler:b"] for p in points.values())  # not c
    page = points["h2o_head_page", 0.2]
    assert page["relative"] == pytest.approx((18 / 20 / 1.0 + 5 / 20 / 0.5) / 2)
    assert page["error"] == pytest.approx(
        ((half_width("a", "h2o_head_page", 0.2) / 1.0) ** 2 + (half_width("b", "h2o_head_page", 0.2) / 0.5) ** 2)
        ** 0.5 / 2)
    assert points["h2o_head", 0.5]["relative"] == pytest.approx((0 + 0.5) / 2)
    assert (page["model"], page["length"], page["mode"]) == ("m", 1024, "question seen")
    rows = {r["series"]: r for r in data["rows"]}
    assert rows["h2o_head_page"]["auc"] == pytest.approx(
        quality_auc([(0.2, page["relative"]), (0.5, points["h2o_head_page", 0.5]["relative"])], 0.2, 1.0))
    # 20 against 0 on task a at both budgets: two wins for per-head pages, two losses for per-head tokens
    assert (rows["h2o_head_page"]["wins"], rows["h2o_head_page"]["losses"]) == (2, 0)
    assert (rows["h2o_head"]["wins"], rows["h2o_head"]["losses"]) == (0, 2)
    assert [t["task"] for t in rows["h2o_head"]["tasks"]] == ["ruler:a", "ruler:b"]
    assert rows["h2o_head"]["tasks"][1] == {"task": "ruler:b", "full": 0.5, "relative": {"0.2": 0.5, "0.5": 0.5}}
    # The headline (README's figure): the granularities compared, a line each, over the scorers run at all of them
    _write_run(runs, "a-snapkv_head-0.2", {"task": "ruler:a", "length": 1024, "samples": 20, "model": "m", "seed": 0,
                                          "query_aware": True, "policy": "snapkv_head", "budget": 0.2},
               {**_metrics(0.0, 0.2), "samples": 20}, records["a", "h2o_head", 0.2])  # no per-head pages: not in it
    data = answer_data(load_entries([runs])[0])
    (view,) = headline(data).items()
    assert view[0] == ("m", 1024, "question seen") and view[1]["scorers"] == ["h2o"]
    assert view[1]["budgets"] == [0.2, 0.5]
    assert view[1]["lines"] == {"head": [points["h2o_head", b]["relative"] for b in (0.2, 0.5)],
                                "head_page": [points["h2o_head_page", b]["relative"] for b in (0.2, 0.5)]}
    build_report(runs, tmp_path / "report")
    assert (tmp_path / "report" / "headline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A variant of one policy (its own policy args) beside them leaves the runs made by default plain: the headline
    # stays, and the variant is a series of its own
    _write_run(runs, "a-h2o_head-0.2-normalized", {"task": "ruler:a", "length": 1024, "samples": 20, "model": "m",
                                                   "seed": 0, "query_aware": True, "policy": "h2o_head", "budget": 0.2,
                                                   "policy_args": {"normalize": "true"}},
               {**_metrics(0.0, 0.2), "samples": 20}, records["a", "h2o_head", 0.2])
    data = answer_data(load_entries([runs])[0])
    assert {p["series"] for p in data["points"] if p["plain"]} == {"h2o_head", "h2o_head_page", "snapkv_head"}
    assert 'h2o_head (policy_args={"normalize": "true"})' in {p["series"] for p in data["points"]}
    assert headline(data)[view[0]]["lines"] == view[1]["lines"]
    # KVzip run at both granularities stays out of the headline: its per-head tokens pool the budget over layers,
    # its per-head pages do not, so its two lines would differ in more than the unit
    for policy in ("kvzip_head", "kvzip_head_page"):
        for budget in (0.2, 0.5):
            _write_run(runs, f"a-{policy}-{budget}", {"task": "ruler:a", "length": 1024, "samples": 20, "model": "m",
                                                     "seed": 0, "query_aware": True, "policy": policy,
                                                     "budget": budget},
                       {**_metrics(0.5, budget), "samples": 20}, records["a", "h2o_head_page", 0.2])
    data = answer_data(load_entries([runs])[0])
    assert {p["scorer"] for p in data["points"] if p["plain"]} >= {"h2o", "kvzip"}
    assert headline(data)[view[0]]["scorers"] == ["h2o"]


# ---- several results folders --------------------------------------------------------------------------------

def _folder_of_runs(runs: Path, scores: dict[str, float]) -> Path:
    """Runs of one setting under `runs`: "full" is the full cache, any other name an h2o_head run at its budget
    (0.25 or 0.5 from the name's end)."""
    base = {"task": "ruler:niah_single_1", "length": 512, "samples": 1, "model": "m", "seed": 0}
    for name, score in scores.items():
        policy, budget = ("full", 1.0) if name == "full" else ("h2o_head", float(name.rsplit("-", 1)[1]))
        _write_run(runs, name, {**base, "policy": policy, "budget": budget}, _metrics(score, budget),
                   [{"id": "s0", "score": score, "prediction": f"answer of {name}", "references": ["x"]}])
    return runs


def _leaderboard(output: Path) -> dict[str, dict]:
    return {row["run_id"]: row for row in csv.DictReader((output / "leaderboard.csv").open())}


def test_runs_of_several_folders_are_read_together_and_each_folder_named(monkeypatch, capsys, tmp_path):
    first = _folder_of_runs(tmp_path / "grid", {"full": 1.0, "h2o-0.25": 0.5})
    second = _folder_of_runs(tmp_path / "study", {"h2o-0.5": 0.75})
    (second / "running").mkdir()  # a run still being written: config, no metrics.json
    (second / "running" / "config.json").write_text(json.dumps({"config": {"policy": "full", "budget": 1.0}}))
    code, out, _ = evalkit(monkeypatch, capsys, "report", str(first), str(second), "-o", str(tmp_path / "r"))
    assert code == 0 and "3 runs" in out
    assert f"left out: {second}: incomplete runs (no metrics.json yet): running" in out.splitlines()
    rows = _leaderboard(tmp_path / "r")
    assert set(rows) == {"full", "h2o-0.25", "h2o-0.5"}
    # One setting across the folders: the study's run is measured against the grid's full cache, on one curve.
    assert float(rows["h2o-0.5"]["relative_score"]) == pytest.approx(0.75)
    assert float(rows["h2o-0.5"]["auc"]) == pytest.approx((0.25 * 0.625 + 0.5 * 0.875) / 0.75)
    html = (tmp_path / "r" / "index.html").read_text()
    assert f"3 runs from <code>{first}</code>, <code>{second}</code>." in html
    assert f"<li>{second}: incomplete runs (no metrics.json yet): running</li>" in html
    assert re.findall(r'<th scope="col" class="headline">([^<]*)</th>', html) == ["AUC / full", "AUC"]  # policies, runs


def test_a_run_id_in_two_folders_is_shown_once_from_the_first_given(tmp_path):
    grid = _folder_of_runs(tmp_path / "grid", {"full": 1.0, "h2o-0.25": 0.5})
    copy = _folder_of_runs(tmp_path / "copy", {"h2o-0.25": 0.25})  # the same run id, another score
    written = build_report([grid, copy], tmp_path / "r")
    assert written.runs == 2 and float(_leaderboard(tmp_path / "r")["h2o-0.25"]["score"]) == 0.5
    assert written.skipped == [f"{copy / 'h2o-0.25'}: the same run id as {grid / 'h2o-0.25'}, which is shown"]
    html = (tmp_path / "r" / "index.html").read_text()
    assert html.count("answer of h2o-0.25") == 1 and html.count("(first 1 of 1)") == 2  # two runs

    written = build_report([copy, grid], tmp_path / "r")  # the order given decides
    assert float(_leaderboard(tmp_path / "r")["h2o-0.25"]["score"]) == 0.25
    assert written.skipped == [f"{grid / 'h2o-0.25'}: the same run id as {copy / 'h2o-0.25'}, which is shown"]

    # A folder named twice is read once: nothing is a duplicate.
    assert build_report([grid, tmp_path / "." / "grid"], tmp_path / "r").skipped == []


def test_a_run_unfinished_in_the_first_folder_is_shown_from_where_it_finished(tmp_path):
    grid = _folder_of_runs(tmp_path / "grid", {"full": 1.0, "h2o-0.25": 0.5})
    (grid / "h2o-0.25" / "metrics.json").unlink()  # stopped here, finished in the rerun below
    rerun = _folder_of_runs(tmp_path / "rerun", {"h2o-0.25": 0.75})
    written = build_report([grid, rerun], tmp_path / "r")
    assert float(_leaderboard(tmp_path / "r")["h2o-0.25"]["score"]) == 0.75
    assert written.skipped == [f"{grid}: incomplete runs (no metrics.json yet): h2o-0.25"]


def test_a_missing_folder_among_several_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path):
    grid = _folder_of_runs(tmp_path / "grid", {"full": 1.0})
    code, out, err = evalkit(monkeypatch, capsys, "report", str(grid), str(tmp_path / "nowhere"),
                             "-o", str(tmp_path / "out"))
    assert code == 2 and out == "" and err.strip() == f"error: no results folder {str(tmp_path / 'nowhere')!r}"
    assert not (tmp_path / "out").exists()
    monkeypatch.chdir(tmp_path)  # no folder given: ./runs, which is not there
    code, _, err = evalkit(monkeypatch, capsys, "report", "-o", "out")
    assert code == 2 and err.strip() == "error: no results folder 'runs'" and not (tmp_path / "out").exists()


# ---- the page's size ----------------------------------------------------------------------------------------

def test_past_50_runs_the_runs_share_a_thousand_predictions():
    from evalkit.report.page import predictions_per_run

    assert [predictions_per_run(runs) for runs in (1, 50, 66, 150, 333, 1000, 5000)] == [20, 20, 15, 6, 3, 1, 1]


def test_the_page_shows_each_runs_share_of_its_predictions(monkeypatch, tmp_path):
    from evalkit.report import page

    runs = tmp_path / "runs"
    base = {"task": "ruler:niah_single_1", "length": 512, "samples": 5, "model": "m", "seed": 0}
    records = [{"id": f"s{i}", "score": 1.0, "prediction": f"prediction {i}", "references": ["x"]} for i in range(5)]
    for name, policy, budget in (("full", "full", 1.0), ("h2o", "h2o_head", 0.5)):
        _write_run(runs, name, {**base, "policy": policy, "budget": budget}, {**_metrics(1.0, budget), "samples": 5},
                   records)
    monkeypatch.setattr(page, "_PREDICTIONS_ON_PAGE", 4)  # two runs share four: two each
    build_report(runs, tmp_path / "r")
    html = (tmp_path / "r" / "index.html").read_text()
    assert html.count("(first 2 of 5)") == 2
    assert "prediction 1<" in html and "prediction 2<" not in html


def test_answer_lengths_are_set_against_the_full_caches_on_the_same_samples(tmp_path):
    runs = tmp_path / "runs"
    base = {"task": "ruler:niah_single_2", "length": 2048, "samples": 3, "model": "m", "seed": 0, "query_aware": True}
    lengths = {"full": [10, 10, 40], "h2o_head": [20, 5, 7]}
    for policy, tokens in lengths.items():
        _write_run(runs, policy, {**base, "policy": policy, "budget": 1.0 if policy == "full" else 0.2},
                   _metrics(0.0, 0.2), [{"id": f"s{i}", "score": 0, "new_tokens": n} for i, n in enumerate(tokens)])
    # A sample the full cache never ran does not count against it.
    (runs / "h2o_head" / "predictions.jsonl").open("a").write(json.dumps({"id": "s9", "score": 0, "new_tokens": 99}) + "\n")
    build_report(runs, tmp_path / "report")
    row = _leaderboard(tmp_path / "report")["h2o_head"]
    assert float(row["new_tokens"]) == (20 + 5 + 7 + 99) / 4
    assert float(row["new_tokens_over_full"]) == (20 + 5 + 7) / (10 + 10 + 40)


def test_multiturn_runs_get_a_quality_by_turn_plot(tmp_path):
    runs = tmp_path / "runs"
    base = {"task": "ruler:multiturn_niah", "length": 2048, "samples": 1, "model": "m", "seed": 0, "query_aware": False}
    for policy, budget in (("full", 1.0), ("h2o_head", 0.2), ("h2o_head_page", 0.2)):
        by_turn = [{"turn": t, "score": 0.5, "ci_low": 0.1, "ci_high": 0.9, "held_over_full": budget} for t in (1, 2, 3)]
        _write_run(runs, policy, {**base, "policy": policy, "budget": budget}, {**_metrics(0.5, budget),
                                                                                "by_turn": by_turn}, [])
    build_report(runs, tmp_path / "report")
    (png,) = (tmp_path / "report").glob("quality-by-turn-*.png")
    assert png.stat().st_size > 0 and f'src="{png.name}"' in (tmp_path / "report" / "index.html").read_text()
    from evalkit.report.page import load_entries
    from evalkit.report.plots import turn_lines

    assert sorted(turn_lines(load_entries([runs])[0])) == ["h2o_head @ 0.2", "h2o_head_page @ 0.2"]
