"""The benchmark harness: replay agentic traces against endpoints and compare them.

- :mod:`.traces`: the native ``gezel-trace`` format, Weka and Mooncake importers,
  scaling for small machines, block-level oracles;
- :mod:`.synth`: token-array prompts that keep the trace's prefix sharing exactly;
- :mod:`.replay`: open/closed-loop replay with Trio and a streaming httpx client;
- :mod:`.metrics`: vLLM/SGLang-named metrics plus cache, oracle and fairness figures;
- :mod:`.report`: JSON, Markdown and PNG reports; :mod:`.targets`: launch recipes;
- :mod:`.cli`: ``gezel-trio bench`` (:func:`.cli.add_bench_arguments`,
  :func:`.cli.run_bench`).

Submodules are imported on use; importing this package loads nothing heavy.
"""
