"""SD-WebUI's (AUTOMATIC1111's) API <-> sd-server's native job. Plain functions, no I/O.

``POST /sdapi/v1/txt2img`` and ``img2img`` map as sd-server's own ``routes_sdapi.cpp``
maps them (``build_sdapi_img_gen_request``): ``prompt``, ``negative_prompt``,
``width``/``height`` (512 when absent, or the input image's size for img2img),
``steps``, ``cfg_scale``, ``seed`` (-1, random, when absent), ``batch_size``,
``clip_skip`` (when > 0), ``sampler_name`` (WebUI's names such as ``Euler a`` or
sd-server's own), ``scheduler``, ``lora``, ``extra_images`` (reference images), the
highres fix (``enable_hr``, ``hr_*``, ``denoising_strength``; txt2img only), and for
img2img ``init_images[0]``, ``mask`` (``inpainting_mask_invert``) and
``denoising_strength`` (the img2img strength, at most 1). A sampler or scheduler
sd-server does not know is left to its default, as sd-server does. The answer is
``{images: [base64 PNG], parameters: <the request>, info: ""}``; images are always PNG.

The model is the host's to choose: ``override_settings.sd_model_checkpoint`` names it for
one request; else the caller's current checkpoint (``POST /sdapi/v1/options``), else the
first image model.

The discovery routes answer what sd-server 0.4.7 answers, from its sources
(``sample_method_to_str``, ``scheduler_to_str`` and the built-in upscaler and latent
modes): the lists are compiled into the pinned engine, so asking a running engine would
only cost a model load (and, under ``swap``, a chat engine's eviction) to learn them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from ..errors import FieldError
from ..images.job import ImageJob, ImageResult
from .image_data import b64, decode_b64_image, image_size, invert_png_mask
from .native_image import apply_extra_args, as_int, as_number

__all__ = [
    "LATENT_UPSCALE_MODES",
    "SAMPLERS",
    "SCHEDULERS",
    "SdapiRequest",
    "latent_upscale_modes_body",
    "options_body",
    "samplers_body",
    "schedulers_body",
    "sd_models_body",
    "sdapi_answer",
    "sdapi_request",
    "upscalers_body",
]

SAMPLERS: Final = (
    "euler",
    "euler_a",
    "heun",
    "dpm2",
    "dpm++2s_a",
    "dpm++2m",
    "dpm++2mv2",
    "ipndm",
    "ipndm_v",
    "lcm",
    "ddim_trailing",
    "tcd",
    "res_multistep",
    "res_2s",
    "er_sde",
)
"""sd-server 0.4.7's sample methods (``sample_method_to_str``), in its order."""

SCHEDULERS: Final = (
    "discrete",
    "karras",
    "exponential",
    "ays",
    "gits",
    "sgm_uniform",
    "simple",
    "smoothstep",
    "kl_optimal",
    "lcm",
    "bong_tangent",
)
"""sd-server 0.4.7's schedulers (``scheduler_to_str``), in its order."""

LATENT_UPSCALE_MODES: Final = (
    "Latent",
    "Latent (nearest)",
    "Latent (nearest-exact)",
    "Latent (antialiased)",
    "Latent (bicubic)",
    "Latent (bicubic antialiased)",
)

_WEBUI_SAMPLERS: Final = {
    "euler a": "euler_a",
    "k_euler_a": "euler_a",
    "euler": "euler",
    "k_euler": "euler",
    "heun": "heun",
    "k_heun": "heun",
    "dpm2": "dpm2",
    "k_dpm_2": "dpm2",
    "lcm": "lcm",
    "ddim": "ddim_trailing",
    "dpm++ 2m": "dpm++2m",
    "k_dpmpp_2m": "dpm++2m",
    "res multistep": "res_multistep",
    "k_res_multistep": "res_multistep",
    "res 2s": "res_2s",
    "k_res_2s": "res_2s",
}
"""WebUI's sampler names sd-server's sdapi route knows (``get_sdapi_sample_method``)."""

_DEFAULT_SIZE: Final = 512  # sd-server's sdapi route: -1 (unset) resolves to 512


@dataclass(frozen=True, slots=True)
class SdapiRequest:
    """One txt2img/img2img request, translated: the model its ``override_settings``
    names (None: the caller's current checkpoint), the job, and the request itself (the
    answer's ``parameters`` echo it)."""

    model: str | None
    job: ImageJob = field(repr=False)
    parameters: Mapping[str, Any] = field(repr=False)


def sample_method(name: str) -> str | None:
    """sd-server's sample method for a WebUI (or native) sampler name; None: its default."""
    if name in SAMPLERS:
        return name
    return _WEBUI_SAMPLERS.get(name.lower())


def _str(body: Mapping[str, Any], key: str, default: str = "") -> str:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, str):
        raise FieldError(key, "expected a string")
    return value


def _int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    return None if value is None else as_int(value, key)


def _number(body: Mapping[str, Any], key: str) -> float | None:
    value = body.get(key)
    return None if value is None else as_number(value, key)


def _model(body: Mapping[str, Any]) -> str | None:
    override = body.get("override_settings")
    if override is None:
        return None
    if not isinstance(override, Mapping):
        raise FieldError("override_settings", "expected an object of settings")
    checkpoint = override.get("sd_model_checkpoint")
    if checkpoint is None or checkpoint == "":
        return None
    if not isinstance(checkpoint, str):
        raise FieldError("override_settings.sd_model_checkpoint", "expected a model name")
    return checkpoint


def _hires(body: Mapping[str, Any]) -> dict[str, Any]:
    hires: dict[str, Any] = {"enabled": True}
    for key, native in (("hr_resize_x", "target_width"), ("hr_resize_y", "target_height")):
        value = _int(body, key)
        if value is not None:
            hires[native] = value
    steps = _int(body, "hr_steps")
    if steps is not None:
        hires["steps"] = steps
    for key, native in (("hr_scale", "scale"), ("denoising_strength", "denoising_strength")):
        number = _number(body, key)
        if number is not None:
            hires[native] = number
    upscaler = body.get("hr_upscaler")
    if upscaler is not None:
        hires["upscaler"] = _str(body, "hr_upscaler")
    return hires


def _lora(value: object) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        return []  # sd-server reads lora only when it is an array
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        if not isinstance(item, Mapping):
            continue  # as sd-server skips it
        path = item.get("path")
        if not isinstance(path, str) or not path:
            raise FieldError(f"lora[{i}].path", "lora.path required")
        entry: dict[str, Any] = {"path": path}
        if item.get("multiplier") is not None:
            entry["multiplier"] = as_number(item["multiplier"], f"lora[{i}].multiplier")
        if item.get("is_high_noise") is not None:
            entry["is_high_noise"] = item["is_high_noise"] is True
        out.append(entry)
    return out


def _images(value: object, param: str) -> list[bytes]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise FieldError(param, "expected an array of base64-encoded images")
    return [decode_b64_image(v, f"{param}[{i}]") for i, v in enumerate(value)]


def _truthy(value: object) -> bool:
    return value is True or (isinstance(value, int | float) and value != 0)


def sdapi_request(body: Mapping[str, Any], *, img2img: bool) -> SdapiRequest:
    """A txt2img (or img2img) body -> the native job. Raises :class:`FieldError` naming
    the field to fix."""
    prompt = _str(body, "prompt")
    if not prompt:
        raise FieldError("prompt", "prompt required")
    width, height = _int(body, "width"), _int(body, "height")
    if (width is not None and width <= 0) or (height is not None and height <= 0):
        raise FieldError("width", "width and height must be positive")
    native: dict[str, Any] = {
        "prompt": prompt,
        "negative_prompt": _str(body, "negative_prompt"),
        "seed": _int(body, "seed") if body.get("seed") is not None else -1,
        "batch_count": _int(body, "batch_size") or 1,
    }
    sample: dict[str, Any] = {}
    steps = _int(body, "steps")
    if steps is not None:
        sample["sample_steps"] = steps
    cfg = _number(body, "cfg_scale")
    if cfg is not None:
        sample["guidance"] = {"txt_cfg": cfg}
    if sample:
        native["sample_params"] = sample
    if width is not None and height is not None:
        native["width"], native["height"] = width, height
    if not img2img and body.get("enable_hr") is True:
        native["hires"] = _hires(body)
    native = apply_extra_args(native)

    clip_skip = _int(body, "clip_skip")
    if clip_skip is not None and clip_skip > 0:
        native["clip_skip"] = clip_skip
    method = sample_method(_str(body, "sampler_name"))
    if method is not None:
        native = _with_sample(native, sample_method=method)
    scheduler = _str(body, "scheduler")
    if scheduler in SCHEDULERS:
        native = _with_sample(native, scheduler=scheduler)
    if isinstance(body.get("lora"), list):
        native["lora"] = _lora(body["lora"])

    sized: list[bytes] = []
    if img2img:
        init = _images(body.get("init_images"), "init_images")
        if init:
            native["init_image"] = b64(init[0])
            sized.append(init[0])
        if isinstance(body.get("mask"), str):
            mask = decode_b64_image(body["mask"], "mask")
            if _truthy(body.get("inpainting_mask_invert")):
                mask = invert_png_mask(mask, "mask")
            native["mask_image"] = b64(mask)
            sized.append(mask)
        strength = _number(body, "denoising_strength")
        if strength is not None and strength >= 0:
            native["strength"] = min(strength, 1.0)
    extra = _images(body.get("extra_images"), "extra_images")
    if extra:
        native["ref_images"] = [b64(raw) for raw in extra]
        sized.extend(extra)

    if "width" not in native or "height" not in native:
        native["width"], native["height"] = _input_size(sized, width, height)
    native["output_format"] = "png"  # sd-server's sdapi answers PNG whatever is asked
    native.pop("output_compression", None)
    return SdapiRequest(_model(body), ImageJob(native), body)


def _with_sample(native: dict[str, Any], **fields: Any) -> dict[str, Any]:
    sample = dict(native.get("sample_params") or {})
    sample.update(fields)
    return {**native, "sample_params": sample}


def _input_size(images: Sequence[bytes], width: int | None, height: int | None) -> tuple[int, int]:
    """The output size where the request names none: the first input image's own (as
    sd-server takes it), else 512; a width or height given alone is kept."""
    for raw in images:
        size = image_size(raw)
        if size is not None:
            return (width or size[0], height or size[1])
    if images:
        raise FieldError(
            "init_images",
            "the image's size cannot be read (send PNG or JPEG), or say width and height",
        )
    return (width or _DEFAULT_SIZE, height or _DEFAULT_SIZE)


def sdapi_answer(request: SdapiRequest, result: ImageResult) -> dict[str, Any]:
    """``{images, parameters, info}``, as sd-server's sdapi routes answer."""
    return {"images": list(result.images), "parameters": dict(request.parameters), "info": ""}


# --------------------------------------------------------------------------- discovery


def samplers_body() -> list[dict[str, Any]]:
    return [{"name": n, "aliases": [n], "options": {}} for n in ("default", *SAMPLERS)]


def schedulers_body() -> list[dict[str, Any]]:
    return [{"name": n, "label": n} for n in ("default", *SCHEDULERS)]


def upscalers_body() -> list[dict[str, Any]]:
    """The built-in upscalers (model-backed ones need sd-server's
    ``--hires-upscalers-dir``, which the host does not pass unless a model's ``args``
    do; they still work by name in ``hr_upscaler``)."""
    return [
        {"name": n, "model_name": None, "model_path": None, "model_url": None, "scale": 4}
        for n in ("None", "Lanczos", "Nearest")
    ]


def latent_upscale_modes_body() -> list[dict[str, Any]]:
    return [{"name": n} for n in LATENT_UPSCALE_MODES]


def sd_models_body(models: Sequence[tuple[str, str]]) -> list[dict[str, Any]]:
    """``(id, filename)`` of each image model -> WebUI's checkpoint list. The hashes are
    sd-server's own placeholders."""
    return [
        {
            "title": model_id,
            "model_name": model_id,
            "filename": filename,
            "hash": "8888888888",
            "sha256": "8" * 64,
            "config": None,
        }
        for model_id, filename in models
    ]


def options_body(checkpoint: str | None) -> dict[str, Any]:
    return {"samples_format": "png", "sd_model_checkpoint": checkpoint or ""}
