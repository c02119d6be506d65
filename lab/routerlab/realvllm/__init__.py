"""Real vLLM (CPU build) beside the simulator: a tiny offline model, a fleet launcher and a
fidelity check that replays one token-id trace against both and compares prefix-cache counters.

Nothing here imports vLLM, torch or transformers at import time: vLLM runs in its own venv
(see docs/fidelity.md) and is only ever started as a subprocess.

- :mod:`routerlab.realvllm.tiny_model` -- make a tiny random-weight Llama model directory
  (run it with the vLLM venv's python, it needs torch/transformers/tokenizers).
- :mod:`routerlab.realvllm.fleet` -- :class:`~routerlab.realvllm.fleet.VllmFleet`, N real
  vLLM CPU servers on loopback ports; :mod:`routerlab.realvllm.launcher` is its command line,
  :mod:`routerlab.realvllm.procs` the OS-side checks (free ports, RSS, log tails).
- :mod:`routerlab.realvllm.trace` -- the deterministic token-id trace and a reference model of
  vLLM's prefix cache (pure Python, tested in CI).
- :mod:`routerlab.realvllm.fidelity` -- real vLLM vs simulator, request by request.
- :mod:`routerlab.realvllm.promtext` -- small HTTP/Prometheus helpers (stdlib only).
"""
