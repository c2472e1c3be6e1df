"""adambridge-lab end to end in a real headless browser (Debian's chromium + chromedriver, selenium):
open the page, start a quick run, see it finish, open its report, see its plots load, compare two."""
from __future__ import annotations

import json
import re
import shutil
import time

import pytest

from adambridge.lab.server import LabServer

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed "
                                                             "(pip install 'adambridge[test]')")
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="chromium and chromedriver are not installed (apt-get install chromium chromium-driver)")


@pytest.fixture
def lab(tmp_path):
    server = LabServer(tmp_path / "reports")
    server.serve_in_thread()
    yield server
    server.shutdown_all()


@pytest.fixture
def browser():
    options = Options()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000"):
        options.add_argument(arg)
    options.binary_location = CHROMIUM
    # NOTE: an explicit driver path, so selenium never tries to download a browser or a driver.
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


def test_browser_quick_run_then_its_report_with_plots_then_compare(lab, browser):
    # NOTE: the quick preset takes 40 s to 4 minutes on a 2-vCPU VM shared with other jobs.
    wait = WebDriverWait(browser, 300, poll_frequency=0.2)
    browser.get(lab.url)
    wait.until(lambda d: len(Select(d.find_element(By.ID, "preset")).options) == 6)
    Select(browser.find_element(By.ID, "preset")).select_by_value("quick")
    browser.find_element(By.ID, "start").click()
    wait.until(lambda d: d.find_element(By.ID, "state").text == "running")
    assert browser.find_element(By.ID, "cancel").is_enabled()
    wait.until(lambda d: d.find_element(By.ID, "state").text == "complete")
    assert float(browser.find_element(By.ID, "progress").get_attribute("value")) == 1.0
    assert "phase 2/2: demo" in browser.find_element(By.ID, "log").text
    # finished: no phase still shown as running, and the run's own closing line
    assert browser.find_element(By.ID, "phase").text == "all 2 done"
    assert re.fullmatch(r"2 of 2 phases ran in \d+ s", browser.find_element(By.ID, "phase-message").text)

    link, = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "a.open-report"))
    name = link.text
    link.click()
    view = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, f"#report-view .report[data-name='{name}']"))
    assert "Host AdamW kernels" in view.text and "native fp32 moments" in view.text
    saved = json.loads((lab.manager.reports / name / "report.json").read_text())
    shown = [c.text for c in view.find_elements(By.CSS_SELECTOR, "p.conclusion")]
    assert shown == [s["conclusion"] for s in saved["sections"]] and all(shown)
    assert shown[1].startswith("against AdamW, fp32 weights: AdamBridge fp32 moments ")
    assert [w.text for w in view.find_elements(By.CSS_SELECTOR, "p.warning")] == \
        [w for s in saved["sections"] for w in s["warnings"]]
    plots = view.find_elements(By.CSS_SELECTOR, "img.plot")
    assert len(plots) == 2  # kernels GB/s, demo loss curves
    for img in plots:
        wait.until(lambda d: d.execute_script("return arguments[0].complete", img))
        assert browser.execute_script("return arguments[0].naturalWidth", img) > 0, img.get_attribute("src")

    # a copy of the report stands for an earlier run on a busy machine, twice as slow in the
    # first kernel row: tick both, compare side by side, its kernel section's warning shown as
    # one, and above them B - A, the earlier report being A
    earlier = lab.manager.reports / "20000101-000000-quick"
    shutil.copytree(lab.manager.reports / name, earlier)
    busy = "256K: WARNING: these timings are not to be trusted: 7 other runnable threads competed"
    saved["sections"][0]["warnings"] = [busy]
    first = saved["sections"][0]["rows"][0]
    ms_now = float(first[2])
    first[2] = f"{2 * ms_now:.2f}"
    (earlier / "report.json").write_text(json.dumps(saved))
    browser.find_element(By.ID, "refresh").click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".pick")) == 2)
    for tick in browser.find_elements(By.CSS_SELECTOR, ".pick"):
        tick.click()
    browser.find_element(By.ID, "compare").click()
    panels = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#report-view .compare .report"))
    assert [p.get_attribute("data-name") for p in panels] == ["20000101-000000-quick", name]
    assert [p.find_element(By.CSS_SELECTOR, "p.side").text for p in panels] == ["A", "B"]
    assert [w.text for w in panels[0].find_elements(By.CSS_SELECTOR, "p.warning")] == [busy]
    difference = browser.find_element(By.CSS_SELECTOR, "#report-view .difference")
    assert difference.find_element(By.TAG_NAME, "h2").text == f"B - A: {name} against 20000101-000000-quick"
    tables = difference.find_elements(By.CSS_SELECTOR, "table")  # the kernel and demo sections
    assert [h.text for h in difference.find_elements(By.TAG_NAME, "h3")] == \
        [s["title"] for s in saved["sections"]]
    heads = [th.text for th in tables[0].find_elements(By.TAG_NAME, "th")]
    assert heads == ["size", "variant", "ms: B - A", "GB/s: B - A", "vs all-CPU torch: B - A"]
    cells = tables[0].find_elements(By.CSS_SELECTOR, "tbody tr")[0].find_elements(By.TAG_NAME, "td")
    shown = f"{ms_now - 2 * ms_now:+.2f} ({ms_now / (2 * ms_now):.2f}x)"
    assert [c.text for c in cells[:3]] == [first[0], first[1], shown]
    assert "num" in cells[2].get_attribute("class")


def test_browser_bad_input_shows_a_message_and_a_bad_token_is_refused(lab, browser):
    wait = WebDriverWait(browser, 30, poll_frequency=0.2)
    browser.get(lab.url)
    wait.until(lambda d: len(Select(d.find_element(By.ID, "preset")).options) == 6)
    # a preset the page does not offer (an old tab, a hand-edited request): the server says why
    browser.execute_script("const o = document.createElement('option'); o.value = o.text = 'bogus';"
                           "document.getElementById('preset').append(o);")
    Select(browser.find_element(By.ID, "preset")).select_by_value("bogus")
    browser.find_element(By.ID, "start").click()
    message = wait.until(lambda d: d.find_element(By.ID, "message").text)
    assert "Unknown preset 'bogus'" in message
    browser.find_element(By.CSS_SELECTOR, "#options-box summary").click()
    Select(browser.find_element(By.ID, "preset")).select_by_value("quick")
    browser.find_element(By.CSS_SELECTOR, "[data-option='threads']").send_keys("0")
    browser.find_element(By.ID, "start").click()
    wait.until(lambda d: "Invalid option threads: 0" in d.find_element(By.ID, "message").text)
    assert lab.manager.status() == {"run": None}

    browser.get(lab.url.replace(lab.token, "not-the-token"))
    deadline = time.monotonic() + 10
    while "forbidden" not in browser.page_source:
        assert time.monotonic() < deadline, browser.page_source[:500]
        time.sleep(0.1)


def test_browser_cancel_stops_the_run(lab, browser, tmp_path):
    slow = tmp_path / "test_slow_browser_target.py"
    slow.write_text("import time\n\ndef test_waits():\n    time.sleep(120)  # a long phase to cancel\n")
    wait = WebDriverWait(browser, 180, poll_frequency=0.2)  # pytest starting under load
    browser.get(lab.url)
    wait.until(lambda d: len(Select(d.find_element(By.ID, "preset")).options) == 6)
    Select(browser.find_element(By.ID, "preset")).select_by_value("tests")
    browser.find_element(By.CSS_SELECTOR, "#options-box summary").click()
    browser.find_element(By.CSS_SELECTOR, "[data-option='tests']").send_keys(str(slow))
    browser.find_element(By.ID, "start").click()
    wait.until(lambda d: "test session starts" in d.find_element(By.ID, "log").text)  # pytest runs
    browser.find_element(By.ID, "cancel").click()
    wait.until(lambda d: d.find_element(By.ID, "state").text == "cancelled")
    assert "cancelled" in browser.find_element(By.ID, "message").text
    assert browser.find_element(By.ID, "phase").text == "1/1 tests (cancelled there)"
    assert not lab.manager.status()["run"]["running"]
    assert not browser.find_element(By.ID, "cancel").is_enabled()
