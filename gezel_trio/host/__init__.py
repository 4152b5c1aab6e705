"""The host: every component, opened from the outside in, and how a request runs.

:mod:`.host` holds ``open_host`` and :class:`Host`; :mod:`.catalog` the models
served (open, retire, reconfigure, reload, a models folder); :mod:`.runtime` a
model as the scheduler sees it; :mod:`.placement` an engine's binary, argv and
memory reservation; :mod:`.completion` the completion service (a slot for a
request's owner, sent pinned, resent before its first byte, assembled);
:mod:`.limits` what a request that overshoots a limit is served instead;
:mod:`.capabilities` what a model can do, as clients are told;
:mod:`.calibration` the co-batch verdicts; :mod:`.watchers` memory pressure and
device health; :mod:`.activity` the request series of the status page;
:mod:`.snapshot` the typed host snapshot; :mod:`.metrics` the Prometheus collector.
"""

from __future__ import annotations

from gezel_trio.host.host import Host, open_host
from gezel_trio.host.placement import EngineResolver
from gezel_trio.host.runtime import ModelRuntime

__all__ = ["EngineResolver", "Host", "ModelRuntime", "open_host"]
