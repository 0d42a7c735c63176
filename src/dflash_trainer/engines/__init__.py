"""Real serving engines for an exported drafter: llama.cpp's ``llama-server`` and vLLM (CPU).

Used by ``dflash-trainer eval --engine`` (tau per domain of each engine beside the project's own
loop) and by ``tools/serve_check.py`` (the serving check). One job per module:

- :mod:`~dflash_trainer.engines.llama_cpp_build`: the cached CPU build of ``llama-server``;
- :mod:`~dflash_trainer.engines.llama_cpp_server`: GGUF conversion, server command, requests;
- :mod:`~dflash_trainer.engines.serve_llama_cpp`: plain and speculative servers, alternating pairs;
- :mod:`~dflash_trainer.engines.vllm_env`: the separate, cached virtualenv holding vLLM;
- :mod:`~dflash_trainer.engines.vllm_server`: one vLLM server, always stopped by process group;
- :mod:`~dflash_trainer.engines.serve_vllm`: the drafter and the plain vLLM server on the same prompts;
- :mod:`~dflash_trainer.engines.compare`: acceptance per domain of each engine, its table, and
  the engine runs of ``eval --engine``.

Nothing here imports torch at module level; the engines run in their own processes.
"""
