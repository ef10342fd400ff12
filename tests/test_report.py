"""report.html (``qcg eval``, ``qcg report``) and ``qcg query --trace --html`` in a real browser: headless
Chromium (Debian's, driven by Selenium through chromedriver) loads each page from disk, and the rows its
filters and drill-down show are checked against the run's own files. The index is a real one (sentence
nodes of the bundled LiHuaWorld sample, MiniLM, faiss), so no LLM is loaded."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from qcg_gpu.cli import main
from qcg_gpu.errors import QCGError
from qcg_gpu.eval.report import write_html
from qcg_gpu.index_format import load_table

from .conftest import REPO, SAMPLE_DOCS

SAMPLE = REPO / "examples" / "lihuaworld_sample"
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A sentence-node index of the sample's 26 chat logs and a retrieval-only qcg eval of its questions."""
    root = tmp_path_factory.mktemp("report")
    assert main(["index", "build", str(SAMPLE_DOCS), str(root / "index"), "--nodes", "sentence", "--quiet"]) == 0
    args = ["eval", "--dataset", "lihuaworld", "--data", str(SAMPLE), "--index", str(root / "index")]
    args += ["--out", str(root / "eval"), "--no-answers", "--methods", "naive,qcg", "--sweeps", "hops"]
    assert main([*args, "--gamma", "1.2", "--quiet"]) == 0
    return root / "eval"


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        if os.environ.get("QCG_BROWSER_TESTS") == "required":  # scripts/test.sh installed them: a miss is a failure
            pytest.fail("headless Chromium is missing: apt-get install chromium chromium-driver")
        pytest.skip("headless Chromium is not installed (scripts/test.sh installs chromium and chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"):
        options.add_argument(flag)
    for flag in ("--disable-background-networking", "--disable-component-update", "--disable-sync"):
        options.add_argument(flag)  # nothing outside this machine is reachable: ask for nothing
    options.add_argument("--window-size=1400,1000")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()


def open_page(browser, path: Path):
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get_log("browser")  # drop the messages of earlier pages
    browser.get(path.resolve().as_uri())
    WebDriverWait(browser, 20).until(lambda b: b.find_element("id", "f-count").text)  # the data is unpacked
    return browser


def shown_rows(browser) -> list[str]:
    return [row.get_attribute("data-qid") for row in browser.find_elements("css selector", "#questions tbody tr")]


def choose(browser, select_id: str, value: str) -> None:
    from selenium.webdriver.support.ui import Select

    Select(browser.find_element("id", select_id)).select_by_value(value)


def console_errors(browser) -> list[dict]:
    return [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]


def records_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "results.jsonl").read_text().splitlines()]


def test_the_eval_page_filters_and_drills_down_to_the_run_s_own_rows(run_dir, browser, tmp_path):
    page = open_page(browser, run_dir / "report.html")
    assert page.save_screenshot(str(tmp_path / "report.png")) and (tmp_path / "report.png").stat().st_size > 10_000
    text = page.find_element("tag name", "body").text
    assert "Evidence recall, R@5" in text and "Differences from naive" in text and "Sweep: hops" in text
    records = records_of(run_dir)
    hit = {(r["method"], r["qid"]): r["Success@5"] for r in records if r["evidence"]}
    qids = list(dict.fromkeys(r["qid"] for r in records))
    assert shown_rows(page) == qids

    page.find_element("id", "f-preset").click()  # QCG missed, naive hit
    assert shown_rows(page) == [q for q in qids if hit.get(("qcg", q)) == 0 and hit.get(("naive", q)) == 1]
    choose(page, "f-a-result", "hit")  # QCG hit, naive hit
    assert shown_rows(page) == [q for q in qids if hit.get(("qcg", q)) == 1 and hit.get(("naive", q)) == 1]
    choose(page, "f-a-result", "")
    choose(page, "f-b-result", "")
    first_type = records[0]["type"]
    choose(page, "f-type", first_type)
    assert shown_rows(page) == [q for q in qids if next(r["type"] for r in records if r["qid"] == q) == first_type]
    choose(page, "f-type", "")
    page.find_element("css selector", "#questions th[data-sort='id']").click()  # sorted by id, then reversed
    assert shown_rows(page) == sorted(qids, key=int)
    page.find_element("css selector", "#questions th[data-sort='id']").click()
    assert shown_rows(page) == sorted(qids, key=int, reverse=True)
    page.find_element("css selector", "#questions th[data-sort='qcg']").click()  # QCG's hits first
    assert [hit[("qcg", q)] for q in shown_rows(page)] == sorted((hit[("qcg", q)] for q in qids), reverse=True)

    qid = qids[0]
    page.find_element("css selector", f"#questions tbody tr[data-qid='{qid}']").click()
    mine = {r["method"]: r for r in records if r["qid"] == qid}
    texts = load_table(run_dir.parent / "index", "chunks").column("text").to_pylist()
    for method, record in mine.items():
        panel = page.find_element("css selector", f".method[data-method='{method}']")
        items = panel.find_elements("css selector", "details.chunk")
        assert [int(i.get_attribute("data-chunk")) for i in items] == record["chunk_ids"]
        evidence = [d in record["evidence"] for d in record["docs"]]
        assert ["evidence" in i.get_attribute("class") for i in items] == evidence
        items[0].find_element("tag name", "summary").click()  # the chunk's text, on demand
        assert items[0].find_element("tag name", "pre").text.split() == texts[record["chunk_ids"][0]].split()
    trace = json.loads(next(line for line in (run_dir / "traces.jsonl").open() if json.loads(line)["qid"] == qid))
    tables = page.find_elements("css selector", ".trace table")
    assert len(tables) == 2 + len(trace["hops"])  # seeds, each hop, the chunks
    assert len(tables[0].find_elements("css selector", "tr")) == 1 + len(trace["seeds"])
    circles = page.find_elements("css selector", "svg.graph circle")
    chunks_drawn = min(len(trace["chunks"]), 5)
    assert len(circles) == 1 + len(trace["seeds"]) + sum(len(hop) for hop in trace["hops"]) + chunks_drawn
    assert console_errors(page) == []


def test_qcg_report_rebuilds_the_same_page_and_refuses_what_it_cannot_read(run_dir, tmp_path, cli):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (copy / "report.html").unlink()
    result = cli("report", copy)
    assert result.returncode == 0, result.stderr
    assert (copy / "report.html").read_bytes() == (run_dir / "report.html").read_bytes()

    broken = tmp_path / "broken"
    shutil.copytree(run_dir, broken)
    (broken / "report.html").unlink()
    lines = (broken / "results.jsonl").read_text().splitlines()
    (broken / "results.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])
    result = cli("report", broken)
    assert result.returncode == 2 and f"results.jsonl:{len(lines)}: not a JSON record" in result.stderr
    # edited files: each was a KeyError traceback
    (broken / "results.jsonl").write_text("\n".join([*lines[:-1], json.dumps({"qid": "1"})]))
    assert f"results.jsonl:{len(lines)}: no type, method, evidence," in cli("report", broken).stderr
    (broken / "results.jsonl").write_text("\n".join([*lines[:-1], "3"]))
    assert f"results.jsonl:{len(lines)}: not a JSON object" in cli("report", broken).stderr
    (broken / "results.jsonl").write_text("\n".join(lines))
    run = json.loads((broken / "run.json").read_text())
    (broken / "run.json").write_text(json.dumps({k: v for k, v in run.items() if k != "types"}))
    assert "run.json: no types, which qcg eval writes: an edited file?" in cli("report", broken).stderr
    (broken / "run.json").write_text(json.dumps(run))
    (broken / "traces.jsonl").write_text('{"seeds": []}\n')
    assert "traces.jsonl:1: no qid" in cli("report", broken).stderr
    (broken / "run.json").write_text('{"format": 1, "head')
    assert "run.json: not JSON" in cli("report", broken).stderr
    (broken / "run.json").unlink()
    assert "written by a qcg eval older than report.html" in cli("report", broken).stderr
    (broken / "results.jsonl").unlink()
    assert "no results.jsonl (is it a qcg eval --out folder?)" in cli("report", broken).stderr
    assert sorted(p.name for p in broken.iterdir() if "report" in p.name) == []  # no page, no half of one
    with pytest.raises(QCGError, match="cannot be read"):  # the index run.json names is gone
        shutil.copytree(run_dir, tmp_path / "moved")
        run = json.loads((tmp_path / "moved" / "run.json").read_text())
        (tmp_path / "moved" / "run.json").write_text(json.dumps({**run, "index": str(tmp_path / "nowhere")}))
        write_html(tmp_path / "moved")


def test_a_question_without_a_trace_says_so(run_dir, browser, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    traces = (copy / "traces.jsonl").read_text().splitlines()
    (copy / "traces.jsonl").write_text("\n".join(traces[1:]) + "\n")
    write_html(copy)
    assert "no QCG trace in traces.jsonl: 1 question (" in capsys.readouterr().err
    page = open_page(browser, copy / "report.html")
    qid = json.loads(traces[0])["qid"]
    page.find_element("css selector", f"#questions tbody tr[data-qid='{qid}']").click()
    assert "No QCG trace was recorded for this question." in page.find_element("id", "drill").text
    assert console_errors(page) == []


def test_query_trace_html_shows_each_query_s_path(run_dir, browser, tmp_path, cli):
    index = run_dir.parent / "index"
    (tmp_path / "q.txt").write_text("Who is Adam?\nlunch with Wolfgang\n")
    args = ("query", index, "--queries", tmp_path / "q.txt", "--gamma", "1.2", "--trace")
    result = cli(*args, "--html", tmp_path / "trace.html")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    page = open_page(browser, tmp_path / "trace.html")
    ids = [r["query_id"] for r in records]
    assert len(ids) == 2 and shown_rows(page) == ids
    page.find_element("css selector", f"#questions tbody tr[data-qid='{ids[1]}']").click()
    items = page.find_elements("css selector", ".method[data-method='qcg'] details.chunk")
    assert [int(i.get_attribute("data-chunk")) for i in items] == [c["chunk_id"] for c in records[1]["chunks"]]
    seeds = page.find_elements("css selector", ".trace table")[0].find_elements("css selector", "tr")
    assert len(seeds) == 1 + len(records[1]["trace"]["seeds"])
    assert console_errors(page) == []
    alone = cli(*args[:-1], "--html", tmp_path / "alone.html")  # was refused: "pass --trace"
    assert alone.returncode == 0 and (tmp_path / "alone.html").read_text() == (tmp_path / "trace.html").read_text()
    untraced = [{key: value for key, value in r.items() if key != "trace"} for r in records]
    assert [json.loads(line) for line in alone.stdout.splitlines()] == untraced  # the lines as without --html
