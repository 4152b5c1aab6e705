"""The engine: llama-server as a supervised process or an external endpoint
(:mod:`.supervisor`, :mod:`.process`, :mod:`.health`, :mod:`.external`), its command
line (:mod:`.argv`, :mod:`.flags`), binary (:mod:`.binary`, :mod:`.build`), model files
(:mod:`.gguf_meta`, :mod:`.arch`, :mod:`.demo_model`, :mod:`.planner`), and every HTTP
call to it (:mod:`.client`, :mod:`.sse`, :mod:`.assemble`, :mod:`.calibrate`)."""
