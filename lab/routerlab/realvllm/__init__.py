"""Real vLLM (CPU build) beside the simulator: a tiny offline model, a fleet launcher, a
fidelity check that replays one token-id trace against both and compares prefix-cache counters,
and the KV-cache event tooling that checks the simulator's events and precise mode against vLLM's.

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
- :mod:`routerlab.realvllm.event_recorder` -- record every raw KV-cache event frame N publishers send.
- :mod:`routerlab.realvllm.event_capture` -- real vLLM event streams as CI fixtures
  (tests/fixtures/vllm_kv_events, replayed by tests/test_vllm_captures.py).
- :mod:`routerlab.realvllm.event_fidelity` -- the simulator's events vs real vLLM's, by block content.
- :mod:`routerlab.realvllm.chat_trace` -- the seeded multi-turn chat trace of the end-to-end check.
- :mod:`routerlab.realvllm.precise_e2e` -- precise mode behind Envoy in front of real vLLM: the
  router's view against vLLM's usage, request by request.
"""
