"""The status page in a real headless Chromium against a running host.

Needs Debian's ``chromium`` and ``chromium-driver`` (``.ci/run`` installs them).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import trio

from gezel_trio.config import ModelConfig
from gezel_trio.engine.binary import EngineBinary

from .conftest import make_config, running

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
API_KEY = "sk-page-user"
ADMIN_KEY = "sk-page-admin"


@pytest.fixture(scope="module")
def browser_paths() -> tuple[str, str]:
    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).exists():
            pytest.fail(
                f"{path} is missing: install Debian's chromium and chromium-driver "
                "(apt-get install -y chromium chromium-driver)",
                pytrace=False,
            )
    return CHROMIUM, CHROMEDRIVER


def _drive(url: str, paths: tuple[str, str], expect: dict[str, Any], shots: Path) -> dict[str, Any]:
    """Run in a worker thread: open the dashboard, type the admin key, read it, press its
    buttons, and take screenshots at a laptop's and a phone's width."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    profile = tempfile.mkdtemp(prefix="gezel-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = paths[0]
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--window-size=1366,900",
        f"--user-data-dir={profile}",
    ):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=paths[1]), options=opts)
    out: dict[str, Any] = {}
    model = expect["model"]
    card_css = f'.card[data-model="{model}"]'
    try:
        driver.set_page_load_timeout(20)
        driver.get(url)
        wait = WebDriverWait(driver, 20, poll_frequency=0.1)

        # keys are configured: the page asks for the admin key
        wait.until(ec.visibility_of_element_located((By.ID, "auth")))
        out["prompt"] = driver.find_element(By.ID, "auth-message").text
        # a user key is not enough
        driver.find_element(By.ID, "key").send_keys(API_KEY)
        driver.find_element(By.ID, "save-key").click()
        wait.until(ec.text_to_be_present_in_element((By.ID, "auth-message"), "not an admin key"))
        driver.find_element(By.ID, "key").send_keys(ADMIN_KEY)
        driver.find_element(By.ID, "save-key").click()

        state = (By.CSS_SELECTOR, f"{card_css} .state")
        wait.until(ec.text_to_be_present_in_element(state, "ready"))
        wait.until(
            ec.text_to_be_present_in_element(
                (By.CSS_SELECTOR, f"{card_css} .slots"), expect["owner"]
            )
        )
        wait.until(ec.text_to_be_present_in_element((By.ID, "activity"), model))
        wait.until(ec.text_to_be_present_in_element((By.ID, "log"), "[gezel] ready in"))
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#chart-queue polyline"))
        card = driver.find_element(By.CSS_SELECTOR, card_css)
        out["card"] = card.text
        out["pid"] = card.find_element(By.CSS_SELECTOR, ".pid").text
        out["port"] = card.find_element(By.CSS_SELECTOR, ".port").text
        out["plan"] = card.find_element(By.CSS_SELECTOR, ".plan").text
        out["slots"] = card.find_element(By.CSS_SELECTOR, ".slots").text
        out["activity"] = driver.find_element(By.ID, "activity").text
        out["queue"] = driver.find_element(By.ID, "queue").text
        out["gpu"] = driver.find_element(By.ID, "gpu-summary").text
        out["gpu_table"] = driver.find_element(By.ID, "gpu").text
        out["conn"] = driver.find_element(By.ID, "conn").text
        out["auth_hidden"] = not driver.find_element(By.ID, "auth").is_displayed()
        out["session_key"] = driver.execute_script(
            "return sessionStorage.getItem('gezel-admin-key')"
        )
        out["local_keys"] = driver.execute_script("return localStorage.length")
        out["page_text"] = driver.find_element(By.TAG_NAME, "body").text
        # the buttons work: unload, then load again
        card.find_element(By.CSS_SELECTOR, "button.unload").click()
        wait.until(ec.text_to_be_present_in_element(state, "stopped"))
        driver.find_element(By.CSS_SELECTOR, f"{card_css} button.load").click()
        wait.until(ec.text_to_be_present_in_element(state, "ready"))
        out["action"] = driver.find_element(By.ID, "action-result").text
        # laptop and phone widths: screenshots, and nothing wider than the screen
        out["overflow"] = {}
        for name, (w, h) in {"laptop": (1366, 900), "phone": (390, 844)}.items():
            driver.set_window_size(w, h)
            wait.until(ec.text_to_be_present_in_element(state, "ready"))
            inner = driver.execute_script("return window.innerWidth")
            scroll = driver.execute_script("return document.documentElement.scrollWidth")
            out["overflow"][name] = (scroll, inner)
            driver.save_screenshot(str(shots / f"dashboard-{name}.png"))
        first = driver.find_element(By.ID, "updated").text
        WebDriverWait(driver, 5, poll_frequency=0.1).until(
            lambda d: d.find_element(By.ID, "updated").text != first
        )
        out["refreshed"] = True
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
    return out


async def test_dashboard_shows_live_state_and_its_buttons_work(
    tiny_model: Path,
    state_dir: Path,
    engine_binary: EngineBinary,
    browser_paths: tuple[str, str],
    tmp_path: Path,
) -> None:
    cfg = make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=2, ctx_per_slot=256)],
        state_dir=state_dir,
        engine_binary=engine_binary,
        server={"api_keys": [API_KEY], "admin_keys": [ADMIN_KEY]},
    )
    with trio.fail_after(90):
        async with running(cfg) as (host, client):
            user = {"Authorization": f"Bearer {API_KEY}"}
            resp = await client.post(
                "/v1/chat/completions",
                json={
                    "model": "tiny",
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 4,
                    "prompt_cache_key": "page-session",
                },
                headers=user,
            )
            assert resp.status_code == 200, resp.text
            status = (
                await client.get("/api/status", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
            ).json()
            owners = [o for o in status["scheduler"]["slot_owners"]["tiny"].values() if o]
            assert len(owners) == 1
            page = await client.get("/")
            assert page.status_code == 200 and "text/html" in page.headers["content-type"]
            assert "default-src 'none'" in page.headers["content-security-policy"]

            engine = host.models["tiny"].engine
            pid, port = engine.pid, engine.port
            out = await trio.to_thread.run_sync(
                _drive,
                str(client.base_url),
                browser_paths,
                {"model": "tiny", "owner": owners[0]},
                tmp_path,
            )
            assert engine.state.value.value == "ready" and engine.starts == 2  # unload, load

    assert "admin key" in out["prompt"]
    assert "tiny" in out["card"] and "ready" in out["card"]
    assert out["pid"] == str(pid) and out["port"] == str(port)
    assert out["plan"].startswith("2 slots \u00d7 256 tokens") and "on the CPU" in out["plan"]
    assert f"session {owners[0]}" in out["slots"] and "free" in out["slots"]
    assert "tiny" in out["activity"] and "200" in out["activity"]
    assert f"queued 0 / {status['scheduler']['max_queue']}" in out["queue"]
    readings = (status.get("gpu") or {}).get("readings") or []
    if readings:  # a machine with a GPU: its name and temperature are shown
        assert readings[0]["name"] in out["gpu_table"]
    else:
        assert "no GPU readings" in out["gpu"]
    assert out["conn"] == "live" and out["auth_hidden"]
    assert out["session_key"] == ADMIN_KEY and out["local_keys"] == 0
    # no raw JSON anywhere on the page
    text = out["page_text"]
    assert '{"' not in text and '":' not in text and "null" not in text, text
    assert out["action"] == "tiny: ready"
    for name, (scroll, inner) in out["overflow"].items():
        assert scroll <= inner, (name, scroll, inner)
        shot = tmp_path / f"dashboard-{name}.png"
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    assert out["refreshed"]
