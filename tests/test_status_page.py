"""The status page in a real headless Chromium against a running host.

Needs Debian's ``chromium`` and ``chromium-driver`` (``.ci/run`` installs them).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import trio

from gezel_trio.config.schema import ModelConfig
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


def _chrome(paths: tuple[str, str], profile: str | Path, *extra: str) -> Any:
    """A headless Chromium (driven through chromedriver) with its own profile folder, at a
    laptop's window size; ``extra`` flags are added to the common ones."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = paths[0]
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--window-size=1366,900",
        *extra,
        f"--user-data-dir={profile}",
    ):
        opts.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=paths[1]), options=opts)


def _drive(url: str, paths: tuple[str, str], expect: dict[str, Any], shots: Path) -> dict[str, Any]:
    """Run in a worker thread: open the dashboard, type the admin key, read it, press its
    buttons, and take screenshots at a laptop's and a phone's width."""
    from selenium import webdriver
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    profile = tempfile.mkdtemp(prefix="gezel-chromium-")
    driver = _chrome(
        paths,
        profile,
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
    )
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

        def click(css: str) -> None:  # a card that changed is a new node: find it again
            def clicked(d: webdriver.Chrome) -> bool:
                d.find_element(By.CSS_SELECTOR, css).click()
                return True

            WebDriverWait(driver, 20, ignored_exceptions=(StaleElementReferenceException,)).until(
                clicked
            )

        click(f"{card_css} button.unload")
        wait.until(ec.text_to_be_present_in_element(state, "stopped"))
        click(f"{card_css} button.load")
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
        assert out["gpu"] == "No GPU: serving on the CPU" and "NVML" not in out["page_text"]
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


def _chromium_cli(paths: tuple[str, str], profile: Path, *args: str) -> str:
    """One headless Chromium run as a person would script it: no flag that waits for
    anything past the page's load (no virtual time budget, no delay)."""
    import subprocess

    result = subprocess.run(
        [
            paths[0],
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--window-size=1366,900",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def _first_paint_and_after(url: str, paths: tuple[str, str], shots: Path) -> dict[str, Any]:
    """Run in a worker thread: the page's DOM and a screenshot at its load, then the page
    in a browser once it has lived 5 s (and polled since)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    out: dict[str, Any] = {}
    profile = Path(tempfile.mkdtemp(prefix="gezel-chromium-"))
    try:
        out["dom"] = _chromium_cli(paths, profile / "a", "--dump-dom", url)
        _chromium_cli(paths, profile / "b", f"--screenshot={shots / 'first-paint.png'}", url)
        driver = _chrome(paths, profile / "c")
        try:
            driver.set_page_load_timeout(20)
            driver.get(url)
            # at load, before any poll: what the host served the page with
            out["loaded_cards"] = len(driver.find_elements(By.CSS_SELECTOR, ".card"))
            first = driver.find_element(By.ID, "updated").text
            WebDriverWait(driver, 20, poll_frequency=0.1).until(
                lambda d: (
                    d.execute_script("return performance.now()") >= 5000
                    and d.find_element(By.ID, "updated").text != first
                )
            )
            driver.save_screenshot(str(shots / "after-5s.png"))
            # read in one script: the page re-renders its rows every second
            out.update(
                driver.execute_script(
                    """
                    const text = (sel) => document.querySelector(sel).innerText;
                    return {
                      card: text('.card[data-model="tiny"]'),
                      ttft_cells: [...document.querySelectorAll('#activity td.ttft')]
                        .map((td) => td.innerText),
                      ttft_now: text('#ttft-now'),
                      gpu: text('#gpu-summary'),
                      page_text: document.body.innerText,
                    };
                    """
                )
            )
        finally:
            driver.quit()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    return out


async def test_the_first_paint_shows_the_models(
    tiny_model: Path,
    state_dir: Path,
    engine_binary: EngineBinary,
    browser_paths: tuple[str, str],
    tmp_path: Path,
) -> None:
    """The quick start's host (no keys): a headless Chromium screenshot taken at the page's
    load, with no flag that waits, shows the models, the requests and the GPU line; after
    5 s the page has polled and still does. ``GEZEL_DASHBOARD_SHOTS=DIR`` keeps both
    screenshots (``dashboard-first-paint.png``, ``dashboard-5s.png``) in DIR."""
    import re

    cfg = make_config(
        [ModelConfig(id="tiny", path=str(tiny_model), parallel=2, ctx_per_slot=256)],
        state_dir=state_dir,
        engine_binary=engine_binary,
    )
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    with trio.fail_after(150):
        async with running(cfg) as (_host, client):
            for body in (chat, {**chat, "stream": True}, {**chat, "prompt_cache_key": "p"}):
                resp = await client.post("/v1/chat/completions", json=body)
                assert resp.status_code == 200, resp.text
            page = await client.get("/")
            assert b'<script id="initial-state" type="application/json">' in page.content
            status = (await client.get("/api/status")).json()
            activity = (await client.get("/api/activity")).json()
            out = await trio.to_thread.run_sync(
                _first_paint_and_after, str(client.base_url), browser_paths, tmp_path
            )

    dom = out["dom"]
    card = re.search(r'<section class="card" data-model="tiny">(.*?)</section>', dom, re.S)
    assert card is not None, dom[:3000]
    assert 'class="state state-ready">ready<' in card.group(1)
    assert '<span id="conn" class="live">live</span>' in dom
    assert "Loading the models" not in dom and "connecting" not in dom
    assert dom.count("<tr") >= 1 + 3  # the header and the three requests
    readings = (status.get("gpu") or {}).get("readings") or []
    if not readings:  # a CPU-only machine
        assert ">No GPU: serving on the CPU</div>" in dom
        assert out["gpu"] == "No GPU: serving on the CPU" and "NVML" not in out["page_text"]
    assert out["loaded_cards"] == 1
    assert "tiny" in out["card"] and "ready" in out["card"]
    # a TTFT cell for every request the host reports a first-token time for (the streamed
    # one today; every one once the API reports it for non-streamed requests too)
    reported = [r for r in activity["requests"] if isinstance(r.get("ttft_ms"), int | float)]
    assert reported and sum(c != "\u2013" for c in out["ttft_cells"]) == len(reported)
    assert re.fullmatch(r"\d+ ms over the last \d+ requests?|[\d.]+ s over.*", out["ttft_now"])
    assert "confirmed" in out["page_text"] and "a miss" in out["page_text"]  # the legend
    for name in ("first-paint", "after-5s"):
        shot = tmp_path / f"{name}.png"
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    keep = os.environ.get("GEZEL_DASHBOARD_SHOTS")
    if keep:
        await trio.to_thread.run_sync(_keep_shots, tmp_path, Path(keep))


def _keep_shots(shots: Path, keep: Path) -> None:
    keep.mkdir(parents=True, exist_ok=True)
    shutil.copy(shots / "first-paint.png", keep / "dashboard-first-paint.png")
    shutil.copy(shots / "after-5s.png", keep / "dashboard-5s.png")


def _watch_a_render(
    url: str, paths: tuple[str, str], start_render: Any, shots: Path
) -> dict[str, Any]:
    """Run in a worker thread: open the page, wait for the image model's card to show a
    free job, start a render (``start_render``, through the test's event loop), and read
    the card while it renders and once it is done."""
    import re

    from selenium.webdriver.support.ui import WebDriverWait

    out: dict[str, Any] = {}
    profile = Path(tempfile.mkdtemp(prefix="gezel-chromium-"))
    driver = _chrome(paths, profile)
    card = '.card[data-model="img"]'

    def text(css: str) -> str:  # in one script: the page re-renders its cards every second
        script = "const e = document.querySelector(arguments[0]); return e ? e.innerText : '';"
        return str(driver.execute_script(script, css))

    try:
        driver.set_page_load_timeout(20)
        driver.get(url)
        wait = WebDriverWait(driver, 120, poll_frequency=0.1)
        wait.until(lambda d: "job: free" in text(f"{card} .slots"))
        out["plan_before"] = text(f"{card} .plan")
        trio.from_thread.run(start_render)
        wait.until(lambda d: re.search(r"rendering, step [1-9]\d*/100", text(f"{card} .slots")))
        out["rendering"] = text(f"{card} .slots")
        driver.save_screenshot(str(shots / "render.png"))
        wait.until(
            lambda d: "job: free" in text(f"{card} .slots") and "measured" in text(f"{card} .plan")
        )
        out["plan_after"] = text(f"{card} .plan")
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
    return out


async def test_the_page_shows_a_render_its_lease_and_its_measured_memory(
    models_dir: Path,
    sd_server_binary: EngineBinary,
    state_dir: Path,
    browser_paths: tuple[str, str],
    tmp_path: Path,
) -> None:
    """An image model's card in a real Chromium: its job's sampling step and the GPU lease
    it holds while it renders, then a free job and the memory measured from sd-server
    in place of the files' estimate."""
    import re

    from benchmarks._raw_client import post_json
    from gezel_trio.engine.demo_image_model import demo_image_model_path

    model = demo_image_model_path(cache_dir=models_dir)
    image = ModelConfig(
        id="img",
        kind="image",
        files={
            "diffusion_model": str(model.diffusion_model),
            "llm": str(model.llm),
            "taesd": str(model.vae),
        },
    )
    cfg = make_config(
        [image], state_dir=state_dir, engine={"sd_server": str(sd_server_binary.path)}
    )
    body = {"model": "img", "prompt": "a red apple", "size": "64x48", "steps": 100}
    streams: list[trio.SocketStream] = []
    with trio.fail_after(400):
        async with running(cfg) as (_host, client):
            base = str(client.base_url).rstrip("/")

            async def start_render() -> None:
                streams.append(await post_json(base, body, "/v1/images/generations"))

            try:
                out = await trio.to_thread.run_sync(
                    _watch_a_render, base + "/", browser_paths, start_render, tmp_path
                )
            finally:
                for stream in streams:
                    await stream.aclose()
    assert "measured" not in out["plan_before"]  # not started yet: nothing measured
    assert re.search(r"rendering, step \d+/100 · holds the img lease", out["rendering"]), out
    assert re.search(
        r"[\d.]+ MiB measured \([\d.]+ MiB estimated from its files\)", out["plan_after"]
    )
    shot = tmp_path / "render.png"
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
