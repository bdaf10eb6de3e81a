"""`k3chat serve`: the local engine behind an OpenAI-compatible HTTP API (design 6).

- ``protocol``: request bodies checked and turned into engine work, OpenAI-style errors;
- ``pool``: saved engine states for prefix reuse across requests, within a byte budget;
- ``worker``: the one engine thread, its fair (first come, first served) queue, the
  generation loop over the chat core's template, sampler and stream parser;
- ``app``: the Starlette routes (chat completions, completions, models, health), the API
  key check, server-sent events;
- ``serve``: the command (opening the model through the runtime, binding, signals).

Nothing here is imported unless `k3chat serve` runs: without it k3chat opens no socket.
"""
