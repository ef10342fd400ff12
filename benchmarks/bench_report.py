"""How long report.html takes to open in headless Chromium, and its size.

    python benchmarks/bench_report.py EVAL_DIR [--repeat 5]

Loads EVAL_DIR/report.html from disk (a fresh tab each time) and prints one JSON line: the file's
bytes, the milliseconds from navigation start until the question table is drawn (the data unpacked,
the filters set up: ``#f-count`` filled), and until one question's drill-down (every method's chunks
and the QCG trace graph) is drawn after a click; the median and the slowest of ``--repeat`` loads.
Needs Debian's chromium and chromium-driver, and selenium (the dev extra)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.support.ui import WebDriverWait

from qcg_gpu.capabilities import cpu_kind


def browser() -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"):
        options.add_argument(flag)
    options.add_argument("--window-size=1400,1000")
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("eval_dir", type=Path)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--screenshot", type=Path, help="save a screenshot of the last load's drill-down here")
    args = parser.parse_args()
    page = (args.eval_dir / "report.html").resolve()
    driver = browser()
    opened, drilled = [], []
    try:
        for _ in range(args.repeat):
            driver.get("about:blank")
            driver.get(page.as_uri())
            WebDriverWait(driver, 60).until(lambda d: d.find_element("id", "f-count").text)
            opened.append(driver.execute_script("return performance.now()"))
            start = time.perf_counter()
            driver.find_element("css selector", "#questions tbody tr").click()
            WebDriverWait(driver, 60).until(lambda d: d.find_elements("css selector", "#drill h2"))
            drilled.append(1000 * (time.perf_counter() - start))
        if args.screenshot:
            driver.save_screenshot(str(args.screenshot))
        rows = len(driver.find_elements("css selector", "#questions tbody tr"))
        methods = len(driver.execute_script("return window.reportData.methods"))
    finally:
        driver.quit()
    print(
        json.dumps(
            {
                "cpu": cpu_kind(),
                "bytes": page.stat().st_size,
                "questions": rows,
                "methods": methods,
                "open_ms_median": round(statistics.median(opened)),
                "open_ms_max": round(max(opened)),
                "drill_down_ms_median": round(statistics.median(drilled)),
                "drill_down_ms_max": round(max(drilled)),
            }
        )
    )


if __name__ == "__main__":
    main()
