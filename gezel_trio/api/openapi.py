"""The OpenAPI 3.1 description of the host's own endpoints, served at ``GET /openapi.json``.

Hand-written, so that it says what the host does rather than what a
framework guesses: every route and every status code it can answer with.
``tests/test_api_admin_metrics.py`` checks that it names exactly the routes
the app serves.

Why not generated (quart-schema is the library for Quart): its documents come
from pydantic or msgspec models declared on each route. The inference routes
pass llama-server's bodies through (any field the engine takes, checked by
``api/validation.py`` for the fields the host itself reads), so a model would
either reject valid engine fields or describe nothing; and the error statuses,
which are most of what a client needs to know, come from the one error map,
not from route signatures. A generator would add pydantic and a route
decorator to every endpoint to produce a less exact document.
"""

from __future__ import annotations

import copy
from typing import Any

from quart import Blueprint, Response

from .. import __version__
from .errors import json_response

bp = Blueprint("openapi", __name__)

JSON = "application/json"
SSE = "text/event-stream"


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _err(description: str, *, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description, "content": {JSON: {"schema": _ref("Error")}}}
    if headers:
        out["headers"] = headers
    return out


RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before retrying.",
        "schema": {"type": "integer"},
    }
}

E401 = _err("No API key, or an unknown one (when `[server] api_keys` is set).")
E403 = _err("The key is valid but not an admin key.")
E404_MODEL = _err("Unknown model (`code: model_not_found`); the message lists the known ones.")
E409 = _err("`lock_model` is on and the request names another model (`code: model_locked`).")
E413 = _err("The request body is larger than `[server] max_body_bytes`.")
E502 = _err("The engine crashed or closed the connection mid-request (`code: engine_crashed`).")
E503 = _err(
    "The queue is full (`code: queue_full`, with `Retry-After`), the engine failed to start "
    "(`engine_failed`, the message summarizes its last log lines), no llama-server was found "
    "(`engine_not_found`) or the GPU has no room (`no_capacity`).",
    headers=RETRY_AFTER,
)
E504 = _err(
    "The engine sent nothing for `[engine] request_timeout` seconds (`code: engine_timeout`)."
)
UPSTREAM = _err(
    "Any other status the engine answered with, relayed faithfully with the engine's own body "
    "(for example 400 `exceed_context_size_error` for a prompt longer than the context)."
)


def _bad_request(what: str) -> dict[str, Any]:
    return _err(
        f"{what}: malformed JSON, or a field of the wrong type (`param` names it), "
        "or the engine's own 400."
    )


def _json_body(schema: str, *, required: bool = True) -> dict[str, Any]:
    return {"required": required, "content": {JSON: {"schema": _ref(schema)}}}


def _ok(description: str, schema: str | dict[str, Any], *, stream: bool = False) -> dict[str, Any]:
    s = _ref(schema) if isinstance(schema, str) else schema
    content: dict[str, Any] = {JSON: {"schema": s}}
    if stream:
        content[SSE] = {
            "schema": {"type": "string"},
            "description": "With `stream: true`: `data: {chunk}` events, then `data: [DONE]`. "
            'A failure after the first byte arrives as one `data: {"error": ...}` event.',
        }
    return {"description": description, "content": content}


def _inference_responses(ok: dict[str, Any], *, what: str) -> dict[str, Any]:
    return {
        "200": ok,
        "400": _bad_request(what),
        "401": E401,
        "404": E404_MODEL,
        "409": E409,
        "413": E413,
        "502": E502,
        "503": E503,
        "504": E504,
        "default": UPSTREAM,
    }


MODEL_PATH_PARAM = {
    "name": "model",
    "in": "path",
    "required": True,
    "description": "A configured model id.",
    "schema": {"type": "string"},
}
MODEL_ID_PARAM = {**MODEL_PATH_PARAM, "name": "model_id"}
MODEL_QUERY_PARAM = {
    "name": "model",
    "in": "query",
    "required": False,
    "description": "A configured model id; the first model when absent.",
    "schema": {"type": "string"},
}
SESSION_HEADER = {
    "name": "X-Session-Id",
    "in": "header",
    "required": False,
    "description": "The chat's identity when the body has no `prompt_cache_key`.",
    "schema": {"type": "string", "maxLength": 512},
}
PUBLIC: list[dict[str, list[str]]] = []


def _native(op: str, *, prefixed: bool) -> dict[str, Any]:
    """One native passthrough operation, with or without the ``/upstream/{model}`` prefix."""
    params: list[dict[str, Any]] = [MODEL_PATH_PARAM] if prefixed else []
    tag = ["llama.cpp native"]
    if op == "completion":
        return {
            "post": {
                "tags": tag,
                "summary": "llama.cpp /completion, scheduled into a slot",
                "description": "The body passes through untouched except `id_slot`, which is "
                "removed: the scheduler pins the slot. `model` chooses the model"
                + (" and must match the path if given." if prefixed else "."),
                "parameters": [*params, SESSION_HEADER],
                "requestBody": _json_body("NativeCompletionRequest"),
                "responses": _inference_responses(
                    _ok("The engine's answer.", {"type": "object"}, stream=True), what="Bad request"
                ),
            }
        }
    if op in ("tokenize", "detokenize"):
        responses = _inference_responses(
            _ok("The engine's answer.", {"type": "object"}), what="Bad request"
        )
        return {
            "post": {
                "tags": tag,
                "summary": f"llama.cpp /{op}",
                "parameters": params,
                "requestBody": _json_body(
                    "TokenizeRequest" if op == "tokenize" else "DetokenizeRequest"
                ),
                "responses": responses,
            }
        }
    responses = _inference_responses(
        _ok(
            "The engine's answer"
            + (" (each slot's `prompt` and `generated` text removed)." if op == "slots" else "."),
            {"type": "array", "items": {"type": "object"}} if op == "slots" else {"type": "object"},
        ),
        what="Bad request",
    )
    del responses["413"]
    return {
        "get": {
            "tags": tag,
            "summary": f"llama.cpp /{op} (read-only)",
            "parameters": params or [MODEL_QUERY_PARAM],
            "responses": responses,
        }
    }


ALIASES = {
    "/chat/completions": "/v1/chat/completions",
    "/completions": "/completion",
    "/embeddings": "/v1/embeddings",
    "/images/generations": "/v1/images/generations",
    "/models": "/v1/models",
    "/responses": "/v1/responses",
    "/chat/completions/input_tokens": "/v1/chat/completions/input_tokens",
    "/responses/input_tokens": "/v1/responses/input_tokens",
    "/audio/transcriptions": "/v1/audio/transcriptions",
    "/rerank": "/v1/rerank",
    "/reranking": "/v1/rerank",
    "/v1/reranking": "/v1/rerank",
}
"""Routes served under a second path, as llama-server serves them (``/completions`` is
its native completion, ``/embeddings`` its native embeddings)."""


def _completion_op(tag: str, summary: str, schema: str, ok: str) -> dict[str, Any]:
    return {
        "post": {
            "tags": [tag],
            "summary": summary,
            "parameters": [SESSION_HEADER],
            "requestBody": _json_body(schema),
            "responses": _inference_responses(
                _ok(ok, {"type": "object"}, stream=True), what="Bad request"
            ),
        }
    }


def _slot_free_op(tag: str, summary: str) -> dict[str, Any]:
    return {
        "post": {
            "tags": [tag],
            "summary": summary,
            "requestBody": _json_body("LooseRequest"),
            "responses": _inference_responses(
                _ok("The engine's answer.", {"type": "object"}), what="Bad request"
            ),
        }
    }


def _dialect_paths() -> dict[str, Any]:
    infill = _completion_op(
        "llama.cpp native",
        "Fill-in-the-middle (llama.vscode's shape), scheduled into a slot",
        "InfillRequest",
        "The engine's answer.",
    )
    return {
        "/v1/responses": _completion_op(
            "OpenAI",
            "OpenAI Responses, streaming or not (stateless: no previous_response_id)",
            "ResponsesRequest",
            "A response, or its events.",
        ),
        "/v1/messages": _completion_op(
            "Anthropic",
            "Anthropic Messages, streaming or not (run on the engine's chat route, pinned)",
            "MessagesRequest",
            "A message, or its events. Errors in Anthropic's shape.",
        ),
        "/v1/messages/count_tokens": _slot_free_op(
            "Anthropic", "Input tokens of a Messages request"
        ),
        "/infill": infill,
        "/upstream/{model}/infill": {
            "post": {
                **infill["post"],
                "parameters": [MODEL_PATH_PARAM, SESSION_HEADER],
            }
        },
        "/apply-template": _slot_free_op("llama.cpp native", "The chat template applied"),
        "/v1/chat/completions/input_tokens": _slot_free_op(
            "OpenAI", "Input tokens of a chat request"
        ),
        "/v1/responses/input_tokens": _slot_free_op(
            "OpenAI", "Input tokens of a Responses request"
        ),
        "/v1/audio/transcriptions": {
            "post": {
                "tags": ["OpenAI"],
                "summary": "Speech to text, on a model with an audio projector (multipart)",
                "requestBody": {
                    "required": True,
                    "content": {
                        "multipart/form-data": {
                            "schema": {
                                "type": "object",
                                "required": ["file"],
                                "properties": {
                                    "file": {"type": "string", "format": "binary"},
                                    "model": {"type": "string"},
                                },
                            }
                        }
                    },
                },
                "responses": _inference_responses(
                    _ok("The engine's answer.", {"type": "object"}),
                    what="Bad request: not multipart, or no file (`param: file`)",
                ),
            }
        },
        "/v1/rerank": {
            "post": {
                "tags": ["llama.cpp native"],
                "summary": "Rerank documents, on a model configured with `reranking = true`",
                "requestBody": _json_body("RerankRequest"),
                "responses": _inference_responses(
                    _ok("The documents' scores.", {"type": "object"}),
                    what="Bad request, or the model does not rerank (`param: model`)",
                ),
            }
        },
    }


NDJSON = "application/x-ndjson"


def _ollama_err(description: str, *, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "description": description,
        "content": {JSON: {"schema": _ref("OllamaError")}},
    }
    if headers:
        out["headers"] = headers
    return out


OLLAMA_401 = _ollama_err("No API key, or an unknown one (when `[server] api_keys` is set).")
OLLAMA_404 = _ollama_err("Unknown model: `model 'x' not found` (`x:latest` names the model `x`).")


def _ollama_ok(description: str, schema: str, *, stream: bool = False) -> dict[str, Any]:
    content: dict[str, Any] = {JSON: {"schema": _ref(schema)}}
    if stream:
        content[NDJSON] = {
            "schema": {"type": "string"},
            "description": "Without `stream: false` (Ollama's default is to stream): one "
            "JSON object per line, `done: false`, then a last line with `done: true`, "
            '`done_reason` and the figures. A failure after the head is a last `{"error": ...}` '
            "line.",
        }
    return {"description": description, "content": content}


def _ollama_model_op(
    summary: str, schema: str, ok: dict[str, Any], *, session: bool = False
) -> dict[str, Any]:
    return {
        "post": {
            "tags": ["Ollama"],
            "summary": summary,
            "parameters": [SESSION_HEADER] if session else [],
            "requestBody": _json_body(schema),
            "responses": {
                "200": ok,
                "400": _ollama_err(
                    "Malformed JSON, a field of the wrong type (the message names it), "
                    "`images` for a model without a projector, a model that does not serve "
                    "this route, or the engine's own 400."
                ),
                "401": OLLAMA_401,
                "404": OLLAMA_404,
                "409": _ollama_err("`lock_model` is on and the request names another model."),
                "413": _ollama_err("The request body is larger than `[server] max_body_bytes`."),
                "500": _ollama_err(
                    "The engine's answer cannot be put in Ollama's shape (tool call arguments "
                    "that are not a JSON object)."
                ),
                "502": _ollama_err("The engine crashed or closed the connection mid-request."),
                "503": _ollama_err(
                    "The queue is full (with `Retry-After`), the engine failed to start, or "
                    "the GPU has no room.",
                    headers=RETRY_AFTER,
                ),
                "504": _ollama_err("The engine sent nothing for `[engine] request_timeout`."),
                "default": _ollama_err("Any other status the engine answered with."),
            },
        }
    }


def _ollama_get(summary: str, schema: str) -> dict[str, Any]:
    return {
        "get": {
            "tags": ["Ollama"],
            "summary": summary,
            "responses": {"200": _ollama_ok(summary, schema), "401": OLLAMA_401},
        }
    }


def _ollama_not_implemented(method: str, route: str) -> dict[str, Any]:
    return {
        method: {
            "tags": ["Ollama"],
            "summary": f"Not supported: 501, saying what to do instead of /api/{route}",
            "requestBody": _json_body("LooseRequest", required=False),
            "responses": {
                "200": {"description": "Never: the host serves the models its config names."},
                "401": OLLAMA_401,
                "413": _ollama_err("The request body is larger than `[server] max_body_bytes`."),
                "501": _ollama_err(
                    "Models come from the config and the models folder, not from a registry."
                ),
            },
        }
    }


def _ollama_paths() -> dict[str, Any]:
    """Ollama's API (``gezel_trio.api.ollama``): errors are ``{"error": "..."}``."""
    paths: dict[str, Any] = {
        "/api/chat": _ollama_model_op(
            "Ollama chat, streamed (NDJSON) unless `stream: false`; pinned like every completion",
            "OllamaChatRequest",
            _ollama_ok("A chat answer, or its lines.", "OllamaAnswer", stream=True),
            session=True,
        ),
        "/api/generate": _ollama_model_op(
            "Ollama generate: the chat template applied; `raw` as is (`/completion`); "
            "`suffix` fills in the middle (`/infill`)",
            "OllamaGenerateRequest",
            _ollama_ok("A generate answer, or its lines.", "OllamaAnswer", stream=True),
            session=True,
        ),
        "/api/embed": _ollama_model_op(
            "Ollama embeddings (L2-normalized), on a model with `embeddings = true`",
            "OllamaEmbedRequest",
            _ollama_ok("The embeddings.", "OllamaEmbedAnswer"),
        ),
        "/api/embeddings": _ollama_model_op(
            "Ollama's legacy embedding route, on a model with `embeddings = true`",
            "OllamaEmbeddingsRequest",
            _ollama_ok("The embedding.", "OllamaEmbeddingsAnswer"),
        ),
        "/api/show": _ollama_model_op(
            "A model's details, parameters, chat template, GGUF facts and capabilities",
            "OllamaShowRequest",
            _ollama_ok("The model.", "OllamaShow"),
        ),
        "/api/tags": _ollama_get("Every model clients can name, as `id:latest`", "OllamaModels"),
        "/api/ps": _ollama_get(
            "The models whose engines are loaded, and when their idle TTL ends", "OllamaModels"
        ),
        "/api/version": _ollama_get("The Ollama API version these routes follow", "OllamaVersion"),
    }
    show = paths["/api/show"]["post"]
    for code in ("500", "502", "503", "504", "default"):
        del show["responses"][code]  # /api/show reads the model file, never the engine
    for route in ("pull", "push", "create", "copy"):
        paths[f"/api/{route}"] = _ollama_not_implemented("post", route)
    paths["/api/delete"] = _ollama_not_implemented("delete", "delete")
    return paths


def _sd_err(description: str, *, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    """sd-server's own error shape, ``{"error": "..."}`` (its SD-WebUI and native routes)."""
    return _ollama_err(description, headers=headers)


def _image_responses(ok: dict[str, Any], *, sd_shape: bool) -> dict[str, Any]:
    err = _sd_err if sd_shape else _err
    return {
        "200": ok,
        "400": err(
            "A field to fix (the message names it), a text model named, or sd-server's own "
            "refusal of the job (its message)."
        ),
        "401": err("No API key, or an unknown one (when `[server] api_keys` is set)."),
        "404": err("Unknown model."),
        "413": err("The request body is larger than `[server] max_body_bytes`."),
        "503": err(
            "The queue is full (with `Retry-After`), the engine failed to start or failed "
            "the job, or the GPU has no room.",
            headers=RETRY_AFTER,
        ),
    }


def _sd_get(summary: str) -> dict[str, Any]:
    return {
        "get": {
            "tags": ["SD-WebUI"],
            "summary": summary,
            "responses": {
                "200": _ok(summary, {"type": "array", "items": {"type": "object"}}),
                "401": _sd_err("No API key, or an unknown one."),
            },
        }
    }


def _job_op(method: str, summary: str, ok: str) -> dict[str, Any]:
    return {
        method: {
            "tags": ["sd-server jobs"],
            "summary": summary,
            "parameters": [
                {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}}
            ],
            "responses": {
                "200": _ok(ok, {"type": "object"}),
                "401": _sd_err("No API key, or an unknown one."),
                "404": _sd_err("No such job of this caller's (`job not found`)."),
                "410": _sd_err("The job ended long ago and was forgotten (`job expired`)."),
            },
        }
    }


def _image_paths() -> dict[str, Any]:
    """The image routes: :mod:`.images_openai`, :mod:`.images_edits`, :mod:`.sdapi` and
    :mod:`.sdcpp`."""
    loose = {"required": True, "content": {JSON: {"schema": _ref("LooseRequest")}}}
    submit = {
        "tags": ["sd-server jobs"],
        "requestBody": loose,
        "responses": {
            **_image_responses(_ok("Never: a job is 202.", {"type": "object"}), sd_shape=True),
            "202": _ok("The job: `{id, kind, status, created, poll_url}`.", {"type": "object"}),
        },
    }
    generations = {
        "post": {
            "tags": ["OpenAI"],
            "summary": "Generate images (`prompt`, `n`, `size`, `output_format`, and "
            "sd-server's `steps`, `seed`, `negative_prompt`); answers `b64_json`",
            "requestBody": loose,
            "responses": _image_responses(
                _ok("`{created, output_format, data: [{b64_json}]}`", {"type": "object"}),
                sd_shape=False,
            ),
        }
    }
    return {
        "/v1/images/generations": generations,
        "/images/generations": generations,
        "/v1/images/edits": {
            "post": {
                "tags": ["OpenAI"],
                "summary": "Edit images (multipart: `image[]` or `image`, `mask`, `prompt`, "
                "`n`, `size`, `output_format`); answers `b64_json`",
                "requestBody": {
                    "required": True,
                    "content": {"multipart/form-data": {"schema": {"type": "object"}}},
                },
                "responses": _image_responses(
                    _ok("`{created, output_format, data: [{b64_json}]}`", {"type": "object"}),
                    sd_shape=False,
                ),
            }
        },
        "/sdapi/v1/txt2img": {
            "post": {
                "tags": ["SD-WebUI"],
                "summary": "Text to image (AUTOMATIC1111's fields); answers base64 PNGs",
                "requestBody": loose,
                "responses": _image_responses(
                    _ok("`{images, parameters, info}`", {"type": "object"}), sd_shape=True
                ),
            }
        },
        "/sdapi/v1/img2img": {
            "post": {
                "tags": ["SD-WebUI"],
                "summary": "Image to image (`init_images`, `mask`, `denoising_strength`)",
                "requestBody": loose,
                "responses": _image_responses(
                    _ok("`{images, parameters, info}`", {"type": "object"}), sd_shape=True
                ),
            }
        },
        "/sdapi/v1/options": {
            **_sd_get("`samples_format` and the caller's `sd_model_checkpoint`"),
            "post": {
                "tags": ["SD-WebUI"],
                "summary": "Choose the caller's checkpoint (`sd_model_checkpoint`)",
                "requestBody": loose,
                "responses": _image_responses(_ok("Done.", {"type": "null"}), sd_shape=True),
            },
        },
        "/sdapi/v1/sd-models": _sd_get("The host's image models, as checkpoints"),
        "/sdapi/v1/samplers": _sd_get("sd-server's sample methods"),
        "/sdapi/v1/schedulers": _sd_get("sd-server's schedulers"),
        "/sdapi/v1/upscalers": _sd_get("The built-in highres upscalers"),
        "/sdapi/v1/latent-upscale-modes": _sd_get("The latent upscale modes"),
        "/sdapi/v1/loras": _sd_get("LoRAs (none listed: the host passes no LoRA folder)"),
        "/sdcpp/v1/img_gen": {
            "post": {**submit, "summary": "Submit an image job (sd-server's native body)"}
        },
        "/sdcpp/v1/vid_gen": {
            "post": {**submit, "summary": "Submit a video job, for a model that renders video"}
        },
        "/sdcpp/v1/jobs/{job_id}": _job_op(
            "get", "A job: status, queue position, progress, result or error", "The job."
        ),
        "/sdcpp/v1/jobs/{job_id}/cancel": _job_op(
            "post", "Cancel a queued or generating job", "The job, cancelled."
        ),
    }


def _build_spec() -> dict[str, Any]:
    paths: dict[str, Any] = {
        "/health": {
            "get": {
                "tags": ["host"],
                "summary": "Liveness; never needs a key",
                "security": PUBLIC,
                "responses": {"200": _ok("The host is up.", {"type": "object"})},
            }
        },
        "/": {
            "get": {
                "tags": ["host"],
                "summary": "The live status page (HTML; it asks for the admin key itself)",
                "security": PUBLIC,
                "responses": {
                    "200": {
                        "description": "HTML",
                        "content": {"text/html": {"schema": {"type": "string"}}},
                    }
                },
            },
            "head": {
                "tags": ["host", "Ollama"],
                "summary": "Is a server there? (Ollama's clients probe it): 200, no body",
                "security": PUBLIC,
                "responses": {"200": {"description": "The host is up."}},
            },
        },
        "/openapi.json": {
            "get": {
                "tags": ["host"],
                "summary": "This document",
                "responses": {"200": _ok("OpenAPI 3.1", {"type": "object"}), "401": E401},
            }
        },
        "/metrics": {
            "get": {
                "tags": ["host"],
                "summary": "Prometheus metrics (text exposition format)",
                "responses": {
                    "200": {
                        "description": "Prometheus text format 0.0.4",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                    "401": E401,
                },
            }
        },
        "/v1/chat/completions": {
            "post": {
                "tags": ["OpenAI"],
                "summary": "Chat completion, streaming or not",
                "parameters": [SESSION_HEADER],
                "requestBody": _json_body("ChatCompletionRequest"),
                "responses": _inference_responses(
                    _ok(
                        "A chat.completion, or chat.completion.chunk events.",
                        {"type": "object"},
                        stream=True,
                    ),
                    what="Bad request",
                ),
            }
        },
        "/v1/completions": {
            "post": {
                "tags": ["OpenAI"],
                "summary": "Text completion, streaming or not",
                "parameters": [SESSION_HEADER],
                "requestBody": _json_body("CompletionRequest"),
                "responses": _inference_responses(
                    _ok("A text_completion, or its chunks.", {"type": "object"}, stream=True),
                    what="Bad request",
                ),
            }
        },
        "/v1/embeddings": {
            "post": {
                "tags": ["OpenAI"],
                "summary": "Embeddings, from a model configured with `embeddings = true`",
                "requestBody": _json_body("EmbeddingRequest"),
                "responses": _inference_responses(
                    _ok("A list of embeddings.", {"type": "object"}),
                    what="Bad request, or the model does not serve embeddings (`param: model`)",
                ),
            }
        },
        "/v1/images/generations": {
            "post": {
                "tags": ["OpenAI"],
                "summary": 'Image generation on an image model (`kind = "image"`), as b64_json',
                "requestBody": _json_body("ImageGenerationRequest"),
                "responses": _inference_responses(
                    _ok("The images, base64 each.", {"type": "object"}),
                    what="Bad request: a field (`param`), `response_format: url`, a text model, "
                    "or a body the image engine refused (its message)",
                ),
            }
        },
        "/v1/models": {
            "get": {
                "tags": ["OpenAI"],
                "summary": "Configured models, with each engine's state",
                "responses": {"200": _ok("A list of models.", "ModelList"), "401": E401},
            }
        },
        "/v1/models/{model_id}": {
            "get": {
                "tags": ["OpenAI"],
                "summary": "One model",
                "parameters": [MODEL_ID_PARAM],
                "responses": {
                    "200": _ok("The model.", "Model"),
                    "401": E401,
                    "404": E404_MODEL,
                    "409": E409,
                },
            }
        },
        "/api/status": {
            "get": {
                "tags": ["admin"],
                "summary": "Engines (state, pid, port, build, log tail), scheduler, GPU",
                "responses": {
                    "200": _ok("The host's status.", {"type": "object"}),
                    "401": E401,
                    "403": E403,
                },
            }
        },
        "/api/config": {
            "get": {
                "tags": ["admin"],
                "summary": "The live configuration (keys are shown only as counts)",
                "responses": {
                    "200": _ok("The configuration.", {"type": "object"}),
                    "401": E401,
                    "403": E403,
                },
            },
            "put": {
                "tags": ["admin"],
                "summary": "Change policy, thermal limits, lock_model, log level; no restart",
                "requestBody": _json_body("ConfigPatch"),
                "responses": {
                    "200": _ok("What was applied, and the live configuration.", {"type": "object"}),
                    "400": _err(
                        "Malformed JSON, an unknown or read-only key, or a bad value; "
                        "`param` names the key (e.g. `temp_margin_c`). Nothing is applied."
                    ),
                    "401": E401,
                    "403": E403,
                    "413": E413,
                    "501": _err(
                        "This host cannot change one of the keys live; nothing is applied."
                    ),
                },
            },
        },
        "/api/models/{model_id}/logs": {
            "get": {
                "tags": ["admin"],
                "summary": "The engine's last output lines",
                "parameters": [
                    MODEL_ID_PARAM,
                    {
                        "name": "lines",
                        "in": "query",
                        "required": False,
                        "schema": {
                            "type": "integer",
                            "minimum": 1,
                            "maximum": 10000,
                            "default": 200,
                        },
                    },
                ],
                "responses": {
                    "200": _ok("`{model, lines}`", {"type": "object"}),
                    "401": E401,
                    "403": E403,
                    "404": E404_MODEL,
                    "409": E409,
                },
            }
        },
        "/api/models/{model_id}/load": {
            "post": {
                "tags": ["admin"],
                "summary": "Start the model's engine and wait until it is ready",
                "parameters": [MODEL_ID_PARAM],
                "responses": {
                    "200": _ok("`{model, state}`", {"type": "object"}),
                    "401": E401,
                    "403": E403,
                    "404": E404_MODEL,
                    "409": E409,
                    "503": E503,
                },
            }
        },
        "/api/models/{model_id}/unload": {
            "post": {
                "tags": ["admin"],
                "summary": "Stop the model's engine",
                "parameters": [MODEL_ID_PARAM],
                "responses": {
                    "200": _ok("`{model, state}`", {"type": "object"}),
                    "401": E401,
                    "403": E403,
                    "404": E404_MODEL,
                    "409": E409,
                },
            }
        },
        "/api/activity": {
            "get": {
                "tags": ["admin"],
                "summary": "Recent requests (TTFT, tokens, cache hits) and per-second queue "
                "depth, running jobs and median TTFT over the last ten minutes",
                "responses": {
                    "200": _ok("`{requests: [...], series: [...]}`", {"type": "object"}),
                    "401": E401,
                    "403": E403,
                },
            }
        },
        "/api/reload": {
            "post": {
                "tags": ["admin"],
                "summary": "Re-read the config file and apply its models, as SIGHUP does: "
                "added ones appear, removed ones drain and stop, changed ones restart when idle",
                "responses": {
                    "200": _ok(
                        "`{added, removed, changed, unchanged, restart_needed}`", {"type": "object"}
                    ),
                    "400": _err("The file is invalid (the key is named); nothing changed."),
                    "401": E401,
                    "403": E403,
                },
            }
        },
        "/api/sessions": {
            "get": {
                "tags": ["sessions"],
                "summary": "The caller's sessions (an admin key: every caller's): where each "
                "one's KV is, in a slot and/or parked on disk, with tokens and bytes",
                "responses": {
                    "200": _ok(
                        "`{sessions: [{id, slots, parked}], kv_parking}`", {"type": "object"}
                    ),
                    "401": E401,
                },
            }
        },
        "/api/sessions/{session_id}": {
            "delete": {
                "tags": ["sessions"],
                "summary": "Remove the session's KV everywhere: its idle slots are erased, "
                "its parked files deleted",
                "parameters": [
                    {
                        "name": "session_id",
                        "in": "path",
                        "required": True,
                        "schema": {"type": "string"},
                        "description": "The id GET /api/sessions lists (a session hash).",
                    }
                ],
                "responses": {
                    "200": _ok("`{id, slots_erased, files_deleted}`", {"type": "object"}),
                    "401": E401,
                    "404": _err("No session with that id is held for the caller."),
                    "409": _err("The session is running a request; retry once it finished."),
                },
            }
        },
        "/api/models/{model_id}/benchmark": {
            "post": {
                "tags": ["admin"],
                "summary": "Measure prefill and decode speed alone on the drained engine "
                "(an exclusive operation); query: prompt_tokens, n_predict",
                "parameters": [MODEL_ID_PARAM],
                "responses": {
                    "200": _ok(
                        "`{model, prompt_tokens_per_s, predicted_tokens_per_s, ...}`",
                        {"type": "object"},
                    ),
                    "400": _err("prompt_tokens or n_predict out of range."),
                    "401": E401,
                    "403": E403,
                    "404": E404_MODEL,
                    "409": E409,
                    "503": E503,
                },
            }
        },
        "/api/models/{model_id}/calibrate": {
            "post": {
                "tags": ["admin"],
                "summary": "Run the co-batch calibration now (an exclusive operation)",
                "parameters": [MODEL_ID_PARAM],
                "responses": {
                    "200": _ok(
                        "`{model, verdict, crashed, prompts_tried, distinct_answers, "
                        "admission_ceiling, ...}`",
                        {"type": "object"},
                    ),
                    "400": _err("The model is served by an external engine."),
                    "401": E401,
                    "403": E403,
                    "404": E404_MODEL,
                    "409": E409,
                    "503": E503,
                },
            }
        },
    }
    for op in ("completion", "tokenize", "detokenize", "props", "slots"):
        paths[f"/{op}"] = _native(op, prefixed=False)
        paths[f"/upstream/{{model}}/{op}"] = _native(op, prefixed=True)
    paths.update(_dialect_paths())
    paths.update(_ollama_paths())
    paths.update(_image_paths())
    for alias, same in ALIASES.items():
        paths[alias] = copy.deepcopy(paths[same])

    return {
        "openapi": "3.1.0",
        "info": {
            "title": "gezel-trio",
            "version": __version__,
            "description": (
                "A local LLM inference host. Errors use OpenAI's shape "
                '`{"error": {"message", "type", "param", "code"}}`. '
                "Any route answers 405 to a method it does not serve and 500 to a bug."
            ),
        },
        "servers": [{"url": "http://127.0.0.1:8080"}],
        "security": [{"bearerAuth": []}],
        "paths": paths,
        "components": {
            "securitySchemes": {
                "bearerAuth": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "Needed when `[server] api_keys` is set; admin key for `/api/*`",
                }
            },
            "schemas": SCHEMAS,
        },
    }


_LOOSE = {"additionalProperties": True}

SCHEMAS: dict[str, Any] = {
    "LooseRequest": {"type": "object", **_LOOSE, "properties": {"model": {"type": "string"}}},
    "MessagesRequest": {
        "type": "object",
        "required": ["model", "max_tokens", "messages"],
        **_LOOSE,
        "properties": {
            "model": {"type": "string"},
            "max_tokens": {"type": "integer", "minimum": 1},
            "messages": {"type": "array", "minItems": 1, "items": {"type": "object"}},
            "system": {"type": ["string", "array"]},
            "stream": {"type": "boolean"},
            "metadata": {"type": "object"},
        },
    },
    "ResponsesRequest": {
        "type": "object",
        "required": ["input"],
        **_LOOSE,
        "properties": {
            "model": {"type": "string"},
            "input": {"type": ["string", "array"]},
            "instructions": {"type": "string"},
            "stream": {"type": "boolean"},
            "max_output_tokens": {"type": "integer", "minimum": 1},
            "prompt_cache_key": {"type": "string", "maxLength": 512},
        },
    },
    "InfillRequest": {
        "type": "object",
        **_LOOSE,
        "properties": {
            "model": {"type": "string"},
            "input_prefix": {"type": "string"},
            "input_suffix": {"type": "string"},
            "input_extra": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"filename": {"type": "string"}, "text": {"type": "string"}},
                },
            },
            "prompt": {"type": "string"},
            "n_predict": {"type": "integer", "minimum": -1},
            "t_max_prompt_ms": {"type": "integer"},
            "t_max_predict_ms": {"type": "integer"},
            "stream": {"type": "boolean"},
        },
    },
    "RerankRequest": {
        "type": "object",
        "required": ["query", "documents"],
        **_LOOSE,
        "properties": {
            "model": {"type": "string"},
            "query": {"type": "string"},
            "documents": {"type": "array", "minItems": 1},
            "top_n": {"type": "integer", "minimum": 1},
        },
    },
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "integer", "null"]},
                },
            }
        },
    },
    "ChatCompletionRequest": {
        "type": "object",
        "required": ["messages"],
        **_LOOSE,
        "properties": {
            "model": {"type": "string"},
            "messages": {"type": "array", "minItems": 1, "items": {"type": "object"}},
            "stream": {"type": "boolean"},
            "stream_options": {
                "type": "object",
                "properties": {"include_usage": {"type": "boolean"}},
            },
            "prompt_cache_key": {"type": "string", "maxLength": 512},
            "max_tokens": {"type": "integer", "minimum": 0},
            "temperature": {"type": "number", "minimum": 0},
        },
    },
    "CompletionRequest": {
        "type": "object",
        "required": ["prompt"],
        **_LOOSE,
        "properties": {
            "model": {"type": "string"},
            "prompt": {"oneOf": [{"type": "string"}, {"type": "array"}]},
            "stream": {"type": "boolean"},
            "stream_options": {
                "type": "object",
                "properties": {"include_usage": {"type": "boolean"}},
            },
            "prompt_cache_key": {"type": "string", "maxLength": 512},
            "max_tokens": {"type": "integer", "minimum": 0},
        },
    },
    "ImageGenerationRequest": {
        "type": "object",
        "required": ["prompt"],
        **_LOOSE,
        "properties": {
            "model": {"type": "string"},
            "prompt": {"type": "string"},
            "n": {"type": "integer", "minimum": 1, "maximum": 10},
            "size": {"type": "string", "description": "WIDTHxHEIGHT, or auto"},
            "response_format": {"enum": ["b64_json"]},
            "output_format": {"enum": ["png", "jpeg", "webp"]},
            "output_compression": {"type": "integer", "minimum": 0, "maximum": 100},
            "steps": {"type": "integer", "minimum": 1, "description": "extension"},
            "seed": {"type": "integer", "description": "extension"},
            "negative_prompt": {"type": "string", "description": "extension"},
        },
    },
    "EmbeddingRequest": {
        "type": "object",
        "required": ["input"],
        **_LOOSE,
        "properties": {
            "model": {"type": "string"},
            "input": {"oneOf": [{"type": "string"}, {"type": "array"}]},
            "encoding_format": {"enum": ["float", "base64"]},
        },
    },
    "NativeCompletionRequest": {
        "type": "object",
        **_LOOSE,
        "properties": {
            "model": {"type": "string"},
            "prompt": {"oneOf": [{"type": "string"}, {"type": "array"}]},
            "n_predict": {"type": "integer", "minimum": -1},
            "stream": {"type": "boolean"},
            "prompt_cache_key": {"type": "string", "maxLength": 512},
            "id_slot": {"type": "integer", "description": "Ignored: the scheduler pins the slot."},
        },
    },
    "TokenizeRequest": {
        "type": "object",
        "required": ["content"],
        **_LOOSE,
        "properties": {
            "model": {"type": "string"},
            "content": {"type": "string"},
            "add_special": {"type": "boolean"},
            "parse_special": {"type": "boolean"},
            "with_pieces": {"type": "boolean"},
        },
    },
    "DetokenizeRequest": {
        "type": "object",
        "required": ["tokens"],
        **_LOOSE,
        "properties": {
            "model": {"type": "string"},
            "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        },
    },
    "Model": {
        "type": "object",
        "required": ["id", "object", "created", "owned_by", "state"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"enum": ["gezel-trio", "external"]},
            "state": {"enum": ["stopped", "starting", "ready", "stopping", "failed"]},
            "capabilities": {
                "type": "array",
                "items": {"enum": ["completion", "tools", "embedding"]},
                "description": "In the list: `tools` when the model's chat template renders "
                "tools (the engine's `chat_template_caps`).",
            },
        },
    },
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": _ref("Model")},
        },
    },
    "ConfigPatch": {
        "type": "object",
        "additionalProperties": False,
        "minProperties": 1,
        "description": "Any subset; validated whole before anything is applied.",
        "properties": {
            "policy": {"enum": ["auto", "coexist", "swap"]},
            "temp_limit_c": {"type": "number", "minimum": 1, "maximum": 150},
            "temp_margin_c": {
                "type": "number",
                "minimum": 0,
                "description": "Must stay below temp_limit_c.",
            },
            "lock_model": {"type": "boolean"},
            "log_level": {"enum": ["debug", "info", "warning", "error"]},
        },
    },
}

_OLLAMA_KEEP_ALIVE = {
    "type": ["number", "string"],
    "description": "Seconds, or a Go duration (`5m`, `1h30m`): 0 unloads the model after "
    "this request, a duration is its idle TTL from then on, a negative value keeps it "
    "loaded. Without it the model's configured `idle_ttl` applies.",
}
_OLLAMA_OPTIONS = {
    "type": "object",
    "description": "`num_predict`, `temperature`, `top_k`, `top_p`, `min_p`, `typical_p`, "
    "`seed`, `stop`, `repeat_penalty`, `repeat_last_n`, `presence_penalty`, "
    "`frequency_penalty`, `num_keep`, `mirostat*`; `num_ctx` is served with the model's "
    "`ctx_per_slot`, and `num_predict` above it is lowered to it (never a 400). Other "
    "options are ignored, as Ollama ignores them.",
}
_OLLAMA_FORMAT = {
    "description": '`"json"`, or a JSON schema the answer must match.',
}
_OLLAMA_THINK = {
    "type": ["boolean", "string"],
    "enum": [True, False, "low", "medium", "high", "max"],
}
_OLLAMA_MODEL = {"type": "string", "description": "A model id; `id:latest` names it too."}
_OLLAMA_DURATIONS = {
    "total_duration": {"type": "integer", "description": "Nanoseconds, the host's wall time."},
    "load_duration": {
        "type": "integer",
        "description": "Nanoseconds spent waiting for the engine to start (absent: it was loaded).",
    },
    "prompt_eval_count": {"type": "integer"},
    "prompt_eval_duration": {"type": "integer"},
    "eval_count": {"type": "integer"},
    "eval_duration": {"type": "integer"},
}

OLLAMA_SCHEMAS: dict[str, Any] = {
    "OllamaError": {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"type": "string"}},
    },
    "OllamaChatRequest": {
        "type": "object",
        "required": ["model"],
        **_LOOSE,
        "properties": {
            "model": _OLLAMA_MODEL,
            "messages": {
                "type": "array",
                "description": "Empty or absent: only load the model (or unload it with "
                "`keep_alive` 0).",
                "items": {"type": "object"},
            },
            "tools": {"type": "array", "items": {"type": "object"}},
            "format": _OLLAMA_FORMAT,
            "options": _OLLAMA_OPTIONS,
            "stream": {"type": "boolean", "default": True},
            "think": _OLLAMA_THINK,
            "keep_alive": _OLLAMA_KEEP_ALIVE,
        },
    },
    "OllamaGenerateRequest": {
        "type": "object",
        "required": ["model"],
        **_LOOSE,
        "properties": {
            "model": _OLLAMA_MODEL,
            "prompt": {"type": "string"},
            "suffix": {"type": "string"},
            "system": {"type": "string"},
            "raw": {"type": "boolean"},
            "images": {"type": "array", "items": {"type": "string", "contentEncoding": "base64"}},
            "format": _OLLAMA_FORMAT,
            "options": _OLLAMA_OPTIONS,
            "stream": {"type": "boolean", "default": True},
            "think": _OLLAMA_THINK,
            "keep_alive": _OLLAMA_KEEP_ALIVE,
        },
    },
    "OllamaEmbedRequest": {
        "type": "object",
        "required": ["model"],
        **_LOOSE,
        "properties": {
            "model": _OLLAMA_MODEL,
            "input": {
                "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]
            },
            "dimensions": {"type": "integer", "minimum": 1},
            "truncate": {"type": "boolean"},
            "options": _OLLAMA_OPTIONS,
            "keep_alive": _OLLAMA_KEEP_ALIVE,
        },
    },
    "OllamaEmbeddingsRequest": {
        "type": "object",
        "required": ["model"],
        **_LOOSE,
        "properties": {
            "model": _OLLAMA_MODEL,
            "prompt": {"type": "string"},
            "options": _OLLAMA_OPTIONS,
            "keep_alive": _OLLAMA_KEEP_ALIVE,
        },
    },
    "OllamaShowRequest": {
        "type": "object",
        "required": ["model"],
        **_LOOSE,
        "properties": {"model": _OLLAMA_MODEL, "verbose": {"type": "boolean"}},
    },
    "OllamaAnswer": {
        "type": "object",
        "required": ["model", "created_at", "done"],
        "properties": {
            "model": {"type": "string"},
            "created_at": {"type": "string", "format": "date-time"},
            "message": {
                "type": "object",
                "description": "`/api/chat`: `role`, `content`, `thinking`, `tool_calls`.",
            },
            "response": {"type": "string", "description": "`/api/generate`."},
            "thinking": {"type": "string"},
            "done": {"type": "boolean"},
            "done_reason": {"enum": ["stop", "length", "load", "unload"]},
            **_OLLAMA_DURATIONS,
        },
    },
    "OllamaEmbedAnswer": {
        "type": "object",
        "required": ["model", "embeddings"],
        "properties": {
            "model": {"type": "string"},
            "embeddings": {
                "type": "array",
                "items": {"type": "array", "items": {"type": "number"}},
            },
            "total_duration": _OLLAMA_DURATIONS["total_duration"],
            "load_duration": _OLLAMA_DURATIONS["load_duration"],
            "prompt_eval_count": {"type": "integer"},
        },
    },
    "OllamaEmbeddingsAnswer": {
        "type": "object",
        "required": ["embedding"],
        "properties": {"embedding": {"type": "array", "items": {"type": "number"}}},
    },
    "OllamaShow": {
        "type": "object",
        "properties": {
            "modelfile": {"type": "string"},
            "parameters": {"type": "string"},
            "template": {"type": "string", "description": "The model's own (Jinja) template."},
            "details": {"type": "object"},
            "model_info": {"type": "object"},
            "capabilities": {"type": "array", "items": {"type": "string"}},
            "modified_at": {"type": "string", "format": "date-time"},
        },
    },
    "OllamaModels": {
        "type": "object",
        "required": ["models"],
        "properties": {
            "models": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "model": {"type": "string"},
                        "size": {"type": "integer"},
                        "digest": {"type": "string"},
                        "details": {"type": "object"},
                        "modified_at": {"type": "string", "format": "date-time"},
                        "expires_at": {"type": "string", "format": "date-time"},
                        "size_vram": {"type": "integer"},
                        "context_length": {"type": "integer"},
                        "capabilities": {"type": "array", "items": {"type": "string"}},
                    },
                },
            }
        },
    },
    "OllamaVersion": {
        "type": "object",
        "required": ["version"],
        "properties": {"version": {"type": "string"}},
    },
}
SCHEMAS.update(OLLAMA_SCHEMAS)

_SPEC = _build_spec()


def openapi_spec() -> dict[str, Any]:
    """A fresh copy of the document."""
    return copy.deepcopy(_SPEC)


@bp.get("/openapi.json")
async def openapi_json() -> Response:
    return json_response(_SPEC)
