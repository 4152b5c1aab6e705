"""OpenAI's ``POST /v1/images/edits``: a multipart form (``image[]`` or ``image``,
``mask``, ``prompt``, ``n``, ``size``, ``output_format``, ``response_format``,
``model``), translated by :mod:`.images_edits_translate` into sd-server's native job and
rendered by ``Host.render``; the answer is OpenAI's images object with ``b64_json``.
Authenticated like every model route; errors in OpenAI's shape.
"""

from __future__ import annotations

import trio
from quart import Blueprint, Response, request

from ..errors import BadRequest
from ..host import Host
from .errors import json_response
from .exchange import current_exchange
from .images_edits_translate import edit_answer, edit_request
from .rendering import image_model, render

__all__ = ["bp"]

bp = Blueprint("images_edits", __name__)


@bp.post("/v1/images/edits")
async def edits() -> Response:
    """Cancellation (the client left) cancels the render."""
    host: Host = current_exchange().host
    if not (request.content_type or "").startswith("multipart/form-data"):
        raise BadRequest(
            "Content-Type must be multipart/form-data, with the image in image[] (or image)"
        )
    form = await request.form
    uploads = await request.files
    fields = {key: form.get(key, "") for key in form}

    def read_uploads() -> dict[str, list[bytes]]:  # spooled to disk when large
        return {key: [part.read() for part in uploads.getlist(key)] for key in uploads}

    files = await trio.to_thread.run_sync(read_uploads)
    translated = edit_request(fields, files)
    model = image_model(host, translated.model)
    result = await render(host, model, translated.job)
    return json_response(edit_answer(result))
