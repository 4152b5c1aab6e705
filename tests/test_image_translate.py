"""The image dialects' translations, without an engine: OpenAI edits, Ollama's image
generate, SD-WebUI's txt2img/img2img and discovery, the native job API, the job table,
and the image bytes helpers. ``test_image_translate_engine.py`` posts the same
translations to a real sd-server."""

from __future__ import annotations

import base64
import struct

import pytest
import trio

from gezel_trio.api.image_data import decode_b64_image, image_size, invert_png_mask
from gezel_trio.api.images_edits_translate import edit_answer, edit_request
from gezel_trio.api.native_image import apply_extra_args, merge_native, parse_size
from gezel_trio.api.ollama_image_translate import (
    image_answer,
    image_generate_request,
    image_progress,
)
from gezel_trio.api.ollama_translate import WallTimes
from gezel_trio.api.sdapi_translate import (
    options_body,
    samplers_body,
    schedulers_body,
    sd_models_body,
    sdapi_answer,
    sdapi_request,
    upscalers_body,
)
from gezel_trio.api.sdcpp_translate import job_body, native_request, submitted_body
from gezel_trio.errors import BadRequest, EngineFailed, FieldError, QueueFull
from gezel_trio.host.image_jobs import ImageJobs, JobExpired, JobNotFound
from gezel_trio.host.images import job_result
from gezel_trio.images.job import ImageProgress, ImageResult

from ._png import grey_pixels, make_png

PNG = make_png(40, 24)
PNG_B64 = base64.b64encode(PNG).decode()
RESULT = ImageResult("png", ("aW1n", "aW1nMg=="), 1.5)


# --------------------------------------------------------------------------- bytes


def test_image_size_reads_each_header() -> None:
    assert image_size(PNG) == (40, 24)
    gif = b"GIF89a" + struct.pack("<HH", 33, 17) + b"\0" * 8
    assert image_size(gif) == (33, 17)
    bmp = b"BM" + b"\0" * 16 + struct.pack("<ii", 20, -10) + b"\0" * 8
    assert image_size(bmp) == (20, 10)
    # JPEG: SOI, an APP0 segment to skip, then SOF0 with height 48, width 64
    jpeg = (
        b"\xff\xd8"
        + b"\xff\xe0"
        + struct.pack(">H", 16)
        + b"JFIF\0" * 2
        + b"\0\0\0\0"
        + b"\xff\xc0"
        + struct.pack(">HBHH", 17, 8, 48, 64)
        + b"\0" * 12
    )
    assert image_size(jpeg) == (64, 48)
    vp8l = b"RIFF\0\0\0\0WEBPVP8L" + b"\0\0\0\0\x2f" + ((63) | (47 << 14)).to_bytes(4, "little")
    assert image_size(vp8l) == (64, 48)
    assert image_size(b"not an image") is None
    assert image_size(PNG[:20]) is None


def test_decode_b64_image_takes_raw_and_data_urls() -> None:
    assert decode_b64_image(PNG_B64, "x") == PNG
    assert decode_b64_image("data:image/png;base64," + PNG_B64, "x") == PNG
    assert decode_b64_image(PNG_B64.rstrip("="), "x") == PNG  # unpadded, as some send it
    for bad in ("", "***", 3, None):
        with pytest.raises(FieldError) as info:
            decode_b64_image(bad, "init_images[0]")
        assert info.value.param == "init_images[0]"


@pytest.mark.parametrize("colour", [0, 2, 4, 6])
def test_invert_png_mask_inverts_luminance_through_every_filter(colour: int) -> None:
    def pixel(x: int, y: int) -> tuple[int, ...]:
        v = (x * 31 + y * 17) % 256
        return {0: (v,), 2: (v, v, v), 4: (v, 200), 6: (v, v, v, 255)}[colour]

    mask = make_png(9, 7, pixel, colour=colour)
    inverted = invert_png_mask(mask, "mask")
    assert image_size(inverted) == (9, 7)
    rows = grey_pixels(inverted)
    for y in range(7):
        for x in range(9):
            v = (x * 31 + y * 17) % 256
            # stb's luminance of a grey RGB pixel is v or v - 1 (integer weights)
            assert 255 - v <= rows[y][x] <= 256 - v, (x, y, rows[y][x], v)


def test_invert_png_mask_refuses_what_it_cannot_read() -> None:
    with pytest.raises(FieldError, match="needs the mask as a PNG"):
        invert_png_mask(b"\xff\xd8\xff\xe0 a jpeg", "mask")


# --------------------------------------------------------------------------- native


def test_extra_args_apply_over_the_fields_and_leave_the_prompt() -> None:
    body = {
        "prompt": 'a cat <sd_cpp_extra_args>{"sample_params": {"sample_steps": 2},'
        ' "width": 96}</sd_cpp_extra_args> on a mat',
        "width": 64,
        "sample_params": {"guidance": {"txt_cfg": 3.0}},
    }
    out = apply_extra_args(body)
    assert out["prompt"] == "a cat  on a mat"
    assert out["width"] == 96
    assert out["sample_params"] == {"guidance": {"txt_cfg": 3.0}, "sample_steps": 2}
    assert merge_native({"a": {"b": 1}}, {"a": {"c": 2}}) == {"a": {"b": 1, "c": 2}}
    with pytest.raises(BadRequest, match="invalid sd_cpp_extra_args"):
        apply_extra_args({"prompt": "<sd_cpp_extra_args>[1]</sd_cpp_extra_args>"})


def test_parse_size() -> None:
    assert parse_size("64x48") == (64, 48)
    assert parse_size("64X48") == (64, 48)
    assert parse_size(None) is None
    assert parse_size("auto") is None
    for bad in ("64", "x48", "0x10", "axb", 64):
        with pytest.raises(FieldError):
            parse_size(bad)


# --------------------------------------------------------------------------- OpenAI edits


def test_edit_maps_uploads_as_sd_server_does() -> None:
    mask = make_png(40, 24, lambda x, y: (255 if x > 20 else 0,), colour=0)
    other = make_png(8, 8)
    request = edit_request(
        {"prompt": "make it blue", "n": "2", "size": "64x48", "model": "img"},
        {"image[]": [PNG, other], "mask": [mask]},
    )
    body = request.job.body
    assert request.model == "img" and request.job.kind == "img_gen"
    assert (body["width"], body["height"], body["batch_count"]) == (64, 48, 2)
    assert body["init_image"] == PNG_B64
    assert body["ref_images"] == [PNG_B64, base64.b64encode(other).decode()]
    assert base64.b64decode(body["mask_image"]) == mask
    assert body["output_format"] == "png"


def test_edit_takes_the_first_image_size_and_the_legacy_field() -> None:
    request = edit_request({"prompt": "p", "output_format": "JPG"}, {"image": [PNG]})
    body = request.job.body
    assert request.model is None
    assert (body["width"], body["height"], body["batch_count"]) == (40, 24, 1)
    assert body["ref_images"] == [PNG_B64] and "mask_image" not in body
    assert body["output_format"] == "jpeg"


@pytest.mark.parametrize(
    ("fields", "files", "param"),
    [
        ({}, {"image": [PNG]}, "prompt"),
        ({"prompt": "p"}, {}, "image"),
        ({"prompt": "p", "n": "two"}, {"image": [PNG]}, "n"),
        ({"prompt": "p", "n": "0"}, {"image": [PNG]}, "n"),
        ({"prompt": "p", "size": "big"}, {"image": [PNG]}, "size"),
        ({"prompt": "p", "output_format": "webp"}, {"image": [PNG]}, "output_format"),
        ({"prompt": "p", "response_format": "url"}, {"image": [PNG]}, "response_format"),
        ({"prompt": "p"}, {"image": [b"not an image"]}, "image"),
    ],
)
def test_edit_refusals_name_the_field(
    fields: dict[str, str], files: dict[str, list[bytes]], param: str
) -> None:
    with pytest.raises(FieldError) as info:
        edit_request(fields, files)
    assert info.value.param == param


def test_edit_answer_is_sd_servers_shape() -> None:
    assert edit_answer(RESULT, created=7) == {
        "created": 7,
        "output_format": "png",
        "data": [{"b64_json": "aW1n"}, {"b64_json": "aW1nMg=="}],
    }


# --------------------------------------------------------------------------- Ollama


def test_ollama_generate_maps_width_height_steps_seed() -> None:
    request = image_generate_request(
        {
            "model": "img:latest",
            "prompt": "a fox",
            "width": 64,
            "height": 48,
            "steps": 3,
            "options": {"seed": 7},
            "stream": False,
        }
    )
    assert request.model == "img:latest" and not request.stream and not request.load_only
    assert request.job.body == {
        "prompt": "a fox",
        "batch_count": 1,
        "output_format": "png",
        "sample_params": {"sample_steps": 3},
        "seed": 7,
        "width": 64,
        "height": 48,
    }


def test_ollama_generate_defaults_and_images() -> None:
    request = image_generate_request({"model": "img", "prompt": "x", "images": [PNG_B64]})
    assert request.stream  # Ollama streams unless told not to
    body = request.job.body
    assert "sample_params" not in body and "seed" not in body
    assert (body["width"], body["height"]) == (40, 24)
    assert body["ref_images"] == [PNG_B64] and body["init_image"] == PNG_B64
    zero = image_generate_request({"model": "img", "prompt": "x", "width": 0, "steps": 0})
    assert "width" not in zero.job.body and "sample_params" not in zero.job.body
    assert image_generate_request({"model": "img"}).load_only


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt": "x"}, "model", "required"),
        ({"model": "m", "width": 5000}, "width", "must be <= 4096"),
        ({"model": "m", "height": "tall"}, "height", "integer"),
        ({"model": "m", "steps": -1}, "steps", "positive"),
        ({"model": "m", "images": "abc"}, "images", "array"),
        ({"model": "m", "options": {"seed": "x"}}, "options.seed", "integer"),
    ],
)
def test_ollama_generate_refusals(body: dict[str, object], param: str, words: str) -> None:
    with pytest.raises(FieldError, match=words) as info:
        image_generate_request(body)
    assert info.value.param == param


def test_ollama_answers_are_what_the_client_reads() -> None:
    from ollama import GenerateResponse

    assert image_progress("img", ImageProgress(0, 0)) is None
    line = image_progress("img", ImageProgress(2, 4), clock_ns=lambda: 10**18)
    assert line is not None
    parsed = GenerateResponse(**line)
    assert (parsed.completed, parsed.total, parsed.done, parsed.image) == (2, 4, False, None)
    final = image_answer("img", RESULT, WallTimes(5_000, 1_000), clock_ns=lambda: 10**18)
    parsed = GenerateResponse(**final)
    assert parsed.done and parsed.done_reason == "stop" and parsed.image == "aW1n"
    assert (parsed.total_duration, parsed.load_duration) == (5_000, 1_000)


# --------------------------------------------------------------------------- SD-WebUI


def test_txt2img_maps_as_sd_servers_sdapi_route() -> None:
    body = {
        "prompt": "a boat",
        "negative_prompt": "fog",
        "width": 64,
        "height": 48,
        "steps": 4,
        "cfg_scale": 5,
        "seed": 11,
        "batch_size": 2,
        "clip_skip": 2,
        "sampler_name": "Euler a",
        "scheduler": "karras",
        "override_settings": {"sd_model_checkpoint": "img"},
        "enable_hr": True,
        "hr_scale": 1.5,
        "hr_upscaler": "Lanczos",
        "denoising_strength": 0.4,
    }
    request = sdapi_request(body, img2img=False)
    assert request.model == "img"
    assert request.job.body == {
        "prompt": "a boat",
        "negative_prompt": "fog",
        "seed": 11,
        "batch_count": 2,
        "sample_params": {
            "sample_steps": 4,
            "guidance": {"txt_cfg": 5.0},
            "sample_method": "euler_a",
            "scheduler": "karras",
        },
        "width": 64,
        "height": 48,
        "hires": {
            "enabled": True,
            "scale": 1.5,
            "denoising_strength": 0.4,
            "upscaler": "Lanczos",
        },
        "clip_skip": 2,
        "output_format": "png",
    }
    assert sdapi_answer(request, RESULT) == {
        "images": ["aW1n", "aW1nMg=="],
        "parameters": body,
        "info": "",
    }


def test_txt2img_defaults_as_sd_server() -> None:
    body = sdapi_request({"prompt": "p", "sampler_name": "no such"}, img2img=False).job.body
    assert body == {
        "prompt": "p",
        "negative_prompt": "",
        "seed": -1,
        "batch_count": 1,
        "width": 512,
        "height": 512,
        "output_format": "png",
    }


def test_img2img_maps_init_image_mask_invert_and_strength() -> None:
    mask = make_png(40, 24, lambda x, y: (0,), colour=0)
    request = sdapi_request(
        {
            "prompt": "p",
            "init_images": ["data:image/png;base64," + PNG_B64],
            "mask": base64.b64encode(mask).decode(),
            "inpainting_mask_invert": 1,
            "denoising_strength": 1.7,
            "extra_images": [PNG_B64],
            "enable_hr": True,  # txt2img only: ignored here
        },
        img2img=True,
    )
    body = request.job.body
    assert request.model is None
    assert (body["width"], body["height"]) == (40, 24)
    assert body["init_image"] == PNG_B64 and body["ref_images"] == [PNG_B64]
    assert body["strength"] == 1.0 and "hires" not in body
    rows = grey_pixels(base64.b64decode(body["mask_image"]))
    assert {v for row in rows for v in row} == {255}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "prompt"),
        ({"prompt": "p", "width": 0}, "width"),
        ({"prompt": "p", "steps": "many"}, "steps"),
        ({"prompt": "p", "lora": [{"multiplier": 1}]}, "lora[0].path"),
        ({"prompt": "p", "override_settings": "x"}, "override_settings"),
        ({"prompt": "p", "init_images": ["%%%"]}, "init_images[0]"),
    ],
)
def test_sdapi_refusals_name_the_field(body: dict[str, object], param: str) -> None:
    with pytest.raises(FieldError) as info:
        sdapi_request(body, img2img=True)
    assert info.value.param == param


def test_sdapi_discovery_is_sd_servers() -> None:
    samplers = [s["name"] for s in samplers_body()]
    assert samplers[:3] == ["default", "euler", "euler_a"] and "er_sde" in samplers
    assert samplers_body()[1] == {"name": "euler", "aliases": ["euler"], "options": {}}
    assert schedulers_body()[1] == {"name": "discrete", "label": "discrete"}
    assert [u["name"] for u in upscalers_body()] == ["None", "Lanczos", "Nearest"]
    (model,) = sd_models_body([("img", "flux2.gguf")])
    assert model["title"] == model["model_name"] == "img" and model["filename"] == "flux2.gguf"
    assert options_body("img") == {"samples_format": "png", "sd_model_checkpoint": "img"}


# --------------------------------------------------------------------------- native jobs


def test_native_request_takes_model_out() -> None:
    request = native_request({"prompt": "p", "model": "img", "width": 64}, "img_gen")
    assert request.model == "img"
    assert dict(request.job.body) == {"prompt": "p", "width": 64}
    assert native_request({"prompt": "p"}, "vid_gen").job.kind == "vid_gen"
    with pytest.raises(FieldError):
        native_request({}, "img_gen")
    with pytest.raises(FieldError):
        native_request({"prompt": "p", "model": 3}, "img_gen")


def test_job_table_life_cycle_and_shapes() -> None:
    table = ImageJobs(max_jobs=4, max_pending=2, keep_s=10)
    a = table.submit("alice", kind="img_gen", model="img", now=0, unix_now=100)
    b = table.submit("alice", kind="img_gen", model="img", now=0, unix_now=100)
    assert submitted_body(a) == {
        "id": a.id,
        "kind": "img_gen",
        "status": "queued",
        "created": 100,
        "poll_url": f"/sdcpp/v1/jobs/{a.id}",
    }
    assert (table.queue_position(a), table.queue_position(b)) == (1, 2)
    with pytest.raises(QueueFull):
        table.submit("bob", kind="img_gen", model="img", now=0, unix_now=100)
    table.progress(a, 0, 0, unix_now=101)
    table.progress(a, 2, 4, unix_now=102)
    assert a.status == "generating" and a.started == 101
    assert table.queue_position(a) == 0 and table.queue_position(b) == 1
    table.complete(a, RESULT, now=3, unix_now=103)
    shown = job_body(table, table.get("alice", a.id, now=3))
    assert shown["status"] == "completed" and shown["progress"] == {"step": 4, "steps": 4}
    assert shown["result"] == {
        "output_format": "png",
        "images": [{"index": 0, "b64_json": "aW1n"}, {"index": 1, "b64_json": "aW1nMg=="}],
    }
    assert shown["error"] is None and shown["completed"] == 103
    assert table.cancel(b, now=4, unix_now=104)
    assert not table.cancel(b, now=4, unix_now=104)  # already finished
    assert job_body(table, b)["error"] == {
        "code": "cancelled",
        "message": "job cancelled by client",
    }
    # another caller never sees a job
    with pytest.raises(JobNotFound):
        table.get("bob", a.id, now=5)
    # kept keep_s after the end, then 410 for its owner, 404 for others
    assert table.get("alice", a.id, now=12.9) is a
    with pytest.raises(JobExpired):
        table.get("alice", a.id, now=13)
    with pytest.raises(JobNotFound):
        table.get("bob", a.id, now=13)
    with pytest.raises(JobNotFound):
        table.get("alice", "job_nope", now=13)


def test_job_table_is_bounded() -> None:
    table = ImageJobs(max_jobs=3, max_pending=1, keep_s=1000)
    ids = []
    for i in range(10):
        job = table.submit("c", kind="img_gen", model="m", now=i, unix_now=i)
        table.fail(job, "generation_failed", "boom", now=i, unix_now=i)
        ids.append(job.id)
    assert table.statistics()["jobs"] == 3
    assert table.get("c", ids[-1], now=10).error == ("generation_failed", "boom")
    with pytest.raises(JobExpired):  # the last ids forgotten are remembered as expired
        table.get("c", ids[-4], now=10)
    with pytest.raises(JobNotFound):  # and no more of them than max_jobs
        table.get("c", ids[0], now=10)


async def test_cancelling_a_job_cancels_its_running_task() -> None:
    """The table owns each running job's scope: a cancel ends the job's task, and a
    finished job's cancel touches nothing."""
    table = ImageJobs(max_jobs=4, max_pending=2, keep_s=10)
    job = table.submit("c", kind="img_gen", model="m", now=0, unix_now=0)
    with table.running(job) as scope:
        assert table.cancel(job, now=1, unix_now=1)
        await trio.lowlevel.checkpoint()
        raise AssertionError("the job's task ran on after its cancel")
    assert scope.cancelled_caught and job.status == "cancelled"
    done = table.submit("c", kind="img_gen", model="m", now=2, unix_now=2)
    table.fail(done, "generation_failed", "boom", now=2, unix_now=2)
    with table.running(done) as scope:
        assert not table.cancel(done, now=3, unix_now=3)
    assert not scope.cancel_called and done.status == "failed"


def test_a_finished_jobs_result_reads_as_sd_server_wrote_it_image_and_video() -> None:
    """sd-server's completed job (async_jobs.cpp make_async_job_json): an image job's
    ``images``, a video job's one ``b64_json`` with its MIME type, fps and frame count.
    The host's ``/sdcpp/v1/jobs/{id}`` gives either back in the same shape. (The demo
    model renders no video: this is the only test of the video path.)"""
    video = {
        "output_format": "webm",
        "mime_type": "video/webm",
        "fps": 16,
        "frame_count": 33,
        "b64_json": "GkXfo0AgQoaBAUL3gQFC8oEE",
    }
    images = {
        "output_format": "png",
        "images": [{"index": 1, "b64_json": "B"}, {"index": 0, "b64_json": "A"}],
    }
    table = ImageJobs(max_jobs=4, max_pending=2, keep_s=10)
    for kind, engine_result in (("vid_gen", video), ("img_gen", images)):
        answer = {"id": "job_1", "kind": kind, "status": "completed", "result": engine_result}
        result = job_result(answer, 1.5)
        record = table.submit("c", kind=kind, model="m", now=0, unix_now=100)  # type: ignore[arg-type]
        table.complete(record, result, now=1, unix_now=101)
        shown = job_body(table, record)["result"]
        if kind == "vid_gen":
            assert (result.media_b64, result.images) == (video["b64_json"], ())
            assert (result.mime_type, result.fps, result.frame_count) == ("video/webm", 16, 33)
            assert shown == video
        else:
            assert result.images == ("A", "B") and result.media_b64 is None
            assert shown == {
                "output_format": "png",
                "images": [{"index": 0, "b64_json": "A"}, {"index": 1, "b64_json": "B"}],
            }
    with pytest.raises(EngineFailed):
        job_result({"status": "completed", "result": {"output_format": "webm"}}, 1.0)
